//! Prefill/decode dispatch through real Envoy: one bucket's pair, one shared room, the decode
//! response held until the prefill callout succeeded, PrefillFailed otherwise.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::{json, Value};

const SHORT: PdBucket<'static> = ("short-context", 10, 4096, 8192, &["P1", "P2"], &["D1", "D2"]);
const LONG: PdBucket<'static> = ("long-context", 20, 131_072, 131_072, &["P3", "P4"], &["D3", "D4"]);

fn design_example(name: &str) -> Deployment {
    let specs = ["P1", "P2", "P3", "P4"]
        .iter()
        .map(|id| SimSpec::prefill(id))
        .chain(["D1", "D2", "D3", "D4"].iter().map(|id| SimSpec::decode(id)))
        .collect();
    let d = Deployment::start(name, specs, |sims| pd_router(sims, &[SHORT, LONG]));
    for sim in &d.sims {
        // Long outputs, generated at once: this test is about which pair is chosen.
        sim.control(json!({"token_delay_ms": 0}));
    }
    d.wait_for_service(8);
    d
}

fn single_pair(name: &str) -> Deployment {
    let d = Deployment::start(name, vec![SimSpec::prefill("P1"), SimSpec::decode("D1")], |sims| {
        pd_router(sims, &[("only", 0, 100_000, 200_000, &["P1"], &["D1"])])
    });
    d.wait_for_service(2);
    d
}

fn header_of(record: &Value, name: &str) -> Option<String> {
    record["headers"].as_array()?.iter().find(|h| h[0] == name).and_then(|h| h[1].as_str().map(String::from))
}

fn last_record(sim: &Sim) -> Value {
    sim.state()["recent"]
        .as_array()
        .and_then(|r| r.last().cloned())
        .unwrap_or_else(|| panic!("{} got no request", sim.spec.id))
}

#[test]
fn a_pd_request_reaches_the_chosen_pair_with_one_shared_room_and_streams_after_the_prefill() {
    let d = single_pair("pd_room");
    let prefill = d.sim("P1");
    // The room is done at once, but the prefill answer lingers: the filter must hold the decode
    // stream until that answer arrives.
    prefill.control(json!({"prefill_linger_ms": 1500}));
    let mut body = chat_body("what is a bootstrap room?", 12, true);
    body["bootstrap_room"] = json!(7); // a client-sent room is overwritten
    let r = d.chat(&body);
    let received_ms = now_unix_ms();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.header("x-sgl-prefill-worker"), r.header("x-sgl-worker")), (Some("P1"), Some("D1")));
    assert_eq!(r.engine(), "D1");

    let p = last_record(prefill);
    let dec = last_record(d.sim("D1"));
    let room = p["bootstrap_room"].clone();
    assert!(room.as_u64().is_some_and(|r| r != 7 && r < (1 << 63)), "a fresh 63-bit room: {room}");
    assert_eq!(dec["bootstrap_room"], room, "prefill and decode share one room");
    assert_eq!(dec["bootstrap_host"], "127.0.0.1");
    assert_eq!(dec["bootstrap_port"].as_u64(), prefill.bootstrap_port.map(u64::from));
    assert!(
        p["headers"].as_array().unwrap().iter().all(|h| h[0] != "content-length" || h[1] != "0"),
        "the prefill callout carried the body"
    );
    // The rewritten decode body keeps a length of its own (sent whole, not chunked).
    assert_eq!(header_of(&dec, "content-length"), Some(dec["body_bytes"].to_string()), "{dec}");
    assert_eq!(header_of(&dec, "transfer-encoding"), None, "{dec}");

    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let content: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(String::from))
        .collect();
    assert_eq!(content, (0..12).map(|i| format!("tok{i} ")).collect::<String>());
    // The decode engine finished its stream long before the prefill answered; the client still
    // got nothing until then.
    let decode_done = dec["finished_ms"].as_u64().unwrap();
    let prefill_done = p["finished_ms"].as_u64().unwrap();
    assert!(decode_done < prefill_done, "the decode stream was ready before the prefill answered");
    assert!(received_ms >= prefill_done, "the response was released only after the prefill answered");
    d.wait_for_idle(&["P1", "D1"]);
}

#[test]
fn a_failing_prefill_engine_gives_502_prefill_failed_and_counts_return_to_zero() {
    let d = single_pair("pd_prefill_fails");
    d.sim("P1").control(json!({"chat": {"status": 500}}));
    for stream in [false, true] {
        // The agent's own timeout would fail this if anything hung.
        let r = d.chat(&chat_body("doomed", 4, stream));
        assert_eq!(r.status, 502, "{}", r.body);
        assert!(r.header("content-type").unwrap_or_default().starts_with("application/json"));
        let v = r.json();
        assert_eq!(v["error"]["type"], "PrefillFailed");
        assert_eq!(v["error"]["code"], 502);
        assert!(r.header("x-sim-engine").is_none(), "nothing of the decode response reached the client");
    }
    d.wait_for_idle(&["P1", "D1"]);
}

#[test]
fn a_decode_error_goes_to_the_client_at_once() {
    let d = single_pair("pd_decode_fails");
    d.sim("D1").control(json!({"chat": {"status": 503}}));
    d.sim("P1").control(json!({"prefill_linger_ms": 3000}));
    let r = d.chat(&chat_body("x", 4, false));
    assert_eq!(r.status, 503);
    assert_eq!(r.engine(), "D1");
    // Not held for the prefill: its answer is still lingering when the client has the error.
    assert_eq!(last_record(d.sim("P1"))["finished_ms"], Value::Null, "the prefill had not answered yet");
    d.wait_for_idle(&["P1", "D1"]);
}

#[test]
fn design_example_4k_input_16k_peak_takes_the_long_pair_and_8k_peak_the_short_one() {
    let d = design_example("pd_design_example");
    let prompt = "x".repeat(4000 * 4); // 4,000 input tokens at 4 bytes per token
    let long = d.chat(&chat_body(&prompt, 12_000, true)); // peak 16k > short context 8k
    assert_eq!(long.status, 200, "{}", long.body);
    assert_eq!(long.header("x-sgl-bucket"), Some("long-context"));
    assert!(["P3", "P4"].contains(&long.header("x-sgl-prefill-worker").unwrap()));
    assert!(["D3", "D4"].contains(&long.header("x-sgl-worker").unwrap()));

    let short = d.chat(&chat_body(&prompt, 4000, true)); // peak 8k
    assert_eq!(short.header("x-sgl-bucket"), Some("short-context"), "{}", short.body);
    assert!(["P1", "P2"].contains(&short.header("x-sgl-prefill-worker").unwrap()));
    assert!(["D1", "D2"].contains(&short.header("x-sgl-worker").unwrap()));
}

#[test]
fn n_greater_than_one_sends_a_room_per_choice() {
    let d = single_pair("pd_n");
    let mut body = chat_body("three answers", 3, false);
    body["n"] = json!(3);
    let r = d.chat(&body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"].as_array().map(Vec::len), Some(3));
    let rooms = last_record(d.sim("D1"))["bootstrap_room"].clone();
    assert_eq!(rooms.as_array().map(Vec::len), Some(3), "{rooms}");
}
