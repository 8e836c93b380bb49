//! Names of the counters the filter bumps (Envoy stats). Labels are encoded in the name as
//! `<metric>.<label>.<value>` and turned into Prometheus tags by the `stats_tags` that `render`
//! emits.

use std::sync::Arc;

use crate::buckets::BucketPick;
use crate::policies::{Limit, Pick, PickReason};
use crate::registry::{Role, Worker};
use crate::server::routes::chat::bucket_loop::SkippedBucket;
use crate::server::routes::chat::{Selection, SelectionFailure};
use crate::server::ErrorKind;

pub const SELECTION_US: &str = "sgl_router_selection_us";

/// A label value safe inside a dotted metric name.
pub fn label(value: &str) -> String {
    value.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect()
}

/// A counter the filter bumps, as its family and label values: naming one on the request path
/// allocates nothing (ids are shared, names static), and the glue turns each distinct counter
/// into an Envoy metric once ([`Counter::name`]).
#[derive(Debug, Clone)]
pub enum Counter {
    /// `sgl_router_requests_total{outcome}`: `routed` or an error's type.
    Outcome(&'static str),
    /// `sgl_router_bucket_selected_total{bucket}`.
    BucketSelected(Arc<str>),
    /// `sgl_router_picks_total{stage, worker}`.
    Pick(Role, Arc<Worker>),
    /// `sgl_router_pick_reasons_total{stage, reason}`.
    PickReason(Role, PickReason),
    /// `sgl_router_admission_rejections_total{limit}`.
    Rejection(Limit),
    /// `sgl_router_prefix_lookups_total{result=hit|miss|unavailable}` (spec §7).
    PrefixLookup(&'static str),
}

impl Counter {
    /// The family and label values: what tells two counters apart.
    fn key(&self) -> (u8, &str, &str) {
        match self {
            Counter::Outcome(o) => (0, o, ""),
            Counter::BucketSelected(b) => (1, b, ""),
            Counter::Pick(stage, w) => (2, stage.as_str(), &w.id),
            Counter::PickReason(stage, r) => (3, stage.as_str(), r.as_str()),
            Counter::Rejection(l) => (4, l.as_str(), ""),
            Counter::PrefixLookup(v) => (5, v, ""),
        }
    }

    /// The Envoy metric name, labels encoded as `<metric>.<label>.<value>`.
    pub fn name(&self) -> String {
        match self {
            Counter::Outcome(o) => format!("sgl_router_requests_total.outcome.{}", label(o)),
            Counter::BucketSelected(b) => format!("sgl_router_bucket_selected_total.bucket.{}", label(b)),
            Counter::Pick(stage, w) => {
                format!("sgl_router_picks_total.stage.{}.worker.{}", stage.as_str(), label(&w.id))
            }
            Counter::PickReason(stage, r) => {
                format!("sgl_router_pick_reasons_total.stage.{}.reason.{}", stage.as_str(), r.as_str())
            }
            Counter::Rejection(l) => format!("sgl_router_admission_rejections_total.limit.{}", l.as_str()),
            Counter::PrefixLookup(v) => format!("sgl_router_prefix_lookups_total.result.{v}"),
        }
    }
}

impl PartialEq for Counter {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Counter {}

impl std::hash::Hash for Counter {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

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
        counters.push(Counter::Pick(stage, Arc::clone(&p.worker)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn labels_cannot_break_the_dotted_name() {
        assert_eq!(label("gpu.node-1/a"), "gpu_node-1_a");
        assert_eq!(Counter::BucketSelected("b.1".into()).name(), "sgl_router_bucket_selected_total.bucket.b_1");
    }

    #[test]
    fn counters_are_told_apart_by_family_and_labels_only() {
        use crate::testing::worker;
        let a = Counter::Pick(Role::Plain, worker("A"));
        assert_eq!(a, Counter::Pick(Role::Plain, worker("A")), "another Arc of the same worker");
        assert_ne!(a, Counter::Pick(Role::Decode, worker("A")));
        assert_ne!(Counter::Outcome("routed"), Counter::PrefixLookup("routed"));
        assert_eq!(a.name(), "sgl_router_picks_total.stage.plain.worker.A");
        assert_eq!(
            Counter::PickReason(Role::Prefill, PickReason::Rotation).name(),
            format!("sgl_router_pick_reasons_total.stage.prefill.reason.{}", PickReason::Rotation.as_str())
        );
    }
}
