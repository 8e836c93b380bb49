//! Which counters a selection bumps: its bucket, picks and reasons, rejections, and outcome.

use std::sync::Arc;

use crate::buckets::BucketPick;
use crate::filter::generation::bucket_loop::SkippedBucket;
use crate::filter::generation::{Selection, SelectionFailure};
use crate::filter::ErrorKind;
use crate::policies::Pick;
use crate::registry::Role;
use crate::wiring::counters::Counter;

pub fn error_outcome(kind: ErrorKind) -> Counter {
    Counter::Outcome(kind.type_name())
}

fn rejection_counters<'a>(skipped: impl IntoIterator<Item = &'a SkippedBucket>) -> Vec<Counter> {
    skipped.into_iter().flat_map(|s| s.error.rejections().iter().map(|r| Counter::Rejection(r.limit))).collect()
}

/// Counters for a completed selection. A plain request's outcome is known now; a PD request's
/// only when its prefill answered (the exchange counts it).
pub fn selected(selection: &Selection) -> Vec<Counter> {
    // Why each engine was chosen: a cache hit, a confirmed miss and an unavailable index stay apart.
    fn picked(counters: &mut Vec<Counter>, stage: Role, p: &Pick) {
        counters.push(Counter::Pick(stage, Arc::clone(&p.engine)));
        counters.push(Counter::PickReason(stage, p.reason));
    }
    let mut counters = Vec::with_capacity(6);
    counters.push(Counter::BucketSelected(Arc::clone(&selection.bucket_id)));
    match &selection.pick {
        BucketPick::Plain(p) => {
            picked(&mut counters, Role::Plain, p);
            counters.push(Counter::Outcome("routed"));
        }
        BucketPick::Pd { prefill, decode } => {
            picked(&mut counters, Role::Prefill, prefill);
            picked(&mut counters, Role::Decode, decode);
        }
    }
    counters.extend(rejection_counters(&selection.skipped));
    counters
}

/// Counters for a selection that failed.
pub fn failed(failure: &SelectionFailure) -> Vec<Counter> {
    let mut counters = vec![error_outcome(failure.to_route_error().kind)];
    match failure {
        SelectionFailure::Exhausted(skipped) => counters.extend(rejection_counters(skipped)),
        SelectionFailure::Stopped(s) => counters.extend(rejection_counters(std::iter::once(s))),
        _ => {}
    }
    counters
}
