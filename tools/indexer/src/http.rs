//! The query API (spec §7, Mooncake KV-indexer conventions): `POST /query` with token ids,
//! `POST /v1/prefix/match` with a client's chat body (rendered and tokenized here), the filter's
//! `POST /v1/prefix/routed` notice, `GET /health`, `GET /metrics`. Queries are read-only; the one
//! write path checks the configured token and bounds what it adds. Malformed input is a 400, never
//! a crash.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use sgl_envoy_router::state::kv_events::remote::ROUTED_NOTICE_HEADER;

use crate::events::Medium;
use crate::index::EngineMatch;
use crate::state::App;

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/query", post(query))
        .route("/v1/prefix/match", post(prefix_match))
        .route("/v1/prefix/routed", post(routed))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(app)
}

fn error(app: &App, status: StatusCode, message: impl Into<String>) -> Response {
    app.stats.bad_queries.fetch_add(1, Ordering::Relaxed);
    let message = message.into();
    (status, Json(json!({"error": {"message": message, "type": "invalid_request", "code": status.as_u16()}})))
        .into_response()
}

/// `{"<worker>": {"matched_tokens", "confirmed_tokens", "GPU", "CPU_PINNED", "DISK", "EXTERNAL"}}`.
fn data(matches: &[(String, EngineMatch)]) -> Value {
    let mut out = Map::new();
    for (worker, m) in matches {
        let mut entry = Map::new();
        entry.insert("matched_tokens".into(), json!(m.matched_tokens));
        entry.insert("confirmed_tokens".into(), json!(m.confirmed_tokens));
        for medium in Medium::ALL {
            let tokens = m.by_medium.iter().find(|(x, _)| *x == medium).map_or(0, |(_, t)| *t);
            entry.insert(medium.as_str().into(), json!(tokens));
        }
        out.insert(worker.clone(), Value::Object(entry));
    }
    Value::Object(out)
}

#[derive(Debug, Deserialize)]
struct Query {
    model: String,
    token_ids: Vec<u32>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Only the matches of a caller that promises routed notices open claims (see `claims`).
fn will_notify(headers: &HeaderMap) -> bool {
    headers.get(ROUTED_NOTICE_HEADER).is_some_and(|v| v.as_bytes() == b"1")
}

async fn query(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let q: Query = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("not a query: {e}")),
    };
    if !app.serves(&q.model) {
        return error(&app, StatusCode::NOT_FOUND, format!("model `{}` is not configured", q.model));
    }
    let (lora, salt) = (q.lora_name.as_deref(), q.cache_salt.as_deref());
    match app.match_tokens(&q.model, &q.token_ids, lora, salt, will_notify(&headers)).await {
        Some((matches, handle)) => Json(json!({"data": data(&matches), "handle": handle.to_string()})).into_response(),
        None => error(&app, StatusCode::NOT_FOUND, format!("model `{}` has no index", q.model)),
    }
}

async fn prefix_match(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let chat: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return error(&app, StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}")),
    };
    let Some(model) = chat.get("model").and_then(Value::as_str).map(str::to_string) else {
        return error(&app, StatusCode::BAD_REQUEST, "`model` is required");
    };
    // Tokenizing is CPU work: off the async workers, so events and routed notices keep flowing.
    let (worker_app, worker_model) = (Arc::clone(&app), model.clone());
    let tokenized = tokio::task::spawn_blocking(move || {
        let tokens = worker_app.tokenize_chat(&worker_model, &chat);
        (tokens, chat)
    })
    .await;
    let (tokens, chat) = match tokenized {
        Ok((Ok(t), chat)) => (t, chat),
        Ok((Err(e), _)) => return error(&app, e.status(), e.to_string()),
        Err(e) => return error(&app, StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer task failed: {e}")),
    };
    let salt = chat.get("cache_salt").and_then(Value::as_str);
    let lora = chat.get("lora_path").and_then(Value::as_str);
    match app.match_tokens(&model, &tokens, lora, salt, will_notify(&headers)).await {
        Some((matches, handle)) => Json(json!({
            "input_tokens": tokens.len(),
            "data": data(&matches),
            "handle": handle.to_string(),
        }))
        .into_response(),
        None => error(&app, StatusCode::NOT_FOUND, format!("model `{model}` has no index")),
    }
}

#[derive(Debug, Deserialize)]
struct Routed {
    handle: String,
    worker: String,
}

async fn routed(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(index) = &app.config.prefix_index {
        if let (Some(header), Some(token)) = (&index.token_header, &index.token) {
            if headers.get(header.as_str()).and_then(|v| v.to_str().ok()) != Some(token.as_str()) {
                app.stats.routed_refused.fetch_add(1, Ordering::Relaxed);
                return (StatusCode::UNAUTHORIZED, "missing or wrong token").into_response();
            }
        }
    }
    let notice: Routed = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("not a routed notice: {e}")),
    };
    match notice.handle.parse::<u64>() {
        Ok(handle) if app.routed(handle, &notice.worker) => StatusCode::NO_CONTENT.into_response(),
        _ => {
            app.stats.routed_refused.fetch_add(1, Ordering::Relaxed);
            (StatusCode::NOT_FOUND, "unknown or expired handle, or a worker of another model").into_response()
        }
    }
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let (want, have) = (app.stats.subscriptions.load(Ordering::Relaxed), app.stats.subscribed.load(Ordering::Relaxed));
    if have >= want {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("subscribed to {have} of {want} engine ranks")).into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], app.metrics()).into_response()
}
