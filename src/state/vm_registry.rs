//! Which filter VMs are alive. Each VM heartbeats into one bounded shared key; the service drops
//! VMs that stopped (a crashed VM is recreated with a new id by FAIL_RELOAD) and reclaims what they
//! held.

use super::keys;
use super::shared::{decode_u64, update};
use crate::host::{Host, HostError};

/// A VM that has not heartbeated for this long is gone.
pub const DEAD_AFTER_MS: u64 = 10_000;
/// How often a filter VM heartbeats.
pub const HEARTBEAT_MS: u64 = 1_000;

/// Slots a VM's own gauges are labelled with. A crash loop makes a new VM id each time and Envoy
/// keeps every series a VM defined, so gauges carry the VM's slot, which a VM takes when it first
/// heartbeats and the sweep frees: at most this many series per gauge, however many VMs came and
/// went. A VM that finds none free exports no per-VM gauges.
pub const VM_SLOTS: u64 = 64;

/// Leads every value: shared data reads an empty value as absent, so an empty list needs a header.
const HEADER: [u8; 8] = *b"sglvms03";
const ENTRY: usize = 32;

/// One live VM: its id, when it last heartbeated, its gauge slot ([`VM_SLOTS`] = none), and
/// whether it has served a request (Envoy's main thread runs a filter VM too, which never does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    vm: u64,
    seen_ms: u64,
    slot: u64,
    serving: bool,
}

fn decode(bytes: &[u8]) -> Vec<Entry> {
    let entries = if bytes.starts_with(&HEADER) { &bytes[HEADER.len()..] } else { &[][..] };
    entries
        .chunks_exact(ENTRY)
        .filter_map(|c| {
            Some(Entry {
                vm: decode_u64(c.get(..8)?)?,
                seen_ms: decode_u64(c.get(8..16)?)?,
                slot: decode_u64(c.get(16..24)?)?,
                serving: decode_u64(c.get(24..)?)? != 0,
            })
        })
        .collect()
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let body = entries
        .iter()
        .flat_map(|e| [e.vm, e.seen_ms, e.slot, u64::from(e.serving)].into_iter().flat_map(u64::to_le_bytes));
    HEADER.into_iter().chain(body).collect()
}

/// What a heartbeat learned: this VM's gauge slot (`None` when every slot is taken) and how many
/// live filter VMs have served requests, itself included once it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    pub slot: Option<u64>,
    pub serving: usize,
}

/// Records that `vm` is alive, and that it serves requests once `serving` (it stays so).
pub fn heartbeat(host: &dyn Host, vm: u64, now_ms: u64, serving: bool) -> Result<Heartbeat, HostError> {
    update(host, keys::VMS, &HEADER, |bytes| {
        let mut entries = decode(bytes);
        let slot = match entries.iter_mut().find(|e| e.vm == vm) {
            Some(entry) => {
                entry.seen_ms = now_ms;
                entry.serving |= serving;
                entry.slot
            }
            None => {
                let slot = (0..VM_SLOTS).find(|s| entries.iter().all(|e| e.slot != *s)).unwrap_or(VM_SLOTS);
                entries.push(Entry { vm, seen_ms: now_ms, slot, serving });
                slot
            }
        };
        let serving = entries.iter().filter(|e| e.serving && now_ms.saturating_sub(e.seen_ms) <= DEAD_AFTER_MS).count();
        (encode(&entries), Heartbeat { slot: (slot < VM_SLOTS).then_some(slot), serving })
    })
}

/// Whether this VM is the only filter VM serving requests, as its heartbeats see it. A VM counts as
/// alone only after two heartbeats in a row found no other serving VM; one heartbeat that finds
/// another ends it at once. A VM heartbeats as soon as it serves its first request, so the others
/// learn of it at their next heartbeat.
#[derive(Debug, Default)]
pub struct Solitude {
    heartbeats_alone: std::sync::atomic::AtomicU8,
}

impl Solitude {
    pub fn observe(&self, heartbeat: Heartbeat) {
        use std::sync::atomic::Ordering;
        let streak =
            if heartbeat.serving <= 1 { self.heartbeats_alone.load(Ordering::Relaxed).saturating_add(1) } else { 0 };
        self.heartbeats_alone.store(streak, Ordering::Relaxed);
    }

    pub fn alone(&self) -> bool {
        self.heartbeats_alone.load(std::sync::atomic::Ordering::Relaxed) >= 2
    }
}

/// Removes VMs silent for [`DEAD_AFTER_MS`] (their slots free) and returns their ids.
pub fn sweep(host: &dyn Host, now_ms: u64) -> Result<Vec<u64>, HostError> {
    update(host, keys::VMS, &HEADER, |bytes| {
        let (alive, dead): (Vec<_>, Vec<_>) =
            decode(bytes).into_iter().partition(|e| now_ms.saturating_sub(e.seen_ms) <= DEAD_AFTER_MS);
        (encode(&alive), dead.into_iter().map(|e| e.vm).collect())
    })
}

pub fn alive(host: &dyn Host) -> Result<Vec<u64>, HostError> {
    Ok(host.shared_get(keys::VMS)?.map(|v| decode(&v.bytes).into_iter().map(|e| e.vm).collect()).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    #[test]
    fn silent_vms_are_swept_and_live_ones_kept() {
        let host = MemoryHost::default();
        heartbeat(&host, 1, 0, true).unwrap();
        heartbeat(&host, 2, 0, true).unwrap();
        heartbeat(&host, 2, 9_000, true).unwrap();
        assert_eq!(sweep(&host, 10_000).unwrap(), Vec::<u64>::new());
        assert_eq!(sweep(&host, 10_001).unwrap(), vec![1]);
        assert_eq!(alive(&host).unwrap(), vec![2]);
    }

    /// Each VM a crash loop makes has a new id; its gauges take a freed slot, so the series stay
    /// as many as the VMs alive at once, not as many as ever lived.
    #[test]
    fn a_crash_loop_reuses_gauge_slots() {
        let host = MemoryHost::default();
        assert_eq!(heartbeat(&host, 7, 0, true).unwrap().slot, Some(0));
        let mut slots = std::collections::HashSet::new();
        for vm in 100..1_100u64 {
            let now = vm * 20_000;
            slots.insert(heartbeat(&host, vm, now, true).unwrap().slot);
            heartbeat(&host, 7, now, true).unwrap();
            sweep(&host, now + DEAD_AFTER_MS + 1).unwrap();
            assert_eq!(
                heartbeat(&host, 7, now + DEAD_AFTER_MS + 1, true).unwrap().slot,
                Some(0),
                "a live VM keeps its slot"
            );
        }
        assert_eq!(slots.into_iter().collect::<Vec<_>>(), [Some(1)]);
        for vm in 0..VM_SLOTS {
            heartbeat(&host, 10_000 + vm, 0, true).unwrap();
        }
        assert_eq!(heartbeat(&host, 99_999, 0, true).unwrap().slot, None, "every slot taken: no per-VM gauges");
    }

    #[test]
    fn a_vm_is_alone_after_two_heartbeats_that_found_no_other_and_not_after_one_that_did() {
        let host = MemoryHost::default();
        let solitude = Solitude::default();
        heartbeat(&host, 9, 0, false).unwrap(); // Envoy's main-thread VM: alive, never serving
        solitude.observe(heartbeat(&host, 1, 0, true).unwrap());
        assert!(!solitude.alone(), "one heartbeat is not enough: a second VM may be starting");
        solitude.observe(heartbeat(&host, 1, 1_000, true).unwrap());
        assert!(solitude.alone());
        heartbeat(&host, 2, 1_500, true).unwrap();
        solitude.observe(heartbeat(&host, 1, 2_000, true).unwrap());
        assert!(!solitude.alone(), "another VM heartbeated: at once not alone");
        // The other stops; it counts as alive until DEAD_AFTER_MS.
        solitude.observe(heartbeat(&host, 1, 2_000 + DEAD_AFTER_MS, true).unwrap());
        assert!(!solitude.alone());
        solitude.observe(heartbeat(&host, 1, 3_000 + DEAD_AFTER_MS, true).unwrap());
        solitude.observe(heartbeat(&host, 1, 4_000 + DEAD_AFTER_MS, true).unwrap());
        assert!(solitude.alone());
    }
}
