//! One model's waiting queue, logical across worker VMs (spec §9). Its entries live in one
//! shared-data key per model, in the order they are served; every VM joins, leaves and reads it
//! with cas. A request waits in its own VM (the key holds only its place, never its body).
//!
//! **Order**: higher class priority first; within a class, the smaller start tag; then arrival.
//!
//! **Fair share by work** (start-time fair queueing over tokens): each class keeps a virtual time,
//! the start tag of the request it served last. A joining request of a tenant the queue knows
//! starts at `max(virtual time, the tenant's finish)`, and the tenant's finish moves to that start
//! plus the request's cost (prompt + output budget tokens). So, between two tenants that keep
//! requests waiting, the tokens served to each over any interval differ by at most the sum of
//! their largest request's cost, and a tenant gains no credit while idle. Tenant values the queue
//! has not seen share one clock, the class's newcomers' finish: a client that makes up a new value
//! per request is, all its values together, served as one tenant. The queue remembers
//! [`MAX_TENANTS`] values per model, the least recently seen forgotten first; a forgotten value
//! comes back as a newcomer, never ahead of where it was.
//!
//! **Competition**: each entry names the engines it could use (those of its compatible buckets'
//! groups). A request, waiting or arriving, may take only engines no request ahead of it could
//! use ([`Board::reserved_ahead`]); an entry none of whose engines is free of those ahead is not
//! tried ([`Board::turns`]). So a request waits only behind requests it competes with.
//!
//! **Prediction**: the queue keeps the times of its last [`SERVICE_SAMPLES`] services and the
//! engines each took. A request that would wait behind `n` competitors, where the competing
//! services since the queue last became non-empty came one per `interval`, expects to wait
//! `(n + 1) × interval`; past its class's wait it is refused at once (`predicted`). Fewer than
//! [`MIN_SAMPLES`] such services predict nothing.

use std::cmp::Reverse;

use serde::{Deserialize, Serialize};

use crate::host::{Host, HostError};
use crate::registry::EngineSet;
use crate::state::keys::waiting_queue as key;
use crate::state::shared::{stable_hash, update};

/// Tenant values remembered per model (their finish tags).
pub const MAX_TENANTS: usize = 256;

/// Services remembered for predicting a wait.
pub const SERVICE_SAMPLES: usize = 32;

/// Competing services needed before a wait is predicted.
pub const MIN_SAMPLES: usize = 4;

/// An entry outlives its own deadline by this much: a VM that crashed cannot remove its entries,
/// and any writer purges them after it.
const ORPHAN_GRACE_MS: u64 = 1_000;

/// The encoding's version, ahead of the msgpack record.
const VERSION: [u8; 8] = *b"sglque02";

/// A header value (tenant or class) as the queue keeps it: a fixed size, whatever its length.
pub fn fingerprint(value: &str) -> u64 {
    let h = stable_hash([value]);
    (h >> 64) as u64 ^ h as u64
}

/// The tenant of requests that name none: one tenant for fair share, and not capped by
/// `max_per_tenant` (the queue's own limit bounds them).
pub const NO_TENANT: u64 = 0;

/// A tenant header's value as the queue keeps it: absent or empty is [`NO_TENANT`].
pub fn tenant(value: Option<&str>) -> u64 {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        // A value that hashes to the reserved one is moved off it.
        Some(v) => fingerprint(v).max(1),
        None => NO_TENANT,
    }
}

/// Why a request left the queue, or never joined it, without being dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QueueExit {
    Full,
    /// Its tenant had `max_per_tenant` requests waiting.
    TenantFull,
    Timeout,
    /// Its expected wait exceeded its class's at once.
    Predicted,
    ClientGone,
    /// The shared queue could not be written (its cas contended past every retry).
    Unavailable,
    /// A request that outranked it took its place in a full queue.
    Displaced,
}

impl QueueExit {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueExit::Full => "queue_full",
            QueueExit::TenantFull => "tenant_full",
            QueueExit::Timeout => "queue_timeout",
            QueueExit::Predicted => "predicted",
            QueueExit::ClientGone => "client_gone",
            QueueExit::Unavailable => "unavailable",
            QueueExit::Displaced => "displaced",
        }
    }
}

/// One waiting request's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The VM it waits in, and its id there (the stream's context id).
    pub vm: u64,
    pub id: u32,
    /// Its class ([`fingerprint`] of the name) and that class's priority.
    pub class: u64,
    pub priority: i32,
    pub tenant: u64,
    /// Its start tag: the order within its class.
    pub tag: u64,
    pub arrival: u64,
    /// When its wait ends; any writer drops it [`ORPHAN_GRACE_MS`] later.
    pub deadline_ms: u64,
    /// Its body's bytes, held by Envoy.
    pub bytes: u64,
    /// The engines it could use.
    pub engines: EngineSet,
}

impl Entry {
    fn order(&self) -> (Reverse<i32>, u64, u64) {
        (Reverse(self.priority), self.tag, self.arrival)
    }
}

/// A request asking to join, or asking what it would wait behind.
#[derive(Debug, Clone, Copy)]
pub struct Joining {
    pub vm: u64,
    pub id: u32,
    pub class: u64,
    pub priority: i32,
    pub tenant: u64,
    /// Prompt + output budget tokens: what serving it charges its tenant.
    pub cost: u64,
    pub bytes: u64,
    pub engines: EngineSet,
    pub deadline_ms: u64,
    /// Its class's longest wait: a longer expected one is refused.
    pub max_wait_ms: u64,
}

/// A model's limits on its queue.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_requests: usize,
    pub max_per_tenant: usize,
}

/// A class's clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Clock {
    class: u64,
    /// The start tag of the request served last.
    virtual_time: u64,
    /// The finish of the tenants not seen before.
    newcomers: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Tenant {
    class: u64,
    tenant: u64,
    finish: u64,
    seen_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Service {
    at_ms: u64,
    engines: EngineSet,
}

/// The queue as read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Board {
    next_arrival: u64,
    /// Since when the queue holds a request (0: empty).
    busy_since_ms: u64,
    clocks: Vec<Clock>,
    tenants: Vec<Tenant>,
    /// The last services, oldest first.
    services: Vec<Service>,
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinError {
    #[error("the queue holds {0} requests, its limit")]
    Full(usize),
    #[error("{0} requests of this tenant wait, its limit")]
    TenantFull(usize),
    #[error("{ahead} requests ahead compete for the same engines: an expected wait of {expected_ms} ms")]
    Hopeless { ahead: usize, expected_ms: u64 },
    #[error(transparent)]
    Host(#[from] HostError),
}

/// One of a VM's entries that may be tried now, and the engines it must leave to those ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    pub id: u32,
    pub reserved: EngineSet,
}

impl Board {
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        rmp_serde::from_slice(bytes.strip_prefix(&VERSION)?).ok()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = VERSION.to_vec();
        // A plain record of integers: encoding it cannot fail.
        out.extend(rmp_serde::to_vec(self).unwrap_or_default());
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

    /// The bytes of the bodies waiting (Envoy holds them).
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    fn clock(&self, class: u64) -> Clock {
        self.clocks.iter().find(|c| c.class == class).copied().unwrap_or(Clock { class, virtual_time: 0, newcomers: 0 })
    }

    fn tenant(&self, class: u64, tenant: u64) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.class == class && t.tenant == tenant)
    }

    /// The start tag `joining` would get now.
    pub fn start_tag(&self, joining: &Joining) -> u64 {
        let clock = self.clock(joining.class);
        let finish = self.tenant(joining.class, joining.tenant).map_or(clock.newcomers, |t| t.finish);
        clock.virtual_time.max(finish)
    }

    fn ahead<'a>(&'a self, priority: i32, tag: u64) -> impl Iterator<Item = &'a Entry> + 'a {
        let order = (Reverse(priority), tag, u64::MAX);
        self.entries.iter().take_while(move |e| e.order() < order)
    }

    /// The engines the requests ahead of `joining` could use, were it to join now: what it may
    /// not take.
    pub fn reserved_ahead(&self, joining: &Joining) -> EngineSet {
        let mut reserved = EngineSet::default();
        for e in self.ahead(joining.priority, self.start_tag(joining)) {
            reserved.union(&e.engines);
        }
        reserved
    }

    /// The wait `joining` can expect behind `ahead` competitors, when enough competing services
    /// were seen since the queue last became non-empty.
    fn expected_wait_ms(&self, ahead: usize, engines: &EngineSet, now_ms: u64) -> Option<u64> {
        if self.busy_since_ms == 0 {
            return None;
        }
        let seen: Vec<&Service> =
            self.services.iter().filter(|s| s.at_ms >= self.busy_since_ms && s.engines.intersects(engines)).collect();
        if seen.len() < MIN_SAMPLES {
            return None;
        }
        // Every sample of the busy period counts from its start; a full ring from its oldest.
        let full = self.services.len() >= SERVICE_SAMPLES && self.services[0].at_ms >= self.busy_since_ms;
        let from = if full { self.services[0].at_ms } else { self.busy_since_ms };
        let span = now_ms.saturating_sub(from).max(1);
        Some((ahead as u64 + 1).saturating_mul(span) / seen.len() as u64)
    }

    /// The ids of `vm`'s entries that may be tried now, in order, each with the engines those
    /// ahead of it could use: an entry all of whose engines are among those is not one.
    pub fn turns(&self, vm: u64) -> Vec<Turn> {
        let mut reserved = EngineSet::default();
        let mut turns = Vec::new();
        for e in &self.entries {
            if e.vm == vm && !e.engines.is_subset(&reserved) {
                turns.push(Turn { id: e.id, reserved });
            }
            reserved.union(&e.engines);
        }
        turns
    }

    /// The engines the entries ahead of `vm`'s entry `id` could use; `None` when it is not here.
    pub fn reserved_for(&self, vm: u64, id: u32) -> Option<EngineSet> {
        let mut reserved = EngineSet::default();
        for e in &self.entries {
            if e.vm == vm && e.id == id {
                return Some(reserved);
            }
            reserved.union(&e.engines);
        }
        None
    }

    fn purge(&mut self, now_ms: u64) {
        self.entries.retain(|e| e.deadline_ms.saturating_add(ORPHAN_GRACE_MS) > now_ms);
        if self.entries.is_empty() {
            self.busy_since_ms = 0;
        }
    }

    fn join(&mut self, joining: &Joining, limits: Limits, now_ms: u64) -> Result<(), JoinError> {
        self.purge(now_ms);
        if self.entries.iter().any(|e| e.vm == joining.vm && e.id == joining.id) {
            return Ok(());
        }
        if joining.tenant != NO_TENANT {
            let of_tenant =
                self.entries.iter().filter(|e| e.class == joining.class && e.tenant == joining.tenant).count();
            if of_tenant >= limits.max_per_tenant {
                return Err(JoinError::TenantFull(of_tenant));
            }
        }
        let tag = self.start_tag(joining);
        if self.entries.len() >= limits.max_requests {
            // A full queue keeps its best requests: one that outranks the last gives it way.
            let outranks = self
                .entries
                .last()
                .is_some_and(|last| (Reverse(joining.priority), tag) < (Reverse(last.priority), last.tag));
            if !outranks {
                return Err(JoinError::Full(self.entries.len()));
            }
            self.entries.pop();
        }
        let ahead = self.ahead(joining.priority, tag).filter(|e| e.engines.intersects(&joining.engines)).count();
        if let Some(expected_ms) = self.expected_wait_ms(ahead, &joining.engines, now_ms) {
            if expected_ms > joining.max_wait_ms {
                return Err(JoinError::Hopeless { ahead, expected_ms });
            }
        }
        self.charge(joining, tag, now_ms);
        let entry = Entry {
            vm: joining.vm,
            id: joining.id,
            class: joining.class,
            priority: joining.priority,
            tenant: joining.tenant,
            tag,
            arrival: self.next_arrival,
            deadline_ms: joining.deadline_ms,
            bytes: joining.bytes,
            engines: joining.engines,
        };
        self.next_arrival += 1;
        if self.entries.is_empty() {
            self.busy_since_ms = now_ms.max(1);
        }
        let at = self.entries.partition_point(|e| e.order() <= entry.order());
        self.entries.insert(at, entry);
        Ok(())
    }

    /// Moves the tenant's finish (or the newcomers') past the request that starts at `tag`.
    fn charge(&mut self, joining: &Joining, tag: u64, now_ms: u64) {
        let finish = tag.saturating_add(joining.cost);
        let known = self.tenants.iter_mut().find(|t| t.class == joining.class && t.tenant == joining.tenant);
        match known {
            Some(t) => {
                t.finish = finish;
                t.seen_ms = now_ms;
            }
            None => {
                match self.clocks.iter_mut().find(|c| c.class == joining.class) {
                    Some(c) => c.newcomers = finish,
                    None => self.clocks.push(Clock { class: joining.class, virtual_time: 0, newcomers: finish }),
                }
                if self.tenants.len() >= MAX_TENANTS {
                    if let Some(oldest) = self.tenants.iter().enumerate().min_by_key(|(_, t)| t.seen_ms).map(|(i, _)| i)
                    {
                        self.tenants.swap_remove(oldest);
                    }
                }
                self.tenants.push(Tenant { class: joining.class, tenant: joining.tenant, finish, seen_ms: now_ms });
            }
        }
    }

    fn leave(&mut self, vm: u64, id: u32, served: bool, now_ms: u64) {
        if let Some(at) = self.entries.iter().position(|e| e.vm == vm && e.id == id) {
            let entry = self.entries.remove(at);
            if served {
                match self.clocks.iter_mut().find(|c| c.class == entry.class) {
                    Some(c) => c.virtual_time = c.virtual_time.max(entry.tag),
                    None => self.clocks.push(Clock { class: entry.class, virtual_time: entry.tag, newcomers: 0 }),
                }
                if self.services.len() >= SERVICE_SAMPLES {
                    self.services.remove(0);
                }
                self.services.push(Service { at_ms: now_ms, engines: entry.engines });
            }
        }
        self.purge(now_ms);
    }
}

/// Reads `model`'s queue; absent or undecodable reads as empty.
pub fn read(host: &dyn Host, model: &str) -> Result<Board, HostError> {
    Ok(host.shared_get(&key(model))?.and_then(|v| Board::decode(&v.bytes)).unwrap_or_default())
}

/// Adds a request to `model`'s queue; the queue as it now stands.
pub fn join(host: &dyn Host, model: &str, joining: &Joining, limits: Limits) -> Result<Board, JoinError> {
    let now = host.now_ms();
    let seed = Board::default().encode();
    update(host, &key(model), &seed, |bytes| {
        let mut board = Board::decode(bytes).unwrap_or_default();
        match board.join(joining, limits, now) {
            Ok(()) => (board.encode(), Ok(board)),
            Err(e) => (bytes.to_vec(), Err(e)),
        }
    })?
}

/// Takes a request out of `model`'s queue: `served` when it was dispatched (its start tag is then
/// its class's virtual time, and its service a sample), not when it timed out or its client left.
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

    const LIMITS: Limits = Limits { max_requests: 64, max_per_tenant: 64 };

    fn engines(slots: &[usize]) -> EngineSet {
        let mut set = EngineSet::default();
        for s in slots {
            set.insert(*s);
        }
        set
    }

    fn joining(vm: u64, id: u32, priority: i32, tenant: u64) -> Joining {
        Joining {
            vm,
            id,
            class: 0,
            priority,
            tenant,
            cost: 100,
            bytes: 10,
            engines: engines(&[0]),
            deadline_ms: 1 << 40,
            max_wait_ms: 1 << 40,
        }
    }

    fn ids(board: &Board) -> Vec<u32> {
        board.entries().iter().map(|e| e.id).collect()
    }

    fn serve(host: &MemoryHost, id: u32) {
        leave(host, "m", 7, id, true).unwrap();
    }

    #[test]
    fn higher_priority_first_then_arrival() {
        let host = MemoryHost::default();
        for (id, priority) in [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1)] {
            join(&host, "m", &joining(7, id, priority, id.into()), LIMITS).unwrap();
        }
        assert_eq!(ids(&read(&host, "m").unwrap()), [2, 4, 1, 3, 5]);
    }

    #[test]
    fn tenants_share_by_tokens_and_carry_no_credit_from_idle_time() {
        let host = MemoryHost::default();
        // Tenant 1 sends ten of 100 tokens (tags 0, 100, … 900), then tenant 2 two of 300: its
        // first starts where the newcomers' clock stands (100, after tenant 1's first), its
        // second once tenant 1 was served 300 tokens more (400).
        for id in 0..10 {
            join(&host, "m", &joining(7, id, 0, 1), LIMITS).unwrap();
        }
        join(&host, "m", &Joining { cost: 300, ..joining(7, 100, 0, 2) }, LIMITS).unwrap();
        join(&host, "m", &Joining { cost: 300, ..joining(7, 101, 0, 2) }, LIMITS).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap())[..8], [0, 1, 100, 2, 3, 4, 101, 5]);
        // Tenant 2 (its finish 700) comes back once the class was served up to tag 800: it starts
        // at 800, with no credit from its idle time.
        for id in [0, 1, 100, 2, 3, 4, 101, 5, 6, 7, 8] {
            serve(&host, id);
        }
        let board = read(&host, "m").unwrap();
        assert_eq!(board.start_tag(&joining(7, 102, 0, 2)), 800);
        assert_eq!(board.start_tag(&joining(7, 102, 0, 1)), 1000, "tenant 1's finish is ahead of it");
    }

    /// A client that makes up a tenant value per request is served as one tenant: an honest
    /// tenant's requests keep their turns against any number of made-up values.
    #[test]
    fn made_up_tenant_values_share_one_clock() {
        let host = MemoryHost::default();
        // The honest tenant has been seen; then both send ten, interleaved.
        join(&host, "m", &joining(7, 1000, 0, 1), LIMITS).unwrap();
        serve(&host, 1000);
        for i in 0..10 {
            join(&host, "m", &joining(7, 100 + i, 0, 1_000_000 + u64::from(i)), LIMITS).unwrap();
            join(&host, "m", &joining(7, 200 + i, 0, 1), LIMITS).unwrap();
        }
        let order = ids(&read(&host, "m").unwrap());
        assert_eq!(order[..6], [100, 200, 101, 201, 102, 202], "{order:?}");
        // Served in that order, the honest tenant is never more than one request behind.
        let mut lead = 0i32;
        for id in order {
            lead += if id >= 200 { 1 } else { -1 };
            assert!(lead.abs() <= 1, "{lead}");
        }
    }

    #[test]
    fn full_queues_and_tenants_refuse_and_leave_the_queue_unchanged() {
        let host = MemoryHost::default();
        let limits = Limits { max_requests: 3, max_per_tenant: 2 };
        join(&host, "m", &joining(7, 1, 0, 5), limits).unwrap();
        join(&host, "m", &joining(7, 2, 0, 5), limits).unwrap();
        assert_eq!(join(&host, "m", &joining(7, 3, 0, 5), limits), Err(JoinError::TenantFull(2)));
        join(&host, "m", &joining(7, 3, 0, 9), limits).unwrap();
        assert_eq!(join(&host, "m", &joining(7, 4, 0, 8), limits), Err(JoinError::Full(3)));
        assert_eq!(ids(&read(&host, "m").unwrap()), [1, 2, 3]);
        // Requests that name no tenant are bounded by the queue only.
        let host = MemoryHost::default();
        let limits = Limits { max_requests: 4, max_per_tenant: 1 };
        for id in 0..4 {
            join(&host, "m", &joining(7, id, 0, NO_TENANT), limits).unwrap();
        }
        assert_eq!(join(&host, "m", &joining(7, 9, 0, NO_TENANT), limits), Err(JoinError::Full(4)));
        assert_eq!((tenant(None), tenant(Some(" ")), tenant(Some("a"))), (NO_TENANT, NO_TENANT, fingerprint("a")));
        // Joining twice keeps one place.
        join(&host, "m", &joining(7, 1, 0, NO_TENANT), limits).unwrap();
        assert_eq!(read(&host, "m").unwrap().len(), 4);
    }

    /// A full queue keeps its best requests: an arrival that outranks the last takes its place; one
    /// that does not is refused.
    #[test]
    fn a_full_queue_gives_the_last_place_to_a_request_that_outranks_it() {
        let host = MemoryHost::default();
        let limits = Limits { max_requests: 2, max_per_tenant: 64 };
        join(&host, "m", &joining(7, 1, -10, 1), limits).unwrap();
        join(&host, "m", &joining(7, 2, -10, 2), limits).unwrap();
        assert_eq!(join(&host, "m", &joining(7, 3, -10, 3), limits), Err(JoinError::Full(2)), "the same class");
        join(&host, "m", &joining(7, 4, 10, 4), limits).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap()), [4, 1], "the last batch request gave way");
    }

    /// A long request waits for engine 2; short ones could use 0, 1 and 2. Only engine 2 is
    /// reserved for the long one, and a short one behind it is still tried.
    #[test]
    fn a_request_waits_only_behind_those_that_compete_for_its_engines() {
        let host = MemoryHost::default();
        let long = Joining { engines: engines(&[2]), ..joining(1, 1, 0, 1) };
        join(&host, "m", &long, LIMITS).unwrap();
        let short = Joining { engines: engines(&[0, 1, 2]), ..joining(2, 2, 0, 2) };
        let board = read(&host, "m").unwrap();
        assert_eq!(board.reserved_ahead(&short), engines(&[2]));
        join(&host, "m", &short, LIMITS).unwrap();
        let board = read(&host, "m").unwrap();
        assert_eq!(board.turns(2), [Turn { id: 2, reserved: engines(&[2]) }]);
        assert_eq!(board.reserved_for(2, 2), Some(engines(&[2])));
        // A second long one behind the first has nothing left to try: it is not tried.
        join(&host, "m", &Joining { engines: engines(&[2]), ..joining(1, 3, 0, 3) }, LIMITS).unwrap();
        let board = read(&host, "m").unwrap();
        assert_eq!(board.turns(1), [Turn { id: 1, reserved: EngineSet::default() }]);
        // A higher class is ahead of all of them: nothing is reserved for it.
        assert!(board.reserved_ahead(&Joining { priority: 1, ..short }).is_empty());
        assert_eq!(board.bytes(), 30);
    }

    #[test]
    fn a_wait_longer_than_the_class_allows_is_refused_at_once() {
        let host = MemoryHost::default();
        let limits = Limits { max_requests: 64, max_per_tenant: 64 };
        // Ten wait; four were served, one every 100 ms.
        for id in 0..10 {
            join(&host, "m", &joining(7, id, 0, u64::from(id)), limits).unwrap();
        }
        for id in 0..4 {
            host.advance_ms(100);
            serve(&host, id);
        }
        // Six ahead: (6 + 1) × 100 ms.
        let refused = join(&host, "m", &Joining { max_wait_ms: 699, ..joining(7, 50, 0, 50) }, limits);
        assert_eq!(refused, Err(JoinError::Hopeless { ahead: 6, expected_ms: 700 }));
        join(&host, "m", &Joining { max_wait_ms: 700, ..joining(7, 50, 0, 50) }, limits).unwrap();
        // A request that competes with none of them predicts nothing: no service of its engines.
        let other = Joining { engines: engines(&[5]), max_wait_ms: 1, ..joining(7, 51, 0, 51) };
        join(&host, "m", &other, limits).unwrap();
        // Once the queue emptied, what it saw before says nothing of the next busy period.
        for id in 4..10 {
            serve(&host, id);
        }
        leave(&host, "m", 7, 50, false).unwrap();
        leave(&host, "m", 7, 51, false).unwrap();
        host.advance_ms(60_000);
        join(&host, "m", &joining(7, 60, 0, 60), limits).unwrap();
        join(&host, "m", &Joining { max_wait_ms: 1, ..joining(7, 61, 0, 61) }, limits).unwrap();
    }

    #[test]
    fn an_orphaned_entry_is_purged_by_the_next_writer_after_its_deadline() {
        let host = MemoryHost::default();
        let mut orphan = joining(1, 10, 0, 0);
        orphan.deadline_ms = host.now_ms();
        join(&host, "m", &orphan, LIMITS).unwrap();
        host.advance_ms(ORPHAN_GRACE_MS + 1);
        join(&host, "m", &joining(2, 20, 0, 0), LIMITS).unwrap();
        assert_eq!(ids(&read(&host, "m").unwrap()), [20]);
    }

    #[test]
    fn the_tenants_remembered_are_bounded_and_the_value_round_trips() {
        let host = MemoryHost::default();
        let limits = Limits { max_requests: 4096, max_per_tenant: 1 };
        for id in 0..(MAX_TENANTS as u32 + 10) {
            join(&host, "m", &joining(u64::MAX, id, -100, u64::from(id)), limits).unwrap();
        }
        let board = read(&host, "m").unwrap();
        assert_eq!(board.tenants.len(), MAX_TENANTS);
        assert_eq!(Board::decode(&board.encode()), Some(board.clone()));
        let mut bytes = board.encode();
        bytes.truncate(bytes.len() / 2);
        assert_eq!(Board::decode(&bytes), None);
        assert_eq!(fingerprint("a"), fingerprint("a"));
        assert_ne!(fingerprint("a"), fingerprint("b"));
    }
}
