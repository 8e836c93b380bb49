//! Router-local accounting of what was sent to each engine (design §6): requests in flight, a
//! cumulative dispatch counter for correcting reports by what was sent since, and the uncached
//! prompt tokens still to prefill — the same correction in tokens, for engines that do not report
//! their prefill queue (a documented deviation: docs/architecture.md, "Design deviations") — and
//! each engine's prefill speed as learned from its first bytes (`speed.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::batching::{Batching, Pair};
use super::fleet::{EngineFit, Prior};
use super::speed::{Sample, Speed, SpeedFit};
use super::table::SentCounts;
use super::unanswered::{Unanswered, Waited, Waiting};
use crate::state::seats::Seat;

/// Prefill work one dispatch hands an engine: its uncached prompt tokens, the rate at which the
/// engine's prefill drains them, the uncached tokens queued ahead of them there, and how long the
/// request was expected to wait for a running slot before the engine starts on it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillWork {
    pub tokens: u64,
    pub tokens_per_ms: f64,
    pub ahead: u64,
    pub slot_wait_ms: u64,
}

impl PrefillWork {
    /// A stage with no prefill work (a PD decode engine).
    pub const NONE: PrefillWork = PrefillWork { tokens: 0, tokens_per_ms: 0.0, ahead: 0, slot_wait_ms: 0 };
}

/// A dispatch's first byte: the dispatch sent at `sent_ms` brought `prefill_tokens` uncached
/// tokens, and `sample` is its time when the byte followed its first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstByte {
    pub prefill_tokens: u64,
    pub sent_ms: u64,
    pub sample: Option<Sample>,
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
    /// The engine's prefill speed as its first bytes showed it.
    pub speed: SpeedFit,
    /// The longest-waiting dispatch whose first byte will time the engine and has not come yet.
    pub unanswered: Option<Waited>,
    /// Whether the engine's first bytes showed it prefilling waiting requests in one batch.
    pub batching: Batching,
}

impl LocalLoad {
    /// The engine's speed as its first bytes showed it, slowed to what its longest-waiting
    /// unanswered dispatch shows (`unanswered.rs`).
    pub fn speed_now(&self, prior_tokens_per_ms: f64) -> Speed {
        self.speed.speed_while(self.unanswered, prior_tokens_per_ms)
    }

    /// The running totals a load report is matched against.
    pub fn sent(&self) -> SentCounts {
        SentCounts { dispatches: self.dispatched_total, uncached_tokens: self.prefilled_total }
    }
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
    /// A dispatch whose first byte will time the engine waits for it ([`Self::answered`] ends the
    /// wait, answered or not).
    fn awaiting(&self, worker: &str, waiting: Waiting);
    fn answered(&self, worker: &str, waiting: Waiting);
    /// A dispatch got its first byte back: its prefill is done, and a timed one teaches the
    /// engine's speed, on `prior_tokens_per_ms` while little is known, and whether it batches.
    fn first_byte(&self, worker: &str, answer: FirstByte, prior_tokens_per_ms: f64);
    /// Ends a dispatch whose `prefill_tokens` are still outstanding (none after its first byte)
    /// and that held the engine `held_ms`; never goes below zero.
    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64);
    /// The clock hold times are measured on.
    fn now_ms(&self) -> u64;
    /// Exchanges this router's counts with the other VMs' (a table that is not shared: nothing).
    fn sync(&self) {}
    /// Tells the other VMs this router's counts now, if they changed; reads nothing.
    fn publish_now(&self) {}
    /// [`Self::publish_now`] unless news was published less than
    /// [`NEWS_MS`](crate::state::schedule::NEWS_MS) ago.
    fn publish_news(&self) {}
    /// [`Self::sync`] if the last one is older than the table's period: called on the request
    /// path, so the exchange keeps pace with traffic and costs nothing while there is none.
    fn sync_if_due(&self) {}
    /// No dispatch of this router is in flight.
    fn idle(&self) -> bool;
    /// Hands `each` every engine's speed fit, over the samples of every VM, and its
    /// longest-waiting unanswered dispatch.
    fn each_fit(&self, each: &mut dyn FnMut(EngineFit));

    /// The prior rates the fleet has shown, on the configured `prior_tokens_per_ms` (`fleet.rs`).
    fn prior(&self, prior_tokens_per_ms: f64) -> Prior {
        let mut engines = Vec::new();
        self.each_fit(&mut |e| engines.push(e));
        Prior::of_fleet(&engines, prior_tokens_per_ms)
    }

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
    /// What is left at `now_ms` had the lane drained at `tokens_per_ms` since its last dispatch.
    pub(super) fn at(&self, now_ms: u64, outstanding: u64, tokens_per_ms: f64) -> u64 {
        let drained = now_ms.saturating_sub(self.at_ms) as f64 * tokens_per_ms.max(0.0);
        let left = (self.tokens as f64 - drained).max(0.0) as u64;
        left.min(outstanding)
    }

    /// Adds `work` to the `left` tokens the lane holds at `now_ms`.
    fn add(&mut self, now_ms: u64, left: u64, work: PrefillWork) {
        self.tokens = left.saturating_add(work.tokens);
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
    work: PrefillWork,
    /// The configured rate, which a young speed fit leans on.
    prior_tokens_per_ms: f64,
    started_ms: u64,
    /// The first byte came back: the prefill is no longer outstanding.
    prefilled: bool,
    /// The dispatch waits for a first byte that will time the engine.
    awaiting: bool,
    /// The stage's seat, when its group caps requests in flight: given back with the slot.
    seat: Option<Arc<Seat>>,
}

impl InflightGuard {
    /// `timed`: the dispatch's first byte will follow its first token (a streamed answer of the
    /// engine that prefills, or a prefill callout), so while it waits it bounds the engine's speed.
    pub fn acquire(
        table: Arc<dyn InflightTable>,
        worker: &str,
        work: PrefillWork,
        prior_tokens_per_ms: f64,
        timed: bool,
    ) -> Self {
        table.acquire(worker, work);
        let started_ms = table.now_ms();
        let guard = Self {
            table,
            worker: worker.to_string(),
            work,
            prior_tokens_per_ms,
            started_ms,
            prefilled: false,
            awaiting: timed,
            seat: None,
        };
        if timed {
            guard.table.awaiting(worker, guard.waiting());
        }
        guard
    }

    /// The dispatch as it waits: since the engine was expected to start on it (a request queued
    /// for a running slot is not late for its prefill while it waits its turn), with the tokens to
    /// prefill before its first.
    fn waiting(&self) -> Waiting {
        Waiting {
            since_ms: self.started_ms.saturating_add(self.work.slot_wait_ms),
            tokens: self.work.ahead.saturating_add(self.work.tokens),
        }
    }

    fn stop_waiting(&mut self) {
        if std::mem::take(&mut self.awaiting) {
            self.table.answered(&self.worker, self.waiting());
        }
    }

    /// The engine's first byte: its prefill of this request is done. `timed`: the byte followed
    /// the first token (a streamed answer of the engine that prefilled), so its time is a sample of
    /// the engine's speed; a whole answer's first byte comes after its decode too.
    pub fn first_byte(&mut self, timed: bool) {
        if std::mem::replace(&mut self.prefilled, true) {
            return;
        }
        self.stop_waiting();
        // Timed from the engine's expected turn for a slot, as a late dispatch is: otherwise the
        // hits a busy holder keeps, which wait for slots, and the cold prompts sent to idle
        // engines, which do not, tilt the line toward an engine that prefills for free.
        let waited = self.waiting();
        let sample =
            timed.then(|| Sample { tokens: waited.tokens, ms: self.table.now_ms().saturating_sub(waited.since_ms) });
        let answer = FirstByte { prefill_tokens: self.work.tokens, sent_ms: self.started_ms, sample };
        self.table.first_byte(&self.worker, answer, self.prior_tokens_per_ms);
    }
}

impl InflightGuard {
    /// Keeps `seat` until the stage ends.
    pub fn with_seat(mut self, seat: Option<Arc<Seat>>) -> Self {
        self.seat = seat;
        self
    }

    pub fn seat(&self) -> Option<&Arc<Seat>> {
        self.seat.as_ref()
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.stop_waiting();
        let held_ms = self.table.now_ms().saturating_sub(self.started_ms);
        let outstanding = if self.prefilled { 0 } else { self.work.tokens };
        self.table.release(&self.worker, outstanding, held_ms);
    }
}

/// In-memory records for tests, on a clock the test sets.
#[derive(Debug, Default)]
pub struct MemoryInflight {
    records: Mutex<HashMap<String, (Record, Unanswered)>>,
    now_ms: AtomicU64,
}

impl MemoryInflight {
    pub fn set(&self, worker: &str, inflight: u64) {
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().0.inflight = inflight;
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
    pub(super) speed: SpeedFit,
    /// The oldest of the VM's dispatches still waiting for a timing first byte.
    pub(super) waiting: Option<Waiting>,
    pub(super) batching: Batching,
}

impl Record {
    pub(super) fn acquire(&mut self, now_ms: u64, work: PrefillWork) {
        let left = self.pending_at(now_ms);
        self.inflight = self.inflight.saturating_add(1);
        self.total = self.total.saturating_add(1);
        self.prefilled = self.prefilled.saturating_add(work.tokens);
        self.outstanding_tokens = self.outstanding_tokens.saturating_add(work.tokens);
        self.queue.add(now_ms, left, work);
    }

    /// `answer` came at `now_ms`; a timed one is compared with the VM's previous timed one from
    /// the engine, which `unanswered` keeps (`batching.rs`).
    pub(super) fn first_byte(
        &mut self,
        now_ms: u64,
        answer: FirstByte,
        unanswered: &mut Unanswered,
        prior_tokens_per_ms: f64,
    ) {
        self.outstanding_tokens = self.outstanding_tokens.saturating_sub(answer.prefill_tokens);
        let Some(sample) = answer.sample else { return };
        if let Some(previous_ms) = unanswered.timed_answer(now_ms) {
            let own_ms = answer.prefill_tokens as f64 / self.speed.speed(prior_tokens_per_ms).tokens_per_ms;
            self.batching.observe(Pair { sent_ms: answer.sent_ms, previous_ms, now_ms, own_ms });
        }
        self.speed.observe(sample, prior_tokens_per_ms);
    }

    pub(super) fn release(&mut self, prefill_tokens: u64, held_ms: u64) {
        self.inflight = self.inflight.saturating_sub(1);
        self.outstanding_tokens = self.outstanding_tokens.saturating_sub(prefill_tokens);
        self.hold_ms = averaged(self.hold_ms, held_ms);
    }

    /// Applies `change` to the VM's unanswered dispatches to this engine, keeping the oldest
    /// published.
    pub(super) fn track(&mut self, unanswered: &mut Unanswered, change: impl FnOnce(&mut Unanswered)) {
        change(unanswered);
        self.waiting = unanswered.oldest();
    }

    /// The prefill lane's tokens left at `now_ms`. When the oldest unanswered dispatch is late
    /// (`Late` in `speed.rs`) the lane drains no faster than it shows the engine can go, and holds
    /// at least what that dispatch is expected still to need and all the work sent since it: an
    /// engine that has not reached the end of one prompt has not started the ones queued behind it.
    /// An engine never timed, with a dispatch waiting for its first byte, has shown nothing of how
    /// far it got: all it was sent and has not answered counts.
    pub(super) fn pending_at(&self, now_ms: u64) -> u64 {
        if !self.speed.timed() && self.waiting.is_some() {
            return self.outstanding_tokens;
        }
        let lane = self.queue.tokens_per_ms;
        let waited = self.waiting.map(|w| w.at(now_ms));
        let late = waited.and_then(|w| self.speed.late(self.speed.speed(lane), w).map(|late| (w, late)));
        match late {
            None => self.queue.at(now_ms, self.outstanding_tokens, lane),
            Some((waited, late)) => {
                let behind = self.outstanding_tokens.saturating_sub(waited.tokens);
                self.queue
                    .at(now_ms, self.outstanding_tokens, late.tokens_per_ms.min(lane))
                    .max(late.remaining_tokens.saturating_add(behind).min(self.outstanding_tokens))
            }
        }
    }

    pub(super) fn fit(&self, now_ms: u64) -> EngineFit {
        EngineFit { fit: self.speed, unanswered: self.waiting.map(|w| w.at(now_ms)) }
    }

    pub(super) fn local_load(&self, now_ms: u64) -> LocalLoad {
        LocalLoad {
            inflight: self.inflight,
            dispatched_total: self.total,
            pending_prefill_tokens: self.pending_at(now_ms),
            prefilled_total: self.prefilled,
            hold_ms: (self.hold_ms > 0.0).then_some(self.hold_ms),
            speed: self.speed,
            unanswered: self.waiting.map(|w| w.at(now_ms)),
            batching: self.batching,
        }
    }
}

impl InflightTable for MemoryInflight {
    fn local_load(&self, worker: &str) -> LocalLoad {
        let now = self.now_ms.load(Ordering::SeqCst);
        let r = self.records.lock().ok().and_then(|c| c.get(worker).map(|(r, _)| *r)).unwrap_or_default();
        r.local_load(now)
    }

    fn acquire(&self, worker: &str, work: PrefillWork) {
        let now = self.now_ms.load(Ordering::SeqCst);
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().0.acquire(now, work);
        }
    }

    fn awaiting(&self, worker: &str, waiting: Waiting) {
        if let Ok(mut c) = self.records.lock() {
            let (r, u) = c.entry(worker.to_string()).or_default();
            r.track(u, |u| u.add(waiting));
        }
    }

    fn answered(&self, worker: &str, waiting: Waiting) {
        if let Ok(mut c) = self.records.lock() {
            let (r, u) = c.entry(worker.to_string()).or_default();
            r.track(u, |u| u.answered(waiting));
        }
    }

    fn first_byte(&self, worker: &str, answer: FirstByte, prior_tokens_per_ms: f64) {
        let now = self.now_ms.load(Ordering::SeqCst);
        if let Ok(mut c) = self.records.lock() {
            let (r, u) = c.entry(worker.to_string()).or_default();
            r.first_byte(now, answer, u, prior_tokens_per_ms);
        }
    }

    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64) {
        if let Ok(mut c) = self.records.lock() {
            c.entry(worker.to_string()).or_default().0.release(prefill_tokens, held_ms);
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn idle(&self) -> bool {
        self.records.lock().is_ok_and(|c| c.values().all(|(r, _)| r.inflight == 0))
    }

    fn each_fit(&self, each: &mut dyn FnMut(EngineFit)) {
        let now = self.now_ms.load(Ordering::SeqCst);
        if let Ok(c) = self.records.lock() {
            c.values().for_each(|(r, _)| each(r.fit(now)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn guards_release_on_drop_and_never_go_below_zero() {
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let a = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork::NONE, 20.0, false);
        let _b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork::NONE, 20.0, false);
        assert_eq!(table.inflight("A"), 2);
        drop(a);
        assert_eq!(table.inflight("A"), 1);
        table.release("A", 0, 0);
        table.release("A", 0, 0);
        assert_eq!(table.inflight("A"), 0);
        assert_eq!(table.dispatched_total("A"), 2);
    }

    const FAST: PrefillWork = PrefillWork { tokens: 0, tokens_per_ms: 10.0, ahead: 0, slot_wait_ms: 0 };

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
        let slow = PrefillWork { tokens: 1_000, tokens_per_ms: 0.001, ahead: 0, slot_wait_ms: 0 };
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let a = InflightGuard::acquire(Arc::clone(&table), "A", slow, 20.0, false);
        let b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork { tokens: 300, ..slow }, 20.0, false);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 1_300);
        drop(a);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 300);
        drop(b);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 0);
    }

    /// `worker` answered prompts of several lengths at exactly `tokens_per_ms`.
    #[test]
    fn an_engine_not_yet_timed_holds_its_unanswered_prompts_whole() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        let mut a = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, true);
        let _b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork { tokens: 1_000, ..work }, 20.0, true);
        // By the prior both are prefilled within 150 ms; nothing says how far the engine got.
        inner.set_now(140);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 3_000);
        a.first_byte(true);
        // Answered: the lane counts as drained at its rate again (3,000 less 140 ms at 20), within
        // what is still unanswered.
        assert_eq!(table.local_load("A").pending_prefill_tokens, 200);
    }

    #[test]
    fn a_dispatch_left_unanswered_past_its_time_slows_the_engine_until_it_is_answered() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        crate::testing::answered(&inner, "A", 20.0, 0, [500, 1_000, 2_000, 4_000]);
        // Two cold prompts sent at once; by the prior the engine prefills them within 150 ms.
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        let mut a = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, true);
        let b = InflightGuard::acquire(
            Arc::clone(&table),
            "A",
            PrefillWork { tokens: 1_000, ahead: 2_000, ..work },
            20.0,
            true,
        );
        inner.set_now(140);
        let on_time = table.local_load("A");
        assert!((on_time.speed_now(20.0).tokens_per_ms - 20.0).abs() < 1e-9, "not late yet: as timed");
        assert_eq!(on_time.pending_prefill_tokens, 200);
        // A second later neither has answered: in the 1,000 ms beyond its allowance (the 50 ms
        // a first token takes at least) the engine prefilled less than the first one's 2,000.
        inner.set_now(1_050);
        let late = table.local_load("A");
        assert!((late.speed_now(20.0).tokens_per_ms - 2.0).abs() < 1e-9);
        // The lane drained at 2 tokens/ms leaves 900 of the 3,000 sent; the first one, 900 ms
        // late, is as likely as not to be 900 ms later still: 1,800 tokens at that rate, and the
        // second one's 1,000 are not started.
        assert_eq!(late.pending_prefill_tokens, 2_800, "the lane holds what the engine showed, not the prior");
        // The first one answers: the second waits on, late too, and keeps the engine slow.
        a.first_byte(true);
        let next = table.local_load("A");
        assert_eq!(next.unanswered, Some(Waited { ms: 1_050, tokens: 3_000 }));
        assert!(next.speed_now(20.0).tokens_per_ms < 5.0, "{:?}", next.speed_now(20.0));
        drop(b);
        drop(a);
        let done = table.local_load("A");
        assert_eq!(done.unanswered, None, "a dispatch that ends unanswered stops waiting too");
        assert_eq!(done.speed_now(20.0), done.speed.speed(20.0));
    }

    #[test]
    fn a_dispatch_waiting_its_expected_turn_for_a_running_slot_is_not_late() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        // Sent to an engine whose slots were full: its turn for one was expected in 600 ms.
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 600 };
        let _queued = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, true);
        inner.set_now(700);
        assert_eq!(table.local_load("A").speed_now(20.0).tokens_per_ms, 20.0, "waited its turn, then 100 ms: on time");
        inner.set_now(1_650);
        // 1,000 ms past its turn and the 50 ms a first token takes at least: under 2 tokens/ms.
        assert_eq!(table.local_load("A").speed_now(20.0).tokens_per_ms, 2.0, "late past its turn: the engine is slow");
    }

    #[test]
    fn a_first_byte_is_timed_from_the_expected_turn_for_a_slot() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 600 };
        let mut a = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, true);
        inner.set_now(700);
        a.first_byte(true);
        let speed = table.local_load("A").speed.speed(20.0);
        assert!((speed.first_byte_ms(2_000) - 100.0).abs() < 1e-6, "600 ms of it was the turn for a slot: {speed:?}");
    }

    #[test]
    fn of_unanswered_dispatches_the_one_due_first_tells() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        let queued = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 600 };
        let _queued = InflightGuard::acquire(Arc::clone(&table), "A", queued, 20.0, true);
        inner.set_now(100);
        // Sent later, to a slot that had come free: due first.
        let free = PrefillWork { tokens: 500, slot_wait_ms: 0, ..queued };
        let _free = InflightGuard::acquire(Arc::clone(&table), "A", free, 20.0, true);
        inner.set_now(300);
        assert_eq!(table.local_load("A").unanswered, Some(Waited { ms: 200, tokens: 500 }));
    }

    #[test]
    fn a_dispatch_whose_first_byte_will_not_time_the_engine_never_slows_it() {
        let inner = Arc::new(MemoryInflight::default());
        let table: Arc<dyn InflightTable> = inner.clone();
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        let _whole = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, false);
        inner.set_now(10_000);
        let load = table.local_load("A");
        assert_eq!((load.unanswered, load.speed_now(20.0).tokens_per_ms), (None, 20.0));
    }

    #[test]
    fn a_first_byte_ends_the_prefill_and_a_timed_one_teaches_the_speed() {
        let table: Arc<dyn InflightTable> = Arc::new(MemoryInflight::default());
        let work = PrefillWork { tokens: 800, tokens_per_ms: 0.001, ahead: 400, slot_wait_ms: 0 };
        let mut a = InflightGuard::acquire(Arc::clone(&table), "A", work, 20.0, false);
        let mut b = InflightGuard::acquire(Arc::clone(&table), "A", PrefillWork { tokens: 100, ..work }, 20.0, false);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 900);
        a.first_byte(false);
        a.first_byte(true);
        assert_eq!(table.local_load("A").pending_prefill_tokens, 100, "its prefill is done");
        assert_eq!(table.local_load("A").speed.weight(), 0.0, "a whole answer's first byte is no sample");
        b.first_byte(true);
        assert_eq!(table.local_load("A").speed.weight(), 1.0);
        drop(a);
        drop(b);
        let load = table.local_load("A");
        assert_eq!((load.inflight, load.pending_prefill_tokens), (0, 0), "nothing released twice");
    }
}
