//! Flow control against real Envoy (spec §9), at `--concurrency 2` unless a test says otherwise:
//! requests every engine's admission refused wait in the queue, across both worker VMs, in class
//! and fair-share order, behind only the requests that compete for their engines, and leave it
//! with a 429 when it is full, their wait ran out or could not end in time, or at once when their
//! client goes.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::{self, sleep};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Two engines that each take `cap` requests at a time, and a queue.
fn queued(name: &str, token_delay_ms: u64, cap: u64, queue: Value) -> Deployment {
    let specs = ["A", "B"].map(|id| SimSpec { token_delay_ms, ..SimSpec::plain(id) }).to_vec();
    Deployment::start(name, specs, |sims| {
        let mut router = plain_router(sims);
        router["load"] = json!({"source": "none"});
        router["queue"] = queue;
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "load_based", "admission": {"max_inflight_requests": cap}});
        router
    })
}

/// One engine that takes one request at a time, a queue, and Envoy on one worker thread.
fn one_engine(name: &str, specs: Vec<SimSpec>, queue: Value) -> Deployment {
    Deployment::start_on(name, 1, specs, |sims| {
        let mut router = plain_router(sims);
        router["load"] = json!({"source": "none"});
        router["queue"] = queue;
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "round_robin", "admission": {"max_inflight_requests": 1}});
        router
    })
}

/// `n` requests at once, each on its own connection with its own headers; each reply and how long
/// it took, in the order given.
fn burst(d: &Deployment, requests: Vec<(Value, Vec<(String, String)>)>) -> Vec<(Reply, Duration)> {
    let start = Arc::new(Barrier::new(requests.len()));
    let url = d.envoy.url("/v1/chat/completions");
    let handles: Vec<_> = requests
        .into_iter()
        .map(|(body, headers)| {
            let (start, url) = (Arc::clone(&start), url.clone());
            thread::spawn(move || {
                start.wait();
                let began = Instant::now();
                let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let reply = send(&url, "POST", Some(&body), &headers);
                (reply, began.elapsed())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

fn header(name: &str, value: &str) -> (String, String) {
    (name.to_string(), value.to_string())
}

#[test]
fn forty_requests_on_four_slots_all_complete_within_the_wait() {
    let d = queued("queue_forty", 5, 2, json!({"max_requests": 64, "max_wait_ms": 5000}));
    // Each takes about 100 ms on its engine; four at a time, so the last waits about a second.
    let requests = (0..40).map(|i| (chat_body(&format!("request {i}"), 20, false), vec![])).collect();
    let replies = burst(&d, requests);
    for (reply, took) in &replies {
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(*took < Duration::from_millis(5000), "waited {took:?}");
    }
    // Envoy merges histograms at its stats flush, every five seconds.
    wait_for("most requests' waits sampled", Duration::from_secs(12), || {
        (d.envoy.metric("sgl_router_queue_wait_ms_count{class=\"standard\"}")? >= 20.0).then_some(())
    });
    let served: u64 = ["A", "B"].iter().map(|id| d.sim(id).state()["served"].as_u64().unwrap()).sum();
    assert_eq!(served, 40);
    wait_for("the queue to be empty", Duration::from_secs(5), || {
        (d.envoy.metric("sgl_router_queue_depth{model=\"demo-model\"}")? == 0.0).then_some(())
    });
}

#[test]
fn interactive_requests_wait_less_than_the_standard_ones_median() {
    let queue = json!({"max_requests": 64, "max_wait_ms": 10000,
        "classes": {"interactive": {"priority": 5}, "standard": {}}});
    let d = queued("queue_priority", 5, 1, queue);
    let mut requests: Vec<_> = (0..24).map(|i| (chat_body(&format!("low {i}"), 20, false), vec![])).collect();
    requests.extend(
        (0..6).map(|i| (chat_body(&format!("high {i}"), 20, false), vec![header("x-sgl-class", "interactive")])),
    );
    let replies = burst(&d, requests);
    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let low_median = median(replies[..24].iter().map(|(_, t)| *t).collect());
    for (_, took) in &replies[24..] {
        assert!(*took < low_median, "a high-priority request took {took:?}, the low ones' median {low_median:?}");
    }
}

#[test]
fn a_light_tenant_waits_no_longer_than_a_heavy_one() {
    let d = queued("queue_tenants", 5, 1, json!({"max_requests": 64, "max_wait_ms": 10000}));
    let mut requests: Vec<_> =
        (0..30).map(|i| (chat_body(&format!("heavy {i}"), 20, false), vec![header("x-sgl-tenant", "heavy")])).collect();
    requests
        .extend((0..3).map(|i| (chat_body(&format!("light {i}"), 20, false), vec![header("x-sgl-tenant", "light")])));
    let replies = burst(&d, requests);
    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let heavy = median(replies[..30].iter().map(|(_, t)| *t).collect());
    let light = median(replies[30..].iter().map(|(_, t)| *t).collect());
    assert!(light <= heavy, "light tenant's median {light:?}, heavy tenant's {heavy:?}");
}

/// Sends `n` long requests in the background; they hold both engines' slots, then wait. They go
/// further apart than the VMs exchange their counts, so no VM dispatches on a count that is behind
/// (a cap can be exceeded by what another VM dispatched within one exchange: see `SharedInflight`).
fn occupy(d: &Deployment, n: usize) -> Vec<thread::JoinHandle<Reply>> {
    let url = d.envoy.url("/v1/chat/completions");
    (0..n)
        .map(|i| {
            let url = url.clone();
            sleep(Duration::from_millis(30));
            thread::spawn(move || send(&url, "POST", Some(&chat_body(&format!("long {i}"), 20, false)), &[]))
        })
        .collect()
}

fn depth(d: &Deployment) -> Option<f64> {
    d.envoy.metric("sgl_router_queue_depth{model=\"demo-model\"}")
}

#[test]
fn a_full_queue_answers_429_queue_full_and_an_expired_wait_429_queue_timeout() {
    // Each request holds its engine for about two seconds; the wait is at most one.
    let d = queued("queue_full", 100, 1, json!({"max_requests": 3, "max_wait_ms": 1000}));
    let held = occupy(&d, 5);
    wait_for("three requests waiting", Duration::from_secs(5), || (depth(&d)? == 3.0).then_some(()));
    let full = d.chat(&chat_body("one too many", 1, false));
    assert_eq!(full.status, 429, "{}", full.body);
    assert_eq!(full.json()["error"]["type"], "queue_full");
    assert_eq!(full.header("retry-after"), Some("1"));
    let replies: Vec<Reply> = held.into_iter().map(|h| h.join().unwrap()).collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 2, "{statuses:?}");
    for r in replies.iter().filter(|r| r.status != 200) {
        assert_eq!((r.status, r.json()["error"]["type"].as_str()), (429, Some("queue_timeout")), "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    let counted = |reason: &str| {
        d.envoy.metric(&format!("sgl_router_queue_rejections_total{{reason=\"{reason}\",class=\"standard\"}}"))
    };
    assert_eq!(counted("queue_full"), Some(1.0));
    assert_eq!(counted("queue_timeout"), Some(3.0));
}

#[test]
fn a_client_that_leaves_while_queued_is_never_dispatched() {
    let d = queued("queue_gone", 100, 1, json!({"max_requests": 8, "max_wait_ms": 10000}));
    let held = occupy(&d, 2);
    wait_for("both engines busy", Duration::from_secs(5), || {
        let running: u64 = ["A", "B"].iter().map(|id| d.sim(id).state()["running"].as_u64().unwrap_or(0)).sum();
        (running == 2).then_some(())
    });
    let impatient: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(Duration::from_millis(300))).build().into();
    let gone = impatient
        .post(&d.envoy.url("/v1/chat/completions"))
        .header("x-request-id", "gone-while-queued")
        .header("content-type", "application/json")
        .send(chat_body("I will not wait", 1, false).to_string());
    assert!(gone.is_err(), "the client gave up while the request waited");
    wait_for("the departure counted", Duration::from_secs(5), || {
        let n = d.envoy.metric("sgl_router_queue_rejections_total{reason=\"client_gone\",class=\"standard\"}")?;
        (n == 1.0).then_some(())
    });
    wait_for("the queue empty", Duration::from_secs(5), || (depth(&d)? == 0.0).then_some(()));
    for h in held {
        assert_eq!(h.join().unwrap().status, 200);
    }
    // The engines freed and took more since: the departed request is not among what they saw.
    let after = d.chat(&chat_body("after", 1, false));
    assert_eq!(after.status, 200);
    sleep(Duration::from_millis(200));
    for id in ["A", "B"] {
        let state = d.sim(id).state();
        let ids: Vec<&str> = state["recent"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["headers"].as_array().into_iter().flatten())
            .filter(|h| h[0] == "x-request-id")
            .filter_map(|h| h[1].as_str())
            .collect();
        assert!(!ids.contains(&"gone-while-queued"), "{id} saw the departed request: {ids:?}");
    }
}

#[test]
fn without_a_queue_a_full_house_is_503_at_once() {
    let specs = vec![SimSpec { token_delay_ms: 100, ..SimSpec::plain("A") }];
    let d = Deployment::start("queue_none", specs, |sims| {
        let mut router = plain_router(sims);
        router["load"] = json!({"source": "none"});
        router["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "round_robin", "admission": {"max_inflight_requests": 1}});
        router
    });
    let held = occupy(&d, 1);
    wait_for("the engine busy", Duration::from_secs(5), || {
        (d.sim("A").state()["running"].as_u64()? == 1).then_some(())
    });
    let refused = d.chat(&chat_body("no room", 1, false));
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.json()["error"]["type"], "AdmissionRejected");
    assert_eq!(held.into_iter().next().unwrap().join().unwrap().status, 200);
}

/// `n` requests sent one after another, `gap` apart, each on its own connection, each reply with
/// its rank among the replies (0 = first to complete).
fn staggered(d: &Deployment, requests: Vec<(Value, Vec<(String, String)>)>, gap: Duration) -> Vec<(Reply, usize)> {
    let done = Arc::new(AtomicUsize::new(0));
    let url = d.envoy.url("/v1/chat/completions");
    let handles: Vec<_> = requests
        .into_iter()
        .map(|(body, headers)| {
            let (done, url) = (Arc::clone(&done), url.clone());
            let h = thread::spawn(move || {
                let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let reply = send(&url, "POST", Some(&body), &headers);
                (reply, done.fetch_add(1, Ordering::SeqCst))
            });
            sleep(gap);
            h
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A short bucket (engine S) and a long one (engine L) that short requests fit too, one request
/// at a time on each. A long request waits for L behind another; short requests that arrive
/// after it go to S at once, on any worker thread, and all complete before the long one that
/// waits: it holds back only what competes for L.
fn a_short_request_passes_a_long_one_waiting_for_its_own_engine(concurrency: u32) {
    let specs = vec![
        SimSpec { token_delay_ms: 2, ..SimSpec::plain("S") },
        SimSpec { token_delay_ms: 100, ..SimSpec::plain("L") },
    ];
    let d = Deployment::start_on(&format!("queue_hol_{concurrency}"), concurrency, specs, |sims| {
        let mut router = plain_router(sims);
        router["load"] = json!({"source": "none"});
        router["queue"] = json!({"max_requests": 16, "max_wait_ms": 20000});
        let group = |id: &str| json!({"plain": {"worker_ids": [id], "policy": {"type": "round_robin", "admission": {"max_inflight_requests": 1}}}});
        router["models"]["demo-model"]["buckets"] = json!([
            {"id": "short", "limits": {"max": 256}, "groups": group("S")},
            {"id": "long", "groups": group("L")},
        ]);
        router
    });
    let long = |i: usize| (chat_body(&format!("long {i} {}", "x".repeat(2000)), 20, false), vec![]);
    let short = |i: usize| (chat_body(&format!("short {i}"), 4, false), vec![]);
    // Four long ones (each ~2 s on L, so three wait, more than there are threads), then six short
    // ones.
    let mut requests: Vec<_> = (0..4).map(long).collect();
    requests.extend((0..6).map(short));
    let replies = staggered(&d, requests, Duration::from_millis(40));
    for (reply, _) in &replies {
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let ranks: Vec<usize> = replies.iter().map(|(_, rank)| *rank).collect();
    assert!(ranks[4..].iter().all(|r| *r < 6), "every short one completed before every long one: {ranks:?}");
    assert_eq!(replies.iter().filter(|(r, _)| r.header("x-sgl-worker") == Some("S")).count(), 6);
    let waited = d.envoy.metric("sgl_router_queue_rejections_total{reason=\"queue_timeout\",class=\"standard\"}");
    assert_eq!(waited.unwrap_or(0.0), 0.0);
}

#[test]
fn a_short_request_passes_a_long_one_waiting_for_its_own_engine_on_one_thread() {
    a_short_request_passes_a_long_one_waiting_for_its_own_engine(1);
}

#[test]
fn a_short_request_passes_a_long_one_waiting_for_its_own_engine_on_two_threads() {
    a_short_request_passes_a_long_one_waiting_for_its_own_engine(2);
}

/// One engine, one request at a time. Requests of three classes queue behind the one it serves:
/// each interactive one before each standard one (an unknown class is standard), each standard
/// one before each batch one, whatever order they came in.
#[test]
fn classes_are_served_in_priority_order_and_an_unknown_class_is_the_default() {
    let queue = json!({"max_requests": 64, "max_wait_ms": 20000,
        "classes": {"interactive": {"priority": 10}, "standard": {}, "batch": {"priority": -10}}});
    let specs = vec![SimSpec { token_delay_ms: 20, ..SimSpec::plain("A") }];
    let d = one_engine("queue_classes", specs, queue);
    let as_class =
        |class: &str, i: usize| (chat_body(&format!("{class} {i}"), 10, false), vec![header("x-sgl-class", class)]);
    // The first holds the engine about 800 ms, while the others all arrive.
    let mut requests = vec![(chat_body("first", 40, false), vec![])];
    requests.extend((0..3).map(|i| as_class("batch", i)));
    requests.extend((0..3).map(|i| as_class("no-such-class", i)));
    requests.extend((0..3).map(|i| as_class("interactive", i)));
    let replies = staggered(&d, requests, Duration::from_millis(30));
    assert!(replies.iter().all(|(r, _)| r.status == 200));
    let rank = |range: std::ops::Range<usize>| replies[range].iter().map(|(_, r)| *r).collect::<Vec<_>>();
    let (batch, unknown, interactive) = (rank(1..4), rank(4..7), rank(7..10));
    assert!(interactive.iter().max() < unknown.iter().min(), "{interactive:?} before {unknown:?}");
    assert!(unknown.iter().max() < batch.iter().min(), "{unknown:?} before {batch:?}");
    // Envoy merges histograms at its stats flush, every five seconds.
    wait_for("the interactive waits sampled", Duration::from_secs(12), || {
        (d.envoy.metric("sgl_router_queue_wait_ms_count{class=\"interactive\"}")? >= 3.0).then_some(())
    });
}

/// A client that makes up a tenant value per request against one that sends its own: the
/// made-up values share one clock, so the honest tenant's median place is no later than the
/// spoofer's.
#[test]
fn a_tenant_value_made_up_per_request_gains_nothing_over_an_honest_tenant() {
    let d = queued("queue_spoof", 5, 1, json!({"max_requests": 64, "max_wait_ms": 20000}));
    let mut requests: Vec<_> = (0..24)
        .map(|i| (chat_body(&format!("spoof {i}"), 20, false), vec![header("x-sgl-tenant", &format!("made-up-{i}"))]))
        .collect();
    requests
        .extend((0..8).map(|i| (chat_body(&format!("honest {i}"), 20, false), vec![header("x-sgl-tenant", "honest")])));
    let replies = burst(&d, requests);
    assert!(replies.iter().all(|(r, _)| r.status == 200));
    // Ranked by when each completed: two engines, one request each at a time.
    let mut ends: Vec<(Duration, bool)> = replies.iter().enumerate().map(|(i, (_, t))| (*t, i >= 24)).collect();
    ends.sort();
    let places = |honest: bool| ends.iter().enumerate().filter(|(_, e)| e.1 == honest).map(|(p, _)| p).collect();
    let (spoofer, honest): (Vec<usize>, Vec<usize>) = (places(false), places(true));
    let median = |v: &Vec<usize>| v[v.len() / 2];
    assert!(median(&honest) <= median(&spoofer), "honest places {honest:?}, spoofer's {spoofer:?}");
}

/// One engine that takes about 400 ms a request, and a class that waits at most a second: once
/// the queue has seen its pace, a request with more ahead of it than a second's worth is refused
/// at once (`predicted`), and those it admits complete.
#[test]
fn a_request_that_cannot_be_served_within_its_class_wait_is_refused_at_once() {
    let queue = json!({"max_requests": 64, "max_wait_ms": 1000});
    let specs = vec![SimSpec { token_delay_ms: 20, ..SimSpec::plain("A") }];
    let d = one_engine("queue_predicted", specs, queue);
    // Arrivals for over seven seconds: the queue predicts once it has seen four services, which
    // a loaded machine (CI runs three suites at once) can stretch well past a second each.
    let requests = (0..120).map(|i| (chat_body(&format!("request {i}"), 20, false), vec![])).collect();
    let replies = staggered(&d, requests, Duration::from_millis(60));
    let predicted: Vec<&Reply> =
        replies.iter().map(|(r, _)| r).filter(|r| r.body.contains("an expected wait of")).collect();
    assert!(!predicted.is_empty(), "none refused as predicted");
    for r in &predicted {
        assert_eq!((r.status, r.json()["error"]["type"].as_str()), (429, Some("queue_timeout")), "{}", r.body);
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    wait_for("the refusals counted", Duration::from_secs(5), || {
        let n = d.envoy.metric("sgl_router_queue_rejections_total{reason=\"predicted\",class=\"standard\"}")?;
        (n == predicted.len() as f64).then_some(())
    });
    let served = replies.iter().filter(|(r, _)| r.status == 200).count();
    assert!(served >= 5, "{served} served");
}

/// Bodies of 32 MiB wait on one worker thread, as many as the queue holds: the VM keeps none of
/// them (Envoy does), reports their bytes, serves each in turn and stays alive.
#[test]
fn a_queue_full_of_the_largest_bodies_leaves_the_vm_alive_and_serving() {
    const WAITING: usize = 4;
    let queue = json!({"max_requests": WAITING, "max_wait_ms": 120000});
    // The engine prefills at once: a 32 MiB prompt would otherwise take minutes of simulated work.
    let specs = vec![SimSpec {
        token_delay_ms: 100,
        extra: vec!["--prefill-tps".into(), "1e12".into()],
        ..SimSpec::plain("A")
    }];
    let d = one_engine("queue_bytes", specs, queue);
    // Just under the 32 MiB limit with the JSON around it, encoded once.
    let big = Arc::new(chat_body(&"y".repeat(32 * 1024 * 1024 - 200), 2, false).to_string().into_bytes());
    let url = d.envoy.url("/v1/chat/completions");
    // It holds the engine until the bodies all wait, then the engine speeds up.
    let first = {
        let url = url.clone();
        thread::spawn(move || send(&url, "POST", Some(&chat_body("first", 1000, false)), &[]))
    };
    wait_for("the engine busy", Duration::from_secs(5), || {
        (d.sim("A").state()["running"].as_u64()? == 1).then_some(())
    });
    let waiting: Vec<_> = (0..WAITING)
        .map(|_| {
            let (url, body) = (url.clone(), Arc::clone(&big));
            thread::spawn(move || {
                let mut r = agent().post(&url).header("content-type", "application/json").send(&body[..]).unwrap();
                (r.status().as_u16(), r.body_mut().read_to_string().unwrap_or_default())
            })
        })
        .collect();
    let bytes = wait_for("the bodies waiting", Duration::from_secs(60), || {
        let depth = d.envoy.metric("sgl_router_queue_depth{model=\"demo-model\"}")?;
        (depth == WAITING as f64).then_some(())?;
        d.envoy.metric("sgl_router_queue_bytes{model=\"demo-model\"}")
    });
    assert!(bytes >= (WAITING * (32 * 1024 * 1024 - 200)) as f64, "{bytes} bytes reported");
    d.sim("A").control(json!({"token_delay_ms": 1}));
    assert_eq!(first.join().unwrap().status, 200);
    for h in waiting {
        let (status, body) = h.join().unwrap();
        assert_eq!(status, 200, "{body}");
    }
    // The engine's health checks may have timed out while it took the large bodies: once it is
    // back in service, the VM serves.
    wait_for("a request served after them", Duration::from_secs(15), || {
        (d.chat(&chat_body("after", 1, false)).status == 200).then_some(())
    });
    // V8 reports a trap as "Function: proxy_on_… failed: Uncaught …".
    assert!(!d.envoy.log_text().contains("Function: proxy_"), "the VM failed:\n{}", d.envoy.log_text());
}
