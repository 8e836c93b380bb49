//! Bucket-first selection inside Envoy: request length picks the bucket, errors come back as
//! OpenAI-style JSON from the filter itself.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::json;

/// Short prompts (≤ 64 tokens, context 256) go to A/B; long ones to C.
fn two_buckets(sims: &[Sim]) -> serde_json::Value {
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "models": {"demo-model": {"buckets": [
            {"id": "long", "rank": 20, "limits": {"max": 100000}, "max_context_tokens": 200000,
             "groups": {"plain": {"worker_ids": ["C"], "policy": {"type": "load_based"}}}},
            {"id": "short", "rank": 10, "limits": {"max": 64}, "max_context_tokens": 256,
             "groups": {"plain": {"worker_ids": ["A", "B"], "policy": {"type": "power_of_two"}}}}
        ]}}
    })
}

fn deployment(name: &str) -> Deployment {
    Deployment::start(name, vec![SimSpec::plain("A"), SimSpec::plain("B"), SimSpec::plain("C")], two_buckets)
}

#[test]
fn request_length_selects_the_smallest_bucket_that_fits() {
    let d = deployment("buckets_length");
    let short = d.chat(&chat_body("hello", 4, false));
    assert_eq!(short.status, 200, "{}", short.body);
    assert_eq!(short.header("x-sgl-bucket"), Some("short"));
    assert!(["A", "B"].contains(&short.engine().as_str()));

    // 400 bytes = 100 input tokens: past the short bucket's input range.
    let long = d.chat(&chat_body(&"x".repeat(400), 4, false));
    assert_eq!(long.status, 200, "{}", long.body);
    assert_eq!((long.header("x-sgl-bucket"), long.engine().as_str()), (Some("long"), "C"));

    // 40 input tokens fit the short range, but 40 + 300 output exceeds its 256-token context.
    let peak = d.chat(&chat_body(&"x".repeat(160), 300, false));
    assert_eq!((peak.header("x-sgl-bucket"), peak.engine().as_str()), (Some("long"), "C"));
}

#[test]
fn no_bucket_fits_is_a_400_no_matching_bucket() {
    let d = deployment("buckets_none");
    let r = d.chat(&chat_body("x", 300_000, false));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "NoMatchingBucket");
    assert_eq!(r.json()["error"]["code"], 400);
    assert!(r.header("content-type").unwrap_or_default().starts_with("application/json"));
}

#[test]
fn unknown_model_is_a_404_and_malformed_bodies_are_400() {
    let d = deployment("buckets_errors");
    let mut body = chat_body("x", 4, false);
    body["model"] = json!("nope");
    let r = d.chat(&body);
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (404, Some("model_not_found")));

    let r = send(&d.envoy.url("/v1/chat/completions"), "POST", None, &[]);
    assert_eq!(r.status, 400, "{}", r.body);
    let bad = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent()
        .post(&d.envoy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .send("{not json")
        .unwrap();
    assert_eq!(bad.status(), 400);

    let mut no_messages = chat_body("x", 4, false);
    no_messages.as_object_mut().unwrap().remove("messages");
    assert_eq!(d.chat(&no_messages).json()["error"]["type"], "invalid_request");

    let mut bad_sampling = chat_body("x", 4, false);
    bad_sampling["top_p"] = json!(0);
    let r = d.chat(&bad_sampling);
    assert_eq!((r.status, r.json()["error"]["type"].as_str()), (400, Some("invalid_request")));
    assert!(r.json()["error"]["message"].as_str().unwrap_or_default().contains("top_p"));
}
