//! The filter ↔ indexer wire (spec §7), one set of types for both ends: the filter serializes the
//! queries and notices and parses the answers; `sgl-indexer` parses the queries and serializes the
//! answers from the same structs. Dynamo's standalone indexer speaks its own `/query` shape
//! ([`DynamoQuery`], [`DynamoScores`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Tokenize a chat body with the model's template, then match it.
pub const MATCH_PATH: &str = "/v1/prefix/match";
/// Match a request's own token ids.
pub const QUERY_PATH: &str = "/query";
/// Tell the indexer which engine got the request behind a handle.
pub const ROUTED_PATH: &str = "/v1/prefix/routed";
/// On a match call: the caller sends a routed notice after every decision on the answer, so the
/// indexer may hold concurrent queries sharing the prefix until it arrives (its "claims").
pub const ROUTED_NOTICE_HEADER: &str = "x-sgl-routed-notice";
/// The largest body the indexer reads (it answers 413 above it).
pub const MAX_INDEXER_BODY_BYTES: usize = 4 << 20;

/// `POST /query`: a request's exact token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query<'a> {
    #[serde(borrow)]
    pub model: Cow<'a, str>,
    pub token_ids: Cow<'a, [u32]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
}

/// One engine's entry in an answer: its longest match, what its own events confirm, and the
/// longest prefix held in each storage medium.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineEntry {
    pub matched_tokens: u64,
    #[serde(default)]
    pub confirmed_tokens: u64,
    /// Absent: every matched token counts as GPU-held.
    #[serde(rename = "GPU", default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u64>,
    #[serde(rename = "CPU_PINNED", default)]
    pub cpu_pinned: u64,
    #[serde(rename = "DISK", default)]
    pub disk: u64,
    #[serde(rename = "EXTERNAL", default)]
    pub external: u64,
    /// Longest match per data-parallel rank (`"<rank>": tokens`), for engines of several ranks.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ranks: BTreeMap<String, u64>,
}

/// The answer to a match or a query: `input_tokens` only for a chat body (the caller of `/query`
/// counted its own), every engine's entry by id, and the handle a routed notice names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    pub data: BTreeMap<String, EngineEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<String>,
}

/// `POST /v1/prefix/routed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedNotice<'a> {
    #[serde(borrow)]
    pub handle: Cow<'a, str>,
    #[serde(borrow)]
    pub worker: Cow<'a, str>,
    /// The data-parallel rank the request was sent to (`routed_dp_rank`), when it was named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
}

/// Dynamo's `POST /query`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DynamoQuery<'a> {
    pub model_name: &'a str,
    pub token_ids: &'a [u32],
}

/// Dynamo's answer: matched tokens per engine id, per data-parallel rank.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DynamoScores {
    pub scores: BTreeMap<String, BTreeMap<String, u64>>,
}

/// What one engine holds of the request's prompt, in tokens, with the part held in GPU memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHit {
    pub engine: String,
    pub matched_tokens: u64,
    pub gpu_tokens: u64,
    /// Tokens matched per data-parallel rank, when the indexer said (rank, tokens).
    pub ranks: Vec<(u32, u64)>,
    /// When the router first sent the matched prefix there, for a hit known only from its own
    /// dispatches; 0 when the engine said it holds it ([`crate::state::prefix::Held::sent_ms`]).
    pub sent_ms: u64,
}

impl PrefixHit {
    /// Tokens worth of cache for ranking: a token held only in CPU memory or on disk must be
    /// loaded back before it saves prefill, so it counts half.
    pub fn effective_tokens(&self) -> u64 {
        let gpu = self.gpu_tokens.min(self.matched_tokens);
        gpu + (self.matched_tokens - gpu) / 2
    }
}

/// The indexer's answer for one request, as the router uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerMatch {
    pub input_tokens: u64,
    /// Engines holding part of the prompt, best first.
    pub hits: Vec<PrefixHit>,
    /// Names the computed blocks in a later routed notice.
    pub handle: Option<String>,
}

/// The answer, or why there is none (error, non-2xx, timeout, garbage, the cap): *unavailable*.
pub type IndexerAnswer = Result<IndexerMatch, String>;

fn checked(status: Option<u16>) -> Result<(), String> {
    match status {
        Some(200..=299) => Ok(()),
        Some(s) => Err(format!("the indexer answered {s}")),
        None => Err("the indexer did not answer in time".to_string()),
    }
}

fn rank(hits: &mut [PrefixHit]) {
    hits.sort_by(|a, b| b.effective_tokens().cmp(&a.effective_tokens()).then_with(|| a.engine.cmp(&b.engine)));
}

/// Ranks named by number, capped at the input; others are not ranks and are left out.
fn per_rank(ranks: BTreeMap<String, u64>, input_tokens: u64) -> Vec<(u32, u64)> {
    let mut out: Vec<(u32, u64)> =
        ranks.into_iter().filter_map(|(r, t)| Some((r.parse().ok()?, t.min(input_tokens)))).collect();
    out.sort_unstable();
    out
}

/// Our indexer's answer; `known_input` is the input length when the caller counted it (a
/// token-id query).
pub fn parse_answer(status: Option<u16>, body: &[u8], known_input: Option<u64>) -> IndexerAnswer {
    checked(status)?;
    let answer: MatchAnswer =
        serde_json::from_slice(body).map_err(|e| format!("the indexer's answer is not one: {e}"))?;
    let input_tokens = answer.input_tokens.or(known_input).ok_or("the indexer's answer has no input_tokens")?;
    let mut hits: Vec<PrefixHit> = answer
        .data
        .into_iter()
        .map(|(engine, m)| PrefixHit {
            engine,
            matched_tokens: m.matched_tokens.min(input_tokens),
            gpu_tokens: m.gpu.unwrap_or(m.matched_tokens),
            ranks: per_rank(m.ranks, input_tokens),
            sent_ms: 0,
        })
        .filter(|h| h.matched_tokens > 0)
        .collect();
    rank(&mut hits);
    Ok(IndexerMatch { input_tokens, hits, handle: answer.handle })
}

/// Dynamo's answer: an engine's match is its best rank's. It knows no storage tiers, so every
/// token counts as GPU-held.
pub fn parse_dynamo(status: Option<u16>, body: &[u8], input_tokens: u64) -> IndexerAnswer {
    checked(status)?;
    let answer: DynamoScores =
        serde_json::from_slice(body).map_err(|e| format!("the indexer's answer is not one: {e}"))?;
    let mut hits: Vec<PrefixHit> = answer
        .scores
        .into_iter()
        .filter_map(|(engine, ranks)| {
            let best = ranks.values().copied().max()?.min(input_tokens);
            let ranks = per_rank(ranks, input_tokens);
            (best > 0).then_some(PrefixHit { engine, matched_tokens: best, gpu_tokens: best, ranks, sent_ms: 0 })
        })
        .collect();
    rank(&mut hits);
    Ok(IndexerMatch { input_tokens, hits, handle: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn dynamos_scores_are_read_per_worker_at_its_best_rank() {
        let body = br#"{"scores": {"1": {"0": 32, "1": 160}, "2": {"0": 48}, "3": {"0": 0}}}"#;
        let m = parse_dynamo(Some(200), body, 150).unwrap();
        let hits: Vec<(&str, u64)> = m.hits.iter().map(|h| (h.engine.as_str(), h.matched_tokens)).collect();
        assert_eq!(hits, [("1", 150), ("2", 48)], "capped at the input, zero dropped");
        assert_eq!((m.input_tokens, m.handle), (150, None));
        assert!(parse_dynamo(Some(200), br#"{"data": {}}"#, 10).is_err());
        assert!(parse_dynamo(Some(503), b"", 10).is_err());
    }

    #[test]
    fn an_answer_gives_exact_tokens_and_hits_ranked_with_cpu_held_tokens_at_half() {
        let body = br#"{"input_tokens": 900, "handle": "7", "data": {
            "A": {"matched_tokens": 800, "GPU": 0, "CPU_PINNED": 800},
            "B": {"matched_tokens": 600, "GPU": 600},
            "C": {"matched_tokens": 0}}}"#;
        let m = parse_answer(Some(200), body, None).unwrap();
        assert_eq!(m.input_tokens, 900);
        let order: Vec<(&str, u64)> = m.hits.iter().map(|h| (h.engine.as_str(), h.effective_tokens())).collect();
        assert_eq!(order, [("B", 600), ("A", 400)], "a GPU hit outranks a longer CPU-only one");
        assert_eq!(m.handle.as_deref(), Some("7"));
    }

    #[test]
    fn anything_but_a_good_answer_is_unavailable() {
        assert!(parse_answer(None, b"", None).is_err());
        assert!(parse_answer(Some(503), b"{}", None).is_err());
        assert!(parse_answer(Some(200), b"nope", None).is_err());
        assert!(parse_answer(Some(200), br#"{"data": {}}"#, None).is_err(), "no input length");
        assert!(parse_answer(Some(200), br#"{"data": {"A": {"matched_tokens": "x"}}}"#, Some(3)).is_err());
        assert!(parse_answer(Some(200), br#"{"data": {}}"#, Some(3)).is_ok(), "a counted query needs none");
    }

    /// What the indexer serializes is what the filter parses, field for field.
    #[test]
    fn an_answer_round_trips_through_the_shared_types() {
        let entry = EngineEntry {
            matched_tokens: 64,
            confirmed_tokens: 32,
            gpu: Some(48),
            cpu_pinned: 64,
            ..Default::default()
        };
        let answer = MatchAnswer {
            input_tokens: Some(100),
            data: [("A".to_string(), entry)].into_iter().collect(),
            handle: Some("9".into()),
        };
        let bytes = serde_json::to_vec(&answer).unwrap();
        assert_eq!(serde_json::from_slice::<MatchAnswer>(&bytes).unwrap(), answer);
        let m = parse_answer(Some(200), &bytes, None).unwrap();
        assert_eq!(
            m.hits,
            [PrefixHit { engine: "A".into(), matched_tokens: 64, gpu_tokens: 48, ranks: vec![], sent_ms: 0 }]
        );
        let query = Query { model: "m".into(), token_ids: vec![1, 2].into(), lora_name: None, cache_salt: None };
        let bytes = serde_json::to_vec(&query).unwrap();
        assert_eq!(bytes, br#"{"model":"m","token_ids":[1,2]}"#);
        assert_eq!(serde_json::from_slice::<Query>(&bytes).unwrap(), query);
    }
}
