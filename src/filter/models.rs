//! `GET /v1/models` and `GET /v1/models/{id}`, answered from the configured models in OpenAI's
//! shapes (the `openai` client's `models.list()` and `models.retrieve()`).

use serde_json::{json, Value};

use crate::config::RouterConfig;
use crate::filter::{ErrorKind, RouteError};

pub const MODELS_PATH: &str = "/v1/models";
/// `GET /v1/models/{id}`: the id is the rest of the path (model names may hold `/`).
pub const MODEL_PATH_PREFIX: &str = "/v1/models/";

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "sgl-envoy-router"})
}

pub fn list_models(config: &RouterConfig) -> Vec<u8> {
    let data: Vec<_> = config.models.keys().map(|id| model_object(id)).collect();
    json!({"object": "list", "data": data}).to_string().into_bytes()
}

/// `GET /v1/models/{id}` for a request `path` (its query ignored): the model, or OpenAI's 404.
pub fn retrieve_model(config: &RouterConfig, path: &str) -> Result<Vec<u8>, RouteError> {
    let raw_id = path.split('?').next().unwrap_or_default().strip_prefix(MODEL_PATH_PREFIX).unwrap_or_default();
    let id = percent_decode(raw_id);
    if config.models.contains_key(&id) {
        Ok(model_object(&id).to_string().into_bytes())
    } else {
        Err(RouteError::new(ErrorKind::ModelNotFound, format!("The model `{id}` does not exist")))
    }
}

/// `%XX` escapes decoded (clients escape `/` and spaces in model names); anything malformed is
/// kept as written, so it simply names no model.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::router_config_with_models;
    use crate::testing::test;

    #[test]
    fn a_configured_model_is_retrieved_and_an_unknown_one_is_a_404() {
        let config = router_config_with_models(&["llama-3-8b", "org/model x"]);
        let body: Value =
            serde_json::from_slice(&retrieve_model(&config, "/v1/models/llama-3-8b?x=1").unwrap()).unwrap();
        assert_eq!(body, json!({"id": "llama-3-8b", "object": "model", "created": 0, "owned_by": "sgl-envoy-router"}));
        let escaped: Value =
            serde_json::from_slice(&retrieve_model(&config, "/v1/models/org%2Fmodel%20x").unwrap()).unwrap();
        assert_eq!(escaped["id"], "org/model x");
        let e = retrieve_model(&config, "/v1/models/gpt-4").unwrap_err();
        assert_eq!((e.status(), e.kind.type_name()), (404, "model_not_found"));
        assert!(retrieve_model(&config, "/v1/models/bad%zz").is_err());
    }
}
