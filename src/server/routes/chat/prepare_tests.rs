use serde_json::json;

use super::*;
use crate::server::ErrorKind;

fn facts(body: serde_json::Value) -> Result<ChatFacts, RouteError> {
    prepare(body.to_string().as_bytes(), 4)
}

fn invalid(body: serde_json::Value) -> String {
    let e = facts(body).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    e.message
}

#[test]
fn extracts_model_stream_and_n() {
    let f = facts(json!({"model": "m", "messages": [], "stream": true, "n": 3})).unwrap();
    assert_eq!((f.model.as_str(), f.stream, f.n), ("m", true, 3));
    let f = facts(json!({"model": "m", "messages": []})).unwrap();
    assert_eq!((f.stream, f.n, f.output_budget, f.expected_peak_tokens), (false, 1, None, None));
}

#[test]
fn input_tokens_are_the_ceiling_of_text_bytes_over_bytes_per_token() {
    let f = facts(json!({"model": "m", "messages": [{"role": "user", "content": "12345"}]})).unwrap();
    assert_eq!(f.input_tokens, 2);
    let f = facts(json!({"model": "m", "messages": [{"role": "user", "content": "1234"}]})).unwrap();
    assert_eq!(f.input_tokens, 1);
}

#[test]
fn text_parts_of_array_content_count_and_other_parts_do_not() {
    let f = facts(json!({"model": "m", "messages": [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [
            {"type": "text", "text": "efgh"},
            {"type": "image_url", "image_url": {"url": "data:xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}
        ]}
    ]}))
    .unwrap();
    assert_eq!(f.input_tokens, 2);
}

#[test]
fn utf8_bytes_not_characters_are_counted() {
    let f = facts(json!({"model": "m", "messages": [{"role": "user", "content": "éé"}]})).unwrap();
    assert_eq!(f.input_tokens, 1); // 4 bytes
}

#[test]
fn output_budget_prefers_max_completion_tokens() {
    let f = facts(json!({"model": "m", "messages": [], "max_tokens": 10, "max_completion_tokens": 20})).unwrap();
    assert_eq!(f.output_budget, Some(20));
    let f = facts(json!({"model": "m", "messages": [], "max_tokens": 10})).unwrap();
    assert_eq!(f.output_budget, Some(10));
}

#[test]
fn expected_peak_is_input_plus_budget_per_sequence() {
    let f =
        facts(json!({"model": "m", "messages": [{"role": "user", "content": "12345678"}], "max_tokens": 10, "n": 4}))
            .unwrap();
    assert_eq!(f.expected_peak_tokens, Some(12));
}

#[test]
fn an_overflowing_peak_is_a_400() {
    let m = invalid(json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": u64::MAX}));
    assert!(m.contains("overflows"), "{m}");
}

#[test]
fn bad_json_and_missing_messages_are_400() {
    assert!(prepare(b"{nope", 4).unwrap_err().message.contains("not valid JSON"));
    assert!(invalid(json!([1, 2])).contains("JSON object"));
    assert!(invalid(json!({"model": "m"})).contains("`messages` is required"));
    assert!(invalid(json!({"model": "m", "messages": "hi"})).contains("must be an array"));
    assert!(invalid(json!({"messages": []})).contains("`model` is required"));
}

#[test]
fn sampling_ranges_follow_sglang() {
    let base = || json!({"model": "m", "messages": []});
    let with = |k: &str, v: serde_json::Value| {
        let mut b = base();
        b[k] = v;
        b
    };
    for (field, bad) in [
        ("temperature", json!(-0.1)),
        ("top_p", json!(0)),
        ("top_p", json!(1.5)),
        ("min_p", json!(-0.1)),
        ("min_p", json!(1.1)),
        ("top_k", json!(0)),
        ("top_k", json!(-2)),
        ("frequency_penalty", json!(2.5)),
        ("presence_penalty", json!(-2.5)),
        ("repetition_penalty", json!(2.1)),
        ("repetition_penalty", json!(-0.1)),
        ("n", json!(0)),
        ("max_tokens", json!(-1)),
        ("temperature", json!("hot")),
    ] {
        let m = invalid(with(field, bad.clone()));
        assert!(m.contains(field) || m.contains("output budget"), "{field}={bad}: {m}");
    }
    for (field, good) in [
        ("temperature", json!(0)),
        ("top_p", json!(1)),
        ("min_p", json!(0)),
        ("top_k", json!(-1)),
        ("top_k", json!(1)),
        ("frequency_penalty", json!(-2)),
        ("repetition_penalty", json!(0)),
        ("max_tokens", json!(0)),
        ("temperature", json!(null)),
    ] {
        assert!(facts(with(field, good.clone())).is_ok(), "{field}={good}");
    }
}
