//! The simulator on its own: PD rooms, load reporting and fault injection, talked to directly.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn post(sim: &Sim, body: &Value) -> Reply {
    send(&sim.url("/v1/chat/completions"), "POST", Some(body), &[])
}

fn pd_body(prefill: &Sim, room: u64, stream: bool) -> Value {
    let mut b = chat_body("pd request", 4, stream);
    b["bootstrap_host"] = json!("127.0.0.1");
    b["bootstrap_port"] = json!(prefill.bootstrap_port.unwrap());
    b["bootstrap_room"] = json!(room);
    b
}

#[test]
fn decode_without_a_bootstrap_room_is_rejected_as_sglang_does() {
    let dir = scratch_dir("sim_no_room");
    let decode = Sim::start(SimSpec::decode("D"), &dir);
    let r = post(&decode, &chat_body("x", 2, false));
    assert_eq!(r.status, 400);
    assert!(r.body.contains("Disaggregated request received without bootstrap room id"), "{}", r.body);
    assert_eq!(r.engine(), "D");
}

#[test]
fn decode_answers_only_after_its_prefill_finished_the_room() {
    let dir = scratch_dir("sim_pd_order");
    let prefill = Sim::start(SimSpec::prefill("P"), &dir);
    let decode = Sim::start(SimSpec::decode("D"), &dir);
    let body = pd_body(&prefill, 42, true);
    let decode_url = decode.url("/v1/chat/completions");
    let decode_body = body.clone();
    let waiting = std::thread::spawn(move || {
        let r = send(&decode_url, "POST", Some(&decode_body), &[]);
        (r, Instant::now())
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!waiting.is_finished(), "decode answered before the prefill ran");
    let prefilled_at = Instant::now();
    let p = post(&prefill, &body);
    assert_eq!(p.status, 200, "{}", p.body);
    let (d, answered_at) = waiting.join().unwrap();
    assert_eq!(d.status, 200, "{}", d.body);
    assert!(answered_at >= prefilled_at);
    assert_eq!(sse_events(&d.body).last().map(String::as_str), Some("[DONE]"));
    assert_eq!(prefill.state()["rooms_finished"], 1);
}

#[test]
fn a_wrong_room_fails_the_decode_after_its_timeout() {
    let dir = scratch_dir("sim_wrong_room");
    let prefill = Sim::start(SimSpec::prefill("P"), &dir);
    let mut spec = SimSpec::decode("D");
    spec.bootstrap_timeout_ms = 300;
    let decode = Sim::start(spec, &dir);
    post(&prefill, &pd_body(&prefill, 1, false));
    let r = post(&decode, &pd_body(&prefill, 2, false));
    assert_eq!(r.status, 500);
    assert!(r.body.contains("room 2"), "{}", r.body);
    // A port nobody listens on: a clear error, not a hang.
    let mut body = pd_body(&prefill, 1, false);
    body["bootstrap_port"] = json!(free_port());
    let r = post(&decode, &body);
    assert_eq!(r.status, 500);
    assert!(r.body.contains("unreachable"), "{}", r.body);
}

#[test]
fn n_greater_than_one_waits_for_every_room() {
    let dir = scratch_dir("sim_rooms_n");
    let prefill = Sim::start(SimSpec::prefill("P"), &dir);
    let mut spec = SimSpec::decode("D");
    spec.bootstrap_timeout_ms = 300;
    let decode = Sim::start(spec, &dir);
    let mut body = pd_body(&prefill, 0, false);
    body["bootstrap_room"] = json!([7, 8]);
    body["n"] = json!(2);
    let mut only_seven = body.clone();
    only_seven["bootstrap_room"] = json!([7]);
    post(&prefill, &only_seven);
    assert_eq!(post(&decode, &body).status, 500, "room 8 was never prefilled");
    post(&prefill, &body);
    let r = post(&decode, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"].as_array().map(Vec::len), Some(2));
}

#[test]
fn reported_counts_are_the_real_requests_and_pins_override_them() {
    let dir = scratch_dir("sim_loads");
    let mut spec = SimSpec::plain("A");
    spec.max_running = 1;
    spec.token_delay_ms = 200;
    let sim = Sim::start(spec, &dir);
    let url = sim.url("/v1/chat/completions");
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || send(&url, "POST", Some(&chat_body("abcdabcd", 5, false)), &[]))
        })
        .collect();
    let loads = wait_for("one running, two waiting", Duration::from_secs(5), || {
        let v = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
        let l = v["loads"][0].clone();
        (l["num_running_reqs"] == 1 && l["num_waiting_reqs"] == 2).then_some(l)
    });
    assert_eq!(loads["num_waiting_uncached_tokens"], 4, "two waiting prompts of 2 tokens");
    let basic = send(&sim.url("/get_load"), "GET", None, &[]).json();
    assert_eq!((basic[0]["num_reqs"].as_u64(), basic[0]["num_waiting_reqs"].as_u64()), (Some(1), Some(2)));
    for t in threads {
        assert_eq!(t.join().unwrap().status, 200);
    }
    let idle = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
    assert_eq!(
        (idle["loads"][0]["num_running_reqs"].as_u64(), idle["loads"][0]["num_used_tokens"].as_u64()),
        (Some(0), Some(0))
    );

    sim.control(json!({"pin": {"running": 7, "waiting": 9, "kv_tokens": 1234}}));
    let pinned = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
    assert_eq!(pinned["loads"][0]["num_running_reqs"], 7);
    assert_eq!(pinned["loads"][0]["num_waiting_reqs"], 9);
    assert_eq!(pinned["loads"][0]["num_used_tokens"], 1234);
    let metrics = send(&sim.url("/metrics"), "GET", None, &[]).body;
    assert!(metrics.contains("sglang:num_running_reqs{") && metrics.contains("} 7\n"), "{metrics}");
    assert!(metrics.contains("sglang:num_queue_reqs{"), "{metrics}");
    sim.control(json!({"pin": null}));
    let unpinned = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
    assert_eq!(unpinned["loads"][0]["num_running_reqs"], 0);
}

#[test]
fn ranks_add_up_to_the_engine_totals() {
    let dir = scratch_dir("sim_ranks");
    let mut spec = SimSpec::plain("A");
    spec.dp_size = 2;
    let sim = Sim::start(spec, &dir);
    sim.control(json!({"pin": {"running": 3, "waiting": 1}}));
    let v = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
    let loads = v["loads"].as_array().unwrap();
    assert_eq!(loads.len(), 2);
    let running: u64 = loads.iter().map(|l| l["num_running_reqs"].as_u64().unwrap()).sum();
    assert_eq!(running, 3);
    assert_eq!(loads[1]["dp_rank"], 1);

    // Unpinned, each rank reports its own requests: one held on rank 1 shows there only.
    sim.control(json!({"pin": null, "token_delay_ms": 100}));
    let url = sim.url("/v1/chat/completions");
    let mut body = chat_body("held on rank 1", 20, false);
    body["routed_dp_rank"] = json!(1);
    let held = std::thread::spawn(move || send(&url, "POST", Some(&body), &[]).status);
    let per_rank = wait_for("the request running on rank 1", Duration::from_secs(5), || {
        let v = send(&sim.url("/v1/loads"), "GET", None, &[]).json();
        let running: Vec<u64> = v["loads"].as_array()?.iter().filter_map(|l| l["num_running_reqs"].as_u64()).collect();
        (running.iter().sum::<u64>() == 1).then_some(running)
    });
    assert_eq!(per_rank, [0, 1]);
    assert_eq!(held.join().unwrap(), 200);
}

#[test]
fn health_load_and_chat_faults_are_separate() {
    let dir = scratch_dir("sim_faults");
    let sim = Sim::start(SimSpec::plain("A"), &dir);
    sim.control(json!({"loads": {"status": 500}}));
    assert_eq!(send(&sim.url("/v1/loads"), "GET", None, &[]).status, 500);
    assert_eq!(send(&sim.url("/get_load"), "GET", None, &[]).status, 500);
    assert_eq!(send(&sim.url("/metrics"), "GET", None, &[]).status, 500);
    assert_eq!(send(&sim.url("/health"), "GET", None, &[]).status, 200);
    assert_eq!(post(&sim, &chat_body("x", 1, false)).status, 200);

    sim.control(json!({"reset": true, "chat": {"status": 503}}));
    assert_eq!(post(&sim, &chat_body("x", 1, false)).status, 503);
    assert_eq!(send(&sim.url("/v1/loads"), "GET", None, &[]).status, 200);

    sim.control(json!({"reset": true, "health": {"delay_ms": 300}}));
    let started = Instant::now();
    assert_eq!(send(&sim.url("/health"), "GET", None, &[]).status, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));

    sim.control(json!({"reset": true, "health": {"hang": true}}));
    let hung = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_millis(500)))
        .build()
        .new_agent()
        .get(&sim.url("/health"))
        .call();
    assert!(hung.is_err(), "a hanging health endpoint never answers");
}

#[test]
fn registration_endpoints_describe_the_engine() {
    let dir = scratch_dir("sim_info");
    let sim = Sim::start(SimSpec::prefill("P").model("m1"), &dir);
    let info = send(&sim.url("/get_server_info"), "GET", None, &[]).json();
    assert_eq!(info["disaggregation_mode"], "prefill");
    assert_eq!(info["disaggregation_bootstrap_port"], json!(sim.bootstrap_port));
    assert_eq!(send(&sim.url("/get_model_info"), "GET", None, &[]).json()["model_path"], "m1");
    assert_eq!(send(&sim.url("/v1/models"), "GET", None, &[]).json()["data"][0]["id"], "m1");
    assert_eq!(send(&sim.url("/health_generate"), "GET", None, &[]).status, 200);
}

fn loads(sim: &Sim) -> Value {
    send(&sim.url("/v1/loads"), "GET", None, &[]).json()["loads"][0].clone()
}

#[test]
fn a_shared_prompt_is_prefilled_once_and_reused_from_the_cache() {
    let dir = scratch_dir("sim_cache");
    let sim = Sim::start(SimSpec::plain("A"), &dir);
    let system = "shared system prompt text ".repeat(40); // ~250 tokens
    let ask = |q: &str| {
        let body = json!({"model": "demo-model", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]});
        assert_eq!(post(&sim, &body).status, 200);
    };
    ask("first");
    let after_first = loads(&sim)["total_prefill_uncached_tokens"].as_u64().unwrap();
    ask("second");
    let second = loads(&sim)["total_prefill_uncached_tokens"].as_u64().unwrap() - after_first;
    assert!(after_first >= 250, "the first prompt is prefilled whole: {after_first}");
    assert!(second < 32, "the second reuses the shared prefix: {second} uncached tokens");
    let cache = &sim.state()["cache"];
    assert!(cache["cached_tokens"].as_u64().unwrap() >= 240);
    assert!(cache["hit_rate"].as_f64().unwrap() > 0.4);
    let metrics = send(&sim.url("/metrics"), "GET", None, &[]).body;
    assert!(metrics.contains("sglang:cache_hit_rate{"), "{metrics}");
}

#[test]
fn a_waiting_prompt_counts_only_what_the_cache_lacks_as_uncached() {
    let dir = scratch_dir("sim_waiting_uncached");
    let mut spec = SimSpec::plain("A");
    spec.max_running = 1;
    spec.token_delay_ms = 200;
    let sim = Sim::start(spec, &dir);
    let system = "shared system prompt text ".repeat(40); // ~250 tokens
    let asked = |q: &str, max_tokens: u64| {
        json!({"model": "demo-model", "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    assert_eq!(post(&sim, &asked("first", 1)).status, 200);
    // Another prompt holds the only slot; the system prompt's next question waits behind it.
    let url = sim.url("/v1/chat/completions");
    let busy = std::thread::spawn({
        let url = url.clone();
        move || send(&url, "POST", Some(&chat_body(&"unrelated ".repeat(40), 5, false)), &[])
    });
    wait_for("the slot taken", Duration::from_secs(5), || (loads(&sim)["num_running_reqs"] == 1).then_some(()));
    let next = std::thread::spawn({
        let body = asked("second", 1);
        move || send(&url, "POST", Some(&body), &[])
    });
    let waiting = wait_for("one waiting", Duration::from_secs(5), || {
        let l = loads(&sim);
        (l["num_waiting_reqs"] == 1).then_some(l)
    });
    let uncached = waiting["num_waiting_uncached_tokens"].as_u64().unwrap();
    assert!(uncached < 32, "the cached system prompt is not waiting to be prefilled: {uncached} tokens");
    assert_eq!((busy.join().unwrap().status, next.join().unwrap().status), (200, 200));
}

#[test]
fn command_line_faults_fail_requests_and_crash_the_engine() {
    let dir = scratch_dir("sim_flags");
    let mut spec = SimSpec::plain("E");
    spec.extra = vec!["--fault-error-rate".into(), "1.0".into()];
    let failing = Sim::start(spec, &dir);
    for _ in 0..3 {
        assert_eq!(post(&failing, &chat_body("x", 1, false)).status, 500);
    }
    let mut spec = SimSpec::plain("C");
    spec.extra = vec!["--crash-after".into(), "2".into()];
    let crashing = Sim::start(spec, &dir);
    assert_eq!(post(&crashing, &chat_body("x", 1, false)).status, 200);
    assert_eq!(post(&crashing, &chat_body("x", 1, false)).status, 200);
    let third = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent()
        .post(&crashing.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .send(chat_body("x", 1, false).to_string());
    assert!(third.is_err(), "the engine crashed instead of answering");
    wait_for("the crashed engine to stop listening", Duration::from_secs(5), || {
        agent().get(&crashing.url("/health")).call().is_err().then_some(())
    });
}
