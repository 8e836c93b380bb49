//! The policy contract (design §4): one asynchronous, object-safe `pick` over an exact candidate
//! set. Local policies return a ready future; the filter polls a pending one from its callouts.

mod round_robin;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use round_robin::{RoundRobinCursor, RoundRobinPolicy, SharedCursor};

use crate::config::Role;
use crate::registry::Worker;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Facts of one group call. No body, no state handles, no observations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PickRequest<'a> {
    pub model: &'a str,
    pub stage: Role,
    pub bucket_id: &'a str,
    pub input_tokens: u64,
    pub expected_peak_tokens: Option<u64>,
    pub session_key: Option<&'a str>,
    pub routing_key: Option<&'a str>,
}

/// Why a policy chose its engine, for stats and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickReason {
    Rotation,
}

impl PickReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::Rotation => "rotation",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub worker: Arc<Worker>,
    pub reason: PickReason,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    #[error("no candidates")]
    NoCandidates,
    #[error("invalid configuration: {0}")]
    InvalidConfiguration(String),
}

pub trait Policy: Send + Sync + std::fmt::Debug {
    fn pick<'a>(
        &'a self,
        engines: &'a [Arc<Worker>],
        request: &'a PickRequest<'a>,
    ) -> BoxFuture<'a, Result<Pick, PickError>>;
}
