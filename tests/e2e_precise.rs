//! Precise prefix routing through real Envoy (spec §7): the filter asks `sgl-indexer` once per
//! request; exact token counts choose the bucket where the byte estimate would choose another; a
//! stopped indexer costs nothing but precision (the estimate returns, no request fails or waits
//! past the timeout), and precision returns with it. Engines' own events steer requests (a
//! CPU-held prefix counting below a GPU-held one), and a burst sharing a new prefix stays together.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn precise_router(sims: &[Sim], indexer_port: u16) -> Value {
    let tok = tokenizer_dir();
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "health": {"interval_ms": 200, "timeout_ms": 150, "failure_threshold": 2, "success_threshold": 1},
        "prefix_index": {"url": format!("http://127.0.0.1:{indexer_port}"), "timeout_ms": 200},
        "models": {"demo-model": {
            "tokenizer": tok.join("tokenizer.json"),
            "chat_template": tok.join("tokenizer_config.json"),
            "buckets": [
                {"id": "short", "limits": {"max": 64}, "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}},
                {"id": "long", "limits": {"max": 100000}, "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}
            ]
        }}
    })
}

/// Thai, a script the project's tokenizer saw none of: 3 bytes a character, so the byte estimate
/// (4 bytes a token) says 60 tokens where the byte-level tokenizer spends 112 (checked against
/// `sgl-indexer`'s own count below).
fn thai_prompt() -> String {
    "กขฃคฅฆงจฉช".repeat(8)
}

#[test]
fn exact_tokens_choose_the_bucket_and_a_stopped_indexer_costs_only_precision() {
    let indexer_port = free_port();
    let d = Deployment::start("precise_buckets", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        precise_router(sims, indexer_port)
    });
    let body = chat_body(&thai_prompt(), 4, false);
    // 240 bytes of text: 60 tokens by the estimate, the short bucket.
    let before = d.chat(&body);
    assert_eq!((before.status, before.header("x-sgl-bucket")), (200, Some("short")), "{}", before.body);

    let mut indexer = start_indexer(&d.dir, indexer_port);
    let counted = send(&format!("http://127.0.0.1:{indexer_port}/v1/prefix/match"), "POST", Some(&body), &[]);
    let exact_tokens = counted.json()["input_tokens"].as_u64().unwrap();
    assert!(exact_tokens > 64, "the premise: the tokenizer counts {exact_tokens}");
    let exact = d.chat(&body);
    assert_eq!((exact.status, exact.header("x-sgl-bucket")), (200, Some("long")), "{}", exact.body);

    // The indexer dies mid-load: every request still succeeds, none waits past the timeout.
    indexer.stop();
    for _ in 0..10 {
        let started = Instant::now();
        let r = d.chat(&body);
        assert_eq!((r.status, r.header("x-sgl-bucket")), (200, Some("short")), "{}", r.body);
        assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
    }
    let _indexer = start_indexer(&d.dir, indexer_port);
    wait_for("precise routing to resume", Duration::from_secs(10), || {
        (d.chat(&body).header("x-sgl-bucket") == Some("long")).then_some(())
    });
    // Nothing is cached (no engine publishes events here): answered lookups are misses, the ones
    // while the indexer was down unavailable, and the two are counted apart.
    for result in ["miss", "unavailable"] {
        let sample = format!("sgl_router_prefix_lookups_total{{result=\"{result}\"}}");
        assert!(d.envoy.metric(&sample).unwrap_or(0.0) >= 1.0, "{sample}");
    }
}

/// Engines that tokenize with the project's tokenizer and publish KV events, SGLang-style.
fn publishing(id: &str) -> (SimSpec, u16, u16) {
    let (events, replay) = (free_port(), free_port());
    let tok = tokenizer_dir();
    let spec = SimSpec {
        extra: vec![
            "--tokenizer".into(),
            tok.join("tokenizer.json").to_string_lossy().into_owned(),
            "--kv-events".into(),
            format!("tcp://127.0.0.1:{events}"),
            "--kv-events-replay".into(),
            format!("tcp://127.0.0.1:{replay}"),
        ],
        ..SimSpec::plain(id)
    };
    (spec, events, replay)
}

fn system_prompt() -> String {
    "You are the support assistant of a model router. Explain buckets, prefill, decode and caches plainly. ".repeat(12)
}

fn ask(question: &str) -> Value {
    json!({"model": "demo-model", "max_tokens": 4, "stream": false,
           "messages": [{"role": "system", "content": system_prompt()}, {"role": "user", "content": question}]})
}

/// Two publishing engines, A and B, routed by `source: remote` with a 64-token minimum hit.
fn two_publishing(name: &str, indexer_port: u16, a: (SimSpec, u16, u16), b: (SimSpec, u16, u16)) -> Deployment {
    let ports = [(a.1, a.2), (b.1, b.2)];
    Deployment::start(name, vec![a.0, b.0], |sims| {
        let mut router = precise_router(sims, indexer_port);
        for (w, (events, replay)) in ports.iter().enumerate() {
            router["workers"][w]["kv_events"] = json!(format!("tcp://127.0.0.1:{events}"));
            router["workers"][w]["kv_events_replay"] = json!(format!("tcp://127.0.0.1:{replay}"));
        }
        router["models"]["demo-model"]["buckets"] = json!([{"id": "all", "groups": {"plain": {"policy": {
            "type": "cache_aware", "source": "remote", "min_hit_tokens": 64}}}}]);
        router
    })
}

#[test]
fn a_prefix_held_in_cpu_memory_counts_below_one_held_in_gpu_memory() {
    let indexer_port = free_port();
    let mut b = publishing("B");
    b.0.extra.extend(["--kv-events-medium".to_string(), "CPU_PINNED".to_string()]);
    let d = two_publishing("precise_tiers", indexer_port, publishing("A"), b);
    let _indexer = start_indexer(&d.dir, indexer_port);
    let match_url = format!("http://127.0.0.1:{indexer_port}/v1/prefix/match");
    // A holds the system prompt in GPU memory; B holds it and a long question after it, in host memory.
    let question = format!("Please check this log: {}", "worker B was idle, worker A was busy. ".repeat(12));
    for (engine, body) in [("A", ask("a short one?")), ("B", ask(&question))] {
        assert_eq!(send(&d.sim(engine).url("/v1/chat/completions"), "POST", Some(&body), &[]).status, 200);
    }
    let answer = wait_for("both engines' events in the index", Duration::from_secs(10), || {
        let v = send(&match_url, "POST", Some(&ask(&question)), &[]).json();
        (v["data"]["A"]["GPU"].as_u64()? > 0 && v["data"]["B"]["CPU_PINNED"].as_u64()? > 0).then_some(v)
    });
    let (a, b) = (&answer["data"]["A"], &answer["data"]["B"]);
    let (a_tokens, b_tokens) = (a["matched_tokens"].as_u64().unwrap(), b["matched_tokens"].as_u64().unwrap());
    // The premise: B's match is the longer one, but less than twice A's.
    assert!(b_tokens > a_tokens && b_tokens < 2 * a_tokens, "A {a} / B {b}");
    assert_eq!(b["GPU"], 0, "B's blocks are in host memory only: {b}");
    for i in 0..4 {
        let r = d.chat(&ask(&question));
        assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("A")), "request {i}: {}", r.body);
    }
}

#[test]
fn a_prefix_an_engine_reports_draws_its_requests_until_the_engine_drops_it() {
    let indexer_port = free_port();
    let d = two_publishing("precise_events", indexer_port, publishing("A"), publishing("B"));
    let _indexer = start_indexer(&d.dir, indexer_port);
    let match_url = format!("http://127.0.0.1:{indexer_port}/v1/prefix/match");
    // The prefix reaches B without the router: B's own events are all the indexer knows.
    let direct = send(&d.sim("B").url("/v1/chat/completions"), "POST", Some(&ask("what is a bucket?")), &[]);
    assert_eq!(direct.status, 200, "{}", direct.body);
    wait_for("B's events in the index", Duration::from_secs(10), || {
        let v = send(&match_url, "POST", Some(&ask("anything")), &[]).json();
        (v["data"]["B"]["matched_tokens"].as_u64()? > 100).then_some(())
    });
    for i in 0..6 {
        let r = d.chat(&ask(&format!("question number {i}?")));
        assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("B")), "request {i}: {}", r.body);
    }
    let hits = d.envoy.metric("sgl_router_pick_reasons_total{stage=\"plain\",reason=\"cache_hit\"}").unwrap_or(0.0);
    assert!(hits >= 6.0, "{hits} cache hits");

    // B flushes its cache: AllBlocksCleared reaches the index, and the next request is a miss.
    assert_eq!(send(&d.sim("B").url("/flush_cache"), "POST", None, &[]).status, 200);
    wait_for("B's clear in the index", Duration::from_secs(10), || {
        let v = send(&match_url, "POST", Some(&ask("anything")), &[]).json();
        v["data"].get("B").is_none().then_some(())
    });
    let misses = |d: &Deployment| {
        d.envoy.metric("sgl_router_pick_reasons_total{stage=\"plain\",reason=\"cache_miss\"}").unwrap_or(0.0)
    };
    let before = misses(&d);
    assert_eq!(d.chat(&ask("after the flush?")).status, 200);
    assert_eq!(misses(&d), before + 1.0, "the flushed prefix no longer counts as cached on B");
}

/// Four publishing engines behind `source: remote` at the defaults (1,024-token minimum hit).
fn four_publishing(name: &str, indexer_port: u16) -> Deployment {
    let engines: Vec<(SimSpec, u16, u16)> = ["A", "B", "C", "D"].iter().map(|id| publishing(id)).collect();
    let ports: Vec<(u16, u16)> = engines.iter().map(|(_, e, r)| (*e, *r)).collect();
    Deployment::start(name, engines.into_iter().map(|(s, _, _)| s).collect(), |sims| {
        let mut router = precise_router(sims, indexer_port);
        for (w, (events, replay)) in ports.iter().enumerate() {
            router["workers"][w]["kv_events"] = json!(format!("tcp://127.0.0.1:{events}"));
            router["workers"][w]["kv_events_replay"] = json!(format!("tcp://127.0.0.1:{replay}"));
        }
        router["models"]["demo-model"]["buckets"] =
            json!([{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]);
        router
    })
}

/// A prefix no engine has seen: about 4k tokens of text unique to this run.
fn new_prefix() -> String {
    let nonce = now_unix_ms();
    (0..140).map(|i| format!("clause {i} of contract {nonce} binds the parties. ")).collect()
}

#[test]
fn a_burst_sharing_a_new_prefix_lands_on_one_engine() {
    let indexer_port = free_port();
    let d = four_publishing("precise_burst", indexer_port);
    let _indexer = start_indexer(&d.dir, indexer_port);
    d.wait_for_service(4);
    let prefix = new_prefix();
    let body = |i: usize| {
        json!({"model": "demo-model", "max_tokens": 4, "stream": false, "messages": [
            {"role": "system", "content": prefix},
            {"role": "user", "content": format!("question {i}: what does clause {i} say?")}]})
    };
    let counted = send(&format!("http://127.0.0.1:{indexer_port}/v1/prefix/match"), "POST", Some(&body(0)), &[]);
    let tokens = counted.json()["input_tokens"].as_u64().unwrap();
    assert!(tokens >= 4000, "the premise: a 4k-token prefix, got {tokens}");
    // All twenty at once, on connections of their own, so Envoy's two worker VMs share them.
    let barrier = std::sync::Barrier::new(20);
    let engines: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let (d, barrier, body) = (&d, &barrier, body(i));
                s.spawn(move || {
                    let client = agent();
                    barrier.wait();
                    let r = d.chat_on(&client, &body, &[]);
                    assert_eq!(r.status, 200, "{}", r.body);
                    r.header("x-sgl-worker").unwrap().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = &engines[0];
    let metrics = send(&format!("http://127.0.0.1:{indexer_port}/metrics"), "GET", None, &[]).body;
    let indexer: Vec<&str> = metrics.lines().filter(|l| !l.starts_with('#')).collect();
    assert!(engines.iter().all(|e| e == first), "the burst scattered: {engines:?}\n{indexer:#?}");
}

/// Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime in `.venv`) on
/// the engines' events; engines are named by integer ids, as Dynamo's `--workers` takes them.
fn start_dynamo_indexer(dir: &std::path::Path, port: u16, workers: &[(&str, u16)]) -> Process {
    let workers: Vec<String> = workers.iter().map(|(id, events)| format!("{id}=tcp://127.0.0.1:{events}")).collect();
    let mut cmd = std::process::Command::new(repo_root().join(".venv/bin/python"));
    cmd.args(["-m", "dynamo.indexer", "--block-size", "16", "--threads", "1", "--model-name", "demo-model"]).args([
        "--port",
        &port.to_string(),
        "--workers",
        &workers.join(","),
    ]);
    Process::spawn("dynamo-indexer", &mut cmd, dir.join("dynamo-indexer.log"))
}

#[test]
fn token_id_requests_route_on_dynamos_indexer() {
    let indexer_port = free_port();
    let engine = |id: &str| {
        let (mut spec, events, _replay) = publishing(id);
        spec.extra.extend(["--page-size".to_string(), "16".to_string()]);
        (spec, events)
    };
    let ((one, one_events), (two, two_events)) = (engine("1"), engine("2"));
    let d = Deployment::start("precise_dynamo", vec![one, two], |sims| {
        json!({
            "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
            "health": {"interval_ms": 200, "timeout_ms": 150, "failure_threshold": 2, "success_threshold": 1},
            "prefix_index": {"url": format!("http://127.0.0.1:{indexer_port}"), "timeout_ms": 500, "api": "dynamo"},
            "models": {"demo-model": {"serve_generate": true, "buckets": [{"id": "all", "groups": {"plain": {"policy": {
                "type": "cache_aware", "source": "remote", "min_hit_tokens": 64}}}}]}}
        })
    });
    d.wait_for_service(2);
    let mut dynamo = start_dynamo_indexer(&d.dir, indexer_port, &[("1", one_events), ("2", two_events)]);
    let query = format!("http://127.0.0.1:{indexer_port}/query");
    let through_envoy = |path: &str, body: Value| send(&d.envoy.url(path), "POST", Some(&body), &[]);
    let prefix: Vec<u32> = (1000..1320).collect();
    wait_for("Dynamo's indexer to answer", Duration::from_secs(60), || {
        assert!(dynamo.is_running(), "Dynamo's indexer exited:\n{}", dynamo.log_text());
        let probe = json!({"token_ids": [1, 2], "model_name": "demo-model"});
        agent().post(&query).header("content-type", "application/json").send(probe.to_string()).ok().map(|_| ())
    });
    // Engine 2 alone computes the prefix; only its events tell anyone.
    let direct = json!({"input_ids": prefix, "sampling_params": {"max_new_tokens": 1}});
    let r = send(&d.sim("2").url("/generate"), "POST", Some(&direct), &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    wait_for("engine 2's blocks in Dynamo's index", Duration::from_secs(20), || {
        let v = send(&query, "POST", Some(&json!({"token_ids": prefix, "model_name": "demo-model"})), &[]).json();
        (v["scores"]["2"]["0"].as_u64()? >= 300).then_some(())
    });
    let mut longer = prefix.clone();
    longer.extend(5000..5016);
    for i in 0..3 {
        let r = through_envoy("/generate", json!({"input_ids": longer, "sampling_params": {"max_new_tokens": 2}}));
        assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("2")), "request {i}: {}", r.body);
    }
    let r = through_envoy("/v1/completions", json!({"model": "demo-model", "prompt": longer, "max_tokens": 2}));
    assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("2")), "{}", r.body);
    assert!(d.envoy.metric("sgl_router_prefix_lookups_total{result=\"hit\"}").unwrap_or(0.0) >= 4.0);
    // A prompt neither engine holds goes by load, where engine 1 comes first.
    let r = through_envoy(
        "/generate",
        json!({"input_ids": (9000..9200).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 1}}),
    );
    assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("1")), "{}", r.body);
    dynamo.stop();
}
