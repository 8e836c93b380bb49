//! Request preparation for `POST /v1/chat/completions` (spec §3): the routing facts, extracted
//! once, and SGLang's validation of the sampling fields.

use serde_json::Value;

use super::chat_body::{ChatBody, Message, Messages};
use crate::filter::RouteError;

/// What routing needs to know about a chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFacts {
    pub model: String,
    pub stream: bool,
    pub n: u64,
    /// `max_completion_tokens`, else `max_tokens`, else unknown.
    pub output_budget: Option<u64>,
    pub input_tokens: u64,
    /// Input plus output budget when the budget is known (per sequence, whatever `n`).
    pub expected_peak_tokens: Option<u64>,
}

impl RequestFacts {
    /// The facts of every endpoint, from what its body says: `budget` is the output budget as
    /// given and the field it came from; the expected peak is the input plus it.
    pub(super) fn new(
        model: String,
        stream: bool,
        n: u64,
        budget: Option<(i128, &str)>,
        input_tokens: u64,
    ) -> Result<Self, RouteError> {
        let output_budget = budget
            .map(|(b, field)| {
                u64::try_from(b).map_err(|_| RouteError::invalid(format!("`{field}` must be at least 0")))
            })
            .transpose()?;
        let expected_peak_tokens = output_budget
            .map(|b| {
                input_tokens.checked_add(b).ok_or_else(|| {
                    RouteError::invalid(format!(
                        "output budget {b} plus {input_tokens} input tokens overflows the expected peak"
                    ))
                })
            })
            .transpose()?;
        Ok(Self { model, stream, n, output_budget, input_tokens, expected_peak_tokens })
    }
}

/// Parses and validates a chat body. `bytes_per_token` is ≥ 1 (validated configuration).
pub fn prepare(body: &[u8], bytes_per_token: u64) -> Result<RequestFacts, RouteError> {
    prepare_chat(body, bytes_per_token, false).map(|(facts, _)| facts)
}

/// [`prepare`], also building the prompt text the prefix index matches when `want_prompt`. One
/// pass over the body, no JSON tree (see `chat_body`).
pub fn prepare_chat(
    body: &[u8],
    bytes_per_token: u64,
    want_prompt: bool,
) -> Result<(RequestFacts, Option<String>), RouteError> {
    let view = read_object::<ChatBody>(body)?;
    let model = required_model(view.model.as_ref())?;
    let messages = match &view.messages {
        Messages::List(m) => m,
        Messages::NotAnArray => return Err(RouteError::invalid("`messages` must be an array")),
        Messages::Absent => return Err(RouteError::invalid("`messages` is required")),
    };
    let stream = stream_flag(view.stream.as_ref())?;
    validate_sampling(|field| view.field(field))?;
    let n = sequences(optional_integer(view.n.as_ref(), "n")?, 1)?;
    let budget = match optional_integer(view.max_completion_tokens.as_ref(), "max_completion_tokens")? {
        Some(b) => Some((b, "max_completion_tokens")),
        None => optional_integer(view.max_tokens.as_ref(), "max_tokens")?.map(|b| (b, "max_tokens")),
    };
    let text_bytes = messages.iter().map(Message::text_bytes).fold(0u64, u64::saturating_add);
    let input_tokens = text_bytes.div_ceil(bytes_per_token.max(1));
    let facts = RequestFacts::new(model, stream, n, budget, input_tokens)?;
    Ok((facts, want_prompt.then(|| prompt_text(messages))))
}

/// Choices one request may ask for (`n`), and sequences in all (prompts × `n`): each sequence is
/// a bootstrap room, host and port in a PD body, so an unbounded `n` is memory a client chooses.
pub const MAX_N: i128 = 128;
pub const MAX_SEQUENCES: u64 = 1024;

/// The sequences a request asks for: `n` (default 1) for each of its `prompts`, within
/// [`MAX_N`] and [`MAX_SEQUENCES`].
pub(super) fn sequences(n: Option<i128>, prompts: u64) -> Result<u64, RouteError> {
    let n = n.unwrap_or(1);
    if n < 1 {
        return Err(RouteError::invalid("`n` must be at least 1"));
    }
    if n > MAX_N {
        return Err(RouteError::invalid(format!("`n` must be at most {MAX_N}, got {n}")));
    }
    let total = prompts.saturating_mul(n as u64);
    if total > MAX_SEQUENCES {
        return Err(RouteError::invalid(format!(
            "{prompts} prompts × `n` = {n} asks for {total} sequences; at most {MAX_SEQUENCES}"
        )));
    }
    Ok(total)
}

/// A request body read as `T`, which must be a JSON object: a body that is not JSON, or is JSON
/// but not an object, gets its own message.
pub(super) fn read_object<'a, T: serde::Deserialize<'a>>(body: &'a [u8]) -> Result<T, RouteError> {
    let is_object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    match serde_json::from_slice::<T>(body) {
        Ok(value) if is_object => Ok(value),
        Err(e) if is_object || serde_json::from_slice::<serde::de::IgnoredAny>(body).is_err() => {
            let what =
                if e.is_data() { "request body is not a valid request" } else { "request body is not valid JSON" };
            Err(RouteError::invalid(format!("{what}: {e}")))
        }
        _ => Err(RouteError::invalid("request body must be a JSON object")),
    }
}

/// The longest prompt the prefix index records; longer prompts are matched on this much.
pub const MAX_PROMPT_BYTES: usize = 64 * 1024;

/// The text the prefix index matches: each message's role and text, in order, cut at
/// [`MAX_PROMPT_BYTES`] on a character boundary. Multi-turn histories extend it, so a session's
/// next turn shares the previous turn's prefix.
pub fn prompt_text(messages: &[Message]) -> String {
    let size: usize =
        messages.iter().map(|m| m.role.as_deref().map_or(0, str::len) + 3 + m.text_bytes() as usize).sum();
    let mut out = String::with_capacity(size.min(MAX_PROMPT_BYTES + 1));
    for m in messages {
        out.push_str(m.role.as_deref().unwrap_or(""));
        out.push_str(": ");
        for text in &m.texts {
            out.push_str(text);
        }
        out.push('\n');
        if out.len() >= MAX_PROMPT_BYTES {
            break;
        }
    }
    cut_to_prompt_limit(&mut out);
    out
}

/// Cuts a prompt text at [`MAX_PROMPT_BYTES`], on a character boundary.
pub(super) fn cut_to_prompt_limit(text: &mut String) {
    if text.len() > MAX_PROMPT_BYTES {
        let mut cut = MAX_PROMPT_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
}

/// The OpenAI bodies' `model`: required, a non-empty string.
pub(super) fn required_model(model: Option<&Value>) -> Result<String, RouteError> {
    match model {
        Some(Value::String(m)) if !m.is_empty() => Ok(m.clone()),
        Some(_) => Err(RouteError::invalid("`model` must be a non-empty string")),
        None => Err(RouteError::invalid("`model` is required")),
    }
}

/// `stream`: a boolean; absent or `null` is false.
pub(super) fn stream_flag(stream: Option<&Value>) -> Result<bool, RouteError> {
    match stream {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RouteError::invalid("`stream` must be a boolean")),
    }
}

/// An integer field; `null` counts as absent. Integral floats (`16.0`) are accepted as SGLang's
/// pydantic models do.
pub(super) fn optional_integer(value: Option<&Value>, field: &str) -> Result<Option<i128>, RouteError> {
    match value {
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

fn optional_number(value: Option<&Value>, field: &str) -> Result<Option<f64>, RouteError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(RouteError::invalid(format!("`{field}` must be a number"))),
    }
}

/// SGLang's sampling-parameter ranges; `get` reads a field of wherever the body keeps them.
pub(super) fn validate_sampling<'a>(get: impl Fn(&str) -> Option<&'a Value>) -> Result<(), RouteError> {
    let check = |field: &str, ok: fn(f64) -> bool, range: &str| -> Result<(), RouteError> {
        match optional_number(get(field), field)? {
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
    if let Some(k) = optional_integer(get("top_k"), "top_k")? {
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
    use crate::filter::ErrorKind;

    fn facts(body: serde_json::Value) -> Result<RequestFacts, RouteError> {
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

    /// The reading the borrowed parse replaced, over a whole JSON tree: the reference it must agree with.
    fn tree_reading(body: &serde_json::Value) -> (u64, String) {
        let mut bytes = 0u64;
        let mut text = String::new();
        for m in body["messages"].as_array().into_iter().flatten() {
            text.push_str(m.get("role").and_then(|r| r.as_str()).unwrap_or(""));
            text.push_str(": ");
            let parts: Vec<&str> = match m.get("content") {
                Some(serde_json::Value::String(s)) => vec![s.as_str()],
                Some(serde_json::Value::Array(parts)) => parts
                    .iter()
                    .filter(|p| p.get("type").and_then(|t| t.as_str()) == Some("text"))
                    .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                    .collect(),
                _ => vec![],
            };
            for p in parts {
                bytes += p.len() as u64;
                text.push_str(p);
            }
            text.push('\n');
        }
        (bytes, text)
    }

    #[test]
    fn escaped_text_counts_its_decoded_bytes_and_reads_back_decoded() {
        let body = json!({"model": "m", "messages": [
            {"role": "user", "content": "line\nbreak \"quoted\" é \u{1F600}"},
            {"role": "assistant", "content": [{"type": "text", "text": "tab\there"}]}
        ]});
        let raw = body.to_string();
        assert!(raw.contains("\\n") && raw.contains("\\t"), "the body carries escapes: {raw}");
        let (facts, text) = prepare_chat(raw.as_bytes(), 1, true).unwrap();
        let (bytes, expected) = tree_reading(&body);
        assert_eq!((facts.input_tokens, text.as_deref()), (bytes, Some(expected.as_str())));
    }

    #[test]
    fn unexpected_types_inside_messages_read_as_absent_but_messages_must_be_an_array() {
        let body = json!({"model": "m", "messages": [
            {"role": 7, "content": "abcd", "tool_calls": [{"id": "x"}], "name": null},
            "not a message",
            {"role": "user", "content": [{"type": "text", "text": 5}, ["odd"], {"type": "text", "text": "efgh"}]},
            {"role": "user", "content": {"unexpected": "object"}}
        ]});
        let (facts, text) = prepare_chat(body.to_string().as_bytes(), 1, true).unwrap();
        let (bytes, expected) = tree_reading(&body);
        assert_eq!((facts.input_tokens, text), (bytes, Some(expected)));
        assert!(invalid(json!({"model": "m", "messages": null})).contains("must be an array"));
        assert!(invalid(json!({"model": "m", "messages": {"role": "user"}})).contains("must be an array"));
        assert!(invalid(json!({"model": null, "messages": []})).contains("non-empty string"));
        assert!(invalid(json!({"model": "m", "messages": [], "stream": "yes"})).contains("`stream`"));
        assert!(prepare(b"  [1, 2]", 4).unwrap_err().message.contains("JSON object"));
        assert!(prepare(b"\"text\"", 4).unwrap_err().message.contains("JSON object"));
        assert!(prepare(br#"{"model": "m", "messages": []"#, 4).unwrap_err().message.contains("not valid JSON"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        #[test]
        fn the_borrowed_reading_agrees_with_the_tree(
            turns in proptest::collection::vec(("[a-z]{0,6}", "[ -~é\n\t\"\\\\]{0,40}", proptest::bool::ANY), 0..6)
        ) {
            let messages: Vec<serde_json::Value> = turns
                .iter()
                .map(|(role, text, as_parts)| if *as_parts {
                    json!({"role": role, "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": text}}]})
                } else {
                    json!({"role": role, "content": text})
                })
                .collect();
            let body = json!({"model": "m", "messages": messages, "max_tokens": 3});
            let (facts, text) = prepare_chat(body.to_string().as_bytes(), 1, true).unwrap();
            let (bytes, expected) = tree_reading(&body);
            proptest::prop_assert_eq!(facts.input_tokens, bytes);
            proptest::prop_assert_eq!(text, Some(expected));
        }
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
