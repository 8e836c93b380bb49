//! Live load and admission through real Envoy: the service's reports, admission across buckets,
//! staleness, and in-flight accounting under mixed traffic.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn plain_with(sims: &[Sim], buckets: Value) -> Value {
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "load": {"interval_ms": 100, "stale_after_ms": 1000},
        "health": {"interval_ms": 200, "timeout_ms": 150},
        "models": {"demo-model": {"buckets": buckets}}
    })
}

/// Waits until the service has seen a pinned value, by letting two poll rounds pass.
fn let_reports_refresh() {
    std::thread::sleep(Duration::from_millis(600));
}

#[test]
fn an_admission_rejection_in_the_first_bucket_advances_and_all_rejected_is_a_503_listing_each() {
    let d = Deployment::start("admission_buckets", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        plain_with(
            sims,
            json!([
                {"id": "small", "limits": {"max": 1000}, "groups": {"plain": {"worker_ids": ["A"],
                    "policy": {"type": "power_of_two", "admission": {"max_running_requests": 8}}}}},
                {"id": "big", "limits": {"max": 100000}, "groups": {"plain": {"worker_ids": ["B"],
                    "policy": {"type": "load_based", "admission": {"max_waiting_requests": 4}}}}}
            ]),
        )
    });
    d.wait_for_service(2);
    let r = d.chat(&chat_body("hi", 1, false));
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("small"), "A"));

    d.sim("A").control(json!({"pin": {"running": 8}}));
    let_reports_refresh();
    let r = d.chat(&chat_body("hi", 1, false));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-bucket"), r.engine().as_str()), (Some("big"), "B"), "advanced to the next bucket");

    d.sim("B").control(json!({"pin": {"waiting": 4}}));
    let_reports_refresh();
    let r = d.chat(&chat_body("hi", 1, false));
    assert_eq!(r.status, 503, "{}", r.body);
    let e = r.json();
    assert_eq!(e["error"]["type"], "AdmissionRejected");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("small/plain/A: max_running_requests"), "{message}");
    assert!(message.contains("big/plain/B: max_waiting_requests"), "{message}");
    assert!(
        d.envoy.metric("sgl_router_admission_rejections_total{limit=\"max_running_requests\"}").unwrap_or(0.0) >= 2.0
    );
    assert!(d.envoy.metric("sgl_router_requests_total{outcome=\"AdmissionRejected\"}").unwrap_or(0.0) >= 1.0);
}

#[test]
fn a_body_over_32_mib_is_a_413_from_the_filter() {
    // The engine prefills at once: a 31 MiB prompt would otherwise take minutes of simulated work.
    let mut engine = SimSpec::plain("A");
    engine.extra = vec!["--prefill-tps".into(), "1e12".into()];
    let d = Deployment::start("too_large", vec![engine], |sims| {
        plain_with(sims, json!([{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]))
    });
    let big = "x".repeat(33 * 1024 * 1024);
    let r = d.chat(&chat_body(&big, 1, false));
    assert_eq!(r.status, 413, "{}", &r.body[..r.body.len().min(300)]);
    let v = r.json();
    assert_eq!((v["error"]["type"].as_str(), v["error"]["code"].as_u64()), (Some("payload_too_large"), Some(413)));
    assert_eq!(d.sim("A").state()["served"], 0);
    // A body just under the limit is routed.
    let fits = "x".repeat(31 * 1024 * 1024);
    assert_eq!(d.chat(&chat_body(&fits, 1, false)).status, 200);
}

#[test]
fn power_of_two_avoids_an_engine_with_a_long_reported_waiting_queue() {
    let d = Deployment::start("p2c_queue", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        plain_with(sims, json!([{"id": "all", "groups": {"plain": {"policy": {"type": "power_of_two"}}}}]))
    });
    d.wait_for_service(2);
    d.sim("A").control(json!({"pin": {"waiting": 50}}));
    let_reports_refresh();
    let counts = d.served_counts(20);
    assert_eq!(counts.get("B"), Some(&20), "{counts:?}");
    assert!(d.envoy.metric("sgl_router_picks_total{stage=\"plain\",worker=\"B\"}").unwrap_or(0.0) >= 20.0);
}

#[test]
fn a_stale_report_fails_open_and_falls_back_to_router_local_counts() {
    let d = Deployment::start("stale_report", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        plain_with(
            sims,
            json!([{"id": "all", "groups": {"plain": {"policy": {"type": "power_of_two", "admission": {"max_waiting_requests": 10}}}}}]),
        )
    });
    d.wait_for_service(2);
    // A is over its cap and B has a short queue: everything goes to B, and A alone is rejected.
    d.sim("A").control(json!({"pin": {"waiting": 50}}));
    d.sim("B").control(json!({"pin": {"waiting": 5}}));
    let_reports_refresh();
    assert_eq!(d.served_counts(10).get("B"), Some(&10));

    // Only A's load endpoint fails: its report goes stale and is never reused.
    d.sim("A").control(json!({"loads": {"status": 500}}));
    wait_for("A's report to go stale", Duration::from_secs(10), || {
        (d.envoy.metric("sgl_router_fresh_load_report{worker=\"A\"}")? == 0.0).then_some(())
    });
    std::thread::sleep(Duration::from_millis(300));
    // Unknown is not zero load (A would win every comparison against B's 5) and not the old 50
    // (A would lose every one): both sampled engines are compared by router-local counts, which
    // are equal, so both serve; and A's stale cap no longer rejects.
    let counts = d.served_counts(40);
    assert!(counts.get("A").copied().unwrap_or(0) >= 5, "{counts:?}");
    assert!(counts.get("B").copied().unwrap_or(0) >= 5, "{counts:?}");
}

#[test]
fn in_flight_counts_rise_under_mixed_traffic_and_all_return_to_zero() {
    let specs = vec![
        SimSpec::plain("A").model("plain-model"),
        SimSpec::plain("B").model("plain-model"),
        SimSpec::prefill("P1"),
        SimSpec::prefill("P2"),
        SimSpec::decode("D1"),
    ];
    let d = Deployment::start("mixed_traffic", specs, |sims| {
        let mut router = pd_router(sims, &[("pd", 0, 1_000_000, 2_000_000, &["P1", "P2"], &["D1"])]);
        router["models"]["plain-model"] =
            json!({"buckets": [{"id": "plain", "groups": {"plain": {"policy": {"type": "load_based"}}}}]});
        router
    });
    for sim in &d.sims {
        sim.control(json!({"token_delay_ms": 10}));
    }
    // P2 fails every prefill: about half the PD requests end in PrefillFailed.
    d.sim("P2").control(json!({"chat": {"status": 500}}));
    d.wait_for_service(5);

    let workers = ["A", "B", "P1", "P2", "D1"];
    let stop = Arc::new(AtomicBool::new(false));
    let max_seen = {
        let url = d.envoy.admin_port;
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut max = 0.0f64;
            while !stop.load(Ordering::SeqCst) {
                if let Ok(mut r) = agent().get(&format!("http://127.0.0.1:{url}/stats/prometheus")).call() {
                    let text = r.body_mut().read_to_string().unwrap_or_default();
                    for l in text.lines().filter(|l| l.starts_with("sgl_router_inflight{")) {
                        max = max.max(l.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            max
        })
    };

    let url = d.envoy.url("/v1/chat/completions");
    let clients: Vec<_> = (0..10)
        .map(|c| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut outcomes: HashMap<u16, usize> = HashMap::new();
                for i in 0..50 {
                    let kind = (c * 50 + i) % 5;
                    let mut body = chat_body(&format!("client {c} request {i}"), 20, kind % 2 == 1);
                    if kind >= 3 {
                        body["model"] = json!("plain-model");
                    }
                    let response =
                        agent().post(&url).header("content-type", "application/json").send(body.to_string()).unwrap();
                    let status = response.status().as_u16();
                    let mut reader = response.into_body().into_reader();
                    if kind == 4 {
                        // Abort a stream midway: read a little, then hang up.
                        let mut first = [0u8; 64];
                        let _ = reader.read(&mut first);
                        drop(reader);
                    } else {
                        let mut rest = String::new();
                        let _ = reader.read_to_string(&mut rest);
                    }
                    *outcomes.entry(status).or_default() += 1;
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes: HashMap<u16, usize> = HashMap::new();
    for c in clients {
        for (status, n) in c.join().unwrap() {
            *outcomes.entry(status).or_default() += n;
        }
    }
    std::thread::sleep(Duration::from_millis(1200));
    stop.store(true, Ordering::SeqCst);
    let max = max_seen.join().unwrap();

    assert_eq!(outcomes.values().sum::<usize>(), 500);
    // Every plain request succeeds (aborted streams started with 200); the failing prefill engine
    // answers at once and so looks least loaded, which is why PD failures can exceed half.
    assert!(outcomes.get(&200).copied().unwrap_or(0) >= 200, "{outcomes:?}");
    assert!(outcomes.get(&502).copied().unwrap_or(0) >= 20, "prefill failures happened: {outcomes:?}");
    assert!(max > 0.0, "in-flight counts rose above zero during the run");
    d.wait_for_idle(&workers);
}

#[test]
fn the_circuit_breaker_opens_on_consecutive_failures_and_a_probe_closes_it() {
    let d = Deployment::start("breaker", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        let mut router =
            plain_with(sims, json!([{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]));
        router["circuit_breaker"] = json!({"failure_threshold": 2, "cooldown_ms": 1500});
        router
    });
    d.sim("A").control(json!({"chat": {"status": 500}}));
    let mut failures = 0;
    for i in 0..8 {
        let r = d.chat(&chat_body(&format!("q{i}"), 1, false));
        if r.status == 500 {
            failures += 1;
        }
    }
    assert_eq!(failures, 2, "A is taken out after two consecutive failures");
    d.sim("A").control(json!({"chat": {"status": null}}));
    assert_eq!(d.served_counts(6).get("B"), Some(&6), "open: A gets nothing during the cool-down");
    std::thread::sleep(Duration::from_millis(1600));
    wait_for("the probe to close A's breaker", Duration::from_secs(10), || {
        d.served_counts(4).contains_key("A").then_some(())
    });
    let counts = d.served_counts(10);
    assert_eq!((counts.get("A"), counts.get("B")), (Some(&5), Some(&5)), "closed again: {counts:?}");
}

/// Sends a chat request from another thread; its engine arrives on the returned handle.
fn chat_in_background(d: &Deployment, content: String, max_tokens: u64) -> std::thread::JoinHandle<String> {
    let url = d.envoy.url("/v1/chat/completions");
    std::thread::spawn(move || {
        let body = chat_body(&content, max_tokens, false);
        let mut r = agent().post(&url).header("content-type", "application/json").send(body.to_string()).unwrap();
        let engine = r.headers().get("x-sgl-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
        let _ = r.body_mut().read_to_string();
        engine
    })
}

#[test]
fn a_cold_prompt_avoids_the_engine_the_router_knows_is_still_prefilling() {
    // Engines that report no prefill queue (SGLang's /get_load), with a slow prefill: only the
    // router's own estimate of what it sent says that A is busy prefilling a long prompt.
    let slow = |id: &str| SimSpec { extra: vec!["--prefill-tps".into(), "2000".into()], ..SimSpec::plain(id) };
    let d = Deployment::start("pending_prefill", vec![slow("A"), slow("B")], |sims| {
        let mut router = plain_with(
            sims,
            json!([{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "min_hit_tokens": 64}}}}]),
        );
        router["load"] = json!({"source": "sglang_get_load", "interval_ms": 100, "stale_after_ms": 1000,
                                "prefill_tokens_per_s": 2000});
        router
    });
    d.wait_for_service(2);
    // A: ~4,000 tokens to prefill (2 s); B: a short prompt decoding for a while. One request each.
    let long = chat_in_background(&d, "lorem ipsum ".repeat(1_350), 1);
    std::thread::sleep(Duration::from_millis(100));
    let short = chat_in_background(&d, "a short question".into(), 1_000);
    let_reports_refresh();
    let engines =
        d.sims.iter().map(|s| s.state()["running"].as_u64().unwrap_or(0) + s.state()["waiting"].as_u64().unwrap_or(0));
    assert_eq!(engines.collect::<Vec<_>>(), vec![1, 1], "one request on each engine, as reported");
    // Equal reports, equal in-flight counts: only the pending prefill tells them apart.
    let r = d.chat(&chat_body(&"a new topic ".repeat(100), 1, false));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.engine(), "B", "the cold prompt must not queue behind A's 2 s prefill");
    assert_eq!(long.join().unwrap(), "A");
    assert_eq!(short.join().unwrap(), "B");
}

/// Issue 29: two engines that report only basic load, one four times slower to prefill than the
/// other and both slower than the configured rate. The filters learn each engine's speed from the
/// first bytes of its streamed answers and send the slow one less of the prefill; the service
/// exports what they learned.
#[test]
fn the_router_learns_which_engine_prefills_slower_and_sends_it_less_prefill() {
    let with_rate = |id: &str, tps: &str| SimSpec {
        token_delay_ms: 1,
        extra: vec!["--prefill-tps".into(), tps.into()],
        ..SimSpec::plain(id)
    };
    let d = Deployment::start("learned_speed", vec![with_rate("F", "8000"), with_rate("S", "2000")], |sims| {
        json!({
            "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
            "load": {"source": "sglang_get_load", "interval_ms": 100, "prefill_tokens_per_s": 20000},
            "models": {"demo-model": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware"}}}}]}}
        })
    });
    d.wait_for_service(2);
    // Every prompt new (nothing to hit): where each goes is the load side's choice alone.
    // Of several lengths, so the time a token takes shows apart from the time any answer takes.
    let prompt =
        |i: usize| (0..[60, 150, 300, 450][i % 4]).map(|j| format!("r{i:04}w{j:03}")).collect::<Vec<_>>().join(" ");
    let round = |first: usize, n: usize, clients: usize| -> HashMap<String, usize> {
        let next = std::sync::atomic::AtomicUsize::new(first);
        let served: Vec<String> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..clients)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::SeqCst);
                            if i >= first + n {
                                return mine;
                            }
                            let r = d.chat(&chat_body(&prompt(i), 2, true));
                            assert_eq!(r.status, 200, "{}", r.body);
                            mine.push(r.engine());
                        }
                    })
                })
                .collect();
            workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
        });
        let mut counts = HashMap::new();
        for e in served {
            *counts.entry(e).or_default() += 1;
        }
        counts
    };
    // Until the first answers come back the two look alike.
    let learning = round(0, 24, 2);
    assert!(learning.get("S").copied().unwrap_or(0) >= 1, "the slow engine is tried while unknown: {learning:?}");
    // One at a time, so every engine is idle when asked and the choice is the speeds' alone: with
    // both assumed at the configured rate the short prompts' waits look alike and new prompts are
    // spread; learned, the slow engine's wait is four times the fast one's. (With two or more at
    // a time the fast engine's queue shows in its first bytes as a time any answer takes, and the
    // split wanders toward the speeds' 4 : 1 — the unlearned one.)
    let learned = round(24, 48, 1);
    let (f, s) = (learned.get("F").copied().unwrap_or(0), learned.get("S").copied().unwrap_or(0));
    assert!(s * 4 < f, "the slow engine gets well under a fifth of the prefill: {learned:?}");
    let gauge = |name: &str, w: &str| d.envoy.metric(&format!("sgl_router_{name}{{worker=\"{w}\"}}"));
    let first_byte_ms = |w: &str, tokens: f64| -> Option<f64> {
        let rate = gauge("prefill_tokens_per_s", w).filter(|r| *r > 0.0)?;
        Some(gauge("first_byte_overhead_ms", w)? + tokens * 1000.0 / rate)
    };
    // What the filters route on, exported: the slow engine takes longer to a first byte at the
    // lengths it was timed on. Sent little once its first answers came back, it may have been
    // timed on one length only, which cannot tell its rate from a fixed delay: the rate exported
    // then is the fleet's and the delay carries the rest, so the gauges are read together.
    let at = |tokens| Some((first_byte_ms("F", tokens)?, first_byte_ms("S", tokens)?));
    wait_for("the learned speeds exported", Duration::from_secs(5), || {
        let timed = |w| gauge("prefill_tokens_per_s", w).is_some_and(|r| r != 20_000.0);
        (at(150.0).is_some() && timed("F") && timed("S")).then_some(())
    });
    for tokens in [150.0, 1_100.0] {
        let (fast, slow) = at(tokens).unwrap();
        assert!(slow > fast, "first byte of {tokens} tokens: F {fast} ms, S {slow} ms");
    }
}

/// A streamed chat request in the background; its status when it is done.
fn streamed(d: &Deployment, content: String) -> std::thread::JoinHandle<u16> {
    let url = d.envoy.url("/v1/chat/completions");
    std::thread::spawn(move || {
        let body = chat_body(&content, 2, true);
        let mut r = agent().post(&url).header("content-type", "application/json").send(body.to_string()).unwrap();
        let status = r.status().as_u16();
        let _ = r.body_mut().read_to_string();
        status
    })
}

/// One engine prefilling 2,000 tokens/s (`--prefill-batching` when `batching`), behind a
/// cache-aware policy with `hold_for_prefix` as `hold` gives it (absent: the default).
fn hold_deployment(name: &str, batching: bool, hold: Option<Value>) -> Deployment {
    let mut extra = vec!["--prefill-tps".into(), "2000".into()];
    if batching {
        extra.push("--prefill-batching".into());
    }
    let slow = SimSpec { token_delay_ms: 1, extra, ..SimSpec::plain("A") };
    let d = Deployment::start(name, vec![slow], |sims| {
        let mut policy = json!({"type": "cache_aware", "min_hit_tokens": 64});
        if let Some(hold) = hold {
            policy["hold_for_prefix"] = hold;
        }
        let mut router = plain_with(sims, json!([{"id": "all", "groups": {"plain": {"policy": policy}}}]));
        router["load"] = json!({"source": "sglang_get_load", "interval_ms": 100, "prefill_tokens_per_s": 2000});
        router
    });
    d.wait_for_service(1);
    d
}

/// Work ahead of a system prompt (`system`'s words) at the engine, then a request hitting that
/// prompt, then another once nothing is ahead of it any more; how many requests were held, when
/// all are answered.
fn hits_behind_work(d: &Deployment, system: &str) -> f64 {
    let holds = || d.envoy.metric("sgl_router_prefix_hold_ms_count{}").unwrap_or(0.0);
    let before = holds();
    // Work ahead: about half a second of prefill, none of it cached. Then the prefix, queued behind it.
    let ahead = streamed(d, format!("ahead of {system}: {}", "lorem ipsum ".repeat(500)));
    let system = format!("{system} ").repeat(60);
    std::thread::sleep(Duration::from_millis(100));
    let first = streamed(d, format!("{system} first"));
    // The prefix reaches every VM's index.
    std::thread::sleep(Duration::from_millis(150));
    let sibling = streamed(d, format!("{system} second"));
    assert_eq!([ahead, first, sibling].map(|h| h.join().unwrap()), [200; 3]);
    // Nothing ahead of the prefix now: the next sibling goes at once.
    assert_eq!(streamed(d, format!("{system} third")).join().unwrap(), 200);
    // Envoy merges its workers' histograms when it flushes stats, every 5 s.
    std::thread::sleep(Duration::from_secs(6));
    holds() - before
}

/// SGLang matches its cache when it schedules a request, so a request sent while the one that
/// brings its prefix still waits behind other work would be scheduled with it and prefill the
/// prefix again. The filter holds it until the engine has answered that work, and only then.
#[test]
fn a_hit_waits_at_the_router_until_its_engine_started_on_the_prefix() {
    let d = hold_deployment("prefix_hold", false, Some(json!("always")));
    assert_eq!(hits_behind_work(&d, "a shared system prompt"), 1.0, "the sibling held, the third not");
}

/// By default the filter holds only at an engine whose first bytes showed it batching, or that
/// no first byte has timed yet: requests that waited there together answer together. Rounds of
/// four distinct prompts at once: the first has the prefill lane to itself, the other three wait
/// for its next turn.
#[test]
fn by_default_a_hit_is_held_only_at_an_engine_seen_to_batch_its_prefill() {
    for batching in [true, false] {
        let d = hold_deployment("prefix_hold_auto", batching, None);
        assert_eq!(hits_behind_work(&d, "a first system prompt"), 1.0, "untimed, batching: {batching}");
        let seen = || d.envoy.metric(r#"sgl_router_prefill_batches{worker="A"}"#);
        for round in 0..6 {
            let all: Vec<_> =
                (0..4).map(|i| streamed(&d, format!("round {round} prompt {i} {}", "lorem ".repeat(150)))).collect();
            assert!(all.into_iter().all(|h| h.join().unwrap() == 200));
        }
        // The service publishes its gauges every second.
        let pct = wait_for("the verdict exported", Duration::from_secs(5), || {
            let pct = d.envoy.metric(r#"sgl_router_batched_first_bytes_pct{worker="A"}"#)?;
            (seen()? == f64::from(u8::from(batching))).then_some(pct)
        });
        if batching {
            assert!(pct >= 20.0, "{pct} % of pairs together");
        } else {
            assert_eq!(pct, 0.0, "one prefill at a time never answers two together");
        }
        assert_eq!(
            hits_behind_work(&d, "a second system prompt"),
            f64::from(u8::from(batching)),
            "batching: {batching}"
        );
    }
}
