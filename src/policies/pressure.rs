//! Stage pressure comparisons used by power-of-two (design §4). `Less` means the first engine is
//! under less pressure. Each level is compared only when both reports supply it.

use std::cmp::Ordering;

use crate::registry::Role;
use crate::state::load_monitor::{EngineLoad, LocalLoad, Speed};

/// Prefill work under this many tokens takes an engine a few milliseconds: compared as none, so
/// request counts decide between engines that are not prefilling.
pub const PREFILL_QUANTUM_TOKENS: u64 = 256;

/// Uncached prompt tokens waiting at an engine: what it reports plus what the router sent it since
/// the report and, by its own estimate, the engine has not yet prefilled; without a report, that
/// estimate alone (docs/architecture.md, "Design deviations"). A report is up to a poll old: a
/// prompt sent since must not leave the engine looking idle to the requests that follow it.
pub fn pending_prefill(load: Option<&EngineLoad>, local: &LocalLoad) -> u64 {
    match load.and_then(|l| Some((l.waiting_uncached_tokens?, l.sent_at_report))) {
        Some((reported, at_report)) => {
            let sent_since = local.sent().since(at_report).uncached_tokens;
            reported.saturating_add(sent_since.min(local.pending_prefill_tokens))
        }
        None => local.pending_prefill_tokens,
    }
}

/// An engine's prefill rate in tokens per millisecond: measured from its counters, else as the
/// router learned it from the engine's first bytes, on the configured `prior_tokens_per_ms`.
pub fn prefill_rate(load: Option<&EngineLoad>, local: &LocalLoad, prior_tokens_per_ms: f64) -> f64 {
    measured_or(load, || local.speed_now(prior_tokens_per_ms))
}

fn measured_or(load: Option<&EngineLoad>, learned: impl FnOnce() -> Speed) -> f64 {
    load.and_then(|l| l.prefill_tokens_per_ms)
        .filter(|r| *r > 0.0)
        .unwrap_or_else(|| learned().tokens_per_ms)
        .max(f64::MIN_POSITIVE)
}

/// How long a new request bringing `uncached` tokens would wait at an engine for its first
/// token, in milliseconds, by what the router can see: its turn for a running slot
/// ([`slot_wait_ms`]), then the prefill queue and its own tokens
/// at the engine's prefill rate ([`prefill_rate`]), and the engine's learned time to a first byte
/// with nothing to prefill. Unknown parts count as none.
pub fn expected_wait_ms(load: Option<&EngineLoad>, local: &LocalLoad, uncached: u64, prior_tokens_per_ms: f64) -> f64 {
    wait_and_rate(load, local, uncached, prior_tokens_per_ms).0
}

/// [`expected_wait_ms`] and the prefill rate it was priced at ([`prefill_rate`]), from one reading
/// of the engine's learned speed.
pub fn wait_and_rate(
    load: Option<&EngineLoad>,
    local: &LocalLoad,
    uncached: u64,
    prior_tokens_per_ms: f64,
) -> (f64, f64) {
    let speed = local.speed_now(prior_tokens_per_ms);
    let rate = measured_or(load, || speed);
    let prefill = speed.overhead_ms + pending_prefill(load, local).saturating_add(uncached) as f64 / rate;
    (slot_wait_ms(load, local) + prefill, rate)
}

/// How long a new request would wait for a running slot at an engine, in milliseconds: the
/// requests ahead of it beyond the engine's slots, reported plus sent since the report, each costing
/// the engine's average hold time shared over its slots. Unknown: none.
pub fn slot_wait_ms(load: Option<&EngineLoad>, local: &LocalLoad) -> f64 {
    match (load, local.hold_ms) {
        (Some(l), Some(hold_ms)) => match (l.running, l.waiting, l.max_running) {
            (Some(running), Some(waiting), Some(slots)) if slots > 0 => {
                let sent_since = local.sent().since(l.sent_at_report).dispatches;
                // Reported numbers are the engine's to choose: a sum that wrapped would make a full
                // engine look idle.
                let queued = running.saturating_add(waiting).saturating_add(sent_since).saturating_add(1);
                let ahead = queued.saturating_sub(slots);
                ahead as f64 * hold_ms / slots as f64
            }
            _ => 0.0,
        },
        _ => 0.0,
    }
}

fn by<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Ordering {
    match (a, b) {
        (Some(a), Some(b)) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
        _ => Ordering::Equal,
    }
}

/// Plain and prefill: estimated prefill queue time, waiting uncached tokens, waiting requests,
/// running requests.
pub fn compare_prefill(a: &EngineLoad, b: &EngineLoad) -> Ordering {
    by(a.prefill_queue_ms, b.prefill_queue_ms)
        .then_with(|| by(a.waiting_uncached_tokens, b.waiting_uncached_tokens))
        .then_with(|| by(a.waiting, b.waiting))
        .then_with(|| by(a.running, b.running))
}

/// Decode: waiting requests, running requests, KV usage fraction, used KV tokens.
pub fn compare_decode(a: &EngineLoad, b: &EngineLoad) -> Ordering {
    by(a.waiting, b.waiting)
        .then_with(|| by(a.running, b.running))
        .then_with(|| by(a.kv_usage(), b.kv_usage()))
        .then_with(|| by(a.kv_used, b.kv_used))
}

pub fn compare_for_stage(stage: Role, a: &EngineLoad, b: &EngineLoad) -> Ordering {
    match stage {
        Role::Plain | Role::Prefill => compare_prefill(a, b),
        Role::Decode => compare_decode(a, b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::load_monitor::SentCounts;
    use crate::testing::native_load;
    use crate::testing::test;

    #[test]
    fn the_wait_counts_requests_beyond_the_slots_and_the_prefill_ahead() {
        let local = LocalLoad { hold_ms: Some(800.0), pending_prefill_tokens: 1_000, ..LocalLoad::default() };
        let mut load = native_load(4, 2);
        load.max_running = Some(4);
        // 3 ahead (4 running + 2 waiting + itself - 4 slots), 200 ms each; 1,500 tokens at 10/ms.
        assert_eq!(expected_wait_ms(Some(&load), &local, 500, 10.0), 600.0 + 150.0);
        load.running = Some(2);
        load.waiting = Some(0);
        assert_eq!(expected_wait_ms(Some(&load), &local, 500, 10.0), 150.0, "a free slot: no wait for one");
        load.prefill_tokens_per_ms = Some(30.0);
        assert_eq!(expected_wait_ms(Some(&load), &local, 500, 10.0), 50.0, "the measured rate wins");
        let fresh = LocalLoad { hold_ms: None, ..local };
        assert_eq!(expected_wait_ms(None, &fresh, 0, 10.0), 100.0, "no report, no hold time: the prefill alone");
    }

    #[test]
    fn requests_sent_since_the_report_are_ahead_too() {
        let local = LocalLoad { hold_ms: Some(400.0), dispatched_total: 12, ..LocalLoad::default() };
        let mut load = native_load(3, 0);
        load.max_running = Some(4);
        load.sent_at_report.dispatches = 10;
        // 3 running + 2 sent since + itself - 4 slots = 2 ahead, 100 ms each.
        assert_eq!(expected_wait_ms(Some(&load), &local, 0, 10.0), 200.0);
    }

    #[test]
    fn prompts_sent_since_the_report_wait_too_while_the_router_thinks_them_unprefilled() {
        let mut load = native_load(1, 0);
        load.waiting_uncached_tokens = Some(500);
        load.sent_at_report = SentCounts { dispatches: 3, uncached_tokens: 1_000 };
        let local = LocalLoad { prefilled_total: 3_000, pending_prefill_tokens: 1_500, ..LocalLoad::default() };
        assert_eq!(pending_prefill(Some(&load), &local), 2_000, "500 reported, 1,500 of the 2,000 sent since");
        let drained = LocalLoad { pending_prefill_tokens: 0, ..local };
        assert_eq!(pending_prefill(Some(&load), &drained), 500, "the sent ones are prefilled by the estimate");
        load.waiting_uncached_tokens = None;
        assert_eq!(pending_prefill(Some(&load), &local), 1_500, "no count reported: the estimate alone");
    }

    #[test]
    fn reported_numbers_near_the_top_of_u64_saturate_and_never_look_idle() {
        let local = LocalLoad { hold_ms: Some(100.0), dispatched_total: u64::MAX, ..LocalLoad::default() };
        let mut load = native_load(u64::MAX, u64::MAX);
        load.max_running = Some(1);
        let full = expected_wait_ms(Some(&load), &local, 0, 10.0);
        load.running = Some(0);
        load.waiting = Some(0);
        load.sent_at_report.dispatches = u64::MAX;
        let idle = expected_wait_ms(Some(&load), &local, 0, 10.0);
        assert!(full > 1e18 && idle == 0.0, "full {full}, idle {idle}");
    }

    #[test]
    fn a_reported_queue_wins_over_the_estimate() {
        let local = LocalLoad { pending_prefill_tokens: 700, ..LocalLoad::default() };
        let mut load = native_load(0, 0);
        assert_eq!(pending_prefill(Some(&load), &local), 700, "not reported: the estimate");
        assert_eq!(pending_prefill(None, &local), 700, "no fresh report: the estimate");
        load.waiting_uncached_tokens = Some(5);
        assert_eq!(pending_prefill(Some(&load), &local), 5);
    }

    #[test]
    fn prefill_compares_queue_time_first() {
        let mut a = native_load(0, 10);
        let mut b = native_load(0, 0);
        a.prefill_queue_ms = Some(1.0);
        b.prefill_queue_ms = Some(2.0);
        assert_eq!(compare_prefill(&a, &b), Ordering::Less, "less queue time wins over more waiting");
    }

    #[test]
    fn prefill_then_waiting_uncached_then_waiting_then_running() {
        let mut a = native_load(5, 5);
        let mut b = native_load(5, 5);
        a.waiting_uncached_tokens = Some(10);
        b.waiting_uncached_tokens = Some(20);
        a.waiting = Some(9);
        assert_eq!(compare_prefill(&a, &b), Ordering::Less);
        b.waiting_uncached_tokens = Some(10);
        assert_eq!(compare_prefill(&a, &b), Ordering::Greater, "then waiting requests");
        a.waiting = Some(5);
        a.running = Some(4);
        assert_eq!(compare_prefill(&a, &b), Ordering::Less, "then running requests");
    }

    #[test]
    fn queue_time_is_skipped_unless_both_report_it() {
        let mut a = native_load(0, 9);
        let b = native_load(0, 1);
        a.prefill_queue_ms = Some(0.0);
        assert_eq!(compare_prefill(&a, &b), Ordering::Greater);
    }

    #[test]
    fn decode_compares_waiting_running_usage_then_tokens() {
        let mut a = native_load(1, 9);
        let b = native_load(5, 0);
        assert_eq!(compare_decode(&a, &b), Ordering::Greater, "waiting first");
        a.waiting = Some(0);
        assert_eq!(compare_decode(&a, &b), Ordering::Less, "then running");
        a.running = Some(5);
        a.kv_used = Some(10);
        let mut b2 = b.clone();
        b2.kv_used = Some(20);
        assert_eq!(compare_decode(&a, &b2), Ordering::Less, "then KV usage");
        let mut c = a.clone();
        c.kv_capacity = Some(2000);
        c.kv_used = Some(20);
        // Same usage fraction (1 %), fewer tokens wins.
        assert_eq!(compare_decode(&a, &c), Ordering::Less);
    }
}
