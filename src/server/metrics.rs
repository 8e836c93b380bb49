//! Names of the counters the filter bumps (Envoy stats). Labels are encoded in the name as
//! `<metric>.<label>.<value>` and turned into Prometheus tags by the `stats_tags` that `render`
//! emits.

use crate::buckets::BucketPick;
use crate::registry::Role;
use crate::server::routes::chat::{Selection, SelectionFailure};
use crate::server::ErrorKind;

pub const SELECTION_US: &str = "sgl_router_selection_us";

/// A label value safe inside a dotted metric name.
pub fn label(value: &str) -> String {
    value.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect()
}

pub fn outcome(name: &str) -> String {
    format!("sgl_router_requests_total.outcome.{}", label(name))
}

/// `sgl_router_prefix_lookups_total{result=hit|miss|unavailable}` (spec §7).
pub fn prefix_lookup(verdict: &str) -> String {
    format!("sgl_router_prefix_lookups_total.result.{verdict}")
}

pub fn error_outcome(kind: ErrorKind) -> String {
    outcome(kind.type_name())
}

fn rejection_counters<'a>(
    skipped: impl Iterator<Item = &'a crate::server::routes::chat::bucket_loop::SkippedBucket>,
) -> Vec<String> {
    skipped
        .flat_map(|s| {
            s.error
                .rejections()
                .iter()
                .map(|r| format!("sgl_router_admission_rejections_total.limit.{}", r.limit.as_str()))
        })
        .collect()
}

/// Counters for a completed selection. A plain request's outcome is known now; a PD request's
/// only when its prefill answered (the exchange counts it).
pub fn selected(selection: &Selection) -> Vec<String> {
    let mut names = vec![format!("sgl_router_bucket_selected_total.bucket.{}", label(&selection.bucket_id))];
    if matches!(selection.pick, BucketPick::Plain(_)) {
        names.push(outcome("routed"));
    }
    let pick =
        |stage: Role, worker: &str| format!("sgl_router_picks_total.stage.{}.worker.{}", stage.as_str(), label(worker));
    // Why each engine was chosen: a cache hit, a confirmed miss and an unavailable index stay apart.
    let reason = |stage: Role, p: &crate::policies::Pick| {
        format!("sgl_router_pick_reasons_total.stage.{}.reason.{}", stage.as_str(), p.reason.as_str())
    };
    let stages: Vec<(Role, &crate::policies::Pick)> = match &selection.pick {
        BucketPick::Plain(p) => vec![(Role::Plain, p)],
        BucketPick::Pd { prefill, decode } => vec![(Role::Prefill, prefill), (Role::Decode, decode)],
    };
    for (stage, p) in stages {
        names.push(pick(stage, &p.worker.id));
        names.push(reason(stage, p));
    }
    names.extend(rejection_counters(selection.skipped.iter()));
    names
}

/// Counters for a selection that failed.
pub fn failed(failure: &SelectionFailure) -> Vec<String> {
    let mut names = vec![error_outcome(failure.to_route_error().kind)];
    match failure {
        SelectionFailure::Exhausted(skipped) => names.extend(rejection_counters(skipped.iter())),
        SelectionFailure::Stopped(s) => names.extend(rejection_counters(std::iter::once(s))),
        _ => {}
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn labels_cannot_break_the_dotted_name() {
        assert_eq!(label("gpu.node-1/a"), "gpu_node-1_a");
    }
}
