//! When things are due: the service's poll of each worker (every `interval_ms`, never with a poll
//! still outstanding), the request path's "at most once per period" ([`Period`]), and what a busy
//! VM holds back for the rest of Envoy ([`Batched`]).

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

    /// [`Self::elapsed`], and if so done now: one caller's turn, claimed.
    pub fn claim(&mut self, now_ms: u64) -> bool {
        let due = self.elapsed(now_ms);
        if due {
            self.done(now_ms);
        }
        due
    }

    /// The request path's rule for what a VM owes the rest of Envoy: at once when the VM is
    /// `idle` (no later request of its own would carry it), else once the period has passed.
    pub fn due(&self, idle: bool, now_ms: u64) -> bool {
        idle || self.elapsed(now_ms)
    }

    pub fn done(&mut self, now_ms: u64) {
        self.last_ms = Some(now_ms);
    }
}

/// News that changes where the other VMs send prompts (a prompt sent to an engine to prefill) is
/// handed over at most this often rather than once per period: at once when prompts come tens of
/// milliseconds apart, and one message per millisecond, not one per request, when every request
/// brings a new prompt at saturation. News keeps its own clock: a handing-over the period made
/// just before it, in the same millisecond (a request's arrival, before its dispatch is known),
/// must not hold it back to the next request event.
pub const NEWS_MS: u64 = 1;

/// What a VM holds back and hands over in one go, because each handing-over is a host call: at
/// most once per period while it has requests in flight, at once when its last one ends (no later
/// request would carry it), and whenever asked (the heartbeat).
#[derive(Debug)]
pub struct Batched<C> {
    held: C,
    sent: Period,
    news: Period,
}

/// A collection a [`Batched`] holds.
pub trait Held: Default {
    fn is_empty(&self) -> bool;
}

impl<T> Held for Vec<T> {
    fn is_empty(&self) -> bool {
        Vec::is_empty(self)
    }
}

impl<K, V> Held for hashbrown::HashMap<K, V> {
    fn is_empty(&self) -> bool {
        hashbrown::HashMap::is_empty(self)
    }
}

impl<C: Held> Batched<C> {
    pub fn every(period_ms: u64) -> Self {
        Self { held: C::default(), sent: Period::every(period_ms), news: Period::every(NEWS_MS) }
    }

    pub fn held_mut(&mut self) -> &mut C {
        &mut self.held
    }

    /// What is held, if anything, when a period has passed since the last handing-over or `idle`.
    pub fn take_if_due(&mut self, idle: bool, now_ms: u64) -> Option<C> {
        if self.sent.due(idle, now_ms) {
            self.take(now_ms)
        } else {
            None
        }
    }

    /// What is held, if anything, unless news was handed over less than [`NEWS_MS`] ago: news that
    /// cannot wait a whole period, still bounded in rate.
    pub fn take_news(&mut self, now_ms: u64) -> Option<C> {
        if self.held.is_empty() || !self.news.claim(now_ms) {
            return None;
        }
        self.take(now_ms)
    }

    /// What is held, if anything.
    pub fn take(&mut self, now_ms: u64) -> Option<C> {
        if self.held.is_empty() {
            return None;
        }
        self.sent.done(now_ms);
        Some(std::mem::take(&mut self.held))
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

    #[test]
    fn a_batch_goes_once_per_period_while_busy_at_once_when_idle_and_never_empty() {
        let mut b: Batched<Vec<u8>> = Batched::every(5);
        assert_eq!(b.take_if_due(true, 0), None, "nothing held, nothing handed over");
        b.held_mut().push(1);
        assert_eq!(b.take_if_due(false, 0), Some(vec![1]), "the first batch goes at once");
        b.held_mut().push(2);
        assert_eq!(b.take_if_due(false, 4), None, "held within the period");
        b.held_mut().push(3);
        assert_eq!(b.take_if_due(false, 5), Some(vec![2, 3]));
        b.held_mut().push(4);
        assert_eq!(b.take_if_due(true, 6), Some(vec![4]), "an idle VM hands over at once");
        b.held_mut().push(5);
        assert_eq!(b.take(7), Some(vec![5]), "and so does the heartbeat");
    }
}
