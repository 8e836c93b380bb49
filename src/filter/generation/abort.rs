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
    let mut request = engine.callout("POST", ABORT_PATH, ABORT_TIMEOUT_MS);
    request.headers.push(("content-type".to_string(), "application/json".to_string()));
    request.body = Some(Arc::new(json!({ "rid": rid }).to_string().into_bytes()));
    request
}
