//! In-flight accounting across VMs (design §6, spec §5: counts live in shared data, survive a VM
//! crash, never go below zero). Each VM owns one shared key holding its records for every worker:
//! it counts its own dispatches in memory, exactly and without a host call, and publishes them with
//! one blind write per sync; it reads what the other live VMs last published once per sync. The
//! request path makes no shared-data call for accounting, and no key is ever written by two VMs,
//! so nothing needs cas.
//!
//! A VM syncs from its request path (as a request arrives, after it is dispatched, when it ends)
//! at most every [`SYNC_MS`], and on its heartbeat tick: a tick into wasm costs Envoy CPU even when it
//! does nothing, so a fast tick would cost more than the exchange it carries. The
//! bound, stated: a VM sees its own dispatches at once; a change of another VM's is published at
//! that VM's next request event at least [`SYNC_MS`] after its last publication (at once when its
//! requests are further apart, and when its last request in flight ends), or by its next heartbeat
//! (within a second), except that a dispatch sending an engine a prompt to prefill is published at
//! once unless such news was published less than [`NEWS_MS`] ago; and read on this VM's next
//! request at least [`SYNC_MS`] after its last read. A cap such as `max_inflight_requests` can be
//! exceeded by at most what the other VMs dispatched in that window; with one worker thread the
//! counts are exact. Each VM's prefill estimate drains as its own lane, so with several VMs the
//! pending-prefill sum drains up to that many times faster than one lane would, and stays bounded
//! by the tokens still in flight.

use std::sync::{Arc, Mutex};

use super::batching::Batching;
use super::fleet::EngineFit;
use super::inflight::{FirstByte, InflightTable, LocalLoad, PrefillQueue, PrefillWork, Record};
use super::speed::SpeedFit;
use super::unanswered::{Unanswered, Waiting};
use crate::host::{Host, HostError};
use crate::state::schedule::{Period, NEWS_MS};
use crate::state::shared::decode_u64;
use crate::state::{keys, vm_registry};

/// How often a busy filter VM publishes its records and reads the others'.
pub const SYNC_MS: u64 = 5;

/// Leads each VM's key: an empty value would read back as absent.
const SHARE_HEADER: [u8; 8] = *b"sglinf06";
/// Leads the dead VMs' folded totals, which only the service writes.
const RETIRED_HEADER: [u8; 8] = *b"sglret05";
const RECORD_WORDS: usize = 18;
const RETIRED_WORDS: usize = 10;

/// A dead VM's speed samples and batching pairs count this much less each time another VM dies: a
/// line of restarts leaves what the live VMs see plus at most about two VMs' worth of history.
const RETIRED_DECAY: f64 = 0.5;

/// A value naming its workers, then one row of `W` words per worker: VMs configured at different
/// times (a live update of the filter configuration) list different workers, in different orders.
fn encode_rows<'a, const W: usize>(
    header: &[u8; 8],
    rows: impl ExactSizeIterator<Item = (&'a str, [u64; W])> + Clone,
) -> Vec<u8> {
    let names: usize = rows.clone().map(|(id, _)| 2 + id.len()).sum();
    let mut out = Vec::with_capacity(header.len() + 4 + names + rows.len() * W * 8);
    out.extend_from_slice(header);
    out.extend_from_slice(&(rows.len() as u32).to_le_bytes());
    for (id, _) in rows.clone() {
        let id = &id.as_bytes()[..id.len().min(usize::from(u16::MAX))];
        out.extend_from_slice(&(id.len() as u16).to_le_bytes());
        out.extend_from_slice(id);
    }
    for (_, row) in rows {
        for w in row {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out
}

/// The rows of a value for the workers `index` knows, by their position there; `None` for a value
/// this build cannot read. Workers the value names and `index` does not are skipped.
fn decode_rows<const W: usize>(
    bytes: &[u8],
    header: &[u8; 8],
    index: &hashbrown::HashMap<String, usize>,
) -> Option<Vec<(usize, [u64; W])>> {
    let mut rest = bytes.strip_prefix(header.as_slice())?;
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        rest = tail;
        Some(head)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
    let mut slots = Vec::with_capacity(count.min(4096));
    for _ in 0..count {
        let len = u16::from_le_bytes(take(2)?.try_into().ok()?) as usize;
        let id = std::str::from_utf8(take(len)?).ok()?;
        slots.push(index.get(id).copied());
    }
    let mut out = Vec::with_capacity(slots.len());
    for slot in slots {
        let mut row = [0u64; W];
        for w in &mut row {
            *w = decode_u64(take(8)?)?;
        }
        if let Some(slot) = slot {
            out.push((slot, row));
        }
    }
    rest.is_empty().then_some(out)
}

fn record_row(r: &Record) -> [u64; RECORD_WORDS] {
    let q = &r.queue;
    let [a, b, c, d, e, f] = r.speed.words();
    let [since, waited] = Waiting::words(r.waiting);
    let [together, apart] = r.batching.words();
    [
        r.inflight,
        r.total,
        r.outstanding_tokens,
        r.prefilled,
        q.tokens,
        q.at_ms,
        q.tokens_per_ms.to_bits(),
        r.hold_ms.to_bits(),
        a,
        b,
        c,
        d,
        e,
        f,
        since,
        waited,
        together,
        apart,
    ]
}

fn speed_words(w: &[u64]) -> SpeedFit {
    match <[u64; 6]>::try_from(w) {
        Ok(words) => SpeedFit::from_words(words),
        Err(_) => SpeedFit::default(),
    }
}

fn row_record(w: [u64; RECORD_WORDS]) -> Record {
    Record {
        inflight: w[0],
        total: w[1],
        outstanding_tokens: w[2],
        prefilled: w[3],
        queue: PrefillQueue { tokens: w[4], at_ms: w[5], tokens_per_ms: f64::from_bits(w[6]) },
        hold_ms: f64::from_bits(w[7]),
        speed: speed_words(&w[8..14]),
        waiting: Waiting::from_words([w[14], w[15]]),
        batching: Batching::from_words([w[16], w[17]]),
    }
}

/// What the dead VMs leave: their dispatch totals, and what they learned of each engine's speed
/// and batching.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Retired {
    total: u64,
    prefilled: u64,
    speed: SpeedFit,
    batching: Batching,
}

fn retired_row(r: &Retired) -> [u64; RETIRED_WORDS] {
    let [a, b, c, d, e, f] = r.speed.words();
    let [together, apart] = r.batching.words();
    [r.total, r.prefilled, a, b, c, d, e, f, together, apart]
}

/// A VM's published records, by `index`'s positions (absent workers: zero), or `None` for a value
/// this build cannot read (or a reclaimed VM's).
fn decode_records(bytes: &[u8], index: &hashbrown::HashMap<String, usize>) -> Option<Vec<Record>> {
    let mut out = vec![Record::default(); index.len()];
    for (slot, row) in decode_rows::<RECORD_WORDS>(bytes, &SHARE_HEADER, index)? {
        if let Some(r) = out.get_mut(slot) {
            *r = row_record(row);
        }
    }
    Some(out)
}

fn decode_retired(bytes: &[u8], index: &hashbrown::HashMap<String, usize>) -> Vec<Retired> {
    let mut out = vec![Retired::default(); index.len()];
    for (slot, row) in decode_rows::<RETIRED_WORDS>(bytes, &RETIRED_HEADER, index).unwrap_or_default() {
        if let Some(s) = out.get_mut(slot) {
            *s = Retired {
                total: row[0],
                prefilled: row[1],
                speed: speed_words(&row[2..8]),
                batching: Batching::from_words([row[8], row[9]]),
            };
        }
    }
    out
}

/// The mean of two hold-time averages, each weighted by the dispatches behind it.
fn merged_hold(a: &Record, b: &Record) -> f64 {
    let weight = |r: &Record| if r.hold_ms > 0.0 { r.total.max(1) as f64 } else { 0.0 };
    let (wa, wb) = (weight(a), weight(b));
    if wa + wb == 0.0 {
        0.0
    } else {
        (a.hold_ms * wa + b.hold_ms * wb) / (wa + wb)
    }
}

/// Adds `other` (one VM's records, evaluated at `now_ms`) into `sum`: counts add, prefill lanes
/// add what is left of each, the hold time is the weighted mean, speed samples add up, the
/// longer-waiting unanswered dispatch is kept.
fn fold(sum: &mut Record, other: &Record, now_ms: u64) {
    let hold_ms = merged_hold(sum, other);
    let left = sum.pending_at(now_ms).saturating_add(other.pending_at(now_ms));
    sum.inflight = sum.inflight.saturating_add(other.inflight);
    sum.total = sum.total.saturating_add(other.total);
    sum.outstanding_tokens = sum.outstanding_tokens.saturating_add(other.outstanding_tokens);
    sum.prefilled = sum.prefilled.saturating_add(other.prefilled);
    sum.queue = PrefillQueue {
        tokens: left,
        at_ms: now_ms,
        tokens_per_ms: sum.queue.tokens_per_ms.max(other.queue.tokens_per_ms),
    };
    sum.hold_ms = hold_ms;
    sum.speed = sum.speed.merged(&other.speed);
    sum.waiting = Waiting::older(sum.waiting, other.waiting);
    sum.batching = sum.batching.merged(&other.batching);
}

#[derive(Debug)]
struct Synced {
    /// This VM's dispatches, exact.
    own: Vec<Record>,
    /// This VM's dispatches waiting for a timing first byte, per worker.
    unanswered: Vec<Unanswered>,
    /// Every other live VM's and the dead VMs' retired totals, as of the last read.
    others: Vec<Record>,
    /// `own` changed since it was last published.
    dirty: bool,
    /// This VM's dispatches still in flight, over every worker.
    active: u64,
    published: Period,
    /// Publications of news, on their own clock (`NEWS_MS`).
    news: Period,
    read: Period,
}

/// This VM's side of the shared in-flight table. Engine records are indexed by the configured
/// worker order, which every VM and the service share (one configuration).
pub struct SharedInflight {
    host: Arc<dyn Host>,
    vm: u64,
    /// The configured workers, in order; `index` finds one's position.
    names: Vec<String>,
    index: hashbrown::HashMap<String, usize>,
    state: Mutex<Synced>,
}

impl SharedInflight {
    /// `vm` names this VM's key; it must be unique per VM instance. The service, which dispatches
    /// nothing, reads with its own id and never publishes.
    pub fn new<'a>(host: Arc<dyn Host>, vm: u64, workers: impl IntoIterator<Item = &'a str>) -> Self {
        let mut names: Vec<String> = Vec::new();
        for id in workers {
            if !names.iter().any(|n| n == id) {
                names.push(id.to_string());
            }
        }
        let index: hashbrown::HashMap<String, usize> =
            names.iter().enumerate().map(|(i, id)| (id.clone(), i)).collect();
        let n = index.len();
        let state = Synced {
            own: vec![Record::default(); n],
            unanswered: vec![Unanswered::default(); n],
            others: vec![Record::default(); n],
            dirty: false,
            active: 0,
            published: Period::every(SYNC_MS),
            news: Period::every(NEWS_MS),
            read: Period::every(SYNC_MS),
        };
        Self { host, vm, names, index, state: Mutex::new(state) }
    }

    fn workers(&self) -> usize {
        self.index.len()
    }

    fn encode_records(&self, records: &[Record]) -> Vec<u8> {
        encode_rows(&SHARE_HEADER, self.names.iter().zip(records).map(|(id, r)| (id.as_str(), record_row(r))))
    }

    fn encode_retired(&self, retired: &[Retired]) -> Vec<u8> {
        encode_rows(&RETIRED_HEADER, self.names.iter().zip(retired).map(|(id, r)| (id.as_str(), retired_row(r))))
    }

    fn others(&self, now_ms: u64) -> Result<Vec<Record>, HostError> {
        let mut sum = vec![Record::default(); self.workers()];
        for vm in vm_registry::alive(self.host.as_ref())? {
            if vm == self.vm {
                continue;
            }
            let Some(value) = self.host.shared_get(&keys::inflight_share(vm))? else { continue };
            if let Some(records) = decode_records(&value.bytes, &self.index) {
                for (s, r) in sum.iter_mut().zip(&records) {
                    fold(s, r, now_ms);
                }
            }
        }
        if let Some(value) = self.host.shared_get(keys::INFLIGHT_RETIRED)? {
            for (s, r) in sum.iter_mut().zip(decode_retired(&value.bytes, &self.index)) {
                s.total = s.total.saturating_add(r.total);
                s.prefilled = s.prefilled.saturating_add(r.prefilled);
                s.speed = s.speed.merged(&r.speed);
                s.batching = s.batching.merged(&r.batching);
            }
        }
        Ok(sum)
    }

    /// The service's sweep: folds the dispatch totals of VMs that died into the retired record
    /// (so corrections by dispatches since a report do not jump back) with what they learned of
    /// the engines' speed (so a restarted VM does not start from the prior), drops their requests,
    /// and empties their keys. Returns how many in-flight requests were dropped.
    pub fn reclaim(&self, dead: &[u64]) -> Result<u64, HostError> {
        let host = self.host.as_ref();
        let mut retired = match host.shared_get(keys::INFLIGHT_RETIRED)? {
            Some(v) => decode_retired(&v.bytes, &self.index),
            None => vec![Retired::default(); self.workers()],
        };
        let mut dropped = 0u64;
        let mut emptied = Vec::new();
        for &vm in dead {
            let key = keys::inflight_share(vm);
            let Some(value) = host.shared_get(&key)? else { continue };
            let Some(records) = decode_records(&value.bytes, &self.index) else { continue };
            for (slot, r) in retired.iter_mut().zip(&records) {
                slot.total = slot.total.saturating_add(r.total);
                slot.prefilled = slot.prefilled.saturating_add(r.prefilled);
                slot.speed = slot.speed.scaled(RETIRED_DECAY).merged(&r.speed);
                slot.batching = slot.batching.scaled(RETIRED_DECAY).merged(&r.batching);
                dropped = dropped.saturating_add(r.inflight);
            }
            emptied.push(key);
        }
        if emptied.is_empty() {
            return Ok(0);
        }
        // The dead VMs are already out of the registry, so no reader reads their keys: until the
        // totals below land, a reader misses their dispatches for one sync. Emptying the keys
        // keeps a second reclaim from counting them again.
        host.shared_set(keys::INFLIGHT_RETIRED, &self.encode_retired(&retired), None)?;
        for key in emptied {
            host.shared_set(&key, &encode_rows::<RECORD_WORDS>(&SHARE_HEADER, std::iter::empty()), None)?;
        }
        Ok(dropped)
    }

    fn publish(&self, now_ms: u64) {
        let bytes = match self.state.lock() {
            Ok(mut state) if state.dirty => {
                state.dirty = false;
                state.published.done(now_ms);
                self.encode_records(&state.own)
            }
            _ => return,
        };
        if let Err(e) = self.host.shared_set(&keys::inflight_share(self.vm), &bytes, None) {
            log::warn!("in-flight counts not published: {e}");
            if let Ok(mut state) = self.state.lock() {
                state.dirty = true;
            }
        }
    }

    fn read(&self, now_ms: u64) {
        match self.others(now_ms) {
            Ok(others) => {
                if let Ok(mut state) = self.state.lock() {
                    state.others = others;
                    state.read.done(now_ms);
                }
            }
            Err(e) => log::warn!("other VMs' in-flight counts not read: {e}"),
        }
    }

    /// Changes this VM's record of `worker` (and its unanswered dispatches there), to be published.
    fn with_own(&self, worker: &str, f: impl FnOnce(&mut Record, &mut Unanswered)) {
        let Some(&i) = self.index.get(worker) else {
            log::warn!("in-flight count of unknown worker {worker} not kept");
            return;
        };
        if let Ok(mut state) = self.state.lock() {
            let Synced { own, unanswered, active, dirty, .. } = &mut *state;
            if let (Some(r), Some(u)) = (own.get_mut(i), unanswered.get_mut(i)) {
                let before = r.inflight;
                f(r, u);
                *active = active.saturating_add(r.inflight).saturating_sub(before);
                *dirty = true;
            }
        }
    }
}

impl std::fmt::Debug for SharedInflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedInflight").field("vm", &self.vm).field("workers", &self.workers()).finish()
    }
}

impl InflightTable for SharedInflight {
    fn local_load(&self, worker: &str) -> LocalLoad {
        let Some(&i) = self.index.get(worker) else { return LocalLoad::default() };
        let now = self.host.now_ms();
        let Ok(state) = self.state.lock() else { return LocalLoad::default() };
        let (own, others) = (state.own.get(i).copied().unwrap_or_default(), state.others.get(i).copied());
        let mut sum = own;
        if let Some(others) = others {
            fold(&mut sum, &others, now);
        }
        sum.local_load(now)
    }

    fn acquire(&self, worker: &str, work: PrefillWork) {
        let now = self.host.now_ms();
        self.with_own(worker, |r, _| r.acquire(now, work));
    }

    fn awaiting(&self, worker: &str, waiting: Waiting) {
        self.with_own(worker, |r, u| r.track(u, |u| u.add(waiting)));
    }

    fn answered(&self, worker: &str, waiting: Waiting) {
        self.with_own(worker, |r, u| r.track(u, |u| u.answered(waiting)));
    }

    fn first_byte(&self, worker: &str, answer: FirstByte, prior_tokens_per_ms: f64) {
        let now = self.host.now_ms();
        self.with_own(worker, |r, u| r.first_byte(now, answer, u, prior_tokens_per_ms));
    }

    fn release(&self, worker: &str, prefill_tokens: u64, held_ms: u64) {
        self.with_own(worker, |r, _| r.release(prefill_tokens, held_ms));
    }

    fn now_ms(&self) -> u64 {
        self.host.now_ms()
    }

    fn idle(&self) -> bool {
        self.state.lock().is_ok_and(|s| s.active == 0)
    }

    fn each_fit(&self, each: &mut dyn FnMut(EngineFit)) {
        let now = self.host.now_ms();
        if let Ok(state) = self.state.lock() {
            state.own.iter().zip(&state.others).for_each(|(own, others)| {
                let waiting = Waiting::older(own.waiting, others.waiting);
                each(EngineFit { fit: own.speed.merged(&others.speed), unanswered: waiting.map(|w| w.at(now)) })
            });
        }
    }

    fn sync_if_due(&self) {
        let now = self.host.now_ms();
        // A VM whose last request ended publishes at once: nothing may follow to carry it.
        let Ok((publish, read)) =
            self.state.lock().map(|s| (s.dirty && s.published.due(s.active == 0, now), s.read.elapsed(now)))
        else {
            return;
        };
        if publish {
            self.publish(now);
        }
        if read {
            self.read(now);
        }
    }

    fn publish_now(&self) {
        self.publish(self.host.now_ms());
    }

    fn publish_news(&self) {
        let now = self.host.now_ms();
        if self.state.lock().is_ok_and(|mut s| s.dirty && s.news.claim(now)) {
            self.publish(now);
        }
    }

    /// Publishes this VM's records if they changed, then reads every other live VM's.
    fn sync(&self) {
        let now = self.host.now_ms();
        self.publish(now);
        self.read(now);
    }
}

#[cfg(test)]
mod tests {
    use super::super::inflight::averaged;
    use super::super::speed::Sample;
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    const WORKERS: [&str; 2] = ["A", "B"];

    fn vm(host: &Arc<MemoryHost>, id: u64) -> SharedInflight {
        vm_registry::heartbeat(host.as_ref(), id, 0, true).unwrap();
        SharedInflight::new(Arc::clone(host) as Arc<dyn Host>, id, WORKERS)
    }

    #[test]
    fn a_vm_sees_its_own_dispatches_at_once_and_the_others_after_a_sync() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        vm1.acquire("A", PrefillWork::NONE);
        vm2.acquire("A", PrefillWork::NONE);
        assert_eq!((vm1.inflight("A"), vm2.inflight("A")), (1, 1), "no host call on the request path");
        vm1.sync();
        vm2.sync();
        vm1.sync();
        assert_eq!((vm1.inflight("A"), vm2.inflight("A")), (2, 2));
        vm2.release("A", 0, 0);
        vm1.release("A", 0, 0);
        vm1.release("A", 0, 0);
        for v in [&vm1, &vm2, &vm1] {
            v.sync();
        }
        assert_eq!((vm2.inflight("A"), vm2.dispatched_total("A")), (0, 2));
        assert_eq!(vm1.inflight("B"), 0);
    }

    /// VMs configured before and after a live update list different workers in different orders:
    /// each counts a worker they share under its name, and ignores the others'.
    #[test]
    fn vms_of_different_configurations_agree_on_the_workers_they_share() {
        let host = Arc::new(MemoryHost::default());
        let old = vm(&host, 1);
        vm_registry::heartbeat(host.as_ref(), 2, 0, true).unwrap();
        let new = SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 2, ["C", "B"]);
        old.acquire("A", PrefillWork::NONE);
        old.acquire("B", PrefillWork::NONE);
        new.acquire("C", PrefillWork::NONE);
        new.acquire("B", PrefillWork::NONE);
        old.sync();
        new.sync();
        old.sync();
        assert_eq!((new.inflight("B"), new.inflight("C"), new.inflight("A")), (2, 1, 0));
        assert_eq!((old.inflight("A"), old.inflight("B")), (1, 2));
        let service = SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, ["B", "C"]);
        assert_eq!(service.reclaim(&[1]).unwrap(), 1, "its request to B is dropped; A is no longer configured");
        new.sync();
        assert_eq!((new.inflight("B"), new.dispatched_total("B")), (1, 2), "its dispatches to B still count");
    }

    #[test]
    fn the_request_path_makes_no_host_call_and_an_idle_sync_writes_nothing() {
        let host = Arc::new(MemoryHost::default());
        let vm1 = vm(&host, 1);
        vm1.sync();
        let key = keys::inflight_share(1);
        assert_eq!(host.shared_get(&key).unwrap(), None, "nothing dispatched: nothing published");
        vm1.acquire("B", PrefillWork::NONE);
        assert_eq!(host.shared_get(&key).unwrap(), None);
        vm1.sync();
        let published = decode_records(&host.shared_get(&key).unwrap().unwrap().bytes, &vm1.index).unwrap();
        assert_eq!((published[0].inflight, published[1].inflight), (0, 1));
    }

    #[test]
    fn a_dispatch_is_published_at_once_unless_one_was_published_within_the_period() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        vm1.sync_if_due();
        vm1.acquire("A", PrefillWork::NONE);
        vm1.sync_if_due();
        vm2.sync_if_due();
        assert_eq!(vm2.inflight("A"), 1, "the read on arrival did not hold back the publication after dispatch");
        vm1.acquire("A", PrefillWork::NONE);
        vm1.sync_if_due();
        host.advance_ms(SYNC_MS);
        vm2.sync_if_due();
        assert_eq!(vm2.inflight("A"), 1, "a second change within the period waits");
        vm1.sync_if_due();
        host.advance_ms(SYNC_MS);
        vm2.sync_if_due();
        assert_eq!(vm2.inflight("A"), 2);
    }

    #[test]
    fn a_vm_whose_last_request_ended_publishes_at_once() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        vm1.acquire("A", PrefillWork::NONE);
        vm1.acquire("B", PrefillWork::NONE);
        vm1.sync_if_due();
        vm1.release("A", 0, 0);
        vm1.sync_if_due();
        assert!(!vm1.idle());
        vm2.sync();
        assert_eq!((vm2.inflight("A"), vm2.inflight("B")), (1, 1), "one still in flight: the period holds");
        vm1.release("B", 0, 0);
        vm1.release("B", 0, 0);
        assert!(vm1.idle(), "a release below zero does not count");
        vm1.sync_if_due();
        vm2.sync();
        assert_eq!((vm2.inflight("A"), vm2.inflight("B")), (0, 0), "idle: published within the period");
    }

    #[test]
    fn a_dead_vms_requests_are_dropped_and_its_dispatches_still_count() {
        let host = Arc::new(MemoryHost::default());
        let (crashed, alive) = (vm(&host, 1), vm(&host, 2));
        crashed.acquire("A", PrefillWork::NONE);
        crashed.acquire("A", PrefillWork::NONE);
        crashed.sync();
        alive.acquire("A", PrefillWork::NONE);
        alive.sync();
        assert_eq!(alive.inflight("A"), 3);
        vm_registry::heartbeat(host.as_ref(), 2, 20_000, true).unwrap();
        assert_eq!(vm_registry::sweep(host.as_ref(), 20_000).unwrap(), vec![1]);
        let service = SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, WORKERS);
        assert_eq!(service.reclaim(&[1]).unwrap(), 2);
        alive.sync();
        assert_eq!((alive.inflight("A"), alive.dispatched_total("A")), (1, 3));
        alive.release("A", 0, 0);
        alive.sync();
        service.sync();
        assert_eq!((service.inflight("A"), service.dispatched_total("A")), (0, 3));
        assert_eq!(service.reclaim(&[1]).unwrap(), 0, "an emptied key gives nothing back twice");
    }

    #[test]
    fn every_vms_prefill_lane_counts_and_a_dead_vms_tokens_leave_the_bound() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        let work = PrefillWork { tokens: 400, tokens_per_ms: 0.001, ahead: 0, slot_wait_ms: 0 };
        vm1.acquire("A", work);
        vm2.acquire("A", work);
        vm2.sync();
        vm1.sync();
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 800);
        SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, WORKERS).reclaim(&[2]).unwrap();
        vm_registry::heartbeat(host.as_ref(), 1, 20_000, true).unwrap();
        vm_registry::sweep(host.as_ref(), 20_000).unwrap();
        vm1.sync();
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 400, "the dead VM's request no longer counts");
        vm1.release("A", 400, 0);
        assert_eq!(vm1.local_load("A").pending_prefill_tokens, 0);
    }

    #[test]
    fn hold_times_are_averaged_over_every_vms_dispatches() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        for _ in 0..3 {
            vm1.acquire("A", PrefillWork::NONE);
            vm1.release("A", 0, 100);
        }
        vm2.acquire("A", PrefillWork::NONE);
        vm2.release("A", 0, 400);
        vm2.sync();
        vm1.sync();
        let own = (0..3).fold(0.0, |h, _| averaged(h, 100));
        let expected = (own * 3.0 + 400.0) / 4.0;
        let seen = vm1.local_load("A").hold_ms.unwrap();
        assert!((seen - expected).abs() < 1e-9, "{seen} vs {expected}");
    }

    #[test]
    fn an_unreadable_share_is_skipped() {
        let host = Arc::new(MemoryHost::default());
        let vm1 = vm(&host, 1);
        vm(&host, 2);
        host.shared_set(&keys::inflight_share(2), b"sglinf01 an older layout", None).unwrap();
        vm1.acquire("A", PrefillWork::NONE);
        vm1.sync();
        assert_eq!(vm1.inflight("A"), 1);
    }

    /// An engine at 5 tokens/ms with 10 ms of overhead, seen by `vm` over `n` requests.
    fn teach(vm: &SharedInflight, n: u64) {
        for i in 0..n {
            let tokens = 100 + (i % 7) * 500;
            vm.acquire("A", PrefillWork { tokens, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 });
            let sample = Some(Sample { tokens, ms: 10 + tokens / 5 });
            vm.first_byte("A", FirstByte { prefill_tokens: tokens, sent_ms: 0, sample }, 20.0);
            vm.release("A", 0, 50);
        }
    }

    fn rate(vm: &SharedInflight) -> f64 {
        vm.local_load("A").speed.speed(20.0).tokens_per_ms
    }

    #[test]
    fn what_one_vm_learns_of_an_engine_every_vm_uses() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        teach(&vm1, 100);
        assert!((rate(&vm1) - 5.0).abs() < 0.25, "{}", rate(&vm1));
        assert_eq!(rate(&vm2), 20.0, "not synced yet: the prior");
        vm1.sync();
        vm2.sync();
        assert!((rate(&vm2) - 5.0).abs() < 0.25, "{}", rate(&vm2));
        assert_eq!(vm2.local_load("B").speed, SpeedFit::default(), "engines apart");
        assert!((vm2.prior(20.0).untimed - 5.0).abs() < 0.25, "B, untimed, is assumed as slow as A");
    }

    #[test]
    fn a_dispatch_one_vm_still_waits_on_slows_the_engine_for_every_vm() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        let work = PrefillWork { tokens: 2_000, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        let sent = Waiting { since_ms: host.now_ms(), tokens: 2_000 };
        vm1.acquire("A", work);
        vm1.awaiting("A", sent);
        vm1.awaiting("A", Waiting { since_ms: sent.since_ms + 10, tokens: 2_500 });
        host.set_now_ms(sent.since_ms + 1_050);
        vm1.sync();
        vm2.sync();
        let seen = vm2.local_load("A");
        assert_eq!(seen.unanswered, Some(sent.at(host.now_ms())), "the oldest is published");
        assert_eq!(seen.speed_now(20.0).tokens_per_ms, 2.0);
        assert_eq!(vm2.local_load("B").unanswered, None);
        vm1.answered("A", sent);
        vm1.sync();
        vm2.sync();
        assert_eq!(vm2.local_load("A").unanswered.map(|w| w.tokens), Some(2_500), "the next oldest");
    }

    #[test]
    fn what_a_dead_vm_learned_survives_its_restart() {
        let host = Arc::new(MemoryHost::default());
        let old = vm(&host, 1);
        teach(&old, 100);
        old.sync();
        vm_registry::heartbeat(host.as_ref(), 2, 20_000, true).unwrap();
        vm_registry::sweep(host.as_ref(), 20_000).unwrap();
        SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, WORKERS).reclaim(&[1]).unwrap();
        // The VM comes back under a new id, with nothing of its own.
        let new = vm(&host, 2);
        assert_eq!(rate(&new), 20.0);
        new.sync();
        assert!((rate(&new) - 5.0).abs() < 0.25, "{}", rate(&new));
        // A second death halves the first one's weight: history stays bounded.
        teach(&new, 100);
        new.sync();
        let weight = new.local_load("A").speed.weight();
        vm_registry::heartbeat(host.as_ref(), 3, 40_000, true).unwrap();
        vm_registry::sweep(host.as_ref(), 40_000).unwrap();
        SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, WORKERS).reclaim(&[2]).unwrap();
        let third = vm(&host, 3);
        third.sync();
        let left = third.local_load("A").speed.weight();
        assert!(left < weight && left > weight * 0.7, "{left} of {weight}");
        assert!((rate(&third) - 5.0).abs() < 0.25);
    }

    /// `vm` sends `n` pairs of 400-token requests to A at once; the engine answers each pair at
    /// once when `batched`, else one at a time.
    fn batch_pairs(host: &MemoryHost, vm: &SharedInflight, n: u64, batched: bool) {
        let work = PrefillWork { tokens: 400, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 };
        for _ in 0..n {
            let sent_ms = host.now_ms();
            for gap_ms in [50, if batched { 0 } else { 40 }] {
                vm.acquire("A", work);
                host.set_now_ms(host.now_ms() + gap_ms);
                let sample = Some(Sample { tokens: 400, ms: host.now_ms() - sent_ms });
                vm.first_byte("A", FirstByte { prefill_tokens: 400, sent_ms, sample }, 20.0);
                vm.release("A", 0, 100);
            }
        }
    }

    #[test]
    fn every_vm_sees_an_engine_batch_and_a_restart_keeps_it() {
        let host = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (vm(&host, 1), vm(&host, 2));
        batch_pairs(&host, &vm1, 2, true);
        batch_pairs(&host, &vm2, 2, true);
        assert!(!vm1.local_load("A").batching.batches(), "two pairs together: not yet");
        vm1.sync();
        vm2.sync();
        assert!(vm2.local_load("A").batching.batches(), "four over both VMs");
        assert!(!vm2.local_load("B").batching.batches());
        vm_registry::heartbeat(host.as_ref(), 3, 20_000, true).unwrap();
        vm_registry::sweep(host.as_ref(), 20_000).unwrap();
        SharedInflight::new(Arc::clone(&host) as Arc<dyn Host>, 0, WORKERS).reclaim(&[1, 2]).unwrap();
        let third = vm(&host, 3);
        third.sync();
        assert!(third.local_load("A").batching.batches(), "the dead VMs' pairs are kept");
    }

    #[test]
    fn an_engine_answering_one_at_a_time_is_not_seen_to_batch() {
        let host = Arc::new(MemoryHost::default());
        let vm1 = vm(&host, 1);
        batch_pairs(&host, &vm1, 50, false);
        let seen = vm1.local_load("A").batching;
        assert!(!seen.batches() && seen.together_pct() == 0, "{seen:?}");
    }
}
