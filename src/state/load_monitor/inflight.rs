//! Router-local accounting of what was sent to each engine (design §6): requests in flight, a
//! cumulative dispatch counter for correcting reports by what was sent since, and the uncached
//! prompt tokens still to prefill — the same correction in tokens, for engines that do not report
//! their prefill queue (a documented deviation: README, "Design deviations").

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

fn averaged(old_ms: f64, held_ms: u64) -> f64 {
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
struct PrefillQueue {
    tokens: u64,
    at_ms: u64,
    tokens_per_ms: f64,
}

impl PrefillQueue {
    fn at(&self, now_ms: u64, outstanding: u64) -> u64 {
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

/// One engine's record: what [`MemoryInflight`] keeps per worker and each VM share in shared data.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Record {
    inflight: u64,
    total: u64,
    outstanding_tokens: u64,
    prefilled: u64,
    queue: PrefillQueue,
    hold_ms: f64,
}

impl InflightTable for MemoryInflight {
    fn local_load(&self, worker: &str) -> LocalLoad {
        let now = self.now_ms.load(Ordering::SeqCst);
        let r = self.records.lock().ok().and_then(|c| c.get(worker).copied()).unwrap_or_default();
        LocalLoad {
            inflight: r.inflight,
            dispatched_total: r.total,
            pending_prefill_tokens: r.queue.at(now, r.outstanding_tokens),
            prefilled_total: r.prefilled,
            hold_ms: (r.hold_ms > 0.0).then_some(r.hold_ms),
        }
    }

    fn acquire(&self, worker: &str, work: PrefillWork) {
        let now = self.now_ms.load(Ordering::SeqCst);
        if let Ok(mut c) = self.records.lock() {
            let r = c.entry(worker.to_string()).or_default();
            r.inflight += 1;
            r.total += 1;
            r.prefilled = r.prefilled.saturating_add(work.tokens);
            r.outstanding_tokens = r.outstanding_tokens.saturating_add(work.tokens);
            r.queue.add(now, r.outstanding_tokens, work);
        }
    }

    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64) {
        if let Ok(mut c) = self.records.lock() {
            let r = c.entry(worker.to_string()).or_default();
            r.inflight = r.inflight.saturating_sub(1);
            r.outstanding_tokens = r.outstanding_tokens.saturating_sub(prefill_tokens);
            r.hold_ms = averaged(r.hold_ms, held_ms);
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
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

/// In-flight counts in shared data, one fixed key per worker. Each VM keeps its own share inside
/// the key, so the share of a VM that crashed can be reclaimed without touching anyone else's;
/// the dispatch total of a reclaimed share is kept, so corrections never jump backwards.
pub struct SharedInflight {
    host: Arc<dyn crate::host::Host>,
    vm: u64,
}

/// The decoded value of one worker's key: the engine's prefill queue, then one share per VM.
#[derive(Debug, Default, PartialEq)]
struct Shares {
    retired_total: u64,
    retired_prefilled: u64,
    hold_ms: f64,
    queue: PrefillQueue,
    vms: Vec<Share>,
}

/// One VM's share: its in-flight requests and their uncached tokens, and its totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Share {
    vm: u64,
    inflight: u64,
    total: u64,
    outstanding_tokens: u64,
    prefilled: u64,
}

const HEADER_WORDS: usize = 6;
const SHARE_WORDS: usize = 5;

impl Shares {
    fn decode(bytes: &[u8]) -> Self {
        let word = |c: &[u8], i: usize| c.get(i * 8..i * 8 + 8).and_then(crate::state::shared::decode_u64).unwrap_or(0);
        let queue = PrefillQueue {
            tokens: word(bytes, 3),
            at_ms: word(bytes, 4),
            tokens_per_ms: f64::from_bits(word(bytes, 5)),
        };
        let vms = bytes
            .get(HEADER_WORDS * 8..)
            .unwrap_or_default()
            .chunks_exact(SHARE_WORDS * 8)
            .map(|c| Share {
                vm: word(c, 0),
                inflight: word(c, 1),
                total: word(c, 2),
                outstanding_tokens: word(c, 3),
                prefilled: word(c, 4),
            })
            .collect();
        let (retired_total, retired_prefilled, hold_ms) =
            (word(bytes, 0), word(bytes, 1), f64::from_bits(word(bytes, 2)));
        Self { retired_total, retired_prefilled, hold_ms, queue, vms }
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity((HEADER_WORDS + SHARE_WORDS * self.vms.len()) * 8);
        let q = &self.queue;
        let words = [
            self.retired_total,
            self.retired_prefilled,
            self.hold_ms.to_bits(),
            q.tokens,
            q.at_ms,
            q.tokens_per_ms.to_bits(),
        ];
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for s in &self.vms {
            for w in [s.vm, s.inflight, s.total, s.outstanding_tokens, s.prefilled] {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        out
    }

    fn inflight(&self) -> u64 {
        self.vms.iter().map(|v| v.inflight).fold(0, u64::saturating_add)
    }

    fn total(&self) -> u64 {
        self.vms.iter().map(|v| v.total).fold(self.retired_total, u64::saturating_add)
    }

    fn outstanding_tokens(&self) -> u64 {
        self.vms.iter().map(|v| v.outstanding_tokens).fold(0, u64::saturating_add)
    }

    fn prefilled(&self) -> u64 {
        self.vms.iter().map(|v| v.prefilled).fold(self.retired_prefilled, u64::saturating_add)
    }

    fn own(&mut self, vm: u64) -> &mut Share {
        let i = match self.vms.iter().position(|v| v.vm == vm) {
            Some(i) => i,
            None => {
                self.vms.push(Share { vm, ..Share::default() });
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

    /// The service's sweep: folds the shares of dead VMs away, keeping their dispatch totals and
    /// dropping their requests' tokens from the prefill bound.
    pub fn reclaim(host: &dyn crate::host::Host, worker: &str, dead: &[u64]) -> Result<u64, crate::host::HostError> {
        let key = crate::state::keys::inflight(worker);
        crate::state::shared::update(host, &key, &Shares::default().encode(), |bytes| {
            let mut shares = Shares::decode(bytes);
            let (mut reclaimed, mut retired, mut prefilled) = (0u64, 0u64, 0u64);
            shares.vms.retain(|s| {
                if dead.contains(&s.vm) {
                    retired = retired.saturating_add(s.total);
                    prefilled = prefilled.saturating_add(s.prefilled);
                    reclaimed = reclaimed.saturating_add(s.inflight);
                    false
                } else {
                    true
                }
            });
            shares.retired_total = shares.retired_total.saturating_add(retired);
            shares.retired_prefilled = shares.retired_prefilled.saturating_add(prefilled);
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
    fn local_load(&self, worker: &str) -> LocalLoad {
        let s = self.read(worker);
        LocalLoad {
            inflight: s.inflight(),
            dispatched_total: s.total(),
            pending_prefill_tokens: s.queue.at(self.host.now_ms(), s.outstanding_tokens()),
            prefilled_total: s.prefilled(),
            hold_ms: (s.hold_ms > 0.0).then_some(s.hold_ms),
        }
    }

    fn acquire(&self, worker: &str, work: PrefillWork) {
        let (vm, now) = (self.vm, self.host.now_ms());
        self.change(worker, |s| {
            let own = s.own(vm);
            own.inflight = own.inflight.saturating_add(1);
            own.total = own.total.saturating_add(1);
            own.outstanding_tokens = own.outstanding_tokens.saturating_add(work.tokens);
            own.prefilled = own.prefilled.saturating_add(work.tokens);
            let outstanding = s.outstanding_tokens();
            s.queue.add(now, outstanding, work);
        });
    }

    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64) {
        let vm = self.vm;
        self.change(worker, |s| {
            let own = s.own(vm);
            own.inflight = own.inflight.saturating_sub(1);
            own.outstanding_tokens = own.outstanding_tokens.saturating_sub(prefill_tokens);
            s.hold_ms = averaged(s.hold_ms, held_ms);
        });
    }

    fn now_ms(&self) -> u64 {
        self.host.now_ms()
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    #[test]
    fn shared_counts_are_seen_by_every_vm_and_never_go_below_zero() {
        let host: Arc<dyn crate::host::Host> = Arc::new(MemoryHost::default());
        let vm1 = SharedInflight::new(Arc::clone(&host), 1);
        let vm2 = SharedInflight::new(host, 2);
        vm1.acquire("A", PrefillWork::NONE);
        vm2.acquire("A", PrefillWork::NONE);
        assert_eq!((vm1.inflight("A"), vm2.inflight("A")), (2, 2));
        vm2.release("A", 0, 0);
        vm1.release("A", 0, 0);
        vm1.release("A", 0, 0);
        assert_eq!((vm2.inflight("A"), vm2.dispatched_total("A")), (0, 2));
    }

    #[test]
    fn a_dead_vms_share_is_reclaimed_and_its_dispatches_still_count() {
        let host: Arc<dyn crate::host::Host> = Arc::new(MemoryHost::default());
        let crashed = SharedInflight::new(Arc::clone(&host), 1);
        let alive = SharedInflight::new(Arc::clone(&host), 2);
        crashed.acquire("A", PrefillWork::NONE);
        crashed.acquire("A", PrefillWork::NONE);
        alive.acquire("A", PrefillWork::NONE);
        assert_eq!(alive.inflight("A"), 3);
        assert_eq!(SharedInflight::reclaim(host.as_ref(), "A", &[1]).unwrap(), 2);
        assert_eq!((alive.inflight("A"), alive.dispatched_total("A")), (1, 3));
        alive.release("A", 0, 0);
        assert_eq!(alive.inflight("A"), 0);
    }

    #[test]
    fn every_vm_feeds_one_prefill_queue_and_a_dead_vms_tokens_leave_the_bound() {
        let host = Arc::new(MemoryHost::default());
        let vm1 = SharedInflight::new(host.clone(), 1);
        let vm2 = SharedInflight::new(host.clone(), 2);
        let work = PrefillWork { tokens: 400, tokens_per_ms: 0.001 };
        vm1.acquire("A", work);
        vm2.acquire("A", work);
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 800);
        SharedInflight::reclaim(host.as_ref(), "A", &[2]).unwrap();
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 400, "the dead VM's request no longer counts");
        vm1.release("A", 400, 0);
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 0);
    }

    #[test]
    fn concurrent_updates_from_many_vms_are_not_lost() {
        // Interleave read-modify-write cycles: every VM reads, then every VM writes with its cas.
        let host = Arc::new(MemoryHost::default());
        let vms: Vec<SharedInflight> = (0..8).map(|vm| SharedInflight::new(host.clone(), vm)).collect();
        for round in 0..50 {
            for vm in &vms {
                vm.acquire("A", PrefillWork::NONE);
                if round % 2 == 1 {
                    vm.release("A", 0, 0);
                }
            }
        }
        assert_eq!(vms[0].inflight("A"), 8 * 25);
        assert_eq!(vms[3].dispatched_total("A"), 8 * 50);
    }
}
