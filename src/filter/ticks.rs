//! A VM's root clock (spec §9, §10): how often its root ticks and what each tick does, decided
//! from what the root knows so that the glue only carries it out.
//!
//! Rules:
//! - The tick runs every [`QUEUE_TICK_MS`] while streams of this VM wait in the queue (each tick
//!   looks for their turns), else at the service's period while this VM does the service's work,
//!   else every heartbeat ([`HEARTBEAT_MS`]). The period is set again only when it changes.
//! - The heartbeat's work (counts exchanged, the VM's heartbeat, its turn at the service lease,
//!   its prefix replica and gauges) runs once per heartbeat, whatever the period.
//! - The queues' depths are exported every heartbeat, and every [`DEPTHS_EVERY_MS`] while streams
//!   wait or have just stopped waiting (the depth they left is exported too).
//!
//! Figures: a tick into wasm costs Envoy about 0.1 ms even when it does nothing, so an idle VM
//! ticks once a second; 2 ms bounds how late a parked stream hears its turn.

use crate::state::vm_registry::HEARTBEAT_MS;

/// The tick of a VM with parked streams.
pub const QUEUE_TICK_MS: u64 = 2;
/// How often a VM with parked streams exports its models' queue depths.
pub const DEPTHS_EVERY_MS: u64 = 100;

/// The root clock's state: the period set, and when the periodic work last ran.
#[derive(Debug, Default)]
pub struct Ticks {
    period_ms: Option<u64>,
    /// Streams were waiting when the period was last chosen.
    fast: bool,
    last_heartbeat_ms: Option<u64>,
    last_depths_ms: u64,
}

impl Ticks {
    /// The period the tick should run at, given whether streams wait and the service's period
    /// while this VM runs it; `Some` when it differs from the one set last.
    pub fn period(&mut self, waiting: bool, service_ms: Option<u64>) -> Option<u64> {
        self.fast = waiting;
        let want = if waiting { QUEUE_TICK_MS } else { service_ms.unwrap_or(HEARTBEAT_MS) };
        (self.period_ms.replace(want) != Some(want)).then_some(want)
    }

    /// Whether the tick runs at the queue's period.
    pub fn fast(&self) -> bool {
        self.fast
    }

    /// At a tick at `now` (`waiting`: streams wait now), whether the queues' depths are due.
    pub fn depths_due(&mut self, now: u64, waiting: bool) -> bool {
        let recent = waiting || self.fast;
        let since = now.saturating_sub(self.last_depths_ms);
        let due = since >= HEARTBEAT_MS || (recent && since >= DEPTHS_EVERY_MS);
        if due {
            self.last_depths_ms = now;
        }
        due
    }

    /// At a tick at `now`, whether the heartbeat's work is due (at the first tick, always).
    pub fn heartbeat_due(&mut self, now: u64) -> bool {
        match self.last_heartbeat_ms {
            Some(last) if now.saturating_sub(last) < HEARTBEAT_MS => false,
            _ => {
                self.last_heartbeat_ms = Some(now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn the_period_follows_the_queue_then_the_service_then_the_heartbeat_and_is_set_once() {
        let mut t = Ticks::default();
        assert_eq!(t.period(false, None), Some(HEARTBEAT_MS));
        assert_eq!(t.period(false, None), None, "unchanged: not set again");
        assert_eq!(t.period(false, Some(50)), Some(50), "this VM took the service's work");
        assert_eq!(t.period(true, Some(50)), Some(QUEUE_TICK_MS), "streams wait: the queue's tick");
        assert!(t.fast());
        assert_eq!(t.period(true, Some(200)), None, "the service's period changes nothing while streams wait");
        assert_eq!(t.period(false, Some(200)), Some(200));
        assert_eq!(t.period(false, None), Some(HEARTBEAT_MS), "the service's work went elsewhere");
    }

    #[test]
    fn the_heartbeat_runs_once_a_second_whatever_the_tick() {
        let mut t = Ticks::default();
        assert!(t.heartbeat_due(5_000), "the first tick");
        let due: Vec<u64> = (1..=1_500).map(|i| 5_000 + i * 2).filter(|now| t.heartbeat_due(*now)).collect();
        assert_eq!(due, [6_000, 7_000, 8_000]);
    }

    #[test]
    fn depths_go_every_heartbeat_and_every_tenth_of_one_while_streams_wait_or_just_left() {
        let mut t = Ticks::default();
        assert!(t.depths_due(10_000, false));
        assert!(!t.depths_due(10_500, false), "idle: once a heartbeat");
        assert!(t.depths_due(10_500 + 500, false));
        assert!(!t.depths_due(11_050, true));
        assert!(t.depths_due(11_100, true), "waiting: every 100 ms");
        t.period(true, None);
        assert!(t.depths_due(11_200, false), "just stopped waiting: the depth they left goes too");
        t.period(false, None);
        assert!(!t.depths_due(11_300, false));
    }
}
