//! Dispatches still waiting for the first byte that will time them: censored samples of an
//! engine's speed (issue 29). A first byte teaches the speed only once it arrives, so an engine
//! slower than the router believes is sent a queue it cannot drain before it can say so. A
//! dispatch that has waited longer than the fit allows says it at once: the engine prefilled less
//! than the tokens ahead of it and its own in that time, so its rate is at most their ratio.
//!
//! Each VM keeps its own unanswered dispatches per engine, oldest first, and publishes the oldest:
//! with first-come service it has waited longest for the most work ahead.

use std::collections::VecDeque;

/// The most unanswered dispatches a VM tracks per engine; later ones go untracked until older
/// ones are answered (the oldest are the ones that tell).
pub const MAX_TRACKED: usize = 256;

/// A dispatch the engine was expected to start on at `since_ms` (sent, then its turn for a running
/// slot) that brings `tokens` to prefill before its first token (queued ahead of it by the router's
/// account, and its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    pub since_ms: u64,
    pub tokens: u64,
}

impl Waiting {
    /// Two words for shared data; `None` as zeros.
    pub(super) fn words(this: Option<Waiting>) -> [u64; 2] {
        this.map_or([0, 0], |w| [w.since_ms, w.tokens.saturating_add(1)])
    }

    pub(super) fn from_words([since_ms, tokens]: [u64; 2]) -> Option<Waiting> {
        (tokens > 0).then(|| Waiting { since_ms, tokens: tokens - 1 })
    }

    /// Of two VMs' oldest, the one that has waited longer.
    pub(super) fn older(a: Option<Waiting>, b: Option<Waiting>) -> Option<Waiting> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.since_ms < a.since_ms { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// How long it has waited by `now_ms`.
    pub fn at(&self, now_ms: u64) -> Waited {
        Waited { ms: now_ms.saturating_sub(self.since_ms), tokens: self.tokens }
    }
}

/// A dispatch still unanswered after `ms`, with `tokens` to prefill before its first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waited {
    pub ms: u64,
    pub tokens: u64,
}

/// One VM's unanswered dispatches to one engine, oldest first, and when its latest timed first
/// byte from there came (the next one is compared with it: `batching.rs`).
#[derive(Debug, Clone, Default)]
pub(super) struct Unanswered {
    entries: VecDeque<Waiting>,
    last_answer_ms: Option<u64>,
}

impl Unanswered {
    /// A timed first byte came at `now_ms`: when the one before it came, if one did.
    pub(super) fn timed_answer(&mut self, now_ms: u64) -> Option<u64> {
        self.last_answer_ms.replace(now_ms)
    }

    pub(super) fn add(&mut self, w: Waiting) {
        if self.entries.len() < MAX_TRACKED {
            self.entries.push_back(w);
        }
    }

    /// `w` was answered (or ended unanswered): it no longer waits. One not tracked: nothing.
    pub(super) fn answered(&mut self, w: Waiting) {
        if let Some(i) = self.entries.iter().position(|e| *e == w) {
            self.entries.remove(i);
        }
    }

    /// The one that has waited longest for its prefill: dispatches are tracked in the order they
    /// were sent, but one sent later behind fewer requests for a slot may be due first.
    pub(super) fn oldest(&self) -> Option<Waiting> {
        self.entries.iter().min_by_key(|w| w.since_ms).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn the_oldest_unanswered_dispatch_is_the_one_kept() {
        let mut u = Unanswered::default();
        let (a, b) = (Waiting { since_ms: 10, tokens: 2_000 }, Waiting { since_ms: 20, tokens: 300 });
        u.add(a);
        u.add(b);
        assert_eq!(u.oldest(), Some(a));
        u.answered(b);
        assert_eq!(u.oldest(), Some(a), "a younger one answered first changes nothing");
        u.add(b);
        u.answered(a);
        assert_eq!(u.oldest(), Some(b));
        u.answered(Waiting { since_ms: 5, tokens: 1 });
        assert_eq!(u.oldest(), Some(b), "an untracked one: nothing");
    }

    #[test]
    fn tracking_stops_at_its_limit_and_resumes_as_dispatches_are_answered() {
        let mut u = Unanswered::default();
        for i in 0..MAX_TRACKED as u64 + 1 {
            u.add(Waiting { since_ms: i, tokens: 1 });
        }
        assert_eq!(u.entries.len(), MAX_TRACKED);
        u.answered(Waiting { since_ms: MAX_TRACKED as u64, tokens: 1 });
        assert_eq!(u.entries.len(), MAX_TRACKED, "the one past the limit was never tracked");
        u.answered(Waiting { since_ms: 0, tokens: 1 });
        u.add(Waiting { since_ms: 999, tokens: 1 });
        assert_eq!(u.entries.back(), Some(&Waiting { since_ms: 999, tokens: 1 }));
        assert_eq!(u.oldest(), Some(Waiting { since_ms: 1, tokens: 1 }));
    }

    #[test]
    fn the_words_keep_a_dispatch_sent_at_time_zero_and_none_apart() {
        for w in [None, Some(Waiting { since_ms: 0, tokens: 0 }), Some(Waiting { since_ms: 7, tokens: u64::MAX })] {
            let back = Waiting::from_words(Waiting::words(w));
            match w {
                Some(Waiting { tokens: u64::MAX, .. }) => {
                    assert_eq!(back.map(|b| b.since_ms), Some(7), "the saturated count stays a dispatch")
                }
                _ => assert_eq!(back, w),
            }
        }
        let (a, b) = (Waiting { since_ms: 3, tokens: 9 }, Waiting { since_ms: 1, tokens: 500 });
        assert_eq!(Waiting::older(Some(a), Some(b)), Some(b));
        assert_eq!(Waiting::older(None, Some(a)), Some(a));
    }
}
