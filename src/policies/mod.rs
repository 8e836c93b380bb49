//! The policy contract (design §4): one synchronous, object-safe `pick` over an exact candidate
//! set. Policies own their state handles; requests carry only facts, the indexer's answer among
//! them: anything a policy waits for is asked before selection starts.

pub mod admission;
pub mod binding;
pub mod cache_aware;
mod load_based;
mod power_of_two;
pub mod pressure;
mod random;
mod round_robin;
mod session_aware;
mod sticky;

use std::sync::{Arc, Mutex};

pub use admission::{Admission, EngineAdmission, EngineMetrics, Limit};
pub use binding::BindingPolicy;
pub use load_based::LoadBasedPolicy;
pub use power_of_two::PowerOfTwoPolicy;
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
pub use random::RandomPolicy;
pub use round_robin::{MemoryCursor, RoundRobinCursor, RoundRobinPolicy, SharedCursor};
pub use session_aware::SessionAwarePolicy;
pub use sticky::StickyPolicy;

use crate::host::Host;
use crate::protocol::indexer::IndexerAnswer;
use crate::registry::Engine;
use crate::registry::Role;

/// Facts of one group call: no body, no state handles, no observations.
#[derive(Debug, Clone, Copy)]
pub struct PickRequest<'a> {
    pub model: &'a str,
    pub stage: Role,
    pub bucket_id: &'a str,
    pub input_tokens: u64,
    pub expected_peak_tokens: Option<u64>,
    pub token_ids: Option<&'a [u32]>,
    /// The prompt text the prefix index matches (its bytes stand in for tokens).
    pub prompt_text: Option<&'a str>,
    /// The indexer's answer, when the request asked it (spec §7).
    pub indexer: Option<&'a IndexerAnswer>,
    pub session_key: Option<&'a str>,
    pub routing_key: Option<&'a str>,
    /// The request may no longer wait at the router for an engine to start on its prefix: a
    /// prefix not started on an engine that may batch is prefilled again with it there.
    pub prefix_wait_over: bool,
}

/// Why a policy chose its engine, for stats and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickReason {
    Rotation,
    Random,
    SingleCandidate,
    LowerPressure,
    /// Both sampled engines reported the same pressure; router-local in-flight decided.
    InflightTieBreak,
    /// A complete tie keeps the first sampled engine.
    FirstSampled,
    /// At least one sampled engine had no fresh native report; router-local counts decided.
    RouterLocalLoad,
    LeastLoad,
    /// An admitted session or routing-key binding was reused.
    BoundReuse,
    /// The fallback chose the engine and it is now bound.
    NewBinding,
    /// No key: the fallback chose, and nothing was bound.
    NoKey,
    /// An engine holding the prompt's prefix was chosen.
    CacheHit,
    /// Every holder was past the soft queue gate; the longest match was kept.
    SaturationPin,
    /// The prefix index answered: nobody holds enough of the prompt.
    CacheMiss,
    /// The prefix index could not answer; load decided.
    CacheUnavailable,
    /// Holders were under too much pressure; load decided.
    PressureGuard,
}

impl PickReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::Rotation => "rotation",
            PickReason::Random => "random",
            PickReason::SingleCandidate => "single_candidate",
            PickReason::LowerPressure => "lower_pressure",
            PickReason::InflightTieBreak => "inflight_tie_break",
            PickReason::FirstSampled => "first_sampled",
            PickReason::RouterLocalLoad => "router_local_load",
            PickReason::LeastLoad => "least_load",
            PickReason::BoundReuse => "bound_reuse",
            PickReason::NewBinding => "new_binding",
            PickReason::NoKey => "no_key",
            PickReason::CacheHit => "cache_hit",
            PickReason::SaturationPin => "saturation_pin",
            PickReason::CacheMiss => "cache_miss",
            PickReason::CacheUnavailable => "cache_unavailable",
            PickReason::PressureGuard => "pressure_guard",
        }
    }
}

/// One engine from the supplied set that passed admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub engine: Arc<Engine>,
    pub reason: PickReason,
    /// The prompt's tokens the engine holds by the policy's prefix lookup (none without one): the
    /// prefill work it is spared.
    pub cached_tokens: u64,
    /// When the router sent the engine the cached prefix (its host clock, ms), if the engine has
    /// not started on that dispatch yet: work sent before it is still unanswered there. SGLang
    /// matches its cache when it schedules a request, so one it schedules in the same batch as
    /// the dispatch that brings the prefix prefills the prefix again.
    pub prefix_unstarted: Option<u64>,
}

impl Pick {
    pub fn new(engine: Arc<Engine>, reason: PickReason) -> Self {
        Self { engine, reason, cached_tokens: 0, prefix_unstarted: None }
    }
}

/// An engine turned away by an admission cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub engine: String,
    pub limit: Limit,
}

/// Why a policy, a group or a bucket could not pick (design §4 "Outcome"). The first three advance
/// the bucket loop; the last three stop it with a 500.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// No eligible member, or a policy selection miss.
    #[error("no candidates: {reason}")]
    NoCandidates { reason: String },
    /// The policy tried every candidate; each was rejected.
    #[error("no admissible engine ({} rejected)", .rejections.len())]
    NoAdmissibleEngine { rejections: Vec<Rejection> },
    /// The chosen engine failed after-selection admission.
    #[error("{} rejected by {}", .0.engine, .0.limit.as_str())]
    AdmissionRejected(Rejection),
    /// The request's facts cannot be acted on (e.g. a peak below the input).
    #[error("invalid signal: {0}")]
    InvalidSignal(String),
    /// The policy's configuration cannot serve this request.
    #[error("invalid configuration: {0}")]
    InvalidConfiguration(String),
    /// The policy answered with an engine that is not one of its candidates.
    #[error("policy returned `{worker}`, which is not one of its candidates")]
    OutsideCandidates { worker: String },
}

impl PickError {
    pub fn no_candidates(reason: impl Into<String>) -> Self {
        PickError::NoCandidates { reason: reason.into() }
    }

    /// The admission rejections this outcome carries (none for other outcomes).
    pub fn rejections(&self) -> &[Rejection] {
        match self {
            PickError::AdmissionRejected(r) => std::slice::from_ref(r),
            PickError::NoAdmissibleEngine { rejections } => rejections,
            _ => &[],
        }
    }
}

/// A selection strategy for one role group (design §4). One instance per group, reused across
/// requests and logical across VMs: whatever state it keeps lives behind its own handles.
pub trait Policy: Send + Sync + std::fmt::Debug {
    /// Chooses one engine of `engines` (the group's exact candidates, sorted by id, never empty
    /// when called by [`crate::buckets::EngineGroup::pick`]) for `request`, and checks admission
    /// where its algorithm says. Returns the engine and why, or the outcome that tells the bucket
    /// loop what to do next: `NoCandidates`, `NoAdmissibleEngine` and `AdmissionRejected` advance to
    /// the next bucket; the others stop routing.
    fn pick(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError>;

    /// Where the request goes if `failed`, which this policy picked, refuses it (spec §8, retry):
    /// this policy's choice among `engines` (the candidates without `failed`), admitted, and
    /// leaving no trace a pick would (no rotation step, no binding). `None`: no admitted engine.
    /// Policies whose pick changes nothing but counters use their pick.
    fn fallback(&self, engines: &[Arc<Engine>], failed: &Engine, request: &PickRequest<'_>) -> Option<Arc<Engine>> {
        let _ = failed;
        self.pick(engines, request).ok().map(|p| p.engine)
    }
}

/// Where policies draw randomness from.
pub trait RandomSource: Send + Sync + std::fmt::Debug {
    fn next_u64(&self) -> u64;

    /// Uniform in `0..n` (`n > 0`), by multiply-shift so small ranges are not skewed by modulo.
    fn below(&self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// A small seeded PRNG; tests pin its seed, the filter seeds it from the host.
#[derive(Debug)]
pub struct SeededRandom(Mutex<Xoshiro256PlusPlus>);

impl SeededRandom {
    pub fn new(seed: u64) -> Self {
        Self(Mutex::new(Xoshiro256PlusPlus::seed_from_u64(seed)))
    }

    pub fn from_host(host: &dyn Host) -> Self {
        Self::new(host.random_u64())
    }
}

impl RandomSource for SeededRandom {
    fn next_u64(&self) -> u64 {
        match self.0.lock() {
            Ok(mut rng) => rng.next_u64(),
            Err(poisoned) => poisoned.into_inner().next_u64(),
        }
    }
}
