//! The update log that keeps every VM's prefix trees equal to the service's: a ring of event
//! batches in fixed shared-data slots, a head counter beside it, and a periodic snapshot for a
//! replica that fell more than a ring behind.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::events::{apply, PrefixEvent};
use super::radix::RadixTree;
use super::wire;
use crate::host::{Host, HostError};
use crate::state::keys::{self, PREFIX_HEAD as HEAD, PREFIX_SNAPSHOT as SNAPSHOT};
use crate::state::shared::read_u64;

/// Batches the ring holds; a snapshot is written every quarter ring.
pub const LOG_SLOTS: u64 = 256;
const SNAPSHOT_EVERY: u64 = LOG_SLOTS / 4;

fn slot_key(batch: u64) -> String {
    keys::prefix_log_slot(batch % LOG_SLOTS)
}

#[derive(Debug, Serialize, Deserialize)]
struct Batch {
    batch: u64,
    first_seq: u64,
    events: Vec<PrefixEvent>,
}

#[derive(Debug, Default, Deserialize)]
struct Snapshot {
    next_batch: u64,
    trees: BTreeMap<String, RadixTree>,
    /// The sequence number the next event gets.
    #[serde(default)]
    next_seq: u64,
}

/// The snapshot as written: the trees borrowed, not cloned (they are the service's whole index).
#[derive(Serialize)]
struct SnapshotOf<'a> {
    next_batch: u64,
    trees: &'a BTreeMap<String, RadixTree>,
    next_seq: u64,
}

/// Per-model tree budgets in bytes; the same on the service and every replica.
#[derive(Debug, Clone, Default)]
pub struct Budgets(pub HashMap<String, u64>);

impl Budgets {
    fn of(&self, model: &str) -> u64 {
        self.0.get(model).copied().unwrap_or(0)
    }
}

/// The service's authoritative trees and the writer of the log.
#[derive(Debug)]
pub struct PrefixLog {
    trees: BTreeMap<String, RadixTree>,
    next_batch: u64,
    next_seq: u64,
    budgets: Budgets,
}

impl PrefixLog {
    pub fn new(budgets: Budgets) -> Self {
        Self { trees: BTreeMap::new(), next_batch: 0, next_seq: 0, budgets }
    }

    pub fn trees(&self) -> &BTreeMap<String, RadixTree> {
        &self.trees
    }

    pub fn head(&self) -> u64 {
        self.next_batch
    }

    /// The budgets later events are applied under (a new configuration's).
    pub fn set_budgets(&mut self, budgets: Budgets) {
        self.budgets = budgets;
    }

    /// The log as its last writer left it in shared data (the snapshot and the batches after it),
    /// for a service that takes over the work (a new lease holder, the service's VM made again):
    /// the trees and every replica's copy carry on. Empty when nothing was published, or when what
    /// was cannot be read back whole.
    pub fn resume(host: &dyn Host, budgets: Budgets) -> Self {
        let mut replica = PrefixReplica::new(budgets.clone());
        match replica.refresh(host) {
            Ok(()) if replica.stalls == 0 => {
                Self { trees: replica.trees, next_batch: replica.next_batch, next_seq: replica.next_seq, budgets }
            }
            Ok(()) => {
                log::warn!("the prefix log could not be read back whole: starting it empty");
                Self::new(budgets)
            }
            Err(e) => {
                log::warn!("the prefix log could not be read back ({e}): starting it empty");
                Self::new(budgets)
            }
        }
    }

    /// Publishes the log's start: its snapshot and head (an empty log, or one [`Self::resume`]d).
    pub fn publish_start(&self, host: &dyn Host) -> Result<(), HostError> {
        self.write_snapshot(host)?;
        host.shared_set(HEAD, &self.next_batch.to_le_bytes(), None)
    }

    /// Applies `events` to the authoritative trees and appends them as one batch.
    pub fn append(&mut self, host: &dyn Host, events: Vec<PrefixEvent>) -> Result<(), HostError> {
        if events.is_empty() {
            return Ok(());
        }
        let first_seq = self.next_seq;
        for event in &events {
            let budgets = &self.budgets;
            apply(&mut self.trees, event, self.next_seq, &|m| budgets.of(m));
            self.next_seq += 1;
        }
        let batch = Batch { batch: self.next_batch, first_seq, events };
        let bytes = wire::encode(&batch)?;
        host.shared_set(&slot_key(self.next_batch), &bytes, None)?;
        self.next_batch += 1;
        host.shared_set(HEAD, &self.next_batch.to_le_bytes(), None)?;
        if self.next_batch % SNAPSHOT_EVERY == 0 {
            self.write_snapshot(host)?;
        }
        Ok(())
    }

    fn write_snapshot(&self, host: &dyn Host) -> Result<(), HostError> {
        let snapshot = SnapshotOf { next_batch: self.next_batch, trees: &self.trees, next_seq: self.next_seq };
        let bytes = wire::encode(&snapshot)?;
        host.shared_set(SNAPSHOT, &bytes, None)
    }
}

/// A worker VM's copy of the trees.
#[derive(Debug)]
pub struct PrefixReplica {
    trees: BTreeMap<String, RadixTree>,
    next_batch: u64,
    next_seq: u64,
    budgets: Budgets,
    resyncs: u64,
    stalls: u64,
}

impl PrefixReplica {
    pub fn new(budgets: Budgets) -> Self {
        Self { trees: BTreeMap::new(), next_batch: 0, next_seq: 0, budgets, resyncs: 0, stalls: 0 }
    }

    pub fn tree(&self, model: &str) -> Option<&RadixTree> {
        self.trees.get(model)
    }

    pub fn trees(&self) -> &BTreeMap<String, RadixTree> {
        &self.trees
    }

    /// The log version this replica has applied.
    pub fn version(&self) -> u64 {
        self.next_batch
    }

    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }

    /// Refreshes that stopped short of the head (see [`Self::refresh`]).
    pub fn stalls(&self) -> u64 {
        self.stalls
    }

    /// Reads the head (a few bytes) and applies whatever batches are new. At most one resync and
    /// one pass over the ring per call: a slot that never decodes, or a snapshot more than a ring
    /// behind the head, leaves the replica where it is until a later call finds a newer snapshot
    /// (one is written every quarter ring), counted as a stall, instead of resyncing forever.
    pub fn refresh(&mut self, host: &dyn Host) -> Result<(), HostError> {
        let head = read_u64(host, HEAD)?.unwrap_or(0);
        let mut resynced = false;
        if head < self.next_batch || head - self.next_batch > LOG_SLOTS {
            // The service restarted (head went back) or the ring moved past us.
            self.resync(host)?;
            resynced = true;
        }
        while self.next_batch < head {
            let raw = host.shared_get(&slot_key(self.next_batch))?;
            let batch: Option<Batch> = raw.and_then(|v| wire::decode(&v.bytes).ok());
            match batch {
                Some(b) if b.batch == self.next_batch => {
                    for (i, event) in b.events.iter().enumerate() {
                        let budgets = &self.budgets;
                        apply(&mut self.trees, event, b.first_seq.saturating_add(i as u64), &|m| budgets.of(m));
                    }
                    self.next_seq = b.first_seq.saturating_add(b.events.len() as u64);
                    self.next_batch += 1;
                }
                // Overwritten under us: start again from the snapshot, once.
                _ if !resynced => {
                    self.resync(host)?;
                    resynced = true;
                }
                _ => {
                    self.stalls += 1;
                    break;
                }
            }
        }
        Ok(())
    }

    fn resync(&mut self, host: &dyn Host) -> Result<(), HostError> {
        let snapshot: Snapshot = match host.shared_get(SNAPSHOT)? {
            Some(v) => wire::decode(&v.bytes)?,
            None => Snapshot::default(),
        };
        self.trees = snapshot.trees;
        for t in self.trees.values_mut() {
            t.rebuild_index();
        }
        self.next_batch = snapshot.next_batch;
        self.next_seq = snapshot.next_seq;
        self.resyncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::state::prefix::Tier;
    use crate::testing::test;

    fn budgets() -> Budgets {
        Budgets([("m".to_string(), 4096u64)].into_iter().collect())
    }

    fn stored(i: u64) -> PrefixEvent {
        PrefixEvent::Stored {
            model: "m".into(),
            worker: ["A", "B"][(i % 2) as usize].into(),
            text: format!("system prompt {} / user {i}", i % 7),
            tier: Tier::Gpu,
            sent_ms: 0,
        }
    }

    #[test]
    fn replicas_follow_the_log_and_agree_with_the_service() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        let mut replica = PrefixReplica::new(budgets());
        for i in 0..40 {
            log.append(&host, vec![stored(i), stored(i + 1000)]).unwrap();
            if i % 3 == 0 {
                replica.refresh(&host).unwrap();
            }
        }
        replica.refresh(&host).unwrap();
        assert_eq!(replica.version(), log.head());
        assert_eq!(replica.trees(), log.trees());
        assert_eq!(replica.resyncs(), 0);
    }

    /// A service that takes over (a new lease holder) carries the log on: its trees are the old
    /// writer's, replicas see no restart, and what it appends next reaches them as before.
    #[test]
    fn a_new_writer_resumes_the_log_and_replicas_carry_on() {
        let host = MemoryHost::default();
        let mut old = PrefixLog::new(budgets());
        old.publish_start(&host).unwrap();
        let mut replica = PrefixReplica::new(budgets());
        for i in 0..(LOG_SLOTS + 70) {
            old.append(&host, vec![stored(i)]).unwrap();
        }
        replica.refresh(&host).unwrap();
        let resyncs = replica.resyncs();
        let mut new = PrefixLog::resume(&host, budgets());
        assert_eq!((new.head(), new.trees()), (old.head(), old.trees()), "the old writer's log, whole");
        new.publish_start(&host).unwrap();
        new.append(&host, vec![stored(9_999)]).unwrap();
        old.append(&MemoryHost::default(), vec![stored(9_999)]).unwrap();
        replica.refresh(&host).unwrap();
        assert_eq!(replica.resyncs(), resyncs, "no resync: the head never went back");
        assert_eq!(replica.trees(), new.trees());
        assert_eq!(new.trees(), old.trees(), "the same event at the same sequence on both");
        let empty = PrefixLog::resume(&MemoryHost::default(), budgets());
        assert_eq!((empty.head(), empty.trees().len()), (0, 0), "nothing published: empty");
    }

    #[test]
    fn a_replica_that_fell_a_ring_behind_resyncs_from_the_snapshot() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        let mut replica = PrefixReplica::new(budgets());
        replica.refresh(&host).unwrap();
        for i in 0..(LOG_SLOTS * 2 + 7) {
            log.append(&host, vec![stored(i)]).unwrap();
        }
        replica.refresh(&host).unwrap();
        assert_eq!(replica.version(), log.head());
        assert_eq!(replica.trees(), log.trees());
        assert_eq!(replica.resyncs(), 1);
    }

    /// A slot that never decodes, with a snapshot from before it, once sent `refresh` between the
    /// slot and the snapshot forever, on every request of the VM.
    #[test]
    fn a_slot_that_never_decodes_stalls_the_replica_once_per_refresh_and_is_counted() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        for i in 0..5 {
            log.append(&host, vec![stored(i)]).unwrap();
        }
        host.shared_set(&slot_key(2), b"\xc1 not msgpack", None).unwrap();
        let mut replica = PrefixReplica::new(budgets());
        replica.refresh(&host).unwrap();
        assert_eq!((replica.version(), replica.resyncs(), replica.stalls()), (2, 1, 1));
        replica.refresh(&host).unwrap();
        assert_eq!((replica.version(), replica.resyncs(), replica.stalls()), (2, 2, 2), "one resync per call");
        // The next snapshot (every quarter ring) carries the replica past the bad slot.
        for i in 5..SNAPSHOT_EVERY {
            log.append(&host, vec![stored(i)]).unwrap();
        }
        replica.refresh(&host).unwrap();
        assert_eq!((replica.version(), replica.trees()), (log.head(), log.trees()));
    }

    /// A snapshot more than a ring behind the head cannot be caught up from the ring: stop there.
    #[test]
    fn a_snapshot_more_than_a_ring_behind_is_not_chased() {
        let host = MemoryHost::default();
        let log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        host.shared_set(HEAD, &(LOG_SLOTS * 3).to_le_bytes(), None).unwrap();
        let mut replica = PrefixReplica::new(budgets());
        replica.refresh(&host).unwrap();
        assert_eq!((replica.version(), replica.resyncs(), replica.stalls()), (0, 1, 1));
    }

    #[test]
    fn a_late_vm_starts_from_the_snapshot_and_catches_up() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        for i in 0..100 {
            log.append(&host, vec![stored(i)]).unwrap();
        }
        let mut late = PrefixReplica::new(budgets());
        late.refresh(&host).unwrap();
        assert_eq!(late.trees(), log.trees());
    }

    #[test]
    fn the_snapshot_is_close_to_the_trees_byte_size() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(Budgets([("m".to_string(), 1 << 20)].into_iter().collect()));
        for i in 0..LOG_SLOTS / 4 {
            let text = format!("{i} {}", "distinct prompt text ".repeat(50));
            log.append(
                &host,
                vec![PrefixEvent::Stored { model: "m".into(), worker: "A".into(), text, tier: Tier::Gpu, sent_ms: 0 }],
            )
            .unwrap();
        }
        let tree = log.trees()["m"].size_bytes();
        let snapshot = host.shared_get(SNAPSHOT).unwrap().unwrap().bytes.len() as u64;
        // Edges as binary plus a few dozen bytes per node; JSON was ~3.8 times the tree.
        assert!(snapshot < tree + tree / 10, "snapshot {snapshot} bytes for a tree of {tree}");
    }

    #[test]
    fn a_restarted_service_resets_the_replicas() {
        let host = MemoryHost::default();
        let mut log = PrefixLog::new(budgets());
        log.publish_start(&host).unwrap();
        for i in 0..10 {
            log.append(&host, vec![stored(i)]).unwrap();
        }
        let mut replica = PrefixReplica::new(budgets());
        replica.refresh(&host).unwrap();
        let mut restarted = PrefixLog::new(budgets());
        restarted.publish_start(&host).unwrap();
        restarted.append(&host, vec![stored(99)]).unwrap();
        replica.refresh(&host).unwrap();
        assert_eq!(replica.trees(), restarted.trees());
    }
}
