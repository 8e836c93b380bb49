//! The indexer's shared state: one index per model (tokens of different models never meet), which
//! model each worker serves, the counters `/metrics` shows, and the recent match handles a router's
//! "routed" notice refers to.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sgl_envoy_router::config::{CacheSourceKind, RouterConfig};

use crate::claims::{Claims, Turn};
use crate::events::EventBatch;
use crate::index::{block_keys, Counters, EngineMatch, Index};
use crate::replicas::{ClaimAnswer, ClaimRequest, Registration, Replicas};
use crate::snapshot::{self, PageView, RankView, Snapshot};
use crate::timing::{Clock, Phase, PhaseTotals};
use crate::tokenize::{ModelTokenizer, TokenizeError};

/// Queries that tokenize or match at once, by default (`--max-concurrent`): the work is CPU, so
/// more at once only makes each one later.
pub const DEFAULT_MAX_CONCURRENT: usize = 8;
/// What the indexer may hold, by default, across its index and caches (`--max-memory-mb`).
pub const DEFAULT_MAX_MEMORY_MB: usize = 1024;
/// What one engine page costs the indexer's resident memory, measured over the wire by
/// `indexer-compare` (docs/reliability.md): the index's share of the budget divided by this is its
/// page limit.
pub const BYTES_PER_PAGE: usize = 100;
/// What one speculative entry costs: its place in the expiry queue and in the map.
const BYTES_PER_SPECULATIVE: usize = 64;
/// What a match handle costs beyond its keys.
const HANDLE_OVERHEAD: usize = 64;
/// How long a routed notice's blocks count for their engine before its own event confirms them.
pub const SPECULATIVE_TTL_MS: u64 = 2_000;
/// Blocks one routed notice may add (and so the keys a match handle keeps).
pub const MAX_ROUTED_BLOCKS: usize = 1 << 14;

/// One memory budget in bytes, split across what grows with traffic: the index's pages (3/4), the
/// tokenizers' piece caches (1/8, shared by the models that tokenize), the match handles routed
/// notices name (1/16) and the speculative entries (1/16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    pub index_pages: usize,
    pub piece_cache_bytes: usize,
    pub handle_bytes: usize,
    pub speculative_entries: usize,
}

impl MemoryBudget {
    pub fn new(total_bytes: usize, tokenizing_models: usize) -> Self {
        Self {
            index_pages: (total_bytes / 4 * 3 / BYTES_PER_PAGE).max(1),
            piece_cache_bytes: total_bytes / 8 / tokenizing_models.max(1),
            handle_bytes: total_bytes / 16,
            speculative_entries: (total_bytes / 16 / BYTES_PER_SPECULATIVE).max(1),
        }
    }

    pub fn from_mb(mb: usize, config: &RouterConfig) -> Self {
        let tokenizing = config.models.values().filter(|m| m.tokenizer.is_some()).count();
        Self::new(mb.saturating_mul(1 << 20), tokenizing)
    }
}

/// A lock whose holder panicked is still used: the indexer unwinds and answers on (a panic is
/// caught per request), and a poisoned index would otherwise refuse every query from then on.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How long a claim may hold the queries sharing its prefix when its notice is late: half the
/// filter's `timeout_ms`, so a held query still answers before the filter gives up on it.
fn claim_window_ms(config: &RouterConfig) -> u64 {
    config.prefix_index.as_ref().map_or(25, |p| p.timeout_ms / 2)
}

/// How long a routed notice for a handle not known yet waits for the handle's registration.
pub const PENDING_NOTICE_MS: u64 = 1_000;
/// Notices waiting for their handle at most.
const MAX_PENDING_NOTICES: usize = 4096;

/// What became of a routed notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed {
    Applied,
    Pending,
    Refused,
}

#[derive(Debug)]
struct PendingNotice {
    handle: u64,
    worker: String,
    dp_rank: Option<u32>,
    until_ms: u64,
}

/// Where this process numbers its handles from: 24 random high bits, so the handles of replicas
/// (which every replica may be told of) do not collide, and 2^40 matches before they could.
fn first_handle() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms());
    h.write_u32(std::process::id());
    h.finish() & !((1u64 << 40) - 1)
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
    /// Requests that panicked (answered 500; shared with the catch layer).
    pub panics: Arc<AtomicU64>,
    pub unauthorized: AtomicU64,
    /// Queries refused for want of capacity before their deadline.
    pub shed: AtomicU64,
    /// Tokenizations given up past their deadline.
    pub abandoned: AtomicU64,
    /// Handle registrations for peers dropped because the outbox was full.
    pub registrations_dropped: AtomicU64,
    /// Claims decided here because the replica arbitrating them did not answer.
    pub arbiter_failures: AtomicU64,
    /// Where chat matches spent their time.
    pub phases: PhaseTotals,
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

/// The recent handles, within their share of the budget.
#[derive(Debug, Default)]
struct Handles {
    recent: VecDeque<Handle>,
    bytes: usize,
}

fn handle_bytes((_, model, keys): &Handle) -> usize {
    HANDLE_OVERHEAD + model.len() + std::mem::size_of_val(&**keys)
}

/// Where a rank's entries came from first since it was last empty (`/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warmth {
    /// The engine's replay buffer, asked at subscription.
    Replay,
    /// A running replica's snapshot (`--peer`).
    Peer,
    /// The engine's live events only.
    Live,
}

impl Warmth {
    pub fn as_str(self) -> &'static str {
        match self {
            Warmth::Replay => "replay",
            Warmth::Peer => "peer",
            Warmth::Live => "live",
        }
    }
}

/// One engine rank's place in its publisher's sequence, and where its entries came from.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct RankStatus {
    /// The last batch applied.
    seq: Option<u64>,
    warm: Option<Warmth>,
}

pub struct App {
    pub block_tokens: u32,
    indexes: Mutex<HashMap<String, Index>>,
    /// Per (worker, rank); locked inside `indexes`, so a snapshot's pages and sequence agree.
    ranks: Mutex<HashMap<(String, u32), RankStatus>>,
    worker_model: HashMap<String, String>,
    /// Engines that publish no KV events: their routed notices are all the index knows of them.
    silent: std::collections::HashSet<String>,
    handles: Mutex<Handles>,
    /// Routed notices that came before their handle (see [`App::routed`]).
    pending_notices: Mutex<Vec<PendingNotice>>,
    budget: MemoryBudget,
    /// Permits for matching work (tokenizing, matching): a query waits for one until its deadline.
    pub work: tokio::sync::Semaphore,
    /// How long a caller waits for an answer: the filter's `timeout_ms`.
    patience: Duration,
    claims: Claims,
    /// The other indexers of `prefix_index.urls`, with which claims and handles are agreed.
    replicas: Arc<Replicas>,
    tokenizers: HashMap<String, ModelTokenizer>,
    next_handle: AtomicU64,
    pub stats: Stats,
    pub config: RouterConfig,
}

impl App {
    /// Loads every configured tokenizer and chat template; a model whose files do not load is a
    /// startup error, never a request-time one.
    pub fn load(config: RouterConfig, budget: MemoryBudget) -> Result<Self, TokenizeError> {
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
            tokenizers.insert(name.clone(), loaded.with_cache_budget(budget.piece_cache_bytes));
        }
        let mut app = Self::new(config, budget);
        app.tokenizers = tokenizers;
        Ok(app)
    }

    /// The chat body as the engine will tokenize it, given up once `deadline` passed.
    pub fn tokenize_chat(
        &self,
        model: &str,
        chat: &serde_json::Value,
        deadline: Option<Instant>,
        clock: &mut Clock,
    ) -> Result<Vec<u32>, TokenizeError> {
        if !self.serves(model) {
            return Err(TokenizeError::UnknownModel(model.to_string()));
        }
        let tokenizer = self.tokenizers.get(model).ok_or_else(|| TokenizeError::NoTokenizer(model.to_string()))?;
        let prompt = tokenizer.render(chat);
        clock.lap(Phase::Render);
        let tokens = tokenizer.encode_until(&prompt?, deadline);
        clock.lap(Phase::Encode);
        tokens
    }

    pub fn new(config: RouterConfig, budget: MemoryBudget) -> Self {
        let block_tokens = config.prefix_index.as_ref().map_or(16, |p| p.block_tokens).clamp(1, 1 << 16) as u32;
        let models = config.models.len().max(1);
        let (pages, speculative) = (budget.index_pages / models, budget.speculative_entries / models);
        // Engines without KV events are known by routed notices alone, kept as a router's tree
        // would keep them: up to the model's largest `max_tree_tokens` among its remote policies,
        // within the memory budget.
        let routed_blocks = |model: &str| {
            let tree = config.models.get(model).and_then(|m| {
                m.cache_aware_policies()
                    .filter(|c| c.source == CacheSourceKind::Remote)
                    .map(|c| c.max_tree_tokens)
                    .max()
            });
            let blocks = tree.map_or(0, |t| t / u64::from(block_tokens)) as usize;
            blocks.clamp(1, speculative.max(1))
        };
        let indexes = config
            .models
            .keys()
            .map(|m| {
                let index = Index::new(block_tokens, pages).with_max_speculative(speculative);
                (m.clone(), index.with_max_routed(routed_blocks(m)))
            })
            .collect();
        let worker_model = config.workers.iter().map(|w| (w.id.clone(), w.model.clone())).collect();
        let silent = config.workers.iter().filter(|w| w.kv_events.is_none()).map(|w| w.id.clone()).collect();
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
            replicas: Arc::new(Replicas::none()),
            block_tokens,
            indexes: Mutex::new(indexes),
            ranks: Mutex::default(),
            worker_model,
            silent,
            handles: Mutex::default(),
            pending_notices: Mutex::default(),
            budget,
            work: tokio::sync::Semaphore::new(DEFAULT_MAX_CONCURRENT),
            patience: Duration::from_millis(config.prefix_index.as_ref().map_or(50, |p| p.timeout_ms).max(1)),
            tokenizers: HashMap::new(),
            next_handle: AtomicU64::new(first_handle()),
            stats: Stats::default(),
            config,
        }
    }

    fn with_index<R>(&self, model: &str, f: impl FnOnce(&mut Index) -> R) -> Option<R> {
        lock(&self.indexes).get_mut(model).map(f)
    }

    /// Agrees claims and handles with these replicas.
    pub fn with_replicas(mut self, replicas: Arc<Replicas>) -> Self {
        self.replicas = replicas;
        self
    }

    /// At most `permits` queries tokenize or match at once.
    pub fn with_max_concurrent(mut self, permits: usize) -> Self {
        self.work = tokio::sync::Semaphore::new(permits.max(1));
        self
    }

    /// When a query arriving now stops being worth answering: the filter has given up on it.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.patience
    }

    /// Whether a request bears the configured token (always, when none is configured). Compared
    /// in constant time.
    pub fn authorized(&self, headers: &axum::http::HeaderMap) -> bool {
        let Some((header, token)) =
            self.config.prefix_index.as_ref().and_then(|p| p.token_header.as_ref().zip(p.token.as_ref()))
        else {
            return true;
        };
        let given = headers.get(header.as_str()).map(|v| v.as_bytes()).unwrap_or_default();
        bool::from(subtle::ConstantTimeEq::ct_eq(given, token.as_bytes()))
    }

    pub fn budget(&self) -> MemoryBudget {
        self.budget
    }

    /// What the piece caches hold now, in bytes.
    pub fn piece_cache_bytes(&self) -> usize {
        self.tokenizers.values().map(ModelTokenizer::cache_bytes).sum()
    }

    /// What the match handles hold now, in bytes.
    pub fn handle_bytes(&self) -> usize {
        lock(&self.handles).bytes
    }

    /// Applies batch `seq` of one rank to its worker's model; `source` says how it came.
    pub fn apply(&self, worker: &str, rank: u32, seq: u64, batch: &EventBatch, source: Warmth) {
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let Some(model) = self.worker_model.get(worker) else { return };
        self.with_index(model, |index| {
            for event in &batch.events {
                index.apply(worker, rank, event);
            }
            let mut ranks = lock(&self.ranks);
            let status = ranks.entry((worker.to_string(), rank)).or_default();
            status.seq = Some(seq);
            status.warm.get_or_insert(source);
        });
    }

    /// Forgets what an engine rank holds (`None`: every rank), and where it was in its sequence.
    pub fn clear(&self, worker: &str, rank: Option<u32>) {
        if let Some(model) = self.worker_model.get(worker) {
            self.with_index(model, |index| {
                index.clear(worker, rank);
                lock(&self.ranks).retain(|(w, r), _| w != worker || rank.is_some_and(|rank| rank != *r));
            });
        }
    }

    /// The batch a rank expects next, when a peer's snapshot brought it (before subscribing).
    pub fn resume_point(&self, worker: &str, rank: u32) -> Option<u64> {
        lock(&self.ranks).get(&(worker.to_string(), rank)).and_then(|s| s.seq).map(|s| s.wrapping_add(1))
    }

    /// The whole view, for a replica starting after this one.
    pub fn snapshot(&self) -> Snapshot {
        let indexes = lock(&self.indexes);
        let ranks = lock(&self.ranks);
        let mut views = Vec::new();
        for index in indexes.values() {
            for (worker, rank, pages) in index.export() {
                let Some(seq) = ranks.get(&(worker.clone(), rank)).and_then(|s| s.seq) else { continue };
                views.push(RankView { worker, rank, seq, pages: pages.into_iter().map(PageView::from).collect() });
            }
        }
        Snapshot { version: snapshot::VERSION, block_tokens: self.block_tokens, ranks: views }
    }

    /// Loads a peer's view before subscribing: ranks of workers this configuration does not
    /// have (or of another model) are skipped. Returns the ranks loaded.
    pub fn load_snapshot(&self, snapshot: Snapshot) -> usize {
        let mut loaded = 0;
        for view in snapshot.ranks {
            let Some(model) = self.worker_model.get(&view.worker) else { continue };
            let in_range = self.config.workers.iter().any(|w| w.id == view.worker && view.rank < w.dp_size.max(1));
            if !in_range {
                continue;
            }
            let (worker, rank, seq) = (view.worker, view.rank, view.seq);
            self.with_index(model, |index| {
                for page in view.pages {
                    index.import(&worker, rank, page.into());
                }
                lock(&self.ranks)
                    .insert((worker.clone(), rank), RankStatus { seq: Some(seq), warm: Some(Warmth::Peer) });
            });
            loaded += 1;
        }
        loaded
    }

    pub fn serves(&self, model: &str) -> bool {
        self.config.models.contains_key(model)
    }

    pub fn worker_model(&self, worker: &str) -> Option<&str> {
        self.worker_model.get(worker).map(String::as_str)
    }

    fn matches(&self, model: &str, keys: &[u64]) -> Option<Vec<(String, EngineMatch)>> {
        let now = now_ms();
        self.with_index(model, |index| index.match_keys(keys, now))
    }

    /// Drops speculative entries past their time, in every model (run on a timer: a match reads
    /// only live entries, so none waits for this).
    pub fn expire_speculative(&self) {
        let now = now_ms();
        for index in lock(&self.indexes).values_mut() {
            index.expire_speculative(now);
        }
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
        // A notice adds at most MAX_ROUTED_BLOCKS blocks: the handle keeps no more keys than that.
        let kept: Arc<[u64]> =
            if keys.len() > MAX_ROUTED_BLOCKS { keys[..MAX_ROUTED_BLOCKS].into() } else { Arc::clone(&keys) };
        // Known before any claim opens under it, here and (soon) at every peer.
        if will_notify && self.replicas.has_peers() {
            let registration = Registration { handle, model: model.to_string(), keys: kept.to_vec() };
            if !self.replicas.register(registration) {
                self.stats.registrations_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.remember_handle(handle, model, kept);
        if let Turn::Wait { mut routed, until_ms, .. } =
            self.arbitrate(model, &keys, best(&matches), claim_as, true).await
        {
            self.stats.claim_waits.fetch_add(1, Ordering::Relaxed);
            let window = Duration::from_millis(until_ms.saturating_sub(now_ms()));
            if !matches!(tokio::time::timeout(window, routed.wait_for(|r| *r)).await, Ok(Ok(_))) {
                self.stats.claim_waits_unrouted.fetch_add(1, Ordering::Relaxed);
            }
            matches = self.matches(model, &keys)?;
            self.arbitrate(model, &keys, best(&matches), claim_as, false).await;
        }
        match matches.first() {
            None => self.stats.misses.fetch_add(1, Ordering::Relaxed),
            Some((_, m)) if m.confirmed_tokens >= m.matched_tokens => {
                self.stats.hits_confirmed.fetch_add(1, Ordering::Relaxed)
            }
            Some(_) => self.stats.hits_speculative.fetch_add(1, Ordering::Relaxed),
        };
        Some((matches, handle))
    }

    /// Keeps a handle a routed notice may name, within the handles' share of the budget; a
    /// notice for it that came first is applied now.
    fn remember_handle(&self, handle: u64, model: &str, keys: Arc<[u64]>) {
        let early = {
            let mut pending = lock(&self.pending_notices);
            let i = pending.iter().position(|p| p.handle == handle);
            i.map(|i| pending.swap_remove(i)).filter(|p| p.until_ms > now_ms())
        };
        if let Some(notice) = early {
            if self.worker_model(&notice.worker) == Some(model) {
                self.apply_notice(handle, model, &keys, &notice.worker, notice.dp_rank);
            }
        }
        let mut handles = lock(&self.handles);
        let entry = (handle, model.to_string(), keys);
        handles.bytes += handle_bytes(&entry);
        handles.recent.push_back(entry);
        while handles.bytes > self.budget.handle_bytes {
            let Some(old) = handles.recent.pop_front() else { break };
            handles.bytes -= handle_bytes(&old);
        }
    }

    /// Whether the query waits on a claim, or may open one (see `claims`): asked of the replica
    /// that arbitrates claims (see `replicas`), this one when it does or no other answers.
    async fn arbitrate(
        &self,
        model: &str,
        keys: &Arc<[u64]>,
        best: u64,
        claim_as: Option<u64>,
        may_wait: bool,
    ) -> Turn {
        if let Some(arbiter) = self.replicas.arbiter().filter(|_| self.claims.could_matter(model, keys.len(), best)) {
            let request = ClaimRequest {
                model: model.to_string(),
                keys: keys[..keys.len().min(MAX_ROUTED_BLOCKS)].to_vec(),
                best_tokens: best,
                handle: claim_as,
                may_wait,
            };
            match self.replicas.claim(arbiter, &request).await {
                Ok(ClaimAnswer::Go) => return Turn::Go,
                Ok(ClaimAnswer::Wait { handle, shared_blocks, wait_ms }) => {
                    // The notice for that claim reaches this replica too: it wakes the wait here.
                    let shared: Arc<[u64]> = keys[..shared_blocks.min(keys.len())].into();
                    let until_ms = now_ms() + wait_ms.min(self.patience.as_millis() as u64);
                    if !self.knows_handle(handle) {
                        self.remember_handle(handle, model, Arc::clone(&shared));
                    }
                    let routed = self.claims.mirror(model, handle, shared, until_ms);
                    return Turn::Wait { routed, until_ms, handle, shared_blocks };
                }
                Err(e) => {
                    self.stats.arbiter_failures.fetch_add(1, Ordering::Relaxed);
                    eprintln!("sgl-indexer: the claims' arbiter did not answer ({e}); deciding here");
                }
            }
        }
        self.claims.turn(model, keys, best, claim_as, may_wait, now_ms())
    }

    fn knows_handle(&self, handle: u64) -> bool {
        lock(&self.handles).recent.iter().any(|(id, _, _)| *id == handle)
    }

    /// A peer's query asks this replica, its arbiter, about a claim.
    pub fn arbitrate_for_peer(&self, request: ClaimRequest) -> ClaimAnswer {
        let keys: Arc<[u64]> = request.keys.into();
        if let Some(handle) = request.handle {
            if !self.knows_handle(handle) {
                self.remember_handle(handle, &request.model, Arc::clone(&keys));
            }
        }
        let now = now_ms();
        match self.claims.turn(&request.model, &keys, request.best_tokens, request.handle, request.may_wait, now) {
            Turn::Go => ClaimAnswer::Go,
            Turn::Wait { until_ms, handle, shared_blocks, .. } => {
                ClaimAnswer::Wait { handle, shared_blocks, wait_ms: until_ms.saturating_sub(now) }
            }
        }
    }

    /// Matches a peer will send routed notices for: a notice reaching this replica adds the same
    /// speculative entries it adds there.
    pub fn register_handles(&self, registrations: Vec<Registration>) -> usize {
        let mut added = 0;
        for r in registrations.into_iter().take(crate::replicas::OUTBOX) {
            if self.serves(&r.model) && !self.knows_handle(r.handle) {
                let keys: Arc<[u64]> = r.keys[..r.keys.len().min(MAX_ROUTED_BLOCKS)].into();
                self.remember_handle(r.handle, &r.model, keys);
                added += 1;
            }
        }
        added
    }

    /// A router sent the request behind `handle` to `worker` (on `dp_rank`). `Applied`, or
    /// `Pending` when the handle is not known here yet — a peer's registration of it may still be
    /// on its way, and the notice is applied when it comes (within [`PENDING_NOTICE_MS`]) — or
    /// `Refused` when the worker serves another model or too many notices are pending.
    pub fn routed(&self, handle: u64, worker: &str, dp_rank: Option<u32>) -> Routed {
        let found = lock(&self.handles)
            .recent
            .iter()
            .find(|(id, _, _)| *id == handle)
            .map(|(_, model, keys)| (model.clone(), Arc::clone(keys)));
        let Some((model, keys)) = found else {
            if self.worker_model(worker).is_none() {
                return Routed::Refused;
            }
            let now = now_ms();
            let mut pending = lock(&self.pending_notices);
            pending.retain(|p| p.until_ms > now);
            if pending.len() >= MAX_PENDING_NOTICES {
                return Routed::Refused;
            }
            pending.push(PendingNotice {
                handle,
                worker: worker.to_string(),
                dp_rank,
                until_ms: now + PENDING_NOTICE_MS,
            });
            drop(pending);
            self.claims.routed(handle, now);
            return Routed::Pending;
        };
        if self.worker_model(worker) != Some(model.as_str()) {
            return Routed::Refused;
        }
        self.apply_notice(handle, &model, &keys, worker, dp_rank);
        Routed::Applied
    }

    fn apply_notice(&self, handle: u64, model: &str, keys: &[u64], worker: &str, dp_rank: Option<u32>) {
        let until = now_ms() + SPECULATIVE_TTL_MS;
        self.stats.routed_notices.fetch_add(1, Ordering::Relaxed);
        let rank = dp_rank.unwrap_or(0);
        if self.silent.contains(worker) {
            self.with_index(model, |index| index.add_routed(worker, rank, keys));
        } else {
            self.with_index(model, |index| index.add_speculative(worker, rank, keys, until));
        }
        self.claims.routed(handle, now_ms());
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        let s = &self.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut line = |name: &str, help: &str, kind: &str, value: u64| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"));
        };
        let routed_blocks: usize = lock(&self.indexes).values().map(Index::routed_blocks).sum();
        let gauges: [(&str, &str, u64); 7] = [
            ("sgl_indexer_subscriptions", "engine ranks configured to publish events", load(&s.subscriptions)),
            ("sgl_indexer_subscribed", "engine ranks subscribed at least once", load(&s.subscribed)),
            ("sgl_indexer_claims_open", "matches claimed and not yet routed", self.claims.open(now_ms()) as u64),
            (
                "sgl_indexer_piece_cache_bytes",
                "what the tokenizers' piece caches hold",
                self.piece_cache_bytes() as u64,
            ),
            ("sgl_indexer_handle_bytes", "what the match handles hold", self.handle_bytes() as u64),
            ("sgl_indexer_max_pages", "the index's page limit, from the memory budget", self.budget.index_pages as u64),
            (
                "sgl_indexer_routed_blocks",
                "blocks held for engines without KV events, from routed notices",
                routed_blocks as u64,
            ),
        ];
        let counters: [(&str, &str, &AtomicU64); 24] = [
            (
                "sgl_indexer_registrations_dropped_total",
                "match handles not registered with peers because the outbox was full",
                &s.registrations_dropped,
            ),
            (
                "sgl_indexer_arbiter_failures_total",
                "claims decided here because the replica arbitrating them did not answer",
                &s.arbiter_failures,
            ),
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
            ("sgl_indexer_panics_total", "requests that panicked (answered 500)", &s.panics),
            ("sgl_indexer_unauthorized_total", "POSTs refused for a missing or wrong token", &s.unauthorized),
            ("sgl_indexer_shed_total", "queries refused for want of capacity before their deadline", &s.shed),
            ("sgl_indexer_abandoned_total", "tokenizations given up past their deadline", &s.abandoned),
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
        for index in lock(&self.indexes).values() {
            index_totals.add(&index.counters);
            per_engine.extend(index.pages_per_engine());
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
        out.push_str(&s.phases.metrics());
        out.push_str(
            "# HELP sgl_indexer_rank_warm engine ranks holding entries, by where they first came from \
             (replay: the engine's buffer at subscription; peer: a replica's snapshot; live: events)\n\
             # TYPE sgl_indexer_rank_warm gauge\n",
        );
        let mut warm: Vec<((String, u32), Warmth)> =
            lock(&self.ranks).iter().filter_map(|(k, s)| Some((k.clone(), s.warm?))).collect();
        warm.sort_by(|a, b| a.0.cmp(&b.0));
        for ((worker, rank), from) in warm {
            out.push_str(&format!(
                "sgl_indexer_rank_warm{{worker=\"{worker}\",rank=\"{rank}\",from=\"{}\"}} 1\n",
                from.as_str()
            ));
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
        App::new(config, MemoryBudget::new(64 << 20, 0))
    }

    /// Handles were capped at 4,096 of any size, each keeping its query's whole key array: 4,096
    /// queries of a million tokens held 2 GiB. They are bounded in bytes now, and keep no more
    /// keys than a routed notice may add.
    #[tokio::test]
    async fn match_handles_stay_within_their_share_of_the_budget() {
        let app = app();
        let budget = app.budget().handle_bytes;
        let long: Vec<u32> = (0..1_000_000).collect();
        let mut last = 0;
        for _ in 0..64 {
            last = app.match_tokens("m", &long, None, None, false).await.unwrap().1;
            assert!(app.handle_bytes() <= budget, "{} of {budget} bytes", app.handle_bytes());
        }
        assert!(app.handle_bytes() > budget / 2, "the share is used, not wasted");
        let kept = lock(&app.handles).recent.back().map(|(_, _, keys)| keys.len());
        assert_eq!(kept, Some(MAX_ROUTED_BLOCKS));
        assert_eq!(app.routed(last, "A", None), Routed::Applied, "the newest handle is still there");
    }

    /// A routed notice can reach a replica before the peer's registration of its handle: it is
    /// held, and applied when the registration comes.
    #[tokio::test]
    async fn a_notice_before_its_handle_is_applied_when_the_handle_comes() {
        let app = app();
        let keys: Vec<u64> = block_keys(&(0..16).collect::<Vec<u32>>(), 4, None, None);
        assert_eq!(app.routed(7 << 40, "A", None), Routed::Pending);
        assert_eq!(app.routed(7 << 40, "nobody", None), Routed::Refused);
        let registration = Registration { handle: 7 << 40, model: "m".into(), keys: keys.clone() };
        assert_eq!(app.register_handles(vec![registration]), 1);
        let matched = app.matches("m", &keys).unwrap();
        assert_eq!(matched.first().map(|(w, m)| (w.as_str(), m.matched_tokens)), Some(("A", 16)));
    }

    #[test]
    fn the_budget_splits_into_pages_caches_handles_and_speculative_entries() {
        let b = MemoryBudget::new(1 << 30, 2);
        assert_eq!(b.index_pages, (3 << 28) / BYTES_PER_PAGE);
        assert_eq!((b.piece_cache_bytes, b.handle_bytes), (1 << 26, 1 << 26));
        assert_eq!(b.speculative_entries, (1 << 26) / 64);
    }

    /// A replica loaded from another's snapshot matches what it matches, resumes each rank after
    /// the batch the peer was current to, and says where its entries came from.
    #[tokio::test]
    async fn a_snapshot_carries_the_view_and_where_each_rank_stands() {
        let peer = app();
        let tokens: Vec<u32> = (1..=10).collect();
        // Page size 1: the last two tokens leave a partly filled block whose chain must carry over.
        let events: Vec<KvEvent> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                KvEvent::Stored(StoredBlocks {
                    block_hashes: vec![100 + i as u64],
                    parent: (i > 0).then(|| 99 + i as u64),
                    token_ids: vec![*t],
                    block_size: 1,
                    lora: None,
                    medium: Medium::Gpu,
                    cache_salt: None,
                })
            })
            .collect();
        peer.apply("A", 0, 41, &EventBatch { ts: 0.0, events, dp_rank: None }, Warmth::Live);
        let bytes = peer.snapshot().encode();
        let replica = app();
        assert_eq!(replica.load_snapshot(Snapshot::decode(&bytes, 4).unwrap()), 1);
        let matched = |a: &App, t: &[u32]| {
            let keys = block_keys(t, 4, None, None);
            a.matches("m", &keys).unwrap().first().map_or(0, |(_, m)| m.matched_tokens)
        };
        assert_eq!((matched(&peer, &tokens), matched(&replica, &tokens)), (8, 8));
        assert_eq!(replica.resume_point("A", 0), Some(42));
        assert!(replica.metrics().contains(r#"sgl_indexer_rank_warm{worker="A",rank="0",from="peer"} 1"#));
        // Two more tokens on the peer's chain complete the third block on the replica too.
        let more = |h: u64, t: u32| {
            KvEvent::Stored(StoredBlocks {
                block_hashes: vec![h],
                parent: Some(h - 1),
                token_ids: vec![t],
                block_size: 1,
                lora: None,
                medium: Medium::Gpu,
                cache_salt: None,
            })
        };
        let batch = EventBatch { ts: 0.0, events: vec![more(110, 11), more(111, 12)], dp_rank: None };
        replica.apply("A", 0, 42, &batch, Warmth::Live);
        let longer: Vec<u32> = (1..=12).collect();
        assert_eq!(matched(&replica, &longer), 12);
        replica.clear("A", Some(0));
        assert_eq!(replica.resume_point("A", 0), None);
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
        app.apply("A", 0, 0, &batch, Warmth::Live);
        let metrics = app.metrics();
        for line in
            ["sgl_indexer_events_total 2", "sgl_indexer_orphan_pages_total 1", "sgl_indexer_evicted_pages_total 0"]
        {
            assert!(metrics.contains(line), "{line} in:\n{metrics}");
        }
        assert!(metrics.contains("# TYPE sgl_indexer_speculative_added_total counter"));
    }
}
