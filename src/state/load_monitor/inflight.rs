//! Router-local in-flight accounting: requests dispatched to an engine and not yet finished, and a
//! cumulative dispatch counter for correcting reports by what was sent since.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The one shared counter per engine (design §6). Backed by shared data in Envoy.
pub trait InflightTable: Send + Sync + std::fmt::Debug {
    fn inflight(&self, worker: &str) -> u64;
    fn dispatched_total(&self, worker: &str) -> u64;
    fn acquire(&self, worker: &str);
    /// Never goes below zero.
    fn release(&self, worker: &str);
}

/// Holds one in-flight slot of a worker until dropped: the stage's end, however it ends.
#[derive(Debug)]
pub struct InflightGuard {
    table: Arc<dyn InflightTable>,
    worker: String,
}

impl InflightGuard {
    pub fn acquire(table: Arc<dyn InflightTable>, worker: &str) -> Self {
        table.acquire(worker);
        Self { table, worker: worker.to_string() }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.table.release(&self.worker);
    }
}

/// In-memory counts for tests.
#[derive(Debug, Default)]
pub struct MemoryInflight {
    counts: Mutex<HashMap<String, (u64, u64)>>,
}

impl MemoryInflight {
    pub fn set(&self, worker: &str, inflight: u64) {
        if let Ok(mut c) = self.counts.lock() {
            c.entry(worker.to_string()).or_default().0 = inflight;
        }
    }
}

impl InflightTable for MemoryInflight {
    fn inflight(&self, worker: &str) -> u64 {
        self.counts.lock().ok().and_then(|c| c.get(worker).map(|v| v.0)).unwrap_or(0)
    }

    fn dispatched_total(&self, worker: &str) -> u64 {
        self.counts.lock().ok().and_then(|c| c.get(worker).map(|v| v.1)).unwrap_or(0)
    }

    fn acquire(&self, worker: &str) {
        if let Ok(mut c) = self.counts.lock() {
            let e = c.entry(worker.to_string()).or_default();
            e.0 += 1;
            e.1 += 1;
        }
    }

    fn release(&self, worker: &str) {
        if let Ok(mut c) = self.counts.lock() {
            let e = c.entry(worker.to_string()).or_default();
            e.0 = e.0.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_release_on_drop_and_never_go_below_zero() {
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let a = InflightGuard::acquire(Arc::clone(&table), "A");
        let _b = InflightGuard::acquire(Arc::clone(&table), "A");
        assert_eq!(table.inflight("A"), 2);
        drop(a);
        assert_eq!(table.inflight("A"), 1);
        table.release("A");
        table.release("A");
        assert_eq!(table.inflight("A"), 0);
        assert_eq!(table.dispatched_total("A"), 2);
    }
}

/// In-flight counts in shared data, one fixed key per worker. Each VM keeps its own share inside
/// the key, so the share of a VM that crashed can be reclaimed without touching anyone else's;
/// the dispatch total of a reclaimed share is kept, so corrections never jump backwards.
pub struct SharedInflight {
    host: Arc<dyn crate::host::Host>,
    vm: u64,
}

/// The decoded value of one worker's key.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shares {
    retired_total: u64,
    /// (vm, in flight, dispatched total)
    vms: Vec<(u64, u64, u64)>,
}

impl Shares {
    fn decode(bytes: &[u8]) -> Self {
        let word = |c: &[u8], i: usize| c.get(i * 8..i * 8 + 8).and_then(crate::state::shared::decode_u64).unwrap_or(0);
        let retired_total = word(bytes, 0);
        let vms =
            bytes.get(8..).unwrap_or_default().chunks_exact(24).map(|c| (word(c, 0), word(c, 1), word(c, 2))).collect();
        Self { retired_total, vms }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = self.retired_total.to_le_bytes().to_vec();
        for (vm, n, total) in &self.vms {
            out.extend_from_slice(&vm.to_le_bytes());
            out.extend_from_slice(&n.to_le_bytes());
            out.extend_from_slice(&total.to_le_bytes());
        }
        out
    }

    fn inflight(&self) -> u64 {
        self.vms.iter().map(|v| v.1).fold(0, u64::saturating_add)
    }

    fn total(&self) -> u64 {
        self.vms.iter().map(|v| v.2).fold(self.retired_total, u64::saturating_add)
    }

    fn own(&mut self, vm: u64) -> &mut (u64, u64, u64) {
        let i = match self.vms.iter().position(|v| v.0 == vm) {
            Some(i) => i,
            None => {
                self.vms.push((vm, 0, 0));
                self.vms.len() - 1
            }
        };
        &mut self.vms[i]
    }
}

impl SharedInflight {
    /// `vm` identifies this VM's share; it must be unique per VM instance.
    pub fn new(host: Arc<dyn crate::host::Host>, vm: u64) -> Self {
        Self { host, vm }
    }

    fn read(&self, worker: &str) -> Shares {
        match self.host.shared_get(&crate::state::keys::inflight(worker)) {
            Ok(Some(v)) => Shares::decode(&v.bytes),
            _ => Shares::default(),
        }
    }

    fn change(&self, worker: &str, f: impl Fn(&mut Shares)) {
        let key = crate::state::keys::inflight(worker);
        let result = crate::state::shared::update(self.host.as_ref(), &key, &Shares::default().encode(), |bytes| {
            let mut shares = Shares::decode(bytes);
            f(&mut shares);
            (shares.encode(), ())
        });
        if let Err(e) = result {
            log::warn!("in-flight count of {worker} not updated: {e}");
        }
    }

    /// The service's sweep: folds the shares of dead VMs away, keeping their dispatch totals.
    pub fn reclaim(host: &dyn crate::host::Host, worker: &str, dead: &[u64]) -> Result<u64, crate::host::HostError> {
        let key = crate::state::keys::inflight(worker);
        crate::state::shared::update(host, &key, &Shares::default().encode(), |bytes| {
            let mut shares = Shares::decode(bytes);
            let mut reclaimed = 0;
            shares.vms.retain(|(vm, n, total)| {
                if dead.contains(vm) {
                    shares.retired_total = shares.retired_total.saturating_add(*total);
                    reclaimed += n;
                    false
                } else {
                    true
                }
            });
            (shares.encode(), reclaimed)
        })
    }
}

impl std::fmt::Debug for SharedInflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedInflight").field("vm", &self.vm).finish()
    }
}

impl InflightTable for SharedInflight {
    fn inflight(&self, worker: &str) -> u64 {
        self.read(worker).inflight()
    }

    fn dispatched_total(&self, worker: &str) -> u64 {
        self.read(worker).total()
    }

    fn acquire(&self, worker: &str) {
        let vm = self.vm;
        self.change(worker, |s| {
            let own = s.own(vm);
            own.1 = own.1.saturating_add(1);
            own.2 = own.2.saturating_add(1);
        });
    }

    fn release(&self, worker: &str) {
        let vm = self.vm;
        self.change(worker, |s| {
            let own = s.own(vm);
            own.1 = own.1.saturating_sub(1);
        });
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;
    use crate::host::MemoryHost;

    #[test]
    fn shared_counts_are_seen_by_every_vm_and_never_go_below_zero() {
        let host: Arc<dyn crate::host::Host> = Arc::new(MemoryHost::default());
        let vm1 = SharedInflight::new(Arc::clone(&host), 1);
        let vm2 = SharedInflight::new(host, 2);
        vm1.acquire("A");
        vm2.acquire("A");
        assert_eq!((vm1.inflight("A"), vm2.inflight("A")), (2, 2));
        vm2.release("A");
        vm1.release("A");
        vm1.release("A");
        assert_eq!((vm2.inflight("A"), vm2.dispatched_total("A")), (0, 2));
    }

    #[test]
    fn a_dead_vms_share_is_reclaimed_and_its_dispatches_still_count() {
        let host: Arc<dyn crate::host::Host> = Arc::new(MemoryHost::default());
        let crashed = SharedInflight::new(Arc::clone(&host), 1);
        let alive = SharedInflight::new(Arc::clone(&host), 2);
        crashed.acquire("A");
        crashed.acquire("A");
        alive.acquire("A");
        assert_eq!(alive.inflight("A"), 3);
        assert_eq!(SharedInflight::reclaim(host.as_ref(), "A", &[1]).unwrap(), 2);
        assert_eq!((alive.inflight("A"), alive.dispatched_total("A")), (1, 3));
        alive.release("A");
        assert_eq!(alive.inflight("A"), 0);
    }

    #[test]
    fn concurrent_updates_from_many_vms_are_not_lost() {
        // Interleave read-modify-write cycles: every VM reads, then every VM writes with its cas.
        let host = Arc::new(MemoryHost::default());
        let vms: Vec<SharedInflight> = (0..8).map(|vm| SharedInflight::new(host.clone(), vm)).collect();
        for round in 0..50 {
            for vm in &vms {
                vm.acquire("A");
                if round % 2 == 1 {
                    vm.release("A");
                }
            }
        }
        assert_eq!(vms[0].inflight("A"), 8 * 25);
        assert_eq!(vms[3].dispatched_total("A"), 8 * 50);
    }
}
