//! Engine health: the service's checker state machine and the table it publishes. A worker is
//! healthy until its first failed checks say otherwise.

use serde::{Deserialize, Serialize};

use super::schedule::PollSchedule;
use crate::registry::Engine;

/// What the service publishes and every filter VM reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthTable {
    pub unhealthy: Vec<String>,
    /// Every worker the service checks. A filter whose configuration names another (a filter-only
    /// update) must not route to it: nobody would notice it failing.
    #[serde(default)]
    pub monitored: Vec<String>,
    /// When the service published this table. It republishes every check interval, flips or not,
    /// so a table that stops moving means the service stopped, and its verdicts are unknown.
    #[serde(default)]
    pub published_ms: u64,
}

/// How long a published health table stands: three check intervals without a new one and the
/// service is taken to be gone.
pub fn stale_after_ms(interval_ms: u64) -> u64 {
    interval_ms.saturating_mul(3)
}

#[derive(Debug, Clone)]
struct EngineHealth {
    id: String,
    healthy: bool,
    consecutive_ok: u32,
    consecutive_fail: u32,
}

/// How often a worker is checked and how many checks in a row flip its health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthThresholds {
    pub interval_ms: u64,
    pub failure_threshold: u32,
    pub success_threshold: u32,
}

/// The service's per-worker check schedule and threshold logic.
#[derive(Debug)]
pub struct HealthMonitor {
    config: HealthThresholds,
    schedule: PollSchedule,
    workers: Vec<EngineHealth>,
}

impl HealthMonitor {
    pub fn new(config: HealthThresholds, workers: &[std::sync::Arc<Engine>]) -> Self {
        Self {
            schedule: PollSchedule::new(config.interval_ms, workers.len()),
            config,
            workers: workers
                .iter()
                .map(|w| EngineHealth { id: w.id.clone(), healthy: true, consecutive_ok: 0, consecutive_fail: 0 })
                .collect(),
        }
    }

    /// Follows a new worker list: a worker configured before and after keeps its verdict and its
    /// runs of checks; a new one starts healthy, as every worker does at startup. Every worker is
    /// due at once, since answers to checks sent before are not recorded.
    pub fn follow(&mut self, config: HealthThresholds, workers: &[std::sync::Arc<Engine>]) {
        let mut old = std::mem::take(&mut self.workers);
        self.workers = workers
            .iter()
            .map(|w| match old.iter().position(|h| h.id == w.id) {
                Some(i) => old.swap_remove(i),
                None => EngineHealth { id: w.id.clone(), healthy: true, consecutive_ok: 0, consecutive_fail: 0 },
            })
            .collect();
        self.schedule = PollSchedule::new(config.interval_ms, workers.len());
        self.config = config;
    }

    /// Workers whose check is due now; each is outstanding until [`Self::record`].
    pub fn due(&mut self, now_ms: u64) -> Vec<usize> {
        self.schedule.due(now_ms)
    }

    /// Records a finished check; returns whether the worker's health flipped.
    pub fn record(&mut self, index: usize, ok: bool) -> bool {
        self.schedule.finished(index);
        let Some(w) = self.workers.get_mut(index) else {
            return false;
        };
        if ok {
            w.consecutive_ok = w.consecutive_ok.saturating_add(1);
            w.consecutive_fail = 0;
            if !w.healthy && w.consecutive_ok >= self.config.success_threshold {
                w.healthy = true;
                return true;
            }
        } else {
            w.consecutive_fail = w.consecutive_fail.saturating_add(1);
            w.consecutive_ok = 0;
            if w.healthy && w.consecutive_fail >= self.config.failure_threshold {
                w.healthy = false;
                return true;
            }
        }
        false
    }

    /// A check that could not even be dispatched counts as a failure, so it is not retried forever.
    pub fn abandon(&mut self, index: usize) -> bool {
        self.record(index, false)
    }

    pub fn table(&self, now_ms: u64) -> HealthTable {
        HealthTable {
            unhealthy: self.workers.iter().filter(|w| !w.healthy).map(|w| w.id.clone()).collect(),
            monitored: self.workers.iter().map(|w| w.id.clone()).collect(),
            published_ms: now_ms,
        }
    }

    pub fn unhealthy(&self) -> usize {
        self.workers.iter().filter(|w| !w.healthy).count()
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::sync::Arc;

    use super::*;
    use crate::registry::EngineAddress;
    use crate::registry::Role;

    fn worker(id: &str) -> Arc<Engine> {
        Arc::new(Engine {
            id: id.to_string(),
            model: "m".to_string(),
            role: Role::Plain,
            address: EngineAddress::new("127.0.0.1", 1),
            cluster: format!("sgl_{id}"),
            override_host: None,
            bootstrap_port: None,
            dp_size: 1,
            draining: false,
        })
    }

    fn monitor() -> HealthMonitor {
        let config = HealthThresholds { failure_threshold: 2, success_threshold: 2, interval_ms: 100 };
        HealthMonitor::new(config, &[worker("A"), worker("B")])
    }

    #[test]
    fn healthy_until_failure_threshold_reached() {
        let mut m = monitor();
        assert!(m.table(0).unhealthy.is_empty());
        assert!(!m.record(0, false));
        assert!(m.table(0).unhealthy.is_empty());
        assert!(m.record(0, false));
        assert_eq!(m.table(0).unhealthy, vec!["A".to_string()]);
    }

    #[test]
    fn recovers_after_success_threshold() {
        let mut m = monitor();
        m.record(0, false);
        m.record(0, false);
        assert!(!m.record(0, true));
        assert!(m.record(0, true));
        assert!(m.table(0).unhealthy.is_empty());
    }

    #[test]
    fn a_success_resets_the_failure_run() {
        let mut m = monitor();
        m.record(0, false);
        m.record(0, true);
        assert!(!m.record(0, false));
        assert!(m.table(0).unhealthy.is_empty());
    }
}
