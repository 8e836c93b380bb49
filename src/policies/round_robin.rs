//! Rotation over the candidates with one cursor per policy instance. The instance is logical and
//! spans every worker VM, so its cursor sits behind a trait the application backs with shared
//! data. The rotated-to engine is checked once; a rejection ends the attempt.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::admission::AdmissionGate;
use super::{Pick, PickError, PickReason, PickRequest, Policy};
use crate::host::Host;
use crate::registry::Engine;
use crate::state::vm_registry::Solitude;
use crate::state::{keys, shared};

/// The policy instance's position; each call returns the next ticket.
pub trait RoundRobinCursor: Send + Sync + std::fmt::Debug {
    fn next_ticket(&self) -> u64;
}

/// A cursor in shared data, advanced with cas by every VM, so the rotation is exact across worker
/// threads. While this VM is the only filter VM serving requests ([`Solitude`]) it advances a copy
/// in memory
/// instead, which costs no host call, and hands its position back to shared data as soon as a
/// heartbeat finds another VM, so the others continue after it. The bound, stated: a VM that
/// serves its first request while another counts itself alone (a second worker thread's first
/// request, a crashed VM's replacement) shares the rotation inexactly until the other's next
/// heartbeat (within
/// [`HEARTBEAT_MS`](crate::state::vm_registry::HEARTBEAT_MS)).
pub struct SharedCursor {
    host: Arc<dyn Host>,
    key: String,
    solitude: Arc<Solitude>,
    /// The next ticket, while this VM advances the cursor alone.
    local: Mutex<Option<u64>>,
}

impl SharedCursor {
    pub fn new(host: Arc<dyn Host>, instance: &str, solitude: Arc<Solitude>) -> Self {
        Self { host, key: keys::round_robin_cursor(instance), solitude, local: Mutex::new(None) }
    }

    fn shared_ticket(&self) -> u64 {
        // Past the cas retry bound, a random ticket keeps traffic spread instead of piling onto
        // the first candidate.
        shared::fetch_add(self.host.as_ref(), &self.key, 1).unwrap_or_else(|_| self.host.random_u64())
    }
}

impl std::fmt::Debug for SharedCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCursor").field("key", &self.key).finish()
    }
}

impl RoundRobinCursor for SharedCursor {
    fn next_ticket(&self) -> u64 {
        let Ok(mut local) = self.local.lock() else { return self.shared_ticket() };
        match (self.solitude.alone(), *local) {
            (true, Some(next)) => {
                *local = Some(next.wrapping_add(1));
                next
            }
            (true, None) => {
                // Alone from now: take the shared position once.
                let next =
                    shared::fetch_add(self.host.as_ref(), &self.key, 1).unwrap_or_else(|_| self.host.random_u64());
                *local = Some(next.wrapping_add(1));
                next
            }
            (false, Some(next)) => {
                // No longer alone: the shared cursor continues from where this VM got to.
                let handed = shared::update(self.host.as_ref(), &self.key, &0u64.to_le_bytes(), |bytes| {
                    let shared = shared::decode_u64(bytes).unwrap_or(0);
                    (shared.max(next).to_le_bytes().to_vec(), ())
                });
                if let Err(e) = handed {
                    log::warn!("round-robin position not handed back: {e}");
                }
                *local = None;
                self.shared_ticket()
            }
            (false, None) => self.shared_ticket(),
        }
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

    /// The next admitted engine in the rotation after the failed one; the cursor does not move.
    fn fallback(&self, engines: &[Arc<Engine>], failed: &Engine, _request: &PickRequest<'_>) -> Option<Arc<Engine>> {
        let next = engines.iter().position(|e| e.id > failed.id).unwrap_or(0);
        let rotation = engines[next..].iter().chain(&engines[..next]);
        rotation.into_iter().find(|e| self.gate.check(e).is_ok()).cloned()
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
            Box::new(SharedCursor::new(Arc::clone(&host), "m/b/plain", Arc::default())),
            s.gate(AdmissionLimits::default()),
        );
        let vm2 = RoundRobinPolicy::new(
            Box::new(SharedCursor::new(Arc::clone(&host), "m/b/plain", Arc::default())),
            s.gate(AdmissionLimits::default()),
        );
        let other = RoundRobinPolicy::new(
            Box::new(SharedCursor::new(host, "m/b2/plain", Arc::default())),
            s.gate(AdmissionLimits::default()),
        );
        let ws = workers(&["A", "B"]);
        let r = request(Role::Plain);
        assert_eq!(vm1.pick(&ws, &r).unwrap().engine.id, "A");
        assert_eq!(vm2.pick(&ws, &r).unwrap().engine.id, "B");
        assert_eq!(other.pick(&ws, &r).unwrap().engine.id, "A", "another instance has its own cursor");
        assert_eq!(vm1.pick(&ws, &r).unwrap().engine.id, "A");
    }

    /// Alone, a VM advances its cursor in memory; when another VM appears it hands its position
    /// back, and the rotation goes on exactly where it was.
    #[test]
    fn a_vm_alone_rotates_in_memory_and_hands_its_position_back() {
        use crate::state::vm_registry::{heartbeat, Solitude};
        let host = Arc::new(MemoryHost::default());
        let solitude = Arc::new(Solitude::default());
        for now in [0, 1_000] {
            solitude.observe(heartbeat(host.as_ref(), 1, now, true).unwrap());
        }
        let key = keys::round_robin_cursor("m/b/plain");
        let cursor = SharedCursor::new(Arc::clone(&host) as Arc<dyn Host>, "m/b/plain", Arc::clone(&solitude));
        let tickets: Vec<u64> = (0..5).map(|_| cursor.next_ticket()).collect();
        assert_eq!(tickets, [0, 1, 2, 3, 4]);
        assert_eq!(shared::read_u64(host.as_ref(), &key).unwrap(), Some(1), "one shared write, when it became alone");
        heartbeat(host.as_ref(), 2, 1_500, true).unwrap();
        solitude.observe(heartbeat(host.as_ref(), 1, 2_000, true).unwrap());
        let other = SharedCursor::new(Arc::clone(&host) as Arc<dyn Host>, "m/b/plain", Arc::default());
        assert_eq!(cursor.next_ticket(), 5, "the position went back to shared data first");
        assert_eq!(other.next_ticket(), 6);
        assert_eq!(cursor.next_ticket(), 7);
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
