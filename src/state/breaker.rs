//! The opt-in circuit breaker (spec §2): consecutive dispatch failures (connect errors, 5xx) open
//! it; after the cool-down one probe request half-opens it; the probe's success closes it, its
//! failure opens it again. A probe always resolves: by its result, by the end of its stream without
//! one (the client left, a PD 502 reset it: the probe is given back), or by a probe timeout of one
//! cool-down (its VM died). Only workers with failures or an open breaker are stored, in one small
//! shared map, so a healthy request path reads a few bytes and writes nothing.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::keys;
use super::shared::update;
use crate::host::Host;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    failures: u32,
    opened_at_ms: Option<u64>,
    /// When the half-open probe went out.
    probe_sent_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Table {
    workers: BTreeMap<String, Entry>,
}

impl Table {
    fn unavailable(&self, now_ms: u64, cooldown_ms: u64) -> HashSet<String> {
        self.workers
            .iter()
            .filter(|(_, e)| match e.opened_at_ms {
                Some(opened) if now_ms < opened.saturating_add(cooldown_ms) => true,
                Some(_) => e.probe_sent_ms.is_some_and(|sent| now_ms < sent.saturating_add(cooldown_ms)),
                None => false,
            })
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// When a breaker opens and how long it stays open before its probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// Consecutive dispatch failures that open it.
    pub failure_threshold: u32,
    pub cooldown_ms: u64,
}

#[derive(Debug, Clone)]
pub struct CircuitBreakers {
    host: Arc<dyn Host>,
    config: BreakerSettings,
}

impl CircuitBreakers {
    pub fn new(host: Arc<dyn Host>, config: BreakerSettings) -> Self {
        Self { host, config }
    }

    fn read(&self) -> Table {
        match self.host.shared_get(keys::BREAKERS) {
            Ok(Some(v)) => serde_json::from_slice(&v.bytes).unwrap_or_default(),
            _ => Table::default(),
        }
    }

    fn change(&self, f: impl Fn(&mut Table)) {
        let seed = serde_json::to_vec(&Table::default()).unwrap_or_default();
        let result = update(self.host.as_ref(), keys::BREAKERS, &seed, |bytes| {
            let mut table: Table = serde_json::from_slice(bytes).unwrap_or_default();
            f(&mut table);
            (serde_json::to_vec(&table).unwrap_or_default(), ())
        });
        if let Err(e) = result {
            log::warn!("circuit breaker state not updated: {e}");
        }
    }

    /// Workers whose breaker is open, or half-open with its probe already out.
    pub fn unavailable(&self) -> HashSet<String> {
        self.read().unavailable(self.host.now_ms(), self.config.cooldown_ms)
    }

    /// A request was dispatched to `worker`: if its breaker is half-open, this is the probe.
    pub fn on_dispatch(&self, worker: &str) {
        let now = self.host.now_ms();
        let cooldown = self.config.cooldown_ms;
        let table = self.read();
        let half_open = table.workers.get(worker).is_some_and(|e| {
            e.opened_at_ms.is_some_and(|t| now >= t.saturating_add(cooldown))
                && e.probe_sent_ms.is_none_or(|sent| now >= sent.saturating_add(cooldown))
        });
        if half_open {
            self.change(|t| {
                if let Some(e) = t.workers.get_mut(worker) {
                    e.probe_sent_ms = Some(now);
                }
            });
        }
    }

    /// A dispatch to `worker` ended without a result (the stream went away first). If it was the
    /// probe, the probe is given back so the next request can probe; nothing is counted.
    pub fn abandon(&self, worker: &str) {
        if self.read().workers.get(worker).is_some_and(|e| e.probe_sent_ms.is_some()) {
            self.change(|t| {
                if let Some(e) = t.workers.get_mut(worker) {
                    e.probe_sent_ms = None;
                }
            });
        }
    }

    /// A dispatch finished; `ok` is false for a connect error or a 5xx.
    pub fn record(&self, worker: &str, ok: bool) {
        if ok {
            // Healthy path: nothing stored for this worker, nothing to write.
            if self.read().workers.contains_key(worker) {
                self.change(|t| {
                    t.workers.remove(worker);
                });
            }
            return;
        }
        let now = self.host.now_ms();
        let threshold = self.config.failure_threshold;
        self.change(|t| {
            let e = t.workers.entry(worker.to_string()).or_default();
            e.failures = e.failures.saturating_add(1);
            if e.probe_sent_ms.is_some() || e.failures >= threshold {
                e.opened_at_ms = Some(now);
                e.probe_sent_ms = None;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    fn breakers() -> (Arc<MemoryHost>, CircuitBreakers) {
        let host = Arc::new(MemoryHost::default());
        let b = CircuitBreakers::new(host.clone(), BreakerSettings { failure_threshold: 3, cooldown_ms: 1000 });
        (host, b)
    }

    #[test]
    fn consecutive_failures_open_it() {
        let (_, b) = breakers();
        b.record("A", false);
        b.record("A", false);
        assert!(b.unavailable().is_empty());
        b.record("A", false);
        assert!(b.unavailable().contains("A"));
    }

    #[test]
    fn a_success_resets_the_count() {
        let (_, b) = breakers();
        b.record("A", false);
        b.record("A", false);
        b.record("A", true);
        b.record("A", false);
        assert!(b.unavailable().is_empty());
    }

    #[test]
    fn after_the_cooldown_one_probe_half_opens_it() {
        let (host, b) = breakers();
        for _ in 0..3 {
            b.record("A", false);
        }
        host.advance_ms(999);
        assert!(b.unavailable().contains("A"));
        host.advance_ms(1);
        assert!(b.unavailable().is_empty(), "half-open: one probe may go");
        b.on_dispatch("A");
        assert!(b.unavailable().contains("A"), "the probe is out; nobody else goes");
        b.record("A", true);
        assert!(b.unavailable().is_empty(), "the probe's success closes it");
    }

    #[test]
    fn a_failed_probe_opens_it_again() {
        let (host, b) = breakers();
        for _ in 0..3 {
            b.record("A", false);
        }
        host.advance_ms(1000);
        b.on_dispatch("A");
        b.record("A", false);
        assert!(b.unavailable().contains("A"));
        host.advance_ms(999);
        assert!(b.unavailable().contains("A"), "a fresh cool-down");
    }

    fn half_open(host: &MemoryHost, b: &CircuitBreakers) {
        for _ in 0..3 {
            b.record("A", false);
        }
        host.advance_ms(1000);
        b.on_dispatch("A");
        assert!(b.unavailable().contains("A"), "the probe is out");
    }

    #[test]
    fn a_probe_whose_stream_ends_without_a_result_is_given_back() {
        let (host, b) = breakers();
        half_open(&host, &b);
        b.abandon("A");
        assert!(b.unavailable().is_empty(), "the next request probes");
        b.on_dispatch("A");
        b.record("A", true);
        assert!(b.unavailable().is_empty());
    }

    #[test]
    fn a_probe_that_never_resolves_times_out_after_a_cooldown() {
        let (host, b) = breakers();
        half_open(&host, &b);
        host.advance_ms(999);
        assert!(b.unavailable().contains("A"));
        host.advance_ms(1);
        assert!(b.unavailable().is_empty(), "the lost probe no longer excludes the worker");
        b.on_dispatch("A");
        assert!(b.unavailable().contains("A"), "a new probe went out");
    }

    #[test]
    fn abandoning_a_dispatch_that_was_not_a_probe_changes_nothing() {
        let (host, b) = breakers();
        b.record("A", false);
        b.abandon("A");
        b.abandon("B");
        b.record("A", false);
        b.record("A", false);
        assert!(b.unavailable().contains("A"), "the failures still count");
        let _ = host;
    }

    #[test]
    fn successes_on_a_healthy_worker_write_nothing() {
        let (host, b) = breakers();
        b.record("A", true);
        assert_eq!(host.shared_get(keys::BREAKERS).unwrap(), None);
    }
}
