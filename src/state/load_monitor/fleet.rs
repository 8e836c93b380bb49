//! The prefill rate an engine's estimate leans on until its own first bytes tell (issue 29): what
//! the fleet as a whole has shown, on the configured `load.prefill_tokens_per_s`.
//!
//! Engines of one fleet are alike more often than not, and the configured rate may err by ten
//! times. An engine sees few prompts of very different lengths, which tell its rate; the fleet sees
//! many. Before any first byte has come back, the fleet's late ones already say something: an
//! engine whose oldest dispatch has waited past what the configured rate allows prefills slower
//! than that, and an engine thought faster than it is gets sent a queue it cannot drain.

use super::inflight::LocalLoad;
use super::speed::SpeedFit;
use super::unanswered::Waited;

/// What the fleet prior reads of one engine: its speed fit over every VM's samples, and its
/// longest-waiting unanswered dispatch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineFit {
    pub fit: SpeedFit,
    pub unanswered: Option<Waited>,
}

/// The fewest engines whose unanswered dispatches speak for the fleet: one late engine alone may be
/// hung, not slow like the rest.
const MIN_SHOWING: usize = 2;

/// However late the fleet's dispatches, its prior stays within this factor below the configured
/// rate: hung engines must not make every idle one look dead.
const LATE_RANGE: f64 = 16.0;

/// The prior rates, in tokens per millisecond.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prior {
    /// For an engine timed at least once, whose fit leans on it while young: the fleet's samples
    /// pooled in one fit.
    pub timed: f64,
    /// For an engine sent work and not yet timed: no faster than the slowest one timed.
    pub untimed: f64,
    /// Some engine of the fleet has been timed.
    pub fleet_timed: bool,
}

impl Prior {
    /// The configured rate alone: nothing is known of the fleet.
    pub fn configured(tokens_per_ms: f64) -> Self {
        Self { timed: tokens_per_ms, untimed: tokens_per_ms, fleet_timed: false }
    }

    /// The prior from every engine's fit and unanswered dispatch, on the configured rate.
    pub fn of_fleet(engines: &[EngineFit], configured: f64) -> Self {
        let base = configured.min(shown_rate(engines, configured));
        let pooled = engines.iter().fold(SpeedFit::default(), |pooled, e| pooled.merged(&e.fit));
        let timed = pooled.speed(base).tokens_per_ms;
        let slowest =
            engines.iter().filter(|e| e.fit.timed()).map(|e| e.fit.speed(timed).tokens_per_ms).fold(timed, f64::min);
        let fleet_timed = engines.iter().any(|e| e.fit.timed());
        Self { timed, untimed: slowest, fleet_timed }
    }

    /// `local` as far as its engine's silence tells against the fleet. Until some engine of the
    /// fleet has been timed, an untimed engine's unanswered dispatch does not slow it: the fleet
    /// was sent its first prompts within moments and none has answered, so each one's wait is
    /// the fleet's, and an engine judged by its own would make the one sent a prompt last look
    /// the least busy — and be sent the next ones, before any of them answers. Its unanswered
    /// prompts still count whole (`pending_prefill_tokens`).
    pub fn judged(&self, local: LocalLoad) -> LocalLoad {
        if self.fleet_timed || local.speed.timed() {
            local
        } else {
            LocalLoad { unanswered: None, ..local }
        }
    }

    /// The prior of the engine whose router-local load is `local`. Only an engine sent work that
    /// has not answered yet is assumed as slow as the slowest timed one: one never sent anything
    /// has shown nothing either way, and assumed slow it would never be sent the work that times
    /// it, so a fleet's idle engine would stay idle for good.
    pub fn of(&self, local: &LocalLoad) -> f64 {
        if local.speed.timed() || local.dispatched_total == 0 {
            self.timed
        } else {
            self.untimed
        }
    }
}

/// The fastest rate any engine with work unanswered has shown: its fit's, slowed to what its
/// longest-waiting dispatch shows once late. The fastest, not the slowest: a heterogeneous fleet's
/// slow engine says nothing of the others. Only when [`MIN_SHOWING`] engines or more have work
/// unanswered (else: `configured`).
fn shown_rate(engines: &[EngineFit], configured: f64) -> f64 {
    let shown =
        engines.iter().filter_map(|e| e.unanswered.map(|w| e.fit.speed_while(Some(w), configured).tokens_per_ms));
    let (count, fastest) = shown.fold((0, 0.0), |(n, fastest), r| (n + 1, r.max(fastest)));
    if count < MIN_SHOWING {
        return configured;
    }
    fastest.max(configured / LATE_RANGE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::load_monitor::Sample;
    use crate::testing::test;

    fn timed(samples: &[(u64, u64)]) -> EngineFit {
        let mut fit = SpeedFit::default();
        for &(tokens, ms) in samples {
            fit.observe(Sample { tokens, ms }, 20.0);
        }
        EngineFit { fit, unanswered: None }
    }

    fn waiting(ms: u64, tokens: u64) -> EngineFit {
        EngineFit { fit: SpeedFit::default(), unanswered: Some(Waited { ms, tokens }) }
    }

    #[test]
    fn nothing_known_is_the_configured_rate() {
        assert_eq!(Prior::of_fleet(&[], 20.0), Prior::configured(20.0));
        assert_eq!(Prior::of_fleet(&[EngineFit::default(); 3], 20.0), Prior::configured(20.0));
    }

    #[test]
    fn an_engine_not_yet_timed_is_assumed_as_slow_as_the_slowest_timed_one() {
        let fleet: Vec<_> = [10, 2, 5]
            .iter()
            .map(|rate| timed(&[256, 2_048, 4_096].map(|tokens| (tokens, tokens / rate))))
            .chain([EngineFit::default()])
            .collect();
        let prior = Prior::of_fleet(&fleet, 20.0);
        let b = fleet[1].fit.speed(prior.timed).tokens_per_ms;
        assert_eq!(prior.untimed, b, "B is the slowest");
        assert!(prior.untimed < fleet[2].fit.speed(prior.timed).tokens_per_ms);
    }

    #[test]
    fn an_engine_never_sent_anything_leans_on_the_fleet_and_one_awaiting_its_first_byte_on_the_slowest() {
        let fleet: Vec<_> = [10, 2].iter().map(|rate| timed(&[256, 2_048, 4_096].map(|t| (t, t / rate)))).collect();
        let prior = Prior::of_fleet(&fleet, 20.0);
        assert!(prior.untimed < prior.timed, "{prior:?}");
        assert_eq!(prior.of(&LocalLoad::default()), prior.timed, "never sent anything");
        let sent = LocalLoad { dispatched_total: 1, inflight: 1, ..LocalLoad::default() };
        assert_eq!(prior.of(&sent), prior.untimed, "sent work, not answered yet");
    }

    #[test]
    fn an_untimed_engines_silence_tells_only_once_some_engine_answered() {
        let late = LocalLoad { unanswered: Some(Waited { ms: 1_000, tokens: 2_048 }), ..LocalLoad::default() };
        let before = Prior::of_fleet(&[waiting(1_000, 2_048), waiting(900, 2_048)], 20.0);
        assert_eq!(before.judged(late).unanswered, None, "no engine has answered: the fleet's wait");
        let after = Prior::of_fleet(&[timed(&[(2_048, 1_000)]), waiting(900, 2_048)], 20.0);
        assert_eq!(after.judged(late), late, "one has: this one's wait is its own");
    }

    #[test]
    fn an_engine_that_saw_one_prompt_length_leans_on_the_fleets_rate_not_the_configured_one() {
        // A prefills at 2 tokens/ms and was sent prompts of every length; B, as slow, only hits.
        let a = timed(&[256, 2_048, 4_096, 1_024].map(|tokens| (tokens, 30 + tokens / 2)));
        let b = timed(&[(150, 30 + 75); 4]);
        let fleet = Prior::of_fleet(&[a, b], 20.0).timed;
        assert!((fleet - 2.0).abs() < 0.2, "{fleet}");
        assert!(b.fit.speed(20.0).tokens_per_ms > 10.0, "on the configured rate B looks ten times as fast");
        assert!((b.fit.speed(fleet).tokens_per_ms - 2.0).abs() < 0.2, "{:?}", b.fit.speed(fleet));
    }

    #[test]
    fn before_any_first_byte_the_fleets_late_dispatches_slow_its_prior() {
        // Every engine with work has waited 1 s on 2,048 tokens: by the configured 20 tokens/ms it
        // should have answered in about 150 ms.
        let late = [waiting(1_000, 2_048), waiting(1_100, 2_048), EngineFit::default()];
        let prior = Prior::of_fleet(&late, 20.0);
        assert!(prior.untimed < 2.5, "{prior:?}");
        assert_eq!(prior.untimed, prior.timed);
        assert!(prior.untimed > 2.0, "the least late one sets it: {prior:?}");
    }

    #[test]
    fn one_engine_on_time_keeps_the_configured_rate() {
        let fleet = [waiting(1_000, 2_048), waiting(60, 2_048)];
        assert_eq!(Prior::of_fleet(&fleet, 20.0), Prior::configured(20.0));
    }

    #[test]
    fn one_engine_late_alone_may_be_hung_and_says_nothing() {
        let prior = Prior::of_fleet(&[waiting(1_000, 2_048), EngineFit::default(), EngineFit::default()], 20.0);
        assert_eq!(prior, Prior::configured(20.0));
    }

    #[test]
    fn however_late_the_fleet_its_prior_slows_only_so_far() {
        let hung = waiting(3_600_000, 2_048);
        let prior = Prior::of_fleet(&[hung, hung, EngineFit::default()], 20.0);
        assert_eq!(prior, Prior::configured(20.0 / LATE_RANGE));
    }
}
