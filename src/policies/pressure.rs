//! Stage pressure comparisons used by power-of-two (design §4). `Less` means the first engine is
//! under less pressure. Each level is compared only when both reports supply it.

use std::cmp::Ordering;

use crate::registry::Role;
use crate::state::load_monitor::EngineLoad;

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
    use crate::testing::native_load;

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
