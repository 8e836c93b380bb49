//! One model's waiting queue, logical across worker VMs (spec §9). Its entries live in one
//! shared-data key per model, in the order they are served: higher priority first, then fair-share
//! round, then arrival. Every VM joins, leaves and reads it with cas; a request waits in its own VM
//! (the key holds only its place), and that VM may try it only when [`Board::turns`] says so.
//!
//! Fair share is start-time fair queueing without per-tenant state: a request's round is one past
//! the last round its tenant holds at its priority, and never below the round served last. With two
//! tenants waiting, one request of each is served per round, whatever each sent.
//!
//! Across VMs: the first `v` entries may be tried, `v` the number of VMs with a request waiting, so
//! each VM's next request can be tried as capacity frees; once the first entry has been first for
//! [`HEAD_GRACE_MS`], it alone may be tried for the next [`HEAD_HOLD_MS`]. So a request first in
//! line is passed by requests behind it, on any VM, only in its first 20 ms there; only higher
//! priorities and earlier rounds go before it. A first entry that cannot go within its hold (its VM
//! died, or no bucket that fits it has room) stops holding the others back.

use std::cmp::Reverse;

use crate::host::{Host, HostError};
use crate::state::keys::waiting_queue as key;
use crate::state::shared::{stable_hash, update};

/// How long the first entry may be passed by the ones behind it (another VM's next tick).
pub const HEAD_GRACE_MS: u64 = 20;

/// How long, after its grace, the first entry alone may be tried.
pub const HEAD_HOLD_MS: u64 = 500;

/// Priorities are clamped to ±this: the order stays total and the stats' labels stay bounded.
pub const PRIORITY_LIMIT: i64 = 100;

/// An entry outlives its own deadline by this much: a VM that crashed cannot remove its entries,
/// and any writer purges them after it.
const ORPHAN_GRACE_MS: u64 = 1_000;

const HEADER: [u8; 8] = *b"sglque01";
const HEADER_BYTES: usize = 8 + 8 + 8 + 8 + 4 + 8 + 4;
const ENTRY_BYTES: usize = 8 + 4 + 4 + 8 + 8 + 8 + 8;

/// The tenant header's value as the queue keeps it: a fixed size, whatever the value's length.
pub fn tenant(value: &str) -> u64 {
    let h = stable_hash([value]);
    (h >> 64) as u64 ^ h as u64
}

/// Clamps a client's priority into the range the queue orders by.
pub fn clamp_priority(value: i64) -> i32 {
    // Within ±PRIORITY_LIMIT, so the conversion holds.
    i32::try_from(value.clamp(-PRIORITY_LIMIT, PRIORITY_LIMIT)).unwrap_or(0)
}

/// Why a request left the queue without being dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueExit {
    Full,
    Timeout,
    ClientGone,
}

impl QueueExit {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueExit::Full => "queue_full",
            QueueExit::Timeout => "queue_timeout",
            QueueExit::ClientGone => "client_gone",
        }
    }
}

/// One waiting request's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The VM it waits in, and its id there (the stream's context id).
    pub vm: u64,
    pub id: u32,
    pub priority: i32,
    /// A fixed-size hash of the tenant header's value.
    pub tenant: u64,
    pub round: u64,
    pub arrival: u64,
    /// When any writer may drop it.
    pub expires_ms: u64,
}

impl Entry {
    fn order(&self) -> (Reverse<i32>, u64, u64) {
        (Reverse(self.priority), self.round, self.arrival)
    }
}

/// A request asking to join.
#[derive(Debug, Clone, Copy)]
pub struct Joining {
    pub vm: u64,
    pub id: u32,
    pub priority: i32,
    pub tenant: u64,
    pub deadline_ms: u64,
}

/// The queue as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Board {
    next_arrival: u64,
    /// The round of the last request served.
    round: u64,
    /// The first entry, and since when it is.
    head: Option<(u64, u32)>,
    head_since_ms: u64,
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error("the queue holds {0} requests, its limit")]
    Full(usize),
    #[error(transparent)]
    Host(#[from] HostError),
}

impl Board {
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let rest = bytes.strip_prefix(&HEADER)?;
        let mut r = Reader(rest);
        let next_arrival = r.u64()?;
        let round = r.u64()?;
        let head_vm = r.u64()?;
        let head_id = r.u32()?;
        let head_since_ms = r.u64()?;
        let n = r.u32()? as usize;
        if r.0.len() != n.checked_mul(ENTRY_BYTES)? {
            return None;
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push(Entry {
                vm: r.u64()?,
                id: r.u32()?,
                priority: i32::from_le_bytes(r.u32()?.to_le_bytes()),
                tenant: r.u64()?,
                round: r.u64()?,
                arrival: r.u64()?,
                expires_ms: r.u64()?,
            });
        }
        let head = (head_vm != 0).then_some((head_vm, head_id));
        Some(Self { next_arrival, round, head, head_since_ms, entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER.len() + HEADER_BYTES + self.entries.len() * ENTRY_BYTES);
        out.extend_from_slice(&HEADER);
        out.extend_from_slice(&self.next_arrival.to_le_bytes());
        out.extend_from_slice(&self.round.to_le_bytes());
        let (head_vm, head_id) = self.head.unwrap_or((0, 0));
        out.extend_from_slice(&head_vm.to_le_bytes());
        out.extend_from_slice(&head_id.to_le_bytes());
        out.extend_from_slice(&self.head_since_ms.to_le_bytes());
        out.extend_from_slice(&u32::try_from(self.entries.len()).unwrap_or(u32::MAX).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.vm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
            out.extend_from_slice(&e.priority.to_le_bytes());
            out.extend_from_slice(&e.tenant.to_le_bytes());
            out.extend_from_slice(&e.round.to_le_bytes());
            out.extend_from_slice(&e.arrival.to_le_bytes());
            out.extend_from_slice(&e.expires_ms.to_le_bytes());
        }
        out
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The ids of `vm`'s entries that may be tried now, in order (see the module documentation).
    pub fn turns(&self, vm: u64, now_ms: u64) -> Vec<u32> {
        let first_for = now_ms.saturating_sub(self.head_since_ms);
        let window = if (HEAD_GRACE_MS..HEAD_GRACE_MS + HEAD_HOLD_MS).contains(&first_for) {
            1
        } else {
            let mut vms: Vec<u64> = self.entries.iter().map(|e| e.vm).collect();
            vms.sort_unstable();
            vms.dedup();
            vms.len().max(1)
        };
        self.entries.iter().take(window).filter(|e| e.vm == vm).map(|e| e.id).collect()
    }

    fn purge(&mut self, now_ms: u64) {
        self.entries.retain(|e| e.expires_ms > now_ms);
    }

    /// Keeps `head` naming the first entry, and when it became first.
    fn mark_head(&mut self, now_ms: u64) {
        let first = self.entries.first().map(|e| (e.vm, e.id));
        if first != self.head {
            self.head = first;
            self.head_since_ms = now_ms;
        }
    }

    fn join(&mut self, joining: &Joining, max: usize, now_ms: u64) -> Result<(), usize> {
        self.purge(now_ms);
        if self.entries.iter().any(|e| e.vm == joining.vm && e.id == joining.id) {
            return Ok(());
        }
        if self.entries.len() >= max {
            return Err(self.entries.len());
        }
        let held = self.entries.iter().filter(|e| e.tenant == joining.tenant && e.priority == joining.priority);
        let round = held.map(|e| e.round + 1).max().unwrap_or(0).max(self.round);
        let entry = Entry {
            vm: joining.vm,
            id: joining.id,
            priority: joining.priority,
            tenant: joining.tenant,
            round,
            arrival: self.next_arrival,
            expires_ms: joining.deadline_ms.saturating_add(ORPHAN_GRACE_MS),
        };
        self.next_arrival += 1;
        let at = self.entries.partition_point(|e| e.order() <= entry.order());
        self.entries.insert(at, entry);
        self.mark_head(now_ms);
        Ok(())
    }

    fn leave(&mut self, vm: u64, id: u32, served: bool, now_ms: u64) {
        if let Some(at) = self.entries.iter().position(|e| e.vm == vm && e.id == id) {
            let entry = self.entries.remove(at);
            if served {
                self.round = self.round.max(entry.round);
            }
        }
        self.purge(now_ms);
        self.mark_head(now_ms);
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }

    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
}

/// Reads `model`'s queue; absent or undecodable reads as empty.
pub fn read(host: &dyn Host, model: &str) -> Result<Board, HostError> {
    Ok(host.shared_get(&key(model))?.and_then(|v| Board::decode(&v.bytes)).unwrap_or_default())
}

/// Adds a request to `model`'s queue of at most `max` requests; the queue as it now stands.
pub fn join(host: &dyn Host, model: &str, joining: &Joining, max: usize) -> Result<Board, JoinError> {
    let now = host.now_ms();
    let seed = Board::default().encode();
    let result = update(host, &key(model), &seed, |bytes| {
        let mut board = Board::decode(bytes).unwrap_or_default();
        match board.join(joining, max, now) {
            Ok(()) => (board.encode(), Ok(board)),
            Err(n) => (bytes.to_vec(), Err(n)),
        }
    })?;
    result.map_err(JoinError::Full)
}

/// Takes a request out of `model`'s queue: `served` when it was dispatched (its round is then the
/// one served last), not when it timed out or its client left.
pub fn leave(host: &dyn Host, model: &str, vm: u64, id: u32, served: bool) -> Result<(), HostError> {
    let now = host.now_ms();
    let seed = Board::default().encode();
    update(host, &key(model), &seed, |bytes| {
        let mut board = Board::decode(bytes).unwrap_or_default();
        board.leave(vm, id, served, now);
        (board.encode(), ())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    fn joining(vm: u64, id: u32, priority: i32, tenant: u64) -> Joining {
        Joining { vm, id, priority, tenant, deadline_ms: 1 << 40 }
    }

    fn ids(board: &Board) -> Vec<u32> {
        board.entries().iter().map(|e| e.id).collect()
    }

    #[test]
    fn higher_priority_first_then_arrival() {
        let host = MemoryHost::default();
        for (id, priority) in [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1)] {
            join(&host, "m", &joining(7, id, priority, 0), 16).unwrap();
        }
        assert_eq!(ids(&read(&host, "m").unwrap()), [2, 4, 1, 3, 5]);
    }

    #[test]
    fn tenants_take_turns_whatever_each_sent() {
        let host = MemoryHost::default();
        // Tenant 1 sends ten, then tenant 2 sends two.
        for id in 0..10 {
            join(&host, "m", &joining(7, id, 0, 1), 64).unwrap();
        }
        join(&host, "m", &joining(7, 100, 0, 2), 64).unwrap();
        join(&host, "m", &joining(7, 101, 0, 2), 64).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap())[..5], [0, 100, 1, 101, 2]);
        // A tenant that comes back after others were served joins the round being served: it
        // carries no credit from its idle time, and no debt from before.
        for id in [0, 100, 1, 101, 2, 3, 4] {
            leave(&host, "m", 7, id, true).unwrap();
        }
        join(&host, "m", &joining(7, 102, 0, 2), 64).unwrap();
        join(&host, "m", &joining(7, 103, 0, 2), 64).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap())[..4], [102, 5, 103, 6]);
    }

    #[test]
    fn a_full_queue_refuses_and_is_left_unchanged() {
        let host = MemoryHost::default();
        join(&host, "m", &joining(7, 1, 0, 0), 2).unwrap();
        join(&host, "m", &joining(7, 2, 0, 0), 2).unwrap();
        assert_eq!(join(&host, "m", &joining(7, 3, 0, 0), 2), Err(JoinError::Full(2)));
        assert_eq!(ids(&read(&host, "m").unwrap()), [1, 2]);
        // Joining twice keeps one place.
        leave(&host, "m", 7, 2, false).unwrap();
        join(&host, "m", &joining(7, 1, 0, 0), 2).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap()), [1]);
    }

    #[test]
    fn each_vm_may_try_its_next_but_a_first_past_its_grace_holds_the_others() {
        let host = MemoryHost::default();
        join(&host, "m", &joining(1, 10, 0, 0), 16).unwrap();
        join(&host, "m", &joining(1, 11, 0, 0), 16).unwrap();
        join(&host, "m", &joining(2, 20, 0, 0), 16).unwrap();
        let board = read(&host, "m").unwrap();
        let now = host.now_ms();
        // Two VMs wait: the first two entries may be tried, both VM 1's.
        assert_eq!(board.turns(1, now), [10, 11]);
        assert!(board.turns(2, now).is_empty());
        leave(&host, "m", 1, 10, true).unwrap();
        let board = read(&host, "m").unwrap();
        assert_eq!(board.turns(2, now), [20]);
        // The first has been first for the grace: it alone may be tried, for its hold.
        let later = now + HEAD_GRACE_MS;
        assert_eq!(board.turns(1, later), [11]);
        assert!(board.turns(2, later).is_empty());
        let stuck = later + HEAD_HOLD_MS;
        assert_eq!(board.turns(2, stuck), [20], "a first that cannot go stops holding the others back");
    }

    #[test]
    fn an_orphaned_entry_is_purged_by_the_next_writer_after_its_deadline() {
        let host = MemoryHost::default();
        let mut orphan = joining(1, 10, 0, 0);
        orphan.deadline_ms = host.now_ms();
        join(&host, "m", &orphan, 16).unwrap();
        host.advance_ms(ORPHAN_GRACE_MS + 1);
        join(&host, "m", &joining(2, 20, 0, 0), 16).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap()), [20]);
    }

    #[test]
    fn the_value_round_trips_and_garbage_reads_as_empty() {
        let host = MemoryHost::default();
        join(&host, "m", &joining(u64::MAX, u32::MAX, -100, 3), 16).unwrap();
        let board = read(&host, "m").unwrap();
        assert_eq!(Board::decode(&board.encode()), Some(board.clone()));
        assert_eq!(board.entries()[0].priority, -100);
        let mut bytes = board.encode();
        bytes.pop();
        assert_eq!(Board::decode(&bytes), None);
        assert_eq!(clamp_priority(i64::MAX), 100);
        assert_eq!(clamp_priority(-7), -7);
    }
}
