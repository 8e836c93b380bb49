//! Hardening through real Envoy: every error a client sees is OpenAI-shaped JSON (the filter's own,
//! a wrong method, and Envoy's own replies about a dead or hung engine), and a PD prefill carries
//! the client's end-to-end headers as the decode request does.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn assert_openai_error(r: &Reply, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    assert!(r.header("content-type").is_some_and(|c| c.starts_with("application/json")), "{:?}", r.headers);
    let v = r.json();
    assert_eq!(v["error"]["type"], kind, "{}", r.body);
    assert_eq!(v["error"]["code"], status, "{}", r.body);
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", r.body);
}

#[test]
fn other_methods_on_the_chat_path_get_405_with_allow_post_and_no_server_error() {
    let d = Deployment::start("method_405", vec![SimSpec::plain("A")], plain_router);
    let url = d.envoy.url("/v1/chat/completions");
    for method in ["GET", "PUT", "DELETE"] {
        let r = send(&url, method, None, &[]);
        assert_openai_error(&r, 405, "method_not_allowed");
        assert_eq!(r.header("allow"), Some("POST"), "{method}");
    }
    let r = send(&d.envoy.url("/v1/models"), "POST", Some(&json!({})), &[]);
    assert_openai_error(&r, 405, "method_not_allowed");
    assert_eq!(r.header("allow"), Some("GET"));
    let stats = d.envoy.admin("/stats?filter=^http\\.sgl\\.downstream_rq_5xx$");
    assert_eq!(stats.trim(), "http.sgl.downstream_rq_5xx: 0", "no server error counted");
    assert_eq!(d.chat(&chat_body("still fine", 4, false)).status, 200);
}

#[test]
fn envoys_own_replies_about_a_dead_engine_are_openai_json_naming_it() {
    let mut d = Deployment::start("local_reply_dead", vec![SimSpec::plain("A")], |sims| {
        let mut router = plain_router(sims);
        // Health would take the dead engine out; this test is about the reply before it does.
        router["health"] = json!({"interval_ms": 60000, "failure_threshold": 1000});
        router
    });
    assert_eq!(d.chat(&chat_body("warm up", 4, false)).status, 200);
    d.sims[0].stop();
    let r = d.chat(&chat_body("is anyone there?", 4, false));
    assert_openai_error(&r, 503, "upstream_unavailable");
    let message = r.json()["error"]["message"].as_str().unwrap_or_default().to_string();
    let host = format!("127.0.0.1:{}", d.sims[0].port);
    assert!(message.contains(&host), "the message names the engine's address: {message}");
    assert_eq!(r.header("x-sgl-worker"), Some("A"), "and the response its id");
}

#[test]
fn a_hung_engine_gets_a_504_stream_idle_timeout_as_openai_json() {
    let d = Deployment::start("local_reply_idle", vec![SimSpec::plain("A")], |sims| {
        let mut router = plain_router(sims);
        router["timeouts"] = json!({"stream_idle_ms": 1000});
        router
    });
    d.sim("A").control(json!({"chat": {"hang": true}}));
    let started = std::time::Instant::now();
    let r = d.chat(&chat_body("hello?", 4, false));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_openai_error(&r, 504, "upstream_timeout");
    let host = format!("127.0.0.1:{}", d.sims[0].port);
    assert!(r.json()["error"]["message"].as_str().unwrap_or_default().contains(&host), "{}", r.body);
}

#[test]
fn a_pd_prefill_carries_the_clients_authorization_and_request_id_as_decode_does() {
    let key = ["--api-key".to_string(), "sk-test".to_string()];
    let specs = vec![
        SimSpec { extra: key.to_vec(), ..SimSpec::prefill("P1") },
        SimSpec { extra: key.to_vec(), ..SimSpec::decode("D1") },
    ];
    let d =
        Deployment::start("pd_auth", specs, |sims| pd_router(sims, &[("only", 0, 100_000, 200_000, &["P1"], &["D1"])]));
    d.wait_for_service(2);
    let headers = [("authorization", "Bearer sk-test"), ("x-request-id", "req-42"), ("x-sgl-cluster", "sgl_P1")];
    let r = d.chat_with_headers(&chat_body("secured", 6, false), &headers);
    assert_eq!(r.status, 200, "{}", r.body);
    for id in ["P1", "D1"] {
        let record = d.sim(id).state()["recent"].as_array().and_then(|a| a.last().cloned()).unwrap();
        let got: Vec<(String, String)> = serde_json::from_value(record["headers"].clone()).unwrap();
        let has = |k: &str, v: &str| got.iter().any(|(a, b)| a == k && b == v);
        assert!(has("authorization", "Bearer sk-test"), "{id}: {got:?}");
        assert!(has("x-request-id", "req-42"), "{id}: {got:?}");
        assert!(!has("x-sgl-cluster", "sgl_P1"), "{id}: the client's routing header never travels: {got:?}");
    }
    // One request, one outcome: routed, counted once the prefill answered.
    wait_for("the routed outcome", Duration::from_secs(5), || {
        (d.envoy.metric("sgl_router_requests_total{outcome=\"routed\"}")? == 1.0).then_some(())
    });
}
