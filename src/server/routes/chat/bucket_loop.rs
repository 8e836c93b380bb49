//! The handler's bucket loop (design §3, §8): try each resolved bucket in order until one supplies
//! its complete selection. Missing candidates and admission rejections advance to the next bucket,
//! where every engine is picked again; invalid signals, invalid configuration and picks outside the
//! candidates stop at once. Nothing is dispatched here.

use std::sync::Arc;

use crate::buckets::{BucketPick, BucketRequest, BucketResolver, ResolveError};
use crate::policies::{BoxFuture, PickError, Rejection};
use crate::registry::LiveWorkers;
use crate::registry::Role;
use crate::server::{ErrorKind, RouteError};

/// The complete selection and the attempts that failed before it (for stats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub bucket_id: String,
    pub pick: BucketPick,
    pub skipped: Vec<SkippedBucket>,
}

/// A bucket that could not supply its selection and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedBucket {
    pub bucket_id: String,
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
                    skipped.iter().flat_map(|s| rejections_of(&s.error).iter().map(move |r| describe(s, r))).collect();
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

fn rejections_of(error: &PickError) -> &[Rejection] {
    match error {
        PickError::AdmissionRejected(r) => std::slice::from_ref(r),
        PickError::NoAdmissibleEngine { rejections } => rejections,
        _ => &[],
    }
}

/// `bucket/stage/worker: limit`, as spec §4 lists rejections.
fn describe(s: &SkippedBucket, r: &Rejection) -> String {
    format!("{}/{}/{}: {}", s.bucket_id, s.stage.as_str(), r.worker, r.limit.as_str())
}

/// Owns everything it needs, so a pending selection can be kept across host callbacks.
pub fn select(
    resolver: Arc<BucketResolver>,
    live: LiveWorkers,
    request: BucketRequest,
) -> BoxFuture<'static, Result<Selection, SelectionFailure>> {
    Box::pin(async move {
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
            match bucket.pick_engines(&live, &request).await {
                Ok(pick) => return Ok(Selection { bucket_id: bucket.id.clone(), pick, skipped }),
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
    })
}

#[cfg(test)]
#[path = "bucket_loop_tests.rs"]
mod tests;
