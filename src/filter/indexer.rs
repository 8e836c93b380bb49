//! The indexer's client (spec §7): one callout per request — `POST /v1/prefix/match` with the
//! client's chat body (ours tokenizes it), or `POST /query` with a request's own token ids (ours,
//! or Dynamo's standalone KV indexer with `api: dynamo`) — answered with every engine's matched
//! prefix and, for a chat body, the exact input length. Any failure (error, non-2xx, timeout,
//! garbage, the concurrency cap) is *unavailable*: the caller falls back to the byte estimate and
//! to load, counted apart from a confirmed miss. The client builds the callouts and reads their
//! answers; the request's life dispatches them and waits.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::config::{IndexerApi, RouterConfig};
use crate::host::CalloutRequest;
use crate::protocol::indexer::{
    parse_answer, parse_dynamo, DynamoQuery, IndexerAnswer, Query, RoutedNotice, MATCH_PATH, MAX_INDEXER_BODY_BYTES,
    QUERY_PATH, ROUTED_NOTICE_HEADER, ROUTED_PATH,
};
use crate::registry::EngineAddress;
use crate::wiring::counters::{Counter, IndexerEvent};

/// One indexer replica: its Envoy cluster and the authority its callouts name.
#[derive(Debug)]
struct Replica {
    cluster: Arc<str>,
    authority: String,
}

/// The replicas in the order the filter tries them, and the one this VM asks first: the last
/// that answered, so a dead replica costs one failover per VM, not one per request.
#[derive(Debug)]
struct Replicas {
    all: Vec<Replica>,
    preferred: AtomicUsize,
}

impl Replicas {
    fn get(&self, i: usize) -> &Replica {
        &self.all[i % self.all.len()]
    }
}

/// Where the indexers are, and the per-VM cap on callouts in flight.
#[derive(Debug)]
pub struct IndexerClient {
    api: IndexerApi,
    replicas: Arc<Replicas>,
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

/// One match callout: the request to send to each replica in turn, and how to read its answer.
/// It holds one of the VM's in-flight slots until it is dropped, however the request ends.
#[derive(Debug)]
pub struct IndexerCall {
    path: &'static str,
    headers: Vec<(String, String)>,
    body: Arc<Vec<u8>>,
    shape: Shape,
    replicas: Arc<Replicas>,
    /// The replica asked first, and how many were asked so far (the current is the last).
    first: usize,
    asked: usize,
    timeout_ms: u64,
    /// When the whole call's budget ends, once it was first sent.
    deadline_us: Option<u64>,
    counters: Vec<Counter>,
    in_flight: Arc<AtomicU64>,
}

impl Drop for IndexerCall {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Below this much of its budget left, a call does not try another replica.
const MIN_ATTEMPT_MS: u64 = 1;

impl IndexerCall {
    fn current(&self) -> usize {
        self.first + self.asked.saturating_sub(1)
    }

    fn request(&self, timeout_ms: u64) -> CalloutRequest {
        let replica = self.replicas.get(self.current());
        CalloutRequest {
            cluster: replica.cluster.to_string(),
            method: "POST".to_string(),
            path: self.path.to_string(),
            authority: replica.authority.clone(),
            headers: self.headers.clone(),
            body: Some(Arc::clone(&self.body)),
            timeout_ms,
        }
    }

    /// The callout to dispatch first (once); `now_us` starts the call's `timeout_ms` budget,
    /// which every replica asked shares.
    pub fn take_request(&mut self, now_us: u64) -> Option<CalloutRequest> {
        if self.asked > 0 {
            return None;
        }
        self.asked = 1;
        self.deadline_us = Some(now_us.saturating_add(self.timeout_ms.saturating_mul(1000)));
        Some(self.request(self.timeout_ms))
    }

    /// The replica asked last could not answer (not sent, failed, timed out, garbage): the same
    /// call to the next replica with what is left of the budget, or `None` when every replica was
    /// asked or the budget is spent. The VM asks the next replica first from now on.
    pub fn fail_over(&mut self, now_us: u64) -> Option<CalloutRequest> {
        let failed = self.current();
        let left_ms = self.deadline_us?.saturating_sub(now_us) / 1000;
        if self.asked >= self.replicas.all.len() || left_ms < MIN_ATTEMPT_MS {
            return None;
        }
        self.asked += 1;
        let next = self.current() % self.replicas.all.len();
        // Only the VM's current choice moves on: a concurrent call that already moved it wins.
        let _ = self.replicas.preferred.compare_exchange(
            failed % self.replicas.all.len(),
            next,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        self.counters.push(Counter::Indexer(Arc::clone(&self.replicas.get(failed).cluster), IndexerEvent::FailedOver));
        Some(self.request(left_ms))
    }

    /// Reads the answer of the replica asked last (`status` `None`: timeout or connection
    /// failure).
    pub fn answer(&mut self, status: Option<u16>, body: &[u8]) -> IndexerAnswer {
        let answer = match self.shape {
            Shape::Sgl { known_input } => parse_answer(status, body, known_input),
            Shape::Dynamo { input } => parse_dynamo(status, body, input),
        };
        if answer.is_ok() {
            let cluster = Arc::clone(&self.replicas.get(self.current()).cluster);
            self.counters.push(Counter::Indexer(cluster, IndexerEvent::Answered));
        }
        answer
    }

    /// What the call counted so far: answers, failures and failovers per replica.
    pub fn take_counters(&mut self) -> Vec<Counter> {
        std::mem::take(&mut self.counters)
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
    /// `replicas`: each indexer's (cluster, authority), in the order they are tried.
    pub fn new(
        replicas: Vec<(String, String)>,
        timeout_ms: u64,
        max_in_flight: u64,
        token: Option<(String, String)>,
        api: IndexerApi,
    ) -> Self {
        let all =
            replicas.into_iter().map(|(cluster, authority)| Replica { cluster: cluster.into(), authority }).collect();
        Self {
            api,
            replicas: Arc::new(Replicas { all, preferred: AtomicUsize::new(0) }),
            timeout_ms,
            max_in_flight,
            in_flight: Arc::default(),
            token,
        }
    }

    /// The client when `prefix_index` is configured (its URLs were validated).
    pub fn from_config(config: &RouterConfig) -> Option<Self> {
        let index = config.prefix_index.as_ref()?;
        let replicas: Vec<(String, String)> = index
            .endpoints()
            .into_iter()
            .filter_map(|e| Some((e.cluster, EngineAddress::parse(&e.url).ok()?.host_port())))
            .collect();
        if replicas.is_empty() {
            return None;
        }
        let token = index.token_header.clone().zip(index.token.clone());
        Some(Self::new(replicas, index.timeout_ms, index.max_concurrent, token, index.api))
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

    fn call(&self, path: &'static str, will_notify: bool, body: Vec<u8>, shape: Shape) -> Result<IndexerCall, String> {
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
        Ok(IndexerCall {
            path,
            headers,
            body: Arc::new(body),
            shape,
            first: self.replicas.preferred.load(Ordering::Relaxed),
            replicas: Arc::clone(&self.replicas),
            asked: 0,
            timeout_ms: self.timeout_ms,
            deadline_us: None,
            counters: Vec::new(),
            in_flight: Arc::clone(&self.in_flight),
        })
    }

    /// The fire-and-forget notices that `worker` got the request behind `handle`: one to every
    /// replica, so speculative entries and claims agree wherever the next query lands.
    pub fn routed_notices(&self, handle: &str, worker: &str, dp_rank: Option<u32>) -> Vec<CalloutRequest> {
        let notice = RoutedNotice { handle: handle.into(), worker: worker.into(), dp_rank };
        let Some(body) = serde_json::to_vec(&notice).ok().map(Arc::new) else { return Vec::new() };
        self.replicas
            .all
            .iter()
            .map(|replica| CalloutRequest {
                cluster: replica.cluster.to_string(),
                method: "POST".to_string(),
                path: ROUTED_PATH.to_string(),
                authority: replica.authority.clone(),
                headers: self.headers(),
                body: Some(Arc::clone(&body)),
                timeout_ms: self.timeout_ms,
            })
            .collect()
    }

    /// The replica a callout to `cluster` went to, for its counters.
    pub fn replica_of(&self, cluster: &str) -> Option<Arc<str>> {
        self.replicas.all.iter().find(|r| &*r.cluster == cluster).map(|r| Arc::clone(&r.cluster))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;
    use serde_json::Value;

    fn one(cluster: &str, authority: &str) -> Vec<(String, String)> {
        vec![(cluster.to_string(), authority.to_string())]
    }

    fn client(cap: u64) -> IndexerClient {
        IndexerClient::new(one("sgl_indexer", "127.0.0.1:9100"), 50, cap, None, IndexerApi::Sgl)
    }

    fn two() -> IndexerClient {
        let replicas = vec![("i0".to_string(), "h:1".to_string()), ("i1".to_string(), "h:2".to_string())];
        IndexerClient::new(replicas, 50, 8, None, IndexerApi::Sgl)
    }

    #[test]
    fn a_token_id_query_goes_to_query_in_each_apis_shape() {
        for (api, field, notice) in [(IndexerApi::Sgl, "model", true), (IndexerApi::Dynamo, "model_name", false)] {
            let client = IndexerClient::new(one("c", "h:1"), 50, 8, None, api);
            let sent = client.match_tokens("m", &[1, 2, 3]).unwrap().take_request(0).unwrap();
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
        let c = IndexerClient::new(one("c", "h:1"), 50, 8, token, IndexerApi::Sgl);
        let at_limit = c.match_chat(&vec![b' '; MAX_INDEXER_BODY_BYTES]).unwrap().take_request(0).unwrap();
        let tokens = c.match_tokens("m", &[1, 2]).unwrap().take_request(0).unwrap();
        let notices = c.routed_notices("1", "A", None);
        for request in [&at_limit, &tokens, &notices[0]] {
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
        assert_eq!(third.take_request(0).unwrap().path, "/v1/prefix/match");
        assert!(third.take_request(0).is_none(), "dispatched once");
        let answer = third.answer(Some(200), br#"{"input_tokens": 3, "data": {}}"#);
        assert_eq!(answer.as_ref().unwrap().input_tokens, 3);
        assert_eq!(verdict(&answer), "miss");
        assert_eq!(verdict(&third.answer(None, b"")), "unavailable");
    }

    #[test]
    fn a_routed_notice_names_the_handle_and_the_engine_and_goes_to_every_replica() {
        let notices = two().routed_notices("7", "A", None);
        let clusters: Vec<&str> = notices.iter().map(|n| n.cluster.as_str()).collect();
        assert_eq!(clusters, ["i0", "i1"]);
        for notice in &notices {
            assert_eq!(notice.path, "/v1/prefix/routed");
            let body: RoutedNotice = serde_json::from_slice(notice.body.as_deref().unwrap()).unwrap();
            assert_eq!((&*body.handle, &*body.worker), ("7", "A"));
        }
        assert_eq!(client(1).routed_notices("7", "A", None).len(), 1);
    }

    /// A replica that fails hands the call to the next with what is left of the one budget, and
    /// the VM asks that one first from then on; with every replica asked, or the budget spent,
    /// the answer is unavailable.
    #[test]
    fn a_failed_replica_hands_the_call_to_the_next_within_the_budget() {
        let c = two();
        let mut call = c.match_chat(b"{}").unwrap();
        let first = call.take_request(1_000_000).unwrap();
        assert_eq!((first.cluster.as_str(), first.authority.as_str(), first.timeout_ms), ("i0", "h:1", 50));
        // Refused after 12 ms: the next replica gets the 38 left.
        let second = call.fail_over(1_012_000).unwrap();
        assert_eq!((second.cluster.as_str(), second.authority.as_str(), second.timeout_ms), ("i1", "h:2", 38));
        assert_eq!(second.body, first.body, "the same question");
        assert!(call.answer(Some(200), br#"{"input_tokens": 3, "data": {}}"#).is_ok());
        let counted: Vec<String> = call.take_counters().iter().map(Counter::name).collect();
        assert_eq!(
            counted,
            ["sgl_router_indexer_failovers_total.indexer.i0", "sgl_router_indexer_queries_total.indexer.i1"]
        );
        drop(call);
        let mut next = c.match_chat(b"{}").unwrap();
        assert_eq!(next.take_request(2_000_000).unwrap().cluster, "i1", "the VM now asks i1 first");
        assert!(next.fail_over(2_010_000).is_some(), "and fails back over to i0");
        assert!(next.fail_over(2_020_000).is_none(), "every replica was asked");
        let mut late = c.match_chat(b"{}").unwrap();
        late.take_request(3_000_000).unwrap();
        assert!(late.fail_over(3_049_500).is_none(), "under a millisecond left: not worth a try");
    }
}
