//! A filter VM's parked requests: those waiting in a model's queue (spec §9) and those held for
//! their prefix. It remembers which of its streams wait where and until when, the class and tenant
//! a request queues as, the engines each must leave to the requests ahead of it, and the answers a
//! wait ends in; the glue wakes the streams [`WaitingRoom::turns`] names. The order across VMs is
//! the shared queue's ([`wait_queue`]). A request's seat here is a value it owns ([`QueuePlace`],
//! [`HoldSlot`]): dropping it gives the seat back, however the request's life ends.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use super::{ErrorKind, RouteError};
use crate::config::QueueConfig;
use crate::host::{Host, HostError};
use crate::registry::EngineSet;
use crate::state::load_monitor::LoadSnapshot;
pub use crate::state::wait_queue::QueueExit;
use crate::state::wait_queue::{self, fingerprint, tenant, JoinError, Joining, Limits};

/// What a 429 from the queue tells a client to wait before it tries again, in seconds.
pub const RETRY_AFTER_S: u64 = 1;

/// What a request's work is charged when it names no output budget: the tokens beyond its prompt
/// its tenant's fair share counts.
pub const UNKNOWN_BUDGET_TOKENS: u64 = 1_024;

/// What a request joins its model's queue as: its class and tenant, its work and the engines it
/// could use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entrant {
    pub model: Arc<str>,
    /// The class's name, for the stats; its priority and longest wait.
    pub class: Arc<str>,
    pub priority: i32,
    pub max_wait_ms: u64,
    pub tenant: u64,
    pub cost: u64,
    pub bytes: u64,
    pub engines: EngineSet,
}

impl Entrant {
    /// The class `config.class_header` names (else the default one) and the tenant
    /// `config.tenant_header` names, read with `header`.
    pub fn new(
        config: &QueueConfig,
        model: &str,
        header: &dyn Fn(&str) -> Option<String>,
        (cost, bytes): (u64, u64),
        engines: EngineSet,
    ) -> Self {
        let named = header(&config.class_header);
        let (class, settings) = config.class(named.as_deref().map(str::trim));
        Self {
            model: Arc::from(model),
            class: Arc::from(class),
            priority: settings.priority,
            max_wait_ms: config.max_wait_ms(&settings),
            tenant: tenant(header(&config.tenant_header).as_deref()),
            cost,
            bytes,
            engines,
        }
    }

    fn joining(&self, vm: u64, id: u32, deadline_ms: u64) -> Joining {
        Joining {
            vm,
            id,
            class: fingerprint(&self.class),
            priority: self.priority,
            tenant: self.tenant,
            cost: self.cost,
            bytes: self.bytes,
            engines: self.engines,
            deadline_ms,
            max_wait_ms: self.max_wait_ms,
        }
    }
}

/// What a waiting request's engines looked like when it was last refused: each engine it may take
/// (its registry place, in-flight count, and whether it is in service), the load report, and what
/// was reserved for the requests ahead. It is selected again only when room may have freed since
/// ([`Capacity::freed_since`]).
#[derive(Debug, Clone)]
pub struct Capacity {
    pub engines: Vec<EngineRoom>,
    pub load: Arc<LoadSnapshot>,
    pub reserved: EngineSet,
}

/// One engine as a waiting request saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineRoom {
    pub place: usize,
    pub inflight: u64,
    pub in_service: bool,
}

impl Capacity {
    /// Whether room it could use may have freed since `before`: a count of one of its engines
    /// fell, one came back into service, a load report arrived, or the requests ahead of it
    /// changed.
    pub fn freed_since(&self, before: &Capacity) -> bool {
        self.reserved != before.reserved
            || !Arc::ptr_eq(&self.load, &before.load)
            || self.engines.len() != before.engines.len()
            || self.engines.iter().zip(&before.engines).any(|(now, then)| {
                now.place != then.place || now.inflight < then.inflight || (now.in_service && !then.in_service)
            })
    }
}

/// A request the queue would not take: why, for the stats, and the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub exit: QueueExit,
    pub error: RouteError,
}

#[derive(Debug)]
struct Waiter {
    model: Arc<str>,
    deadline_ms: u64,
    /// The engines the requests ahead of it could use, as of its last turn.
    reserved: EngineSet,
    /// Its place is gone from the shared queue before its wait was over: a request that outranked
    /// it took it in a full queue.
    displaced: bool,
}

/// The most requests one VM holds for their prefixes; past it, requests go at once.
pub const MAX_HELD: usize = 1_024;

/// This VM's parked streams, by their context id.
#[derive(Debug)]
pub struct WaitingRoom {
    host: Arc<dyn Host>,
    vm: u64,
    waiting: Mutex<BTreeMap<u32, Waiter>>,
    /// Streams held for their prefix: offered a turn on every tick.
    held: Mutex<BTreeSet<u32>>,
    /// Leaves the shared queue did not take (its cas contended), tried again on each turn.
    unleft: Mutex<Vec<(Arc<str>, u32, bool)>>,
}

/// A request's place in its model's queue. Dropped, it leaves the queue: as served when
/// [`QueuePlace::served`] consumed it, else as a request that left unserved.
#[derive(Debug)]
pub struct QueuePlace {
    room: Arc<WaitingRoom>,
    id: u32,
    served: bool,
}

impl QueuePlace {
    /// The request was dispatched: its place goes, and its start tag is its class's virtual time.
    pub fn served(mut self) {
        self.served = true;
    }
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.room.leave(self.id, self.served);
    }
}

/// One of the VM's [`MAX_HELD`] slots for requests held for their prefix; dropped, it is free.
#[derive(Debug)]
pub struct HoldSlot {
    room: Arc<WaitingRoom>,
    id: u32,
}

impl Drop for HoldSlot {
    fn drop(&mut self) {
        if let Ok(mut held) = self.room.held.lock() {
            held.remove(&self.id);
        }
    }
}

/// The answer of a request whose place a request that outranked it took in a full queue.
pub fn displaced(model: &str) -> RouteError {
    RouteError::new(
        ErrorKind::QueueFull,
        format!("the queue of model `{model}` filled up with requests that go before this one"),
    )
}

pub fn timed_out(model: &str, max_wait_ms: u64) -> RouteError {
    RouteError::new(
        ErrorKind::QueueTimeout,
        format!("no engine of model `{model}` had room within the queue's wait of {max_wait_ms} ms"),
    )
}

fn refusal(entrant: &Entrant, error: JoinError) -> Refusal {
    let (model, class) = (&entrant.model, &entrant.class);
    let (exit, kind, message) = match error {
        JoinError::Full(n) => (
            QueueExit::Full,
            ErrorKind::QueueFull,
            format!("every engine of model `{model}` is full and {n} requests of its class or higher wait already, the queue's limit"),
        ),
        JoinError::TenantFull(n) => (
            QueueExit::TenantFull,
            ErrorKind::QueueFull,
            format!("{n} requests of this tenant wait for model `{model}` already, the queue's limit per tenant"),
        ),
        JoinError::Hopeless { ahead, expected_ms } => (
            QueueExit::Predicted,
            ErrorKind::QueueTimeout,
            format!(
                "{ahead} requests ahead wait for the same engines of model `{model}`: an expected wait of \
                 {expected_ms} ms, past class `{class}`'s {} ms",
                entrant.max_wait_ms
            ),
        ),
        JoinError::Host(e) => (
            QueueExit::Unavailable,
            ErrorKind::QueueUnavailable,
            format!("the queue of model `{model}` could not be written: {e}"),
        ),
    };
    Refusal { exit, error: RouteError::new(kind, message) }
}

impl WaitingRoom {
    pub fn new(host: Arc<dyn Host>, vm: u64) -> Self {
        Self { host, vm, waiting: Mutex::default(), held: Mutex::default(), unleft: Mutex::default() }
    }

    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<u32, Waiter>) -> R) -> Option<R> {
        self.waiting.lock().ok().map(|mut w| f(&mut w))
    }

    /// Whether no stream is parked here.
    pub fn is_empty(&self) -> bool {
        self.with(|w| w.is_empty()).unwrap_or(true) && self.held_count() == 0
    }

    /// Whether stream `id` is parked here (queued or held).
    pub fn holds(&self, id: u32) -> bool {
        self.with(|w| w.contains_key(&id)).unwrap_or(false) || self.held.lock().is_ok_and(|h| h.contains(&id))
    }

    /// How many streams are held for their prefix.
    pub fn held_count(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    /// A slot for stream `id` to be held for its prefix, while fewer than [`MAX_HELD`] are.
    pub fn hold(self: &Arc<Self>, id: u32) -> Option<HoldSlot> {
        let mut held = self.held.lock().ok()?;
        if held.len() >= MAX_HELD {
            return None;
        }
        held.insert(id);
        Some(HoldSlot { room: Arc::clone(self), id })
    }

    /// The engines an arrival that would join as `entrant` must leave to the requests already
    /// waiting ahead of it (none when none waits). A queue that cannot be read is an error: nobody
    /// skips it.
    pub fn reserved_ahead(&self, entrant: &Entrant) -> Result<EngineSet, HostError> {
        let board = wait_queue::read(self.host.as_ref(), &entrant.model)?;
        let joining = entrant.joining(self.vm, 0, 0);
        Ok(if board.is_empty() { EngineSet::default() } else { board.reserved_ahead(&joining) })
    }

    /// Requests of `model` waiting on every VM, and the bytes of their bodies.
    pub fn depth(&self, model: &str) -> (usize, u64) {
        wait_queue::read(self.host.as_ref(), model).map(|board| (board.len(), board.bytes())).unwrap_or_default()
    }

    /// Stream `id` joins its model's queue as `entrant` until `deadline_ms`: its place.
    pub fn join(
        self: &Arc<Self>,
        id: u32,
        entrant: &Entrant,
        config: &QueueConfig,
        deadline_ms: u64,
    ) -> Result<QueuePlace, Refusal> {
        let limits =
            Limits { max_requests: config.max_requests as usize, max_per_tenant: config.max_per_tenant as usize };
        let joining = entrant.joining(self.vm, id, deadline_ms);
        let board =
            wait_queue::join(self.host.as_ref(), &entrant.model, &joining, limits).map_err(|e| refusal(entrant, e))?;
        let reserved = board.reserved_for(self.vm, id).unwrap_or_default();
        let waiter = Waiter { model: Arc::clone(&entrant.model), deadline_ms, reserved, displaced: false };
        self.with(|w| w.insert(id, waiter));
        Ok(QueuePlace { room: Arc::clone(self), id, served: false })
    }

    /// Stream `id` leaves its queue: `served` when it was dispatched. A stream the glue lost
    /// without its end being heard leaves this way too.
    pub fn leave(&self, id: u32, served: bool) {
        let Some(Some(waiter)) = self.with(|w| w.remove(&id)) else { return };
        self.leave_shared(waiter.model, id, served);
    }

    fn leave_shared(&self, model: Arc<str>, id: u32, served: bool) {
        if let Err(e) = wait_queue::leave(self.host.as_ref(), &model, self.vm, id, served) {
            // Tried again on the next turn; past its deadline any writer purges it.
            log::warn!("queue of model `{model}` not left: {e}");
            if let Ok(mut unleft) = self.unleft.lock() {
                unleft.push((model, id, served));
            }
        }
    }

    /// Whether stream `id`'s place was taken by a request that outranked it in a full queue.
    pub fn displaced(&self, id: u32) -> bool {
        self.with(|w| w.get(&id).is_some_and(|x| x.displaced)).unwrap_or(false)
    }

    /// The engines stream `id` must leave to the requests ahead of it, as of its last turn.
    pub fn reserved(&self, id: u32) -> EngineSet {
        self.with(|w| w.get(&id).map(|x| x.reserved)).flatten().unwrap_or_default()
    }

    /// The streams to wake now, in order: those whose wait is over, those that may be tried (each
    /// with the engines left to those ahead of it, read by [`WaitingRoom::reserved`]), then those
    /// held for their prefix (each looks whether its engine started on it).
    pub fn turns(&self) -> Vec<u32> {
        let retries = self.unleft.lock().map(|mut u| std::mem::take(&mut *u)).unwrap_or_default();
        for (model, id, served) in retries {
            self.leave_shared(model, id, served);
        }
        let now = self.host.now_ms();
        let Some((mut due, models)) = self.with(|w| {
            let due: Vec<u32> = w.iter().filter(|(_, x)| x.deadline_ms <= now).map(|(id, _)| *id).collect();
            let mut models: Vec<Arc<str>> = w.values().map(|x| Arc::clone(&x.model)).collect();
            models.sort_unstable();
            models.dedup();
            (due, models)
        }) else {
            return Vec::new();
        };
        for model in models {
            match wait_queue::read(self.host.as_ref(), &model) {
                Ok(board) => {
                    for turn in board.turns(self.vm) {
                        self.with(|w| w.get_mut(&turn.id).map(|x| x.reserved = turn.reserved));
                        if !due.contains(&turn.id) {
                            due.push(turn.id);
                        }
                    }
                    let placed = |id: u32| board.entries().iter().any(|e| e.vm == self.vm && e.id == id);
                    let gone: Vec<u32> = self
                        .with(|w| {
                            let mut gone = Vec::new();
                            for (id, x) in w.iter_mut().filter(|(_, x)| x.model == model) {
                                if !placed(*id) {
                                    x.displaced = true;
                                    gone.push(*id);
                                }
                            }
                            gone
                        })
                        .unwrap_or_default();
                    due.extend(gone.into_iter().filter(|id| !due.contains(id)).collect::<Vec<_>>());
                }
                Err(e) => log::warn!("queue of model `{model}` not read: {e}"),
            }
        }
        if let Ok(held) = self.held.lock() {
            due.extend(held.iter().copied());
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    fn config(max_requests: u32) -> QueueConfig {
        serde_json::from_value(serde_json::json!({"max_requests": max_requests, "max_wait_ms": 100,
            "classes": {"standard": {}, "interactive": {"priority": 10, "max_wait_ms": 50}}}))
        .unwrap()
    }

    fn entrant(class: &'static str, tenant: &'static str, slots: &[usize]) -> Entrant {
        let header = move |name: &str| match name {
            "x-sgl-class" => Some(class.to_string()),
            "x-sgl-tenant" => Some(tenant.to_string()),
            _ => None,
        };
        let mut engines = EngineSet::default();
        slots.iter().for_each(|s| engines.insert(*s));
        Entrant::new(&config(8), "m", &header, (10, 100), engines)
    }

    #[test]
    fn a_class_is_the_operators_and_an_unknown_one_is_the_default() {
        let s = entrant("interactive", "t", &[0]);
        assert_eq!((&*s.class, s.priority, s.max_wait_ms), ("interactive", 10, 50));
        let s = entrant("gold", "t", &[0]);
        assert_eq!((&*s.class, s.priority, s.max_wait_ms), ("standard", 0, 100));
    }

    #[test]
    fn rooms_of_two_vms_share_one_order_and_each_wakes_its_own() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let (a, b) =
            (Arc::new(WaitingRoom::new(Arc::clone(&host), 1)), Arc::new(WaitingRoom::new(Arc::clone(&host), 2)));
        let deadline = host.now_ms() + 100;
        let _ten = a.join(10, &entrant("standard", "t", &[0]), &config(8), deadline).unwrap();
        let twenty = b.join(20, &entrant("interactive", "t", &[0]), &config(8), deadline).unwrap();
        assert_eq!(b.turns(), [20], "the higher class goes first, on the other VM");
        assert!(a.turns().is_empty(), "VM 1's request competes with the one ahead of it");
        // A request for other engines is tried beside them.
        let _eleven = a.join(11, &entrant("standard", "u", &[1]), &config(8), deadline).unwrap();
        assert_eq!(a.turns(), [11]);
        let mut zero = EngineSet::default();
        zero.insert(0);
        assert_eq!(a.reserved(11), zero);
        assert_eq!(a.depth("m"), (3, 300));
        twenty.served();
        assert_eq!(a.turns(), [10, 11]);
        assert!(b.is_empty() && !a.is_empty());
    }

    /// However a parked request's life ends, dropping its seat gives the seat back.
    #[test]
    fn a_dropped_seat_leaves_the_queue_and_frees_the_hold() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let room = Arc::new(WaitingRoom::new(Arc::clone(&host), 1));
        let place = room.join(1, &entrant("standard", "t", &[0]), &config(8), host.now_ms() + 100).unwrap();
        let slot = room.hold(2).unwrap();
        assert!(room.holds(1) && room.holds(2) && room.held_count() == 1);
        assert_eq!(room.turns(), [1, 2], "the queued one's turn, and the held one every tick");
        drop(place);
        drop(slot);
        assert!(room.is_empty() && !room.holds(1) && !room.holds(2));
        assert_eq!(room.depth("m"), (0, 0));
        let slots: Vec<HoldSlot> = (0..MAX_HELD as u32).map(|id| room.hold(id).unwrap()).collect();
        assert!(room.hold(MAX_HELD as u32).is_none(), "at most MAX_HELD held");
        drop(slots);
        assert_eq!(room.held_count(), 0);
    }

    #[test]
    fn room_may_have_freed_when_a_count_fell_an_engine_returned_a_report_came_or_those_ahead_changed() {
        let room = |place, inflight, in_service| EngineRoom { place, inflight, in_service };
        let load = Arc::new(LoadSnapshot::default());
        let before = Capacity {
            engines: vec![room(0, 2, true), room(1, 1, false)],
            load: Arc::clone(&load),
            reserved: EngineSet::default(),
        };
        let with = |engines: Vec<EngineRoom>| Capacity { engines, ..before.clone() };
        assert!(!before.freed_since(&before));
        assert!(!with(vec![room(0, 3, true), room(1, 1, false)]).freed_since(&before), "more in flight");
        assert!(with(vec![room(0, 1, true), room(1, 1, false)]).freed_since(&before), "a count fell");
        assert!(with(vec![room(0, 2, true), room(1, 1, true)]).freed_since(&before), "back in service");
        assert!(!with(vec![room(0, 2, false), room(1, 1, false)]).freed_since(&before), "out of service");
        assert!(with(vec![room(0, 2, true)]).freed_since(&before), "other engines");
        let report = Capacity { load: Arc::new(LoadSnapshot::default()), ..before.clone() };
        assert!(report.freed_since(&before), "a load report");
        let mut reserved = EngineSet::default();
        reserved.insert(3);
        assert!(Capacity { reserved, ..before.clone() }.freed_since(&before), "those ahead changed");
    }

    #[test]
    fn a_full_queue_is_a_429_and_an_expired_wait_is_due_first() {
        let memory = Arc::new(MemoryHost::default());
        let host: Arc<dyn Host> = Arc::clone(&memory) as Arc<dyn Host>;
        let room = Arc::new(WaitingRoom::new(host, 1));
        let deadline = memory.now_ms() + 100;
        let _one = room.join(1, &entrant("standard", "a", &[0]), &config(2), deadline).unwrap();
        let _two = room.join(2, &entrant("standard", "b", &[0]), &config(2), deadline + 1).unwrap();
        let full = room.join(3, &entrant("standard", "c", &[0]), &config(2), deadline).unwrap_err();
        assert_eq!((full.exit, full.error.status(), full.error.kind), (QueueExit::Full, 429, ErrorKind::QueueFull));
        assert_eq!(room.turns(), [1], "one engine: only the first may be tried");
        memory.advance_ms(101);
        assert_eq!(room.turns(), [1, 2], "both waits are over");
    }
}
