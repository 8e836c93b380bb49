//! Bucket-first selection (design §2–§3): the resolver orders a model's length-compatible buckets;
//! a bucket picks its complete selection (one plain engine, or a prefill and a decode engine from
//! its own two groups); an engine group filters live workers and validates its policy's answer.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use crate::policies::{Pick, PickError, PickRequest, Policy};
use crate::protocol::indexer::IndexerAnswer;
use crate::registry::{Engine, LiveEngines, Role};

/// Which workers a group may use: `None` in the configuration means all, `[]` means none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    All,
    Only(HashSet<String>),
}

/// The engines of one stage in one bucket and the policy that picks among them (design §2). It
/// owns membership and validates its policy's answer; it never looks at another bucket.
#[derive(Debug)]
pub struct EngineGroup {
    stage: Role,
    membership: Membership,
    policy: Arc<dyn Policy>,
    /// The policy's `max_inflight_requests`: each engine picked takes a seat, exact across VMs.
    seat_cap: Option<u64>,
    /// The last candidate list, kept while the live view it came from is unchanged, so a request
    /// does not filter every worker of the registry again (the views change when health does).
    cached: Mutex<Option<Candidates>>,
}

#[derive(Debug)]
struct Candidates {
    live: LiveEngines,
    model: String,
    list: Arc<[Arc<Engine>]>,
}

impl EngineGroup {
    /// A catch-all group: every healthy engine of the model and stage.
    pub fn new(stage: Role, policy: Arc<dyn Policy>) -> Self {
        Self { stage, membership: Membership::All, policy, seat_cap: None, cached: Mutex::default() }
    }

    /// A group of the listed workers only (`worker_ids: []` is a group of none).
    pub fn with_members(stage: Role, members: impl IntoIterator<Item = String>, policy: Arc<dyn Policy>) -> Self {
        Self {
            stage,
            membership: Membership::Only(members.into_iter().collect()),
            policy,
            seat_cap: None,
            cached: Mutex::default(),
        }
    }

    /// The group caps each engine's requests in flight at `cap`, counted by seats across VMs.
    pub fn with_seats(mut self, cap: Option<u64>) -> Self {
        self.seat_cap = cap;
        self
    }

    pub fn seat_cap(&self) -> Option<u64> {
        self.seat_cap
    }

    /// Live workers of the model and this stage that belong to the group, sorted by stable id.
    pub fn candidates(&self, live: &LiveEngines, model: &str) -> Arc<[Arc<Engine>]> {
        let Ok(mut cached) = self.cached.lock() else {
            return self.filter(live, model);
        };
        match cached.as_ref() {
            Some(c) if c.live.is_same_view(live) && c.model == model => Arc::clone(&c.list),
            _ => {
                let list = self.filter(live, model);
                *cached = Some(Candidates { live: live.clone(), model: model.to_string(), list: Arc::clone(&list) });
                list
            }
        }
    }

    fn filter(&self, live: &LiveEngines, model: &str) -> Arc<[Arc<Engine>]> {
        live.serving(model, self.stage)
            .filter(|w| match &self.membership {
                Membership::All => true,
                Membership::Only(ids) => ids.contains(&w.id),
            })
            .cloned()
            .collect()
    }

    /// Invokes the policy on the exact candidate set and rejects any answer outside it, including
    /// a different allocation that happens to carry a candidate's id.
    /// Up to `n` engines to retry on after `primary` (this group's pick), in order, each chosen by
    /// the group's policy without the ones before it; only engines `eligible` says may be named.
    pub fn fallbacks(
        &self,
        live: &LiveEngines,
        request: &PickRequest<'_>,
        primary: &Engine,
        n: usize,
        eligible: &dyn Fn(&Engine) -> bool,
    ) -> Vec<Arc<Engine>> {
        let mut rest: Vec<Arc<Engine>> = self
            .candidates(live, request.model)
            .iter()
            .filter(|c| c.id != primary.id && eligible(c))
            .cloned()
            .collect();
        let mut chosen = Vec::new();
        let mut failed = primary;
        while chosen.len() < n && !rest.is_empty() {
            let Some(next) = self.policy.fallback(&rest, failed, request) else { break };
            rest.retain(|c| c.id != next.id);
            chosen.push(next);
            failed = chosen.last().map_or(primary, |c| c.as_ref());
        }
        chosen
    }

    pub fn pick(&self, live: &LiveEngines, request: &PickRequest<'_>) -> Result<Pick, PickError> {
        let candidates = self.candidates(live, request.model);
        if candidates.is_empty() {
            return Err(PickError::no_candidates(format!(
                "no healthy {} engine of model `{}` in this group",
                self.stage.as_str(),
                request.model
            )));
        }
        let pick = self.policy.pick(&candidates, request)?;
        // Candidates are in id order: finding the answer costs log(group), not the group.
        let found = candidates.binary_search_by(|c| c.id.as_str().cmp(&pick.engine.id));
        if found.is_ok_and(|i| candidates.get(i).is_some_and(|c| Arc::ptr_eq(c, &pick.engine))) {
            Ok(pick)
        } else {
            Err(PickError::OutsideCandidates { worker: pick.engine.id.clone() })
        }
    }
}

/// One plain group, or both PD groups: a partial or mixed bucket cannot be built.
#[derive(Debug)]
pub enum BucketGroups {
    Plain(EngineGroup),
    Pd { prefill: EngineGroup, decode: EngineGroup },
}

/// Routing facts prepared once per request; each group call gets its stage-specific view.
#[derive(Debug, Clone, Default)]
pub struct BucketRequest {
    pub model: String,
    pub input_tokens: u64,
    pub expected_peak_tokens: Option<u64>,
    pub token_ids: Option<Vec<u32>>,
    pub prompt_text: Option<Arc<str>>,
    /// The indexer's answer, when the request asked it: an input like the others.
    pub indexer: Option<IndexerAnswer>,
    pub session_key: Option<String>,
    pub routing_key: Option<String>,
    /// It waited for its prefix as long as it may, or waited in the queue: it goes now.
    pub prefix_wait_over: bool,
}

impl BucketRequest {
    pub fn for_stage<'a>(&'a self, bucket_id: &'a str, stage: Role) -> PickRequest<'a> {
        PickRequest {
            model: &self.model,
            stage,
            bucket_id,
            input_tokens: self.input_tokens,
            expected_peak_tokens: self.expected_peak_tokens,
            token_ids: self.token_ids.as_deref(),
            prompt_text: self.prompt_text.as_deref(),
            indexer: self.indexer.as_ref(),
            session_key: self.session_key.as_deref(),
            routing_key: self.routing_key.as_deref(),
            prefix_wait_over: self.prefix_wait_over,
        }
    }
}

/// A complete selection from one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BucketPick {
    Plain(Pick),
    Pd { prefill: Pick, decode: Pick },
}

/// A failed group call, with the stage it failed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageError {
    pub stage: Role,
    pub error: PickError,
}

/// A length range and context capacity with its groups; it owns the complete plain or PD pick.
#[derive(Debug)]
pub struct Bucket {
    pub id: Arc<str>,
    pub rank: i64,
    /// Inclusive input-token range.
    pub min_input: u64,
    pub max_input: Option<u64>,
    pub max_context: Option<u64>,
    pub groups: BucketGroups,
}

impl Bucket {
    /// The lesser of the input upper bound and the context capacity; `None` is unbounded.
    pub fn capacity(&self) -> Option<u64> {
        match (self.max_input, self.max_context) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the request's length fits: input within the range, and the context capacity
    /// holding input plus output when the budget is known, else the input.
    pub fn fits(&self, input: u64, peak: Option<u64>) -> bool {
        let in_range = input >= self.min_input && self.max_input.is_none_or(|max| input <= max);
        let needed = peak.unwrap_or(input);
        in_range && self.max_context.is_none_or(|ctx| needed <= ctx)
    }

    /// This bucket's groups, of every stage: their candidates are the capacity a request that
    /// fits it could use.
    pub fn groups(&self) -> impl Iterator<Item = &EngineGroup> {
        let (first, second) = match &self.groups {
            BucketGroups::Plain(group) => (group, None),
            BucketGroups::Pd { prefill, decode } => (prefill, Some(decode)),
        };
        std::iter::once(first).chain(second)
    }

    /// Picks every engine this bucket needs. A PD bucket picks prefill then decode; a decode
    /// failure discards the tentative prefill choice (nothing was dispatched).
    /// The engines to retry the upstream stage (plain or decode) on after `primary`.
    pub fn fallbacks(
        &self,
        live: &LiveEngines,
        request: &BucketRequest,
        primary: &Engine,
        n: usize,
        eligible: &dyn Fn(&Engine) -> bool,
    ) -> Vec<Arc<Engine>> {
        let (group, stage) = match &self.groups {
            BucketGroups::Plain(group) => (group, Role::Plain),
            BucketGroups::Pd { decode, .. } => (decode, Role::Decode),
        };
        group.fallbacks(live, &request.for_stage(&self.id, stage), primary, n, eligible)
    }

    pub fn pick_engines(&self, live: &LiveEngines, request: &BucketRequest) -> Result<BucketPick, StageError> {
        let at = |stage: Role| move |error| StageError { stage, error };
        match &self.groups {
            BucketGroups::Plain(group) => {
                let r = request.for_stage(&self.id, Role::Plain);
                group.pick(live, &r).map(BucketPick::Plain).map_err(at(Role::Plain))
            }
            BucketGroups::Pd { prefill, decode } => {
                let pr = request.for_stage(&self.id, Role::Prefill);
                let p = prefill.pick(live, &pr).map_err(at(Role::Prefill))?;
                let dr = request.for_stage(&self.id, Role::Decode);
                let d = decode.pick(live, &dr).map_err(at(Role::Decode))?;
                Ok(BucketPick::Pd { prefill: p, decode: d })
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("expected peak {peak} is below the input length {input}")]
    PeakBelowInput { input: u64, peak: u64 },
}

/// A model's buckets; `resolve` orders the ones a request's length fits.
#[derive(Debug, Default)]
pub struct BucketResolver {
    buckets: Vec<Arc<Bucket>>,
}

impl BucketResolver {
    pub fn new(buckets: Vec<Bucket>) -> Self {
        Self { buckets: buckets.into_iter().map(Arc::new).collect() }
    }

    pub fn buckets(&self) -> &[Arc<Bucket>] {
        &self.buckets
    }

    /// Compatible buckets, smallest capacity first (unbounded last), then by rank, then by id.
    /// Looks at no worker and no policy.
    pub fn resolve(
        &self,
        input_tokens: u64,
        expected_peak_tokens: Option<u64>,
    ) -> Result<Vec<Arc<Bucket>>, ResolveError> {
        if let Some(peak) = expected_peak_tokens {
            if peak < input_tokens {
                return Err(ResolveError::PeakBelowInput { input: input_tokens, peak });
            }
        }
        let mut fitting: Vec<Arc<Bucket>> =
            self.buckets.iter().filter(|b| b.fits(input_tokens, expected_peak_tokens)).cloned().collect();
        fitting.sort_by(|a, b| order(a, b));
        Ok(fitting)
    }
}

fn order(a: &Bucket, b: &Bucket) -> Ordering {
    let capacity = match (a.capacity(), b.capacity()) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    };
    capacity.then_with(|| a.rank.cmp(&b.rank)).then_with(|| a.id.cmp(&b.id))
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};

    use proptest::prelude::*;

    use super::*;
    use crate::policies::{PickReason, PickRequest};
    use crate::testing::{worker_with, Scripted};

    fn live(workers: &[Arc<Engine>], unhealthy: &[&str]) -> LiveEngines {
        let mut sorted = workers.to_vec();
        sorted.sort_by(|a, b| a.id.cmp(&b.id));
        LiveEngines::new(sorted.into(), Arc::new(unhealthy.iter().map(|s| s.to_string()).collect()))
    }

    fn plain(id: &str) -> Arc<Engine> {
        worker_with(id, Role::Plain, "m")
    }

    fn bucket(id: &str, rank: i64, min: u64, max: Option<u64>, ctx: Option<u64>) -> Bucket {
        Bucket {
            id: id.into(),
            rank,
            min_input: min,
            max_input: max,
            max_context: ctx,
            groups: BucketGroups::Plain(EngineGroup::new(Role::Plain, Scripted::first())),
        }
    }

    fn ids(buckets: &[Arc<Bucket>]) -> Vec<&str> {
        buckets.iter().map(|b| &*b.id).collect()
    }

    fn request(stage: Role) -> PickRequest<'static> {
        crate::testing::request(stage)
    }

    #[test]
    fn candidates_are_kept_for_the_same_live_view_and_follow_a_new_one() {
        let workers = [plain("A"), plain("B"), plain("C")];
        let group = EngineGroup::new(Role::Plain, Scripted::first());
        let view = live(&workers, &["B"]);
        let first = group.candidates(&view, "m");
        let names = |c: &[Arc<Engine>]| c.iter().map(|w| w.id.clone()).collect::<Vec<_>>();
        assert_eq!(names(&first), ["A", "C"]);
        assert!(Arc::ptr_eq(&first, &group.candidates(&view.clone(), "m")), "the same view: the same list");
        // Equal contents in new allocations (health published again) are a new view: recomputed.
        let healed = live(&workers, &[]);
        assert_eq!(names(&group.candidates(&healed, "m")), ["A", "B", "C"]);
        assert_eq!(names(&group.candidates(&view, "m")), ["A", "C"]);
        assert!(group.candidates(&view, "other-model").is_empty());
    }

    // ---- BucketResolver::resolve (design §3) ----

    #[test]
    fn a_known_peak_below_the_input_is_an_invalid_signal() {
        let r = BucketResolver::new(vec![bucket("a", 0, 0, None, None)]);
        assert_eq!(r.resolve(10, Some(9)).unwrap_err(), ResolveError::PeakBelowInput { input: 10, peak: 9 });
        assert!(r.resolve(10, Some(10)).is_ok());
    }

    #[test]
    fn the_input_range_is_inclusive() {
        let r = BucketResolver::new(vec![bucket("a", 0, 10, Some(20), None)]);
        assert!(r.resolve(9, None).unwrap().is_empty());
        assert_eq!(ids(&r.resolve(10, None).unwrap()), ["a"]);
        assert_eq!(ids(&r.resolve(20, None).unwrap()), ["a"]);
        assert!(r.resolve(21, None).unwrap().is_empty());
    }

    #[test]
    fn context_capacity_is_checked_against_input_plus_output_when_known() {
        let r = BucketResolver::new(vec![bucket("a", 0, 0, None, Some(100))]);
        assert_eq!(ids(&r.resolve(50, Some(100)).unwrap()), ["a"]);
        assert!(r.resolve(50, Some(101)).unwrap().is_empty());
    }

    #[test]
    fn context_capacity_is_checked_against_input_when_output_is_unknown() {
        let r = BucketResolver::new(vec![bucket("a", 0, 0, None, Some(100))]);
        assert_eq!(ids(&r.resolve(100, None).unwrap()), ["a"]);
        assert!(r.resolve(101, None).unwrap().is_empty());
    }

    #[test]
    fn buckets_are_ordered_by_capacity_with_unbounded_last() {
        let r = BucketResolver::new(vec![
            bucket("unbounded", 0, 0, None, None),
            bucket("big", 0, 0, Some(1000), None),
            bucket("small", 0, 0, None, Some(100)),
        ]);
        assert_eq!(ids(&r.resolve(10, None).unwrap()), ["small", "big", "unbounded"]);
    }

    #[test]
    fn capacity_is_the_lesser_of_the_input_bound_and_the_context() {
        // a: input bound 500, context 50 000 → 500; b: input bound 10 000, context 400 → 400.
        let r = BucketResolver::new(vec![
            bucket("a", 0, 0, Some(500), Some(50_000)),
            bucket("b", 0, 0, Some(10_000), Some(400)),
        ]);
        assert_eq!(ids(&r.resolve(10, None).unwrap()), ["b", "a"]);
    }

    #[test]
    fn capacity_ties_are_broken_by_rank_then_id() {
        let r = BucketResolver::new(vec![
            bucket("z", 1, 0, Some(100), None),
            bucket("y", 2, 0, Some(100), None),
            bucket("x", 2, 0, Some(100), None),
            bucket("w", 0, 0, None, None),
            bucket("v", 0, 0, None, None),
        ]);
        assert_eq!(ids(&r.resolve(10, None).unwrap()), ["z", "x", "y", "v", "w"]);
    }

    #[test]
    fn the_resolver_returns_the_whole_ordered_list_or_nothing() {
        let r = BucketResolver::new(vec![bucket("a", 0, 0, Some(10), None), bucket("b", 0, 0, Some(20), None)]);
        assert_eq!(ids(&r.resolve(5, None).unwrap()), ["a", "b"]);
        assert!(r.resolve(30, None).unwrap().is_empty());
    }

    /// Design §7: a 4k input with a 16k peak cannot use the short bucket; a peak ≤ 8k selects it.
    #[test]
    fn design_example_4k_input_with_16k_peak_selects_long_and_8k_peak_selects_short() {
        let r = BucketResolver::new(vec![
            bucket("long-context", 20, 0, Some(131_072), Some(131_072)),
            bucket("short-context", 10, 0, Some(4096), Some(8192)),
        ]);
        assert_eq!(ids(&r.resolve(4000, Some(16_000)).unwrap()), ["long-context"]);
        assert_eq!(ids(&r.resolve(4000, Some(8192)).unwrap()), ["short-context", "long-context"]);
    }

    proptest! {
        #[test]
        fn resolved_buckets_all_fit_and_are_sorted(
            specs in proptest::collection::vec((0u64..50, proptest::option::of(50u64..200), proptest::option::of(10u64..300), -3i64..3), 0..12),
            input in 0u64..250,
            extra in proptest::option::of(0u64..100),
        ) {
            let buckets: Vec<Bucket> = specs.iter().enumerate().map(|(i, (min, max, ctx, rank))| bucket(&format!("b{i:02}"), *rank, *min, *max, *ctx)).collect();
            let resolver = BucketResolver::new(buckets);
            let peak = extra.map(|e| input + e);
            let resolved = resolver.resolve(input, peak).unwrap();
            // Exactly the fitting buckets…
            let expected: HashSet<&str> = resolver.buckets().iter().filter(|b| b.fits(input, peak)).map(|b| &*b.id).collect();
            prop_assert_eq!(resolved.iter().map(|b| &*b.id).collect::<HashSet<_>>(), expected);
            // …in capacity, rank, id order.
            for pair in resolved.windows(2) {
                let key = |b: &Bucket| (b.capacity().map_or((1, 0), |c| (0, c)), b.rank, b.id.clone());
                prop_assert!(key(&pair[0]) < key(&pair[1]));
            }
        }
    }

    // ---- EngineGroup::pick (design §2) ----

    #[test]
    fn a_group_filters_by_model_health_stage_and_membership_and_sorts_by_id() {
        let ws = vec![
            plain("C"),
            plain("A"),
            plain("B"),
            worker_with("D", Role::Plain, "other-model"),
            worker_with("P", Role::Prefill, "m"),
            plain("E"),
        ];
        let policy = Scripted::first();
        let group = EngineGroup::with_members(Role::Plain, ["A", "B", "C", "D", "P"].map(String::from), policy.clone());
        let pick = group.pick(&live(&ws, &["B"]), &request(Role::Plain)).unwrap();
        assert_eq!(pick.engine.id, "A");
        assert_eq!(
            policy.offered.lock().unwrap()[0],
            ["A", "C"],
            "E is not a member, B unhealthy, D another model, P another role"
        );
    }

    #[test]
    fn omitted_membership_means_every_engine_and_an_empty_one_none() {
        let ws = vec![plain("A"), plain("B")];
        let all = Scripted::first();
        EngineGroup::new(Role::Plain, all.clone()).pick(&live(&ws, &[]), &request(Role::Plain)).unwrap();
        assert_eq!(all.offered.lock().unwrap()[0], ["A", "B"]);

        let none = Scripted::first();
        let group = EngineGroup::with_members(Role::Plain, Vec::<String>::new(), none.clone());
        assert!(matches!(group.pick(&live(&ws, &[]), &request(Role::Plain)), Err(PickError::NoCandidates { .. })));
        assert!(none.offered.lock().unwrap().is_empty(), "the policy is not invoked without candidates");
    }

    #[test]
    fn a_result_outside_the_candidates_is_rejected() {
        let ws = vec![plain("A")];
        let foreign = plain("Z");
        let policy = Scripted::new(move |_| Ok(Pick::new(Arc::clone(&foreign), PickReason::Rotation)));
        let err = EngineGroup::new(Role::Plain, policy).pick(&live(&ws, &[]), &request(Role::Plain)).unwrap_err();
        assert_eq!(err, PickError::OutsideCandidates { worker: "Z".into() });
    }

    #[test]
    fn a_new_allocation_with_a_candidates_id_is_rejected() {
        let ws = vec![plain("A")];
        let policy = Scripted::new(|_| Ok(Pick::new(plain("A"), PickReason::Rotation)));
        let err = EngineGroup::new(Role::Plain, policy).pick(&live(&ws, &[]), &request(Role::Plain)).unwrap_err();
        assert_eq!(err, PickError::OutsideCandidates { worker: "A".into() });
    }

    // ---- Bucket::pick_engines ----

    fn pd_bucket(id: &str, prefill: Arc<Scripted>, decode: Arc<Scripted>) -> Bucket {
        Bucket {
            id: id.into(),
            rank: 0,
            min_input: 0,
            max_input: None,
            max_context: None,
            groups: BucketGroups::Pd {
                prefill: EngineGroup::new(Role::Prefill, prefill),
                decode: EngineGroup::new(Role::Decode, decode),
            },
        }
    }

    fn pd_workers() -> Vec<Arc<Engine>> {
        vec![worker_with("P1", Role::Prefill, "m"), worker_with("D1", Role::Decode, "m")]
    }

    fn bucket_request() -> BucketRequest {
        BucketRequest { model: "m".into(), input_tokens: 10, ..BucketRequest::default() }
    }

    #[test]
    fn a_pd_bucket_picks_both_engines_from_its_own_groups() {
        let b = pd_bucket("b", Scripted::first(), Scripted::first());
        let pick = b.pick_engines(&live(&pd_workers(), &[]), &bucket_request()).unwrap();
        let BucketPick::Pd { prefill, decode } = pick else { panic!("not a PD pick") };
        assert_eq!((prefill.engine.id.as_str(), decode.engine.id.as_str()), ("P1", "D1"));
    }

    #[test]
    fn each_group_gets_a_stage_specific_request_with_the_bucket_id() {
        #[derive(Debug, Default)]
        struct Recording(Mutex<Vec<(Role, String, Option<String>)>>);
        impl Policy for Recording {
            fn pick(&self, engines: &[Arc<Engine>], r: &PickRequest<'_>) -> Result<Pick, PickError> {
                self.0.lock().unwrap().push((r.stage, r.bucket_id.to_string(), r.session_key.map(String::from)));
                Ok(Pick::new(Arc::clone(&engines[0]), PickReason::Rotation))
            }
        }
        let rec = Arc::new(Recording::default());
        let b = Bucket {
            groups: BucketGroups::Pd {
                prefill: EngineGroup::new(Role::Prefill, rec.clone()),
                decode: EngineGroup::new(Role::Decode, rec.clone()),
            },
            ..pd_bucket("short", Scripted::first(), Scripted::first())
        };
        let req = BucketRequest { session_key: Some("s1".into()), ..bucket_request() };
        b.pick_engines(&live(&pd_workers(), &[]), &req).unwrap();
        let seen = rec.0.lock().unwrap().clone();
        assert_eq!(
            seen,
            vec![(Role::Prefill, "short".into(), Some("s1".into())), (Role::Decode, "short".into(), Some("s1".into()))]
        );
    }

    #[test]
    fn a_decode_failure_discards_the_prefill_choice_and_names_its_stage() {
        let b = pd_bucket("b", Scripted::first(), Scripted::failing(PickError::no_candidates("none")));
        let err = b.pick_engines(&live(&pd_workers(), &[]), &bucket_request()).unwrap_err();
        assert_eq!(err.stage, Role::Decode);
    }

    #[test]
    fn a_prefill_failure_skips_the_decode_group() {
        let decode = Scripted::first();
        let b = pd_bucket("b", Scripted::failing(PickError::no_candidates("none")), decode.clone());
        let err = b.pick_engines(&live(&pd_workers(), &[]), &bucket_request()).unwrap_err();
        assert_eq!(err.stage, Role::Prefill);
        assert!(decode.offered.lock().unwrap().is_empty());
    }
}
