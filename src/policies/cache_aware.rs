//! Cache-aware selection (design §5 "Cache-aware behavior") within the supplied candidates:
//! 1. look up prefix ownership (through [`CacheSource`]: this VM's replica, or the indexer's answer
//!    the request carries);
//! 2. keep holders whose match passes the minimum-token and optional ratio gates;
//! 3. bound them by match length and pressure to the configured minimum / ratio / maximum;
//! 4. apply the soft queue gate and the saturation pin, and check admission explicitly;
//! 5. choose among usable holders by uncached work, the switch margin and the pressure guard;
//! 6. on a miss, a power-of-k load fallback preferring engines inside the soft queue gate, whose
//!    winner this policy checks.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use super::admission::AdmissionGate;
use super::pressure::{wait_and_rate, PREFILL_QUANTUM_TOKENS};
use super::{Pick, PickError, PickReason, PickRequest, Policy, RandomSource};
use crate::config::{CacheAwareConfig, HoldForPrefix};
use crate::host::{Host, HostError};
use crate::protocol::indexer::PrefixHit;
use crate::registry::Engine;
use crate::state::load_monitor::{EngineLoad, InflightTable, LoadSnapshot, LocalLoad, Prior};
use crate::state::prefix::PrefixReplica;
use crate::state::schedule::Period;

/// What a prefix lookup found. A confirmed miss and an unavailable source both fall back to load,
/// but stay distinguishable in the pick reason (and so in stats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheLookup<'a> {
    /// Every engine's hit, in tokens (a source converts its own units).
    Matches(Cow<'a, [PrefixHit]>),
    Unavailable(Cow<'a, str>),
}

/// Normalizes local and remote prefix lookups. Synchronous: a remote index was asked before the
/// selection started, and its answer is one of the request's facts.
pub trait CacheSource: Send + Sync + std::fmt::Debug {
    fn lookup<'a>(&self, request: &PickRequest<'a>) -> CacheLookup<'a>;

    /// Whether hits count the request's exact tokens (the indexer) rather than the router's text
    /// estimate of them.
    fn exact(&self) -> bool {
        false
    }
}

/// The remote variant: the indexer's answer the request carries (design §6). Without one (the
/// model has no tokenizer, or the request was not asked about) the index is unavailable.
#[derive(Debug, Default)]
pub struct RemoteCacheSource;

impl CacheSource for RemoteCacheSource {
    fn lookup<'a>(&self, request: &PickRequest<'a>) -> CacheLookup<'a> {
        match request.indexer {
            Some(Ok(answer)) => CacheLookup::Matches(Cow::Borrowed(&answer.hits)),
            Some(Err(why)) => CacheLookup::Unavailable(Cow::Borrowed(why)),
            None => CacheLookup::Unavailable(Cow::Borrowed("no indexer answer for this request")),
        }
    }

    fn exact(&self) -> bool {
        true
    }
}

/// The local variant: this VM's replica of the service's prefix trees.
pub struct LocalCacheSource {
    host: Arc<dyn Host>,
    replica: Mutex<Replica>,
    bytes_per_token: u64,
    /// Whether this VM has requests in flight: see [`Replica::looked`].
    inflight: Arc<dyn InflightTable>,
}

#[derive(Debug)]
struct Replica {
    log: PrefixReplica,
    /// When the log's head was last looked at. Looking is a shared-data read, which copies into the
    /// VM: a VM that was idle when a request came looks on every lookup, so a conversation's
    /// next turn finds what its last turn recorded; a busy one at most once per period, as its own
    /// events reach the service (`PrefixOutbox`).
    looked: Period,
}

impl Replica {
    fn refresh(&mut self, host: &dyn Host, now_ms: u64) -> Result<(), HostError> {
        self.looked.done(now_ms);
        self.log.refresh(host)
    }

    fn refresh_if_due(&mut self, host: &dyn Host, idle: bool, now_ms: u64) -> Result<(), HostError> {
        if self.looked.due(idle, now_ms) {
            self.refresh(host, now_ms)
        } else {
            Ok(())
        }
    }
}

impl LocalCacheSource {
    /// The trees match prompt bytes; `bytes_per_token` turns them into the estimator's tokens.
    /// `recheck_ms`: how often a busy VM looks for new log batches.
    pub fn new(
        host: Arc<dyn Host>,
        replica: PrefixReplica,
        bytes_per_token: u64,
        inflight: Arc<dyn InflightTable>,
        recheck_ms: u64,
    ) -> Self {
        Self {
            host,
            replica: Mutex::new(Replica { log: replica, looked: Period::every(recheck_ms) }),
            bytes_per_token: bytes_per_token.max(1),
            inflight,
        }
    }

    /// Applies new log batches; also run on the VM's tick so an idle replica keeps up.
    pub fn refresh(&self) {
        let now = self.host.now_ms();
        if let Ok(mut r) = self.replica.lock() {
            if let Err(e) = r.refresh(self.host.as_ref(), now) {
                log::warn!("prefix replica not refreshed: {e}");
            }
        }
    }

    /// (log version applied, bytes held across models, resyncs, stalls) of this VM's replica.
    pub fn replica_status(&self) -> [u64; 4] {
        self.replica
            .lock()
            .map(|r| {
                let bytes = r.log.trees().values().map(|t| t.size_bytes()).sum();
                [r.log.version(), bytes, r.log.resyncs(), r.log.stalls()]
            })
            .unwrap_or_default()
    }
}

impl std::fmt::Debug for LocalCacheSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalCacheSource")
    }
}

impl CacheSource for LocalCacheSource {
    fn lookup<'a>(&self, request: &PickRequest<'a>) -> CacheLookup<'a> {
        let Some(text) = request.prompt_text else { return CacheLookup::Matches(Cow::Borrowed(&[])) };
        let now = self.host.now_ms();
        let idle = self.inflight.idle();
        let Ok(mut r) = self.replica.lock() else {
            return CacheLookup::Unavailable(Cow::Borrowed("replica lock poisoned"));
        };
        if let Err(e) = r.refresh_if_due(self.host.as_ref(), idle, now) {
            return CacheLookup::Unavailable(Cow::Owned(e.to_string()));
        }
        CacheLookup::Matches(Cow::Owned(
            r.log
                .tree(request.model)
                .map(|t| t.match_prefix(text.as_bytes()))
                .unwrap_or_default()
                .into_iter()
                .map(|m| {
                    let tokens = m.matched_bytes / self.bytes_per_token;
                    PrefixHit {
                        engine: m.worker,
                        matched_tokens: tokens,
                        gpu_tokens: tokens,
                        ranks: Vec::new(),
                        sent_ms: m.sent_ms,
                    }
                })
                .collect(),
        ))
    }
}

#[derive(Debug)]
pub struct CacheAwarePolicy {
    config: CacheAwareConfig,
    source: Arc<dyn CacheSource>,
    gate: AdmissionGate,
    random: Arc<dyn RandomSource>,
    bytes_per_token: u64,
    /// The prior of the prefill rate learned for an engine that does not report one
    /// (`load.prefill_tokens_per_s`).
    assumed_tokens_per_ms: f64,
}

/// What a request would cost at one engine, read once per pick: its own wait for a first token
/// ([`expected_wait_ms`](super::pressure::expected_wait_ms)), the tokens it would prefill there and the rate they were priced at.
#[derive(Debug, Clone, Copy)]
struct Price {
    wait_ms: f64,
    rate: f64,
    uncached: u64,
    local: LocalLoad,
}

impl Price {
    /// The wait plus the request's prefill counted `weight` times more.
    fn cost_ms(&self, weight: f64) -> f64 {
        self.wait_ms + weight * self.uncached as f64 / self.rate
    }
}

/// One usable prefix holder, priced for the rest of its prompt.
#[derive(Debug, Clone)]
struct Holder {
    worker: Arc<Engine>,
    matched_tokens: u64,
    price: Price,
}

/// Prefill the router causes costs more than the wait of the request that brings it: the requests
/// queued behind it on that engine wait too, and a prefix prefilled again elsewhere takes cache
/// space twice. Counted this many times over: the trade between hit rate and tail latency chosen on
/// the tail bench (docs/benchmarks.md, "The tail").
const UNCACHED_WEIGHT: f64 = 12.0;

/// Between holders of one prefix, what only the longer match holds (a session's own turns) counts
/// this many times over: on the tail bench, switching a session's turns to another holder for its
/// shorter queue cost hits and bought no tail (docs/results/history.md, "Weights").
const SWITCH_WEIGHT: f64 = 32.0;

/// Waits up to this are treated as none, and longer ones as equal within [`WAIT_RATIO`], so the
/// spreading of load decides between engines that are about as idle — and engines whose learned
/// speeds differ by noise, not by hardware, look alike.
const WAIT_QUANTUM_MS: f64 = 20.0;
const WAIT_RATIO: f64 = 1.25;

/// A wait's class: 0 up to [`WAIT_QUANTUM_MS`], then one more for each [`WAIT_RATIO`] times.
fn wait_class(wait_ms: f64) -> u64 {
    let over = wait_ms.max(WAIT_QUANTUM_MS) / WAIT_QUANTUM_MS;
    (over.ln() / WAIT_RATIO.ln()) as u64
}

/// A total order for load between holders, never a pairwise comparator: the class of the expected
/// wait for a first token (turn for a slot, then the prefill queue and the request's own:
/// [`expected_wait_ms`](super::pressure::expected_wait_ms)), then reported running + waiting
/// (router-local in-flight without a fresh report), then the uncached tokens the engine was ever
/// sent, then in-flight, then id.
fn load_key(w: &Engine, load: Option<&EngineLoad>, local: LocalLoad, wait_ms: f64) -> (u64, u64, u64, u64, String) {
    let (content, count, inflight, id) = spread_key(w, load, local);
    (wait_class(wait_ms), count, content, inflight, id)
}

/// Where a prompt nobody holds goes among engines about as idle ([`about_as_idle`]): where the
/// least distinct content went (the uncached tokens the engine was ever sent, what sglang-router's
/// smallest tree measures), then reported running + waiting, then in-flight, then id. Content
/// first: where a prefix lands its sessions' turns follow for good, so the prefixes an engine was
/// given say what load it will draw; how many requests it runs this moment says little of that.
fn spread_key(w: &Engine, load: Option<&EngineLoad>, local: LocalLoad) -> (u64, u64, u64, String) {
    let reported = load.and_then(|l| Some(l.running?.saturating_add(l.waiting?)));
    (local.prefilled_total / PREFILL_QUANTUM_TOKENS, reported.unwrap_or(local.inflight), local.inflight, w.id.clone())
}

/// Whether an engine may schedule waiting requests in one prefill batch. Not yet timed, it may as
/// well as not: holding a request for its prefix costs the wait for its first byte, prefilling
/// the prefix again beside the first dispatch may cost its whole batch.
fn may_batch(local: &LocalLoad) -> bool {
    local.batching.batches() || !local.speed.timed()
}

/// The longest expected wait that counts as about as idle as the idlest engine's `least_ms`.
fn about_as_idle(least_ms: f64) -> f64 {
    least_ms * WAIT_RATIO + WAIT_QUANTUM_MS
}

impl CacheAwarePolicy {
    pub fn new(
        config: CacheAwareConfig,
        source: Arc<dyn CacheSource>,
        gate: AdmissionGate,
        random: Arc<dyn RandomSource>,
        bytes_per_token: u64,
        assumed_tokens_per_ms: f64,
    ) -> Self {
        Self { config, source, gate, random, bytes_per_token: bytes_per_token.max(1), assumed_tokens_per_ms }
    }

    /// What sending a request bringing `uncached` tokens to `w` costs, for an engine whose speed,
    /// unless measured or timed, is assumed no faster than `tokens_per_ms`.
    fn priced(&self, snapshot: &LoadSnapshot, fleet: Prior, w: &Engine, uncached: u64, tokens_per_ms: f64) -> Price {
        let load = snapshot.get(&w.id);
        let local = self.gate.inflight.local_load(&w.id);
        let prior = fleet.of(&local);
        let prior = if local.speed.timed() { prior } else { prior.min(tokens_per_ms) };
        let (wait_ms, rate) = wait_and_rate(load, &fleet.judged(local), uncached, prior);
        Price { wait_ms, rate, uncached, local }
    }

    /// The switch margin as prefill time at the assumed rate.
    fn margin_ms(&self) -> f64 {
        self.config.switch_margin_tokens as f64 / self.assumed_tokens_per_ms
    }

    fn priced_key(snapshot: &LoadSnapshot, w: &Engine, price: &Price) -> (u64, u64, u64, u64, String) {
        load_key(w, snapshot.get(&w.id), price.local, price.wait_ms)
    }

    /// The rates assumed of engines not yet timed, for one pick.
    fn prior(&self) -> Prior {
        self.gate.inflight.prior(self.assumed_tokens_per_ms)
    }

    fn waiting(snapshot: &LoadSnapshot, w: &Engine) -> Option<u64> {
        snapshot.get(&w.id).and_then(|l| l.waiting)
    }

    /// Step 4's soft gate: past the worker queue limit (unknown queues are not past it).
    fn queued(&self, snapshot: &LoadSnapshot, w: &Engine) -> bool {
        self.config.worker_queue_limit.is_some_and(|limit| Self::waiting(snapshot, w).is_some_and(|q| q >= limit))
    }

    /// When the router sent `hit`'s prefix to its engine, if the engine has not started on that
    /// dispatch: serving first come first, it has not while a dispatch started before it waits
    /// unanswered there. Asked only where `hold_for_prefix` holds: `always`, or `auto` on an engine
    /// seen to batch its prefill or not yet timed. A prefix the engine itself reported (`sent_ms`
    /// 0) is never held.
    /// `priced` is the engine's load as this pick already read it, if it did.
    fn unstarted(&self, hit: &PrefixHit, priced: impl FnOnce() -> Option<LocalLoad>) -> Option<u64> {
        if self.config.hold_for_prefix == HoldForPrefix::Never || hit.sent_ms == 0 {
            return None;
        }
        let local = priced().unwrap_or_else(|| self.gate.inflight.local_load(&hit.engine));
        if self.config.hold_for_prefix == HoldForPrefix::Auto && !may_batch(&local) {
            return None;
        }
        let oldest = local.unanswered?;
        let started_ms = self.gate.inflight.now_ms().saturating_sub(oldest.ms);
        (started_ms < hit.sent_ms).then_some(hit.sent_ms)
    }

    /// Whether a request that may wait no longer would be batched at `hit`'s engine with the
    /// dispatch that sent the prefix there, and prefill it again: its match holds nothing for it.
    fn prefilled_again(&self, hit: &PrefixHit) -> bool {
        let local = self.gate.inflight.local_load(&hit.engine);
        may_batch(&local) && self.unstarted(hit, || Some(local)).is_some()
    }

    /// Step 2's gates: whether `matched_tokens` of the `compared` ones make a hit.
    fn counts_as_hit(&self, matched_tokens: u64, compared: u64) -> bool {
        let ratio_ok =
            self.config.min_hit_ratio.is_none_or(|r| compared > 0 && matched_tokens as f64 / compared as f64 >= r);
        matched_tokens >= self.config.min_hit_tokens && matched_tokens > 0 && ratio_ok
    }

    /// Steps 2 and 3: holders past the gates, longest match first, bounded in number.
    /// `compared` is how many of the input's tokens the index could match against (the prompt text
    /// the router keeps is bounded): the ratio gate measures a match against that, so a fully
    /// cached long prompt is not a miss.
    fn usable_holders(
        &self,
        engines: &[Arc<Engine>],
        matches: &[PrefixHit],
        input: u64,
        compared: u64,
        snapshot: &LoadSnapshot,
        prior: Prior,
    ) -> Vec<Holder> {
        let mut holders: Vec<Holder> = matches
            .iter()
            .filter_map(|m| {
                let worker = engines.iter().find(|w| w.id == m.engine)?;
                let matched_tokens = m.effective_tokens().min(input);
                self.counts_as_hit(matched_tokens, compared).then(|| {
                    let price =
                        self.priced(snapshot, prior, worker, input.saturating_sub(matched_tokens), f64::INFINITY);
                    Holder { worker: Arc::clone(worker), matched_tokens, price }
                })
            })
            .collect();
        holders.sort_by_cached_key(|h| {
            (std::cmp::Reverse(h.matched_tokens), Self::priced_key(snapshot, &h.worker, &h.price))
        });
        let by_ratio = self.config.candidate_ratio.map_or(0, |r| (r * engines.len() as f64).ceil() as usize);
        let mut bound = self.config.min_candidates.max(by_ratio);
        if let Some(max) = self.config.max_candidates {
            bound = bound.min(max);
        }
        holders.truncate(bound.max(1));
        holders
    }

    /// Step 5's pressure guard: engines far busier than the least busy candidate lose preference,
    /// as holders and as the cold engine that replaces one.
    fn within_pressure_guard(&self, worker: &Engine, engines: &[Arc<Engine>], snapshot: &LoadSnapshot) -> bool {
        let Some(guard) = &self.config.pressure_guard else { return true };
        let Some(load) = snapshot.get(&worker.id) else { return true };
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
    /// switch margin of uncached work: the prompt's unmatched part, the engine's own prefill queue
    /// and its queue for a slot, all as time ([`Price`], the unmatched part counted
    /// [`SWITCH_WEIGHT`] times).
    fn preferred_order(&self, holders: Vec<Holder>) -> Vec<Holder> {
        if holders.is_empty() {
            return holders;
        }
        let waits: Vec<f64> = holders.iter().map(|h| h.price.cost_ms(SWITCH_WEIGHT)).collect();
        let mut best = 0;
        for (i, wait) in waits.iter().enumerate().skip(1) {
            if wait + self.margin_ms() < waits[best] {
                best = i;
            }
        }
        let mut ordered = holders;
        let chosen = ordered.remove(best);
        ordered.insert(0, chosen);
        ordered
    }

    /// Step 6: the load fallback's winner, checked by this policy.
    fn load_fallback(
        &self,
        engines: &[Arc<Engine>],
        snapshot: &LoadSnapshot,
        prior: Prior,
        input: u64,
        reason: PickReason,
    ) -> Result<Pick, PickError> {
        self.checked(self.fallback_engine(engines, snapshot, prior, input), snapshot, reason)
    }

    fn checked(
        &self,
        winner: Option<&Arc<Engine>>,
        snapshot: &LoadSnapshot,
        reason: PickReason,
    ) -> Result<Pick, PickError> {
        let winner = winner.ok_or_else(|| PickError::no_candidates("cache_aware has no candidates"))?;
        self.gate.check_with(winner, snapshot.get(&winner.id))?;
        Ok(Pick::new(Arc::clone(winner), reason))
    }

    /// Step 6's choice for a request prefilling all its `input` tokens: power-of-k over the engines
    /// inside the soft queue gate (all of them if none is), all of them when k covers the pool; of
    /// those, the engines about as idle as the one where it would wait least (a slower engine is
    /// asked for less of the prefill), and of those the first by [`spread_key`].
    fn fallback_engine<'e>(
        &self,
        engines: &'e [Arc<Engine>],
        snapshot: &LoadSnapshot,
        prior: Prior,
        input: u64,
    ) -> Option<&'e Arc<Engine>> {
        let open: Vec<&Arc<Engine>> = engines.iter().filter(|w| !self.queued(snapshot, w)).collect();
        let pool: Vec<&Arc<Engine>> = if open.is_empty() { engines.iter().collect() } else { open };
        let k = self.config.min_load_choices.max(1);
        let sampled: Vec<&Arc<Engine>> = if k >= pool.len() {
            pool
        } else {
            let mut remaining = pool;
            (0..k).map(|_| remaining.swap_remove(self.random.below(remaining.len()))).collect()
        };
        let priced: Vec<(&Arc<Engine>, Price)> =
            sampled.into_iter().map(|w| (w, self.priced(snapshot, prior, w, input, f64::INFINITY))).collect();
        let least_ms = priced.iter().map(|(_, p)| p.wait_ms).fold(f64::INFINITY, f64::min);
        let band_ms = about_as_idle(least_ms);
        priced
            .into_iter()
            .filter(|(_, p)| p.wait_ms <= band_ms || p.wait_ms.is_nan())
            .min_by_key(|(w, p)| spread_key(w, snapshot.get(&w.id), p.local))
            .map(|(w, _)| w)
    }

    fn choose(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        let text = request.prompt_text.filter(|_| !self.source.exact());
        let lookup = self.source.lookup(request);
        let snapshot = self.gate.load.snapshot();
        let prior = self.prior();
        let matches = match &lookup {
            // Done waiting for its prefix, a request sent where that prefix has not started on a
            // batching engine is scheduled beside it and prefills it again: no hit there.
            CacheLookup::Matches(m) if request.prefix_wait_over => {
                &Cow::Owned(m.iter().filter(|h| !self.prefilled_again(h)).cloned().collect())
            }
            CacheLookup::Matches(m) => m,
            CacheLookup::Unavailable(_) => {
                return self.load_fallback(
                    engines,
                    &snapshot,
                    prior,
                    request.input_tokens,
                    PickReason::CacheUnavailable,
                )
            }
        };
        let input = request.input_tokens;
        let compared = match text {
            Some(t) => (t.len() as u64).div_ceil(self.bytes_per_token).min(input),
            None => input,
        };
        let holders = self.usable_holders(engines, matches, input, compared, &snapshot, prior);
        // The chosen engine's match is what it is spared prefilling, whatever the reason it won,
        // and all of it: a match only the indexer's speculation or a slower tier holds counts
        // half for ranking, but counted half in the engine's pending prefill, a burst of siblings
        // of one new prompt made its holder look seconds behind and was moved off it. A usable
        // holder's load was read when it was priced. Only a match the gates count as a hit is
        // worth holding for: a few shared tokens cost little to prefill again.
        let cached = |pick: Pick| {
            let hit = matches.iter().find(|h| h.engine == pick.engine.id);
            let cached_tokens = hit.map_or(0, |h| h.matched_tokens).min(input);
            let priced = || holders.iter().find(|h| h.worker.id == pick.engine.id).map(|h| h.price.local);
            let prefix_unstarted =
                hit.filter(|_| self.counts_as_hit(cached_tokens, compared)).and_then(|h| self.unstarted(h, priced));
            Pick { cached_tokens, prefix_unstarted, ..pick }
        };
        if holders.is_empty() {
            return self
                .load_fallback(engines, &snapshot, prior, request.input_tokens, PickReason::CacheMiss)
                .map(cached);
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
                    return self
                        .load_fallback(engines, &snapshot, prior, request.input_tokens, PickReason::CacheMiss)
                        .map(cached);
                }
            }
        };
        // The wait guard: a holder loses preference when the request would cost more there than at
        // the fallback's engine prefilling all of it, by more than the switch margin
        // (docs/architecture.md, "Design deviations").
        let guarded: Vec<Arc<Engine>>;
        let cold_pool = if self.config.pressure_guard.is_some() {
            guarded = engines.iter().filter(|w| self.within_pressure_guard(w, engines, &snapshot)).cloned().collect();
            if guarded.is_empty() {
                engines
            } else {
                &guarded[..]
            }
        } else {
            engines
        };
        let cold = self.fallback_engine(cold_pool, &snapshot, prior, input);
        // Once the fleet has shown itself slower than the configured rate, an engine not yet
        // timed is priced no faster than the holder: the holder that has waited longest looks
        // slowest only because it has, and moving its sessions prefills their prompts twice. A
        // holder late alone may be hung: then the others keep the configured rate.
        let fleet_slow = prior.untimed < self.assumed_tokens_per_ms;
        usable.retain(|h| {
            let stays = |w: &Engine| {
                let cap = if fleet_slow { h.price.rate } else { f64::INFINITY };
                let elsewhere = self.priced(&snapshot, prior, w, input, cap);
                h.price.cost_ms(UNCACHED_WEIGHT) <= elsewhere.cost_ms(UNCACHED_WEIGHT) + self.margin_ms()
            };
            self.within_pressure_guard(&h.worker, engines, &snapshot) && cold.is_none_or(|w| stays(w))
        });
        if usable.is_empty() {
            return self.checked(cold, &snapshot, PickReason::PressureGuard).map(cached);
        }
        // Hard rejection of every bounded holder never turns into a cold fallback.
        let ordered = self.preferred_order(usable);
        self.gate.first_admitted(ordered.iter().map(|h| &h.worker), &snapshot, reason).map(cached)
    }
}

impl Policy for CacheAwarePolicy {
    fn pick(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.choose(engines, request)
    }

    /// The policy's load side: where a prompt nobody holds goes. A second walk of the prefix index
    /// for every request, for an engine that is used only when the first refuses, cost more than
    /// the whole rest of the filter's selection.
    fn fallback(&self, engines: &[Arc<Engine>], _failed: &Engine, request: &PickRequest<'_>) -> Option<Arc<Engine>> {
        let snapshot = self.gate.load.snapshot();
        self.load_fallback(engines, &snapshot, self.prior(), request.input_tokens, PickReason::CacheMiss)
            .ok()
            .map(|p| p.engine)
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::config::{AdmissionLimits, PressureGuard};
    use crate::policies::{Limit, Rejection, SeededRandom};
    use crate::registry::Role;
    use crate::state::load_monitor::{FirstByte, InflightTable, MemoryInflight, PrefillWork, Sample, Waiting};
    use crate::testing::*;

    #[test]
    fn a_busy_vm_looks_for_new_prefix_batches_once_per_period_an_idle_one_on_every_lookup() {
        use crate::host::MemoryHost;
        use crate::state::prefix::{Budgets, PrefixEvent, PrefixLog, Tier};
        let host = Arc::new(MemoryHost::default());
        let budgets = Budgets([("m".to_string(), 1 << 20)].into_iter().collect());
        let mut service = PrefixLog::new(budgets.clone());
        service.publish_start(host.as_ref()).unwrap();
        let inflight = Arc::new(MemoryInflight::default());
        let source = LocalCacheSource::new(
            Arc::clone(&host) as Arc<dyn Host>,
            PrefixReplica::new(budgets),
            1,
            Arc::clone(&inflight) as Arc<dyn InflightTable>,
            5,
        );
        let stored = |worker: &str, text: &str| PrefixEvent::Stored {
            model: "m".into(),
            worker: worker.into(),
            text: text.into(),
            tier: Tier::Gpu,
            sent_ms: 0,
        };
        let holders = |text: &str| match source.lookup(&PickRequest { prompt_text: Some(text), ..request(Role::Plain) })
        {
            CacheLookup::Matches(m) => m.iter().map(|h| h.engine.clone()).collect::<Vec<_>>(),
            CacheLookup::Unavailable(e) => panic!("{e}"),
        };
        service.append(host.as_ref(), vec![stored("A", "hello")]).unwrap();
        assert_eq!(holders("hello"), ["A"], "an idle VM sees the last batch at once");

        inflight.set("A", 1);
        assert_eq!(holders("hello"), ["A"], "busy: looked now, a period starts");
        service.append(host.as_ref(), vec![stored("B", "bye")]).unwrap();
        host.advance_ms(4);
        assert!(holders("bye").is_empty(), "busy: not looked again within the period");
        host.advance_ms(1);
        assert_eq!(holders("bye"), ["B"], "a period on");

        service.append(host.as_ref(), vec![stored("C", "again")]).unwrap();
        inflight.set("A", 0);
        assert_eq!(holders("again"), ["C"], "idle again: at once");
    }

    /// A source with fixed answers that counts lookups.
    #[derive(Debug)]
    struct Fixed {
        answer: CacheLookup<'static>,
        lookups: AtomicUsize,
    }

    impl Fixed {
        fn matches(m: &[(&str, u64)]) -> Arc<Self> {
            Self::sent(&m.iter().map(|&(w, tokens)| (w, tokens, 0)).collect::<Vec<_>>())
        }

        /// Hits the router sent there at (engine, tokens, sent_ms).
        fn sent(m: &[(&str, u64, u64)]) -> Arc<Self> {
            let matches = m
                .iter()
                .map(|&(w, tokens, sent_ms)| PrefixHit {
                    engine: w.to_string(),
                    matched_tokens: tokens,
                    gpu_tokens: tokens,
                    ranks: Vec::new(),
                    sent_ms,
                })
                .collect();
            Arc::new(Self { answer: CacheLookup::Matches(Cow::Owned(matches)), lookups: AtomicUsize::new(0) })
        }
    }

    impl CacheSource for Fixed {
        fn lookup<'a>(&self, _: &PickRequest<'a>) -> CacheLookup<'a> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            self.answer.clone()
        }
    }

    fn policy(
        state: &State,
        source: Arc<Fixed>,
        config: CacheAwareConfig,
        limits: AdmissionLimits,
    ) -> CacheAwarePolicy {
        CacheAwarePolicy::new(config, source, state.gate(limits), Arc::new(SeededRandom::new(3)), 4, 20.0)
    }

    fn tuned(f: impl FnOnce(&mut CacheAwareConfig)) -> CacheAwareConfig {
        let mut c = CacheAwareConfig { min_hit_tokens: 100, ..CacheAwareConfig::default() };
        f(&mut c);
        c
    }

    /// A prompt whose text is as long as its tokens say (4 bytes a token).
    fn prompt(input_tokens: u64) -> PickRequest<'static> {
        let text: &'static str = Box::leak("p".repeat(input_tokens as usize * 4).into_boxed_str());
        PickRequest { input_tokens, prompt_text: Some(text), ..request(Role::Plain) }
    }

    fn pick(p: &CacheAwarePolicy, ids: &[&str], input: u64) -> Result<Pick, PickError> {
        p.pick(&workers(ids), &prompt(input))
    }

    #[test]
    fn the_engine_holding_the_prefix_is_chosen() {
        let s = State::new();
        let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 200)]), tuned(|_| {}), AdmissionLimits::default());
        let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("B", PickReason::CacheHit));
    }

    /// A retry's engine is where a prompt nobody holds would go, found without a second lookup.
    #[test]
    fn the_fallback_is_the_load_side_without_another_lookup() {
        let s = State::new();
        let source = Fixed::matches(&[("B", 900), ("C", 900)]);
        let p = policy(&s, Arc::clone(&source), tuned(|_| {}), AdmissionLimits::default());
        let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!(r.engine.id, "B");
        s.inflight.set("C", 5);
        let rest = workers(&["A", "C"]);
        let fallback = p.fallback(&rest, &r.engine, &prompt(1000)).unwrap();
        assert_eq!(fallback.id, "A", "the idle engine, though C holds the prompt");
        assert_eq!(source.lookups.load(Ordering::SeqCst), 1, "one lookup for both");
    }

    #[test]
    fn the_default_minimum_hit_is_1024_tokens() {
        assert_eq!(CacheAwareConfig::default().min_hit_tokens, 1024);
        assert_eq!(CacheAwareConfig::default().min_load_choices, 2);
        let s = State::new();
        let p = policy(&s, Fixed::matches(&[("B", 1023)]), CacheAwareConfig::default(), AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B"], 5000).unwrap().reason, PickReason::CacheMiss);
        let p = policy(&s, Fixed::matches(&[("B", 1024)]), CacheAwareConfig::default(), AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B"], 5000).unwrap().engine.id, "B");
    }

    #[test]
    fn the_optional_ratio_gate_applies_too() {
        let s = State::new();
        let p = policy(
            &s,
            Fixed::matches(&[("B", 300)]),
            tuned(|c| c.min_hit_ratio = Some(0.5)),
            AdmissionLimits::default(),
        );
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().reason, PickReason::CacheMiss, "30 % < 50 %");
        assert_eq!(pick(&p, &["A", "B"], 500).unwrap().engine.id, "B", "60 % passes");
    }

    #[test]
    fn a_fully_cached_prompt_longer_than_the_compared_text_passes_the_ratio_gate() {
        // 200 kB of prompt; the router keeps the first 64 KiB of text (16,384 tokens) and the
        // index matched all of it.
        let s = State::new();
        let p = policy(
            &s,
            Fixed::matches(&[("B", 16_384)]),
            tuned(|c| c.min_hit_ratio = Some(0.5)),
            AdmissionLimits::default(),
        );
        let text: &'static str = Box::leak("p".repeat(64 * 1024).into_boxed_str());
        let r = PickRequest { input_tokens: 50_000, prompt_text: Some(text), ..request(Role::Plain) };
        let pick = p.pick(&workers(&["A", "B"]), &r).unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("B", PickReason::CacheHit));
    }

    #[test]
    fn matches_outside_the_candidates_are_ignored() {
        let s = State::new();
        let p = policy(&s, Fixed::matches(&[("Z", 900)]), tuned(|_| {}), AdmissionLimits::default());
        let r = pick(&p, &["A", "B"], 1000).unwrap();
        assert_eq!(r.reason, PickReason::CacheMiss);
    }

    #[test]
    fn candidate_bounds_keep_the_longest_matches() {
        let s = State::new();
        // B has the longest match but is rejected; with max_candidates 1 nothing else may be tried.
        s.inflight.set("B", 1);
        let limits = AdmissionLimits { max_inflight_requests: Some(1), ..Default::default() };
        let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 800)]), tuned(|c| c.max_candidates = Some(1)), limits);
        let err = pick(&p, &["A", "B", "C"], 1000).unwrap_err();
        assert_eq!(
            err,
            PickError::NoAdmissibleEngine {
                rejections: vec![Rejection { engine: "B".into(), limit: Limit::MaxInflightRequests }]
            }
        );
        let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 800)]), tuned(|c| c.min_candidates = 2), limits);
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "C", "the next bounded holder is checked");
    }

    #[test]
    fn hard_rejection_of_every_holder_never_becomes_a_cold_fallback() {
        let s = State::new();
        s.inflight.set("B", 1);
        let limits = AdmissionLimits { max_inflight_requests: Some(1), ..Default::default() };
        let p = policy(&s, Fixed::matches(&[("B", 900)]), tuned(|_| {}), limits);
        assert!(
            matches!(pick(&p, &["A", "B"], 1000), Err(PickError::NoAdmissibleEngine { .. })),
            "A is idle but not a fallback"
        );
    }

    #[test]
    fn the_soft_queue_gate_prefers_holders_below_the_queue_limit() {
        let s = State::new();
        s.loads(&[("B", native_load(1, 10)), ("C", native_load(1, 0))]);
        let p = policy(
            &s,
            Fixed::matches(&[("B", 900), ("C", 500)]),
            tuned(|c| c.worker_queue_limit = Some(8)),
            AdmissionLimits::default(),
        );
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "C");
    }

    #[test]
    fn saturation_pins_the_longest_match_only_above_the_floor() {
        let s = State::new();
        s.loads(&[("A", native_load(0, 20)), ("B", native_load(0, 20)), ("C", native_load(0, 2))]);
        let cfg = |floor| {
            tuned(|c| {
                c.worker_queue_limit = Some(8);
                c.saturation_floor = floor;
            })
        };
        let p = policy(&s, Fixed::matches(&[("B", 900)]), cfg(Some(0.8)), AdmissionLimits::default());
        let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("B", PickReason::SaturationPin));
        let p = policy(&s, Fixed::matches(&[("B", 900)]), cfg(Some(0.95)), AdmissionLimits::default());
        let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!(
            (r.engine.id.as_str(), r.reason),
            ("C", PickReason::CacheMiss),
            "the fallback prefers the open engine"
        );
    }

    #[test]
    fn a_saturation_pin_must_still_pass_hard_admission() {
        let s = State::new();
        s.loads(&[("B", native_load(0, 20))]);
        let cfg = tuned(|c| {
            c.worker_queue_limit = Some(8);
            c.saturation_floor = Some(0.5);
        });
        let p = policy(
            &s,
            Fixed::matches(&[("B", 900)]),
            cfg,
            AdmissionLimits { max_waiting_requests: Some(20), ..Default::default() },
        );
        assert!(matches!(pick(&p, &["A", "B"], 1000), Err(PickError::NoAdmissibleEngine { .. })));
    }

    #[test]
    fn a_shorter_match_wins_only_beyond_the_switch_margin() {
        let s = State::new();
        let mut busy = native_load(0, 0);
        busy.waiting_uncached_tokens = Some(3_000);
        s.loads(&[("B", busy.clone()), ("C", native_load(0, 0))]);
        let holders = || Fixed::matches(&[("B", 900), ("C", 800)]);
        let p = policy(&s, holders(), tuned(|c| c.min_candidates = 2), AdmissionLimits::default());
        // At 20 tokens/ms, what only the longer match holds weighed 33×: B waits (3,000 + 100) / 20
        // = 155 ms and costs 160 ms more; C waits 10 ms and costs 320 ms more.
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "B", "a session keeps its turns");
        busy.waiting_uncached_tokens = Some(5_000);
        s.loads(&[("B", busy), ("C", native_load(0, 0))]);
        // B now waits 255 ms: C saves 85 ms, 1,700 tokens' worth.
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "C");
        let with_margin = tuned(|c| {
            c.min_candidates = 2;
            c.switch_margin_tokens = 2_000;
        });
        let p = policy(&s, holders(), with_margin, AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "B", "1,700 saved is not more than the margin");
    }

    #[test]
    fn the_pressure_guard_moves_requests_off_an_overloaded_holder() {
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(1, 12))]);
        let guard = PressureGuard { max_extra_waiting_requests: Some(10), max_extra_running_requests: None };
        let p = policy(
            &s,
            Fixed::matches(&[("B", 900)]),
            tuned(|c| c.pressure_guard = Some(guard.clone())),
            AdmissionLimits::default(),
        );
        let r = pick(&p, &["A", "B"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("A", PickReason::PressureGuard));
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(1, 10))]);
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "B", "within the guard");
    }

    #[test]
    fn the_pressure_guard_never_sends_the_cold_prefill_back_to_the_holder_it_moved_off() {
        let s = State::new();
        let mut fast = native_load(1, 12);
        // Prefilling the whole prompt on B would look quickest: B is guarded all the same.
        fast.prefill_tokens_per_ms = Some(1_000.0);
        s.loads(&[("A", native_load(1, 0)), ("B", fast), ("C", native_load(1, 1))]);
        let guard = PressureGuard { max_extra_waiting_requests: Some(10), max_extra_running_requests: None };
        let p = policy(
            &s,
            Fixed::matches(&[("B", 900)]),
            tuned(|c| c.pressure_guard = Some(guard.clone())),
            AdmissionLimits::default(),
        );
        let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("A", PickReason::PressureGuard));
    }

    /// A report of `running` + `waiting` on an engine with `slots`, whose requests held it
    /// `hold_ms` each.
    fn slotted(s: &State, id: &str, running: u64, waiting: u64, slots: u64, hold_ms: u64) -> (String, EngineLoad) {
        s.inflight.acquire(id, PrefillWork::NONE);
        s.inflight.release(id, 0, hold_ms);
        let mut load = native_load(running, waiting);
        load.max_running = Some(slots);
        load.sent_at_report = s.inflight.local_load(id).sent();
        (id.to_string(), load)
    }

    #[test]
    fn the_wait_guard_moves_a_request_off_a_holder_with_a_long_queue_for_a_slot() {
        let s = State::new();
        let queued = slotted(&s, "B", 4, 3, 4, 800);
        let idle = slotted(&s, "A", 1, 0, 4, 800);
        s.inflight.set_now(0);
        s.loads(&[(idle.0.as_str(), idle.1.clone()), (queued.0.as_str(), queued.1)]);
        let p = policy(&s, Fixed::matches(&[("B", 900)]), tuned(|_| {}), AdmissionLimits::default());
        // B: 4 ahead × 200 ms = 800 ms; A: 1,000 tokens at 20/ms = 50 ms, weighed 13× = 650 ms.
        let r = pick(&p, &["A", "B"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("A", PickReason::PressureGuard));
        let shorter = slotted(&s, "B", 4, 1, 4, 800);
        s.loads(&[(idle.0.as_str(), idle.1), (shorter.0.as_str(), shorter.1)]);
        // B: 2 ahead = 400 ms plus 100 tokens weighed 13× = 65 ms: still under 650 ms.
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "B", "a shorter queue keeps the hit");
    }

    #[test]
    fn a_miss_goes_where_the_least_distinct_content_went_among_engines_about_as_idle() {
        let s = State::new();
        s.loads(&[("A", native_load(0, 0)), ("B", native_load(3, 0))]);
        s.inflight.acquire("A", PrefillWork { tokens: 4_096, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("A", 4_096, 5);
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default());
        // Neither has a queue for a slot or for prefill: B's three running requests cost the new
        // prompt nothing, and A was given the prefixes whose sessions will keep it busy.
        let r = pick(&p, &["A", "B"], 1000).unwrap();
        assert_eq!((r.engine.id.as_str(), r.reason), ("B", PickReason::CacheMiss));
        s.inflight.acquire("B", PrefillWork { tokens: 8_192, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("B", 8_192, 5);
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "A");
    }

    #[test]
    fn a_miss_does_not_go_for_its_little_content_to_an_engine_it_would_wait_at() {
        let s = State::new();
        let queued = slotted(&s, "B", 4, 2, 4, 800);
        let idle = slotted(&s, "A", 1, 0, 4, 800);
        s.inflight.acquire("A", PrefillWork { tokens: 4_096, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("A", 4_096, 5);
        s.loads(&[(idle.0.as_str(), idle.1), (queued.0.as_str(), queued.1)]);
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default());
        // B: 3 ahead of it for a slot × 200 ms; A: its own 50 ms of prefill.
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "A");
    }

    #[test]
    fn a_miss_avoids_an_engine_still_prefilling_what_the_router_sent() {
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(1, 0))]);
        // Sent 2,000 tokens at 1 token/ms: 2 s of prefill the report does not show.
        s.inflight.acquire("A", PrefillWork { tokens: 2_000, tokens_per_ms: 1.0, ahead: 0, slot_wait_ms: 0 });
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "B");
        s.inflight.set_now(2_000);
        // Drained: the next difference decides — B was given more distinct content than A.
        s.inflight.acquire("B", PrefillWork { tokens: 4_000, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "A");
    }

    #[test]
    fn a_miss_avoids_an_engine_sent_a_prompt_since_its_report_showed_no_prefill_waiting() {
        let s = State::new();
        // B was given more distinct content, long since prefilled: by content alone A is preferred.
        s.inflight.acquire("B", PrefillWork { tokens: 8_000, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("B", 8_000, 5);
        let reported = |id: &str, waiting_uncached: u64| {
            let mut load = native_load(0, 0);
            load.waiting_uncached_tokens = Some(waiting_uncached);
            load.sent_at_report = s.inflight.local_load(id).sent();
            (id.to_string(), load)
        };
        let (a, b) = (reported("A", 0), reported("B", 0));
        s.loads(&[(a.0.as_str(), a.1.clone()), (b.0.as_str(), b.1.clone())]);
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B"], 2_000).unwrap().engine.id, "A");
        // A is sent a prompt of 2,000 tokens at 16 tokens/ms: 125 ms of prefill its report cannot show.
        s.inflight.acquire("A", PrefillWork { tokens: 2_000, tokens_per_ms: 16.0, ahead: 0, slot_wait_ms: 0 });
        assert_eq!(pick(&p, &["A", "B"], 2_000).unwrap().engine.id, "B", "the report is older than the prompt");
        let a_later = reported("A", 2_000);
        s.loads(&[(a_later.0.as_str(), a_later.1), (b.0.as_str(), b.1.clone())]);
        assert_eq!(pick(&p, &["A", "B"], 2_000).unwrap().engine.id, "B", "a report showing it, counted once");
        s.loads(&[(a.0.as_str(), a.1), (b.0.as_str(), b.1)]);
        s.inflight.set_now(1_000);
        assert_eq!(pick(&p, &["A", "B"], 2_000).unwrap().engine.id, "A", "prefilled by the router's estimate");
    }

    /// `worker` answered `n` streamed requests of mixed lengths at `tokens_per_ms`.
    fn learned(s: &State, worker: &str, tokens_per_ms: f64, n: u64) {
        crate::testing::answered(&s.inflight, worker, tokens_per_ms, 5, (0..n).map(|i| 100 + (i % 5) * 700));
    }

    /// `worker` answered requests that waited there together at once, as an engine prefilling them
    /// in one batch does.
    fn answered_in_batches(s: &State, worker: &str) {
        let now = s.inflight.now_ms();
        for _ in 0..6 {
            s.inflight.acquire(worker, PrefillWork { tokens: 400, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 });
            let sample = Some(Sample { tokens: 400, ms: 40 });
            s.inflight.first_byte(worker, FirstByte { prefill_tokens: 400, sent_ms: now - 40, sample }, 20.0);
            s.inflight.release(worker, 0, 50);
        }
        assert!(s.inflight.local_load(worker).batching.batches());
    }

    /// Two idle engines, and a policy for which neither holds anything: the fallback's exact
    /// minimum decides.
    fn misses_between(s: &State, a: &str, b: &str) -> CacheAwarePolicy {
        s.loads(&[(a, native_load(0, 0)), (b, native_load(0, 0))]);
        policy(s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default())
    }

    #[test]
    fn a_miss_goes_to_the_engine_that_prefills_it_sooner_by_what_the_router_learned() {
        let s = State::new();
        let p = misses_between(&s, "A", "B");
        // By the prior both prefill at 20 tokens/ms; A was given more distinct content.
        s.inflight.acquire("A", PrefillWork { tokens: 4_096, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("A", 4_096, 5);
        assert_eq!(pick(&p, &["A", "B"], 2000).unwrap().engine.id, "B");
        // B turns out four times slower than A: a long prompt goes to A, a short one still
        // spreads by content (its prefill takes a few milliseconds anywhere).
        learned(&s, "A", 8.0, 40);
        learned(&s, "B", 2.0, 40);
        assert_eq!(pick(&p, &["A", "B"], 2000).unwrap().engine.id, "A");
        assert_eq!(pick(&p, &["A", "B"], 20).unwrap().engine.id, "B");
    }

    #[test]
    fn an_engine_not_yet_timed_is_judged_as_slow_as_the_slowest_timed_one() {
        let s = State::new();
        let p = misses_between(&s, "A", "U");
        // U was sent 2,000 tokens and has not answered yet; A answers at 2 tokens/ms.
        s.inflight.acquire("U", PrefillWork { tokens: 2_000, tokens_per_ms: 2.0, ahead: 0, slot_wait_ms: 0 });
        learned(&s, "A", 2.0, 40);
        // At the configured 20 tokens/ms U's queue would look 150 ms long, A's own prefill 500 ms.
        assert_eq!(pick(&p, &["A", "U"], 1000).unwrap().engine.id, "A");
    }

    #[test]
    fn an_idle_engine_never_sent_anything_is_tried_though_a_timed_one_is_slower() {
        let s = State::new();
        s.loads(&[("A", native_load(0, 0)), ("B", native_load(0, 0)), ("N", native_load(0, 0))]);
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 3), AdmissionLimits::default());
        learned(&s, "A", 4.0, 40);
        learned(&s, "B", 1.0, 40);
        // A has a second's work queued, and a cold 2,000 tokens take it half a second more; B
        // would take 2 s. At the fleet's rate, between the two, N takes about 1.3 s.
        s.inflight.acquire("A", PrefillWork { tokens: 4_000, tokens_per_ms: 4.0, ahead: 0, slot_wait_ms: 0 });
        // N never answered because it was never asked: judged as slow as B, it never would be.
        assert_eq!(pick(&p, &["A", "B", "N"], 2_000).unwrap().engine.id, "N");
    }

    #[test]
    fn before_any_first_byte_the_engine_sent_a_prompt_last_does_not_look_the_least_busy() {
        let s = State::new();
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 2), AdmissionLimits::default());
        let cold = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        s.inflight.acquire("Old", cold);
        s.inflight.awaiting("Old", Waiting { since_ms: 0, tokens: 2_000 });
        s.inflight.set_now(300);
        s.inflight.acquire("Young", cold);
        s.inflight.awaiting("Young", Waiting { since_ms: 300, tokens: 2_000 });
        s.inflight.acquire("Young", PrefillWork { tokens: 500, ..cold });
        // By the configured rate Old is late and Young nearly done; but no engine has answered
        // yet, so Old's wait is the fleet's, and Young was sent more.
        s.inflight.set_now(400);
        assert_eq!(pick(&p, &["Old", "Young"], 2_000).unwrap().engine.id, "Old");
    }

    #[test]
    fn a_holder_late_with_the_fleet_keeps_its_hit_from_an_engine_that_has_not_shown_its_speed() {
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(0, 0)), ("C", native_load(1, 0))]);
        let p = policy(&s, Fixed::matches(&[("A", 900)]), tuned(|_| {}), AdmissionLimits::default());
        s.inflight.set("B", 0);
        // A was sent 2,000 tokens at 0 and 6,000 more since; C 2,000 at 2,000. Neither has answered
        // by 3,050: the fleet is slower than the configured 20 tokens/ms, A seemingly slowest.
        let cold = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        s.inflight.acquire("A", cold);
        s.inflight.awaiting("A", Waiting { since_ms: 0, tokens: 2_000 });
        s.inflight.acquire("A", PrefillWork { tokens: 6_000, ..cold });
        s.inflight.set_now(2_000);
        s.inflight.acquire("C", cold);
        s.inflight.awaiting("C", Waiting { since_ms: 2_000, tokens: 2_000 });
        s.inflight.set_now(3_050);
        let [a, b] = ["A", "B"].map(|w| workers(&[w]).remove(0));
        let (input, snapshot) = (1_000, crate::state::load_monitor::LoadView::snapshot(s.load.as_ref()));
        let cost =
            |prior, w: &Engine, tokens| p.priced(&snapshot, prior, w, tokens, f64::INFINITY).cost_ms(UNCACHED_WEIGHT);
        let prior = s.inflight.prior(20.0);
        assert!(prior.untimed < 3.0, "{prior:?}");
        // No engine has answered: A's silence is the fleet's, and its queue counts whole.
        assert!(cost(prior, &a, input - 900) < cost(prior, &b, input), "before any first byte A looks no slower");
        assert_eq!(pick(&p, &["A", "B", "C"], input).unwrap().engine.id, "A");
        // D answers at 2 tokens/ms: now A's silence is A's own.
        learned(&s, "D", 2.0, 40);
        let prior = s.inflight.prior(20.0);
        assert!(
            cost(prior, &b, input) + p.margin_ms() < cost(prior, &a, input - 900),
            "at the fleet's rate the idle B looks cheaper"
        );
        assert_eq!(pick(&p, &["A", "B", "C"], input).unwrap().engine.id, "A", "but B is no faster than A");
    }

    #[test]
    fn a_holder_that_leaves_its_prompts_unanswered_long_past_their_time_loses_the_hit() {
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(1, 0))]);
        let p = policy(&s, Fixed::matches(&[("A", 900)]), tuned(|_| {}), AdmissionLimits::default());
        // B idle, timed on time: A's lateness is A's alone, not the fleet's.
        learned(&s, "B", 20.0, 8);
        // A was sent a 2,000-token prompt at 0 whose first token is still to come; by the prior
        // it takes 100 ms.
        s.inflight.acquire("A", PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 });
        s.inflight.awaiting("A", Waiting { since_ms: 0, tokens: 2_000 });
        s.inflight.set_now(100);
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "A", "on time: the hit stays");
        // Three seconds on it has not answered: what A shows of itself outweighs the 900 tokens.
        s.inflight.set_now(3_050);
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "B");
        s.inflight.answered("A", Waiting { since_ms: 0, tokens: 2_000 });
        s.inflight.release("A", 0, 3_050);
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().engine.id, "A", "answered: back to its holder");
    }

    /// SGLang matches its cache when it schedules a request: one scheduled in the batch of the
    /// dispatch that brings the prefix prefills it again.
    #[test]
    fn a_hit_says_when_its_prefix_was_sent_while_work_sent_before_it_waits_unanswered() {
        let s = State::new();
        let hold = tuned(|c| c.hold_for_prefix = HoldForPrefix::Always);
        let off = policy(
            &s,
            Fixed::sent(&[("A", 900, 50)]),
            tuned(|c| c.hold_for_prefix = HoldForPrefix::Never),
            AdmissionLimits::default(),
        );
        let auto = policy(&s, Fixed::sent(&[("A", 900, 50)]), tuned(|_| {}), AdmissionLimits::default());
        let p = policy(&s, Fixed::sent(&[("A", 900, 50)]), hold.clone(), AdmissionLimits::default());
        let unstarted = |p: &CacheAwarePolicy| {
            let hit = pick(p, &["A", "B"], 1000).unwrap();
            assert_eq!((hit.engine.id.as_str(), hit.cached_tokens), ("A", 900), "the holder all the same");
            hit.prefix_unstarted
        };
        s.inflight.set_now(60);
        assert_eq!(unstarted(&p), None, "nothing unanswered: the engine took the prefix up");
        let ahead = Waiting { since_ms: 40, tokens: 500 };
        s.inflight.awaiting("A", ahead);
        assert_eq!(unstarted(&p), Some(50), "a dispatch sent before it still waits");
        assert_eq!(unstarted(&off), None, "not asked for");
        assert_eq!(unstarted(&auto), Some(50), "by default, before A's first byte times it");
        learned(&s, "A", 20.0, 1);
        assert_eq!(unstarted(&auto), None, "by default, not once A is timed and not seen to batch");
        answered_in_batches(&s, "A");
        assert_eq!(unstarted(&auto), Some(50), "A batches");
        assert_eq!(unstarted(&off), None);
        s.inflight.awaiting("B", Waiting { since_ms: 10, tokens: 500 });
        s.inflight.answered("A", ahead);
        s.inflight.awaiting("A", Waiting { since_ms: 50, tokens: 900 });
        assert_eq!(unstarted(&p), None, "only the prefix's own dispatch waits, another engine's is not A's");
        let reported = policy(&s, Fixed::sent(&[("A", 900, 0)]), hold, AdmissionLimits::default());
        s.inflight.awaiting("A", Waiting { since_ms: 0, tokens: 500 });
        assert_eq!(unstarted(&reported), None, "what the engine says it holds");
    }

    /// Two idle engines; A was sent a prefix at 50 ms behind work sent at 40 ms, still unanswered
    /// at 60 ms. A policy with `hold` for each.
    fn prefix_unstarted_at_a(hold: HoldForPrefix) -> (State, CacheAwarePolicy) {
        let s = State::new();
        s.loads(&[("A", native_load(0, 0)), ("B", native_load(0, 0))]);
        let p =
            policy(&s, Fixed::sent(&[("A", 900, 50)]), tuned(|c| c.hold_for_prefix = hold), AdmissionLimits::default());
        s.inflight.set_now(60);
        s.inflight.awaiting("A", Waiting { since_ms: 40, tokens: 500 });
        (s, p)
    }

    #[test]
    fn done_waiting_a_hit_is_none_where_a_batching_engine_has_not_started_on_its_prefix() {
        let done = |p: &CacheAwarePolicy| {
            let request = PickRequest { prefix_wait_over: true, ..prompt(1000) };
            let pick = p.pick(&workers(&["A", "B"]), &request).unwrap();
            (pick.engine.id.clone(), pick.cached_tokens, pick.reason)
        };
        let (s, p) = prefix_unstarted_at_a(HoldForPrefix::Auto);
        answered_in_batches(&s, "A");
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().prefix_unstarted, Some(50), "it may still wait");
        assert_eq!(done(&p), ("B".into(), 0, PickReason::CacheMiss), "at A it would prefill the prefix again");
        let always = policy(
            &s,
            Fixed::sent(&[("A", 900, 50)]),
            tuned(|c| c.hold_for_prefix = HoldForPrefix::Always),
            AdmissionLimits::default(),
        );
        // A serves first come first: its prefix is prefilled before the request, whenever it goes.
        let (fcfs, fcfs_policy) = prefix_unstarted_at_a(HoldForPrefix::Always);
        learned(&fcfs, "A", 20.0, 1);
        assert_eq!(done(&fcfs_policy).0, "A", "a timed engine not seen to batch keeps the hit");
        assert_eq!(done(&always).0, "B", "held always, still prefilled again where A batches");
        // Started on the prefix: a hit like any other.
        s.inflight.answered("A", Waiting { since_ms: 40, tokens: 500 });
        assert_eq!(done(&p), ("A".into(), 900, PickReason::CacheHit));
    }

    #[test]
    fn a_match_too_short_to_be_a_hit_is_not_held_for() {
        let s = State::new();
        let hold = tuned(|c| {
            c.hold_for_prefix = HoldForPrefix::Always;
            c.min_hit_tokens = 64;
        });
        let short = policy(&s, Fixed::sent(&[("A", 40, 50)]), hold.clone(), AdmissionLimits::default());
        let long = policy(&s, Fixed::sent(&[("A", 64, 50)]), hold, AdmissionLimits::default());
        s.inflight.set_now(60);
        s.inflight.awaiting("A", Waiting { since_ms: 40, tokens: 500 });
        let short = pick(&short, &["A"], 1000).unwrap();
        assert_eq!((short.cached_tokens, short.prefix_unstarted), (40, None), "prefilled again at little cost");
        assert_eq!(pick(&long, &["A"], 1000).unwrap().prefix_unstarted, Some(50), "at the limit: held");
    }

    #[test]
    fn engines_of_one_speed_learned_with_noise_still_spread_new_prefixes_by_content() {
        let s = State::new();
        let p = misses_between(&s, "A", "B");
        learned(&s, "A", 8.2, 40);
        learned(&s, "B", 7.8, 40);
        s.inflight.acquire("A", PrefillWork { tokens: 4_096, tokens_per_ms: 1e9, ahead: 0, slot_wait_ms: 0 });
        s.inflight.release("A", 4_096, 5);
        assert_eq!(pick(&p, &["A", "B"], 2000).unwrap().engine.id, "B", "A was given more, though a little faster");
    }

    #[test]
    fn an_unavailable_source_falls_back_distinguishably() {
        let s = State::new();
        let source = Arc::new(Fixed { answer: CacheLookup::Unavailable("down".into()), lookups: AtomicUsize::new(0) });
        let p = policy(&s, source, tuned(|_| {}), AdmissionLimits::default());
        assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().reason, PickReason::CacheUnavailable);
    }

    #[test]
    fn the_miss_fallback_takes_the_exact_minimum_when_k_covers_the_group() {
        let s = State::new();
        s.loads(&[("A", native_load(5, 0)), ("B", native_load(1, 1)), ("C", native_load(3, 0))]);
        let p = policy(&s, Fixed::matches(&[]), tuned(|c| c.min_load_choices = 3), AdmissionLimits::default());
        for _ in 0..10 {
            assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().engine.id, "B");
        }
    }

    #[test]
    fn the_fallback_winner_is_checked_by_the_cache_policy() {
        let s = State::new();
        s.inflight.set("A", 2);
        let p = policy(
            &s,
            Fixed::matches(&[]),
            tuned(|c| c.min_load_choices = 1),
            AdmissionLimits { max_inflight_requests: Some(2), ..Default::default() },
        );
        let err = pick(&p, &["A"], 1000).unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "A".into(), limit: Limit::MaxInflightRequests })
        );
    }

    /// The policy names what its pick is spared: the chosen engine's match, in tokens.
    #[test]
    fn a_pick_carries_the_chosen_engines_cached_tokens() {
        let s = State::new();
        let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 200)]), tuned(|_| {}), AdmissionLimits::default());
        let hit = pick(&p, &["A", "B", "C"], 1000).unwrap();
        assert_eq!((hit.engine.id.as_str(), hit.cached_tokens), ("B", 900));
        let miss = pick(&p, &["A", "D"], 1000).unwrap();
        assert_eq!((miss.reason, miss.cached_tokens), (PickReason::CacheMiss, 0));
        let speculative =
            PrefixHit { engine: "B".into(), matched_tokens: 900, gpu_tokens: 0, ranks: vec![], sent_ms: 0 };
        let answer = CacheLookup::Matches(Cow::Owned(vec![speculative]));
        let source = Arc::new(Fixed { answer, lookups: AtomicUsize::new(0) });
        let p = policy(&s, source, tuned(|_| {}), AdmissionLimits::default());
        let hit = pick(&p, &["A", "B"], 1000).unwrap();
        assert_eq!((hit.engine.id.as_str(), hit.cached_tokens), ("B", 900), "ranked at half, spared whole");
    }

    /// The remote source reads the indexer's answer the request carries, and nothing else.
    #[test]
    fn the_remote_source_reads_the_requests_indexer_answer() {
        use crate::protocol::indexer::IndexerMatch;
        let hits =
            vec![PrefixHit { engine: "A".into(), matched_tokens: 5, gpu_tokens: 5, ranks: Vec::new(), sent_ms: 0 }];
        let answered: crate::protocol::indexer::IndexerAnswer =
            Ok(IndexerMatch { input_tokens: 9, hits: hits.clone(), handle: None });
        let failed: crate::protocol::indexer::IndexerAnswer = Err("late".into());
        let source = RemoteCacheSource;
        let with = |answer| PickRequest { indexer: answer, ..request(Role::Plain) };
        assert_eq!(source.lookup(&with(Some(&answered))), CacheLookup::Matches(Cow::Borrowed(&hits)));
        assert_eq!(source.lookup(&with(Some(&failed))), CacheLookup::Unavailable(Cow::Borrowed("late")));
        assert!(matches!(source.lookup(&with(None)), CacheLookup::Unavailable(_)));
    }
}
