//! The indexer's shared state: one index per model (tokens of different models never meet), which
//! model each worker serves, the counters `/metrics` shows, and the recent match handles a router's
//! "routed" notice refers to.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sgl_envoy_router::config::{CacheSourceKind, RouterConfig};

use crate::claims::{Claims, Turn};
use crate::events::EventBatch;
use crate::index::{block_keys, Counters, EngineMatch, Index};
use crate::tokenize::{ModelTokenizer, TokenizeError};

/// Engine pages the indexer keeps in all models together (about 190 bytes each: 8 Mi pages ≈ 1.5 GiB).
pub const DEFAULT_MAX_PAGES: usize = 8 << 20;
/// How long a routed notice's blocks count for their engine before its own event confirms them.
pub const SPECULATIVE_TTL_MS: u64 = 2_000;
/// Match handles kept for routed notices.
const HANDLES: usize = 4096;
/// Blocks one routed notice may add.
pub const MAX_ROUTED_BLOCKS: usize = 1 << 14;

/// How long a claim may hold the queries sharing its prefix when its notice is late: half the
/// filter's `timeout_ms`, so a held query still answers before the filter gives up on it.
fn claim_window_ms(config: &RouterConfig) -> u64 {
    config.prefix_index.as_ref().map_or(25, |p| p.timeout_ms / 2)
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[derive(Debug, Default)]
pub struct Stats {
    pub subscriptions: AtomicU64,
    pub subscribed: AtomicU64,
    pub batches: AtomicU64,
    pub malformed: AtomicU64,
    pub gaps: AtomicU64,
    pub replayed: AtomicU64,
    pub unrepaired: AtomicU64,
    pub restarts: AtomicU64,
    pub queries: AtomicU64,
    pub bad_queries: AtomicU64,
    pub hits_confirmed: AtomicU64,
    pub hits_speculative: AtomicU64,
    pub misses: AtomicU64,
    pub routed_notices: AtomicU64,
    pub routed_refused: AtomicU64,
    pub claim_waits: AtomicU64,
    pub claim_waits_unrouted: AtomicU64,
    /// Engine connections cut for an oversized frame or message (shared with every relay).
    pub oversized: Arc<AtomicU64>,
    pub repair_overflows: AtomicU64,
    pub reconnects: AtomicU64,
}

macro_rules! counter {
    ($($name:ident => $field:ident),* $(,)?) => {
        impl Stats {
            $(pub fn $name(&self, n: u64) {
                self.$field.fetch_add(n, Ordering::Relaxed);
            })*
        }
    };
}

counter!(subscribed => subscribed, malformed => malformed, gaps => gaps, replayed => replayed,
         unrepaired => unrepaired, restarts => restarts, repair_overflows => repair_overflows,
         reconnects => reconnects);

/// A recent match a routed notice can name: (handle, model, block keys).
type Handle = (u64, String, Arc<[u64]>);

pub struct App {
    pub block_tokens: u32,
    indexes: Mutex<HashMap<String, Index>>,
    worker_model: HashMap<String, String>,
    handles: Mutex<VecDeque<Handle>>,
    claims: Claims,
    tokenizers: HashMap<String, ModelTokenizer>,
    next_handle: AtomicU64,
    pub stats: Stats,
    pub config: RouterConfig,
}

impl App {
    /// Loads every configured tokenizer and chat template; a model whose files do not load is a
    /// startup error, never a request-time one.
    pub fn load(config: RouterConfig, max_pages: usize) -> Result<Self, TokenizeError> {
        let mut tokenizers = HashMap::new();
        for (name, model) in &config.models {
            let Some(tokenizer) = &model.tokenizer else { continue };
            let tokenizer = std::path::Path::new(tokenizer);
            let template = match &model.chat_template {
                Some(t) => std::path::PathBuf::from(t),
                None => tokenizer.with_file_name("tokenizer_config.json"),
            };
            let loaded = ModelTokenizer::load(tokenizer, &template)
                .map_err(|e| TokenizeError::Load(format!("models.{name}: {e}")))?;
            tokenizers.insert(name.clone(), loaded);
        }
        let mut app = Self::new(config, max_pages);
        app.tokenizers = tokenizers;
        Ok(app)
    }

    /// The chat body as the engine will tokenize it.
    pub fn tokenize_chat(&self, model: &str, chat: &serde_json::Value) -> Result<Vec<u32>, TokenizeError> {
        if !self.serves(model) {
            return Err(TokenizeError::UnknownModel(model.to_string()));
        }
        self.tokenizers.get(model).ok_or_else(|| TokenizeError::NoTokenizer(model.to_string()))?.tokenize_chat(chat)
    }

    pub fn new(config: RouterConfig, max_pages: usize) -> Self {
        let block_tokens = config.prefix_index.as_ref().map_or(16, |p| p.block_tokens).clamp(1, 1 << 16) as u32;
        let per_model = max_pages / config.models.len().max(1);
        let indexes = config.models.keys().map(|m| (m.clone(), Index::new(block_tokens, per_model))).collect();
        let worker_model = config.workers.iter().map(|w| (w.id.clone(), w.model.clone())).collect();
        // A claim matters only to policies reading this index, and only by a gain they count as a hit.
        let min_gain = config
            .models
            .iter()
            .filter_map(|(name, m)| {
                let remote = m.cache_aware_policies().filter(|c| c.source == CacheSourceKind::Remote);
                remote.map(|c| c.min_hit_tokens.max(u64::from(block_tokens))).min().map(|g| (name.clone(), g))
            })
            .collect();
        Self {
            claims: Claims::new(claim_window_ms(&config), block_tokens, min_gain),
            block_tokens,
            indexes: Mutex::new(indexes),
            worker_model,
            handles: Mutex::new(VecDeque::new()),
            tokenizers: HashMap::new(),
            next_handle: AtomicU64::new(now_ms() << 16),
            stats: Stats::default(),
            config,
        }
    }

    fn with_index<R>(&self, model: &str, f: impl FnOnce(&mut Index) -> R) -> Option<R> {
        let mut indexes = self.indexes.lock().ok()?;
        indexes.get_mut(model).map(f)
    }

    /// Applies one rank's batch to its worker's model.
    pub fn apply(&self, worker: &str, rank: u32, batch: &EventBatch) {
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let Some(model) = self.worker_model.get(worker) else { return };
        self.with_index(model, |index| {
            for event in &batch.events {
                index.apply(worker, rank, event);
            }
        });
    }

    pub fn clear(&self, worker: &str, rank: Option<u32>) {
        if let Some(model) = self.worker_model.get(worker) {
            self.with_index(model, |index| index.clear(worker, rank));
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.config.models.contains_key(model)
    }

    pub fn worker_model(&self, worker: &str) -> Option<&str> {
        self.worker_model.get(worker).map(String::as_str)
    }

    fn matches(&self, model: &str, keys: &[u64]) -> Option<Vec<(String, EngineMatch)>> {
        let now = now_ms();
        self.with_index(model, |index| {
            index.expire_speculative(now);
            index.match_keys(keys, now)
        })
    }

    /// Matches `tokens` in `model`'s namespace; returns every engine's match and a handle a routed
    /// notice can name. A caller that `will_notify` claims what its match left uncovered (see
    /// `claims`); a query that an open claim would serve better waits for that claim's notice.
    pub async fn match_tokens(
        &self,
        model: &str,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
        will_notify: bool,
    ) -> Option<(Vec<(String, EngineMatch)>, u64)> {
        self.stats.queries.fetch_add(1, Ordering::Relaxed);
        let keys: Arc<[u64]> = block_keys(tokens, self.block_tokens, lora, salt).into();
        let mut matches = self.matches(model, &keys)?;
        let best = |m: &[(String, EngineMatch)]| m.first().map_or(0, |(_, m)| m.matched_tokens);
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let claim_as = will_notify.then_some(handle);
        if let Turn::Wait { mut routed, until_ms } =
            self.claims.turn(model, &keys, best(&matches), claim_as, true, now_ms())
        {
            self.stats.claim_waits.fetch_add(1, Ordering::Relaxed);
            let window = Duration::from_millis(until_ms.saturating_sub(now_ms()));
            if !matches!(tokio::time::timeout(window, routed.wait_for(|r| *r)).await, Ok(Ok(_))) {
                self.stats.claim_waits_unrouted.fetch_add(1, Ordering::Relaxed);
            }
            matches = self.matches(model, &keys)?;
            self.claims.turn(model, &keys, best(&matches), claim_as, false, now_ms());
        }
        match matches.first() {
            None => self.stats.misses.fetch_add(1, Ordering::Relaxed),
            Some((_, m)) if m.confirmed_tokens >= m.matched_tokens => {
                self.stats.hits_confirmed.fetch_add(1, Ordering::Relaxed)
            }
            Some(_) => self.stats.hits_speculative.fetch_add(1, Ordering::Relaxed),
        };
        if let Ok(mut handles) = self.handles.lock() {
            handles.push_back((handle, model.to_string(), keys));
            while handles.len() > HANDLES {
                handles.pop_front();
            }
        }
        Some((matches, handle))
    }

    /// A router sent the request behind `handle` to `worker`. `false` when the handle is unknown
    /// (expired) or the worker does not serve that model.
    pub fn routed(&self, handle: u64, worker: &str) -> bool {
        let found = self.handles.lock().ok().and_then(|h| {
            h.iter().find(|(id, _, _)| *id == handle).map(|(_, model, keys)| (model.clone(), Arc::clone(keys)))
        });
        let Some((model, keys)) = found else { return false };
        if self.worker_model(worker) != Some(model.as_str()) {
            return false;
        }
        let keys = &keys[..keys.len().min(MAX_ROUTED_BLOCKS)];
        let until = now_ms() + SPECULATIVE_TTL_MS;
        self.stats.routed_notices.fetch_add(1, Ordering::Relaxed);
        let applied = self.with_index(&model, |index| index.add_speculative(worker, keys, until)).is_some();
        self.claims.routed(handle);
        applied
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        let s = &self.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut line = |name: &str, help: &str, kind: &str, value: u64| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
        };
        let gauges: [(&str, &str, u64); 3] = [
            ("sgl_indexer_subscriptions", "engine ranks configured to publish events", load(&s.subscriptions)),
            ("sgl_indexer_subscribed", "engine ranks subscribed at least once", load(&s.subscribed)),
            ("sgl_indexer_claims_open", "matches claimed and not yet routed", self.claims.open(now_ms()) as u64),
        ];
        let counters: [(&str, &str, &AtomicU64); 18] = [
            ("sgl_indexer_batches_total", "event batches applied", &s.batches),
            ("sgl_indexer_malformed_total", "event frames dropped as malformed", &s.malformed),
            ("sgl_indexer_gaps_total", "sequence gaps seen", &s.gaps),
            ("sgl_indexer_replayed_batches_total", "batches recovered from replay", &s.replayed),
            ("sgl_indexer_unrepaired_gaps_total", "gaps that dropped a rank's entries", &s.unrepaired),
            ("sgl_indexer_publisher_restarts_total", "publishers seen restarting", &s.restarts),
            ("sgl_indexer_queries_total", "match queries", &s.queries),
            ("sgl_indexer_bad_queries_total", "queries refused as malformed", &s.bad_queries),
            ("sgl_indexer_hits_confirmed_total", "queries whose best match the engine confirmed", &s.hits_confirmed),
            ("sgl_indexer_hits_speculative_total", "queries whose best match was only routed", &s.hits_speculative),
            ("sgl_indexer_misses_total", "queries no engine matched", &s.misses),
            ("sgl_indexer_routed_notices_total", "routed notices applied", &s.routed_notices),
            ("sgl_indexer_routed_refused_total", "routed notices refused", &s.routed_refused),
            (
                "sgl_indexer_claim_waits_total",
                "queries that waited for a concurrent match sharing their prefix to be routed",
                &s.claim_waits,
            ),
            (
                "sgl_indexer_claim_waits_unrouted_total",
                "claim waits that ended without the routed notice",
                &s.claim_waits_unrouted,
            ),
            (
                "sgl_indexer_reconnects_total",
                "engine connections made anew (the rank starts over from replay)",
                &s.reconnects,
            ),
            ("sgl_indexer_oversized_total", "engine connections cut for an oversized frame or message", &s.oversized),
            (
                "sgl_indexer_repair_overflows_total",
                "repairs given up because the live batches held behind them reached their bound",
                &s.repair_overflows,
            ),
        ];
        for (name, help, value) in gauges {
            line(name, help, "gauge", value);
        }
        for (name, help, counter) in counters {
            line(name, help, "counter", load(counter));
        }
        let mut index_totals = Counters::default();
        let mut per_engine = Vec::new();
        if let Ok(indexes) = self.indexes.lock() {
            for index in indexes.values() {
                index_totals.add(&index.counters);
                per_engine.extend(index.pages_per_engine());
            }
        }
        let index_counters = [
            ("sgl_indexer_events_total", "engine events applied", index_totals.events),
            (
                "sgl_indexer_evicted_pages_total",
                "pages evicted to stay within the memory budget",
                index_totals.evicted_pages,
            ),
            (
                "sgl_indexer_orphan_pages_total",
                "pages whose parent was never seen (they key nothing)",
                index_totals.orphan_pages,
            ),
            ("sgl_indexer_speculative_added_total", "blocks added by routed notices", index_totals.speculative_added),
        ];
        for (name, help, value) in index_counters {
            line(name, help, "counter", value);
        }
        out.push_str("# HELP sgl_indexer_blocks engine pages held, per engine\n# TYPE sgl_indexer_blocks gauge\n");
        for (engine, pages) in per_engine {
            out.push_str(&format!("sgl_indexer_blocks{{worker=\"{engine}\"}} {pages}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{KvEvent, Medium, StoredBlocks};

    pub(crate) fn app() -> App {
        let config = sgl_envoy_router::config::parse_and_validate(
            r#"{"workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m", "kv_events": "tcp://127.0.0.1:5557"}],
                "prefix_index": {"url": "http://127.0.0.1:9", "block_tokens": 4},
                "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}}"#,
        )
        .unwrap();
        App::new(config, 1000)
    }

    /// The index's own counters were kept "for /metrics" and never reached it.
    #[test]
    fn the_index_counters_are_exported() {
        let app = app();
        let stored = |hash, parent| {
            KvEvent::Stored(StoredBlocks {
                block_hashes: vec![hash],
                parent,
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora: None,
                medium: Medium::Gpu,
                cache_salt: None,
            })
        };
        let batch = EventBatch { ts: 0.0, events: vec![stored(1, None), stored(2, Some(99))], dp_rank: None };
        app.apply("A", 0, &batch);
        let metrics = app.metrics();
        for line in
            ["sgl_indexer_events_total 2", "sgl_indexer_orphan_pages_total 1", "sgl_indexer_evicted_pages_total 0"]
        {
            assert!(metrics.contains(line), "{line} in:\n{metrics}");
        }
        assert!(metrics.contains("# TYPE sgl_indexer_speculative_added_total counter"));
    }
}
