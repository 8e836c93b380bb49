//! Rotation over the candidates with one cursor per policy instance. The instance is logical and
//! spans every worker VM, so its cursor lives behind a trait the application backs with shared data.

use std::sync::Arc;

use super::{BoxFuture, Pick, PickError, PickReason, PickRequest, Policy};
use crate::host::Host;
use crate::registry::Worker;
use crate::state::{keys, shared};

/// The policy instance's position; each call returns the next ticket.
pub trait RoundRobinCursor: Send + Sync + std::fmt::Debug {
    fn next_ticket(&self) -> u64;
}

/// A cursor in shared data, advanced with cas by every VM.
pub struct SharedCursor {
    host: Arc<dyn Host>,
    key: String,
}

impl SharedCursor {
    pub fn new(host: Arc<dyn Host>, instance: &str) -> Self {
        Self {
            host,
            key: keys::round_robin_cursor(instance),
        }
    }
}

impl std::fmt::Debug for SharedCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCursor")
            .field("key", &self.key)
            .finish()
    }
}

impl RoundRobinCursor for SharedCursor {
    fn next_ticket(&self) -> u64 {
        // Under contention past the retry bound, a random ticket keeps traffic spread rather than
        // piling onto the first candidate.
        shared::fetch_add(self.host.as_ref(), &self.key, 1)
            .unwrap_or_else(|_| self.host.random_u64())
    }
}

#[derive(Debug)]
pub struct RoundRobinPolicy {
    cursor: Box<dyn RoundRobinCursor>,
}

impl RoundRobinPolicy {
    pub fn new(cursor: Box<dyn RoundRobinCursor>) -> Self {
        Self { cursor }
    }
}

impl Policy for RoundRobinPolicy {
    fn pick<'a>(
        &'a self,
        engines: &'a [Arc<Worker>],
        _request: &'a PickRequest<'a>,
    ) -> BoxFuture<'a, Result<Pick, PickError>> {
        let result = if engines.is_empty() {
            Err(PickError::NoCandidates)
        } else {
            let len = engines.len() as u64;
            let index = (self.cursor.next_ticket() % len) as usize;
            engines
                .get(index)
                .map(|w| Pick {
                    worker: Arc::clone(w),
                    reason: PickReason::Rotation,
                })
                .ok_or(PickError::NoCandidates)
        };
        Box::pin(std::future::ready(result))
    }
}
