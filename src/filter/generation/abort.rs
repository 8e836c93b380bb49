//! Aborts (spec §8): a request whose client went away before its response completed is aborted
//! at every engine still working on it, by its id, with SGLang's `POST /abort_request`.

use std::sync::Arc;

use serde_json::json;

use crate::host::CalloutRequest;
use crate::registry::Engine;

pub const ABORT_PATH: &str = "/abort_request";
/// An abort nobody waits for: long enough for a busy engine, short enough to free its callout.
const ABORT_TIMEOUT_MS: u64 = 2_000;

/// The abort of request `rid` at `engine`.
pub fn abort_request(engine: &Engine, rid: &str) -> CalloutRequest {
    CalloutRequest {
        cluster: engine.cluster.clone(),
        method: "POST".to_string(),
        path: ABORT_PATH.to_string(),
        authority: engine.address.host_port(),
        headers: vec![("content-type".to_string(), "application/json".to_string())],
        body: Some(Arc::new(json!({ "rid": rid }).to_string().into_bytes())),
        timeout_ms: ABORT_TIMEOUT_MS,
    }
}
