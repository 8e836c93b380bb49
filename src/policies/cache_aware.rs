//! Cache-aware selection (design §5 "Cache-aware behavior") within the supplied candidates:
//! 1. look up prefix ownership (through [`CacheSource`], once per request via [`PrefixMemo`]);
//! 2. keep holders whose match passes the minimum-token and optional ratio gates;
//! 3. bound them by match length and pressure to the configured minimum / ratio / maximum;
//! 4. apply the soft queue gate and the saturation pin, and check admission explicitly;
//! 5. choose among usable holders by uncached work, the switch margin and the pressure guard;
//! 6. on a miss, a power-of-k load fallback preferring engines inside the soft queue gate, whose
//!    winner this policy checks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::admission::AdmissionGate;
use super::{BoxFuture, Pick, PickError, PickReason, PickRequest, Policy, RandomSource};
use crate::config::CacheAwareConfig;
use crate::host::Host;
use crate::registry::Worker;
use crate::state::kv_events::{PrefixMatch, PrefixReplica};
use crate::state::load_monitor::{EngineLoad, LoadSnapshot};

/// What a prefix lookup found. A confirmed miss and an unavailable source both fall back to load,
/// but stay distinguishable in the pick reason (and so in stats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheLookup {
    Matches(Vec<PrefixMatch>),
    Unavailable(String),
}

/// Normalizes local and remote prefix lookups. Asynchronous so a remote indexer fits.
pub trait CacheSource: Send + Sync + std::fmt::Debug {
    fn lookup<'a>(&'a self, model: &'a str, text: &'a str) -> BoxFuture<'a, CacheLookup>;
}

/// The local variant: this VM's replica of the service's prefix trees.
pub struct LocalCacheSource {
    host: Arc<dyn Host>,
    replica: Mutex<PrefixReplica>,
}

impl LocalCacheSource {
    pub fn new(host: Arc<dyn Host>, replica: PrefixReplica) -> Self {
        Self { host, replica: Mutex::new(replica) }
    }

    /// Applies new log batches; also run on the VM's tick so an idle replica keeps up.
    pub fn refresh(&self) {
        if let Ok(mut r) = self.replica.lock() {
            if let Err(e) = r.refresh(self.host.as_ref()) {
                log::warn!("prefix replica not refreshed: {e}");
            }
        }
    }

    /// (log version applied, bytes held across models).
    pub fn replica_status(&self) -> (u64, u64) {
        self.replica.lock().map(|r| (r.version(), r.trees().values().map(|t| t.size_bytes()).sum())).unwrap_or((0, 0))
    }
}

impl std::fmt::Debug for LocalCacheSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalCacheSource")
    }
}

impl CacheSource for LocalCacheSource {
    fn lookup<'a>(&'a self, model: &'a str, text: &'a str) -> BoxFuture<'a, CacheLookup> {
        let result = match self.replica.lock() {
            Ok(mut r) => match r.refresh(self.host.as_ref()) {
                Ok(()) => {
                    CacheLookup::Matches(r.tree(model).map(|t| t.match_prefix(text.as_bytes())).unwrap_or_default())
                }
                Err(e) => CacheLookup::Unavailable(e.to_string()),
            },
            Err(_) => CacheLookup::Unavailable("replica lock poisoned".into()),
        };
        Box::pin(std::future::ready(result))
    }
}

/// One lookup per request and source, shared across bucket attempts. Each policy still filters
/// the matches to its own candidates and runs its own admission.
#[derive(Debug, Default)]
pub struct PrefixMemo {
    results: Mutex<HashMap<usize, Arc<CacheLookup>>>,
}

impl PrefixMemo {
    async fn lookup(&self, source: &Arc<dyn CacheSource>, model: &str, text: &str) -> Arc<CacheLookup> {
        // Keyed by the shared source, so different index namespaces stay independent.
        let key = Arc::as_ptr(source) as *const () as usize;
        if let Some(hit) = self.results.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return hit;
        }
        let result = Arc::new(source.lookup(model, text).await);
        if let Ok(mut m) = self.results.lock() {
            m.insert(key, Arc::clone(&result));
        }
        result
    }
}

#[derive(Debug)]
pub struct CacheAwarePolicy {
    config: CacheAwareConfig,
    source: Arc<dyn CacheSource>,
    gate: AdmissionGate,
    random: Arc<dyn RandomSource>,
    bytes_per_token: u64,
}

/// One usable prefix holder.
#[derive(Debug, Clone)]
struct Holder {
    worker: Arc<Worker>,
    matched_tokens: u64,
}

/// A total order for load: reported running + waiting (router-local in-flight without a fresh
/// report), then waiting uncached tokens, then in-flight, then id. Never a pairwise comparator.
fn load_key(w: &Worker, load: Option<&EngineLoad>, inflight: u64) -> (u64, u64, u64, String) {
    let reported = load.and_then(|l| Some(l.running?.saturating_add(l.waiting?)));
    let uncached = load.and_then(|l| l.waiting_uncached_tokens).unwrap_or(0);
    (reported.unwrap_or(inflight), uncached, inflight, w.id.clone())
}

impl CacheAwarePolicy {
    pub fn new(
        config: CacheAwareConfig,
        source: Arc<dyn CacheSource>,
        gate: AdmissionGate,
        random: Arc<dyn RandomSource>,
        bytes_per_token: u64,
    ) -> Self {
        Self { config, source, gate, random, bytes_per_token: bytes_per_token.max(1) }
    }

    fn waiting(snapshot: &LoadSnapshot, w: &Worker) -> Option<u64> {
        snapshot.get(&w.id).and_then(|l| l.waiting)
    }

    /// Step 4's soft gate: past the worker queue limit (unknown queues are not past it).
    fn queued(&self, snapshot: &LoadSnapshot, w: &Worker) -> bool {
        self.config.worker_queue_limit.is_some_and(|limit| Self::waiting(snapshot, w).is_some_and(|q| q >= limit))
    }

    /// Steps 2 and 3: holders past the gates, longest match first, bounded in number.
    fn usable_holders(
        &self,
        engines: &[Arc<Worker>],
        matches: &[PrefixMatch],
        input: u64,
        snapshot: &LoadSnapshot,
    ) -> Vec<Holder> {
        let mut holders: Vec<Holder> = matches
            .iter()
            .filter_map(|m| {
                let worker = engines.iter().find(|w| w.id == m.worker)?;
                let matched_tokens = (m.matched_bytes / self.bytes_per_token).min(input);
                let ratio_ok =
                    self.config.min_hit_ratio.is_none_or(|r| input > 0 && matched_tokens as f64 / input as f64 >= r);
                (matched_tokens >= self.config.min_hit_tokens && matched_tokens > 0 && ratio_ok)
                    .then(|| Holder { worker: Arc::clone(worker), matched_tokens })
            })
            .collect();
        let inflight = |w: &Worker| self.gate.inflight.inflight(&w.id);
        holders.sort_by_cached_key(|h| {
            (std::cmp::Reverse(h.matched_tokens), load_key(&h.worker, snapshot.get(&h.worker.id), inflight(&h.worker)))
        });
        let by_ratio = self.config.candidate_ratio.map_or(0, |r| (r * engines.len() as f64).ceil() as usize);
        let mut bound = self.config.min_candidates.max(by_ratio);
        if let Some(max) = self.config.max_candidates {
            bound = bound.min(max);
        }
        holders.truncate(bound.max(1));
        holders
    }

    /// Step 5's pressure guard: holders far busier than the least busy candidate lose preference.
    fn within_pressure_guard(&self, holder: &Holder, engines: &[Arc<Worker>], snapshot: &LoadSnapshot) -> bool {
        let Some(guard) = &self.config.pressure_guard else { return true };
        let Some(load) = snapshot.get(&holder.worker.id) else { return true };
        let least =
            |f: fn(&EngineLoad) -> Option<u64>| engines.iter().filter_map(|w| snapshot.get(&w.id).and_then(f)).min();
        let over = |value: Option<u64>, floor: Option<u64>, extra: Option<u64>| match (value, floor, extra) {
            (Some(v), Some(f), Some(e)) => v > f.saturating_add(e),
            _ => false,
        };
        !over(load.waiting, least(|l| l.waiting), guard.max_extra_waiting_requests)
            && !over(load.running, least(|l| l.running), guard.max_extra_running_requests)
    }

    /// Step 5: start from the longest match; a shorter one wins only when it saves more than the
    /// switch margin of uncached work (the prompt's unmatched part plus the engine's own queue).
    fn preferred_order(&self, holders: Vec<Holder>, input: u64, snapshot: &LoadSnapshot) -> Vec<Holder> {
        let uncached = |h: &Holder| {
            let queue = snapshot.get(&h.worker.id).and_then(|l| l.waiting_uncached_tokens).unwrap_or(0);
            input.saturating_sub(h.matched_tokens).saturating_add(queue)
        };
        if holders.is_empty() {
            return holders;
        }
        let mut best = 0;
        for (i, h) in holders.iter().enumerate().skip(1) {
            if uncached(h).saturating_add(self.config.switch_margin_tokens) < uncached(&holders[best]) {
                best = i;
            }
        }
        let mut ordered = holders;
        let chosen = ordered.remove(best);
        ordered.insert(0, chosen);
        ordered
    }

    /// Step 6: power-of-k over the engines inside the soft queue gate (all of them if none is),
    /// the exact minimum when k covers the pool. The winner is checked by this policy.
    fn load_fallback(
        &self,
        engines: &[Arc<Worker>],
        snapshot: &LoadSnapshot,
        reason: PickReason,
    ) -> Result<Pick, PickError> {
        let open: Vec<&Arc<Worker>> = engines.iter().filter(|w| !self.queued(snapshot, w)).collect();
        let pool: Vec<&Arc<Worker>> = if open.is_empty() { engines.iter().collect() } else { open };
        let k = self.config.min_load_choices.max(1);
        let sampled: Vec<&Arc<Worker>> = if k >= pool.len() {
            pool
        } else {
            let mut remaining = pool;
            (0..k).map(|_| remaining.swap_remove(self.random.below(remaining.len()))).collect()
        };
        let key = |w: &Worker| load_key(w, snapshot.get(&w.id), self.gate.inflight.inflight(&w.id));
        let winner = sampled
            .into_iter()
            .min_by_key(|w| key(w))
            .ok_or_else(|| PickError::no_candidates("cache_aware has no candidates"))?;
        self.gate.check_with(winner, snapshot.get(&winner.id))?;
        Ok(Pick { worker: Arc::clone(winner), reason })
    }

    async fn choose(&self, engines: &[Arc<Worker>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        if engines.is_empty() {
            return Err(PickError::no_candidates("cache_aware has no candidates"));
        }
        let lookup = match (request.prompt_text, request.prefix_memo) {
            (Some(text), Some(memo)) => memo.lookup(&self.source, request.model, text).await,
            (Some(text), None) => Arc::new(self.source.lookup(request.model, text).await),
            (None, _) => Arc::new(CacheLookup::Matches(Vec::new())),
        };
        let snapshot = self.gate.load.snapshot();
        let matches = match lookup.as_ref() {
            CacheLookup::Matches(m) => m,
            CacheLookup::Unavailable(_) => return self.load_fallback(engines, &snapshot, PickReason::CacheUnavailable),
        };
        let holders = self.usable_holders(engines, matches, request.input_tokens, &snapshot);
        if holders.is_empty() {
            return self.load_fallback(engines, &snapshot, PickReason::CacheMiss);
        }
        let (mut usable, reason): (Vec<Holder>, PickReason) = {
            let open: Vec<Holder> = holders.iter().filter(|h| !self.queued(&snapshot, &h.worker)).cloned().collect();
            if !open.is_empty() {
                (open, PickReason::CacheHit)
            } else {
                // Saturated: every holder is queued. Keep the longest match only if it covers
                // enough of the prompt; it must still pass hard admission below.
                let best = &holders[0];
                let covers = request.input_tokens > 0
                    && self
                        .config
                        .saturation_floor
                        .is_some_and(|f| best.matched_tokens as f64 / request.input_tokens as f64 >= f);
                if covers {
                    (vec![best.clone()], PickReason::SaturationPin)
                } else {
                    return self.load_fallback(engines, &snapshot, PickReason::CacheMiss);
                }
            }
        };
        usable.retain(|h| self.within_pressure_guard(h, engines, &snapshot));
        if usable.is_empty() {
            return self.load_fallback(engines, &snapshot, PickReason::PressureGuard);
        }
        // Hard rejection of every bounded holder never turns into a cold fallback.
        let ordered = self.preferred_order(usable, request.input_tokens, &snapshot);
        self.gate.first_admitted(ordered.iter().map(|h| &h.worker), &snapshot, reason)
    }
}

impl Policy for CacheAwarePolicy {
    fn pick<'a>(
        &'a self,
        engines: &'a [Arc<Worker>],
        request: &'a PickRequest<'a>,
    ) -> BoxFuture<'a, Result<Pick, PickError>> {
        Box::pin(self.choose(engines, request))
    }
}

#[cfg(test)]
#[path = "cache_aware_tests.rs"]
mod tests;
