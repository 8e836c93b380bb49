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

/// Envoy's router obeys `x-envoy-*` request headers (timeouts, retries, hedging, stat names) from
/// whoever sends them, as far as the listener trusts them. On the router's routes a client's are
/// all removed: each one sent with a value that would show, and none shows.
#[test]
fn a_clients_envoy_headers_change_nothing_on_the_routers_routes() {
    let d = Deployment::start("envoy_headers", vec![SimSpec { token_delay_ms: 20, ..SimSpec::plain("A") }], |sims| {
        let mut router = plain_router(sims);
        router["retry"] = json!({"attempts": 0});
        router
    });
    d.wait_for_service(1);
    // A request takes ~8 × 20 ms: any of these obeyed cuts it short.
    let cut_short = [
        ("x-envoy-upstream-rq-timeout-ms", "1"),
        ("x-envoy-upstream-rq-per-try-timeout-ms", "1"),
        ("x-envoy-upstream-stream-duration-ms", "1"),
        ("x-envoy-expected-rq-timeout-ms", "1"),
        ("x-envoy-hedge-on-per-try-timeout", "true"),
        ("x-envoy-upstream-rq-timeout-alt-response", "204"),
        ("x-envoy-upstream-alt-stat-name", "hostile_stat"),
        ("x-envoy-original-dst-host", "127.0.0.1:1"),
    ];
    // Envoy trusts a request's `x-envoy-*` headers when it reads as internal: an RFC 1918 address
    // in `x-forwarded-for` is all it takes on a listener without `use_remote_address`.
    let internal = ("x-forwarded-for", "10.1.2.3");
    for (name, value) in cut_short {
        let r = d.chat_with_headers(&chat_body("take your time", 8, false), &[(name, value), internal]);
        assert_eq!((r.status, r.engine()), (200, "A".to_string()), "{name}: {value}: {}", r.body);
        assert_eq!(r.json()["usage"]["completion_tokens"], 8, "{name}: the whole answer");
    }
    // Together, as a client that wants every timeout short would send them.
    let all: Vec<(&str, &str)> = cut_short.iter().copied().chain([internal]).collect();
    let r = d.chat_with_headers(&chat_body("all at once", 8, true), &all);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("[DONE]"), "the whole stream: {}", r.body);
    let stats = d.envoy.admin("/stats");
    assert!(!stats.contains("hostile_stat"), "a client names no stat");
    // An engine failing: no client header makes Envoy retry it.
    d.sim("A").control(json!({"chat": {"status": 503}}));
    let retry = [
        [("x-envoy-retry-on", "5xx,retriable-status-codes,reset"), ("x-envoy-max-retries", "3")],
        [("x-envoy-retry-grpc-on", "unavailable,cancelled"), ("x-envoy-max-retries", "3")],
        [("x-envoy-retriable-status-codes", "503"), ("x-envoy-retry-on", "retriable-status-codes")],
        [("x-envoy-retriable-header-names", "content-type"), ("x-envoy-retry-on", "retriable-headers")],
    ];
    for headers in &retry {
        let headers: Vec<(&str, &str)> = headers.iter().copied().chain([internal]).collect();
        let r = d.chat_with_headers(&chat_body("fail once", 4, false), &headers);
        assert_eq!(r.status, 503, "{headers:?}: {}", r.body);
    }
    let retried = d.envoy.admin("/stats?filter=upstream_rq_retry$");
    assert!(retried.lines().all(|l| l.trim_end().ends_with(": 0")), "no retry on a client's word: {retried}");
    // And the engine saw none of the client's values.
    let recent = d.sim("A").state()["recent"].clone();
    let seen: Vec<(String, String)> = recent
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| serde_json::from_value::<Vec<(String, String)>>(r["headers"].clone()).unwrap_or_default())
        .collect();
    for (name, value) in cut_short.iter().chain(retry.iter().flatten()) {
        assert!(!seen.iter().any(|(k, v)| k == name && v == value), "{name}: {value} reached the engine");
    }
}
