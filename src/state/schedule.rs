//! When things are due: the service's poll of each worker (every `interval_ms`, never with a poll
//! still outstanding), and the request path's "at most once per period" ([`Period`]).

/// Something done at most once per period: the request path's exchanges and version checks, which
/// ride on requests instead of a timer (a tick into wasm costs Envoy ~0.1 ms even when idle).
#[derive(Debug, Clone, Copy, Default)]
pub struct Period {
    every_ms: u64,
    last_ms: Option<u64>,
}

impl Period {
    pub fn every(ms: u64) -> Self {
        Self { every_ms: ms, last_ms: None }
    }

    pub fn ms(&self) -> u64 {
        self.every_ms
    }

    /// Never done yet, or a whole period since it was.
    pub fn elapsed(&self, now_ms: u64) -> bool {
        self.last_ms.is_none_or(|t| now_ms.saturating_sub(t) >= self.every_ms)
    }

    pub fn done(&mut self, now_ms: u64) {
        self.last_ms = Some(now_ms);
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    next_due_ms: u64,
    outstanding: bool,
}

#[derive(Debug, Clone)]
pub struct PollSchedule {
    interval_ms: u64,
    slots: Vec<Slot>,
}

impl PollSchedule {
    pub fn new(interval_ms: u64, workers: usize) -> Self {
        Self { interval_ms, slots: vec![Slot::default(); workers] }
    }

    /// Indices due now; each is marked outstanding until [`Self::finished`].
    pub fn due(&mut self, now_ms: u64) -> Vec<usize> {
        let interval = self.interval_ms;
        self.slots
            .iter_mut()
            .enumerate()
            .filter(|(_, s)| !s.outstanding && s.next_due_ms <= now_ms)
            .map(|(i, s)| {
                s.outstanding = true;
                s.next_due_ms = now_ms.saturating_add(interval);
                i
            })
            .collect()
    }

    pub fn finished(&mut self, index: usize) {
        if let Some(s) = self.slots.get_mut(index) {
            s.outstanding = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn polls_follow_the_interval_and_skip_outstanding_ones() {
        let mut s = PollSchedule::new(100, 2);
        assert_eq!(s.due(0), vec![0, 1]);
        assert!(s.due(50).is_empty());
        s.finished(0);
        assert!(s.due(99).is_empty());
        assert_eq!(s.due(100), vec![0], "worker 1's poll is still outstanding");
    }
}
