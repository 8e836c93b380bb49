//! Admission (design §4): per-engine absolute caps that accept or reject an engine a policy chose.
//! It never ranks, replaces or reserves. Reported metrics are `None` without a fresh complete
//! report, and then the cap fails open; the in-flight count is always known.

use super::{PickError, Rejection};
use crate::config::AdmissionLimits;
use crate::registry::Engine;
use crate::state::load_monitor::EngineLoad;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    MaxRunningRequests,
    MaxWaitingRequests,
    MaxKvTokens,
    MaxPendingPrefillTokens,
    MaxInflightRequests,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::MaxRunningRequests => "max_running_requests",
            Limit::MaxWaitingRequests => "max_waiting_requests",
            Limit::MaxKvTokens => "max_kv_tokens",
            Limit::MaxPendingPrefillTokens => "max_pending_prefill_tokens",
            Limit::MaxInflightRequests => "max_inflight_requests",
        }
    }
}

/// What admission observes of one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineMetrics {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub kv_tokens: Option<u64>,
    pub pending_prefill_tokens: Option<u64>,
    pub inflight: u64,
}

impl EngineMetrics {
    /// From the load record captured for selection (if any) and the live in-flight count.
    pub fn from_load(load: Option<&EngineLoad>, inflight: u64) -> Self {
        Self {
            running: load.and_then(|l| l.running),
            waiting: load.and_then(|l| l.waiting),
            kv_tokens: load.and_then(|l| l.kv_used),
            pending_prefill_tokens: load.and_then(|l| l.waiting_uncached_tokens),
            inflight,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Allow,
    Reject(Limit),
}

/// Acceptance of one engine a policy chose (design §4): `Allow` or `Reject(limit)`.
pub trait EngineAdmission: Send + Sync + std::fmt::Debug {
    fn check(&self, engine: &Engine, metrics: &EngineMetrics) -> Admission;

    /// Whether any check reads engine-reported metrics (lets callers skip reading the table).
    fn needs_reports(&self) -> bool {
        true
    }
}

impl EngineAdmission for AdmissionLimits {
    fn check(&self, _engine: &Engine, m: &EngineMetrics) -> Admission {
        // A cap admits while the metric is below it; an unknown metric is not checked.
        let checks = [
            (Limit::MaxRunningRequests, self.max_running_requests, m.running),
            (Limit::MaxWaitingRequests, self.max_waiting_requests, m.waiting),
            (Limit::MaxKvTokens, self.max_kv_tokens, m.kv_tokens),
            (Limit::MaxPendingPrefillTokens, self.max_pending_prefill_tokens, m.pending_prefill_tokens),
            (Limit::MaxInflightRequests, self.max_inflight_requests, Some(m.inflight)),
        ];
        for (limit, cap, metric) in checks {
            if let (Some(cap), Some(value)) = (cap, metric) {
                if value >= cap {
                    return Admission::Reject(limit);
                }
            }
        }
        Admission::Allow
    }

    fn needs_reports(&self) -> bool {
        self.max_running_requests.is_some()
            || self.max_waiting_requests.is_some()
            || self.max_kv_tokens.is_some()
            || self.max_pending_prefill_tokens.is_some()
    }
}

/// Runs one check and turns a rejection into the policy outcome `AdmissionRejected`.
pub fn admit_or_reject(
    admission: &dyn EngineAdmission,
    engine: &Engine,
    metrics: &EngineMetrics,
) -> Result<(), PickError> {
    match admission.check(engine, metrics) {
        Admission::Allow => Ok(()),
        Admission::Reject(limit) => Err(PickError::AdmissionRejected(Rejection { engine: engine.id.clone(), limit })),
    }
}

/// A policy's admission checker with the state it observes. Policies decide where to call it.
#[derive(Debug, Clone)]
pub struct AdmissionGate {
    pub admission: std::sync::Arc<dyn EngineAdmission>,
    pub load: std::sync::Arc<dyn crate::state::load_monitor::LoadView>,
    pub inflight: std::sync::Arc<dyn crate::state::load_monitor::InflightTable>,
}

impl AdmissionGate {
    /// Checks an engine against the load record already captured for its selection.
    pub fn check_with(&self, engine: &Engine, load: Option<&EngineLoad>) -> Result<(), PickError> {
        let metrics = EngineMetrics::from_load(load, self.inflight.inflight(&engine.id));
        admit_or_reject(self.admission.as_ref(), engine, &metrics)
    }

    /// Checks `ordered` engines in turn against the captured snapshot; the first admitted is the
    /// pick. When every one is rejected, the outcome lists each rejection.
    pub fn first_admitted<'w>(
        &self,
        ordered: impl IntoIterator<Item = &'w std::sync::Arc<Engine>>,
        snapshot: &crate::state::load_monitor::LoadSnapshot,
        reason: super::PickReason,
    ) -> Result<super::Pick, PickError> {
        let mut rejections = Vec::new();
        for worker in ordered {
            match self.check_with(worker, snapshot.get(&worker.id)) {
                Ok(()) => return Ok(super::Pick::new(std::sync::Arc::clone(worker), reason)),
                Err(PickError::AdmissionRejected(r)) => rejections.push(r),
                Err(other) => return Err(other),
            }
        }
        Err(PickError::NoAdmissibleEngine { rejections })
    }

    /// Takes `engines[index]` and checks it once: the rotation and random policies' whole answer.
    pub fn checked_pick(
        &self,
        engines: &[std::sync::Arc<Engine>],
        index: usize,
        reason: super::PickReason,
    ) -> Result<super::Pick, PickError> {
        let worker = engines.get(index).ok_or_else(|| PickError::no_candidates("no candidate at the chosen index"))?;
        self.check(worker)?;
        Ok(super::Pick::new(std::sync::Arc::clone(worker), reason))
    }

    /// Checks an engine chosen without load observations; reads the current report only when a
    /// cap needs one.
    pub fn check(&self, engine: &Engine) -> Result<(), PickError> {
        if self.admission.needs_reports() {
            let snapshot = self.load.snapshot();
            self.check_with(engine, snapshot.get(&engine.id))
        } else {
            self.check_with(engine, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;
    use crate::testing::worker;

    fn check(limits: AdmissionLimits, m: EngineMetrics) -> Admission {
        limits.check(&worker("A"), &m)
    }

    #[test]
    fn default_limits_admit_everything() {
        let m = EngineMetrics {
            running: Some(u64::MAX),
            waiting: Some(u64::MAX),
            kv_tokens: Some(u64::MAX),
            pending_prefill_tokens: Some(u64::MAX),
            inflight: u64::MAX,
        };
        assert_eq!(check(AdmissionLimits::default(), m), Admission::Allow);
    }

    #[test]
    fn a_cap_admits_while_the_metric_is_below_it() {
        let limits = AdmissionLimits { max_running_requests: Some(4), ..Default::default() };
        assert_eq!(check(limits, EngineMetrics { running: Some(3), ..Default::default() }), Admission::Allow);
        assert_eq!(
            check(limits, EngineMetrics { running: Some(4), ..Default::default() }),
            Admission::Reject(Limit::MaxRunningRequests)
        );
    }

    #[test]
    fn each_cap_checks_its_own_metric() {
        let cases = [
            (
                AdmissionLimits { max_waiting_requests: Some(1), ..Default::default() },
                EngineMetrics { waiting: Some(1), ..Default::default() },
                Limit::MaxWaitingRequests,
            ),
            (
                AdmissionLimits { max_kv_tokens: Some(10), ..Default::default() },
                EngineMetrics { kv_tokens: Some(11), ..Default::default() },
                Limit::MaxKvTokens,
            ),
            (
                AdmissionLimits { max_pending_prefill_tokens: Some(5), ..Default::default() },
                EngineMetrics { pending_prefill_tokens: Some(5), ..Default::default() },
                Limit::MaxPendingPrefillTokens,
            ),
            (
                AdmissionLimits { max_inflight_requests: Some(2), ..Default::default() },
                EngineMetrics { inflight: 2, ..Default::default() },
                Limit::MaxInflightRequests,
            ),
        ];
        for (limits, metrics, limit) in cases {
            assert_eq!(check(limits, metrics), Admission::Reject(limit));
        }
    }

    #[test]
    fn unknown_reported_metrics_fail_open() {
        let limits = AdmissionLimits {
            max_running_requests: Some(1),
            max_waiting_requests: Some(1),
            max_kv_tokens: Some(1),
            max_pending_prefill_tokens: Some(1),
            max_inflight_requests: None,
        };
        assert_eq!(check(limits, EngineMetrics::default()), Admission::Allow);
    }

    #[test]
    fn in_flight_is_always_known() {
        let limits = AdmissionLimits { max_inflight_requests: Some(0), ..Default::default() };
        assert_eq!(check(limits, EngineMetrics::default()), Admission::Reject(Limit::MaxInflightRequests));
    }

    #[test]
    fn metrics_from_a_missing_report_are_unknown_not_zero() {
        let m = EngineMetrics::from_load(None, 3);
        assert_eq!(m, EngineMetrics { inflight: 3, ..Default::default() });
    }
}
