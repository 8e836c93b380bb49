//! A filter VM's side of flow control (spec §9): which of its streams wait in which model's queue
//! and until when, when each may be tried again, and the answers a wait ends in. The order across
//! VMs is the shared queue's ([`wait_queue`]); this room only remembers its own streams, which the
//! glue wakes when [`WaitingRoom::turns`] names them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{ErrorKind, RouteError};
use crate::config::QueueConfig;
use crate::host::Host;
pub use crate::state::wait_queue::QueueExit;
use crate::state::wait_queue::{self, clamp_priority, tenant, JoinError, Joining};

/// What a 429 from the queue tells a client to wait before it tries again, in seconds.
pub const RETRY_AFTER_S: u64 = 1;

/// A stream's place in its model's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub model: Arc<str>,
    pub deadline_ms: u64,
    /// It may be tried at once: it is among its model's first.
    pub turn: bool,
}

#[derive(Debug)]
struct Waiter {
    model: Arc<str>,
    deadline_ms: u64,
}

/// This VM's waiting streams, by their context id.
#[derive(Debug)]
pub struct WaitingRoom {
    host: Arc<dyn Host>,
    vm: u64,
    waiting: Mutex<BTreeMap<u32, Waiter>>,
}

/// The priority a request asks for in `config.priority_header`: an integer, clamped; else 0.
pub fn priority(config: &QueueConfig, header: &dyn Fn(&str) -> Option<String>) -> i32 {
    header(&config.priority_header).and_then(|v| v.trim().parse::<i64>().ok()).map(clamp_priority).unwrap_or(0)
}

pub fn timed_out(model: &str, max_wait_ms: u64) -> RouteError {
    RouteError::new(
        ErrorKind::QueueTimeout,
        format!("no engine of model `{model}` had room within the queue's wait of {max_wait_ms} ms"),
    )
}

impl WaitingRoom {
    pub fn new(host: Arc<dyn Host>, vm: u64) -> Self {
        Self { host, vm, waiting: Mutex::default() }
    }

    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<u32, Waiter>) -> R) -> Option<R> {
        self.waiting.lock().ok().map(|mut w| f(&mut w))
    }

    pub fn is_empty(&self) -> bool {
        self.with(|w| w.is_empty()).unwrap_or(true)
    }

    /// Whether stream `id` waits here.
    pub fn holds(&self, id: u32) -> bool {
        self.with(|w| w.contains_key(&id)).unwrap_or(false)
    }

    /// Whether any request of `model` waits, on any VM: an arrival then waits behind it.
    pub fn occupied(&self, model: &str) -> bool {
        wait_queue::read(self.host.as_ref(), model).is_ok_and(|board| !board.is_empty())
    }

    /// Requests of `model` waiting, on every VM.
    pub fn depth(&self, model: &str) -> usize {
        wait_queue::read(self.host.as_ref(), model).map(|board| board.len()).unwrap_or(0)
    }

    /// Stream `id` joins `model`'s queue at `priority` ([`priority`]). A full queue is a 429
    /// `queue_full`; a queue that cannot be read or written is `None`: the request is answered as
    /// it would be without one.
    pub fn join(
        &self,
        id: u32,
        model: &str,
        config: &QueueConfig,
        priority: i32,
        header: &dyn Fn(&str) -> Option<String>,
    ) -> Option<Result<Place, RouteError>> {
        let deadline_ms = self.host.now_ms().saturating_add(config.max_wait_ms);
        let tenant = tenant(&header(&config.tenant_header).unwrap_or_default());
        let joining = Joining { vm: self.vm, id, priority, tenant, deadline_ms };
        let max = config.max_requests as usize;
        match wait_queue::join(self.host.as_ref(), model, &joining, max) {
            Ok(board) => {
                let model: Arc<str> = Arc::from(model);
                self.with(|w| w.insert(id, Waiter { model: Arc::clone(&model), deadline_ms }));
                let turn = board.turns(self.vm, self.host.now_ms()).contains(&id);
                Some(Ok(Place { model, deadline_ms, turn }))
            }
            Err(JoinError::Full(n)) => Some(Err(RouteError::new(
                ErrorKind::QueueFull,
                format!("every engine of model `{model}` is full and {n} requests wait already, the queue's limit"),
            ))),
            Err(JoinError::Host(e)) => {
                log::warn!("queue of model `{model}` not joined: {e}");
                None
            }
        }
    }

    /// Stream `id` leaves its queue: `served` when it was dispatched.
    pub fn leave(&self, id: u32, served: bool) {
        let Some(Some(waiter)) = self.with(|w| w.remove(&id)) else { return };
        if let Err(e) = wait_queue::leave(self.host.as_ref(), &waiter.model, self.vm, id, served) {
            // Its entry is purged after its deadline by the next writer.
            log::warn!("queue of model `{}` not left: {e}", waiter.model);
        }
    }

    /// The streams to wake now, in order: those whose wait is over, then those whose turn it is.
    pub fn turns(&self) -> Vec<u32> {
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
                    for id in board.turns(self.vm, now) {
                        if !due.contains(&id) {
                            due.push(id);
                        }
                    }
                }
                Err(e) => log::warn!("queue of model `{model}` not read: {e}"),
            }
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
        serde_json::from_value(serde_json::json!({"max_requests": max_requests, "max_wait_ms": 100})).unwrap()
    }

    fn headers(priority: &'static str, tenant: &'static str) -> impl Fn(&str) -> Option<String> {
        move |name| match name {
            "x-sgl-priority" => Some(priority.to_string()),
            "x-sgl-tenant" => Some(tenant.to_string()),
            _ => None,
        }
    }

    #[test]
    fn rooms_of_two_vms_share_one_order_and_each_wakes_its_own() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let (a, b) = (WaitingRoom::new(Arc::clone(&host), 1), WaitingRoom::new(Arc::clone(&host), 2));
        let place = a.join(10, "m", &config(8), 0, &headers("0", "t")).unwrap().unwrap();
        assert!(place.turn);
        let place = b.join(20, "m", &config(8), 7, &headers("7", "t")).unwrap().unwrap();
        assert!(place.turn, "the higher priority goes first, on the other VM");
        assert_eq!(b.turns(), [20]);
        assert_eq!(a.turns(), [10], "two VMs wait: each may try its first");
        assert!(a.occupied("m") && !a.occupied("other"));
        assert_eq!(a.depth("m"), 2);
        b.leave(20, true);
        assert!(b.is_empty() && !a.is_empty());
        assert_eq!(a.depth("m"), 1);
    }

    #[test]
    fn a_full_queue_is_a_429_and_an_expired_wait_is_due_first() {
        let memory = Arc::new(MemoryHost::default());
        let host: Arc<dyn Host> = Arc::clone(&memory) as Arc<dyn Host>;
        let room = WaitingRoom::new(host, 1);
        room.join(1, "m", &config(2), 0, &headers("x", "")).unwrap().unwrap();
        room.join(2, "m", &config(2), -3, &headers("-3", "")).unwrap().unwrap();
        let full = room.join(3, "m", &config(2), 0, &headers("0", "")).unwrap().unwrap_err();
        assert_eq!((full.status(), full.kind), (429, ErrorKind::QueueFull));
        assert_eq!(room.turns(), [1], "one VM waits: only the first may be tried");
        memory.advance_ms(100);
        assert_eq!(room.turns(), [1, 2], "both waits are over");
    }

    #[test]
    fn priorities_parse_as_integers_and_are_clamped() {
        let c = config(1);
        assert_eq!(priority(&c, &headers("5", "")), 5);
        assert_eq!(priority(&c, &headers(" -2 ", "")), -2);
        assert_eq!(priority(&c, &headers("99999999999999", "")), 100);
        assert_eq!(priority(&c, &headers("high", "")), 0);
        assert_eq!(priority(&c, &|_| None), 0);
    }
}
