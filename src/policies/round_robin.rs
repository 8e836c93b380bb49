//! Rotation over the candidates with one cursor per policy instance. The instance is logical and
//! spans every worker VM, so its cursor sits behind a trait the application backs with shared
//! data. The rotated-to engine is checked once; a rejection ends the attempt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::admission::AdmissionGate;
use super::{Pick, PickError, PickReason, PickRequest, Policy};
use crate::host::Host;
use crate::registry::Engine;
use crate::state::{keys, shared};

/// The policy instance's position; each call returns the next ticket.
pub trait RoundRobinCursor: Send + Sync + std::fmt::Debug {
    fn next_ticket(&self) -> u64;
}

/// A cursor in shared data, advanced with cas by every VM.
pub struct SharedCursor {
    host: Arc<dyn Host>,
    key: String,
}

impl SharedCursor {
    pub fn new(host: Arc<dyn Host>, instance: &str) -> Self {
        Self { host, key: keys::round_robin_cursor(instance) }
    }
}

impl std::fmt::Debug for SharedCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCursor").field("key", &self.key).finish()
    }
}

impl RoundRobinCursor for SharedCursor {
    fn next_ticket(&self) -> u64 {
        // Past the cas retry bound, a random ticket keeps traffic spread instead of piling onto
        // the first candidate.
        shared::fetch_add(self.host.as_ref(), &self.key, 1).unwrap_or_else(|_| self.host.random_u64())
    }
}

/// A process-local cursor, for tests.
#[derive(Debug, Default)]
pub struct MemoryCursor(AtomicU64);

impl RoundRobinCursor for MemoryCursor {
    fn next_ticket(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst)
    }
}

#[derive(Debug)]
pub struct RoundRobinPolicy {
    cursor: Box<dyn RoundRobinCursor>,
    gate: AdmissionGate,
}

impl RoundRobinPolicy {
    pub fn new(cursor: Box<dyn RoundRobinCursor>, gate: AdmissionGate) -> Self {
        Self { cursor, gate }
    }
}

impl Policy for RoundRobinPolicy {
    fn pick(&self, engines: &[Arc<Engine>], _request: &PickRequest<'_>) -> Result<Pick, PickError> {
        let index = self.cursor.next_ticket().checked_rem(engines.len() as u64).unwrap_or(0) as usize;
        self.gate.checked_pick(engines, index, PickReason::Rotation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdmissionLimits;
    use crate::host::MemoryHost;
    use crate::policies::{Limit, Rejection};
    use crate::registry::Role;
    use crate::testing::test;
    use crate::testing::*;

    #[test]
    fn rotates_over_the_candidates_in_order() {
        let s = State::new();
        let p = RoundRobinPolicy::new(Box::new(MemoryCursor::default()), s.gate(AdmissionLimits::default()));
        let ws = workers(&["A", "B", "C"]);
        let r = request(Role::Plain);
        let ids: Vec<String> = (0..6).map(|_| p.pick(&ws, &r).unwrap().engine.id.clone()).collect();
        assert_eq!(ids, ["A", "B", "C", "A", "B", "C"]);
    }

    #[test]
    fn one_cursor_per_instance_shared_through_shared_data() {
        // Two VMs' instances of the same logical policy share one cursor.
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let s = State::new();
        let vm1 = RoundRobinPolicy::new(
            Box::new(SharedCursor::new(Arc::clone(&host), "m/b/plain")),
            s.gate(AdmissionLimits::default()),
        );
        let vm2 = RoundRobinPolicy::new(
            Box::new(SharedCursor::new(Arc::clone(&host), "m/b/plain")),
            s.gate(AdmissionLimits::default()),
        );
        let other =
            RoundRobinPolicy::new(Box::new(SharedCursor::new(host, "m/b2/plain")), s.gate(AdmissionLimits::default()));
        let ws = workers(&["A", "B"]);
        let r = request(Role::Plain);
        assert_eq!(vm1.pick(&ws, &r).unwrap().engine.id, "A");
        assert_eq!(vm2.pick(&ws, &r).unwrap().engine.id, "B");
        assert_eq!(other.pick(&ws, &r).unwrap().engine.id, "A", "another instance has its own cursor");
        assert_eq!(vm1.pick(&ws, &r).unwrap().engine.id, "A");
    }

    #[test]
    fn no_candidates_is_not_an_admission_outcome() {
        let s = State::new();
        let p = RoundRobinPolicy::new(Box::new(MemoryCursor::default()), s.gate(AdmissionLimits::default()));
        assert!(matches!(p.pick(&[], &request(Role::Plain)), Err(PickError::NoCandidates { .. })));
    }

    #[test]
    fn the_rotated_to_engine_is_checked_and_a_rejection_ends_the_attempt() {
        let s = State::new();
        s.inflight.set("A", 1);
        let p = RoundRobinPolicy::new(
            Box::new(MemoryCursor::default()),
            s.gate(AdmissionLimits { max_inflight_requests: Some(1), ..Default::default() }),
        );
        let ws = workers(&["A", "B"]);
        let err = p.pick(&ws, &request(Role::Plain)).unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "A".into(), limit: Limit::MaxInflightRequests })
        );
        assert_eq!(p.pick(&ws, &request(Role::Plain)).unwrap().engine.id, "B");
    }
}
