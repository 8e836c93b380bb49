//! Where a chat match spends its time, phase by phase: answered to its caller in a `server-timing`
//! header and summed for `/metrics`, so the latency precise routing adds can be taken apart
//! (docs/benchmarks.md) without a profiler on the request path.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The phases of `POST /v1/prefix/match`, in the order a request walks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The body read as JSON.
    Parse,
    /// Waiting for a work permit and for a blocking thread to take the tokenization.
    Queue,
    /// The chat template rendered over the messages.
    Render,
    /// The rendered prompt turned into token ids.
    Encode,
    /// Block keys, the index lookup and any claim arbitration.
    Match,
    /// The answer serialized.
    Answer,
}

impl Phase {
    pub const ALL: [Phase; 6] = [Phase::Parse, Phase::Queue, Phase::Render, Phase::Encode, Phase::Match, Phase::Answer];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Parse => "parse",
            Phase::Queue => "queue",
            Phase::Render => "render",
            Phase::Encode => "encode",
            Phase::Match => "match",
            Phase::Answer => "answer",
        }
    }
}

/// One request's stopwatch: each [`Clock::lap`] charges the time since the previous lap to a phase.
#[derive(Debug)]
pub struct Clock {
    last: Instant,
    spent_ns: [u64; Phase::ALL.len()],
}

impl Default for Clock {
    fn default() -> Self {
        Self { last: Instant::now(), spent_ns: [0; Phase::ALL.len()] }
    }
}

impl Clock {
    pub fn lap(&mut self, phase: Phase) {
        let now = Instant::now();
        let spent = &mut self.spent_ns[phase as usize];
        *spent = spent.saturating_add(now.saturating_duration_since(self.last).as_nanos() as u64);
        self.last = now;
    }

    /// The `server-timing` header's value (durations in milliseconds, as the header has them).
    pub fn server_timing(&self) -> String {
        let mut out = String::new();
        for phase in Phase::ALL {
            let sep = if out.is_empty() { "" } else { ", " };
            let _ = write!(out, "{sep}{};dur={:.3}", phase.as_str(), self.spent_ns[phase as usize] as f64 / 1e6);
        }
        out
    }
}

/// Every timed request's phases summed since start, for `/metrics`.
#[derive(Debug, Default)]
pub struct PhaseTotals {
    requests: AtomicU64,
    ns: [AtomicU64; Phase::ALL.len()],
}

impl PhaseTotals {
    pub fn add(&self, clock: &Clock) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        for (total, spent) in self.ns.iter().zip(clock.spent_ns) {
            total.fetch_add(spent, Ordering::Relaxed);
        }
    }

    /// The Prometheus text of the totals.
    pub fn metrics(&self) -> String {
        let mut out = String::from(
            "# HELP sgl_indexer_match_timed_total chat matches answered with their phases timed\n\
             # TYPE sgl_indexer_match_timed_total counter\n",
        );
        let _ = writeln!(out, "sgl_indexer_match_timed_total {}", self.requests.load(Ordering::Relaxed));
        out.push_str(
            "# HELP sgl_indexer_match_phase_seconds_total time chat matches spent, by phase\n\
             # TYPE sgl_indexer_match_phase_seconds_total counter\n",
        );
        for (phase, ns) in Phase::ALL.iter().zip(&self.ns) {
            let seconds = ns.load(Ordering::Relaxed) as f64 / 1e9;
            let _ = writeln!(out, "sgl_indexer_match_phase_seconds_total{{phase=\"{}\"}} {seconds:.9}", phase.as_str());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_charge_their_phase_and_totals_sum_requests() {
        let mut clock = Clock::default();
        std::thread::sleep(std::time::Duration::from_millis(2));
        clock.lap(Phase::Parse);
        clock.lap(Phase::Encode);
        clock.spent_ns[Phase::Encode as usize] = 3_000_000;
        assert!(clock.spent_ns[Phase::Parse as usize] >= 2_000_000);
        let header = clock.server_timing();
        assert!(header.starts_with("parse;dur=") && header.contains("encode;dur=3.000"), "{header}");
        let totals = PhaseTotals::default();
        totals.add(&clock);
        totals.add(&clock);
        let text = totals.metrics();
        assert!(text.contains("sgl_indexer_match_timed_total 2\n"), "{text}");
        assert!(text.contains("sgl_indexer_match_phase_seconds_total{phase=\"encode\"} 0.006000000"), "{text}");
    }
}
