//! `GET /v1/models`, answered from the configured models in OpenAI's list format.

use serde_json::json;

use crate::config::RouterConfig;

pub const MODELS_PATH: &str = "/v1/models";

pub fn list_models(config: &RouterConfig) -> Vec<u8> {
    let data: Vec<_> = config
        .models
        .keys()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "sgl-envoy-router"}))
        .collect();
    json!({"object": "list", "data": data}).to_string().into_bytes()
}
