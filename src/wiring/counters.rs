//! The counters the filter bumps (Envoy stats) and how a VM holds them back. Labels are encoded in
//! the name as `<metric>.<label>.<value>` and turned into Prometheus tags by the `stats_tags` that
//! `render` emits.

use std::sync::{Arc, Mutex};

use crate::policies::{Limit, PickReason};
use crate::registry::{Engine, Role};
use crate::state::schedule::Batched;
use crate::state::wait_queue::QueueExit;

pub const SELECTION_US: &str = "sgl_router_selection_us";
/// From sending the indexer callout to its answer or its last failure, failovers included.
pub const INDEXER_WAIT_US: &str = "sgl_router_indexer_wait_us";
/// How long a request waited at the router for its engine to start on its prefix.
pub const PREFIX_HOLD_MS: &str = "sgl_router_prefix_hold_ms";

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
    Pick(Role, Arc<Engine>),
    /// `sgl_router_pick_reasons_total{stage, reason}`.
    PickReason(Role, PickReason),
    /// `sgl_router_admission_rejections_total{limit}`.
    Rejection(Limit),
    /// `sgl_router_prefix_lookups_total{result=hit|miss|unavailable}` (spec §7).
    PrefixLookup(&'static str),
    /// `sgl_router_health_stale_reads_total`: health read while the service's table was stale.
    HealthTableStale,
    /// Per indexer replica (its cluster): `sgl_router_indexer_queries_total` (answered),
    /// `sgl_router_indexer_failovers_total` (it failed and the next replica was asked),
    /// `sgl_router_indexer_notices_total{result=sent|failed}`.
    Indexer(Arc<str>, IndexerEvent),
    /// `sgl_router_aborts_total{stage}`: aborts sent to engines for requests whose client left.
    Abort(Role),
    /// `sgl_router_aborts_unsent_total{stage}`: aborts that could not be sent (the engine's
    /// cluster is gone: an update removed it).
    AbortUnsent(Role),
    /// `sgl_router_retries_total{stage}`: requests Envoy sent on to a fallback engine.
    Retry(Role),
    /// `sgl_router_queue_rejections_total{class, reason}`: requests that left the waiting queue
    /// (or were refused by it) without being dispatched.
    QueueRejection(QueueExit, Arc<str>),
}

/// The waiting queue's histogram of how long dispatched requests waited, by class.
pub fn queue_wait_ms(class: &str) -> String {
    format!("sgl_router_queue_wait_ms.class.{}", label(class))
}

/// The gauge of the bytes of the bodies waiting in one model's queue (Envoy holds them).
pub fn queue_bytes(model: &str) -> String {
    format!("sgl_router_queue_bytes.model.{}", label(model))
}

/// The gauge of requests waiting in one model's queue, on every VM.
pub fn queue_depth(model: &str) -> String {
    format!("sgl_router_queue_depth.model.{}", label(model))
}

/// What happened with one indexer replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexerEvent {
    Answered,
    FailedOver,
    NoticeSent,
    NoticeFailed,
}

impl IndexerEvent {
    fn as_str(self) -> &'static str {
        match self {
            IndexerEvent::Answered => "answered",
            IndexerEvent::FailedOver => "failed_over",
            IndexerEvent::NoticeSent => "notice_sent",
            IndexerEvent::NoticeFailed => "notice_failed",
        }
    }
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
            Counter::HealthTableStale => (6, "", ""),
            Counter::Indexer(cluster, event) => (7, cluster, event.as_str()),
            Counter::Abort(stage) => (8, stage.as_str(), ""),
            Counter::Retry(stage) => (9, stage.as_str(), ""),
            Counter::QueueRejection(exit, class) => (10, exit.as_str(), class),
            Counter::AbortUnsent(stage) => (11, stage.as_str(), ""),
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
            Counter::HealthTableStale => "sgl_router_health_stale_reads_total".to_string(),
            Counter::Indexer(cluster, event) => {
                let cluster = label(cluster);
                match event {
                    IndexerEvent::Answered => format!("sgl_router_indexer_queries_total.indexer.{cluster}"),
                    IndexerEvent::FailedOver => format!("sgl_router_indexer_failovers_total.indexer.{cluster}"),
                    IndexerEvent::NoticeSent => {
                        format!("sgl_router_indexer_notices_total.indexer.{cluster}.result.sent")
                    }
                    IndexerEvent::NoticeFailed => {
                        format!("sgl_router_indexer_notices_total.indexer.{cluster}.result.failed")
                    }
                }
            }
            Counter::Abort(stage) => format!("sgl_router_aborts_total.stage.{}", stage.as_str()),
            Counter::AbortUnsent(stage) => format!("sgl_router_aborts_unsent_total.stage.{}", stage.as_str()),
            Counter::Retry(stage) => format!("sgl_router_retries_total.stage.{}", stage.as_str()),
            Counter::QueueRejection(exit, class) => {
                format!("sgl_router_queue_rejections_total.class.{}.reason.{}", label(class), exit.as_str())
            }
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

/// Counter bumps a filter VM holds back: each bump is a host call into Envoy (priced by
/// `scripts/bench --only hostcalls`) and a routed request makes four. They go to the glue on the
/// [`Batched`] rule with the VM's other exchanges, so Envoy's stats lag a busy VM by at most one
/// sync period and an idle one not at all.
#[derive(Debug)]
pub struct HeldCounters {
    held: Mutex<Batched<Bumps>>,
}

/// How many times each counter was bumped.
pub type Bumps = hashbrown::HashMap<Counter, u64>;

impl HeldCounters {
    pub fn new(period_ms: u64) -> Self {
        Self { held: Mutex::new(Batched::every(period_ms)) }
    }

    pub fn hold(&self, counters: impl IntoIterator<Item = Counter>) {
        if let Ok(mut held) = self.held.lock() {
            for counter in counters {
                *held.held_mut().entry(counter).or_insert(0) += 1;
            }
        }
    }

    /// `n` bumps of one counter.
    pub fn hold_n(&self, counter: Counter, n: u64) {
        if let Ok(mut held) = self.held.lock() {
            let count = held.held_mut().entry(counter).or_insert(0);
            *count = count.saturating_add(n);
        }
    }

    /// The bumps held since the last hand-over, if one is due (see [`Batched`]).
    pub fn take_if_due(&self, idle: bool, now_ms: u64) -> Bumps {
        self.take_with(|held| held.take_if_due(idle, now_ms))
    }

    /// Every bump held.
    pub fn take(&self, now_ms: u64) -> Bumps {
        self.take_with(|held| held.take(now_ms))
    }

    fn take_with(&self, take: impl FnOnce(&mut Batched<Bumps>) -> Option<Bumps>) -> Bumps {
        self.held.lock().ok().and_then(|mut held| take(&mut held)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn held_counters_add_up_and_go_to_the_glue_on_the_batch_rule() {
        use crate::testing::worker;
        let held = HeldCounters::new(5);
        let routed = || [Counter::Outcome("routed"), Counter::Pick(Role::Plain, worker("A"))];
        held.hold(routed());
        let mut first: Vec<_> = held.take_if_due(false, 0).into_iter().collect();
        first.sort_by_key(|(c, _)| c.name());
        assert_eq!(first, [(Counter::Pick(Role::Plain, worker("A")), 1), (Counter::Outcome("routed"), 1)]);
        held.hold(routed());
        held.hold(routed());
        held.hold([Counter::Outcome("NoCandidates")]);
        assert!(held.take_if_due(false, 3).is_empty(), "a busy VM holds them within the period");
        let mut due: Vec<_> = held.take_if_due(true, 3).into_iter().collect();
        due.sort_by_key(|(c, _)| c.name());
        assert_eq!(
            due,
            [
                (Counter::Pick(Role::Plain, worker("A")), 2),
                (Counter::Outcome("NoCandidates"), 1),
                (Counter::Outcome("routed"), 2)
            ],
            "an idle VM's, added up, at once"
        );
        assert!(held.take(4).is_empty(), "each bump is handed over once");
    }

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
