//! The shapes a mesh or a gateway gives the filter (spec §10), through real Envoy: engines as the
//! endpoints of one cluster with an override-host policy (`upstream.mode: override_host`), no
//! per-engine cluster; requests, retries, health and load polls, PD prefill callouts and aborts
//! all reach their engine through that one cluster and the header that names it.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn override_host(mut router: serde_json::Value) -> serde_json::Value {
    router["upstream"] = json!({"mode": "override_host"});
    router
}

/// Two plain engines on one override-host cluster: the rotation reaches both, a client cannot
/// steer with the header, health polled through the same cluster takes an engine out and back.
#[test]
fn override_host_routes_and_health_checks_through_one_cluster() {
    let d = Deployment::start("mesh_plain", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        let mut router = override_host(plain_router(sims));
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] = json!({"type": "round_robin"});
        router
    });
    d.wait_for_service(2);
    let clusters = d.envoy.admin("/clusters");
    assert!(!clusters.contains("sgl_A::") && clusters.contains("sgl_engines::"), "one cluster for the engines");
    let counts = d.served_counts(8);
    assert_eq!((counts.get("A"), counts.get("B")), (Some(&4), Some(&4)), "{counts:?}");
    let a = format!("127.0.0.1:{}", d.sim("A").port);
    for _ in 0..4 {
        let r = d.chat_with_headers(&chat_body("steer", 1, false), &[("x-gateway-destination-endpoint", a.as_str())]);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(d.sim("A").state()["served"], 6, "A served its rotation share only");

    d.sim("A").control(json!({"health": {"status": 503}}));
    wait_for("A out of rotation", Duration::from_secs(15), || (d.served_counts(4).get("B") == Some(&4)).then_some(()));
    d.sim("A").control(json!({"health": {"status": null}}));
    wait_for("A back", Duration::from_secs(15), || d.served_counts(4).contains_key("A").then_some(()));
}

/// An engine that refuses connections: the request goes to the fallback its group's policy named
/// in the same header.
#[test]
fn override_host_retries_on_the_named_fallback() {
    let mut d = Deployment::start("mesh_retry", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        let mut router = override_host(plain_router(sims));
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] = json!({"type": "round_robin"});
        // Health would take the dead engine out; this test is about the retry before it does.
        router["health"] = json!({"interval_ms": 60000, "failure_threshold": 1000});
        router
    });
    d.wait_for_service(2);
    d.sims[0].stop();
    for i in 0..4 {
        let r = d.chat(&chat_body(&format!("retry {i}"), 2, false));
        assert_eq!((r.status, r.engine()), (200, "B".to_string()), "{}", r.body);
    }
    wait_for("the retries counted", Duration::from_secs(5), || {
        (d.envoy.metric("sgl_router_retries_total{stage=\"plain\"}")? >= 2.0).then_some(())
    });
}

/// A PD pair on the one cluster: the prefill callout reaches the prefill engine through it with
/// the header naming it, the decode request the decode engine.
#[test]
fn override_host_routes_a_pd_pair() {
    let d = Deployment::start("mesh_pd", vec![SimSpec::prefill("P1"), SimSpec::decode("D1")], |sims| {
        override_host(pd_router(sims, &[("only", 0, 100_000, 200_000, &["P1"], &["D1"])]))
    });
    d.wait_for_service(2);
    for i in 0..3 {
        let r = d.chat(&chat_body(&format!("pd {i}"), 4, false));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!((r.header("x-sgl-prefill-worker"), r.header("x-sgl-worker")), (Some("P1"), Some("D1")));
    }
    assert_eq!(d.sim("P1").state()["served"], 3, "every prefill reached P1");
}

/// No bootstrap service (`service.mode: embedded`), two worker threads: a filter VM takes the
/// service lease and does its work. Health takes an engine out and brings it back, and admission
/// caps of one request per engine hold across both threads.
#[test]
fn an_embedded_service_checks_health_and_caps_hold_across_threads() {
    let specs = vec![
        SimSpec { token_delay_ms: 20, ..SimSpec::plain("A") },
        SimSpec { token_delay_ms: 20, ..SimSpec::plain("B") },
    ];
    let d = Deployment::start_on("mesh_embedded", 2, specs, |sims| {
        let mut router = plain_router(sims);
        router["service"] = json!({"mode": "embedded"});
        router["health"] = json!({"interval_ms": 200, "failure_threshold": 2, "success_threshold": 1});
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "round_robin", "admission": {"max_inflight_requests": 1}});
        router
    });
    let bootstrap = std::fs::read_to_string(d.dir.join("envoy.yaml")).unwrap_or_default();
    assert!(!bootstrap.contains("sgl_router_service"), "no bootstrap service");
    d.wait_for_service(2);
    assert!(d.envoy.log_text().contains("this filter VM does the service's work"));

    d.sim("A").control(json!({"health": {"status": 503}}));
    wait_for("A out of rotation", Duration::from_secs(15), || (d.served_counts(4).get("B") == Some(&4)).then_some(()));
    d.sim("A").control(json!({"health": {"status": null}}));
    wait_for("A back", Duration::from_secs(15), || d.served_counts(4).contains_key("A").then_some(()));

    // Six long requests at once over both threads: one per engine runs, the rest are refused.
    let clients = d.two_vm_clients();
    let answers: Vec<u16> = std::thread::scope(|s| {
        let running: Vec<_> = (0..6)
            .map(|i| {
                let client = &clients[i % 2];
                let d = &d;
                s.spawn(move || d.chat_on(client, &chat_body(&format!("cap {i}"), 40, false), &[]).status)
            })
            .collect();
        running.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = answers.iter().filter(|s| **s == 200).count();
    assert_eq!(ok, 2, "one per engine, whichever thread decided: {answers:?}");
}
