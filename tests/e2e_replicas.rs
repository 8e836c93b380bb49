//! An index you can lose (spec §7), through real Envoy on engines publishing through SGLang's own
//! KV-event publisher: two indexers, one killed under load, and the hit rate holds; a burst over
//! two Envoys asking different indexers stays on one engine; an engine that went quiet is known to
//! a restarted indexer from its replay, and to one started from a peer when it has no replay; an
//! engine of two data-parallel ranks gets the rank that holds the prompt.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A publishing engine: SGLang's `ZmqEventPublisher` (from its wheel) carries its events, with a
/// replay endpoint unless `replay` is false. Returns the spec and its event and replay ports.
fn publishing(id: &str, replay: bool) -> (SimSpec, u16, Option<u16>) {
    publishing_ranks(id, replay, 1)
}

/// [`publishing`] for an engine of `ranks` data-parallel ranks: rank r publishes on the ports + r.
fn publishing_ranks(id: &str, replay: bool, ranks: u16) -> (SimSpec, u16, Option<u16>) {
    let (events, replay) = (free_ports(ranks), replay.then(|| free_ports(ranks)));
    let root = repo_root();
    let module = root.join(".tools/sglang/sglang/srt/disaggregation/kv_events.py");
    assert!(module.exists(), "run scripts/setup --tests: it unpacks SGLang's publisher");
    let mut extra = vec![
        "--tokenizer".into(),
        tokenizer_dir().join("tokenizer.json").to_string_lossy().into_owned(),
        "--kv-events".into(),
        format!("tcp://127.0.0.1:{events}"),
        "--kv-events-sglang".into(),
        module.to_string_lossy().into_owned(),
        "--python".into(),
        root.join(".venv/bin/python").to_string_lossy().into_owned(),
    ];
    if let Some(replay) = replay {
        extra.extend(["--kv-events-replay".into(), format!("tcp://127.0.0.1:{replay}")]);
    }
    (SimSpec { extra, dp_size: u32::from(ranks), ..SimSpec::plain(id) }, events, replay)
}

/// The router: `engines` publishing, every cache-aware group remote, the indexers at `indexers`.
fn router(sims: &[Sim], ports: &[(u16, Option<u16>)], indexers: &[u16], min_hit: u64) -> Value {
    router_with_timeout(sims, ports, indexers, min_hit, 200)
}

/// [`router`] with the filter's indexer budget `timeout_ms` (a claim holds queries half of it).
fn router_with_timeout(
    sims: &[Sim],
    ports: &[(u16, Option<u16>)],
    indexers: &[u16],
    min_hit: u64,
    timeout_ms: u64,
) -> Value {
    let tok = tokenizer_dir();
    let mut workers: Vec<Value> = sims.iter().map(Sim::worker_json).collect();
    for (w, (events, replay)) in workers.iter_mut().zip(ports) {
        w["kv_events"] = json!(format!("tcp://127.0.0.1:{events}"));
        if let Some(replay) = replay {
            w["kv_events_replay"] = json!(format!("tcp://127.0.0.1:{replay}"));
        }
    }
    json!({
        "workers": workers,
        "health": {"interval_ms": 200, "timeout_ms": 150, "failure_threshold": 2, "success_threshold": 1},
        "prefix_index": {"urls": indexers.iter().map(|p| format!("http://127.0.0.1:{p}")).collect::<Vec<_>>(),
                         "timeout_ms": timeout_ms},
        "models": {"demo-model": {
            "tokenizer": tok.join("tokenizer.json"),
            "chat_template": tok.join("tokenizer_config.json"),
            "buckets": [{"id": "all", "groups": {"plain": {"policy": {
                "type": "cache_aware", "source": "remote", "min_hit_tokens": min_hit}}}}]
        }}
    })
}

fn deploy(name: &str, engines: Vec<(SimSpec, u16, Option<u16>)>, indexers: &[u16], min_hit: u64) -> Deployment {
    let ports: Vec<(u16, Option<u16>)> = engines.iter().map(|(_, e, r)| (*e, *r)).collect();
    let specs = engines.into_iter().map(|(s, _, _)| s).collect();
    Deployment::start(name, specs, |sims| router(sims, &ports, indexers, min_hit))
}

/// Another Envoy on the same engines, rendered from `router` in a directory of its own.
fn another_envoy(router: &Value, dir: &Path) -> Envoy {
    std::fs::create_dir_all(dir).unwrap();
    let (port, admin) = (free_port(), free_port());
    let rendered = render(router, dir, port, admin);
    Envoy::start(&rendered, port, admin, dir)
}

fn ask(system: &str, question: &str) -> Value {
    json!({"model": "demo-model", "max_tokens": 4, "stream": false,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
}

fn indexer_match(port: u16, body: &Value) -> Value {
    send(&format!("http://127.0.0.1:{port}/v1/prefix/match"), "POST", Some(body), &[]).json()
}

/// Cached and prompt tokens the engine reported for one response.
fn usage(r: &Reply) -> (u64, u64) {
    let v = r.json();
    let u = &v["usage"];
    (u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0), u["prompt_tokens"].as_u64().unwrap_or(0))
}

fn hit_rate(replies: &[(Reply, Duration)]) -> f64 {
    let (cached, prompt) = replies.iter().map(|(r, _)| usage(r)).fold((0, 0), |(c, p), (a, b)| (c + a, p + b));
    cached as f64 / prompt.max(1) as f64
}

/// Poisson arrivals at `rate` per second, each request from its own thread; returns the replies
/// with their latencies, in order of sending.
fn poisson(d: &Deployment, bodies: Vec<Value>, rate: f64, seed: u64) -> Vec<(Reply, Duration)> {
    let mut state = seed | 1;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .into_iter()
            .map(|body| {
                std::thread::sleep(Duration::from_secs_f64(-(1.0 - uniform()).ln() / rate));
                s.spawn(move || {
                    let started = Instant::now();
                    let r = d.chat(&body);
                    (r, started.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two indexers; the one every worker VM asks first is killed halfway through Poisson load over
/// shared prefixes. Every request is served, none waits a whole timeout more than it did before,
/// and the hit rate over the next 200 requests stays within a point of the 200 before.
#[test]
fn an_indexer_killed_under_load_costs_neither_requests_nor_hit_rate() {
    let (i0, i1) = (free_port(), free_port());
    let engines = ["A", "B", "C", "D"].iter().map(|id| publishing(id, true)).collect();
    let d = deploy("replicas_failover", engines, &[i0, i1], 64);
    let mut first = start_indexer(&d.dir, i0);
    let _second = start_indexer(&d.dir, i1);
    d.wait_for_service(4);
    let nonce = now_unix_ms();
    let systems: Vec<String> = (0..8)
        .map(|p| {
            format!("Tenant {p} of run {nonce}: answer as the tenant's assistant, citing its policy book. ").repeat(10)
        })
        .collect();
    let body = |i: usize| ask(&systems[i * 7 % systems.len()], &format!("request {i}: what does section {i} say?"));
    // Every prefix is seen once before anything is counted.
    let warm = poisson(&d, (0..80).map(body).collect(), 40.0, 1);
    assert!(warm.iter().all(|(r, _)| r.status == 200));
    let before = poisson(&d, (80..280).map(body).collect(), 40.0, 2);
    first.stop();
    let after = poisson(&d, (280..480).map(body).collect(), 40.0, 3);
    for (r, _) in before.iter().chain(&after) {
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let slowest = |rs: &[(Reply, Duration)]| rs.iter().map(|(_, t)| *t).max().unwrap();
    let (hit_before, hit_after) = (hit_rate(&before), hit_rate(&after));
    eprintln!(
        "failover: hit rate {hit_before:.4} before, {hit_after:.4} after; slowest {:?} before, {:?} after",
        slowest(&before),
        slowest(&after)
    );
    assert!(slowest(&after) < slowest(&before) + Duration::from_millis(200), "a request waited past the timeout");
    assert!(hit_before > 0.8, "the premise: affinity holds before the kill ({hit_before:.3})");
    assert!(hit_after >= hit_before - 0.01, "hit rate {hit_before:.4} before, {hit_after:.4} after");
    let failovers = d.envoy.metric("sgl_router_indexer_failovers_total{indexer=\"sgl_indexer\"}").unwrap_or(0.0);
    let answered = d.envoy.metric("sgl_router_indexer_queries_total{indexer=\"sgl_indexer_1\"}").unwrap_or(0.0);
    assert!(failovers >= 1.0 && answered >= 150.0, "failovers {failovers}, answered by the second {answered}");
}

/// Twenty requests sharing a new prefix, half through an Envoy that asks one indexer first and
/// half through one that asks the other: the claim is agreed between the indexers, and all twenty
/// land on one engine.
#[test]
fn a_burst_over_two_envoys_asking_different_indexers_lands_on_one_engine() {
    let (i0, i1) = (free_port(), free_port());
    let engines: Vec<_> = ["A", "B", "C", "D"].iter().map(|id| publishing(id, true)).collect();
    let ports: Vec<(u16, Option<u16>)> = engines.iter().map(|(_, e, r)| (*e, *r)).collect();
    // Twenty 4k-token prompts tokenized at once by debug builds beside other tests: a budget that
    // holds on a busy CI machine (a slower answer would be unavailable and routed on load).
    let budget = 1000;
    let specs = engines.into_iter().map(|(s, _, _)| s).collect();
    let d =
        Deployment::start("replicas_burst", specs, |sims| router_with_timeout(sims, &ports, &[i0, i1], 1024, budget));
    let _first = start_indexer(&d.dir, i0);
    let _second = start_indexer(&d.dir, i1);
    let reversed = router_with_timeout(&d.sims, &ports, &[i1, i0], 1024, budget);
    let other = another_envoy(&reversed, &d.dir.join("second-envoy"));
    d.wait_for_service(4);
    let nonce = now_unix_ms();
    let prefix: String = (0..140).map(|i| format!("clause {i} of contract {nonce} binds the parties. ")).collect();
    let barrier = std::sync::Barrier::new(20);
    let engines: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..20)
            .map(|i| {
                let (barrier, body) = (&barrier, ask(&prefix, &format!("question {i}: what does clause {i} say?")));
                let url =
                    if i % 2 == 0 { d.envoy.url("/v1/chat/completions") } else { other.url("/v1/chat/completions") };
                s.spawn(move || {
                    let client = agent();
                    barrier.wait();
                    let r = send_with(&client, &url, "POST", Some(&body), &[]);
                    assert_eq!(r.status, 200, "{}", r.body);
                    r.header("x-sgl-worker").unwrap().to_string()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let metrics = |port: u16| send(&format!("http://127.0.0.1:{port}/metrics"), "GET", None, &[]).body;
    let claims: Vec<String> = [i0, i1]
        .iter()
        .flat_map(|p| {
            metrics(*p).lines().filter(|l| l.starts_with("sgl_indexer_claim")).map(String::from).collect::<Vec<_>>()
        })
        .collect();
    let lookups: Vec<String> = [&d.envoy, &other]
        .iter()
        .flat_map(|e| {
            e.admin("/stats/prometheus")
                .lines()
                .filter(|l| l.starts_with("sgl_router_prefix_lookups_total"))
                .map(String::from)
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(engines.iter().all(|e| *e == engines[0]), "the burst scattered: {engines:?}\n{claims:#?}\n{lookups:#?}");
    let answered_by_second = other.metric("sgl_router_indexer_queries_total{indexer=\"sgl_indexer\"}").unwrap_or(0.0);
    assert!(answered_by_second >= 10.0, "the second Envoy asked its own first indexer ({answered_by_second})");
}

/// Engines that publish no KV events (older SGLang, vLLM without events): the indexer keeps what
/// any Envoy routed to them, past the window a routed notice covers for engines that do publish,
/// so a prompt one Envoy sent an engine reaches that engine through another Envoy.
#[test]
fn engines_without_events_share_what_any_envoy_routed_to_them() {
    let indexer = free_port();
    let specs = ["A", "B", "C", "D"].map(SimSpec::plain).to_vec();
    // Budgets that hold on a busy CI machine (other tests tokenize bursts beside this one): an
    // indexer answer past its budget would be routed on load, and a health check past its timeout
    // twice would take an engine out of the second Envoy's rotation.
    let d = Deployment::start("replicas_silent", specs, |sims| {
        let mut r = router_with_timeout(sims, &[], &[indexer], 64, 1000);
        r["health"] = json!({"interval_ms": 500, "timeout_ms": 2000, "failure_threshold": 5, "success_threshold": 1});
        r
    });
    let _indexer = start_indexer(&d.dir, indexer);
    let config: Value = serde_json::from_str(&std::fs::read_to_string(d.dir.join("router.json")).unwrap()).unwrap();
    assert!(config["workers"].as_array().unwrap().iter().all(|w| w.get("kv_events").is_none()), "no engine publishes");
    let other = another_envoy(&config, &d.dir.join("second-envoy"));
    d.wait_for_service(4);
    let nonce = now_unix_ms();
    let systems: Vec<String> =
        (0..6).map(|i| format!("Run {nonce}, desk {i}: you answer for desk {i} only. ").repeat(12)).collect();
    let first: Vec<String> = systems.iter().map(|s| d.chat(&ask(s, "first question")).engine()).collect();
    // Longer than a routed notice holds for an engine that publishes (it would have said so by now).
    std::thread::sleep(Duration::from_millis(2_500));
    let second: Vec<String> = systems
        .iter()
        .map(|s| {
            let r = send(&other.url("/v1/chat/completions"), "POST", Some(&ask(s, "second question")), &[]);
            assert_eq!(r.status, 200, "{}", r.body);
            r.engine()
        })
        .collect();
    let views: Vec<Value> =
        systems.iter().map(|s| indexer_match(indexer, &ask(s, "second question"))["data"].clone()).collect();
    let lookups = other.admin("/stats/prometheus");
    let lookups: Vec<&str> = lookups
        .lines()
        .filter(|l| l.starts_with("sgl_router_prefix_lookups_total") || l.starts_with("sgl_router_healthy_workers"))
        .collect();
    assert_eq!(
        second, first,
        "each prompt back at the engine the other Envoy sent it to\nindexer: {views:#?}\n{lookups:#?}"
    );
    let metrics = send(&format!("http://127.0.0.1:{indexer}/metrics"), "GET", None, &[]).body;
    assert!(metrics.lines().any(|l| l.starts_with("sgl_indexer_routed_blocks ") && !l.ends_with(" 0")), "{metrics}");
}

/// Engine A (with replay) holds S1 and engine B (without) holds S2, and both go quiet. A
/// restarted indexer knows S1 from A's replay within 3 s; only an indexer started from a peer
/// knows S2, also within 3 s. Each is checked by where Envoy routes the prefix.
#[test]
fn a_quiet_engines_prefix_survives_an_indexer_restart_by_replay_or_by_peer() {
    let (i0, i1) = (free_port(), free_port());
    let d = deploy("replicas_warm", vec![publishing("A", true), publishing("B", false)], &[i0, i1], 64);
    let mut first = start_indexer(&d.dir, i0);
    d.wait_for_service(2);
    let nonce = now_unix_ms();
    let s1 = format!("Run {nonce}: the first engine's prompt on buckets and caches. ").repeat(12);
    let s2 = format!("Run {nonce}: the second engine's prompt on prefill and decode. ").repeat(12);
    for (engine, system) in [("A", &s1), ("B", &s2)] {
        let r = send(&d.sim(engine).url("/v1/chat/completions"), "POST", Some(&ask(system, "hello?")), &[]);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let held = |port: u16, system: &str, engine: &str| {
        indexer_match(port, &ask(system, "x"))["data"][engine]["matched_tokens"].as_u64().unwrap_or(0) > 100
    };
    wait_for("both prefixes in the first indexer", Duration::from_secs(10), || {
        (held(i0, &s1, "A") && held(i0, &s2, "B")).then_some(())
    });
    // Routed to the holder as a cache hit, not by chance on load.
    let hits = || d.envoy.metric("sgl_router_pick_reasons_total{stage=\"plain\",reason=\"cache_hit\"}").unwrap_or(0.0);
    let routes_to = |system: &str, engine: &str| {
        let before = hits();
        let r = d.chat(&ask(system, &format!("is this cached {}?", now_unix_ms())));
        r.status == 200 && r.header("x-sgl-worker") == Some(engine) && hits() > before
    };

    // A peer loaded from the first: it has S2, which B's live events gave and no replay can.
    // With the first gone, Envoy asks the peer, and S2 goes to B.
    let started = Instant::now();
    let mut peer = start_indexer_with(&d.dir, i1, &["--peer", &format!("http://127.0.0.1:{i0}")]);
    first.stop();
    wait_for("S2 routed to B by the peer-started indexer", Duration::from_secs(3), || {
        (started.elapsed() < Duration::from_secs(3) && routes_to(&s2, "B")).then_some(())
    });
    let peer_took = started.elapsed();
    let metrics = send(&format!("http://127.0.0.1:{i1}/metrics"), "GET", None, &[]).body;
    assert!(metrics.contains(r#"sgl_indexer_rank_warm{worker="B",rank="0",from="peer"} 1"#), "{metrics}");

    // The first restarts cold, alone: A's replay gives it S1 at once, nothing gives it S2.
    peer.stop();
    let started = Instant::now();
    let _restarted = start_indexer(&d.dir, i0);
    wait_for("S1 routed to A by the restarted indexer", Duration::from_secs(3), || {
        (started.elapsed() < Duration::from_secs(3) && routes_to(&s1, "A")).then_some(())
    });
    let replay_took = started.elapsed();
    assert!(!held(i0, &s2, "B"), "the premise: without replay the restarted indexer cannot know S2");
    let metrics = send(&format!("http://127.0.0.1:{i0}/metrics"), "GET", None, &[]).body;
    assert!(metrics.contains(r#"sgl_indexer_rank_warm{worker="A",rank="0",from="replay"} 1"#), "{metrics}");
    eprintln!("warm start: S2 routed {peer_took:?} after the peer started, S1 {replay_took:?} after the restart");
}

/// The sim's last request record carrying a body.
fn last_record(sim: &Sim) -> Value {
    let state = sim.state();
    let recent = state["recent"].as_array().cloned().unwrap_or_default();
    recent.into_iter().rev().find(|r| r["path"] == "/v1/chat/completions").unwrap_or(Value::Null)
}

/// Waits until the indexer on `port` has `engine`'s rank 1 holding the prompt behind `system`.
fn wait_for_rank_one(port: u16, system: &str, engine: &str) {
    wait_for(&format!("{engine}'s rank 1 events in the index"), Duration::from_secs(10), || {
        let v = indexer_match(port, &ask(system, "x"));
        (v["data"][engine]["ranks"]["1"].as_u64()? > 100).then_some(())
    });
}

/// An engine of two data-parallel ranks whose rank 1 holds the prompt: the request reaching it
/// names `routed_dp_rank: 1`, plain and (on a prefill engine) in PD.
#[test]
fn the_rank_that_holds_the_prefix_is_named_plain_and_in_pd() {
    let indexer = free_port();
    let a = publishing_ranks("A", true, 2);
    let d = deploy("replicas_dp", vec![a, publishing("B", true)], &[indexer], 64);
    let _indexer = start_indexer(&d.dir, indexer);
    d.wait_for_service(2);
    let system = format!("Run {}: a prompt only rank 1 of engine A has seen. ", now_unix_ms()).repeat(12);
    let mut direct = ask(&system, "warm up?");
    direct["routed_dp_rank"] = json!(1);
    assert_eq!(send(&d.sim("A").url("/v1/chat/completions"), "POST", Some(&direct), &[]).status, 200);
    assert_eq!(last_record(d.sim("A"))["dp_rank"], 1, "the premise: rank 1 served it");
    wait_for_rank_one(indexer, &system, "A");
    let r = d.chat(&ask(&system, "which rank?"));
    assert_eq!((r.status, r.header("x-sgl-worker")), (200, Some("A")), "{}", r.body);
    let record = last_record(d.sim("A"));
    assert_eq!((record["routed_dp_rank"].clone(), record["dp_rank"].clone()), (json!(1), json!(1)), "{record}");

    // PD: the prefill engine has the two ranks; the decode engine balances on its own load.
    let indexer = free_port();
    let mut p = publishing_ranks("P", true, 2);
    p.0.role = "prefill";
    let (p_events, p_replay) = (p.1, p.2);
    let mut decode = SimSpec::decode("D");
    decode.dp_size = 2;
    let d = Deployment::start("replicas_dp_pd", vec![p.0, decode], |sims| {
        let mut r = router(sims, &[(p_events, p_replay)], &[indexer], 64);
        r["workers"][1].as_object_mut().unwrap().remove("kv_events");
        r["models"]["demo-model"]["buckets"] = json!([{"id": "pd", "groups": {"pd": {
            "prefill": {"policy": {"type": "cache_aware", "source": "remote", "min_hit_tokens": 64}},
            "decode": {"policy": {"type": "round_robin"}}}}}]);
        r
    });
    let _indexer = start_indexer(&d.dir, indexer);
    d.wait_for_service(2);
    let mut direct = ask(&system, "warm up?");
    direct["routed_dp_rank"] = json!(1);
    direct["bootstrap_room"] = json!(1);
    direct["bootstrap_host"] = json!("127.0.0.1");
    direct["bootstrap_port"] = json!(d.sim("P").bootstrap_port);
    assert_eq!(send(&d.sim("P").url("/v1/chat/completions"), "POST", Some(&direct), &[]).status, 200);
    wait_for_rank_one(indexer, &system, "P");
    let r = d.chat(&ask(&system, "which rank in PD?"));
    assert_eq!((r.status, r.header("x-sgl-prefill-worker")), (200, Some("P")), "{}", r.body);
    let prefill = last_record(d.sim("P"));
    assert_eq!(prefill["routed_dp_rank"], 1, "{prefill}");
    let decode = last_record(d.sim("D"));
    assert!(decode["routed_dp_rank"].is_u64(), "the decode engine's rank by its load: {decode}");
}
