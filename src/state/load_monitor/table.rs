//! The reported-load table: per-rank reports with their time, aggregated per worker only when
//! every rank is fresh. The service owns the table; filters read snapshots of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::reports::{RankReport, ReportKind};

/// A worker's fresh, complete report, summed over its ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineLoad {
    pub kind: ReportKind,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub kv_used: Option<u64>,
    pub kv_capacity: Option<u64>,
    pub max_running: Option<u64>,
    pub waiting_uncached_tokens: Option<u64>,
    /// Estimated time to drain the waiting uncached tokens at the measured prefill throughput.
    pub prefill_queue_ms: Option<f64>,
    /// Measured prefill throughput, tokens per busy millisecond, summed over the ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_ms: Option<f64>,
    /// When the oldest rank's report was taken.
    pub reported_at_ms: u64,
    /// What the router had sent the worker when that report arrived: what the report cannot show
    /// yet.
    #[serde(default)]
    pub sent_at_report: SentCounts,
    /// Running + waiting requests per data-parallel rank, for an engine of several ranks: which
    /// rank a request is routed to (`routed_dp_rank`, spec §7).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_loads: Vec<u64>,
}

impl EngineLoad {
    /// KV usage fraction, from tokens when a capacity is known.
    pub fn kv_usage(&self) -> Option<f64> {
        match (self.kv_used, self.kv_capacity) {
            (Some(used), Some(cap)) if cap > 0 => Some(used as f64 / cap as f64),
            _ => None,
        }
    }

    /// A native report with a valid capacity: what power-of-two's pressure comparisons need.
    pub fn is_native_with_capacity(&self) -> bool {
        self.kind == ReportKind::Native
            && self.kv_capacity.is_some_and(|c| c > 0)
            && self.running.is_some()
            && self.waiting.is_some()
    }
}

/// The router's running totals of what it sent one engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentCounts {
    pub dispatches: u64,
    pub uncached_tokens: u64,
}

impl SentCounts {
    /// What was sent after `earlier` was counted.
    pub fn since(self, earlier: SentCounts) -> SentCounts {
        SentCounts {
            dispatches: self.dispatches.saturating_sub(earlier.dispatches),
            uncached_tokens: self.uncached_tokens.saturating_sub(earlier.uncached_tokens),
        }
    }
}

/// One rank's latest report as the service keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RankSample {
    report: RankReport,
    at_ms: u64,
    /// Prefill throughput in tokens per millisecond of busy time, from the previous sample.
    prefill_tokens_per_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WorkerLoad {
    kind: ReportKind,
    dp_size: u32,
    ranks: Vec<Option<RankSample>>,
    #[serde(default)]
    sent_at_report: SentCounts,
}

/// The service's table and the document it publishes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadTable {
    workers: HashMap<String, WorkerLoad>,
}

impl LoadTable {
    /// Records a successful poll of `worker` (`dp_size` ranks expected), when the router had sent it
    /// `sent`.
    pub fn record(
        &mut self,
        worker: &str,
        dp_size: u32,
        kind: ReportKind,
        reports: Vec<RankReport>,
        now_ms: u64,
        sent: SentCounts,
    ) {
        let entry = self.workers.entry(worker.to_string()).or_insert_with(|| WorkerLoad {
            kind,
            dp_size,
            ranks: vec![None; dp_size.max(1) as usize],
            sent_at_report: sent,
        });
        entry.kind = kind;
        entry.sent_at_report = sent;
        if entry.ranks.len() != dp_size.max(1) as usize {
            entry.ranks = vec![None; dp_size.max(1) as usize];
        }
        for report in reports {
            let Some(slot) = entry.ranks.get_mut(report.dp_rank as usize) else {
                continue;
            };
            let throughput = slot
                .as_ref()
                .and_then(|prev| throughput(&prev.report, &report))
                .or_else(|| slot.as_ref().and_then(|prev| prev.prefill_tokens_per_ms));
            *slot = Some(RankSample { report, at_ms: now_ms, prefill_tokens_per_ms: throughput });
        }
    }

    /// Keeps the reports of the workers `keep` says yes to.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.workers.retain(|id, _| keep(id));
    }

    /// Fresh, complete reports as of `now_ms`.
    pub fn snapshot(&self, now_ms: u64, stale_after_ms: u64) -> LoadSnapshot {
        self.snapshot_until(now_ms, stale_after_ms).0
    }

    /// The snapshot and the first moment one of its reports goes stale.
    pub fn snapshot_until(&self, now_ms: u64, stale_after_ms: u64) -> (LoadSnapshot, u64) {
        let loads: HashMap<String, EngineLoad> = self
            .workers
            .iter()
            .filter_map(|(id, w)| Some((id.clone(), aggregate(w, now_ms, stale_after_ms)?)))
            .collect();
        let valid_until = loads
            .values()
            .map(|l| l.reported_at_ms.saturating_add(stale_after_ms).saturating_add(1))
            .min()
            .unwrap_or(u64::MAX);
        (LoadSnapshot { loads }, valid_until)
    }
}

/// Tokens per busy millisecond between two samples of the cumulative prefill counters.
fn throughput(prev: &RankReport, now: &RankReport) -> Option<f64> {
    let tokens = now.prefill_tokens_total?.checked_sub(prev.prefill_tokens_total?)?;
    let busy_us = now.prefill_busy_us_total?.checked_sub(prev.prefill_busy_us_total?)?;
    (busy_us > 0 && tokens > 0).then(|| tokens as f64 / (busy_us as f64 / 1000.0))
}

fn sum(mut values: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    values.try_fold(0u64, |acc, v| v.map(|v| acc.saturating_add(v)))
}

fn aggregate(w: &WorkerLoad, now_ms: u64, stale_after_ms: u64) -> Option<EngineLoad> {
    let samples: Vec<&RankSample> = w.ranks.iter().map(Option::as_ref).collect::<Option<_>>()?;
    if samples.iter().any(|s| now_ms.saturating_sub(s.at_ms) > stale_after_ms) {
        return None;
    }
    let reports = || samples.iter().map(|s| &s.report);
    let waiting_uncached = sum(reports().map(|r| r.waiting_uncached_tokens));
    let queue_ms = samples
        .iter()
        .map(|s| Some(s.report.waiting_uncached_tokens? as f64 / s.prefill_tokens_per_ms?))
        .try_fold(0.0f64, |acc: f64, v| v.map(|v| acc.max(v)));
    let rate = samples.iter().map(|s| s.prefill_tokens_per_ms).try_fold(0.0f64, |acc, v| v.map(|v| acc + v));
    let kv_capacity = sum(reports().map(|r| r.kv_capacity));
    let kv_used = sum(reports().map(|r| r.kv_used));
    Some(EngineLoad {
        kind: w.kind,
        running: sum(reports().map(|r| r.running)),
        waiting: sum(reports().map(|r| r.waiting)),
        kv_used,
        kv_capacity,
        max_running: sum(reports().map(|r| r.max_running)),
        waiting_uncached_tokens: waiting_uncached,
        prefill_queue_ms: queue_ms,
        prefill_tokens_per_ms: rate,
        reported_at_ms: samples.iter().map(|s| s.at_ms).min().unwrap_or(now_ms),
        sent_at_report: w.sent_at_report,
        rank_loads: if samples.len() > 1 {
            reports().map(|r| r.running.unwrap_or(0).saturating_add(r.waiting.unwrap_or(0))).collect()
        } else {
            Vec::new()
        },
    })
}

/// Fresh reports by worker id; a worker without one is absent, never zero.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadSnapshot {
    loads: HashMap<String, EngineLoad>,
}

impl LoadSnapshot {
    pub fn get(&self, worker: &str) -> Option<&EngineLoad> {
        self.loads.get(worker)
    }

    pub fn from_loads(loads: impl IntoIterator<Item = (String, EngineLoad)>) -> Self {
        Self { loads: loads.into_iter().collect() }
    }
}

/// How a policy reads engine-reported load: the current snapshot, captured once per selection
/// attempt. Shared, so capturing it copies nothing.
pub trait LoadView: Send + Sync + std::fmt::Debug {
    fn snapshot(&self) -> Arc<LoadSnapshot>;
}

/// A settable snapshot, for tests and for `load.source: none` (always empty).
#[derive(Debug, Default)]
pub struct StaticLoad(Mutex<Arc<LoadSnapshot>>);

impl StaticLoad {
    pub fn new(snapshot: LoadSnapshot) -> Self {
        Self(Mutex::new(Arc::new(snapshot)))
    }

    pub fn set(&self, snapshot: LoadSnapshot) {
        if let Ok(mut s) = self.0.lock() {
            *s = Arc::new(snapshot);
        }
    }
}

impl LoadView for StaticLoad {
    fn snapshot(&self) -> Arc<LoadSnapshot> {
        self.0.lock().map(|s| Arc::clone(&s)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    fn native(rank: u32, running: u64, waiting: u64) -> RankReport {
        RankReport {
            dp_rank: rank,
            running: Some(running),
            waiting: Some(waiting),
            kv_used: Some(10),
            kv_capacity: Some(100),
            ..RankReport::default()
        }
    }

    #[test]
    fn ranks_are_summed() {
        let mut t = LoadTable::default();
        t.record("A", 2, ReportKind::Native, vec![native(0, 1, 2), native(1, 3, 4)], 1000, SentCounts::default());
        let l = t.snapshot(1000, 500).get("A").cloned().unwrap();
        assert_eq!((l.running, l.waiting, l.kv_used, l.kv_capacity), (Some(4), Some(6), Some(20), Some(200)));
    }

    #[test]
    fn a_worker_counts_only_when_every_rank_reported() {
        let mut t = LoadTable::default();
        t.record("A", 2, ReportKind::Native, vec![native(0, 1, 2)], 1000, SentCounts::default());
        assert_eq!(t.snapshot(1000, 500).get("A"), None);
    }

    #[test]
    fn a_worker_counts_only_when_every_rank_is_fresh() {
        let mut t = LoadTable::default();
        t.record("A", 2, ReportKind::Native, vec![native(0, 1, 2), native(1, 1, 1)], 1000, SentCounts::default());
        t.record("A", 2, ReportKind::Native, vec![native(0, 1, 2)], 1400, SentCounts::default());
        assert!(t.snapshot(1500, 500).get("A").is_some());
        assert_eq!(t.snapshot(1501, 500).get("A"), None, "rank 1 is now stale");
    }

    #[test]
    fn stale_reports_read_as_unknown() {
        let mut t = LoadTable::default();
        t.record("A", 1, ReportKind::Native, vec![native(0, 9, 9)], 1000, SentCounts::default());
        assert!(t.snapshot(3000, 2000).get("A").is_some());
        assert_eq!(t.snapshot(3001, 2000).get("A"), None);
    }

    #[test]
    fn a_missing_field_on_any_rank_leaves_the_sum_unknown() {
        let mut t = LoadTable::default();
        let mut partial = native(1, 1, 1);
        partial.kv_used = None;
        t.record("A", 2, ReportKind::Native, vec![native(0, 1, 1), partial], 1000, SentCounts::default());
        let l = t.snapshot(1000, 500).get("A").cloned().unwrap();
        assert_eq!(l.kv_used, None);
        assert_eq!(l.running, Some(2));
    }

    #[test]
    fn prefill_queue_time_comes_from_two_samples_of_the_counters() {
        let mut t = LoadTable::default();
        let sample = |tokens: u64, busy_us: u64, waiting: u64| RankReport {
            prefill_tokens_total: Some(tokens),
            prefill_busy_us_total: Some(busy_us),
            waiting_uncached_tokens: Some(waiting),
            ..native(0, 0, 0)
        };
        t.record("A", 1, ReportKind::Native, vec![sample(1000, 100_000, 500)], 1000, SentCounts::default());
        assert_eq!(t.snapshot(1000, 500).get("A").unwrap().prefill_queue_ms, None, "one sample is not a rate");
        // 2,000 tokens in 100 ms busy = 20 tokens/ms; 500 waiting tokens → 25 ms.
        t.record("A", 1, ReportKind::Native, vec![sample(3000, 200_000, 500)], 1250, SentCounts::default());
        let q = t.snapshot(1250, 500).get("A").unwrap().prefill_queue_ms.unwrap();
        assert!((q - 25.0).abs() < 1e-9, "{q}");
    }

    #[test]
    fn native_with_capacity_needs_a_positive_capacity() {
        let mut t = LoadTable::default();
        let mut r = native(0, 1, 1);
        r.kv_capacity = Some(0);
        t.record("A", 1, ReportKind::Native, vec![r], 1000, SentCounts::default());
        t.record("B", 1, ReportKind::Basic, vec![native(0, 1, 1)], 1000, SentCounts::default());
        t.record("C", 1, ReportKind::Native, vec![native(0, 1, 1)], 1000, SentCounts::default());
        let s = t.snapshot(1000, 500);
        assert!(!s.get("A").unwrap().is_native_with_capacity());
        assert!(!s.get("B").unwrap().is_native_with_capacity());
        assert!(s.get("C").unwrap().is_native_with_capacity());
    }
}
