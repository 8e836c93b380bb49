//! Least load (`load_based`, spec §6): load = reported running + waiting plus the dispatches made
//! since that report; without a fresh report, router-local in-flight alone. Ties by in-flight,
//! then id. Engines are checked in load order; the first admitted wins, and when every one is
//! rejected the outcome lists them all.

use std::sync::Arc;

use super::admission::AdmissionGate;
use super::{Pick, PickError, PickReason, PickRequest, Policy};
use crate::registry::Engine;

#[derive(Debug)]
pub struct LoadBasedPolicy {
    gate: AdmissionGate,
}

impl LoadBasedPolicy {
    pub fn new(gate: AdmissionGate) -> Self {
        Self { gate }
    }

    fn choose(&self, engines: &[Arc<Engine>]) -> Result<Pick, PickError> {
        let snapshot = self.gate.load.snapshot();
        let inflight = &self.gate.inflight;
        let mut ranked: Vec<(u64, u64, &Arc<Engine>)> = engines
            .iter()
            .map(|w| {
                // One read of the in-memory table per engine: in-flight and the dispatch total together.
                let counts = inflight.local_load(&w.id);
                let local = counts.inflight;
                let load = match snapshot.get(&w.id) {
                    Some(report) => match (report.running, report.waiting) {
                        (Some(r), Some(q)) => {
                            let since = counts.sent().since(report.sent_at_report).dispatches;
                            r.saturating_add(q).saturating_add(since)
                        }
                        _ => local,
                    },
                    None => local,
                };
                (load, local, w)
            })
            .collect();
        // Candidates arrive sorted by id, so the first minimum and the stable sort both end ties
        // on id order. The common case (the least loaded engine is admitted) needs no sort.
        let key = |(load, local, _): &(u64, u64, &Arc<Engine>)| (*load, *local);
        let Some(best) = ranked.iter().min_by_key(|r| key(r)).map(|r| r.2) else {
            return Err(PickError::no_candidates("load_based has no candidates"));
        };
        match self.gate.check_with(best, snapshot.get(&best.id)) {
            Ok(()) => return Ok(Pick::new(Arc::clone(best), PickReason::LeastLoad)),
            Err(PickError::AdmissionRejected(_)) => {}
            Err(other) => return Err(other),
        }
        ranked.sort_by_key(key);
        self.gate.first_admitted(ranked.into_iter().map(|(_, _, w)| w), &snapshot, PickReason::LeastLoad)
    }
}

impl Policy for LoadBasedPolicy {
    fn pick(&self, engines: &[Arc<Engine>], _request: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.choose(engines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdmissionLimits;
    use crate::policies::{Limit, Rejection};
    use crate::registry::Role;
    use crate::state::load_monitor::{InflightTable, PrefillWork};
    use crate::testing::test;
    use crate::testing::*;

    fn pick(s: &State, limits: AdmissionLimits, ids: &[&str]) -> Result<Pick, PickError> {
        LoadBasedPolicy::new(s.gate(limits)).pick(&workers(ids), &request(Role::Plain))
    }

    #[test]
    fn reported_running_plus_waiting_decides() {
        let s = State::new();
        s.loads(&[("A", native_load(3, 3)), ("B", native_load(4, 1)), ("C", basic_load(1, 9))]);
        assert_eq!(pick(&s, AdmissionLimits::default(), &["A", "B", "C"]).unwrap().engine.id, "B");
    }

    #[test]
    fn dispatches_since_the_report_are_added() {
        let s = State::new();
        let mut a = native_load(1, 0);
        a.sent_at_report.dispatches = 10;
        s.loads(&[("A", a), ("B", native_load(3, 0))]);
        for _ in 0..13 {
            s.inflight.acquire("A", PrefillWork::NONE);
        }
        for _ in 0..13 {
            s.inflight.release("A", 0, 0);
        }
        // A: 1 reported + 3 sent since the report = 4 > B's 3.
        assert_eq!(pick(&s, AdmissionLimits::default(), &["A", "B"]).unwrap().engine.id, "B");
    }

    #[test]
    fn without_a_fresh_report_router_local_in_flight_is_the_load() {
        let s = State::new();
        s.inflight.set("A", 5);
        s.inflight.set("B", 2);
        assert_eq!(pick(&s, AdmissionLimits::default(), &["A", "B"]).unwrap().engine.id, "B");
    }

    #[test]
    fn ties_go_to_fewer_in_flight_then_lower_id() {
        let s = State::new();
        s.loads(&[("A", native_load(2, 0)), ("B", native_load(2, 0)), ("C", native_load(2, 0))]);
        s.inflight.set("A", 1);
        assert_eq!(pick(&s, AdmissionLimits::default(), &["A", "B", "C"]).unwrap().engine.id, "B");
        s.inflight.set("B", 1);
        s.inflight.set("C", 1);
        assert_eq!(pick(&s, AdmissionLimits::default(), &["A", "B", "C"]).unwrap().engine.id, "A");
    }

    #[test]
    fn rejected_engines_are_skipped_and_exhaustion_lists_every_rejection() {
        let s = State::new();
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(5, 0))]);
        let limits =
            AdmissionLimits { max_running_requests: Some(5), max_inflight_requests: Some(1), ..Default::default() };
        s.inflight.set("A", 1);
        assert_eq!(
            pick(&s, limits, &["A", "B"]).unwrap_err(),
            PickError::NoAdmissibleEngine {
                rejections: vec![
                    Rejection { engine: "A".into(), limit: Limit::MaxInflightRequests },
                    Rejection { engine: "B".into(), limit: Limit::MaxRunningRequests },
                ]
            }
        );
        s.loads(&[("A", native_load(1, 0)), ("B", native_load(4, 0))]);
        assert_eq!(pick(&s, limits, &["A", "B"]).unwrap().engine.id, "B");
    }
}
