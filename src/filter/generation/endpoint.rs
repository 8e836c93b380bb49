//! The three generation endpoints the filter routes (spec §3): OpenAI's chat and text
//! completions and SGLang's native `/generate`. Each has its own body; all yield the same routing
//! facts, so one bucket loop, one PD exchange and one set of stats serve them.
//!
//! A body with several prompts (a batch) is one request to one engine, as SGLang serves it: it is
//! bucketed by its longest prompt, counts every prompt's tokens as prefill work, and in PD gets one
//! bootstrap room per sequence (prompts × `n`).

use serde_json::{Map, Value};

use super::prepare::{
    cut_to_prompt_limit, optional_integer, prepare_chat, read_object, required_model, sequences, stream_flag,
    validate_sampling, RequestFacts,
};
use crate::filter::{ErrorKind, RouteError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
    /// `POST /generate` (SGLang's native API; the model is the configuration's `serve_generate`)
    Generate,
}

impl Endpoint {
    pub const ALL: [Endpoint; 3] = [Endpoint::Chat, Endpoint::Completions, Endpoint::Generate];

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => super::CHAT_PATH,
            Endpoint::Completions => "/v1/completions",
            Endpoint::Generate => "/generate",
        }
    }

    pub fn from_path(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.path() == path)
    }
}

/// A request's prompts as it carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompts {
    /// Chat messages: the text is read from the body when needed.
    Messages,
    Texts(Vec<String>),
    TokenIds(Vec<Vec<u32>>),
}

impl Prompts {
    /// The exact token ids of a single token-id prompt.
    pub fn single_token_ids(&self) -> Option<&[u32]> {
        match self {
            Prompts::TokenIds(ids) if ids.len() == 1 => ids.first().map(Vec::as_slice),
            _ => None,
        }
    }

    fn count(&self) -> u64 {
        match self {
            Prompts::Messages => 1,
            Prompts::Texts(t) => t.len() as u64,
            Prompts::TokenIds(ids) => ids.len() as u64,
        }
    }

    /// The text the prefix index matches for text and token-id prompts, one line per prompt.
    fn text(&self, bytes_per_token: u64) -> String {
        let mut text = match self {
            Prompts::Messages => String::new(),
            Prompts::Texts(texts) => texts.join("\n"),
            Prompts::TokenIds(ids) => {
                ids.iter().map(|p| token_id_text(p, bytes_per_token)).collect::<Vec<_>>().join("\n")
            }
        };
        cut_to_prompt_limit(&mut text);
        text
    }

    /// Input tokens of the longest prompt: token ids counted, text estimated.
    fn longest_tokens(&self, bytes_per_token: u64) -> u64 {
        match self {
            Prompts::Messages => 0,
            Prompts::Texts(t) => t.iter().map(|s| (s.len() as u64).div_ceil(bytes_per_token.max(1))).max().unwrap_or(0),
            Prompts::TokenIds(ids) => ids.iter().map(|p| p.len() as u64).max().unwrap_or(0),
        }
    }
}

/// A prepared request: its routing facts, its prompts, and the text the prefix index matches when
/// it was asked for.
#[derive(Debug)]
pub struct Prepared {
    pub facts: RequestFacts,
    pub prompts: Prompts,
    pub prompt_text: Option<String>,
}

/// Parses and validates a body of `endpoint`. `generate_model` is the model `/generate` serves;
/// `want_prompt` asks for the prompt text (models whose prefix index records prompts).
pub fn prepare_endpoint(
    endpoint: Endpoint,
    body: &[u8],
    bytes_per_token: u64,
    generate_model: Option<&str>,
    want_prompt: bool,
) -> Result<Prepared, RouteError> {
    if endpoint == Endpoint::Chat {
        let (facts, prompt_text) = prepare_chat(body, bytes_per_token, want_prompt)?;
        return Ok(Prepared { facts, prompts: Prompts::Messages, prompt_text });
    }
    let obj = read_object::<Map<String, Value>>(body)?;
    let stream = stream_flag(obj.get("stream"))?;
    let no_params = Map::new();
    let (model, prompts, sampling) = match endpoint {
        Endpoint::Completions => {
            let model = required_model(obj.get("model"))?;
            let prompts = match obj.get("prompt") {
                Some(p) => prompts_of(p, "prompt")?,
                None => return Err(RouteError::invalid("`prompt` is required")),
            };
            (model, prompts, &obj)
        }
        _ => {
            let model = generate_model.map(str::to_string).ok_or_else(|| {
                RouteError::new(ErrorKind::ModelNotFound, "no model of this router serves /generate (serve_generate)")
            })?;
            let prompts = match (obj.get("text"), obj.get("input_ids")) {
                (Some(t), None) => prompts_of(t, "text")?,
                (None, Some(ids)) => prompts_of(ids, "input_ids")?,
                (Some(_), Some(_)) => return Err(RouteError::invalid("give `text` or `input_ids`, not both")),
                (None, None) => return Err(RouteError::invalid("`text` or `input_ids` is required")),
            };
            let sampling = match obj.get("sampling_params") {
                None | Some(Value::Null) => None,
                Some(Value::Object(s)) => Some(s),
                Some(_) => return Err(RouteError::invalid("`sampling_params` must be an object")),
            };
            (model, prompts, sampling.unwrap_or(&no_params))
        }
    };
    validate_sampling(|field| sampling.get(field))?;
    let budget_field = if endpoint == Endpoint::Generate { "max_new_tokens" } else { "max_tokens" };
    let budget = optional_integer(sampling.get(budget_field), budget_field)?.map(|b| (b, budget_field));
    let n = sequences(optional_integer(sampling.get("n"), "n")?, prompts.count())?;
    let facts = RequestFacts::new(model, stream, n, budget, prompts.longest_tokens(bytes_per_token))?;
    let prompt_text = want_prompt.then(|| prompts.text(bytes_per_token));
    Ok(Prepared { facts, prompts, prompt_text })
}

/// A string, a list of strings, a list of token ids, or a list of token-id lists.
fn prompts_of(value: &Value, field: &str) -> Result<Prompts, RouteError> {
    let bad = || RouteError::invalid(format!("`{field}` must be a string, a list of strings or token ids"));
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items.iter().map(|v| v.as_u64().and_then(|i| u32::try_from(i).ok())).collect()
    };
    let prompts = match value {
        Value::String(s) => Prompts::Texts(vec![s.clone()]),
        Value::Array(items) if items.is_empty() => return Err(RouteError::invalid(format!("`{field}` is empty"))),
        Value::Array(items) => match items.first() {
            Some(Value::String(_)) => Prompts::Texts(
                items.iter().map(|v| v.as_str().map(str::to_string)).collect::<Option<_>>().ok_or_else(bad)?,
            ),
            Some(Value::Number(_)) => Prompts::TokenIds(vec![ids(items).ok_or_else(bad)?]),
            Some(Value::Array(_)) => Prompts::TokenIds(
                items
                    .iter()
                    .map(|p| p.as_array().and_then(|p| (!p.is_empty()).then(|| ids(p)).flatten()))
                    .collect::<Option<_>>()
                    .ok_or_else(bad)?,
            ),
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(prompts)
}

/// Token ids as text the prefix index can match: each id as `bytes_per_token` characters, so a
/// matched length in bytes divided by `bytes_per_token` is a matched length in tokens.
pub fn token_id_text(ids: &[u32], bytes_per_token: u64) -> String {
    const DIGITS: &[u8; 64] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz+/";
    let width = bytes_per_token.clamp(1, 8) as u32;
    let mut out = String::with_capacity(ids.len() * width as usize);
    for &id in ids {
        for place in (0..width).rev() {
            let digit = (u64::from(id) >> (6 * place)) & 63;
            out.push(char::from(DIGITS[digit as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use serde_json::json;

    use super::*;

    fn prep(endpoint: Endpoint, body: Value) -> Result<Prepared, RouteError> {
        prepare_endpoint(endpoint, body.to_string().as_bytes(), 4, Some("gen-model"), true)
    }

    #[test]
    fn paths_name_their_endpoints() {
        for e in Endpoint::ALL {
            assert_eq!(Endpoint::from_path(e.path()), Some(e));
        }
        assert_eq!(Endpoint::from_path("/v1/completions/"), None);
    }

    #[test]
    fn completions_take_a_string_strings_or_token_ids() {
        let p = prep(Endpoint::Completions, json!({"model": "m", "prompt": "12345678", "max_tokens": 5})).unwrap();
        assert_eq!((p.facts.input_tokens, p.facts.output_budget, p.facts.expected_peak_tokens), (2, Some(5), Some(7)));
        let p = prep(Endpoint::Completions, json!({"model": "m", "prompt": ["1234", "123456789012"], "n": 2})).unwrap();
        assert_eq!((p.facts.input_tokens, p.facts.n), (3, 4), "the longest prompt; prompts × n sequences");
        let p = prep(Endpoint::Completions, json!({"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7]})).unwrap();
        assert_eq!((p.facts.input_tokens, p.prompts.single_token_ids()), (7, Some(&[1, 2, 3, 4, 5, 6, 7][..])));
        let p =
            prep(Endpoint::Completions, json!({"model": "m", "prompt": [[1, 2], [3, 4, 5]], "stream": true})).unwrap();
        assert_eq!((p.facts.input_tokens, p.facts.n, p.facts.stream), (3, 2, true));
        assert_eq!(p.prompts.single_token_ids(), None);
    }

    #[test]
    fn completions_reject_what_openai_rejects() {
        for (body, says) in [
            (json!({"prompt": "x"}), "`model` is required"),
            (json!({"model": "m"}), "`prompt` is required"),
            (json!({"model": "m", "prompt": []}), "`prompt` is empty"),
            (json!({"model": "m", "prompt": [1, "a"]}), "must be a string"),
            (json!({"model": "m", "prompt": [[1], []]}), "must be a string"),
            (json!({"model": "m", "prompt": "x", "max_tokens": -1}), "`max_tokens` must be at least 0"),
            (json!({"model": "m", "prompt": "x", "temperature": -1}), "`temperature`"),
        ] {
            let e = prep(Endpoint::Completions, body).unwrap_err();
            assert!(e.message.contains(says), "{} vs {says}", e.message);
        }
    }

    #[test]
    fn generate_reads_text_or_input_ids_and_its_sampling_params() {
        let p = prep(Endpoint::Generate, json!({"text": "12345678", "sampling_params": {"max_new_tokens": 9, "n": 2}}))
            .unwrap();
        assert_eq!(p.facts.model, "gen-model");
        assert_eq!((p.facts.input_tokens, p.facts.output_budget, p.facts.n), (2, Some(9), 2));
        let p = prep(Endpoint::Generate, json!({"input_ids": [[5, 6, 7], [8]], "stream": true})).unwrap();
        assert_eq!((p.facts.input_tokens, p.facts.n, p.facts.stream, p.facts.output_budget), (3, 2, true, None));
        assert!(prep(Endpoint::Generate, json!({"text": "a", "input_ids": [1]})).is_err());
        assert!(prep(Endpoint::Generate, json!({"sampling_params": {}})).is_err());
        let e = prep(Endpoint::Generate, json!({"text": "a", "sampling_params": {"top_p": 2}})).unwrap_err();
        assert!(e.message.contains("top_p"), "{}", e.message);
        let none = prepare_endpoint(Endpoint::Generate, br#"{"text": "a"}"#, 4, None, false).unwrap_err();
        assert_eq!(none.kind, ErrorKind::ModelNotFound);
    }

    /// `n` builds a bootstrap room, host and port per sequence in a PD body: `1e18` once took a VM's
    /// memory. Capped on every endpoint, at the limits themselves.
    #[test]
    fn n_and_prompts_times_n_are_capped_on_every_endpoint() {
        let body = |endpoint, n: Value, prompts: usize| match endpoint {
            Endpoint::Chat => json!({"model": "m", "messages": [], "n": n}),
            Endpoint::Completions => json!({"model": "m", "prompt": vec!["x"; prompts], "n": n}),
            Endpoint::Generate => json!({"text": vec!["x"; prompts], "sampling_params": {"n": n}}),
        };
        for endpoint in Endpoint::ALL {
            assert_eq!(prep(endpoint, body(endpoint, json!(128), 1)).unwrap().facts.n, 128);
            for n in [json!(129), json!(1e18), json!(u64::MAX)] {
                let e = prep(endpoint, body(endpoint, n.clone(), 1)).unwrap_err();
                assert_eq!((e.kind, e.status()), (ErrorKind::InvalidRequest, 400), "{endpoint:?} n={n}");
                assert!(e.message.contains("at most 128"), "{}", e.message);
            }
        }
        for endpoint in [Endpoint::Completions, Endpoint::Generate] {
            assert_eq!(prep(endpoint, body(endpoint, json!(128), 8)).unwrap().facts.n, 1024);
            let e = prep(endpoint, body(endpoint, json!(128), 9)).unwrap_err();
            assert!(e.message.contains("1152 sequences"), "{}", e.message);
            let e = prep(endpoint, body(endpoint, json!(1), 1025)).unwrap_err();
            assert!(e.message.contains("at most 1024"), "{}", e.message);
        }
    }

    #[test]
    fn token_id_text_gives_each_id_bytes_per_token_characters() {
        assert_eq!(token_id_text(&[0, 1, 64], 2), "000110");
        assert_eq!(token_id_text(&[151_643], 4).len(), 4);
        assert_ne!(token_id_text(&[1, 2], 4), token_id_text(&[1, 3], 4));
    }
}
