//! Bucket-first selection (design §2–§3): the resolver orders a model's length-compatible buckets;
//! a bucket picks its complete selection (one plain engine, or a prefill and a decode engine from
//! its own two groups); an engine group filters live workers and validates its policy's answer.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::sync::Arc;

use crate::policies::{BoxFuture, Pick, PickError, PickRequest, Policy};
use crate::registry::{LiveWorkers, Role, Worker};

/// Which workers a group may use: `None` in the configuration means all, `[]` means none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    All,
    Only(HashSet<String>),
}

#[derive(Debug)]
pub struct EngineGroup {
    stage: Role,
    membership: Membership,
    policy: Arc<dyn Policy>,
}

impl EngineGroup {
    /// A catch-all group: every healthy engine of the model and stage.
    pub fn new(stage: Role, policy: Arc<dyn Policy>) -> Self {
        Self { stage, membership: Membership::All, policy }
    }

    pub fn with_members(stage: Role, members: impl IntoIterator<Item = String>, policy: Arc<dyn Policy>) -> Self {
        Self { stage, membership: Membership::Only(members.into_iter().collect()), policy }
    }

    /// Live workers of the model and this stage that belong to the group, sorted by stable id.
    pub fn candidates(&self, live: &LiveWorkers, model: &str) -> Vec<Arc<Worker>> {
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
    pub fn pick<'a>(
        &'a self,
        live: &'a LiveWorkers,
        request: &'a PickRequest<'a>,
    ) -> BoxFuture<'a, Result<Pick, PickError>> {
        let candidates = self.candidates(live, request.model);
        Box::pin(async move {
            if candidates.is_empty() {
                return Err(PickError::no_candidates(format!(
                    "no healthy {} engine of model `{}` in this group",
                    self.stage.as_str(),
                    request.model
                )));
            }
            let pick = self.policy.pick(&candidates, request).await?;
            if candidates.iter().any(|c| Arc::ptr_eq(c, &pick.worker)) {
                Ok(pick)
            } else {
                Err(PickError::OutsideCandidates { worker: pick.worker.id.clone() })
            }
        })
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
    pub prefix_memo: Arc<crate::policies::cache_aware::PrefixMemo>,
    pub session_key: Option<String>,
    pub routing_key: Option<String>,
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
            prefix_memo: Some(&self.prefix_memo),
            session_key: self.session_key.as_deref(),
            routing_key: self.routing_key.as_deref(),
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

#[derive(Debug)]
pub struct Bucket {
    pub id: String,
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

    /// Picks every engine this bucket needs. A PD bucket picks prefill then decode; a decode
    /// failure discards the tentative prefill choice (nothing was dispatched).
    pub fn pick_engines<'a>(
        &'a self,
        live: &'a LiveWorkers,
        request: &'a BucketRequest,
    ) -> BoxFuture<'a, Result<BucketPick, StageError>> {
        Box::pin(async move {
            let at = |stage: Role| move |error| StageError { stage, error };
            match &self.groups {
                BucketGroups::Plain(group) => {
                    let r = request.for_stage(&self.id, Role::Plain);
                    group.pick(live, &r).await.map(BucketPick::Plain).map_err(at(Role::Plain))
                }
                BucketGroups::Pd { prefill, decode } => {
                    let pr = request.for_stage(&self.id, Role::Prefill);
                    let p = prefill.pick(live, &pr).await.map_err(at(Role::Prefill))?;
                    let dr = request.for_stage(&self.id, Role::Decode);
                    let d = decode.pick(live, &dr).await.map_err(at(Role::Decode))?;
                    Ok(BucketPick::Pd { prefill: p, decode: d })
                }
            }
        })
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
pub(crate) mod tests;
