//! An engine's prefill speed as the router observes it (issue 29): each streamed request's time to
//! first byte, from its expected turn for a running slot, against the prefill tokens that had to go
//! before it — the uncached tokens queued ahead of it at the engine, by the router's own account,
//! and its own. A robust least-squares
//! line through those points gives the engine's prefill rate (its slope) and its fixed time to a
//! first byte (its intercept: a scheduler turn, the launch, the network).
//!
//! The fit is kept as sums, so the records of several VMs add up to the fit over all their
//! samples; each VM forgets its own samples geometrically, so a fit follows an engine that slows
//! down. The prior is a line, not a rate: no overhead, and the configured rate
//! (`load.prefill_tokens_per_s`) as its slope, each worth a fraction of a sample. Real samples
//! outweigh it within a few requests wherever their lengths differ. Where they do not — the
//! start-up's cold prompts, all of one length — the two pulls split what the samples leave open:
//! a long prompt's time goes to the rate, a short one's to the overhead.

use super::unanswered::Waited;

/// The weight a VM's newest sample takes from its older ones: about the last 32 samples count.
const FORGET: f64 = 1.0 / 32.0;

/// The prior slope's weight: as much as this many samples [`PRIOR_TOKENS`] from their mean.
const PRIOR_WEIGHT: f64 = 0.05;

/// A cold prompt's length.
const PRIOR_TOKENS: f64 = 2048.0;

/// The prior overhead's weight, in samples: a first byte needs no more than a scheduler turn and
/// the network beyond its prefill. Against [`PRIOR_WEIGHT`]'s slope, this reads the time of
/// prompts of one length past a few hundred tokens as prefill: a fit whose overhead took the
/// start-up's seconds would price a cold prefill there at the configured rate, ten times too
/// cheap on a slow fleet, and draw every moved session to the first engine timed.
const OVERHEAD_PRIOR_WEIGHT: f64 = 0.5;

/// A sample further from the line than this many mean deviations counts less (Huber): a request
/// that waited for a running slot, or for a long decode step, says little about prefill.
const HUBER: f64 = 3.0;

/// How fast the mean deviation follows new residuals.
const SCALE_WEIGHT: f64 = 1.0 / 32.0;

/// How much faster than its prior an engine may be, a priori: the prior slope's spread on that side,
/// as a fraction of it. First bytes that do not grow with tokens (queued behind others, or all
/// of one length) fit a line of any slope, and a fast rate makes a cold prefill there look free;
/// so a faster rate is believed as far as the samples show it through their own scatter.
const FASTER_SPREAD: f64 = 0.5;

/// A learned rate stays within this factor of the prior either way: a fit from odd samples never
/// makes an engine look idle or dead.
const RATE_RANGE: f64 = 16.0;

/// The intercept is at most this many milliseconds.
const MAX_OVERHEAD_MS: f64 = 10_000.0;

/// A first byte is late only past this many milliseconds beyond the fit's line, however young the
/// fit: a first token takes at least a scheduler step and the network, which a fit with no
/// samples does not know.
const MIN_LATE_MS: f64 = 50.0;

/// An unanswered dispatch counts at least this many tokens: one bringing fewer still waits a
/// scheduler turn, which says nothing of the prefill rate.
const MIN_WAITED_TOKENS: u64 = 256;

/// One observation: `tokens` to prefill before the request's own first token (queued ahead of it
/// and its own uncached ones), and the milliseconds until its first byte.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub tokens: u64,
    pub ms: u64,
}

/// What the fit says of an engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speed {
    pub tokens_per_ms: f64,
    /// Time to a first byte with nothing to prefill.
    pub overhead_ms: f64,
}

impl Speed {
    /// The prior alone: the configured rate, no overhead.
    pub fn prior(tokens_per_ms: f64) -> Self {
        Self { tokens_per_ms: tokens_per_ms.max(f64::MIN_POSITIVE), overhead_ms: 0.0 }
    }

    pub fn first_byte_ms(&self, tokens: u64) -> f64 {
        self.overhead_ms + tokens as f64 / self.tokens_per_ms
    }
}

/// A late dispatch's evidence. In the time it had beyond its allowance the engine prefilled less
/// than its tokens (those queued ahead of it and its own): `tokens_per_ms` is the fastest the
/// engine can be. How much longer it takes is unknown; without more to go on, a wait that has
/// overrun by some time is as likely as not to overrun by as much again, so `remaining_tokens`
/// is what that much more time at that rate prefills.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Late {
    pub tokens_per_ms: f64,
    pub remaining_tokens: u64,
}

/// The weighted sums of a least-squares fit of milliseconds on tokens, and the mean absolute
/// residual the outlier weight is measured against. All zero: no sample yet.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpeedFit {
    pub(super) weight: f64,
    pub(super) x: f64,
    pub(super) y: f64,
    pub(super) xx: f64,
    pub(super) xy: f64,
    pub(super) deviation: f64,
}

impl SpeedFit {
    /// Samples' weight behind the fit, forgotten ones discounted.
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// Whether any first byte has timed the engine (a NaN weight counts as none).
    pub fn timed(&self) -> bool {
        self.weight > 0.0
    }

    /// The fit's line: its slope pulled toward the prior's as if by [`PRIOR_WEIGHT`] samples spread
    /// [`PRIOR_TOKENS`] apart, its intercept toward none as if by [`OVERHEAD_PRIOR_WEIGHT`] samples
    /// at the origin.
    pub fn speed(&self, prior_tokens_per_ms: f64) -> Speed {
        let prior = Speed::prior(prior_tokens_per_ms);
        // No sample (or a NaN that slipped through): the prior.
        if self.weight.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return prior;
        }
        let slope0 = 1.0 / prior.tokens_per_ms;
        // Least squares with both priors: the overhead pulled toward none, the slope toward the
        // prior's by `ridge`; solved for the slope by eliminating the overhead.
        let weight = self.weight + OVERHEAD_PRIOR_WEIGHT;
        let (mean_x, mean_y) = (self.x / weight, self.y / weight);
        let spread = (self.xx - self.x * mean_x).max(0.0);
        let co = self.xy - self.x * mean_y;
        let line = |ridge: f64| (co + ridge * slope0) / (spread + ridge);
        let ridge = PRIOR_WEIGHT * PRIOR_TOKENS * PRIOR_TOKENS;
        let slope = line(ridge);
        // Faster than the prior: the prior's weight against samples as scattered as these
        // (a Gaussian prior's, samples' variance over the prior's). Equal to the slope above
        // where that meets the prior's, so the rate moves smoothly.
        let slope = if slope < slope0 {
            let scatter = self.deviation / (FASTER_SPREAD * slope0);
            line(ridge.max(scatter * scatter))
        } else {
            slope
        };
        let slope = slope.clamp(slope0 / RATE_RANGE, slope0 * RATE_RANGE);
        let overhead = (mean_y - slope * mean_x).clamp(0.0, MAX_OVERHEAD_MS);
        if slope.is_finite() && overhead.is_finite() {
            Speed { tokens_per_ms: 1.0 / slope, overhead_ms: overhead }
        } else {
            prior
        }
    }

    /// What a dispatch still unanswered after `waited` shows, once it is later than the line
    /// allows by more than the fit's spread ([`HUBER`] mean deviations, at least [`MIN_LATE_MS`]):
    /// `None` while it is not late.
    pub fn late(&self, speed: Speed, waited: Waited) -> Option<Late> {
        let tokens = waited.tokens.max(MIN_WAITED_TOKENS) as f64;
        let beyond_ms = waited.ms as f64 - speed.overhead_ms - (HUBER * self.deviation).max(MIN_LATE_MS);
        let late_by_ms = beyond_ms - tokens / speed.tokens_per_ms;
        (late_by_ms > 0.0).then(|| {
            let tokens_per_ms = (tokens / beyond_ms).max(f64::MIN_POSITIVE);
            Late { tokens_per_ms, remaining_tokens: (tokens_per_ms * late_by_ms) as u64 }
        })
    }

    /// The fit's speed, slowed to what an unanswered dispatch shows ([`Self::late`]).
    pub fn speed_while(&self, waited: Option<Waited>, prior_tokens_per_ms: f64) -> Speed {
        let speed = self.speed(prior_tokens_per_ms);
        match waited.and_then(|w| self.late(speed, w)) {
            Some(late) => Speed { tokens_per_ms: late.tokens_per_ms, ..speed },
            None => speed,
        }
    }

    /// Adds a sample, forgetting a little of the older ones; one far off the line counts less.
    pub fn observe(&mut self, sample: Sample, prior_tokens_per_ms: f64) {
        let (x, y) = (sample.tokens as f64, sample.ms as f64);
        let residual = (y - self.speed(prior_tokens_per_ms).first_byte_ms(sample.tokens)).abs();
        let limit = HUBER * self.deviation;
        let weight = if self.deviation > 0.0 && residual > limit { limit / residual } else { 1.0 };
        let keep = 1.0 - FORGET;
        self.weight = self.weight * keep + weight;
        self.x = self.x * keep + weight * x;
        self.y = self.y * keep + weight * y;
        self.xx = self.xx * keep + weight * x * x;
        self.xy = self.xy * keep + weight * x * y;
        // A discounted sample still widens the band, up to twice its limit: an engine that changed
        // speed is an outlier only until the band takes it in. A millisecond floor: the clock's
        // resolution.
        let residual = if weight < 1.0 { residual.min(2.0 * limit) } else { residual }.max(1.0);
        self.deviation =
            if self.deviation > 0.0 { self.deviation + SCALE_WEIGHT * (residual - self.deviation) } else { residual };
    }

    /// Two fits over disjoint samples, as one.
    pub fn merged(&self, other: &SpeedFit) -> SpeedFit {
        let weight = self.weight + other.weight;
        let deviation =
            if weight > 0.0 { (self.deviation * self.weight + other.deviation * other.weight) / weight } else { 0.0 };
        SpeedFit {
            weight,
            x: self.x + other.x,
            y: self.y + other.y,
            xx: self.xx + other.xx,
            xy: self.xy + other.xy,
            deviation,
        }
    }

    /// The fit with its samples counted `factor` times (a dead VM's, as it ages).
    pub fn scaled(&self, factor: f64) -> SpeedFit {
        SpeedFit {
            weight: self.weight * factor,
            x: self.x * factor,
            y: self.y * factor,
            xx: self.xx * factor,
            xy: self.xy * factor,
            deviation: self.deviation,
        }
    }

    pub(super) fn words(&self) -> [u64; 6] {
        [self.weight, self.x, self.y, self.xx, self.xy, self.deviation].map(f64::to_bits)
    }

    /// A fit read back from shared data; one that is not finite and non-negative is no fit.
    pub(super) fn from_words(w: [u64; 6]) -> SpeedFit {
        let [weight, x, y, xx, xy, deviation] = w.map(f64::from_bits);
        let fit = SpeedFit { weight, x, y, xx, xy, deviation };
        let sane = [weight, x, y, xx, deviation].iter().all(|v| v.is_finite() && *v >= 0.0) && xy.is_finite();
        if sane {
            fit
        } else {
            SpeedFit::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    /// A first-come-first-served engine at `tokens_per_ms` with `overhead_ms` per request, and
    /// requests of mixed lengths arriving with some work ahead of them.
    fn engine_samples(tokens_per_ms: f64, overhead_ms: f64, n: usize, seed: u64) -> Vec<Sample> {
        let mut state = seed.max(1);
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..n)
            .map(|_| {
                let own = [64, 150, 300, 2_100][(next() % 4) as usize];
                let ahead = next() % 3_000;
                let tokens = own + ahead;
                let jitter = (next() % 5) as f64;
                Sample { tokens, ms: (overhead_ms + tokens as f64 / tokens_per_ms + jitter).round() as u64 }
            })
            .collect()
    }

    fn close(a: f64, b: f64, within: f64) -> bool {
        (a - b).abs() <= within * b
    }

    #[test]
    fn an_unanswered_dispatch_says_nothing_until_it_is_late_beyond_the_fits_spread() {
        let fit = SpeedFit::default();
        let prior = fit.speed(20.0);
        // 2,000 tokens at 20/ms: 100 ms, and 50 ms a first token always may take.
        assert_eq!(fit.late(prior, Waited { ms: 150, tokens: 2_000 }), None);
        let late = fit.late(prior, Waited { ms: 450, tokens: 2_000 }).unwrap();
        assert_eq!(late, Late { tokens_per_ms: 5.0, remaining_tokens: 1_500 }, "300 ms late: 300 more at 5/ms");
        assert_eq!(fit.speed_while(Some(Waited { ms: 450, tokens: 2_000 }), 20.0).tokens_per_ms, 5.0);
        // A fit that has seen first bytes scatter allows them as much.
        let mut noisy = SpeedFit::default();
        for (i, s) in engine_samples(20.0, 10.0, 64, 3).into_iter().enumerate() {
            noisy.observe(Sample { ms: s.ms + (i as u64 % 2) * 200, ..s }, 20.0);
        }
        let speed = noisy.speed(20.0);
        let allowed = speed.first_byte_ms(2_000) + 3.0 * noisy.deviation;
        assert!(noisy.late(speed, Waited { ms: allowed as u64 - 1, tokens: 2_000 }).is_none(), "{noisy:?}");
        assert!(noisy.late(speed, Waited { ms: allowed as u64 + 50, tokens: 2_000 }).is_some());
        // A dispatch with nothing to prefill counts a scheduler turn's worth, not a rate of zero.
        let short = fit.late(prior, Waited { ms: 1_050, tokens: 0 }).unwrap();
        assert!((short.tokens_per_ms - 0.256).abs() < 1e-9, "{short:?}");
    }

    #[test]
    fn without_samples_the_prior_is_the_answer() {
        let s = SpeedFit::default().speed(20.0);
        assert_eq!(s, Speed { tokens_per_ms: 20.0, overhead_ms: 0.0 });
    }

    #[test]
    fn converges_on_a_known_rate_and_overhead() {
        let mut fit = SpeedFit::default();
        for s in engine_samples(8.0, 15.0, 300, 7) {
            fit.observe(s, 20.0);
        }
        let speed = fit.speed(20.0);
        assert!(close(speed.tokens_per_ms, 8.0, 0.05), "{speed:?}");
        assert!((speed.overhead_ms - 17.0).abs() < 4.0, "15 ms and a 0–4 ms jitter: {speed:?}");
    }

    #[test]
    fn adapts_when_an_engine_slows_down() {
        let mut fit = SpeedFit::default();
        for s in engine_samples(16.0, 5.0, 300, 3) {
            fit.observe(s, 20.0);
        }
        assert!(close(fit.speed(20.0).tokens_per_ms, 16.0, 0.05));
        // A noisy neighbour: a quarter of the speed from now on.
        let slow = engine_samples(4.0, 5.0, 200, 5);
        for s in &slow[..40] {
            fit.observe(*s, 20.0);
        }
        let early = fit.speed(20.0).tokens_per_ms;
        assert!(early < 8.0, "40 samples in, most of the way: {early}");
        for s in &slow[40..] {
            fit.observe(*s, 20.0);
        }
        assert!(close(fit.speed(20.0).tokens_per_ms, 4.0, 0.05), "{:?}", fit.speed(20.0));
    }

    #[test]
    fn outliers_count_less() {
        let mut fit = SpeedFit::default();
        let samples = engine_samples(8.0, 10.0, 400, 11);
        for (i, s) in samples.into_iter().enumerate() {
            // One request in ten waited two seconds for a slot.
            let ms = if i % 10 == 9 { s.ms + 2_000 } else { s.ms };
            fit.observe(Sample { ms, ..s }, 20.0);
        }
        let speed = fit.speed(20.0);
        assert!(close(speed.tokens_per_ms, 8.0, 0.15), "{speed:?}");
        assert!(speed.overhead_ms < 120.0, "a plain mean would put 200 ms here: {speed:?}");
    }

    #[test]
    fn one_prompt_length_does_not_tilt_far_from_the_prior() {
        let mut fit = SpeedFit::default();
        for _ in 0..200 {
            fit.observe(Sample { tokens: 150, ms: 30 }, 20.0);
        }
        let speed = fit.speed(20.0);
        assert!(speed.first_byte_ms(150).round() == 30.0, "it fits what it saw: {speed:?}");
        assert!(speed.tokens_per_ms >= 20.0 / RATE_RANGE && speed.tokens_per_ms <= 20.0 * RATE_RANGE, "{speed:?}");
    }

    #[test]
    fn cold_prompts_of_one_length_are_read_as_prefill_not_overhead() {
        // Start-up on a fleet ten times slower than configured: every first byte so far is a cold
        // 2,100-token prompt's, at 3 tokens/ms and 10 ms overhead.
        for n in [1, 3, 12] {
            let mut fit = SpeedFit::default();
            for _ in 0..n {
                fit.observe(Sample { tokens: 2_100, ms: 710 }, 20.0);
            }
            let speed = fit.speed(20.0);
            assert!(speed.tokens_per_ms < 3.5 && speed.tokens_per_ms > 2.8, "{n} samples: {speed:?}");
            assert!(speed.overhead_ms < 60.0, "{n} samples: {speed:?}");
            // Priced at the configured rate with the rest as overhead, a cold prefill there would
            // cost a tenth of its time each time it is counted.
            assert!((speed.first_byte_ms(2_100) - 710.0).abs() < 40.0, "{n} samples: {speed:?}");
        }
        // Short prompts of one length keep their time as overhead: a hit says little of the rate.
        let mut fit = SpeedFit::default();
        for _ in 0..12 {
            fit.observe(Sample { tokens: 60, ms: 40 }, 20.0);
        }
        assert!(fit.speed(20.0).tokens_per_ms > 12.0, "{:?}", fit.speed(20.0));
    }

    #[test]
    fn first_bytes_that_do_not_grow_with_tokens_claim_no_rate_much_faster_than_the_prior() {
        // Start-up: the longer prompts went first and the shorter ones queued behind them.
        let mut fit = SpeedFit::default();
        for (tokens, ms) in [(3_000, 700), (2_000, 720), (1_000, 760), (500, 800)] {
            fit.observe(Sample { tokens, ms }, 20.0);
        }
        let speed = fit.speed(20.0);
        assert!(speed.tokens_per_ms < 25.0, "{speed:?}");
        // Within a tenth: the prior's half a sample of no overhead pulls four samples' level by
        // as much as it pulls their overhead, the slope being held at the prior's.
        assert!((speed.first_byte_ms(1_625) - 745.0).abs() < 75.0, "it still fits what it saw: {speed:?}");
    }

    #[test]
    fn an_engine_faster_than_the_prior_is_learned_through_little_scatter() {
        let mut fit = SpeedFit::default();
        for s in engine_samples(60.0, 5.0, 300, 19) {
            fit.observe(s, 20.0);
        }
        assert!(close(fit.speed(20.0).tokens_per_ms, 60.0, 0.1), "{:?}", fit.speed(20.0));
    }

    #[test]
    fn fits_of_disjoint_samples_merge_into_the_fit_of_all() {
        let samples = engine_samples(6.0, 8.0, 200, 13);
        let (mut a, mut b) = (SpeedFit::default(), SpeedFit::default());
        for (i, s) in samples.iter().enumerate() {
            if i % 2 == 0 {
                a.observe(*s, 20.0)
            } else {
                b.observe(*s, 20.0)
            }
        }
        let merged = a.merged(&b);
        assert!(close(merged.speed(20.0).tokens_per_ms, 6.0, 0.05), "{:?}", merged.speed(20.0));
        assert!(close(merged.weight(), a.weight() + b.weight(), 1e-9));
        let alone = SpeedFit::default().merged(&a);
        assert!(close(alone.deviation, a.deviation, 1e-9) && alone.xy == a.xy);
    }

    #[test]
    fn survives_a_round_trip_through_words_and_refuses_garbage() {
        let mut fit = SpeedFit::default();
        for s in engine_samples(6.0, 8.0, 50, 17) {
            fit.observe(s, 20.0);
        }
        assert_eq!(SpeedFit::from_words(fit.words()), fit);
        let mut words = fit.words();
        words[0] = f64::NAN.to_bits();
        assert_eq!(SpeedFit::from_words(words), SpeedFit::default());
        words[0] = (-1.0f64).to_bits();
        assert_eq!(SpeedFit::from_words(words), SpeedFit::default());
    }
}
