//! The service's load polling: which worker is due, which endpoint the configured source reads,
//! and the table built from the answers. A failed poll records nothing, so the old report ages
//! out instead of being reused.

use std::sync::Arc;

use super::reports::{parse_get_load, parse_prometheus, parse_v1_loads, ReportError, ReportKind};
use super::table::{LoadTable, SentCounts};
use crate::registry::Engine;
use crate::state::schedule::PollSchedule;

/// The load endpoint an engine serves and how its answer reads (spec §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportEndpoint {
    /// SGLang's `GET /v1/loads`: native reports.
    V1Loads,
    /// SGLang's older `GET /get_load`: basic reports.
    GetLoad,
    /// `GET /metrics` of SGLang or vLLM: basic reports.
    Prometheus,
}

impl ReportEndpoint {
    pub fn path(self) -> &'static str {
        match self {
            ReportEndpoint::V1Loads => "/v1/loads",
            ReportEndpoint::GetLoad => "/get_load",
            ReportEndpoint::Prometheus => "/metrics",
        }
    }

    fn parse(self, body: &[u8]) -> Result<(ReportKind, Vec<super::RankReport>), ReportError> {
        Ok(match self {
            ReportEndpoint::V1Loads => (ReportKind::Native, parse_v1_loads(body)?),
            ReportEndpoint::GetLoad => (ReportKind::Basic, parse_get_load(body)?),
            ReportEndpoint::Prometheus => (ReportKind::Basic, parse_prometheus(body)?),
        })
    }
}

#[derive(Debug)]
pub struct LoadPoller {
    endpoint: Option<ReportEndpoint>,
    schedule: PollSchedule,
    workers: Vec<Arc<Engine>>,
    table: LoadTable,
    dirty: bool,
}

impl LoadPoller {
    /// `endpoint: None` polls nothing.
    pub fn new(endpoint: Option<ReportEndpoint>, interval_ms: u64, workers: &[Arc<Engine>]) -> Self {
        Self {
            endpoint,
            schedule: PollSchedule::new(interval_ms, workers.len()),
            workers: workers.to_vec(),
            table: LoadTable::default(),
            dirty: false,
        }
    }

    /// Follows a new worker list: the reports of workers configured before and after are kept,
    /// the others' dropped. Every worker is due at once.
    pub fn follow(&mut self, endpoint: Option<ReportEndpoint>, interval_ms: u64, workers: &[Arc<Engine>]) {
        self.table.retain(|id| workers.iter().any(|w| w.id == id));
        self.endpoint = endpoint;
        self.schedule = PollSchedule::new(interval_ms, workers.len());
        self.workers = workers.to_vec();
        self.dirty = true;
    }

    /// The endpoint polled; `None` when load is not polled at all.
    pub fn path(&self) -> Option<&'static str> {
        self.endpoint.map(ReportEndpoint::path)
    }

    pub fn due(&mut self, now_ms: u64) -> Vec<usize> {
        if self.path().is_none() {
            return Vec::new();
        }
        self.schedule.due(now_ms)
    }

    /// Records a finished poll. `body` is `Some` only for a 2xx answer. `sent` is what the router
    /// has sent the worker until now, so later readers can correct by what was sent since.
    pub fn record(
        &mut self,
        index: usize,
        body: Option<&[u8]>,
        now_ms: u64,
        sent: SentCounts,
    ) -> Result<(), ReportError> {
        self.schedule.finished(index);
        let Some(worker) = self.workers.get(index) else {
            return Ok(());
        };
        let (Some(body), Some(endpoint)) = (body, self.endpoint) else { return Ok(()) };
        let (kind, reports) = endpoint.parse(body)?;
        self.table.record(&worker.id, worker.dp_size, kind, reports, now_ms, sent);
        self.dirty = true;
        Ok(())
    }

    /// The table to publish, once per change.
    pub fn take_publication(&mut self) -> Option<Vec<u8>> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        serde_json::to_vec(&self.table).ok()
    }

    pub fn table(&self) -> &LoadTable {
        &self.table
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;
    use crate::testing::worker;

    fn sent(dispatches: u64) -> SentCounts {
        SentCounts { dispatches, ..SentCounts::default() }
    }

    fn poller(endpoint: Option<ReportEndpoint>) -> LoadPoller {
        LoadPoller::new(endpoint, 100, &[worker("A"), worker("B")])
    }

    #[test]
    fn each_source_reads_its_endpoint() {
        assert_eq!(poller(Some(ReportEndpoint::V1Loads)).path(), Some("/v1/loads"));
        assert_eq!(poller(Some(ReportEndpoint::GetLoad)).path(), Some("/get_load"));
        assert_eq!(poller(Some(ReportEndpoint::Prometheus)).path(), Some("/metrics"));
        let mut none = poller(None);
        assert_eq!(none.path(), None);
        assert!(none.due(0).is_empty(), "nothing is polled without a source");
    }

    #[test]
    fn a_successful_poll_is_published_once() {
        let mut p = poller(Some(ReportEndpoint::GetLoad));
        assert_eq!(p.due(0), vec![0, 1]);
        p.record(0, Some(br#"[{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_tokens": 5}]"#), 10, sent(7))
            .unwrap();
        let published: LoadTable = serde_json::from_slice(&p.take_publication().unwrap()).unwrap();
        let a = published.snapshot(10, 1000).get("A").cloned().unwrap();
        assert_eq!(
            (a.running, a.waiting, a.kind, a.sent_at_report.dispatches),
            (Some(2), Some(1), ReportKind::Basic, 7)
        );
        assert!(p.take_publication().is_none(), "nothing new to publish");
    }

    #[test]
    fn a_failed_or_garbled_poll_records_nothing() {
        let mut p = poller(Some(ReportEndpoint::V1Loads));
        p.due(0);
        p.record(0, None, 10, sent(0)).unwrap();
        assert!(p.record(1, Some(b"<html>"), 10, sent(0)).is_err());
        assert!(p.take_publication().is_none());
        assert_eq!(p.due(100), vec![0, 1], "both polls finished and are due again");
    }
}
