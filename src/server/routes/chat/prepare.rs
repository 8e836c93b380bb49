//! Request preparation for `POST /v1/chat/completions` (spec §3): the routing facts, extracted
//! once, and SGLang's validation of the sampling fields.

use serde_json::{Map, Value};

use crate::server::RouteError;

/// What routing needs to know about a chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatFacts {
    pub model: String,
    pub stream: bool,
    pub n: u64,
    /// `max_completion_tokens`, else `max_tokens`, else unknown.
    pub output_budget: Option<u64>,
    pub input_tokens: u64,
    /// Input plus output budget when the budget is known (per sequence, whatever `n`).
    pub expected_peak_tokens: Option<u64>,
}

/// Parses and validates a chat body. `bytes_per_token` is ≥ 1 (validated configuration).
pub fn prepare(body: &[u8], bytes_per_token: u64) -> Result<ChatFacts, RouteError> {
    prepare_with_body(body, bytes_per_token).map(|(facts, _)| facts)
}

/// [`prepare`], also handing back the parsed body so a PD dispatch can rewrite it without
/// parsing it again.
pub fn prepare_with_body(body: &[u8], bytes_per_token: u64) -> Result<(ChatFacts, Map<String, Value>), RouteError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| RouteError::invalid(format!("request body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(RouteError::invalid("request body must be a JSON object"));
    };
    let model = required_model(&obj)?;
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) => m,
        Some(_) => return Err(RouteError::invalid("`messages` must be an array")),
        None => return Err(RouteError::invalid("`messages` is required")),
    };
    let stream = stream_flag(&obj)?;
    validate_sampling(&obj)?;
    let n = optional_integer(&obj, "n")?.unwrap_or(1);
    if n < 1 {
        return Err(RouteError::invalid("`n` must be at least 1"));
    }
    let output_budget = match optional_integer(&obj, "max_completion_tokens")? {
        Some(b) => Some(b),
        None => optional_integer(&obj, "max_tokens")?,
    };
    let output_budget = output_budget
        .map(|b| u64::try_from(b).map_err(|_| RouteError::invalid("the output budget must be at least 0")))
        .transpose()?;
    let text_bytes = messages.iter().map(message_text_bytes).fold(0u64, u64::saturating_add);
    let input_tokens = text_bytes.div_ceil(bytes_per_token.max(1));
    let expected_peak_tokens = output_budget
        .map(|b| {
            input_tokens.checked_add(b).ok_or_else(|| {
                RouteError::invalid(format!(
                    "output budget {b} plus {input_tokens} input tokens overflows the expected peak"
                ))
            })
        })
        .transpose()?;
    let facts = ChatFacts {
        model,
        stream,
        n: u64::try_from(n).unwrap_or(u64::MAX),
        output_budget,
        input_tokens,
        expected_peak_tokens,
    };
    Ok((facts, obj))
}

/// The longest prompt the prefix index records; longer prompts are matched on this much.
pub const MAX_PROMPT_BYTES: usize = 64 * 1024;

/// The text the prefix index matches: each message's role and text, in order, cut at
/// [`MAX_PROMPT_BYTES`] on a character boundary. Multi-turn histories extend it, so a session's
/// next turn shares the previous turn's prefix.
pub fn prompt_text(body: &Map<String, Value>) -> String {
    let mut out = String::new();
    for m in body.get("messages").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
        out.push_str(": ");
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts.iter().filter(|p| p.get("type").and_then(Value::as_str) == Some("text")) {
                    out.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
            _ => {}
        }
        out.push('\n');
        if out.len() >= MAX_PROMPT_BYTES {
            break;
        }
    }
    if out.len() > MAX_PROMPT_BYTES {
        let mut cut = MAX_PROMPT_BYTES;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

/// UTF-8 bytes of a message's text: a string content, or the text parts of an array content.
fn message_text_bytes(message: &Value) -> u64 {
    match message.get("content") {
        Some(Value::String(s)) => s.len() as u64,
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.len() as u64)
            .fold(0, u64::saturating_add),
        _ => 0,
    }
}

/// The OpenAI bodies' `model`: required, a non-empty string.
pub(super) fn required_model(obj: &Map<String, Value>) -> Result<String, RouteError> {
    match obj.get("model") {
        Some(Value::String(m)) if !m.is_empty() => Ok(m.clone()),
        Some(_) => Err(RouteError::invalid("`model` must be a non-empty string")),
        None => Err(RouteError::invalid("`model` is required")),
    }
}

/// `stream`: a boolean; absent or `null` is false.
pub(super) fn stream_flag(obj: &Map<String, Value>) -> Result<bool, RouteError> {
    match obj.get("stream") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RouteError::invalid("`stream` must be a boolean")),
    }
}

/// An integer field; `null` counts as absent. Integral floats (`16.0`) are accepted as SGLang's
/// pydantic models do.
pub(super) fn optional_integer(obj: &Map<String, Value>, field: &str) -> Result<Option<i128>, RouteError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(i) = n.as_i64() {
                Ok(Some(i128::from(i)))
            } else if let Some(u) = n.as_u64() {
                Ok(Some(i128::from(u)))
            } else {
                match n.as_f64() {
                    Some(f) if f.fract() == 0.0 && f.abs() < 1e30 => Ok(Some(f as i128)),
                    _ => Err(RouteError::invalid(format!("`{field}` must be an integer"))),
                }
            }
        }
        Some(_) => Err(RouteError::invalid(format!("`{field}` must be an integer"))),
    }
}

fn optional_number(obj: &Map<String, Value>, field: &str) -> Result<Option<f64>, RouteError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(RouteError::invalid(format!("`{field}` must be a number"))),
    }
}

/// SGLang's sampling-parameter ranges.
pub(super) fn validate_sampling(obj: &Map<String, Value>) -> Result<(), RouteError> {
    let check = |field: &str, ok: fn(f64) -> bool, range: &str| -> Result<(), RouteError> {
        match optional_number(obj, field)? {
            Some(v) if !ok(v) => Err(RouteError::invalid(format!("`{field}` must be {range}, got {v}"))),
            _ => Ok(()),
        }
    };
    check("temperature", |v| v >= 0.0, "at least 0")?;
    check("top_p", |v| v > 0.0 && v <= 1.0, "in (0, 1]")?;
    check("min_p", |v| (0.0..=1.0).contains(&v), "in [0, 1]")?;
    check("frequency_penalty", |v| (-2.0..=2.0).contains(&v), "in [-2, 2]")?;
    check("presence_penalty", |v| (-2.0..=2.0).contains(&v), "in [-2, 2]")?;
    check("repetition_penalty", |v| (0.0..=2.0).contains(&v), "in [0, 2]")?;
    if let Some(k) = optional_integer(obj, "top_k")? {
        if k != -1 && k < 1 {
            return Err(RouteError::invalid(format!("`top_k` must be -1 or at least 1, got {k}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
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
        let f = facts(
            json!({"model": "m", "messages": [{"role": "user", "content": "12345678"}], "max_tokens": 10, "n": 4}),
        )
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
}
