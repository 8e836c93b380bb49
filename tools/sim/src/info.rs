//! Health and the descriptive endpoints sglang-router reads when it registers a worker.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::control;
use crate::engine::{Engine, Role};

pub async fn health(State(engine): State<Arc<Engine>>) -> Response {
    let fault = engine.control().health.clone();
    if let Some(r) = control::apply(fault, "health").await {
        return r;
    }
    ().into_response()
}

fn disaggregation_mode(role: Role) -> &'static str {
    match role {
        Role::Plain => "null",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

pub async fn server_info(State(engine): State<Arc<Engine>>) -> Response {
    Json(json!({
        "model_path": engine.model,
        "served_model_name": engine.model,
        "tokenizer_path": engine.model,
        "disaggregation_mode": disaggregation_mode(engine.role),
        "disaggregation_bootstrap_port": engine.bootstrap_port(),
        "dp_size": engine.args.dp_size,
        "tp_size": 1,
        "max_total_num_tokens": engine.args.kv_capacity,
        "max_running_requests": engine.args.max_running,
        "is_generation": true,
        "version": concat!("sgl-sim ", env!("CARGO_PKG_VERSION")),
        "sim_engine": engine.id,
    }))
    .into_response()
}

pub async fn model_info(State(engine): State<Arc<Engine>>) -> Response {
    Json(json!({
        "model_path": engine.model,
        "tokenizer_path": engine.model,
        "is_generation": true,
        "sim_engine": engine.id,
    }))
    .into_response()
}

pub async fn models(State(engine): State<Arc<Engine>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{"id": engine.model, "object": "model", "created": 0, "owned_by": "sgl-sim", "root": engine.model}],
    }))
    .into_response()
}

/// As SGLang's: drops the prefix cache, and says so on the event stream.
pub async fn flush_cache(State(engine): State<Arc<Engine>>) -> Response {
    for cache in &engine.caches {
        cache.clear();
    }
    for events in &engine.events {
        events.cleared();
    }
    "Cache flushed.".into_response()
}
