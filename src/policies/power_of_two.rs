//! Power-of-two choices (design §4): sample two distinct candidates uniformly, keep the one under
//! less stage pressure, then check exactly that engine once, with the load record captured for
//! selection. A rejection is final for this attempt: no resample, no other engine, no fallback.

use std::cmp::Ordering;
use std::sync::Arc;

use super::admission::AdmissionGate;
use super::pressure::{compare_for_stage, PREFILL_QUANTUM_TOKENS};
use super::{Pick, PickError, PickReason, PickRequest, Policy, RandomSource};
use crate::registry::{Engine, Role};
use crate::state::load_monitor::{EngineLoad, LocalLoad};

#[derive(Debug)]
pub struct PowerOfTwoPolicy {
    random: Arc<dyn RandomSource>,
    gate: AdmissionGate,
}

impl PowerOfTwoPolicy {
    pub fn new(random: Arc<dyn RandomSource>, gate: AdmissionGate) -> Self {
        Self { random, gate }
    }

    /// Two distinct uniform indices in `0..n` (`n ≥ 2`), in sampling order.
    fn sample_pair(&self, n: usize) -> (usize, usize) {
        let first = self.random.below(n);
        let mut second = self.random.below(n - 1);
        if second >= first {
            second += 1;
        }
        (first, second)
    }

    fn choose(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        let snapshot = self.gate.load.snapshot();
        let (chosen, reason) = match engines {
            [] => return Err(PickError::no_candidates("power_of_two has no candidates")),
            [only] => (only, PickReason::SingleCandidate),
            _ => {
                let (i, j) = self.sample_pair(engines.len());
                let (a, b) = match (engines.get(i), engines.get(j)) {
                    (Some(a), Some(b)) => (a, b),
                    _ => return Err(PickError::no_candidates("sample out of range")),
                };
                let (local_a, local_b) = (self.gate.inflight.local_load(&a.id), self.gate.inflight.local_load(&b.id));
                let by_inflight = |reason| match local_a.inflight.cmp(&local_b.inflight) {
                    Ordering::Greater => (b, reason),
                    Ordering::Less => (a, reason),
                    Ordering::Equal => (a, PickReason::FirstSampled),
                };
                let prefills = request.stage != Role::Decode;
                // Prefill work the engine does not report is the router's own estimate of it.
                let estimated = |load: &EngineLoad, local: &LocalLoad| {
                    let mut load = load.clone();
                    if prefills && load.waiting_uncached_tokens.is_none() {
                        load.waiting_uncached_tokens = Some(local.pending_prefill_tokens);
                    }
                    load
                };
                let level = |local: &LocalLoad| local.pending_prefill_tokens / PREFILL_QUANTUM_TOKENS;
                match (snapshot.get(&a.id), snapshot.get(&b.id)) {
                    (Some(la), Some(lb)) if la.is_native_with_capacity() && lb.is_native_with_capacity() => {
                        match compare_for_stage(request.stage, &estimated(la, &local_a), &estimated(lb, &local_b)) {
                            Ordering::Less => (a, PickReason::LowerPressure),
                            Ordering::Greater => (b, PickReason::LowerPressure),
                            Ordering::Equal => by_inflight(PickReason::InflightTieBreak),
                        }
                    }
                    // Without fresh native reports on both, compare what the router itself knows:
                    // the prefill it sent and has not seen drain, then its requests in flight.
                    _ if prefills && level(&local_a) != level(&local_b) => {
                        (if level(&local_a) < level(&local_b) { a } else { b }, PickReason::RouterLocalLoad)
                    }
                    _ => match by_inflight(PickReason::RouterLocalLoad) {
                        (w, PickReason::FirstSampled) => (w, PickReason::RouterLocalLoad),
                        other => other,
                    },
                }
            }
        };
        self.gate.check_with(chosen, snapshot.get(&chosen.id))?;
        Ok(Pick::new(Arc::clone(chosen), reason))
    }
}

impl Policy for PowerOfTwoPolicy {
    fn pick(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.choose(engines, request)
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::collections::HashSet;
    use std::sync::Mutex;

    use super::*;
    use crate::config::AdmissionLimits;
    use crate::policies::{Limit, Rejection, SeededRandom};
    use crate::registry::Role;
    use crate::state::load_monitor::{InflightTable, PrefillWork};
    use crate::testing::*;

    /// Replays fixed draws so a test decides which two engines are sampled.
    #[derive(Debug)]
    struct Draws(Mutex<Vec<u64>>);

    impl Draws {
        /// Draws that make the policy sample engine `first`, then engine `second` (indices).
        fn picking(n: usize, first: usize, second: usize) -> Arc<Self> {
            let to_draw = |i: usize, n: usize| (((i as u128) << 64) / n as u128 + 1) as u64;
            let second_rank = if second > first { second - 1 } else { second };
            Arc::new(Self(Mutex::new(vec![to_draw(second_rank, n - 1), to_draw(first, n)])))
        }
    }

    impl RandomSource for Draws {
        fn next_u64(&self) -> u64 {
            self.0.lock().unwrap().pop().expect("no draws left")
        }
    }

    fn p2c(random: Arc<dyn RandomSource>, s: &State, limits: AdmissionLimits) -> PowerOfTwoPolicy {
        PowerOfTwoPolicy::new(random, s.gate(limits))
    }

    #[test]
    fn a_single_candidate_is_taken_directly() {
        let s = State::new();
        let p = p2c(Arc::new(Draws(Mutex::new(vec![]))), &s, AdmissionLimits::default());
        let pick = p.pick(&workers(&["A"]), &request(Role::Plain)).unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("A", PickReason::SingleCandidate));
    }

    #[test]
    fn a_single_candidate_still_has_its_load_read_for_admission() {
        let s = State::new();
        s.loads(&[("A", native_load(8, 0))]);
        let p = p2c(
            Arc::new(Draws(Mutex::new(vec![]))),
            &s,
            AdmissionLimits { max_running_requests: Some(8), ..Default::default() },
        );
        let err = p.pick(&workers(&["A"]), &request(Role::Plain)).unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "A".into(), limit: Limit::MaxRunningRequests })
        );
    }

    #[test]
    fn no_candidates_returns_no_candidates_without_admission() {
        let s = State::new();
        let p = p2c(
            Arc::new(SeededRandom::new(1)),
            &s,
            AdmissionLimits { max_inflight_requests: Some(0), ..Default::default() },
        );
        assert!(matches!(p.pick(&[], &request(Role::Plain)), Err(PickError::NoCandidates { .. })));
    }

    #[test]
    fn two_distinct_candidates_are_sampled_uniformly() {
        let s = State::new();
        let p = p2c(Arc::new(SeededRandom::new(42)), &s, AdmissionLimits::default());
        let mut pairs = HashSet::new();
        let mut firsts = [0u32; 4];
        for _ in 0..4000 {
            let (i, j) = p.sample_pair(4);
            assert_ne!(i, j);
            pairs.insert((i, j));
            firsts[i] += 1;
        }
        assert_eq!(pairs.len(), 12, "every ordered pair occurs");
        assert!(firsts.iter().all(|c| (850..1150).contains(c)), "{firsts:?}");
    }

    #[test]
    fn plain_prefers_fewer_waiting_requests() {
        let s = State::new();
        s.loads(&[("A", native_load(0, 9)), ("B", native_load(5, 1))]);
        let p = p2c(Draws::picking(3, 0, 1), &s, AdmissionLimits::default());
        let pick = p.pick(&workers(&["A", "B", "C"]), &request(Role::Plain)).unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("B", PickReason::LowerPressure));
    }

    #[test]
    fn decode_uses_the_decode_comparison() {
        // Prefill order would prefer A (less waiting uncached work); decode looks at waiting first.
        let s = State::new();
        let mut a = native_load(0, 3);
        a.waiting_uncached_tokens = Some(0);
        let mut b = native_load(0, 1);
        b.waiting_uncached_tokens = Some(100);
        s.loads(&[("A", a), ("B", b)]);
        let ws = workers(&["A", "B"]);
        let prefill =
            p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default()).pick(&ws, &request(Role::Prefill)).unwrap();
        let decode =
            p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default()).pick(&ws, &request(Role::Decode)).unwrap();
        assert_eq!((prefill.engine.id.as_str(), decode.engine.id.as_str()), ("A", "B"));
    }

    #[test]
    fn reported_ties_are_broken_by_router_local_active_requests() {
        let s = State::new();
        s.loads(&[("A", native_load(2, 2)), ("B", native_load(2, 2))]);
        s.inflight.set("A", 3);
        s.inflight.set("B", 1);
        let pick = p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("B", PickReason::InflightTieBreak));
    }

    #[test]
    fn a_complete_tie_keeps_the_first_sampled_engine() {
        let s = State::new();
        s.loads(&[("A", native_load(2, 2)), ("B", native_load(2, 2))]);
        let pick = p2c(Draws::picking(2, 1, 0), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("B", PickReason::FirstSampled));
    }

    #[test]
    fn unreported_prefill_queues_are_compared_by_the_routers_estimate() {
        let s = State::new();
        // Equal native reports without num_waiting_uncached_tokens; A was sent 3,000 tokens.
        s.loads(&[("A", native_load(2, 0)), ("B", native_load(2, 0))]);
        s.inflight.acquire("A", PrefillWork { tokens: 3_000, tokens_per_ms: 1.0, ahead: 0, slot_wait_ms: 0 });
        let plain = p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!((plain.engine.id.as_str(), plain.reason), ("B", PickReason::LowerPressure));
        // A reported queue is the engine's word, not replaced by the estimate.
        let mut a = native_load(2, 0);
        a.waiting_uncached_tokens = Some(0);
        let mut b = native_load(2, 0);
        b.waiting_uncached_tokens = Some(10);
        s.loads(&[("A", a), ("B", b)]);
        let reported = p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!(reported.engine.id, "A");
    }

    #[test]
    fn without_reports_the_prefill_sent_counts_before_requests_in_flight_and_not_for_decode() {
        let s = State::new();
        s.inflight.acquire("A", PrefillWork { tokens: 3_000, tokens_per_ms: 1.0, ahead: 0, slot_wait_ms: 0 });
        s.inflight.set("B", 4);
        let pick = |stage| {
            p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
                .pick(&workers(&["A", "B"]), &request(stage))
                .unwrap()
                .engine
                .id
                .clone()
        };
        assert_eq!(pick(Role::Plain), "B", "3,000 tokens still to prefill outweigh 4 requests in flight");
        assert_eq!(pick(Role::Decode), "A", "decode compares requests only");
    }

    #[test]
    fn router_local_counts_decide_when_either_engine_lacks_a_fresh_native_report() {
        let s = State::new();
        // B reports far less pressure, but A has no report: both are compared by in-flight.
        s.loads(&[("B", native_load(0, 0))]);
        s.inflight.set("A", 1);
        s.inflight.set("B", 5);
        let pick = p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("A", PickReason::RouterLocalLoad));

        // A basic report is fresh but not native: same rule.
        s.loads(&[("A", basic_load(50, 50)), ("B", native_load(0, 0))]);
        let pick = p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits::default())
            .pick(&workers(&["A", "B"]), &request(Role::Plain))
            .unwrap();
        assert_eq!(pick.engine.id, "A");
    }

    #[test]
    fn exactly_one_admission_check_on_the_chosen_engine_and_no_resample() {
        let s = State::new();
        s.loads(&[("A", native_load(9, 9)), ("B", native_load(1, 0))]);
        // B wins the comparison but is at its cap: the attempt fails even though A is admissible.
        let p =
            p2c(Draws::picking(2, 0, 1), &s, AdmissionLimits { max_running_requests: Some(1), ..Default::default() });
        let err = p.pick(&workers(&["A", "B"]), &request(Role::Plain)).unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "B".into(), limit: Limit::MaxRunningRequests })
        );
    }

    #[test]
    fn admission_uses_the_record_captured_for_selection() {
        #[derive(Debug)]
        struct Counting(std::sync::atomic::AtomicUsize, Arc<crate::state::load_monitor::StaticLoad>);
        impl crate::state::load_monitor::LoadView for Counting {
            fn snapshot(&self) -> Arc<crate::state::load_monitor::LoadSnapshot> {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                self.1.snapshot()
            }
        }
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(2, 0))]);
        let counting = Arc::new(Counting(Default::default(), s.load.clone()));
        let gate = AdmissionGate {
            admission: Arc::new(AdmissionLimits { max_running_requests: Some(5), ..Default::default() }),
            load: counting.clone(),
            inflight: s.inflight.clone(),
        };
        let p = PowerOfTwoPolicy::new(Draws::picking(2, 0, 1), gate);
        p.pick(&workers(&["A", "B"]), &request(Role::Plain)).unwrap();
        assert_eq!(counting.0.load(std::sync::atomic::Ordering::SeqCst), 1, "one snapshot for selection and admission");
    }
}
