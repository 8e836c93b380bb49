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
        Self {
            table,
            worker: worker.to_string(),
        }
    }

    pub fn worker(&self) -> &str {
        &self.worker
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
        self.counts
            .lock()
            .ok()
            .and_then(|c| c.get(worker).map(|v| v.0))
            .unwrap_or(0)
    }

    fn dispatched_total(&self, worker: &str) -> u64 {
        self.counts
            .lock()
            .ok()
            .and_then(|c| c.get(worker).map(|v| v.1))
            .unwrap_or(0)
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

/// In-flight counts in shared data, one fixed key per worker, updated with cas by every VM.
pub struct SharedInflight {
    host: Arc<dyn crate::host::Host>,
}

impl SharedInflight {
    pub fn new(host: Arc<dyn crate::host::Host>) -> Self {
        Self { host }
    }

    fn read(&self, worker: &str) -> (u64, u64) {
        match self.host.shared_get(&crate::state::keys::inflight(worker)) {
            Ok(Some(v)) => decode_pair(&v.bytes),
            _ => (0, 0),
        }
    }

    fn change(&self, worker: &str, f: impl Fn((u64, u64)) -> (u64, u64)) {
        let key = crate::state::keys::inflight(worker);
        let result =
            crate::state::shared::update(self.host.as_ref(), &key, &encode_pair((0, 0)), |bytes| {
                (encode_pair(f(decode_pair(bytes))), ())
            });
        if let Err(e) = result {
            log::warn!("in-flight count of {worker} not updated: {e}");
        }
    }
}

impl std::fmt::Debug for SharedInflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedInflight")
    }
}

fn encode_pair((inflight, total): (u64, u64)) -> Vec<u8> {
    let mut v = inflight.to_le_bytes().to_vec();
    v.extend_from_slice(&total.to_le_bytes());
    v
}

fn decode_pair(bytes: &[u8]) -> (u64, u64) {
    let word = |i: usize| {
        bytes
            .get(i * 8..i * 8 + 8)
            .and_then(crate::state::shared::decode_u64)
            .unwrap_or(0)
    };
    (word(0), word(1))
}

impl InflightTable for SharedInflight {
    fn inflight(&self, worker: &str) -> u64 {
        self.read(worker).0
    }

    fn dispatched_total(&self, worker: &str) -> u64 {
        self.read(worker).1
    }

    fn acquire(&self, worker: &str) {
        self.change(worker, |(n, total)| {
            (n.saturating_add(1), total.saturating_add(1))
        });
    }

    fn release(&self, worker: &str) {
        self.change(worker, |(n, total)| (n.saturating_sub(1), total));
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;
    use crate::host::MemoryHost;

    #[test]
    fn shared_counts_are_seen_by_every_vm_and_never_go_below_zero() {
        let host: Arc<dyn crate::host::Host> = Arc::new(MemoryHost::default());
        let vm1 = SharedInflight::new(Arc::clone(&host));
        let vm2 = SharedInflight::new(host);
        vm1.acquire("A");
        vm2.acquire("A");
        assert_eq!((vm1.inflight("A"), vm2.inflight("A")), (2, 2));
        vm2.release("A");
        vm1.release("A");
        vm1.release("A");
        assert_eq!((vm2.inflight("A"), vm2.dispatched_total("A")), (0, 2));
    }
}
