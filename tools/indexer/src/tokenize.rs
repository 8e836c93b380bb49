//! Tokenization as the engine does it (spec §7): the model's chat template rendered over `messages`
//! and `tools` with the generation prompt, then the model's tokenizer.
//!
//! What repeats is not tokenized again. A Hugging Face tokenizer cuts its input at added (special)
//! tokens first and encodes the pieces between them independently, and chat templates put special
//! tokens between turns; so the rendered prompt is cut the same way here, each piece's ids are
//! cached by its text, and a shared system prompt or an earlier turn costs a hash lookup. A piece
//! that concurrent requests bring at once (a burst sharing a new prefix) is encoded by the first
//! of them while the others wait for its ids.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use axum::http::StatusCode;
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use rayon::prelude::*;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::pretokenize::{cut_points, parts_for, Shape, WordEncoder};

/// Bytes a model's piece cache holds by default (its text, its ids and the entry); past its
/// budget the cache starts over (no per-piece bookkeeping on the hot path). The indexer sets it
/// from `--max-memory-mb`.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;
/// What a cached piece costs beyond its text and ids: the map entry, the `String` and the `Arc`.
const PIECE_OVERHEAD: usize = 96;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("model `{0}` has no tokenizer configured (models.{0}.tokenizer)")]
    NoTokenizer(String),
    #[error("model `{0}` is not configured")]
    UnknownModel(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Load(String),
    #[error("tokenization abandoned: the caller's deadline passed")]
    Abandoned,
}

impl TokenizeError {
    pub fn status(&self) -> StatusCode {
        match self {
            TokenizeError::UnknownModel(_) => StatusCode::NOT_FOUND,
            TokenizeError::Template(_) => StatusCode::BAD_REQUEST,
            TokenizeError::Abandoned => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// One model's tokenizer, chat template and piece cache.
pub struct ModelTokenizer {
    tokenizer: Tokenizer,
    env: Environment<'static>,
    /// Added tokens by their text, longest first, so a prompt is cut at the longest one.
    specials: Vec<(String, u32)>,
    bos: String,
    eos: String,
    cache: Mutex<PieceCache>,
    max_cache_bytes: usize,
    /// How a new piece may be encoded faster than whole (see `pretokenize`).
    shape: Shape,
    /// A GPT-2-shaped tokenizer's remembered pre-tokens.
    words: Option<WordEncoder>,
}

/// The share of the cache budget remembered pre-tokens may take.
const WORDS_SHARE: usize = 8;

#[derive(Default)]
struct PieceCache {
    pieces: HashMap<String, Piece>,
    /// What the ready pieces cost, by [`piece_bytes`].
    bytes: usize,
}

fn piece_bytes(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids) + PIECE_OVERHEAD
}

/// A cached piece: its ids, or the encoding another request is doing.
enum Piece {
    Ready(Arc<[u32]>),
    Encoding(Arc<Encoding>),
}

#[derive(Default)]
struct Encoding {
    done: Mutex<Option<Result<Arc<[u32]>, String>>>,
    ready: Condvar,
}

impl Encoding {
    fn wait(&self) -> Result<Arc<[u32]>, TokenizeError> {
        let mut done = self.done.lock().map_err(|_| TokenizeError::Tokenizer("piece cache poisoned".into()))?;
        loop {
            if let Some(result) = done.as_ref() {
                return result.clone().map_err(TokenizeError::Tokenizer);
            }
            done = self.ready.wait(done).map_err(|_| TokenizeError::Tokenizer("piece cache poisoned".into()))?;
        }
    }

    fn finish(&self, result: Result<Arc<[u32]>, String>) {
        if let Ok(mut done) = self.done.lock() {
            *done = Some(result);
        }
        self.ready.notify_all();
    }
}

/// A template's `raise_exception('...')`, as Hugging Face's renderer provides it.
fn raise_exception(message: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// A `tokenizer_config.json` carries the template as `chat_template` (a string, or a list of named
/// templates of which `default` is used); anything else is the template itself.
fn read_template(path: &Path) -> Result<(String, Option<Value>), TokenizeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TokenizeError::Load(format!("cannot read chat template {}: {e}", path.display())))?;
    if path.extension().is_some_and(|e| e == "json") {
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| TokenizeError::Load(format!("{} is not JSON: {e}", path.display())))?;
        let template = match config.get("chat_template") {
            Some(Value::String(t)) => t.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(|| TokenizeError::Load(format!("{}: no `default` chat template", path.display())))?,
            _ => return Err(TokenizeError::Load(format!("{}: no `chat_template`", path.display()))),
        };
        return Ok((template, Some(config)));
    }
    Ok((text, None))
}

fn token_text(config: Option<&Value>, name: &str) -> String {
    match config.and_then(|c| c.get(name)) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ModelTokenizer {
    pub fn load(tokenizer: &Path, template: &Path) -> Result<Self, TokenizeError> {
        let tok = Tokenizer::from_file(tokenizer)
            .map_err(|e| TokenizeError::Load(format!("cannot load tokenizer {}: {e}", tokenizer.display())))?;
        // Its configuration as written, for what `pretokenize` may do with it.
        let described: Value = std::fs::read_to_string(tokenizer)
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or(Value::Null);
        let shape = Shape::of(&described);
        let (source, config) = read_template(template)?;
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| TokenizeError::Load(format!("chat template {} does not parse: {e}", template.display())))?;
        let mut specials: Vec<(String, u32)> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (t.content, id))
            .filter(|(c, _)| !c.is_empty())
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Ok(Self {
            tokenizer: tok,
            env,
            specials,
            bos: token_text(config.as_ref(), "bos_token"),
            eos: token_text(config.as_ref(), "eos_token"),
            cache: Mutex::default(),
            max_cache_bytes: DEFAULT_CACHE_BYTES,
            shape,
            words: Self::words(shape, DEFAULT_CACHE_BYTES),
        })
    }

    fn words(shape: Shape, budget: usize) -> Option<WordEncoder> {
        (shape == Shape::Gpt2).then(|| WordEncoder::new(budget / WORDS_SHARE).ok()).flatten()
    }

    /// Bounds the caches (pieces and pre-tokens together) to `bytes`.
    pub fn with_cache_budget(mut self, bytes: usize) -> Self {
        self.max_cache_bytes = bytes - bytes / WORDS_SHARE;
        self.words = Self::words(self.shape, bytes);
        self
    }

    /// What the caches hold now, in bytes.
    pub fn cache_bytes(&self) -> usize {
        self.cache.lock().map(|c| c.bytes).unwrap_or(0) + self.words.as_ref().map_or(0, WordEncoder::cached_bytes)
    }

    /// A piece without added tokens, encoded: by pre-token through the cache when the tokenizer
    /// allows, a long one in parts on all cores when it allows, else whole.
    fn encode_piece(&self, piece: &str) -> Result<Vec<u32>, String> {
        let one = |part: &str| match &self.words {
            Some(words) => words.encode(&self.tokenizer, part),
            None => self.tokenizer.encode_fast(part, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string()),
        };
        let parts = if self.shape == Shape::Whole { 1 } else { parts_for(piece.len()) };
        let cuts = if parts > 1 { cut_points(piece, parts) } else { Vec::new() };
        if cuts.is_empty() {
            return one(piece);
        }
        let bounds: Vec<(usize, usize)> =
            std::iter::once(0).chain(cuts.iter().copied()).zip(cuts.iter().copied().chain([piece.len()])).collect();
        let encoded: Vec<Result<Vec<u32>, String>> = bounds.par_iter().map(|(s, e)| one(&piece[*s..*e])).collect();
        let mut ids = Vec::with_capacity(piece.len() / 3);
        for part in encoded {
            ids.extend(part?);
        }
        Ok(ids)
    }

    /// The prompt the engine will see for this chat body.
    pub fn render(&self, chat: &Value) -> Result<String, TokenizeError> {
        let template = self.env.get_template("chat").map_err(|e| TokenizeError::Template(e.to_string()))?;
        let messages = chat.get("messages").cloned().unwrap_or(Value::Array(vec![]));
        let tools = chat.get("tools").cloned().unwrap_or(Value::Null);
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => true,
                bos_token => self.bos.clone(),
                eos_token => self.eos.clone(),
            })
            .map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// `text` cut at added tokens: `(piece, Some(id))` for an added token, `(piece, None)` between.
    /// Each added token's next occurrence is searched once and kept until the cut passes it, so a
    /// long prompt is scanned about once per added token, not once per piece.
    fn pieces<'t>(&self, text: &'t str) -> Vec<(&'t str, Option<u32>)> {
        let mut out = Vec::new();
        let mut next: Vec<Option<usize>> = self.specials.iter().map(|(s, _)| text.find(s.as_str())).collect();
        let mut start = 0;
        loop {
            // The earliest occurrence; at one position the longest added token (they are sorted
            // longest first, so the first found wins a tie).
            let mut best: Option<(usize, usize)> = None;
            for (i, pos) in next.iter_mut().enumerate() {
                if pos.is_some_and(|p| p < start) {
                    *pos = text[start..].find(self.specials[i].0.as_str()).map(|p| p + start);
                }
                if let Some(p) = *pos {
                    if best.is_none_or(|(bp, _)| p < bp) {
                        best = Some((p, i));
                    }
                }
            }
            let Some((pos, i)) = best else { break };
            let (special, id) = &self.specials[i];
            if start < pos {
                out.push((&text[start..pos], None));
            }
            out.push((&text[pos..pos + special.len()], Some(*id)));
            start = pos + special.len();
        }
        if start < text.len() {
            out.push((&text[start..], None));
        }
        out
    }

    /// Token ids of a rendered prompt, through the piece cache.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_until(text, None)
    }

    /// [`Self::encode`], given up between pieces once `deadline` passed: a caller that stopped
    /// waiting gets no answer, and the pieces encoded so far stay cached for the next one.
    pub fn encode_until(&self, text: &str, deadline: Option<Instant>) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        for (piece, special) in self.pieces(text) {
            if deadline.is_some_and(|d| Instant::now() > d) {
                return Err(TokenizeError::Abandoned);
            }
            match special {
                Some(id) => ids.push(id),
                None => ids.extend_from_slice(&self.piece_ids(piece)?),
            }
        }
        Ok(ids)
    }

    /// One piece's ids: cached, being encoded by another request (wait for it), or encoded here.
    fn piece_ids(&self, piece: &str) -> Result<Arc<[u32]>, TokenizeError> {
        let encoding = {
            let mut cache = self.cache.lock().map_err(|_| TokenizeError::Tokenizer("piece cache poisoned".into()))?;
            match cache.pieces.get(piece) {
                Some(Piece::Ready(ids)) => return Ok(Arc::clone(ids)),
                Some(Piece::Encoding(other)) => {
                    let other = Arc::clone(other);
                    drop(cache);
                    return other.wait();
                }
                None => {
                    let mine = Arc::new(Encoding::default());
                    cache.pieces.insert(piece.to_string(), Piece::Encoding(Arc::clone(&mine)));
                    mine
                }
            }
        };
        let result: Result<Arc<[u32]>, String> = self.encode_piece(piece).map(Into::into);
        if let Ok(mut cache) = self.cache.lock() {
            match &result {
                Ok(ids) => {
                    let bytes = piece_bytes(piece, ids);
                    if cache.bytes + bytes > self.max_cache_bytes {
                        cache.pieces.retain(|_, p| matches!(p, Piece::Encoding(_)));
                        cache.bytes = 0;
                    }
                    // A piece larger than the whole budget is answered, not kept.
                    if bytes <= self.max_cache_bytes {
                        cache.bytes += bytes;
                        cache.pieces.insert(piece.to_string(), Piece::Ready(Arc::clone(ids)));
                    } else {
                        cache.pieces.remove(piece);
                    }
                }
                Err(_) => {
                    cache.pieces.remove(piece);
                }
            };
        }
        encoding.finish(result.clone());
        result.map_err(TokenizeError::Tokenizer)
    }

    /// The whole prompt tokenized at once, without the cache: what the cache must equal.
    pub fn encode_uncached(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self
            .tokenizer
            .encode_fast(text, false)
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    pub fn tokenize_chat(&self, chat: &Value) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_chat_until(chat, None)
    }

    /// [`Self::tokenize_chat`], abandoned past `deadline` (see [`Self::encode_until`]).
    pub fn tokenize_chat_until(&self, chat: &Value, deadline: Option<Instant>) -> Result<Vec<u32>, TokenizeError> {
        self.encode_until(&self.render(chat)?, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shipped() -> ModelTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer");
        ModelTokenizer::load(&dir.join("tokenizer.json"), &dir.join("tokenizer_config.json")).unwrap()
    }

    #[test]
    fn the_chat_template_renders_chatml_with_the_generation_prompt() {
        let t = shipped();
        let chat = json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]},
        ]});
        assert_eq!(
            t.render(&chat).unwrap(),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn tools_are_rendered_into_the_prompt() {
        let t = shipped();
        let chat = json!({"messages": [{"role": "user", "content": "weather?"}],
                          "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]});
        let text = t.render(&chat).unwrap();
        assert!(text.contains("get_weather") && text.starts_with("<|im_start|>system\n# Tools"), "{text}");
    }

    #[test]
    fn the_piece_cache_gives_exactly_what_a_whole_encode_gives() {
        let t = shipped();
        for chat in [
            json!({"messages": [{"role": "system", "content": "the model router explains the cache"}, {"role": "user", "content": "please summarize 1234 documents"}]}),
            json!({"messages": [{"role": "user", "content": "漢字 と 日本語 の 模型 缓存 请求"}, {"role": "assistant", "content": "東京 北京"}, {"role": "user", "content": "fn main() { let x = 1; }"}]}),
            json!({"messages": [{"role": "user", "content": "<|im_end|> inside user text and trailing spaces   "}]}),
        ] {
            let text = t.render(&chat).unwrap();
            let whole = t.encode_uncached(&text).unwrap();
            assert_eq!(t.encode(&text).unwrap(), whole, "first, uncached pieces: {text:?}");
            assert_eq!(t.encode(&text).unwrap(), whole, "second, from the cache");
        }
    }

    /// A long new piece is cut at spaces and encoded in parts, each pre-token through the word
    /// cache: the ids are the whole encode's, first time and every time.
    #[test]
    fn long_pieces_encoded_in_parts_give_exactly_a_whole_encode() {
        let t = shipped();
        assert_eq!(t.shape, Shape::Gpt2);
        let mixed = "Tokens,  tabs\t and 1234 numbers; it's 漢字 e\u{301}   spaced\n\n  lines\u{a0}end. ";
        for unit in [mixed, "word ", "x", " ", "a\n"] {
            let piece = unit.repeat(crate::pretokenize::PARALLEL_MIN_BYTES * 3 / unit.len());
            let text = format!("<|im_start|>user\n{piece}<|im_end|>\n");
            let whole = t.encode_uncached(&text).unwrap();
            assert_eq!(t.encode(&text).unwrap(), whole, "first, in parts: {unit:?}");
            assert_eq!(t.encode(&text).unwrap(), whole, "from the piece cache: {unit:?}");
            let fresh = shipped();
            assert_eq!(fresh.encode_piece(&piece).unwrap(), fresh.encode_uncached(&piece).unwrap());
            assert_eq!(fresh.encode_piece(&piece).unwrap(), fresh.encode_uncached(&piece).unwrap(), "words cached");
        }
    }

    fn text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let pieces = prop::sample::select(vec![
            "a", "Z", "word", " ", "  ", "\n", "\t", "\r\n", "9", "123", ".", ",", "'s", "'", "!?", "é", "e\u{301}",
            "漢", "\u{a0}", "\u{3000}", "\u{2028}", "😀", "-", "_", "<", "/", "'ll", "the", " model",
        ]);
        prop::collection::vec(pieces, 0..80).prop_map(|v| v.concat())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        #[test]
        fn any_text_encodes_by_pre_token_as_it_does_whole(text in text()) {
            let t = shipped();
            proptest::prop_assert_eq!(t.encode_piece(&text).unwrap(), t.encode_uncached(&text).unwrap());
        }
    }

    #[test]
    fn concurrent_requests_bringing_one_new_piece_share_one_encoding() {
        let t = shipped();
        let text = format!("<|im_start|>system\n{}<|im_end|>\n", "a new shared prefix arrives in a burst ".repeat(300));
        let whole = t.encode_uncached(&text).unwrap();
        let results: Vec<Vec<u32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| t.encode(&text).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|ids| *ids == whole));
        let cache = t.cache.lock().unwrap();
        assert!(cache.pieces.values().all(|p| matches!(p, Piece::Ready(_))), "no encoding left pending");
    }

    #[test]
    fn a_shared_system_prompt_is_tokenized_once() {
        let t = shipped();
        let system = "the engine keeps a prefix cache ".repeat(200);
        for question in ["what is a bucket", "what is prefill"] {
            let chat =
                json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
            t.tokenize_chat(&chat).unwrap();
        }
        let cache = t.cache.lock().unwrap();
        let system_pieces = cache.pieces.keys().filter(|k| k.contains("prefix cache")).count();
        assert_eq!(system_pieces, 1, "one cached piece for the shared system prompt");
    }

    /// The cache was bounded by 65,536 pieces of any size: 65,536 distinct 1 MiB system prompts
    /// were 64 GiB. It is bounded in bytes now, at the budget itself.
    #[test]
    fn the_piece_cache_is_bounded_in_bytes() {
        let budget = 200_000;
        let t = shipped().with_cache_budget(budget);
        for i in 0..40 {
            let text = format!("<|im_start|>system\n{i} {}<|im_end|>\n", "distinct words every time ".repeat(400));
            let whole = t.encode_uncached(&text).unwrap();
            assert_eq!(t.encode(&text).unwrap(), whole);
            assert!(t.cache_bytes() <= budget, "{} bytes cached", t.cache_bytes());
        }
        assert!(t.cache_bytes() > 0);
        let huge = "x".repeat(budget * 2);
        assert_eq!(t.encode(&huge).unwrap(), t.encode_uncached(&huge).unwrap());
        assert!(t.cache_bytes() <= budget, "a piece above the budget is not kept");
    }

    #[test]
    fn tokenization_past_its_deadline_is_abandoned_and_keeps_what_it_encoded() {
        let t = shipped();
        let text = "<|im_start|>system\nfirst piece<|im_end|>\n<|im_start|>user\nsecond<|im_end|>\n";
        let past = Instant::now() - std::time::Duration::from_millis(1);
        assert!(matches!(t.encode_until(text, Some(past)), Err(TokenizeError::Abandoned)));
        assert_eq!(TokenizeError::Abandoned.status(), StatusCode::SERVICE_UNAVAILABLE);
        let later = Instant::now() + std::time::Duration::from_secs(60);
        assert_eq!(t.encode_until(text, Some(later)).unwrap(), t.encode_uncached(text).unwrap());
    }

    #[test]
    fn a_template_that_raises_is_a_template_error() {
        let dir = std::env::temp_dir().join(format!("sgl-indexer-raise-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("t.jinja"), "{{ raise_exception('roles must alternate') }}").unwrap();
        let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        let t = ModelTokenizer::load(&tok, &dir.join("t.jinja")).unwrap();
        let err = t.render(&json!({"messages": []})).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }
}
