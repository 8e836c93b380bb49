//! Uniform choice among the candidates; the chosen engine is checked once.

use std::sync::Arc;

use super::admission::AdmissionGate;
use super::{Pick, PickError, PickReason, PickRequest, Policy, RandomSource};
use crate::registry::Engine;

#[derive(Debug)]
pub struct RandomPolicy {
    random: Arc<dyn RandomSource>,
    gate: AdmissionGate,
}

impl RandomPolicy {
    pub fn new(random: Arc<dyn RandomSource>, gate: AdmissionGate) -> Self {
        Self { random, gate }
    }
}

impl Policy for RandomPolicy {
    fn pick(&self, engines: &[Arc<Engine>], _request: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.gate.checked_pick(engines, self.random.below(engines.len()), PickReason::Random)
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::collections::HashMap;

    use super::*;
    use crate::config::AdmissionLimits;
    use crate::policies::SeededRandom;
    use crate::registry::Role;
    use crate::testing::*;

    #[test]
    fn every_candidate_is_chosen_about_equally() {
        let s = State::new();
        let p = RandomPolicy::new(Arc::new(SeededRandom::new(7)), s.gate(AdmissionLimits::default()));
        let ws = workers(&["A", "B", "C", "D"]);
        let r = request(Role::Plain);
        let mut counts: HashMap<String, u32> = HashMap::new();
        for _ in 0..4000 {
            *counts.entry(p.pick(&ws, &r).unwrap().engine.id.clone()).or_default() += 1;
        }
        for id in ["A", "B", "C", "D"] {
            let c = counts.get(id).copied().unwrap_or(0);
            assert!((850..1150).contains(&c), "{id}: {c} of 4000");
        }
    }

    #[test]
    fn no_candidates_and_rejection() {
        let s = State::new();
        let p = RandomPolicy::new(
            Arc::new(SeededRandom::new(1)),
            s.gate(AdmissionLimits { max_inflight_requests: Some(0), ..Default::default() }),
        );
        assert!(matches!(p.pick(&[], &request(Role::Plain)), Err(PickError::NoCandidates { .. })));
        assert!(matches!(p.pick(&workers(&["A"]), &request(Role::Plain)), Err(PickError::AdmissionRejected(_))));
    }
}
