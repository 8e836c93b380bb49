//! The registry's view of worker health in a filter VM: the service's published health table plus
//! the circuit breakers, read once per request. The health table is decoded again only when its
//! version moved. A worker the service does not monitor (the filter's configuration changed alone)
//! is unavailable: its failures would go unseen.

use std::collections::HashSet;
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
}

#[derive(Debug)]
struct HealthCopy {
    reader: VersionedReader<HealthTable>,
    /// Unhealthy or unmonitored.
    out: Arc<HashSet<String>>,
    unmonitored: Vec<String>,
}

impl SharedAvailability {
    /// `recheck_ms`: see [`VersionedReader::rechecked_every`].
    pub fn new(
        host: Arc<dyn Host>,
        breakers: Option<CircuitBreakers>,
        configured: Vec<String>,
        recheck_ms: u64,
    ) -> Self {
        let health = HealthCopy {
            reader: VersionedReader::new(keys::HEALTH_TABLE).rechecked_every(recheck_ms),
            out: Arc::default(),
            unmonitored: Vec::new(),
        };
        Self { host, breakers, configured, health: Mutex::new(health) }
    }

    fn out_of_service(&self) -> Arc<HashSet<String>> {
        let Ok(mut copy) = self.health.lock() else {
            return Arc::default();
        };
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
            }
        }
        Arc::clone(&copy.out)
    }

    /// Configured workers the service does not monitor (a gauge for operators).
    pub fn unmonitored(&self) -> usize {
        self.out_of_service();
        self.health.lock().map(|c| c.unmonitored.len()).unwrap_or(0)
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
            SharedAvailability::new(Arc::clone(&host), Some(breakers.clone()), vec!["A".into(), "B".into()], 0);
        assert!(availability.unavailable().is_empty(), "nothing published yet: everyone is available");
        let table = HealthTable { unhealthy: vec!["A".into()], monitored: vec!["A".into(), "B".into()] };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        breakers.record("B", false);
        let mut down: Vec<String> = availability.unavailable().iter().cloned().collect();
        down.sort();
        assert_eq!(down, ["A", "B"]);
    }

    #[test]
    fn a_worker_the_service_does_not_monitor_is_unavailable() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let availability = SharedAvailability::new(Arc::clone(&host), None, vec!["A".into(), "NEW".into()], 0);
        let table = HealthTable { unhealthy: vec![], monitored: vec!["A".into()] };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        assert_eq!(availability.unavailable().iter().collect::<Vec<_>>(), ["NEW"]);
        assert_eq!(availability.unmonitored(), 1);
        let table = HealthTable { unhealthy: vec![], monitored: vec!["A".into(), "NEW".into()] };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        assert!(availability.unavailable().is_empty(), "once the service monitors it, it serves");
        assert_eq!(availability.unmonitored(), 0);
    }
}
