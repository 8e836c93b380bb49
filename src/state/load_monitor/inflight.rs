//! Router-local accounting of what was sent to each engine (design §6): requests in flight, a
//! cumulative dispatch counter for correcting reports by what was sent since, and the uncached
//! prompt tokens still to prefill — the same correction in tokens, for engines that do not report
//! their prefill queue (a documented deviation: docs/architecture.md, "Design deviations").

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Prefill work one dispatch hands an engine: its uncached prompt tokens, and the rate at which
/// the engine's prefill drains them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillWork {
    pub tokens: u64,
    pub tokens_per_ms: f64,
}

impl PrefillWork {
    /// A stage with no prefill work (a PD decode engine).
    pub const NONE: PrefillWork = PrefillWork { tokens: 0, tokens_per_ms: 0.0 };
}

/// What the router itself knows of one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalLoad {
    pub inflight: u64,
    pub dispatched_total: u64,
    /// Uncached tokens sent and, by the estimate, not yet prefilled.
    pub pending_prefill_tokens: u64,
    /// Every uncached token ever sent: a router-local measure of how much distinct content the
    /// engine was given to cache (what sglang-router's approximate tree size measures).
    pub prefilled_total: u64,
    /// How long a request held the engine, dispatch to end, on a moving average (none finished yet:
    /// `None`). What one request ahead in its queue costs a new one, times its slots.
    pub hold_ms: Option<f64>,
}

/// Weight of the newest request in the moving average of hold times.
const HOLD_WEIGHT: f64 = 0.1;

pub(super) fn averaged(old_ms: f64, held_ms: u64) -> f64 {
    if old_ms > 0.0 {
        old_ms + HOLD_WEIGHT * (held_ms as f64 - old_ms)
    } else {
        (held_ms as f64).max(f64::MIN_POSITIVE)
    }
}

/// The one shared record per engine (design §6). Backed by shared data in Envoy.
pub trait InflightTable: Send + Sync + std::fmt::Debug {
    fn local_load(&self, worker: &str) -> LocalLoad;
    fn acquire(&self, worker: &str, work: PrefillWork);
    /// Ends a dispatch that brought `prefill_tokens` and held the engine `held_ms`; never goes
    /// below zero.
    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64);
    /// The clock hold times are measured on.
    fn now_ms(&self) -> u64;
    /// Exchanges this router's counts with the other VMs' (a table that is not shared: nothing).
    fn sync(&self) {}
    /// Tells the other VMs this router's counts now, if they changed; reads nothing.
    fn publish_now(&self) {}
    /// [`Self::sync`] if the last one is older than the table's period: called on the request
    /// path, so the exchange keeps pace with traffic and costs nothing while there is none.
    fn sync_if_due(&self) {}
    /// No dispatch of this router is in flight.
    fn idle(&self) -> bool;

    fn inflight(&self, worker: &str) -> u64 {
        self.local_load(worker).inflight
    }

    fn dispatched_total(&self, worker: &str) -> u64 {
        self.local_load(worker).dispatched_total
    }
}

/// The pending-prefill estimate: one lane draining at the rate of the last dispatch, bounded by
/// the tokens of the requests still in flight (a finished request's prefill is certainly done, so
/// an underestimated rate cannot pile up work that no longer exists).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct PrefillQueue {
    pub(super) tokens: u64,
    pub(super) at_ms: u64,
    pub(super) tokens_per_ms: f64,
}

impl PrefillQueue {
    pub(super) fn at(&self, now_ms: u64, outstanding: u64) -> u64 {
        let drained = now_ms.saturating_sub(self.at_ms) as f64 * self.tokens_per_ms.max(0.0);
        let left = (self.tokens as f64 - drained).max(0.0) as u64;
        left.min(outstanding)
    }

    fn add(&mut self, now_ms: u64, outstanding: u64, work: PrefillWork) {
        self.tokens = self.at(now_ms, outstanding).saturating_add(work.tokens);
        self.at_ms = now_ms.max(self.at_ms);
        if work.tokens_per_ms > 0.0 {
            self.tokens_per_ms = work.tokens_per_ms;
        }
    }
}

/// Holds one in-flight slot of a worker until dropped: the stage's end, however it ends.
#[derive(Debug)]
pub struct InflightGuard {
    table: Arc<dyn InflightTable>,
    worker: String,
    prefill_tokens: u64,
    started_ms: u64,
}

impl InflightGuard {
    pub fn acquire(table: Arc<dyn InflightTable>, worker: &str, work: PrefillWork) -> Self {
        table.acquire(worker, work);
        let started_ms = table.now_ms();
        Self { table, worker: worker.to_string(), prefill_tokens: work.tokens, started_ms }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let held_ms = self.table.now_ms().saturating_sub(self.started_ms);
        self.table.release(&self.worker, self.prefill_tokens, held_ms);
    }
}

/// In-memory records for tests, on a clock the test sets.
#[derive(Debug, Default)]
pub struct MemoryInflight {
    records: Mutex<HashMap<String, Record>>,
    now_ms: AtomicU64,
}

impl MemoryInflight {
    pub fn set(&self, worker: &str, inflight: u64) {
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().inflight = inflight;
        }
    }

    pub fn set_now(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

/// One engine's record: what [`MemoryInflight`] keeps per worker, and what each VM keeps of its
/// own dispatches and publishes (`shared_inflight.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Record {
    pub(super) inflight: u64,
    pub(super) total: u64,
    pub(super) outstanding_tokens: u64,
    pub(super) prefilled: u64,
    pub(super) queue: PrefillQueue,
    pub(super) hold_ms: f64,
}

impl Record {
    pub(super) fn acquire(&mut self, now_ms: u64, work: PrefillWork) {
        self.inflight = self.inflight.saturating_add(1);
        self.total = self.total.saturating_add(1);
        self.prefilled = self.prefilled.saturating_add(work.tokens);
        self.outstanding_tokens = self.outstanding_tokens.saturating_add(work.tokens);
        self.queue.add(now_ms, self.outstanding_tokens, work);
    }

    pub(super) fn release(&mut self, prefill_tokens: u64, held_ms: u64) {
        self.inflight = self.inflight.saturating_sub(1);
        self.outstanding_tokens = self.outstanding_tokens.saturating_sub(prefill_tokens);
        self.hold_ms = averaged(self.hold_ms, held_ms);
    }

    pub(super) fn local_load(&self, now_ms: u64) -> LocalLoad {
        LocalLoad {
            inflight: self.inflight,
            dispatched_total: self.total,
            pending_prefill_tokens: self.queue.at(now_ms, self.outstanding_tokens),
            prefilled_total: self.prefilled,
            hold_ms: (self.hold_ms > 0.0).then_some(self.hold_ms),
        }
    }
}

impl InflightTable for MemoryInflight {
    fn local_load(&self, worker: &str) -> LocalLoad {
        let now = self.now_ms.load(Ordering::SeqCst);
        let r = self.records.lock().ok().and_then(|c| c.get(worker).copied()).unwrap_or_default();
        r.local_load(now)
    }

    fn acquire(&self, worker: &str, work: PrefillWork) {
        let now = self.now_ms.load(Ordering::SeqCst);
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().acquire(now, work);
        }
    }

    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64) {
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().release(prefill_tokens, held_ms);
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn idle(&self) -> bool {
        self.records.lock().is_ok_and(|c| c.values().all(|r| r.inflight == 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn guards_release_on_drop_and_never_go_below_zero() {
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let a = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork::NONE);
        let _b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork::NONE);
        assert_eq!(table.inflight("A"), 2);
        drop(a);
        assert_eq!(table.inflight("A"), 1);
        table.release("A", 0, 0);
        table.release("A", 0, 0);
        assert_eq!(table.inflight("A"), 0);
        assert_eq!(table.dispatched_total("A"), 2);
    }

    const FAST: PrefillWork = PrefillWork { tokens: 0, tokens_per_ms: 10.0 };

    #[test]
    fn pending_prefill_drains_at_the_engines_rate() {
        let table = MemoryInflight::default();
        table.set_now(1_000);
        table.acquire("A", PrefillWork { tokens: 1_000, ..FAST });
        table.acquire("A", PrefillWork { tokens: 500, ..FAST });
        assert_eq!(table.local_load("A").pending_prefill_tokens, 1_500);
        table.set_now(1_100);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 500, "100 ms at 10 tokens/ms");
        table.set_now(1_200);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 0);
        assert_eq!(table.local_load("B").pending_prefill_tokens, 0);
    }

    #[test]
    fn work_added_later_queues_behind_what_is_left() {
        let table = MemoryInflight::default();
        table.acquire("A", PrefillWork { tokens: 1_000, ..FAST });
        table.set_now(50);
        table.acquire("A", PrefillWork { tokens: 1_000, ..FAST });
        assert_eq!(table.local_load("A").pending_prefill_tokens, 1_500);
    }

    #[test]
    fn finished_requests_bound_the_estimate() {
        // A rate far below the engine's: the estimate would linger, but the requests finished.
        let slow = PrefillWork { tokens: 1_000, tokens_per_ms: 0.001 };
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let a = InflightGuard::acquire(Arc::clone(&table), "A", slow);
        let b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork { tokens: 300, ..slow });
        assert_eq!(table.local_load("A").pending_prefill_tokens, 1_300);
        drop(a);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 300);
        drop(b);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 0);
    }
}
