//! Every generation endpoint through real Envoy (issue 14): OpenAI's `/v1/completions` and
//! SGLang's `/generate` take the same bucket-first path as chat — plain and PD, streamed and not,
//! buckets chosen by exact token-id length — and `GET /v1/models/{id}` answers in OpenAI's shape.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};

/// Two plain buckets: `short` (up to 100 input tokens) on A, `long` on B; the model serves
/// `/generate`.
fn two_buckets(name: &str) -> Deployment {
    let d = Deployment::start(name, vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        json!({
            "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
            "load": {"interval_ms": 100, "stale_after_ms": 1000},
            "health": {"interval_ms": 200, "timeout_ms": 150},
            "models": {"demo-model": {"serve_generate": true, "buckets": [
                {"id": "short", "limits": {"max": 100}, "groups": {"plain": {"worker_ids": ["A"], "policy": {"type": "round_robin"}}}},
                {"id": "long", "limits": {"min": 101, "max": 100000}, "groups": {"plain": {"worker_ids": ["B"], "policy": {"type": "round_robin"}}}}
            ]}}
        })
    });
    d.wait_for_service(2);
    d
}

fn post(d: &Deployment, path: &str, body: &Value) -> Reply {
    send(&d.envoy.url(path), "POST", Some(body), &[])
}

fn last_path(sim: &Sim) -> String {
    sim.state()["recent"]
        .as_array()
        .and_then(|r| r.last())
        .map(|r| r["path"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

#[test]
fn completions_are_routed_by_the_same_buckets_plain_and_streamed() {
    let d = two_buckets("completions");
    let r = post(&d, "/v1/completions", &json!({"model": "demo-model", "prompt": "say hi", "max_tokens": 3}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("short"), "A"));
    assert_eq!(r.json()["object"], "text_completion");
    assert_eq!(r.json()["choices"][0]["text"], "tok0 tok1 tok2 ");
    assert_eq!(last_path(d.sim("A")), "/v1/completions");

    // 150 token ids are 150 tokens, however few bytes they take.
    let ids: Vec<u32> = (1..=150).collect();
    let r =
        post(&d, "/v1/completions", &json!({"model": "demo-model", "prompt": ids, "max_tokens": 2, "stream": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("long"), "B"));
    assert!(
        r.body.contains("\"object\":\"text_completion\"") && r.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        r.body
    );

    let r = post(&d, "/v1/completions", &json!({"model": "demo-model", "prompt": []}));
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (400, Some("invalid_request")), "{}", r.body);
    let r = post(&d, "/v1/completions", &json!({"model": "gpt-4", "prompt": "x"}));
    assert_eq!(r.status, 404, "{}", r.body);
}

#[test]
fn generate_serves_the_configured_model_by_text_or_input_ids() {
    let d = two_buckets("generate");
    let r =
        post(&d, "/generate", &json!({"text": "the capital of France is", "sampling_params": {"max_new_tokens": 4}}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("short"), "A"));
    assert_eq!(r.json()["text"], "tok0 tok1 tok2 tok3 ");
    assert_eq!(last_path(d.sim("A")), "/generate");

    let ids: Vec<u32> = (1..=101).collect();
    let r = post(&d, "/generate", &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "stream": true}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("long"), "B"));
    assert!(r.body.contains("\"text\":\"tok0 tok1 \""), "{}", r.body);

    // A batch is one request to one engine, bucketed by its longest prompt.
    let r = post(
        &d,
        "/generate",
        &json!({"input_ids": [[1, 2], (1..=120).collect::<Vec<u32>>()], "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!((r.status, r.header("x-sgl-bucket")), (200, Some("long")), "{}", r.body);
    assert_eq!(r.json().as_array().map(Vec::len), Some(2), "{}", r.body);

    let r = post(&d, "/generate", &json!({"text": "x", "input_ids": [1]}));
    assert_eq!(r.status, 400, "{}", r.body);
    let r = send(&d.envoy.url("/generate"), "GET", None, &[]);
    assert_eq!((r.status, r.header("allow")), (405, Some("POST")));
}

/// `sglang.bench_serving --backend sglang` posts to `/generate`: a router with one model serves it
/// there without `serve_generate`; with several, none marked is a 404.
#[test]
fn generate_serves_the_only_model_and_models_are_retrieved_by_id() {
    let d = Deployment::start("models_by_id", vec![SimSpec::plain("A")], |sims| {
        let mut router = plain_router(sims);
        router["models"]["other-model"] = router["models"]["demo-model"].clone();
        router
    });
    d.wait_for_service(1);
    let r = post(&d, "/generate", &json!({"text": "hi"}));
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("model_not_found")), "{}", r.body);
    let one = Deployment::start("generate_one_model", vec![SimSpec::plain("A")], plain_router);
    one.wait_for_service(1);
    let r = post(&one, "/generate", &json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}}));
    assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("A")), "{}", r.body);
    assert_eq!(last_path(one.sim("A")), "/generate");

    let r = send(&d.envoy.url("/v1/models/demo-model"), "GET", None, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json(), json!({"id": "demo-model", "object": "model", "created": 0, "owned_by": "sgl-envoy-router"}));
    let r = send(&d.envoy.url("/v1/models/gpt-4"), "GET", None, &[]);
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("model_not_found")), "{}", r.body);
}

#[test]
fn generate_in_pd_sends_the_bootstrap_fields_and_the_prefill_to_generate() {
    let d = Deployment::start("generate_pd", vec![SimSpec::prefill("P1"), SimSpec::decode("D1")], |sims| {
        let mut router = pd_router(sims, &[("only", 0, 100_000, 200_000, &["P1"], &["D1"])]);
        router["models"]["demo-model"]["serve_generate"] = json!(true);
        router
    });
    d.wait_for_service(2);
    for stream in [false, true] {
        let r = post(
            &d,
            "/generate",
            &json!({"text": "prefill me", "sampling_params": {"max_new_tokens": 3}, "stream": stream}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!((r.header("x-sgl-prefill-worker"), r.header("x-sgl-worker")), (Some("P1"), Some("D1")));
        let (p, dec) = (d.sim("P1").state(), d.sim("D1").state());
        let (p, dec) = (
            p["recent"].as_array().unwrap().last().unwrap().clone(),
            dec["recent"].as_array().unwrap().last().unwrap().clone(),
        );
        assert_eq!((p["path"].as_str(), dec["path"].as_str()), (Some("/generate"), Some("/generate")));
        assert_eq!(p["bootstrap_room"], dec["bootstrap_room"]);
        assert!(p["bootstrap_room"].is_u64(), "{p}");
    }
    let r = post(&d, "/v1/completions", &json!({"model": "demo-model", "prompt": "pd too", "max_tokens": 2}));
    assert_eq!((r.status, r.header("x-sgl-prefill-worker")), (200, Some("P1")), "{}", r.body);
    assert_eq!(last_path(d.sim("P1")), "/v1/completions");
}

#[test]
fn the_official_openai_client_works_unchanged() {
    let d = two_buckets("openai_client");
    let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
model = client.models.retrieve("demo-model")
listed = [m.id for m in client.models.list()]
completion = client.completions.create(model="demo-model", prompt="say hi", max_tokens=3)
streamed = "".join(c.choices[0].text for c in client.completions.create(model="demo-model", prompt="say hi", max_tokens=2, stream=True) if c.choices)
chat = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
try:
    client.models.retrieve("gpt-4")
    missing = "found"
except Exception as e:
    missing = type(e).__name__
print(json.dumps({"model": model.id, "listed": listed, "completion": completion.choices[0].text, "streamed": streamed,
                  "chat": chat.choices[0].message.content, "missing": missing}))
"#;
    let python = repo_root().join(".venv/bin/python");
    let out = std::process::Command::new(python)
        .args(["-c", script, &d.envoy.url("/v1")])
        .output()
        .expect("the project's Python (scripts/setup installs openai into .venv)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model"], "demo-model");
    assert_eq!(v["listed"], json!(["demo-model"]));
    assert_eq!(v["completion"], "tok0 tok1 tok2 ");
    assert_eq!(v["streamed"], "tok0 tok1 ");
    assert_eq!(v["chat"], "tok0 tok1 ");
    assert_eq!(v["missing"], "NotFoundError");
}

#[test]
fn every_metric_the_grafana_dashboard_reads_is_one_envoy_exports() {
    let d = two_buckets("dashboard_metrics");
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = json!({"model": "demo-model", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        assert_eq!(post(&d, path, &body).status, 200);
    }
    let exported = d.envoy.admin("/stats/prometheus");
    let dashboard = std::fs::read_to_string(repo_root().join("deploy/grafana/sgl-envoy-router.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&dashboard).unwrap();
    let mut names: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .flat_map(|expr| {
            expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("sgl_router_"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 10, "{names:?}");
    // Counted only when their event happens (a rejection, an indexer answer, failover or notice, a
    // retry, an abort, a wait in the queue; `e2e_replicas`, `e2e_live` and `e2e_queue` see those
    // exported).
    let on_events = [
        "sgl_router_queue_depth",
        "sgl_router_queue_rejections_total",
        "sgl_router_queue_wait_ms_bucket",
        "sgl_router_admission_rejections_total",
        "sgl_router_prefix_lookups_total",
        "sgl_router_indexer_queries_total",
        "sgl_router_indexer_failovers_total",
        "sgl_router_indexer_notices_total",
        "sgl_router_retries_total",
        "sgl_router_aborts_total",
    ];
    for name in names.iter().filter(|n| !on_events.contains(&n.as_str())) {
        assert!(
            exported.lines().any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))),
            "{name} is not exported"
        );
    }
}
