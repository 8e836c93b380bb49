//! The indexer's answer (spec §7): one callout per request — `POST /v1/prefix/match` with the
//! client's chat body (ours tokenizes it), or `POST /query` with a request's own token ids (ours,
//! or Dynamo's standalone KV indexer with `api: dynamo`) — answered with every engine's matched
//! prefix and, for a chat body, the exact input length. Any failure (error, non-2xx, timeout,
//! garbage, the concurrency cap) is *unavailable*: the caller falls back to the byte estimate and
//! to load, counted apart from a confirmed miss.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use crate::config::IndexerApi;
use crate::host::{CalloutRequest, Callouts};

/// What one engine holds of the request's prompt, in tokens, with the part held in GPU memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHit {
    pub worker: String,
    pub matched_tokens: u64,
    pub gpu_tokens: u64,
}

impl PrefixHit {
    /// Tokens worth of cache for ranking: a token held only in CPU memory or on disk must be
    /// loaded back before it saves prefill, so it counts half.
    pub fn effective_tokens(&self) -> u64 {
        let gpu = self.gpu_tokens.min(self.matched_tokens);
        gpu + (self.matched_tokens - gpu) / 2
    }
}

/// The indexer's answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerMatch {
    pub input_tokens: u64,
    pub hits: Vec<PrefixHit>,
    /// Names the computed blocks in a later routed notice.
    pub handle: Option<String>,
}

pub type IndexerAnswer = Result<IndexerMatch, String>;

/// On a match call: the caller sends a routed notice after every decision on the answer, so the
/// indexer may hold concurrent queries sharing the prefix until it arrives (its "claims").
pub const ROUTED_NOTICE_HEADER: &str = "x-sgl-routed-notice";
/// The largest body the indexer reads (it answers 413 above it).
pub const MAX_INDEXER_BODY_BYTES: usize = 4 << 20;

fn answer_json(status: Option<u16>, body: &[u8]) -> Result<Value, String> {
    match status {
        Some(200..=299) => {}
        Some(s) => return Err(format!("the indexer answered {s}")),
        None => return Err("the indexer did not answer in time".to_string()),
    }
    serde_json::from_slice(body).map_err(|e| format!("the indexer's answer is not JSON: {e}"))
}

/// `{"input_tokens": N, "data": {"<worker>": {"matched_tokens", "GPU", ...}}, "handle": "..."}`;
/// `known_input` is the input length when the caller counted it (a token-id query).
pub fn parse_answer(status: Option<u16>, body: &[u8]) -> IndexerAnswer {
    parse_sgl(status, body, None)
}

fn parse_sgl(status: Option<u16>, body: &[u8], known_input: Option<u64>) -> IndexerAnswer {
    let v = answer_json(status, body)?;
    let input_tokens = v
        .get("input_tokens")
        .and_then(Value::as_u64)
        .or(known_input)
        .ok_or("the indexer's answer has no input_tokens")?;
    let data = v.get("data").and_then(Value::as_object).ok_or("the indexer's answer has no data")?;
    let mut hits: Vec<PrefixHit> = data
        .iter()
        .filter_map(|(worker, m)| {
            let matched = m.get("matched_tokens")?.as_u64()?;
            Some(PrefixHit {
                worker: worker.clone(),
                matched_tokens: matched.min(input_tokens),
                gpu_tokens: m.get("GPU").and_then(Value::as_u64).unwrap_or(matched),
            })
        })
        .filter(|h| h.matched_tokens > 0)
        .collect();
    rank(&mut hits);
    let handle = v.get("handle").and_then(Value::as_str).map(str::to_string);
    Ok(IndexerMatch { input_tokens, hits, handle })
}

fn rank(hits: &mut [PrefixHit]) {
    hits.sort_by(|a, b| b.effective_tokens().cmp(&a.effective_tokens()).then_with(|| a.worker.cmp(&b.worker)));
}

/// Dynamo's standalone indexer: `{"scores": {"<worker id>": {"<dp rank>": tokens}}}`; a worker's
/// match is its best rank's. It knows no storage tiers, so every token counts as GPU-held.
fn parse_dynamo(status: Option<u16>, body: &[u8], input_tokens: u64) -> IndexerAnswer {
    let v = answer_json(status, body)?;
    let scores = v.get("scores").and_then(Value::as_object).ok_or("the indexer's answer has no scores")?;
    let mut hits: Vec<PrefixHit> = scores
        .iter()
        .filter_map(|(worker, ranks)| {
            let best = ranks.as_object()?.values().filter_map(Value::as_u64).max()?.min(input_tokens);
            (best > 0).then(|| PrefixHit { worker: worker.clone(), matched_tokens: best, gpu_tokens: best })
        })
        .collect();
    rank(&mut hits);
    Ok(IndexerMatch { input_tokens, hits, handle: None })
}

/// Where the indexer is, and the per-VM cap on callouts in flight.
#[derive(Debug)]
pub struct IndexerClient {
    api: IndexerApi,
    callouts: Arc<dyn Callouts>,
    cluster: String,
    authority: String,
    timeout_ms: u64,
    max_in_flight: u64,
    in_flight: Arc<AtomicU64>,
    token: Option<(String, String)>,
}

/// Gives its slot back however the callout ends, the request aborted included.
struct Slot(Arc<AtomicU64>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl IndexerClient {
    pub fn new(
        callouts: Arc<dyn Callouts>,
        cluster: String,
        authority: String,
        timeout_ms: u64,
        max_in_flight: u64,
        token: Option<(String, String)>,
        api: IndexerApi,
    ) -> Self {
        Self { api, callouts, cluster, authority, timeout_ms, max_in_flight, in_flight: Arc::default(), token }
    }

    /// Every POST to the indexer carries the token, when one is configured (spec §7).
    fn headers(&self) -> Vec<(String, String)> {
        let mut headers = vec![("content-type".to_string(), "application/json".to_string())];
        if let Some((name, value)) = &self.token {
            headers.push((name.clone(), value.clone()));
        }
        headers
    }

    /// Whether this indexer tokenizes chat bodies itself (ours does; Dynamo's takes token ids only).
    pub fn tokenizes_chat(&self) -> bool {
        self.api == IndexerApi::Sgl
    }

    /// Starts the match callout for a chat body. The future never waits past the callout's
    /// timeout; past the cap it is unavailable at once.
    pub fn match_chat(&self, body: &[u8]) -> crate::host::BoxFuture<'static, IndexerAnswer> {
        self.call("/v1/prefix/match", true, body.to_vec(), parse_answer)
    }

    /// Starts the match callout for a request's exact token ids, in the configured API's shape.
    pub fn match_tokens(&self, model: &str, token_ids: &[u32]) -> crate::host::BoxFuture<'static, IndexerAnswer> {
        let input = token_ids.len() as u64;
        match self.api {
            IndexerApi::Sgl => {
                let body = serde_json::json!({"model": model, "token_ids": token_ids}).to_string().into_bytes();
                self.call("/query", true, body, move |status, body| parse_sgl(status, body, Some(input)))
            }
            IndexerApi::Dynamo => {
                let body = serde_json::json!({"model_name": model, "token_ids": token_ids}).to_string().into_bytes();
                self.call("/query", false, body, move |status, body| parse_dynamo(status, body, input))
            }
        }
    }

    fn call(
        &self,
        path: &str,
        will_notify: bool,
        body: Vec<u8>,
        parse: impl FnOnce(Option<u16>, &[u8]) -> IndexerAnswer + Send + 'static,
    ) -> crate::host::BoxFuture<'static, IndexerAnswer> {
        if body.len() > MAX_INDEXER_BODY_BYTES {
            // The indexer would answer 413: route on the estimate without asking.
            return Box::pin(std::future::ready(Err("the request is larger than the indexer reads".to_string())));
        }
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Box::pin(std::future::ready(Err("the indexer's concurrency cap is reached".to_string())));
        }
        let slot = Slot(Arc::clone(&self.in_flight));
        let mut headers = self.headers();
        if will_notify {
            headers.push((ROUTED_NOTICE_HEADER.to_string(), "1".to_string()));
        }
        let request = CalloutRequest {
            cluster: self.cluster.clone(),
            method: "POST".to_string(),
            path: path.to_string(),
            authority: self.authority.clone(),
            headers,
            body: Some(body),
            timeout_ms: self.timeout_ms,
        };
        // Dispatched on the first poll, inside the selection, so the filter sees the callout the
        // pending selection waits on.
        let callouts = Arc::clone(&self.callouts);
        Box::pin(async move {
            let future = callouts.dispatch(request).map_err(|e| format!("the indexer callout was not sent: {e}"))?;
            let response = future.await;
            drop(slot);
            parse(response.status, &response.body)
        })
    }

    /// The fire-and-forget notice that `worker` got the request behind `handle`.
    pub fn routed_notice(&self, handle: &str, worker: &str) -> CalloutRequest {
        let headers = self.headers();
        CalloutRequest {
            cluster: self.cluster.clone(),
            method: "POST".to_string(),
            path: "/v1/prefix/routed".to_string(),
            authority: self.authority.clone(),
            headers,
            body: Some(serde_json::json!({"handle": handle, "worker": worker}).to_string().into_bytes()),
            timeout_ms: self.timeout_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{CalloutResponse, MemoryCallouts};
    use crate::testing::now;
    use crate::testing::test;

    fn client(callouts: Arc<MemoryCallouts>, cap: u64) -> IndexerClient {
        IndexerClient::new(callouts, "sgl_indexer".into(), "127.0.0.1:9100".into(), 50, cap, None, IndexerApi::Sgl)
    }

    #[test]
    fn dynamos_scores_are_read_per_worker_at_its_best_rank() {
        let body = br#"{"scores": {"1": {"0": 32, "1": 160}, "2": {"0": 48}, "3": {"0": 0}}}"#;
        let m = parse_dynamo(Some(200), body, 150).unwrap();
        let hits: Vec<(&str, u64)> = m.hits.iter().map(|h| (h.worker.as_str(), h.matched_tokens)).collect();
        assert_eq!(hits, [("1", 150), ("2", 48)], "capped at the input, zero dropped");
        assert_eq!((m.input_tokens, m.handle), (150, None));
        assert!(parse_dynamo(Some(200), br#"{"data": {}}"#, 10).is_err());
        assert!(parse_dynamo(Some(503), b"", 10).is_err());
    }

    #[test]
    fn a_token_id_query_goes_to_query_in_each_apis_shape() {
        let callouts = Arc::new(MemoryCallouts::default());
        for (api, field, notice) in [(IndexerApi::Sgl, "model", true), (IndexerApi::Dynamo, "model_name", false)] {
            let client = IndexerClient::new(callouts.clone(), "c".into(), "h:1".into(), 50, 8, None, api);
            let mut pending = client.match_tokens("m", &[1, 2, 3]);
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(pending.as_mut().poll(&mut cx).is_pending(), "sent on the first poll");
            let sent = callouts.sent.lock().unwrap().last().cloned().unwrap().1;
            assert_eq!(sent.path, "/query");
            let body: Value = serde_json::from_slice(sent.body.as_deref().unwrap()).unwrap();
            assert_eq!((body[field].as_str(), body["token_ids"].clone()), (Some("m"), serde_json::json!([1, 2, 3])));
            assert_eq!(sent.headers.iter().any(|(k, _)| k == ROUTED_NOTICE_HEADER), notice);
        }
    }

    /// With a token configured the indexer refuses every POST without it: the match callouts
    /// carry it too, not only the routed notice. A body the indexer would refuse is not sent.
    #[test]
    fn every_callout_carries_the_token_and_a_body_over_four_mib_is_not_sent() {
        let callouts = Arc::new(MemoryCallouts::default());
        let token = Some(("x-indexer-token".to_string(), "s3cret".to_string()));
        let c = IndexerClient::new(callouts.clone(), "c".into(), "h:1".into(), 50, 8, token, IndexerApi::Sgl);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut at_limit = c.match_chat(&vec![b' '; MAX_INDEXER_BODY_BYTES]);
        assert!(at_limit.as_mut().poll(&mut cx).is_pending());
        let mut tokens = c.match_tokens("m", &[1, 2]);
        assert!(tokens.as_mut().poll(&mut cx).is_pending());
        let notice = c.routed_notice("1", "A");
        let sent = callouts.sent.lock().unwrap().clone();
        for request in sent.iter().map(|(_, r)| r).chain([&notice]) {
            assert!(request.headers.contains(&("x-indexer-token".into(), "s3cret".into())), "{}", request.path);
        }
        let over = now(c.match_chat(&vec![b' '; MAX_INDEXER_BODY_BYTES + 1]));
        assert!(over.unwrap_err().contains("larger"));
        assert_eq!(callouts.sent.lock().unwrap().len(), 2, "not sent");
    }

    #[test]
    fn an_answer_gives_exact_tokens_and_hits_ranked_with_cpu_held_tokens_at_half() {
        let body = br#"{"input_tokens": 900, "handle": "7", "data": {
            "A": {"matched_tokens": 800, "GPU": 0, "CPU_PINNED": 800},
            "B": {"matched_tokens": 600, "GPU": 600},
            "C": {"matched_tokens": 0}}}"#;
        let m = parse_answer(Some(200), body).unwrap();
        assert_eq!(m.input_tokens, 900);
        let order: Vec<(&str, u64)> = m.hits.iter().map(|h| (h.worker.as_str(), h.effective_tokens())).collect();
        assert_eq!(order, [("B", 600), ("A", 400)], "a GPU hit outranks a longer CPU-only one");
        assert_eq!(m.handle.as_deref(), Some("7"));
    }

    #[test]
    fn anything_but_a_good_answer_is_unavailable() {
        assert!(parse_answer(None, b"").is_err());
        assert!(parse_answer(Some(503), b"{}").is_err());
        assert!(parse_answer(Some(200), b"nope").is_err());
        assert!(parse_answer(Some(200), br#"{"data": {}}"#).is_err());
    }

    #[test]
    fn the_cap_makes_the_next_request_unavailable_at_once_and_slots_come_back() {
        let callouts = Arc::new(MemoryCallouts::default());
        let c = client(Arc::clone(&callouts), 1);
        let first = c.match_chat(b"{}");
        let second = now(c.match_chat(b"{}"));
        assert!(second.unwrap_err().contains("cap"));
        drop(first);
        let mut third = c.match_chat(b"{}");
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(third.as_mut().poll(&mut cx).is_pending(), "sent on the first poll, then waiting");
        let token = callouts.sent.lock().unwrap().last().map(|(t, _)| *t).unwrap();
        callouts.board().complete(
            token,
            CalloutResponse { status: Some(200), body: br#"{"input_tokens": 3, "data": {}}"#.to_vec() },
        );
        assert_eq!(now(third).unwrap().input_tokens, 3);
        assert_eq!(callouts.sent.lock().unwrap()[0].1.path, "/v1/prefix/match");
    }
}
