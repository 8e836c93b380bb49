//! The handler's bucket loop (design §3, §8): try each resolved bucket in order until one supplies
//! its complete selection. Missing candidates and admission rejections advance to the next bucket,
//! where every engine is picked again; invalid signals, invalid configuration and picks outside the
//! candidates stop at once. Nothing is dispatched here.

use std::sync::Arc;

use crate::buckets::{Bucket, BucketGroups, BucketPick, BucketRequest, BucketResolver, ResolveError, StageError};
use crate::filter::{ErrorKind, RouteError};
use crate::policies::{Limit, PickError, Rejection};
use crate::registry::{Engine, LiveEngines, Role};
use crate::state::seats::{Seat, SeatBook, Seats};

/// How many times a bucket picks again, each time without an engine whose seats were all taken
/// (by other VMs since this one's counts were exchanged).
const SEAT_RETRIES: usize = 4;

/// The complete selection and the attempts that failed before it (for stats).
#[derive(Debug)]
pub struct Selection {
    pub bucket_id: Arc<str>,
    /// The bucket that supplied the pick, whose groups name the engines to retry on.
    pub bucket: Arc<Bucket>,
    pub pick: BucketPick,
    pub skipped: Vec<SkippedBucket>,
    /// The input length the buckets were resolved with (exact when the indexer counted it).
    pub input_tokens: u64,
    /// A seat at each engine of the pick whose group caps its requests in flight.
    pub seats: Seats,
}

/// Two selections are the same when the same bucket (by id) supplied the same pick.
impl PartialEq for Selection {
    fn eq(&self, other: &Self) -> bool {
        (&self.bucket_id, &self.pick, &self.skipped, self.input_tokens)
            == (&other.bucket_id, &other.pick, &other.skipped, other.input_tokens)
    }
}

impl Eq for Selection {}

/// A bucket that could not supply its selection and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedBucket {
    pub bucket_id: Arc<str>,
    pub stage: Role,
    pub error: PickError,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SelectionFailure {
    InvalidSignal(ResolveError),
    NoMatchingBucket {
        input_tokens: u64,
        expected_peak_tokens: Option<u64>,
    },
    /// Every bucket was tried; the skipped attempts in order.
    Exhausted(Vec<SkippedBucket>),
    /// An invalid signal, invalid configuration or foreign pick stopped the pass.
    Stopped(SkippedBucket),
}

impl SelectionFailure {
    /// Spec §4: the status and error body the client gets.
    pub fn to_route_error(&self) -> RouteError {
        match self {
            SelectionFailure::InvalidSignal(e) => RouteError::new(ErrorKind::InvalidSignal, e.to_string()),
            SelectionFailure::NoMatchingBucket { input_tokens, expected_peak_tokens } => RouteError::new(
                ErrorKind::NoMatchingBucket,
                match expected_peak_tokens {
                    Some(peak) => {
                        format!("no bucket fits {input_tokens} input tokens with an expected peak of {peak} tokens")
                    }
                    None => format!("no bucket fits {input_tokens} input tokens"),
                },
            ),
            SelectionFailure::Exhausted(skipped) => {
                let rejections: Vec<String> =
                    skipped.iter().flat_map(|s| s.error.rejections().iter().map(move |r| describe(s, r))).collect();
                if rejections.is_empty() {
                    let last = skipped.last();
                    let detail = last
                        .map(|s| format!("bucket `{}`, stage {}: {}", s.bucket_id, s.stage.as_str(), s.error))
                        .unwrap_or_else(|| "no bucket was tried".to_string());
                    RouteError::new(
                        ErrorKind::NoCandidates,
                        format!("no engine available; last unavailable stage: {detail}"),
                    )
                } else {
                    RouteError::new(
                        ErrorKind::AdmissionRejected,
                        format!("every compatible engine rejected the request: {}", rejections.join(", ")),
                    )
                }
            }
            SelectionFailure::Stopped(s) => {
                let kind = match s.error {
                    PickError::InvalidConfiguration(_) => ErrorKind::InvalidConfiguration,
                    PickError::OutsideCandidates { .. } => ErrorKind::OutsideCandidates,
                    _ => ErrorKind::InvalidSignal,
                };
                RouteError::new(kind, format!("bucket `{}`, stage {}: {}", s.bucket_id, s.stage.as_str(), s.error))
            }
        }
    }
}

/// `bucket/stage/worker: limit`, as spec §4 lists rejections.
fn describe(s: &SkippedBucket, r: &Rejection) -> String {
    format!("{}/{}/{}: {}", s.bucket_id, s.stage.as_str(), r.engine, r.limit.as_str())
}

/// Tries each bucket the request's length fits, in order, until one supplies its complete
/// selection. The request carries every fact selection reads, the indexer's answer among them.
/// `seats` counts the capped groups' requests across VMs (without it, as in tests of one VM, the
/// policies' own admission is the only gate).
pub fn select(
    resolver: &BucketResolver,
    live: &LiveEngines,
    request: &BucketRequest,
    seats: Option<&Arc<SeatBook>>,
) -> Result<Selection, SelectionFailure> {
    let buckets = resolver
        .resolve(request.input_tokens, request.expected_peak_tokens)
        .map_err(SelectionFailure::InvalidSignal)?;
    if buckets.is_empty() {
        return Err(SelectionFailure::NoMatchingBucket {
            input_tokens: request.input_tokens,
            expected_peak_tokens: request.expected_peak_tokens,
        });
    }
    let mut skipped = Vec::new();
    for bucket in buckets {
        match pick_seated(&bucket, live, request, seats) {
            Ok((pick, seats)) => {
                return Ok(Selection {
                    bucket_id: bucket.id.clone(),
                    bucket: Arc::clone(&bucket),
                    pick,
                    skipped,
                    input_tokens: request.input_tokens,
                    seats,
                })
            }
            Err(failure) => {
                let attempt =
                    SkippedBucket { bucket_id: bucket.id.clone(), stage: failure.stage, error: failure.error };
                match attempt.error {
                    PickError::NoCandidates { .. }
                    | PickError::AdmissionRejected(_)
                    | PickError::NoAdmissibleEngine { .. } => skipped.push(attempt),
                    PickError::InvalidSignal(_)
                    | PickError::InvalidConfiguration(_)
                    | PickError::OutsideCandidates { .. } => return Err(SelectionFailure::Stopped(attempt)),
                }
            }
        }
    }
    Err(SelectionFailure::Exhausted(skipped))
}

/// The bucket's pick, with a seat at each engine its capped groups chose. An engine whose seats
/// are all taken is a `max_inflight_requests` rejection: the bucket picks again without it.
fn pick_seated(
    bucket: &Bucket,
    live: &LiveEngines,
    request: &BucketRequest,
    book: Option<&Arc<SeatBook>>,
) -> Result<(BucketPick, Seats), StageError> {
    let capped = |stage: Role| {
        let group = match (&bucket.groups, stage) {
            (BucketGroups::Plain(g), _) => g,
            (BucketGroups::Pd { prefill, .. }, Role::Prefill) => prefill,
            (BucketGroups::Pd { decode, .. }, _) => decode,
        };
        group.seat_cap()
    };
    let Some(book) = book.filter(|_| bucket.groups().any(|g| g.seat_cap().is_some())) else {
        return bucket.pick_engines(live, request).map(|pick| (pick, Seats::default()));
    };
    let mut view = live.clone();
    let mut full: Vec<Rejection> = Vec::new();
    let mut last_stage = Role::Plain;
    for _ in 0..=SEAT_RETRIES {
        let pick = match bucket.pick_engines(&view, request) {
            Ok(pick) => pick,
            Err(e) if full.is_empty() => return Err(e),
            Err(StageError { stage, error }) => {
                return Err(match error {
                    PickError::NoCandidates { .. }
                    | PickError::NoAdmissibleEngine { .. }
                    | PickError::AdmissionRejected(_) => {
                        full.extend(error.rejections().iter().cloned());
                        StageError { stage, error: PickError::NoAdmissibleEngine { rejections: full } }
                    }
                    other => StageError { stage, error: other },
                })
            }
        };
        let stages: Vec<(Role, &Arc<Engine>)> = match &pick {
            BucketPick::Plain(p) => vec![(Role::Plain, &p.engine)],
            BucketPick::Pd { prefill, decode } => {
                vec![(Role::Prefill, &prefill.engine), (Role::Decode, &decode.engine)]
            }
        };
        let mut taken: Vec<Seat> = Vec::new();
        let mut refused = None;
        for (stage, engine) in stages {
            let Some(cap) = capped(stage) else { continue };
            match book.take(&Arc::from(engine.id.as_str()), cap) {
                Some(seat) => taken.push(seat),
                None => {
                    refused = Some((stage, Arc::clone(engine)));
                    break;
                }
            }
        }
        let Some((stage, engine)) = refused else { return Ok((pick, Seats::new(taken))) };
        // The seats taken for the other stage go back as `taken` drops.
        view = view.without(&view.places([&engine]));
        full.push(Rejection { engine: engine.id.clone(), limit: Limit::MaxInflightRequests });
        last_stage = stage;
    }
    Err(StageError { stage: last_stage, error: PickError::NoAdmissibleEngine { rejections: full } })
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::buckets::{Bucket, BucketGroups, EngineGroup};
    use crate::filter::ErrorKind;
    use crate::policies::{Limit, PickError, Rejection};
    use crate::registry::Engine;
    use crate::testing::{worker_with, Scripted};

    fn plain_bucket(id: &str, capacity: u64, policy: Arc<Scripted>) -> Bucket {
        Bucket {
            id: id.into(),
            rank: 0,
            min_input: 0,
            max_input: Some(capacity),
            max_context: None,
            groups: BucketGroups::Plain(EngineGroup::new(Role::Plain, policy)),
        }
    }

    fn pd_bucket(id: &str, capacity: u64, prefill: (&str, Arc<Scripted>), decode: (&str, Arc<Scripted>)) -> Bucket {
        Bucket {
            id: id.into(),
            rank: 0,
            min_input: 0,
            max_input: Some(capacity),
            max_context: None,
            groups: BucketGroups::Pd {
                prefill: EngineGroup::with_members(Role::Prefill, [prefill.0.to_string()], prefill.1),
                decode: EngineGroup::with_members(Role::Decode, [decode.0.to_string()], decode.1),
            },
        }
    }

    fn live(workers: Vec<Arc<Engine>>) -> LiveEngines {
        let mut workers = workers;
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        LiveEngines::new(workers.into(), Arc::default())
    }

    fn plain_live() -> LiveEngines {
        live(vec![worker_with("A", Role::Plain, "m")])
    }

    fn request(input: u64, peak: Option<u64>) -> BucketRequest {
        BucketRequest { model: "m".into(), input_tokens: input, expected_peak_tokens: peak, ..BucketRequest::default() }
    }

    fn run(buckets: Vec<Bucket>, live: LiveEngines, req: BucketRequest) -> Result<Selection, SelectionFailure> {
        select(&BucketResolver::new(buckets), &live, &req, None)
    }

    fn rejected(worker: &str, limit: Limit) -> PickError {
        PickError::AdmissionRejected(Rejection { engine: worker.into(), limit })
    }

    #[test]
    fn the_first_bucket_that_supplies_a_selection_wins() {
        let s = run(
            vec![plain_bucket("small", 100, Scripted::first()), plain_bucket("big", 1000, Scripted::first())],
            plain_live(),
            request(10, None),
        )
        .unwrap();
        assert_eq!(&*s.bucket_id, "small");
        assert!(s.skipped.is_empty());
    }

    #[test]
    fn no_candidates_advances_to_the_next_bucket() {
        let s = run(
            vec![
                plain_bucket("small", 100, Scripted::failing(PickError::no_candidates("x"))),
                plain_bucket("big", 1000, Scripted::first()),
            ],
            plain_live(),
            request(10, None),
        )
        .unwrap();
        assert_eq!(&*s.bucket_id, "big");
        assert_eq!(s.skipped.len(), 1);
    }

    #[test]
    fn admission_rejected_and_no_admissible_engine_both_advance() {
        for error in [rejected("A", Limit::MaxRunningRequests), PickError::NoAdmissibleEngine { rejections: vec![] }] {
            let s = run(
                vec![
                    plain_bucket("small", 100, Scripted::failing(error)),
                    plain_bucket("big", 1000, Scripted::first()),
                ],
                plain_live(),
                request(10, None),
            )
            .unwrap();
            assert_eq!(&*s.bucket_id, "big");
        }
    }

    #[test]
    fn invalid_signal_configuration_and_foreign_picks_stop_the_pass() {
        for (error, kind) in [
            (PickError::InvalidSignal("bad".into()), ErrorKind::InvalidSignal),
            (PickError::InvalidConfiguration("bad".into()), ErrorKind::InvalidConfiguration),
            (PickError::OutsideCandidates { worker: "Z".into() }, ErrorKind::OutsideCandidates),
        ] {
            let later = Scripted::first();
            let failure = run(
                vec![plain_bucket("small", 100, Scripted::failing(error)), plain_bucket("big", 1000, later.clone())],
                plain_live(),
                request(10, None),
            )
            .unwrap_err();
            assert!(matches!(failure, SelectionFailure::Stopped(_)));
            assert_eq!(failure.to_route_error().kind, kind);
            assert_eq!(failure.to_route_error().status(), 500);
            assert!(later.offered.lock().unwrap().is_empty(), "no later bucket is tried");
        }
    }

    #[test]
    fn exhaustion_with_rejections_is_a_503_listing_every_rejection() {
        let failure = run(
            vec![
                plain_bucket("small", 100, Scripted::failing(rejected("A", Limit::MaxRunningRequests))),
                plain_bucket("mid", 500, Scripted::failing(PickError::no_candidates("none"))),
                plain_bucket(
                    "big",
                    1000,
                    Scripted::failing(PickError::NoAdmissibleEngine {
                        rejections: vec![
                            Rejection { engine: "A".into(), limit: Limit::MaxKvTokens },
                            Rejection { engine: "B".into(), limit: Limit::MaxInflightRequests },
                        ],
                    }),
                ),
            ],
            plain_live(),
            request(10, None),
        )
        .unwrap_err();
        let e = failure.to_route_error();
        assert_eq!((e.status(), e.kind), (503, ErrorKind::AdmissionRejected));
        for item in
            ["small/plain/A: max_running_requests", "big/plain/A: max_kv_tokens", "big/plain/B: max_inflight_requests"]
        {
            assert!(e.message.contains(item), "{item} missing from: {}", e.message);
        }
    }

    #[test]
    fn exhaustion_without_rejections_is_a_503_naming_the_last_unavailable_stage() {
        let failure = run(
            vec![pd_bucket(
                "only",
                100,
                ("P1", Scripted::first()),
                ("D1", Scripted::failing(PickError::no_candidates("no decode"))),
            )],
            live(vec![worker_with("P1", Role::Prefill, "m"), worker_with("D1", Role::Decode, "m")]),
            request(10, None),
        )
        .unwrap_err();
        let e = failure.to_route_error();
        assert_eq!((e.status(), e.kind), (503, ErrorKind::NoCandidates));
        assert!(e.message.contains("bucket `only`, stage decode"), "{}", e.message);
    }

    #[test]
    fn no_compatible_bucket_is_a_400_no_matching_bucket() {
        let failure =
            run(vec![plain_bucket("small", 100, Scripted::first())], plain_live(), request(500, None)).unwrap_err();
        let e = failure.to_route_error();
        assert_eq!((e.status(), e.kind), (400, ErrorKind::NoMatchingBucket));
    }

    #[test]
    fn a_peak_below_the_input_reaching_the_resolver_is_a_500_invalid_signal() {
        let failure =
            run(vec![plain_bucket("small", 100, Scripted::first())], plain_live(), request(50, Some(10))).unwrap_err();
        let e = failure.to_route_error();
        assert_eq!((e.status(), e.kind), (500, ErrorKind::InvalidSignal));
    }

    #[test]
    fn a_pd_selection_takes_both_engines_from_one_bucket() {
        let s = run(
            vec![
                pd_bucket(
                    "short",
                    100,
                    ("P1", Scripted::first()),
                    ("D1", Scripted::failing(rejected("D1", Limit::MaxKvTokens))),
                ),
                pd_bucket("long", 1000, ("P2", Scripted::first()), ("D2", Scripted::first())),
            ],
            live(
                ["P1", "P2"]
                    .iter()
                    .map(|id| worker_with(id, Role::Prefill, "m"))
                    .chain(["D1", "D2"].iter().map(|id| worker_with(id, Role::Decode, "m")))
                    .collect(),
            ),
            request(10, None),
        )
        .unwrap();
        let BucketPick::Pd { prefill, decode } = s.pick else { panic!("not PD") };
        assert_eq!((&*s.bucket_id, prefill.engine.id.as_str(), decode.engine.id.as_str()), ("long", "P2", "D2"));
    }

    #[derive(Debug, Clone, Copy)]
    enum Outcome {
        Ok,
        Missing,
        Rejected,
    }

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![Just(Outcome::Ok), Just(Outcome::Missing), Just(Outcome::Rejected)]
    }

    fn scripted(outcome: Outcome, worker: &str) -> Arc<Scripted> {
        match outcome {
            Outcome::Ok => Scripted::first(),
            Outcome::Missing => Scripted::failing(PickError::no_candidates("none")),
            Outcome::Rejected => Scripted::failing(rejected(worker, Limit::MaxRunningRequests)),
        }
    }

    proptest! {
        /// Design §3 rule 5: a failed PD attempt never contributes an engine to a later pair.
        #[test]
        fn a_failed_pd_attempt_never_contributes_an_engine_to_a_later_pair(outcomes in proptest::collection::vec((outcome(), outcome()), 1..8)) {
            let mut workers = Vec::new();
            let mut buckets = Vec::new();
            for (i, (p, d)) in outcomes.iter().enumerate() {
                let (pid, did) = (format!("P{i}"), format!("D{i}"));
                workers.push(worker_with(&pid, Role::Prefill, "m"));
                workers.push(worker_with(&did, Role::Decode, "m"));
                buckets.push(pd_bucket(&format!("b{i}"), 100 + i as u64, (&pid, scripted(*p, &pid)), (&did, scripted(*d, &did))));
            }
            let winner = outcomes.iter().position(|(p, d)| matches!((p, d), (Outcome::Ok, Outcome::Ok)));
            match (run(buckets, live(workers), request(10, None)), winner) {
                (Ok(s), Some(k)) => {
                    let BucketPick::Pd { prefill, decode } = s.pick else { panic!("not PD") };
                    prop_assert_eq!(s.bucket_id.to_string(), format!("b{k}"));
                    prop_assert_eq!(prefill.engine.id.clone(), format!("P{k}"));
                    prop_assert_eq!(decode.engine.id.clone(), format!("D{k}"));
                    prop_assert_eq!(s.skipped.len(), k);
                }
                (Err(SelectionFailure::Exhausted(skipped)), None) => prop_assert_eq!(skipped.len(), outcomes.len()),
                (other, w) => prop_assert!(false, "unexpected {:?} for winner {:?}", other, w),
            }
        }
    }
}
