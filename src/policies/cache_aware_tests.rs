use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;
use crate::config::{AdmissionLimits, PressureGuard};
use crate::policies::{Limit, Rejection, SeededRandom};
use crate::registry::Role;
use crate::state::kv_events::Tier;
use crate::testing::*;

/// A source with fixed answers that counts lookups.
#[derive(Debug)]
struct Fixed {
    answer: CacheLookup,
    lookups: AtomicUsize,
}

impl Fixed {
    fn matches(m: &[(&str, u64)]) -> Arc<Self> {
        let matches = m
            .iter()
            .map(|(w, tokens)| PrefixMatch { worker: w.to_string(), matched_bytes: tokens * 4, tier: Tier::Gpu })
            .collect();
        Arc::new(Self { answer: CacheLookup::Matches(matches), lookups: AtomicUsize::new(0) })
    }
}

impl CacheSource for Fixed {
    fn lookup<'a>(&'a self, _: &'a str, _: &'a str) -> BoxFuture<'a, CacheLookup> {
        self.lookups.fetch_add(1, Ordering::SeqCst);
        Box::pin(std::future::ready(self.answer.clone()))
    }
}

fn policy(state: &State, source: Arc<Fixed>, config: CacheAwareConfig, limits: AdmissionLimits) -> CacheAwarePolicy {
    CacheAwarePolicy::new(config, source, state.gate(limits), Arc::new(SeededRandom::new(3)), 4)
}

fn tuned(f: impl FnOnce(&mut CacheAwareConfig)) -> CacheAwareConfig {
    let mut c = CacheAwareConfig { min_hit_tokens: 100, ..CacheAwareConfig::default() };
    f(&mut c);
    c
}

fn prompt(input_tokens: u64) -> PickRequest<'static> {
    PickRequest { input_tokens, prompt_text: Some("the prompt"), ..request(Role::Plain) }
}

fn pick(p: &CacheAwarePolicy, ids: &[&str], input: u64) -> Result<Pick, PickError> {
    now(p.pick(&workers(ids), &prompt(input)))
}

#[test]
fn the_engine_holding_the_prefix_is_chosen() {
    let s = State::new();
    let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 200)]), tuned(|_| {}), AdmissionLimits::default());
    let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
    assert_eq!((r.worker.id.as_str(), r.reason), ("B", PickReason::CacheHit));
}

#[test]
fn the_default_minimum_hit_is_1024_tokens() {
    assert_eq!(CacheAwareConfig::default().min_hit_tokens, 1024);
    assert_eq!(CacheAwareConfig::default().min_load_choices, 2);
    let s = State::new();
    let p = policy(&s, Fixed::matches(&[("B", 1023)]), CacheAwareConfig::default(), AdmissionLimits::default());
    assert_eq!(pick(&p, &["A", "B"], 5000).unwrap().reason, PickReason::CacheMiss);
    let p = policy(&s, Fixed::matches(&[("B", 1024)]), CacheAwareConfig::default(), AdmissionLimits::default());
    assert_eq!(pick(&p, &["A", "B"], 5000).unwrap().worker.id, "B");
}

#[test]
fn the_optional_ratio_gate_applies_too() {
    let s = State::new();
    let p =
        policy(&s, Fixed::matches(&[("B", 300)]), tuned(|c| c.min_hit_ratio = Some(0.5)), AdmissionLimits::default());
    assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().reason, PickReason::CacheMiss, "30 % < 50 %");
    assert_eq!(pick(&p, &["A", "B"], 500).unwrap().worker.id, "B", "60 % passes");
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
            rejections: vec![Rejection { worker: "B".into(), limit: Limit::MaxInflightRequests }]
        }
    );
    let p = policy(&s, Fixed::matches(&[("B", 900), ("C", 800)]), tuned(|c| c.min_candidates = 2), limits);
    assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().worker.id, "C", "the next bounded holder is checked");
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
    assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().worker.id, "C");
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
    assert_eq!((r.worker.id.as_str(), r.reason), ("B", PickReason::SaturationPin));
    let p = policy(&s, Fixed::matches(&[("B", 900)]), cfg(Some(0.95)), AdmissionLimits::default());
    let r = pick(&p, &["A", "B", "C"], 1000).unwrap();
    assert_eq!((r.worker.id.as_str(), r.reason), ("C", PickReason::CacheMiss), "the fallback prefers the open engine");
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
    busy.waiting_uncached_tokens = Some(2000);
    s.loads(&[("B", busy), ("C", native_load(0, 0))]);
    // B: 1000 - 900 + 2000 queued = 2100 uncached; C: 1000 - 500 = 500.
    let p = policy(
        &s,
        Fixed::matches(&[("B", 900), ("C", 500)]),
        tuned(|c| c.min_candidates = 2),
        AdmissionLimits::default(),
    );
    assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().worker.id, "C");
    let p = policy(
        &s,
        Fixed::matches(&[("B", 900), ("C", 500)]),
        tuned(|c| {
            c.min_candidates = 2;
            c.switch_margin_tokens = 1600;
        }),
        AdmissionLimits::default(),
    );
    assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().worker.id, "B", "1,600 saved is not more than the margin");
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
    assert_eq!((r.worker.id.as_str(), r.reason), ("A", PickReason::PressureGuard));
    s.loads(&[("A", native_load(1, 0)), ("B", native_load(1, 10))]);
    assert_eq!(pick(&p, &["A", "B"], 1000).unwrap().worker.id, "B", "within the guard");
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
        assert_eq!(pick(&p, &["A", "B", "C"], 1000).unwrap().worker.id, "B");
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
    assert_eq!(err, PickError::AdmissionRejected(Rejection { worker: "A".into(), limit: Limit::MaxInflightRequests }));
}

#[test]
fn one_lookup_per_request_across_bucket_attempts() {
    let s = State::new();
    let source = Fixed::matches(&[("B", 900)]);
    let p1 = policy(&s, Arc::clone(&source), tuned(|_| {}), AdmissionLimits::default());
    let p2 = policy(&s, Arc::clone(&source), tuned(|_| {}), AdmissionLimits::default());
    let memo = PrefixMemo::default();
    let r = PickRequest { prefix_memo: Some(&memo), ..prompt(1000) };
    // Two groups (say, two buckets' prefill groups) with different candidates share one lookup,
    // and each still filters to its own candidates.
    assert_eq!(now(p1.pick(&workers(&["A", "B"]), &r)).unwrap().worker.id, "B");
    assert_eq!(now(p2.pick(&workers(&["C", "D"]), &r)).unwrap().reason, PickReason::CacheMiss);
    assert_eq!(source.lookups.load(Ordering::SeqCst), 1);
}
