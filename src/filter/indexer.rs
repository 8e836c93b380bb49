//! The indexer's client (spec §7): one callout per request — `POST /v1/prefix/match` with the
//! client's chat body (ours tokenizes it), or `POST /query` with a request's own token ids (ours,
//! or Dynamo's standalone KV indexer with `api: dynamo`) — answered with every engine's matched
//! prefix and, for a chat body, the exact input length. Any failure (error, non-2xx, timeout,
//! garbage, the concurrency cap) is *unavailable*: the caller falls back to the byte estimate and
//! to load, counted apart from a confirmed miss. The client builds the callouts and reads their
//! answers; the request's life dispatches them and waits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::config::{IndexerApi, RouterConfig};
use crate::host::CalloutRequest;
use crate::protocol::indexer::{
    parse_answer, parse_dynamo, DynamoQuery, IndexerAnswer, Query, RoutedNotice, MATCH_PATH, MAX_INDEXER_BODY_BYTES,
    QUERY_PATH, ROUTED_NOTICE_HEADER, ROUTED_PATH,
};
use crate::registry::EngineAddress;

/// Where the indexer is, and the per-VM cap on callouts in flight.
#[derive(Debug)]
pub struct IndexerClient {
    api: IndexerApi,
    cluster: String,
    authority: String,
    timeout_ms: u64,
    max_in_flight: u64,
    in_flight: Arc<AtomicU64>,
    token: Option<(String, String)>,
}

/// How to read the answer of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Ours; the input length when the caller counted it.
    Sgl {
        known_input: Option<u64>,
    },
    Dynamo {
        input: u64,
    },
}

/// One match callout: the request to send, and how to read its answer. It holds one of the VM's
/// in-flight slots until it is dropped, however the request ends.
#[derive(Debug)]
pub struct IndexerCall {
    request: Option<CalloutRequest>,
    shape: Shape,
    in_flight: Arc<AtomicU64>,
}

impl Drop for IndexerCall {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl IndexerCall {
    /// The callout to dispatch (once).
    pub fn take_request(&mut self) -> Option<CalloutRequest> {
        self.request.take()
    }

    /// Reads the indexer's answer (`status` `None`: timeout or connection failure).
    pub fn answer(&self, status: Option<u16>, body: &[u8]) -> IndexerAnswer {
        match self.shape {
            Shape::Sgl { known_input } => parse_answer(status, body, known_input),
            Shape::Dynamo { input } => parse_dynamo(status, body, input),
        }
    }
}

/// The verdict of an answer for stats: `hit`, `miss` or `unavailable` (spec §7).
pub fn verdict(answer: &IndexerAnswer) -> &'static str {
    match answer {
        Ok(m) if m.hits.is_empty() => "miss",
        Ok(_) => "hit",
        Err(_) => "unavailable",
    }
}

impl IndexerClient {
    pub fn new(
        cluster: String,
        authority: String,
        timeout_ms: u64,
        max_in_flight: u64,
        token: Option<(String, String)>,
        api: IndexerApi,
    ) -> Self {
        Self { api, cluster, authority, timeout_ms, max_in_flight, in_flight: Arc::default(), token }
    }

    /// The client when `prefix_index` is configured (its URL was validated).
    pub fn from_config(config: &RouterConfig) -> Option<Self> {
        let index = config.prefix_index.as_ref()?;
        let authority = EngineAddress::parse(&index.url).ok()?.host_port();
        let token = index.token_header.clone().zip(index.token.clone());
        Some(Self::new(index.cluster.clone(), authority, index.timeout_ms, index.max_concurrent, token, index.api))
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

    /// The match call for a chat body, or why it is not made (the answer is then unavailable).
    pub fn match_chat(&self, body: &[u8]) -> Result<IndexerCall, String> {
        self.call(MATCH_PATH, true, body.to_vec(), Shape::Sgl { known_input: None })
    }

    /// The match call for a request's exact token ids, in the configured API's shape.
    pub fn match_tokens(&self, model: &str, token_ids: &[u32]) -> Result<IndexerCall, String> {
        let input = token_ids.len() as u64;
        let encoded = match self.api {
            IndexerApi::Sgl => serde_json::to_vec(&Query {
                model: model.into(),
                token_ids: token_ids.into(),
                lora_name: None,
                cache_salt: None,
            }),
            IndexerApi::Dynamo => serde_json::to_vec(&DynamoQuery { model_name: model, token_ids }),
        };
        let body = encoded.map_err(|e| format!("the query was not encoded: {e}"))?;
        match self.api {
            IndexerApi::Sgl => self.call(QUERY_PATH, true, body, Shape::Sgl { known_input: Some(input) }),
            IndexerApi::Dynamo => self.call(QUERY_PATH, false, body, Shape::Dynamo { input }),
        }
    }

    fn call(&self, path: &str, will_notify: bool, body: Vec<u8>, shape: Shape) -> Result<IndexerCall, String> {
        if body.len() > MAX_INDEXER_BODY_BYTES {
            // The indexer would answer 413: route on the estimate without asking.
            return Err("the request is larger than the indexer reads".to_string());
        }
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err("the indexer's concurrency cap is reached".to_string());
        }
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
            body: Some(Arc::new(body)),
            timeout_ms: self.timeout_ms,
        };
        Ok(IndexerCall { request: Some(request), shape, in_flight: Arc::clone(&self.in_flight) })
    }

    /// The fire-and-forget notice that `worker` got the request behind `handle`.
    pub fn routed_notice(&self, handle: &str, worker: &str) -> CalloutRequest {
        let notice = RoutedNotice { handle: handle.into(), worker: worker.into() };
        CalloutRequest {
            cluster: self.cluster.clone(),
            method: "POST".to_string(),
            path: ROUTED_PATH.to_string(),
            authority: self.authority.clone(),
            headers: self.headers(),
            body: serde_json::to_vec(&notice).ok().map(Arc::new),
            timeout_ms: self.timeout_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;
    use serde_json::Value;

    fn client(cap: u64) -> IndexerClient {
        IndexerClient::new("sgl_indexer".into(), "127.0.0.1:9100".into(), 50, cap, None, IndexerApi::Sgl)
    }

    #[test]
    fn a_token_id_query_goes_to_query_in_each_apis_shape() {
        for (api, field, notice) in [(IndexerApi::Sgl, "model", true), (IndexerApi::Dynamo, "model_name", false)] {
            let client = IndexerClient::new("c".into(), "h:1".into(), 50, 8, None, api);
            let sent = client.match_tokens("m", &[1, 2, 3]).unwrap().take_request().unwrap();
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
        let token = Some(("x-indexer-token".to_string(), "s3cret".to_string()));
        let c = IndexerClient::new("c".into(), "h:1".into(), 50, 8, token, IndexerApi::Sgl);
        let at_limit = c.match_chat(&vec![b' '; MAX_INDEXER_BODY_BYTES]).unwrap().take_request().unwrap();
        let tokens = c.match_tokens("m", &[1, 2]).unwrap().take_request().unwrap();
        let notice = c.routed_notice("1", "A");
        for request in [&at_limit, &tokens, &notice] {
            assert!(request.headers.contains(&("x-indexer-token".into(), "s3cret".into())), "{}", request.path);
        }
        let over = c.match_chat(&vec![b' '; MAX_INDEXER_BODY_BYTES + 1]);
        assert!(over.unwrap_err().contains("larger"));
    }

    #[test]
    fn the_cap_makes_the_next_request_unavailable_at_once_and_slots_come_back() {
        let c = client(1);
        let first = c.match_chat(b"{}").unwrap();
        assert!(c.match_chat(b"{}").unwrap_err().contains("cap"));
        drop(first);
        let mut third = c.match_chat(b"{}").unwrap();
        assert_eq!(third.take_request().unwrap().path, "/v1/prefix/match");
        assert!(third.take_request().is_none(), "dispatched once");
        let answer = third.answer(Some(200), br#"{"input_tokens": 3, "data": {}}"#);
        assert_eq!(answer.as_ref().unwrap().input_tokens, 3);
        assert_eq!(verdict(&answer), "miss");
        assert_eq!(verdict(&third.answer(None, b"")), "unavailable");
    }

    #[test]
    fn a_routed_notice_names_the_handle_and_the_engine() {
        let notice = client(1).routed_notice("7", "A");
        assert_eq!(notice.path, "/v1/prefix/routed");
        let body: RoutedNotice = serde_json::from_slice(notice.body.as_deref().unwrap()).unwrap();
        assert_eq!((&*body.handle, &*body.worker), ("7", "A"));
    }
}
