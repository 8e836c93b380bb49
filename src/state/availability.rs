//! The registry's view of worker health in a filter VM: the service's published health table plus
//! the circuit breakers, read once per request. The health table is decoded again only when its
//! version moved. A worker the service does not monitor (the filter's configuration changed alone)
//! is unavailable: its failures would go unseen. A table older than its stale time (the service
//! stopped publishing) says nothing: health is unknown, so it fails open to load, as a stale load
//! report does, and each such read is counted.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::breaker::CircuitBreakers;
use super::health::HealthTable;
use super::keys;
use super::shared::VersionedReader;
use crate::host::Host;
use crate::registry::Availability;

#[derive(Debug)]
pub struct SharedAvailability {
    host: Arc<dyn Host>,
    breakers: Option<CircuitBreakers>,
    /// The filter's own workers.
    configured: Vec<String>,
    health: Mutex<HealthCopy>,
    stale_after_ms: u64,
    /// Reads that found the table stale, since the last [`SharedAvailability::take_stale_reads`].
    stale_reads: AtomicU64,
}

#[derive(Debug)]
struct HealthCopy {
    reader: VersionedReader<HealthTable>,
    /// Unhealthy or unmonitored.
    out: Arc<HashSet<String>>,
    unmonitored: Vec<String>,
    published_ms: u64,
}

impl SharedAvailability {
    /// `recheck_ms`: see [`VersionedReader::rechecked_every`]; `stale_after_ms`: see
    /// [`super::health::stale_after_ms`].
    pub fn new(
        host: Arc<dyn Host>,
        breakers: Option<CircuitBreakers>,
        configured: Vec<String>,
        recheck_ms: u64,
        stale_after_ms: u64,
    ) -> Self {
        let health = HealthCopy {
            reader: VersionedReader::new(keys::HEALTH_TABLE).rechecked_every(recheck_ms),
            out: Arc::default(),
            unmonitored: Vec::new(),
            published_ms: 0,
        };
        Self { host, breakers, configured, health: Mutex::new(health), stale_after_ms, stale_reads: AtomicU64::new(0) }
    }

    /// Reads that found the health table stale since the last call.
    pub fn take_stale_reads(&self) -> u64 {
        self.stale_reads.swap(0, Ordering::Relaxed)
    }

    fn out_of_service(&self) -> Arc<HashSet<String>> {
        let Ok(mut copy) = self.health.lock() else {
            return Arc::default();
        };
        if !self.fresh(&mut copy) {
            self.stale_reads.fetch_add(1, Ordering::Relaxed);
            return Arc::default();
        }
        Arc::clone(&copy.out)
    }

    /// Brings the copy up to the published table; whether that table is fresh (no table yet is:
    /// nothing is known to be down).
    fn fresh(&self, copy: &mut HealthCopy) -> bool {
        if copy.reader.refresh(self.host.as_ref()) {
            if let Some(table) = copy.reader.value() {
                let monitored: HashSet<&str> = table.monitored.iter().map(String::as_str).collect();
                let unmonitored: Vec<String> =
                    self.configured.iter().filter(|w| !monitored.contains(w.as_str())).cloned().collect();
                for w in unmonitored.iter().filter(|w| !copy.unmonitored.contains(w)) {
                    log::warn!(
                        "worker {w} is in this filter's configuration but the service does not check its health; \
                         it gets no traffic until the service's configuration names it too"
                    );
                }
                copy.out = Arc::new(table.unhealthy.iter().cloned().chain(unmonitored.iter().cloned()).collect());
                copy.unmonitored = unmonitored;
                copy.published_ms = table.published_ms;
            }
        }
        copy.reader.value().is_none() || self.host.now_ms().saturating_sub(copy.published_ms) <= self.stale_after_ms
    }

    /// Configured workers the service does not monitor (a gauge for operators).
    pub fn unmonitored(&self) -> usize {
        let Ok(mut copy) = self.health.lock() else { return 0 };
        self.fresh(&mut copy);
        copy.unmonitored.len()
    }

    /// Whether the health table has gone stale (a gauge for operators).
    pub fn health_stale(&self) -> bool {
        let Ok(mut copy) = self.health.lock() else { return false };
        !self.fresh(&mut copy)
    }
}

impl Availability for SharedAvailability {
    /// Unhealthy workers, and those whose breaker is open or whose half-open probe is out.
    fn unavailable(&self) -> Arc<HashSet<String>> {
        let unhealthy = self.out_of_service();
        let open = self.breakers.as_ref().map(CircuitBreakers::unavailable).unwrap_or_default();
        if open.is_empty() {
            unhealthy
        } else {
            Arc::new(unhealthy.iter().cloned().chain(open).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::state::breaker::BreakerSettings;
    use crate::state::shared;
    use crate::testing::test;

    #[test]
    fn unhealthy_and_open_breakers_are_both_unavailable() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let breakers =
            CircuitBreakers::new(Arc::clone(&host), BreakerSettings { failure_threshold: 1, cooldown_ms: 1000 });
        let availability =
            SharedAvailability::new(Arc::clone(&host), Some(breakers.clone()), vec!["A".into(), "B".into()], 0, 1000);
        assert!(availability.unavailable().is_empty(), "nothing published yet: everyone is available");
        let table = HealthTable {
            unhealthy: vec!["A".into()],
            monitored: vec!["A".into(), "B".into()],
            published_ms: host.now_ms(),
        };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        breakers.record("B", false);
        let mut down: Vec<String> = availability.unavailable().iter().cloned().collect();
        down.sort();
        assert_eq!(down, ["A", "B"]);
    }

    #[test]
    fn a_worker_the_service_does_not_monitor_is_unavailable() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let availability = SharedAvailability::new(Arc::clone(&host), None, vec!["A".into(), "NEW".into()], 0, 1000);
        let table = HealthTable { unhealthy: vec![], monitored: vec!["A".into()], published_ms: host.now_ms() };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        assert_eq!(availability.unavailable().iter().collect::<Vec<_>>(), ["NEW"]);
        assert_eq!(availability.unmonitored(), 1);
        let table =
            HealthTable { unhealthy: vec![], monitored: vec!["A".into(), "NEW".into()], published_ms: host.now_ms() };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        assert!(availability.unavailable().is_empty(), "once the service monitors it, it serves");
        assert_eq!(availability.unmonitored(), 0);
    }

    /// A service that died froze its last verdict: a worker it had marked down stayed down (and
    /// one it had not, up) forever. Past the stale time the table says nothing, and that is counted.
    #[test]
    fn a_stale_health_table_reads_as_unknown_and_is_counted() {
        let host = Arc::new(MemoryHost::default());
        let availability = SharedAvailability::new(host.clone(), None, vec!["A".into(), "B".into()], 0, 1000);
        let table =
            |at| HealthTable { unhealthy: vec!["A".into()], monitored: vec!["A".into(), "B".into()], published_ms: at };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table(host.now_ms())).unwrap())
            .unwrap();
        host.advance_ms(1000);
        assert_eq!(availability.unavailable().iter().collect::<Vec<_>>(), ["A"], "fresh at its stale time");
        assert_eq!((availability.take_stale_reads(), availability.health_stale()), (0, false));
        host.advance_ms(1);
        assert!(availability.unavailable().is_empty(), "stale: unknown, so open to load");
        availability.unavailable();
        assert_eq!((availability.take_stale_reads(), availability.health_stale()), (2, true));
        assert_eq!(availability.take_stale_reads(), 0);
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table(host.now_ms())).unwrap())
            .unwrap();
        assert_eq!(availability.unavailable().iter().collect::<Vec<_>>(), ["A"], "the service is back");
    }
}
