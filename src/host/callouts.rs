//! HTTP callouts the core asks the glue to make (the indexer's match, a PD prefill, notices) and
//! their answers. The core never waits on one: it names the callout in an action, and the
//! request's life takes the answer as its next event. Every callout has a timeout, so every wait
//! ends.

use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutRequest {
    pub cluster: String,
    pub method: String,
    pub path: String,
    pub authority: String,
    pub headers: Vec<(String, String)>,
    /// Shared, so a PD body can be the callout's and the upstream request's without a copy.
    pub body: Option<Arc<Vec<u8>>>,
    pub timeout_ms: u64,
}
