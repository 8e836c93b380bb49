//! Which VM does the service's work (spec §10): the bootstrap singleton where one runs, else one
//! filter VM elected through a lease in shared data (under the configuration's namespace).
//!
//! **Rules.** The holder renews its lease every heartbeat, for [`LEASE_MS`] (a heartbeat and a
//! half: one renewal may come half a heartbeat late). A singleton always takes the lease, so
//! filter VMs step aside while one is alive. A filter VM takes a lease that expired (or was never
//! written) with cas, so one VM wins each turn; a VM that has served no request (Envoy's
//! main-thread VM, which never does) may take it at expiry, a serving one [`SERVING_GRACE_MS`]
//! later, so the VM with nothing else to do is preferred.
//!
//! **Bound.** VMs claim at their own heartbeats, a heartbeat apart at any phase. A holder that
//! stops renewing (a crash, FAIL_RELOAD, its configuration replaced) is replaced within
//! `LEASE_MS` + `SERVING_GRACE_MS` + one heartbeat of its last renewal: three heartbeats.

use serde::{Deserialize, Serialize};

use super::keys;
use super::vm_registry::HEARTBEAT_MS;
use crate::host::{Host, HostError};

/// How long a renewal holds the lease.
pub const LEASE_MS: u64 = 3 * HEARTBEAT_MS / 2;
/// How much longer a VM that serves requests leaves an expired lease to an idle one.
pub const SERVING_GRACE_MS: u64 = HEARTBEAT_MS / 2;

/// The cas a first write carries (see `shared`): it writes only when the key is absent.
const ONLY_IF_ABSENT: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Lease {
    holder: u64,
    singleton: bool,
    until_ms: u64,
}

/// Who asks for the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimant {
    /// The bootstrap service: it takes the lease whoever holds it.
    Singleton,
    /// A filter VM; `serving` once it has served a request.
    Filter { serving: bool },
}

/// Whether `me` holds the lease after this heartbeat's claim: renewed, taken, or left to another.
pub fn claim(host: &dyn Host, me: u64, claimant: Claimant, now_ms: u64) -> Result<bool, HostError> {
    let current = host.shared_get(keys::SERVICE_LEASE)?;
    let lease = current.as_ref().and_then(|c| serde_json::from_slice::<Lease>(&c.bytes).ok());
    let take = match (claimant, lease) {
        (Claimant::Singleton, _) => true,
        (Claimant::Filter { .. }, Some(l)) if l.holder == me => true,
        (Claimant::Filter { .. }, None) => true,
        (Claimant::Filter { serving }, Some(l)) => {
            let grace = if serving { SERVING_GRACE_MS } else { 0 };
            now_ms >= l.until_ms.saturating_add(grace)
        }
    };
    if !take {
        return Ok(false);
    }
    let mine = Lease { holder: me, singleton: claimant == Claimant::Singleton, until_ms: now_ms + LEASE_MS };
    let bytes = serde_json::to_vec(&mine).map_err(|e| HostError::Failed(format!("lease not encoded: {e}")))?;
    let cas = current.map_or(ONLY_IF_ABSENT, |c| c.cas);
    let cas = if claimant == Claimant::Singleton { None } else { Some(cas) };
    match host.shared_set(keys::SERVICE_LEASE, &bytes, cas) {
        Ok(()) => Ok(true),
        // Another VM took it in the same turn.
        Err(HostError::CasMismatch) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    const SERVING: Claimant = Claimant::Filter { serving: true };
    const IDLE: Claimant = Claimant::Filter { serving: false };

    #[test]
    fn one_filter_vm_holds_it_and_renews_it() {
        let host = MemoryHost::default();
        assert!(claim(&host, 1, SERVING, 0).unwrap());
        assert!(!claim(&host, 2, IDLE, 10).unwrap(), "held");
        for t in 1..10 {
            assert!(claim(&host, 1, SERVING, t * HEARTBEAT_MS).unwrap(), "renewed each heartbeat");
            assert!(!claim(&host, 2, IDLE, t * HEARTBEAT_MS + 1).unwrap());
        }
    }

    /// The holder stops at its last renewal: the idle VM takes over at expiry, a serving one
    /// half a heartbeat later; at whatever phase their heartbeats fall, within three heartbeats.
    #[test]
    fn a_holder_that_stops_renewing_is_replaced_within_three_heartbeats() {
        let host = MemoryHost::default();
        let last = 5 * HEARTBEAT_MS;
        assert!(claim(&host, 1, SERVING, last).unwrap());
        assert!(!claim(&host, 3, IDLE, last + LEASE_MS - 1).unwrap());
        assert!(!claim(&host, 2, SERVING, last + LEASE_MS).unwrap(), "a serving VM leaves it to an idle one");
        assert!(claim(&host, 3, IDLE, last + LEASE_MS).unwrap(), "the idle VM first");

        for claimant in [IDLE, SERVING] {
            for phase in [1, 250, 499, 500, 501, 999] {
                let host = MemoryHost::default();
                assert!(claim(&host, 1, SERVING, last).unwrap());
                let beats = (0..10).map(|k| last + phase + k * HEARTBEAT_MS);
                let taken = beats.clone().find(|&t| claim(&host, 2, claimant, t).unwrap()).unwrap();
                assert!(taken - last <= 3 * HEARTBEAT_MS, "{claimant:?} at phase {phase}: {} ms", taken - last);
            }
        }
    }

    /// A renewal up to half a heartbeat late keeps the lease.
    #[test]
    fn a_late_renewal_keeps_the_lease() {
        let host = MemoryHost::default();
        assert!(claim(&host, 1, IDLE, 0).unwrap());
        assert!(!claim(&host, 2, SERVING, HEARTBEAT_MS + SERVING_GRACE_MS - 1).unwrap());
        assert!(claim(&host, 1, IDLE, HEARTBEAT_MS + HEARTBEAT_MS / 2 - 1).unwrap(), "renewed late, still its");
    }

    #[test]
    fn a_singleton_takes_it_and_filter_vms_step_aside_while_it_lives() {
        let host = MemoryHost::default();
        assert!(claim(&host, 1, IDLE, 0).unwrap());
        assert!(claim(&host, 9, Claimant::Singleton, 100).unwrap(), "the singleton takes it at once");
        assert!(!claim(&host, 1, IDLE, 200).unwrap(), "the filter VM steps aside");
        assert!(claim(&host, 9, Claimant::Singleton, HEARTBEAT_MS).unwrap());
        assert!(claim(&host, 1, IDLE, HEARTBEAT_MS + LEASE_MS).unwrap(), "back once the singleton is gone");
    }
}
