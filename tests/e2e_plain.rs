//! Plain routing through real Envoy (`--concurrency 2`) to simulated engines.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn two_engines(name: &str) -> Deployment {
    Deployment::start(name, vec![SimSpec::plain("A"), SimSpec::plain("B")], plain_router)
}

#[test]
fn two_plain_engines_both_receive_traffic() {
    let d = two_engines("two_plain");
    let counts = d.served_counts(20);
    // One cursor in shared data for both worker VMs: the rotation is exact whatever the VM.
    assert_eq!(counts.get("A"), Some(&10), "{counts:?}");
    assert_eq!(counts.get("B"), Some(&10), "{counts:?}");
}

/// `drain: true` (spec §8): the draining engine gets no request, the other all of them, and the
/// gauge says how many drain. (Draining under an update, with streams in flight, is issue 27's.)
#[test]
fn a_draining_engine_takes_no_request() {
    let d = Deployment::start("drain", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        let mut router = plain_router(sims);
        router["workers"][1]["drain"] = json!(true);
        router
    });
    let counts = d.served_counts(10);
    assert_eq!(counts.get("A"), Some(&10), "{counts:?}");
    wait_for("the draining gauge", Duration::from_secs(10), || {
        (d.envoy.metric("sgl_router_draining_workers{}")? == 1.0).then_some(())
    });
}

#[test]
fn non_streamed_response_is_the_engines_json() {
    let d = two_engines("json_reply");
    let r = d.chat(&chat_body("hello", 3, false));
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["sim_engine"], r.engine());
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 ");
    // The body the filter read goes on with the request's id (the filter's own, not Envoy's
    // `x-request-id`) added and its length (not re-sent chunked).
    let record = d.sim(&r.engine()).state()["recent"].as_array().and_then(|r| r.last().cloned()).unwrap();
    let header = |name: &str| record["headers"].as_array().unwrap().iter().find(|h| h[0] == name).map(|h| h[1].clone());
    let rid = record["rid"].as_str().unwrap_or_default();
    assert!(rid.starts_with("sgl-") && Some(Value::from(rid)) != header("x-request-id"), "{record}");
    let sent = chat_body("hello", 3, false).to_string().len() + format!(r#""rid":"{rid}","#).len();
    assert_eq!(record["body_bytes"], sent, "{record}");
    assert_eq!(header("content-length"), Some(Value::String(sent.to_string())), "{record}");
}

#[test]
fn streamed_response_arrives_as_intact_sse_events_in_order() {
    let d = two_engines("stream_order");
    let r = d.chat(&chat_body("stream please", 50, true));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("content-type").unwrap_or_default().starts_with("text/event-stream"));
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk is not JSON ({err}): {e}")))
        .collect();
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    let expected: String = (0..50).map(|i| format!("tok{i} ")).collect();
    assert_eq!(content, expected, "tokens arrive complete and in order");
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["sim_engine"] == r.engine()));
    assert_eq!(chunks.last().map(|c| c["choices"][0]["finish_reason"].clone()), Some(json!("length")));
}

#[test]
fn a_twenty_second_stream_is_not_cut() {
    let d = two_engines("long_stream");
    for sim in &d.sims {
        sim.control(json!({"token_delay_ms": 1000}));
    }
    let started = std::time::Instant::now();
    let r = d.chat(&chat_body("a long generation", 21, true));
    let elapsed = started.elapsed();
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream finished: {}", r.body);
    let tokens = events.iter().filter(|e| e.contains("\"content\":\"tok")).count();
    assert_eq!(tokens, 21);
    // Not a timing assertion on performance: it proves the stream really outlived Envoy's 15 s default.
    assert!(elapsed >= Duration::from_secs(20), "the stream lasted only {elapsed:?}");
}

#[test]
fn a_worker_whose_health_fails_stops_and_resumes_receiving_traffic() {
    let d = two_engines("health_flip");
    d.sim("A").control(json!({"health": {"status": 503}}));
    wait_for("A to be taken out of rotation", Duration::from_secs(15), || {
        let counts = d.served_counts(6);
        (counts.get("B") == Some(&6)).then_some(())
    });
    let counts = d.served_counts(10);
    assert_eq!(counts.get("B"), Some(&10), "an unhealthy worker gets nothing: {counts:?}");

    d.sim("A").control(json!({"health": {"status": null}}));
    wait_for("A to serve again", Duration::from_secs(15), || d.served_counts(4).contains_key("A").then_some(()));
}

#[test]
fn client_routing_headers_change_nothing_on_the_chat_path() {
    let d = two_engines("strip_chat");
    let a_port = d.sim("A").port.to_string();
    let endpoint = format!("127.0.0.1:{a_port}");
    let mut counts = HashMap::new();
    for i in 0..10 {
        let r = d.chat_with_headers(
            &chat_body(&format!("steer {i}"), 1, false),
            &[("x-sgl-cluster", "sgl_A"), ("x-gateway-destination-endpoint", endpoint.as_str()), ("x-sgl-worker", "A")],
        );
        assert_eq!(r.status, 200, "{}", r.body);
        *counts.entry(r.engine()).or_insert(0) += 1;
    }
    assert_eq!(counts.get("B"), Some(&5), "the client did not steer: {counts:?}");
    for sim in &d.sims {
        let state = sim.state();
        for record in state["recent"].as_array().cloned().unwrap_or_default() {
            let headers: HashMap<String, String> = serde_json::from_value(
                json!(record["headers"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|h| (h[0].clone(), h[1].clone()))
                    .collect::<Vec<_>>())
                .as_array()
                .map(|a| {
                    Value::Object(a.iter().filter_map(|p| Some((p[0].as_str()?.to_string(), p[1].clone()))).collect())
                })
                .unwrap_or_default(),
            )
            .unwrap_or_default();
            // The engines cluster, led by this engine's own address (retries name the next after it).
            assert_eq!(headers.get("x-sgl-cluster").map(String::as_str), Some("sgl_engines"));
            let own = format!("127.0.0.1:{}", sim.port);
            let endpoint = headers.get("x-sgl-endpoint").cloned().unwrap_or_default();
            assert!(endpoint.starts_with(&own), "{endpoint} names {own} first");
            assert!(!headers.contains_key("x-gateway-destination-endpoint"), "client header reached the engine");
            assert!(!headers.contains_key("x-sgl-worker"), "client header reached the engine");
        }
    }
}

#[test]
fn client_routing_headers_change_nothing_on_other_paths() {
    // An operator route that forwards by the cluster header: a client-sent one must not steer it.
    let d =
        Deployment::start_with("strip_other", vec![SimSpec::plain("A"), SimSpec::plain("B")], plain_router, |yaml| {
            let routes = &mut yaml["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"];
            let route: serde_yaml_ng::Value =
                serde_yaml_ng::from_str("{match: {prefix: /sim/state}, route: {cluster_header: x-sgl-cluster}}")
                    .unwrap_or_default();
            if let Some(seq) = routes.as_sequence_mut() {
                seq.insert(0, route);
            }
        });
    let r = send(&d.envoy.url("/sim/state"), "GET", None, &[("x-sgl-cluster", "sgl_A")]);
    assert_ne!(r.status, 200, "a client-chosen cluster was reached: {}", r.body);
    assert!(r.header("x-sim-engine").is_none(), "an engine answered: {}", r.body);
    let r = send(&d.envoy.url("/v1/other"), "GET", None, &[("x-sgl-cluster", "sgl_A")]);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["type"], "not_found");
}

#[test]
fn models_are_listed() {
    let d = two_engines("models");
    let r = send(&d.envoy.url("/v1/models"), "GET", None, &[]);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap_or_default().starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, vec!["demo-model"]);
}

#[test]
fn original_dst_mode_routes_to_the_engines_host_and_port() {
    let d = Deployment::start("original_dst", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        let mut router = plain_router(sims);
        router["upstream"] = json!({"mode": "original_dst"});
        router
    });
    let counts = d.served_counts(8);
    assert_eq!((counts.get("A"), counts.get("B")), (Some(&4), Some(&4)), "{counts:?}");
    // The client cannot choose the destination either.
    let port = d.sim("A").port;
    for _ in 0..4 {
        let r = d.chat_with_headers(
            &chat_body("x", 1, false),
            &[("x-gateway-destination-endpoint", &format!("127.0.0.1:{port}"))],
        );
        assert_eq!(r.status, 200);
    }
    let a = d.sim("A").state()["served"].as_u64().unwrap_or(0);
    assert_eq!(a, 6, "A served its rotation share only");
}
