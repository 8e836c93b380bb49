//! Whether an engine prefills the requests waiting for it together, in one batch, or one at a time
//! in arrival order, as the router sees it in its first bytes (issue 29). SGLang's scheduler admits
//! every waiting request into its next prefill batch, and the batch's first tokens come out of one
//! forward pass: two requests that waited there together answer together. An engine that prefills
//! one request at a time answers the later of two at least that request's own prefill after the
//! earlier one.
//!
//! So each VM compares each timed first byte with its previous one from the same engine, when the
//! request had been sent before that one came (the two waited there at once). The pair came
//! *together* when the gap between them is under a [`TOGETHER_SHARE`] of the later request's own
//! prefill at the engine's fitted rate, and *apart* otherwise; a pair whose own prefill is too short
//! to tell from the clock's resolution says nothing. A batching engine answers many pairs together
//! (those that reached one batch) and the rest apart (those that reached the next); an engine that
//! prefills one at a time answers together only when the router overestimated a prefill.
//!
//! The counts are forgotten geometrically and add up over VMs as the speed fit does.

/// The weight a VM's newest pair takes from its older ones: about the last 64 pairs count.
const FORGET: f64 = 1.0 / 64.0;

/// A pair says something only when its later request's own prefill takes at least this long at
/// the fitted rate: a first byte is timed to the millisecond, and two answers of one batch reach
/// the filter a scheduler turn apart.
const MIN_OWN_MS: f64 = 8.0;

/// Two first bytes came together when the later one followed in less than this share of its own
/// prefill: an engine prefilling one at a time would have needed all of it.
const TOGETHER_SHARE: f64 = 0.25;

/// An engine batches once at least this share of its pairs came together...
const BATCHED_SHARE: f64 = 0.2;

/// ...and about three pairs did: one overestimated prefill makes no batch.
const MIN_TOGETHER: f64 = 2.5;

/// One VM's two consecutive timed first bytes from one engine: the later request was sent at
/// `sent_ms`, the earlier one answered at `previous_ms`, the later at `now_ms`, and the later one's
/// own uncached tokens take `own_ms` at the engine's fitted rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pair {
    pub sent_ms: u64,
    pub previous_ms: u64,
    pub now_ms: u64,
    pub own_ms: f64,
}

/// The pairs that came together and apart, forgotten ones discounted. All zero: none yet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Batching {
    together: f64,
    apart: f64,
}

impl Batching {
    /// Counts `pair` if it says something: the later request waited at the engine while the
    /// earlier one was answered, and brought enough to prefill to tell.
    pub fn observe(&mut self, pair: Pair) {
        let tells = pair.own_ms.partial_cmp(&MIN_OWN_MS).is_some_and(|o| o.is_ge());
        if pair.sent_ms >= pair.previous_ms || !tells {
            return;
        }
        let gap_ms = pair.now_ms.saturating_sub(pair.previous_ms) as f64;
        let together = gap_ms < TOGETHER_SHARE * pair.own_ms;
        let keep = 1.0 - FORGET;
        self.together = self.together * keep + f64::from(u8::from(together));
        self.apart = self.apart * keep + f64::from(u8::from(!together));
    }

    /// The engine has been seen to prefill waiting requests in one batch.
    pub fn batches(&self) -> bool {
        self.together >= MIN_TOGETHER && self.together >= BATCHED_SHARE * (self.together + self.apart)
    }

    /// The share of telling pairs that came together, in percent (none yet: 0).
    pub fn together_pct(&self) -> u64 {
        let all = self.together + self.apart;
        if all > 0.0 {
            (100.0 * self.together / all).round() as u64
        } else {
            0
        }
    }

    /// Two VMs' counts over disjoint pairs, as one.
    pub fn merged(&self, other: &Batching) -> Batching {
        Batching { together: self.together + other.together, apart: self.apart + other.apart }
    }

    /// The counts taken `factor` times (a dead VM's, as it ages).
    pub fn scaled(&self, factor: f64) -> Batching {
        Batching { together: self.together * factor, apart: self.apart * factor }
    }

    pub(super) fn words(&self) -> [u64; 2] {
        [self.together, self.apart].map(f64::to_bits)
    }

    /// Counts read back from shared data; any that are not finite and non-negative are none.
    pub(super) fn from_words(w: [u64; 2]) -> Batching {
        let [together, apart] = w.map(f64::from_bits);
        if [together, apart].iter().all(|v| v.is_finite() && *v >= 0.0) {
            Batching { together, apart }
        } else {
            Batching::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    /// The later of two requests sent at 0, the earlier answered at 100, the later `gap_ms` after,
    /// bringing `own_ms` of prefill.
    fn pair(gap_ms: u64, own_ms: f64) -> Pair {
        Pair { sent_ms: 0, previous_ms: 100, now_ms: 100 + gap_ms, own_ms }
    }

    #[test]
    fn first_bytes_of_one_batch_show_a_batching_engine() {
        let mut b = Batching::default();
        // A batch of three, then the next request a batch later: two together, one apart.
        for _ in 0..2 {
            b.observe(pair(1, 40.0));
            b.observe(pair(0, 40.0));
            b.observe(pair(90, 40.0));
        }
        assert!(b.batches(), "{b:?}");
        assert!((60..=70).contains(&b.together_pct()), "{}", b.together_pct());
    }

    #[test]
    fn an_engine_that_prefills_one_at_a_time_never_looks_batched() {
        let mut b = Batching::default();
        for own in [10.0, 40.0, 400.0] {
            for _ in 0..50 {
                // Each answer follows the one before by at least its own prefill.
                b.observe(pair(own as u64 + 3, own));
            }
        }
        // Two prefills the router overestimated fourfold in a hundred and fifty.
        b.observe(pair(5, 40.0));
        b.observe(pair(5, 40.0));
        assert!(!b.batches(), "{b:?}");
        // Nor does a run of too few pairs: two together, nothing else.
        let mut young = Batching::default();
        young.observe(pair(0, 40.0));
        young.observe(pair(0, 40.0));
        assert!(!young.batches(), "{young:?}");
    }

    #[test]
    fn pairs_that_cannot_tell_are_not_counted() {
        let mut b = Batching::default();
        // Sent after the earlier one was answered: it never waited beside it.
        b.observe(Pair { sent_ms: 100, previous_ms: 100, now_ms: 101, own_ms: 40.0 });
        // Its own prefill is within the clock's resolution of a batch's spread.
        b.observe(pair(0, MIN_OWN_MS - 1.0));
        b.observe(pair(0, f64::NAN));
        assert_eq!(b, Batching::default());
    }

    #[test]
    fn an_engine_that_stops_batching_is_forgotten_as_a_batcher() {
        let mut b = Batching::default();
        for _ in 0..20 {
            b.observe(pair(0, 40.0));
        }
        assert!(b.batches());
        let mut n = 0;
        while b.batches() {
            b.observe(pair(60, 40.0));
            n += 1;
        }
        assert!((40..400).contains(&n), "after {n} pairs apart");
    }

    #[test]
    fn vms_counts_add_up_and_survive_shared_data() {
        let (mut a, mut b) = (Batching::default(), Batching::default());
        a.observe(pair(0, 40.0));
        a.observe(pair(0, 40.0));
        b.observe(pair(0, 40.0));
        assert!(!a.batches() && !b.batches());
        let both = a.merged(&b);
        assert!(both.batches(), "three pairs together over two VMs: {both:?}");
        assert!(!both.scaled(0.5).batches(), "a dead VM's counts fade");
        assert_eq!(Batching::from_words(both.words()), both);
        assert_eq!(Batching::from_words([f64::NAN.to_bits(), 0]), Batching::default());
        assert_eq!(Batching::from_words([(-1.0f64).to_bits(), 0]), Batching::default());
    }
}
