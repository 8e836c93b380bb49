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

    d.health_out_and_back("A");
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

    d.health_out_and_back("A");

    // Six long requests at once over both threads: one per engine runs, the rest are refused.
    let answers = d.statuses_at_once(6);
    let ok = answers.iter().filter(|s| **s == 200).count();
    assert_eq!(ok, 2, "one per engine, whichever thread decided: {answers:?}");
}

/// Two router configurations in one Envoy and one VM (two plugins of the module, one `vm_id`,
/// their own root ids as a mesh gives them), with the same model name and the same worker ids,
/// in two namespaces and with no bootstrap service: each routes to its own engines, keeps its
/// own rotation, and an engine's health in one pool says nothing about the other's.
#[test]
fn two_pools_in_one_vm_stay_apart() {
    let specs = ["A", "B", "A2", "B2"].map(SimSpec::plain).to_vec();
    let second = std::cell::RefCell::new(json!(null));
    let pool_b_port = free_port();
    let d = Deployment::start_with(
        "mesh_two_pools",
        specs,
        |sims| {
            let pool = |namespace: &str, engines: &[&Sim], clusters: Option<&str>| {
                let workers: Vec<_> = ["A", "B"]
                    .iter()
                    .zip(engines)
                    .map(|(id, sim)| {
                        let mut w = sim.worker_json();
                        w["id"] = json!(id);
                        if let Some(prefix) = clusters {
                            w["cluster"] = json!(format!("{prefix}_{id}"));
                        }
                        w
                    })
                    .collect();
                let mut router = plain_router(sims);
                router["workers"] = json!(workers);
                router["namespace"] = json!(namespace);
                router["service"] = json!({"mode": "embedded"});
                router["health"] = json!({"interval_ms": 200, "failure_threshold": 2, "success_threshold": 1});
                router
            };
            let mut b = pool("pool-b", &[&sims[2], &sims[3]], Some("pool_b"));
            // One `sgl_engines` per Envoy: pool b goes without retries.
            b["retry"] = json!({"attempts": 0});
            *second.borrow_mut() = b;
            pool("pool-a", &[&sims[0], &sims[1]], None)
        },
        |yaml| {
            // Pool b: its own listener and clusters, rendered apart, its plugin renamed.
            let dir = scratch_dir("mesh_two_pools_b");
            let rendered = render(&second.borrow(), &dir, pool_b_port, free_port());
            let text = std::fs::read_to_string(rendered).unwrap();
            let other: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
            let mut listener = other["static_resources"]["listeners"][0].clone();
            listener["name"] = "pool_b".into();
            let plugin = &mut listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
                ["typed_config"]["config"];
            plugin["name"] = "sgl_router_b".into();
            plugin["root_id"] = "sgl_router_b".into();
            let resources = &mut yaml["static_resources"];
            resources["listeners"].as_sequence_mut().unwrap().push(listener);
            let clusters = other["static_resources"]["clusters"].as_sequence().unwrap().clone();
            resources["clusters"].as_sequence_mut().unwrap().extend(clusters);
        },
    );
    let pool_b = |i: usize| {
        let url = format!("http://127.0.0.1:{pool_b_port}/v1/chat/completions");
        let r = send(&url, "POST", Some(&chat_body(&format!("pool b {i}"), 1, false)), &[]);
        assert_eq!(r.status, 200, "{}", r.body);
        r.engine()
    };
    let first_a = d.chat(&chat_body("pool a", 1, false)).engine();
    let first_b = pool_b(0);
    assert_eq!(
        (first_a.as_str(), first_b.as_str()),
        ("A", "A2"),
        "same worker id A, each pool's own engine, each rotation from its start"
    );
    for i in 1..5 {
        assert!(["A2", "B2"].contains(&pool_b(i).as_str()), "pool b never reaches pool a's engines");
    }
    d.sim("A").control(json!({"health": {"status": 503}}));
    wait_for("pool a's A out", Duration::from_secs(15), || (d.served_counts(4).get("B") == Some(&4)).then_some(()));
    let b_engines: Vec<String> = (0..6).map(pool_b).collect();
    assert!(b_engines.iter().any(|e| e == "A2"), "pool b's A is healthy: {b_engines:?}");
}

/// The VM doing the service's work traps, as a crash would (the module built with test-only
/// faults): another VM takes the lease, health goes on being checked, and no request fails
/// meanwhile. (The three-heartbeat bound is `state::lease`'s, tested on a fake clock; the time
/// this takeover took is printed.)
#[test]
fn a_crashed_service_holder_is_replaced_and_no_request_fails() {
    let faulty = wasm_module_with_faults();
    let d = Deployment::start_with(
        "mesh_takeover",
        vec![SimSpec::plain("A"), SimSpec::plain("B")],
        |sims| {
            let mut router = plain_router(sims);
            router["service"] = json!({"mode": "embedded"});
            router["health"] = json!({"interval_ms": 200, "failure_threshold": 2, "success_threshold": 1});
            router
        },
        |yaml| {
            let text = serde_yaml_ng::to_string(yaml).unwrap();
            let text = text.replace(&wasm_module().to_string_lossy().into_owned(), &faulty.to_string_lossy());
            *yaml = serde_yaml_ng::from_str(&text).unwrap();
        },
    );
    d.wait_for_service(2);
    let takes = || d.envoy.log_text().matches("does the service's work (lease taken)").count();
    assert_eq!(takes(), 1);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let statuses = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut statuses = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                statuses.push(d.chat(&chat_body(&format!("during takeover {i}"), 2, false)).status);
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            statuses
        });
        let armed = d.chat_with_headers(&chat_body("trap", 1, false), &[("x-sgl-fault", "trap-service")]);
        assert_eq!(armed.status, 202, "{}", armed.body);
        wait_for("the holder to trap", Duration::from_secs(10), || {
            d.envoy.log_text().contains("the VM doing the service's work traps now").then_some(())
        });
        wait_for("another VM to take the lease", Duration::from_secs(20), || (takes() >= 2).then_some(()));
        // The new holder checks health: A out and back.
        d.health_out_and_back("A");
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        load.join().unwrap()
    });
    let log = d.envoy.log_text();
    let at =
        |needle: &str, nth: usize| log.lines().filter(|l| l.contains(needle)).nth(nth).map(|l| l[1..24].to_string());
    eprintln!(
        "takeover: trapped at {:?}, lease taken again at {:?}",
        at("traps now", 0),
        at("does the service's work (lease taken)", 1)
    );
    assert!(!statuses.is_empty() && statuses.iter().all(|s| *s == 200), "every request served: {statuses:?}");
}
