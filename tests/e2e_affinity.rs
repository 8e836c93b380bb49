//! Session, sticky and cache-aware routing over shared state, through real Envoy with two worker
//! VMs (`--concurrency 2`, `exact_balance`), each response naming the VM that decided.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn balanced(yaml: &mut serde_yaml_ng::Value) {
    yaml["static_resources"]["listeners"][0]["connection_balance_config"] =
        serde_yaml_ng::from_str("{exact_balance: {}}").unwrap();
}

fn router(sims: &[Sim], buckets: Value) -> Value {
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "load": {"interval_ms": 100, "stale_after_ms": 1000},
        "health": {"interval_ms": 200, "timeout_ms": 150},
        "debug": {"vm_header": true},
        "models": {"demo-model": {"buckets": buckets}}
    })
}

fn engines(ids: &[&str]) -> Vec<SimSpec> {
    ids.iter().map(|id| SimSpec::plain(id)).collect()
}

/// Both worker VMs must have decided some of `replies`.
fn assert_both_vms(replies: &[Reply]) {
    let vms: HashSet<&str> = replies.iter().filter_map(|r| r.header("x-sgl-vm")).collect();
    assert_eq!(vms.len(), 2, "both worker VMs served: {vms:?}");
}

#[test]
fn sessions_stay_on_one_engine_and_spread_over_the_engines() {
    let d = Deployment::start_with(
        "sessions",
        engines(&["A", "B", "C", "D"]),
        |sims| router(sims, json!([{"id": "all", "groups": {"plain": {"policy": {"type": "session_aware"}}}}])),
        balanced,
    );
    d.wait_for_service(4);
    let clients = d.two_vm_clients();
    let mut replies = Vec::new();
    let mut engine_of: HashMap<String, HashSet<String>> = HashMap::new();
    for turn in 0..5 {
        for s in 0..20 {
            let session = format!("session-{s}");
            let client = &clients[(turn + s) % 2];
            let r = d.chat_on(
                client,
                &chat_body(&format!("turn {turn} of {session}"), 1, false),
                &[("x-session-id", &session)],
            );
            assert_eq!(r.status, 200, "{}", r.body);
            engine_of.entry(session).or_default().insert(r.engine());
            replies.push(r);
        }
    }
    for (session, engines) in &engine_of {
        assert_eq!(engines.len(), 1, "{session} moved: {engines:?}");
    }
    let used: HashSet<&String> = engine_of.values().flatten().collect();
    assert!(used.len() >= 3, "sessions spread over the engines: {used:?}");
    assert_both_vms(&replies);
}

#[test]
fn a_sticky_key_keeps_its_engine_moves_buckets_on_rejection_and_keeps_its_binding() {
    let d = Deployment::start_with(
        "sticky",
        engines(&["A", "B", "C"]),
        |sims| {
            router(
                sims,
                json!([
                    {"id": "small", "limits": {"max": 1000}, "groups": {"plain": {"worker_ids": ["A", "B"],
                        "policy": {"type": "sticky", "admission": {"max_waiting_requests": 5}}}}},
                    {"id": "big", "limits": {"max": 100000}, "groups": {"plain": {"worker_ids": ["C"], "policy": {"type": "round_robin"}}}}
                ]),
            )
        },
        balanced,
    );
    d.wait_for_service(3);
    let clients = d.two_vm_clients();
    let ask_on = |i: usize, key: &str| {
        d.chat_on(&clients[i % 2], &chat_body("sticky question", 1, false), &[("x-sgl-routing-key", key)])
    };
    let ask = |key: &str| ask_on(0, key);
    let first = ask("tenant-1");
    let bound = first.engine();
    let mut replies = vec![first];
    for i in 0..9 {
        let r = ask_on(i + 1, "tenant-1");
        assert_eq!((r.header("x-sgl-bucket"), r.engine()), (Some("small"), bound.clone()));
        replies.push(r);
    }
    assert_both_vms(&replies);

    d.sim(&bound).control(json!({"pin": {"waiting": 10}}));
    std::thread::sleep(Duration::from_millis(600));
    let moved = ask("tenant-1");
    assert_eq!((moved.header("x-sgl-bucket"), moved.engine().as_str()), (Some("big"), "C"), "rejected: next bucket");

    d.sim(&bound).control(json!({"pin": null}));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(ask("tenant-1").engine(), bound, "the binding was kept");

    // A new key goes through the fallback (round robin) and sticks to what it got.
    let other = ask("tenant-2").engine();
    assert!(["A", "B"].contains(&other.as_str()));
    assert_eq!(ask("tenant-2").engine(), other);
}

fn system_prompt() -> String {
    "You are a careful assistant for the sgl-envoy-router test suite. ".repeat(40)
}

fn cache_router(sims: &[Sim]) -> Value {
    router(
        sims,
        json!([{"id": "all", "groups": {"plain": {"policy": {
            "type": "cache_aware", "min_hit_tokens": 256,
            "pressure_guard": {"max_extra_waiting_requests": 3}
        }}}}]),
    )
}

fn with_system(question: &str) -> Value {
    json!({
        "model": "demo-model",
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system_prompt()}, {"role": "user", "content": question}],
    })
}

fn wait_for_replicas(d: &Deployment, head_at_least: f64) {
    wait_for("the service's log and every replica's version", Duration::from_secs(20), || {
        let text = d.envoy.admin("/stats/prometheus");
        let head: f64 =
            text.lines().find_map(|l| l.strip_prefix("sgl_router_prefix_log_head{} ")?.trim().parse().ok())?;
        let versions: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("sgl_router_prefix_replica_version{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        // Every filter VM (both workers, and the main thread's) reports its replica.
        (head >= head_at_least && versions.len() >= 2 && versions.iter().all(|v| *v == head)).then_some(())
    });
}

/// Sends the system prompt's first question once the service is up: the engine that holds it,
/// once every replica knows.
fn first_holder(d: &Deployment) -> String {
    d.wait_for_service(3);
    let first = d.chat(&with_system("first question"));
    assert_eq!(first.status, 200, "{}", first.body);
    wait_for_replicas(d, 1.0);
    first.engine()
}

#[test]
fn a_shared_system_prompt_goes_to_its_holder_on_every_vm_until_the_pressure_guard_moves_it() {
    let d = Deployment::start_with("cache_aware", engines(&["A", "B", "C"]), cache_router, balanced);
    let holder = first_holder(&d);

    let clients = d.two_vm_clients();
    let mut replies = Vec::new();
    for i in 0..20 {
        let r = d.chat_on(&clients[i % 2], &with_system(&format!("follow-up {i}")), &[]);
        assert_eq!(r.engine(), holder, "the holder of the system prompt serves it");
        replies.push(r);
    }
    // Requests decided by both VMs saw the same owner: the replicas agree.
    assert_both_vms(&replies);
    assert!(d.envoy.metric("sgl_router_requests_total{outcome=\"routed\"}").unwrap_or(0.0) >= 21.0);
    let hits = d.envoy.metric("sgl_router_pick_reasons_total{stage=\"plain\",reason=\"cache_hit\"}").unwrap_or(0.0);
    let misses = d.envoy.metric("sgl_router_pick_reasons_total{stage=\"plain\",reason=\"cache_miss\"}").unwrap_or(0.0);
    assert!(hits >= 20.0 && misses >= 1.0, "hits {hits}, misses {misses}: a miss and a hit are counted apart");

    d.sim(&holder).control(json!({"pin": {"waiting": 10}}));
    std::thread::sleep(Duration::from_millis(600));
    let moved = d.chat(&with_system("while the holder is swamped"));
    assert_ne!(moved.engine(), holder, "the pressure guard moved it");
}

/// Without a bootstrap service (a filter VM elected to do its work), both worker VMs route a
/// shared system prompt to its holder, and keep doing so after the elected VM crashes: the next
/// holder resumes the prefix log, so no replica starts over.
#[test]
fn with_an_embedded_service_the_tree_is_shared_and_outlives_a_takeover() {
    let faulty = wasm_module_with_faults();
    let d = Deployment::start_with(
        "cache_aware_embedded",
        engines(&["A", "B", "C"]),
        |sims| {
            let mut router = cache_router(sims);
            router["service"] = json!({"mode": "embedded"});
            router
        },
        |yaml| {
            balanced(yaml);
            let text = serde_yaml_ng::to_string(yaml).unwrap();
            let text = text.replace(&wasm_module().to_string_lossy().into_owned(), &faulty.to_string_lossy());
            *yaml = serde_yaml_ng::from_str(&text).unwrap();
        },
    );
    let holder = first_holder(&d);
    let clients = d.two_vm_clients();
    let follow = |from: usize, n: usize| -> Vec<Reply> {
        (from..from + n).map(|i| d.chat_on(&clients[i % 2], &with_system(&format!("follow-up {i}")), &[])).collect()
    };
    let before = follow(0, 10);
    assert!(before.iter().all(|r| r.engine() == holder), "the holder serves it from both VMs");
    assert_both_vms(&before);
    let resyncs = || -> f64 {
        let text = d.envoy.admin("/stats/prometheus");
        text.lines()
            .filter(|l| l.starts_with("sgl_router_prefix_replica_resyncs{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let resynced = resyncs();

    let armed = d.chat_with_headers(&with_system("trap"), &[("x-sgl-fault", "trap-service")]);
    assert_eq!(armed.status, 202, "{}", armed.body);
    wait_for("another VM to take the lease", Duration::from_secs(20), || {
        (d.envoy.log_text().matches("does the service's work (lease taken)").count() >= 2).then_some(())
    });
    let after = follow(10, 10);
    let engines: Vec<String> = after.iter().map(Reply::engine).collect();
    assert!(engines.iter().all(|e| *e == holder), "still the holder after the takeover: {engines:?}");
    assert_eq!(resyncs(), resynced, "no replica started over");
}

#[test]
fn the_prefix_tree_stays_within_its_budget_after_20000_distinct_prompts() {
    const PROMPTS: usize = 20_000;
    const CLIENTS: usize = 8;
    let d = Deployment::start_with(
        "tree_budget",
        engines(&["A", "B"]),
        |sims| {
            let mut r = router(
                sims,
                json!([{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "max_tree_tokens": 4096}}}}]),
            );
            r["load"] = json!({"source": "none"});
            // Saturated engines answer health checks slowly; this test is about the tree.
            r["health"] = json!({"interval_ms": 1000, "timeout_ms": 5000, "failure_threshold": 10});
            r
        },
        balanced,
    );
    for sim in &d.sims {
        sim.control(json!({"token_delay_ms": 0}));
    }
    let url = d.envoy.url("/v1/chat/completions");
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let url = url.clone();
            std::thread::spawn(move || {
                let agent = agent(); // one connection per client, balanced over the VMs
                for i in (c..PROMPTS).step_by(CLIENTS) {
                    let body = json!({"model": "demo-model", "max_tokens": 1,
                        "messages": [{"role": "user", "content": format!("distinct prompt {i:06} asking about item {}", i * 7919)}]});
                    let mut r = agent.post(&url).header("content-type", "application/json").send(body.to_string()).unwrap();
                    let status = r.status().as_u16();
                    let text = r.body_mut().read_to_string().unwrap_or_default();
                    assert_eq!(status, 200, "{text}");
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let budget = 4096.0 * 4.0;
    wait_for("every prompt logged and replicated", Duration::from_secs(60), || {
        let text = d.envoy.admin("/stats/prometheus");
        let value = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok());
        let head = value("sgl_router_prefix_log_head{} ")?;
        let versions: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("sgl_router_prefix_replica_version{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        let routed = value("sgl_router_requests_total{outcome=\"routed\"} ")?;
        (routed >= PROMPTS as f64 && versions.len() >= 2 && versions.iter().all(|v| *v == head)).then_some(())
    });
    let text = d.envoy.admin("/stats/prometheus");
    let service: f64 =
        text.lines().find_map(|l| l.strip_prefix("sgl_router_prefix_service_bytes{} ")?.trim().parse().ok()).unwrap();
    assert!(service > 0.0 && service <= budget, "service tree: {service} bytes of {budget}");
    let replicas: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("sgl_router_prefix_replica_bytes{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(replicas.len() >= 2);
    for r in replicas {
        assert!(r > 0.0 && r <= budget, "replica tree: {r} bytes of {budget}");
        assert_eq!(r, service, "replicas hold what the service holds");
    }
}
