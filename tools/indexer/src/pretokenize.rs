//! Encoding a long piece of prompt fast, with ids equal to the tokenizer's own whole encode.
//!
//! A byte-level BPE tokenizer (GPT-2's pre-tokenizer, Llama 3's, Qwen's) first cuts its input into
//! pre-tokens by a regular expression and then encodes each pre-token on its own. Two things follow:
//!
//! - No pre-token of those expressions spans a space that follows a non-space character (a space
//!   only ever starts a pre-token, or belongs to a run of whitespace). A long piece cut at such
//!   spaces encodes, part by part, to the ids of the whole: the parts are encoded on all cores.
//! - With GPT-2's expression and no normalizer, the pre-tokens are found here (the `regex` crate,
//!   with its one look-ahead handled by hand) and each distinct pre-token is encoded once by the
//!   tokenizer's own model and remembered: natural text repeats its words, so most of a first
//!   encode is lookups.
//!
//! Which of these a tokenizer allows is read from its `tokenizer.json`; anything else is encoded
//! whole, as before. Property tests hold the ids equal to the tokenizer's whole encode (with the
//! shipped tokenizer), the splitter equal to GPT-2's expression, and every cut point outside
//! every pre-token of the three expressions, as Oniguruma (Hugging Face's engine) runs them.

use std::sync::RwLock;

use hashbrown::HashMap;
use regex::Regex;
use serde_json::Value;
use tokenizers::{Model, Tokenizer};

/// Pieces from this many bytes are cut into parts encoded in parallel.
pub const PARALLEL_MIN_BYTES: usize = 32 << 10;
/// The smallest part worth a thread of its own.
const PART_MIN_BYTES: usize = 16 << 10;
/// Pre-tokens longer than this are encoded each time, not remembered.
const MAX_WORD_BYTES: usize = 64;
/// What a remembered pre-token costs beyond its text and ids (the map entry, two boxes).
const WORD_OVERHEAD: usize = 48;

/// GPT-2's pre-tokenizer expression, as Hugging Face's `ByteLevel` pre-tokenizer applies it.
#[cfg(test)]
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// The same without its look-ahead alternative, which [`Gpt2Splitter`] applies by hand.
const GPT2_WITHOUT_LOOKAHEAD: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
/// Split expressions known to start a pre-token at every space after a non-space: Llama 3's and
/// Qwen 2's (which differ in how many digits make one pre-token).
const KNOWN_SPLIT_PATTERNS: [&str; 2] = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// What a tokenizer's configuration allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// GPT-2's byte-level pre-tokenizer, no normalizer: pre-tokens found and remembered here.
    Gpt2,
    /// A known pre-tokenizer: long pieces are cut at spaces and the parts encoded in parallel.
    Splittable,
    /// Encoded whole by the tokenizer.
    Whole,
}

impl Shape {
    /// The shape of the tokenizer a `tokenizer.json` describes.
    pub fn of(config: &Value) -> Shape {
        let normalizer = config.get("normalizer").unwrap_or(&Value::Null);
        let no_normalizer = normalizer.is_null();
        let nfc = normalizer.get("type").and_then(Value::as_str) == Some("NFC");
        let pre = config.get("pre_tokenizer").unwrap_or(&Value::Null);
        let kind = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_string);
        let flag = |v: &Value, name: &str| v.get(name).and_then(Value::as_bool);
        let byte_level = |v: &Value, regex: bool| {
            kind(v).as_deref() == Some("ByteLevel")
                && flag(v, "use_regex") == Some(regex)
                && flag(v, "add_prefix_space") == Some(false)
        };
        if no_normalizer && byte_level(pre, true) {
            return Shape::Gpt2;
        }
        let known_split = |v: &Value| {
            kind(v).as_deref() == Some("Split")
                && v.get("behavior").and_then(Value::as_str) == Some("Isolated")
                && flag(v, "invert") == Some(false)
                && v.get("pattern")
                    .and_then(|p| p.get("Regex"))
                    .and_then(Value::as_str)
                    .is_some_and(|p| KNOWN_SPLIT_PATTERNS.contains(&p))
        };
        let steps = pre.get("pretokenizers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
        let split_then_bytes = kind(pre).as_deref() == Some("Sequence")
            && matches!(steps, [split, bytes] if known_split(split) && byte_level(bytes, false));
        if (no_normalizer || nfc) && split_then_bytes {
            return Shape::Splittable;
        }
        Shape::Whole
    }
}

/// Where a long piece may be cut: at spaces that follow a non-space, about `parts` equal parts.
pub fn cut_points(text: &str, parts: usize) -> Vec<usize> {
    let mut cuts = Vec::new();
    let step = text.len() / parts.max(1);
    let bytes = text.as_bytes();
    let mut from = step;
    while cuts.len() + 1 < parts && from < text.len() {
        let found = (from..text.len())
            .find(|&p| bytes[p] == b' ' && text[..p].chars().next_back().is_some_and(|c| !c.is_whitespace()));
        let Some(p) = found else { break };
        cuts.push(p);
        from = p + step.max(1);
    }
    cuts
}

/// How many parts a piece is encoded in.
pub fn parts_for(len: usize) -> usize {
    if len < PARALLEL_MIN_BYTES {
        return 1;
    }
    rayon::current_num_threads().clamp(1, (len / PART_MIN_BYTES).max(1))
}

/// GPT-2's pre-tokenizer: the expression without its look-ahead, then `\s+(?!\S)` by hand — a run
/// of whitespace before a non-space gives its last character to what follows.
pub struct Gpt2Splitter {
    regex: Regex,
}

impl Gpt2Splitter {
    pub fn new() -> Result<Self, regex::Error> {
        Ok(Self { regex: Regex::new(GPT2_WITHOUT_LOOKAHEAD)? })
    }

    /// Calls `each` with every pre-token of `text`, in order.
    pub fn split<'t>(&self, text: &'t str, mut each: impl FnMut(&'t str)) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.regex.find_at(text, pos) else {
                each(&text[pos..]);
                return;
            };
            if m.start() > pos {
                // Not reachable with this expression (it matches every character); kept whole.
                each(&text[pos..m.start()]);
            }
            let mut end = m.end();
            let word = m.as_str();
            // Only the last alternative, `\s+`, matches whitespace alone; the original tries
            // `\s+(?!\S)` first, which leaves the run's last character to the next pre-token.
            if end < text.len() && word.chars().all(char::is_whitespace) {
                if let Some(last) = word.chars().next_back().filter(|_| word.chars().nth(1).is_some()) {
                    end -= last.len_utf8();
                }
            }
            each(&text[m.start()..end]);
            pos = end;
        }
    }
}

/// GPT-2's byte-to-character map: what the byte-level pre-tokenizer hands the model.
fn byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut extra = 0u32;
    for (b, slot) in map.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let code = if printable {
            b as u32
        } else {
            extra += 1;
            255 + extra
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    map
}

/// Remembered pre-tokens' ids, bounded in bytes (past its budget it starts over).
#[derive(Default)]
struct Words {
    ids: HashMap<Box<str>, Box<[u32]>>,
    bytes: usize,
}

/// GPT-2-shaped tokenizers encoded pre-token by pre-token through a cache of their ids.
pub struct WordEncoder {
    splitter: Gpt2Splitter,
    chars: [char; 256],
    words: RwLock<Words>,
    max_bytes: usize,
}

impl WordEncoder {
    pub fn new(max_bytes: usize) -> Result<Self, regex::Error> {
        Ok(Self { splitter: Gpt2Splitter::new()?, chars: byte_chars(), words: RwLock::default(), max_bytes })
    }

    pub fn cached_bytes(&self) -> usize {
        self.words.read().map(|w| w.bytes).unwrap_or(0)
    }

    /// `text`'s ids, as the tokenizer's pre-tokenizer and model give them.
    pub fn encode(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut new: Vec<(&str, Vec<u32>)> = Vec::new();
        let mut failed = None;
        {
            let words = self.words.read().map_err(|_| "word cache poisoned".to_string())?;
            self.splitter.split(text, |word| {
                if failed.is_some() {
                    return;
                }
                if let Some(known) = words.ids.get(word) {
                    ids.extend_from_slice(known);
                    return;
                }
                match self.model_ids(tokenizer, word) {
                    Ok(fresh) => {
                        ids.extend_from_slice(&fresh);
                        if word.len() <= MAX_WORD_BYTES {
                            new.push((word, fresh));
                        }
                    }
                    Err(e) => failed = Some(e),
                }
            });
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if !new.is_empty() {
            if let Ok(mut words) = self.words.write() {
                for (word, fresh) in new {
                    let bytes = word.len() + 4 * fresh.len() + WORD_OVERHEAD;
                    if words.bytes + bytes > self.max_bytes {
                        *words = Words::default();
                    }
                    if words.ids.insert(word.into(), fresh.into_boxed_slice()).is_none() {
                        words.bytes += bytes;
                    }
                }
            }
        }
        Ok(ids)
    }

    fn model_ids(&self, tokenizer: &Tokenizer, word: &str) -> Result<Vec<u32>, String> {
        let mapped: String = word.bytes().map(|b| self.chars[b as usize]).collect();
        let tokens = tokenizer.get_model().tokenize(&mapped).map_err(|e| e.to_string())?;
        Ok(tokens.into_iter().map(|t| t.id).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_splitter_gives_the_original_expressions_pre_tokens() {
        let splitter = Gpt2Splitter::new().unwrap();
        let original = onig::Regex::new(GPT2_PATTERN).unwrap();
        for text in [
            "hello world",
            "a   b",
            "a \n b",
            "x\n\ny",
            "trailing   ",
            "  leading",
            "it's 12 o'clock, isn't it?",
            "tab\there\u{a0}nbsp\u{2028}line",
            "漢字 と\u{3000}日本語",
            "",
            " ",
            "e\u{301} combining",
        ] {
            let mut ours = Vec::new();
            splitter.split(text, |w| ours.push(w));
            let theirs: Vec<&str> = original.find_iter(text).map(|(s, e)| &text[s..e]).collect();
            assert_eq!(ours, theirs, "{text:?}");
        }
    }

    fn text() -> impl Strategy<Value = String> {
        let pieces = prop::sample::select(vec![
            "a", "Z", "word", " ", "  ", "\n", "\t", "\r\n", "9", "123", ".", ",", "'s", "'", "!?", "é", "e\u{301}",
            "漢", "\u{a0}", "\u{3000}", "\u{2028}", "😀", "-", "_", "<", "/", "$", "'ll",
        ]);
        prop::collection::vec(pieces, 0..60).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn split_equals_the_original_expression(text in text()) {
            let splitter = Gpt2Splitter::new().unwrap();
            let original = onig::Regex::new(GPT2_PATTERN).unwrap();
            let mut ours = Vec::new();
            splitter.split(&text, |w| ours.push(w));
            let theirs: Vec<&str> = original.find_iter(&text).map(|(s, e)| &text[s..e]).collect();
            prop_assert_eq!(ours, theirs);
        }

        #[test]
        fn no_pre_token_spans_a_cut_point(text in text(), parts in 1usize..6) {
            let cuts = cut_points(&text, parts);
            for pattern in std::iter::once(GPT2_PATTERN).chain(KNOWN_SPLIT_PATTERNS) {
                let original = onig::Regex::new(pattern).unwrap();
                for (s, e) in original.find_iter(&text) {
                    prop_assert!(!cuts.iter().any(|c| s < *c && *c < e), "{:?} spans a cut in {:?}", &text[s..e], cuts);
                }
            }
        }
    }

    /// Remembered pre-tokens are bounded in bytes: past the budget the cache starts over, and
    /// every answer is still the model's.
    #[test]
    fn remembered_pre_tokens_stay_within_their_budget() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        let tokenizer = Tokenizer::from_file(path).unwrap();
        let budget = 4_000;
        let words = WordEncoder::new(budget).unwrap();
        for round in 0..20 {
            let text: String = (0..200).map(|i| format!(" w{round}x{i}")).collect();
            let whole = tokenizer.encode_fast(text.as_str(), false).unwrap().get_ids().to_vec();
            assert_eq!(words.encode(&tokenizer, &text).unwrap(), whole);
            assert!(words.cached_bytes() <= budget, "{} of {budget} bytes", words.cached_bytes());
        }
        assert!(words.cached_bytes() > 0);
        let long = "y".repeat(MAX_WORD_BYTES + 1);
        words.encode(&tokenizer, &long).unwrap();
        assert!(
            words.words.read().unwrap().ids.keys().all(|w| w.len() <= MAX_WORD_BYTES),
            "a long pre-token is not kept"
        );
    }

    #[test]
    fn the_shipped_tokenizer_is_gpt2_shaped_and_others_are_read_right() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer/tokenizer.json");
        let shipped: Value = serde_json::from_str(&std::fs::read_to_string(dir).unwrap()).unwrap();
        assert_eq!(Shape::of(&shipped), Shape::Gpt2);
        let qwen = serde_json::json!({
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": KNOWN_SPLIT_PATTERNS[1]}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}});
        assert_eq!(Shape::of(&qwen), Shape::Splittable);
        let mut other = qwen.clone();
        other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = Value::from(r"\w+|\S");
        assert_eq!(Shape::of(&other), Shape::Whole, "an unknown expression is encoded whole");
        let metaspace = serde_json::json!({"normalizer": null, "pre_tokenizer": {"type": "Metaspace"}});
        assert_eq!(Shape::of(&metaspace), Shape::Whole);
    }
}
