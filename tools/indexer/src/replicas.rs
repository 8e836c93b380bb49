//! The other indexers of `prefix_index.urls`. Every replica subscribes to every engine, so their
//! views agree from the engines' events; what the events cannot carry is agreed here:
//!
//! - **Claims** (see `claims`) are arbitrated by one replica, the first of the list this one can
//!   reach (itself when it comes first): a query that could wait on a claim or open one asks it
//!   before answering, so a burst sharing a new prefix waits on one claim whichever replica each
//!   query reaches. The arbiter that cannot be reached is passed over for [`DOWN_FOR`].
//! - **Handles**: every match a router will send a routed notice for is registered with every
//!   peer (batched, in the background), so the notice — which the router sends to every replica —
//!   adds the same speculative entries everywhere.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sgl_envoy_router::config::RouterConfig;
use sgl_envoy_router::registry::EngineAddress;
use tokio::sync::mpsc;

/// Ask a replica's arbiter about a claim.
pub const CLAIM_PATH: &str = "/v1/replica/claim";
/// Register matches' handles with a replica.
pub const HANDLES_PATH: &str = "/v1/replica/handles";
/// How long an arbiter that did not answer is passed over.
pub const DOWN_FOR: Duration = Duration::from_secs(1);
/// Registrations waiting to go out at most; past it they are dropped (and counted): a peer that
/// misses one only lacks that match's speculative entries until the engine's event confirms them.
pub const OUTBOX: usize = 4096;
/// Registrations sent in one request at most, and their keys at most: a peer reads 4 MiB of body,
/// and a key takes up to 21 bytes of JSON.
const BATCH: usize = 256;
const BATCH_KEYS: usize = 96 * 1024;
/// How long registrations gather before they go out.
const GATHER: Duration = Duration::from_millis(2);

/// A query asks the arbiter whether it waits on a claim, or opens one as `handle`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRequest {
    pub model: String,
    pub keys: Vec<u64>,
    pub best_tokens: u64,
    pub handle: Option<u64>,
    pub may_wait: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimAnswer {
    Go,
    /// Wait on `handle`'s claim, which shares the query's first `shared_blocks` blocks.
    Wait {
        handle: u64,
        shared_blocks: usize,
        wait_ms: u64,
    },
}

/// A match whose routed notice may come: what the notice's speculative entries are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub handle: u64,
    pub model: String,
    pub keys: Vec<u64>,
}

#[derive(Debug)]
pub struct Replicas {
    /// Base URLs in the configured order, and which one is this indexer.
    urls: Vec<String>,
    me: Option<usize>,
    down_until: Mutex<Vec<Option<Instant>>>,
    agent: ureq::Agent,
    token: Option<(String, String)>,
    outbox: Option<mpsc::Sender<Registration>>,
}

/// The position of the replica listening on `listen` in `urls`: its host and port, or only its
/// port when it listens on every address.
fn position(urls: &[String], listen: std::net::SocketAddr) -> Option<usize> {
    let parsed: Vec<Option<EngineAddress>> = urls.iter().map(|u| EngineAddress::parse(u).ok()).collect();
    let exact = parsed.iter().position(|a| {
        a.as_ref().is_some_and(|a| a.port() == listen.port() && a.host().parse().ok() == Some(listen.ip()))
    });
    exact.or_else(|| {
        let by_port: Vec<usize> = parsed
            .iter()
            .enumerate()
            .filter(|(_, a)| a.as_ref().is_some_and(|a| a.port() == listen.port()))
            .map(|(i, _)| i)
            .collect();
        (listen.ip().is_unspecified() && by_port.len() == 1).then(|| by_port[0])
    })
}

impl Replicas {
    /// The replica set of `config` as seen from the indexer listening on `listen`; `advertise`
    /// names this one when its listen address is not how the others reach it.
    pub fn new(config: &RouterConfig, listen: std::net::SocketAddr, advertise: Option<&str>) -> Self {
        let index = config.prefix_index.as_ref();
        let urls: Vec<String> = index
            .map(|p| p.endpoints().into_iter().map(|e| e.url.trim_end_matches('/').to_string()).collect())
            .unwrap_or_default();
        let me = match advertise {
            Some(url) => urls.iter().position(|u| u == url.trim_end_matches('/')),
            None => position(&urls, listen),
        };
        let timeout = Duration::from_millis(index.map_or(50, |p| p.timeout_ms).clamp(2, 1000) / 2);
        let agent: ureq::Agent =
            ureq::Agent::config_builder().timeout_global(Some(timeout)).http_status_as_error(false).build().into();
        let token = index.and_then(|p| p.token_header.clone().zip(p.token.clone()));
        Self { down_until: Mutex::new(vec![None; urls.len()]), urls, me, agent, token, outbox: None }
    }

    /// A lone indexer: no peers.
    pub fn none() -> Self {
        Self {
            urls: Vec::new(),
            me: None,
            down_until: Mutex::default(),
            agent: ureq::Agent::new_with_defaults(),
            token: None,
            outbox: None,
        }
    }

    /// This indexer's place in the list, when it is one of the configured replicas.
    pub fn me(&self) -> Option<usize> {
        self.me
    }

    /// Whether other replicas are configured and this indexer is one of them.
    pub fn has_peers(&self) -> bool {
        self.me.is_some() && self.urls.len() > 1
    }

    fn peers(&self) -> impl Iterator<Item = &String> {
        self.urls.iter().enumerate().filter(|(i, _)| Some(*i) != self.me).map(|(_, u)| u)
    }

    /// The replica that arbitrates claims now: `None` when it is this one.
    pub fn arbiter(&self) -> Option<usize> {
        let me = self.me?;
        let now = Instant::now();
        let down = self.down_until.lock().map(|d| d.clone()).unwrap_or_default();
        (0..me).find(|i| down.get(*i).copied().flatten().is_none_or(|until| until <= now))
    }

    fn mark_down(&self, i: usize) {
        if let Ok(mut down) = self.down_until.lock() {
            if let Some(slot) = down.get_mut(i) {
                *slot = Some(Instant::now() + DOWN_FOR);
            }
        }
    }

    fn post(&self, url: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), String> {
        let mut request = self.agent.post(url).header("content-type", "application/json");
        if let Some((name, value)) = &self.token {
            request = request.header(name.as_str(), value.as_str());
        }
        let mut response = request.send(&body[..]).map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = response.body_mut().with_config().limit(1 << 16).read_to_vec().map_err(|e| e.to_string())?;
        Ok((status, body))
    }

    /// Asks arbiter `i`; an arbiter that does not answer is passed over for a while.
    pub async fn claim(self: &Arc<Self>, i: usize, request: &ClaimRequest) -> Result<ClaimAnswer, String> {
        let url = format!("{}{CLAIM_PATH}", self.urls[i]);
        let body = serde_json::to_vec(request).map_err(|e| e.to_string())?;
        let this = Arc::clone(self);
        let answer = tokio::task::spawn_blocking(move || this.post(&url, body)).await.map_err(|e| e.to_string())?;
        let answer = match answer {
            Ok((200, body)) => serde_json::from_slice(&body).map_err(|e| e.to_string()),
            Ok((status, _)) => Err(format!("answered {status}")),
            Err(e) => Err(e),
        };
        if answer.is_err() {
            self.mark_down(i);
        }
        answer
    }

    /// Queues a registration for every peer; `false` when the outbox is full (or none runs).
    pub fn register(&self, registration: Registration) -> bool {
        self.outbox.as_ref().is_some_and(|o| o.try_send(registration).is_ok())
    }

    /// Starts the task that sends registrations to the peers.
    pub fn start(mut self) -> Arc<Self> {
        if !self.has_peers() {
            return Arc::new(self);
        }
        let (tx, mut rx) = mpsc::channel::<Registration>(OUTBOX);
        self.outbox = Some(tx);
        let this = Arc::new(self);
        let sender = Arc::clone(&this);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                tokio::time::sleep(GATHER).await;
                let mut keys = first.keys.len();
                let mut batch = vec![first];
                let mut next = None;
                while batch.len() < BATCH {
                    match rx.try_recv() {
                        Ok(r) if keys + r.keys.len() <= BATCH_KEYS => {
                            keys += r.keys.len();
                            batch.push(r);
                        }
                        Ok(r) => {
                            next = Some(r);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                // One batch at a time: a slow peer slows the registrations, not the queries.
                sender.send_batch(&batch).await;
                if let Some(r) = next {
                    sender.send_batch(&[r]).await;
                }
            }
        });
        this
    }

    /// Posts one batch of registrations to every peer, off the async workers.
    async fn send_batch(self: &Arc<Self>, batch: &[Registration]) {
        let Ok(body) = serde_json::to_vec(batch) else { return };
        let peers: Vec<String> = self.peers().map(|u| format!("{u}{HANDLES_PATH}")).collect();
        let this = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || {
            for url in peers {
                let _ = this.post(&url, body.clone());
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(urls: &[&str]) -> RouterConfig {
        sgl_envoy_router::config::parse_and_validate(&format!(
            r#"{{"workers": [{{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}}],
                "prefix_index": {{"urls": {}}},
                "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "random"}}}}}}}}]}}}}}}"#,
            serde_json::to_string(urls).unwrap()
        ))
        .unwrap()
    }

    /// A batch of registrations at its bound in keys still fits the body a peer reads.
    #[test]
    fn a_full_batch_of_registrations_fits_a_peers_body_limit() {
        let one = |n: usize| Registration { handle: u64::MAX, model: "m".repeat(64), keys: vec![u64::MAX; n] };
        let batch: Vec<Registration> = (0..BATCH).map(|_| one(BATCH_KEYS / BATCH)).collect();
        let bytes = serde_json::to_vec(&batch).unwrap().len();
        assert!(bytes < sgl_envoy_router::protocol::indexer::MAX_INDEXER_BODY_BYTES, "{bytes} bytes");
        let alone = serde_json::to_vec(&[one(crate::state::MAX_ROUTED_BLOCKS)]).unwrap().len();
        assert!(alone < sgl_envoy_router::protocol::indexer::MAX_INDEXER_BODY_BYTES, "the largest one alone: {alone}");
    }

    #[test]
    fn a_replica_finds_itself_in_the_list_and_the_first_reachable_one_arbitrates() {
        let c = config(&["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://10.0.0.3:9100"]);
        let first = Replicas::new(&c, "127.0.0.1:9100".parse().unwrap(), None);
        assert_eq!((first.me(), first.arbiter()), (Some(0), None), "the first arbitrates itself");
        let second = Replicas::new(&c, "127.0.0.1:9101".parse().unwrap(), None);
        assert_eq!((second.me(), second.arbiter()), (Some(1), Some(0)));
        second.mark_down(0);
        assert_eq!(second.arbiter(), None, "the first is passed over: the second arbitrates");
        let third = Replicas::new(&c, "0.0.0.0:9100".parse().unwrap(), Some("http://10.0.0.3:9100/"));
        assert_eq!(third.me(), Some(2));
        let ambiguous = Replicas::new(&c, "0.0.0.0:9100".parse().unwrap(), None);
        assert_eq!(ambiguous.me(), None, "two replicas on that port: --advertise says which");
        let by_port = Replicas::new(&c, "0.0.0.0:9101".parse().unwrap(), None);
        assert_eq!(by_port.me(), Some(1));
        let stranger = Replicas::new(&c, "127.0.0.1:7000".parse().unwrap(), None);
        assert!(!stranger.has_peers(), "an indexer not in the list keeps to itself");
    }
}
