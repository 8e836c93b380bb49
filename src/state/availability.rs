//! The registry's view of worker health in a filter VM: the service's published health table plus
//! the circuit breakers, read once per request. The health table is decoded again only when its
//! version moved.

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
    health: Mutex<HealthCopy>,
}

#[derive(Debug)]
struct HealthCopy {
    reader: VersionedReader<HealthTable>,
    unhealthy: Arc<HashSet<String>>,
}

impl SharedAvailability {
    pub fn new(host: Arc<dyn Host>, breakers: Option<CircuitBreakers>) -> Self {
        let health = HealthCopy { reader: VersionedReader::new(keys::HEALTH_TABLE), unhealthy: Arc::default() };
        Self { host, breakers, health: Mutex::new(health) }
    }

    fn unhealthy(&self) -> Arc<HashSet<String>> {
        let Ok(mut copy) = self.health.lock() else {
            return Arc::default();
        };
        if copy.reader.refresh(self.host.as_ref()) {
            if let Some(table) = copy.reader.value() {
                copy.unhealthy = Arc::new(table.unhealthy.iter().cloned().collect());
            }
        }
        Arc::clone(&copy.unhealthy)
    }
}

impl Availability for SharedAvailability {
    /// Unhealthy workers, and those whose breaker is open or whose half-open probe is out.
    fn unavailable(&self) -> Arc<HashSet<String>> {
        let unhealthy = self.unhealthy();
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

    #[test]
    fn unhealthy_and_open_breakers_are_both_unavailable() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let breakers =
            CircuitBreakers::new(Arc::clone(&host), BreakerSettings { failure_threshold: 1, cooldown_ms: 1000 });
        let availability = SharedAvailability::new(Arc::clone(&host), Some(breakers.clone()));
        assert!(availability.unavailable().is_empty(), "nothing published yet: everyone is available");
        let table = HealthTable { unhealthy: vec!["A".into()] };
        shared::publish(host.as_ref(), keys::HEALTH_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        breakers.record("B", false);
        let mut down: Vec<String> = availability.unavailable().iter().cloned().collect();
        down.sort();
        assert_eq!(down, ["A", "B"]);
    }
}
