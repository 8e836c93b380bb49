//! The query API (spec §7, Mooncake KV-indexer conventions): `POST /query` with token ids,
//! `POST /v1/prefix/match` with a client's chat body (rendered and tokenized here), the filter's
//! `POST /v1/prefix/routed` notice, a replica's `GET /v1/snapshot`, `GET /health`, `GET /metrics`.
//! Queries are read-only; the one write path bounds what it adds; with a token configured every
//! POST (and the snapshot) needs it. Malformed input is a 400, never a crash; a panic is the 500 of
//! its own request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use sgl_envoy_router::protocol::indexer::{
    EngineEntry, MatchAnswer, Query, RoutedNotice, MATCH_PATH, MAX_INDEXER_BODY_BYTES, QUERY_PATH,
    ROUTED_NOTICE_HEADER, ROUTED_PATH,
};

use crate::events::Medium;
use crate::index::EngineMatch;
use crate::replicas::{ClaimRequest, Registration, CLAIM_PATH, HANDLES_PATH};
use crate::state::{App, Routed};
use crate::timing::{Clock, Phase};
use crate::tokenize::TokenizeError;
use tower_http::catch_panic::{CatchPanicLayer, ResponseForPanic};

/// Chat bodies up to this size are tokenized on the async worker that read them (a first encode
/// of this many bytes takes about a millisecond); larger ones on a blocking thread.
pub const INLINE_TOKENIZE_BYTES: usize = 16 << 10;

/// A running indexer's whole view (`sgl-indexer --peer`).
pub const SNAPSHOT_PATH: &str = "/v1/snapshot";

/// Request bodies accepted at most (spec §7); the filter routes a larger request on the estimate
/// without asking.
pub const MAX_BODY_BYTES: usize = MAX_INDEXER_BODY_BYTES;

/// The query API with its guards: every POST needs the configured token, bodies over
/// [`MAX_BODY_BYTES`] get 413, matching waits for one of `app`'s work permits no longer than the
/// filter waits for its answer, and a panic answers 500 for its request alone (counted).
pub fn router(app: Arc<App>) -> Router {
    let panics = Arc::clone(&app.stats.panics);
    let writes = Router::new()
        .route(QUERY_PATH, post(query))
        .route(MATCH_PATH, post(prefix_match))
        .route(ROUTED_PATH, post(routed))
        // The whole view, for a replica starting after this one: as privileged as a write.
        .route(SNAPSHOT_PATH, get(snapshot))
        // Replicas agreeing claims and handles (see `replicas`).
        .route(CLAIM_PATH, post(peer_claim))
        .route(HANDLES_PATH, post(peer_handles))
        .route_layer(axum::middleware::from_fn_with_state(Arc::clone(&app), require_token));
    Router::new()
        .merge(writes)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(catch_panics(panics))
        .with_state(app)
}

/// Answers a request whose handler panicked with a 500, and counts it.
fn catch_panics(panics: Arc<AtomicU64>) -> CatchPanicLayer<PanicAnswer> {
    CatchPanicLayer::custom(PanicAnswer(panics))
}

#[derive(Debug, Clone)]
struct PanicAnswer(Arc<AtomicU64>);

impl ResponseForPanic for PanicAnswer {
    type ResponseBody = axum::body::Body;

    fn response_for_panic(&mut self, _: Box<dyn std::any::Any + Send + 'static>) -> Response {
        self.0.fetch_add(1, Ordering::Relaxed);
        let body = json!({"error": {"message": "internal error", "type": "internal_error", "code": 500}});
        (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
    }
}

/// With `prefix_index.token` configured, a POST without it (in `token_header`) is refused.
async fn require_token(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    if !app.authorized(request.headers()) {
        app.stats.unauthorized.fetch_add(1, Ordering::Relaxed);
        if request.uri().path() == ROUTED_PATH {
            app.stats.routed_refused.fetch_add(1, Ordering::Relaxed);
        }
        return (StatusCode::UNAUTHORIZED, "missing or wrong token").into_response();
    }
    next.run(request).await
}

/// A permit for matching work, waited for until the caller's deadline; `Err` answers 503.
async fn permit(app: &App, deadline: Instant) -> Result<tokio::sync::SemaphorePermit<'_>, Response> {
    let wait = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(wait, app.work.acquire()).await {
        Ok(Ok(permit)) => Ok(permit),
        _ => {
            app.stats.shed.fetch_add(1, Ordering::Relaxed);
            Err(error(app, StatusCode::SERVICE_UNAVAILABLE, "busy: no capacity before the caller's deadline"))
        }
    }
}

fn error(app: &App, status: StatusCode, message: impl Into<String>) -> Response {
    if status.is_client_error() {
        app.stats.bad_queries.fetch_add(1, Ordering::Relaxed);
    }
    let message = message.into();
    (status, Json(json!({"error": {"message": message, "type": "invalid_request", "code": status.as_u16()}})))
        .into_response()
}

/// The answer's shape is the filter's own ([`MatchAnswer`]): every engine's entry by id.
fn answer(input_tokens: Option<u64>, matches: Vec<(String, EngineMatch)>, handle: u64) -> MatchAnswer {
    let data = matches
        .into_iter()
        .map(|(worker, m)| {
            let ranks = m.ranks.iter().map(|(r, t)| (r.to_string(), *t)).collect();
            let held = |medium: Medium| m.by_medium.iter().find(|(x, _)| *x == medium).map_or(0, |(_, t)| *t);
            let entry = EngineEntry {
                matched_tokens: m.matched_tokens,
                confirmed_tokens: m.confirmed_tokens,
                gpu: Some(held(Medium::Gpu)),
                cpu_pinned: held(Medium::CpuPinned),
                disk: held(Medium::Disk),
                external: held(Medium::External),
                ranks,
            };
            (worker, entry)
        })
        .collect();
    MatchAnswer { input_tokens, data, handle: Some(handle.to_string()) }
}

/// Only the matches of a caller that promises routed notices open claims (see `claims`).
fn will_notify(headers: &HeaderMap) -> bool {
    headers.get(ROUTED_NOTICE_HEADER).is_some_and(|v| v.as_bytes() == b"1")
}

async fn query(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let deadline = app.deadline();
    let q: Query<'_> = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("not a query: {e}")),
    };
    if !app.serves(&q.model) {
        return error(&app, StatusCode::NOT_FOUND, format!("model `{}` is not configured", q.model));
    }
    let _permit = match permit(&app, deadline).await {
        Ok(p) => p,
        Err(busy) => return busy,
    };
    let (lora, salt) = (q.lora_name.as_deref(), q.cache_salt.as_deref());
    match app.match_tokens(&q.model, &q.token_ids, lora, salt, will_notify(&headers)).await {
        Some((matches, handle)) => Json(answer(None, matches, handle)).into_response(),
        None => error(&app, StatusCode::NOT_FOUND, format!("model `{}` has no index", q.model)),
    }
}

async fn prefix_match(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let deadline = app.deadline();
    let mut clock = Clock::default();
    let chat: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return error(&app, StatusCode::BAD_REQUEST, "the body must be a JSON object"),
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}")),
    };
    let Some(model) = chat.get("model").and_then(Value::as_str).map(str::to_string) else {
        return error(&app, StatusCode::BAD_REQUEST, "`model` is required");
    };
    clock.lap(Phase::Parse);
    let _permit = match permit(&app, deadline).await {
        Ok(p) => p,
        Err(busy) => return busy,
    };
    let (worker_app, worker_model) = (Arc::clone(&app), model.clone());
    let tokenize = move || {
        clock.lap(Phase::Queue);
        let tokens = worker_app.tokenize_chat(&worker_model, &chat, Some(deadline), &mut clock);
        (tokens, chat, clock)
    };
    // A long prompt's tokenizing is CPU work: off the async workers, so events and routed notices
    // keep flowing. A short one costs less than the hand-off to a blocking thread and back.
    let tokenized =
        if body.len() <= INLINE_TOKENIZE_BYTES { Ok(tokenize()) } else { tokio::task::spawn_blocking(tokenize).await };
    let (tokens, chat, mut clock) = match tokenized {
        Ok((Ok(t), chat, clock)) => (t, chat, clock),
        Ok((Err(e), _, _)) => {
            if matches!(e, TokenizeError::Abandoned) {
                app.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            }
            return error(&app, e.status(), e.to_string());
        }
        Err(e) => {
            if e.is_panic() {
                app.stats.panics.fetch_add(1, Ordering::Relaxed);
            }
            return error(&app, StatusCode::INTERNAL_SERVER_ERROR, "the tokenizer failed on this request");
        }
    };
    // Handing the answer back to an async worker is queueing too.
    clock.lap(Phase::Queue);
    let salt = chat.get("cache_salt").and_then(Value::as_str);
    let lora = chat.get("lora_path").and_then(Value::as_str);
    let Some((matches, handle)) = app.match_tokens(&model, &tokens, lora, salt, will_notify(&headers)).await else {
        return error(&app, StatusCode::NOT_FOUND, format!("model `{model}` has no index"));
    };
    clock.lap(Phase::Match);
    let answer = serde_json::to_vec(&answer(Some(tokens.len() as u64), matches, handle));
    clock.lap(Phase::Answer);
    app.stats.phases.add(&clock);
    match answer {
        Ok(body) => {
            let headers = [("content-type", "application/json".to_string()), ("server-timing", clock.server_timing())];
            (headers, body).into_response()
        }
        Err(e) => error(&app, StatusCode::INTERNAL_SERVER_ERROR, format!("the answer did not encode: {e}")),
    }
}

async fn routed(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let notice: RoutedNotice<'_> = match serde_json::from_slice(&body) {
        Ok(n) => n,
        Err(e) => return error(&app, StatusCode::BAD_REQUEST, format!("not a routed notice: {e}")),
    };
    match notice.handle.parse::<u64>().map(|h| app.routed(h, &notice.worker, notice.dp_rank)) {
        Ok(Routed::Applied) => StatusCode::NO_CONTENT.into_response(),
        Ok(Routed::Pending) => StatusCode::ACCEPTED.into_response(),
        _ => {
            app.stats.routed_refused.fetch_add(1, Ordering::Relaxed);
            (StatusCode::NOT_FOUND, "unknown or expired handle, or a worker of another model").into_response()
        }
    }
}

async fn peer_claim(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match serde_json::from_slice::<ClaimRequest>(&body) {
        Ok(request) if app.serves(&request.model) => Json(app.arbitrate_for_peer(request)).into_response(),
        Ok(request) => error(&app, StatusCode::NOT_FOUND, format!("model `{}` is not configured", request.model)),
        Err(e) => error(&app, StatusCode::BAD_REQUEST, format!("not a claim: {e}")),
    }
}

async fn peer_handles(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Vec<Registration>>(&body) {
        Ok(registrations) => Json(json!({"added": app.register_handles(registrations)})).into_response(),
        Err(e) => error(&app, StatusCode::BAD_REQUEST, format!("not registrations: {e}")),
    }
}

async fn snapshot(State(app): State<Arc<App>>) -> Response {
    // Encoding walks the whole index: off the async workers.
    match tokio::task::spawn_blocking(move || app.snapshot().encode()).await {
        Ok(bytes) => ([("content-type", "application/msgpack")], bytes).into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "the snapshot failed").into_response(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt;

    fn test_app(token: bool) -> Arc<App> {
        let token = if token { r#", "token_header": "x-indexer-token", "token": "s3cret""# } else { "" };
        let config = sgl_envoy_router::config::parse_and_validate(&format!(
            r#"{{"workers": [{{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}}],
                "prefix_index": {{"url": "http://127.0.0.1:9", "block_tokens": 4, "timeout_ms": 20{token}}},
                "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "cache_aware", "source": "remote"}}}}}}}}]}}}}}}"#
        ))
        .unwrap();
        Arc::new(App::new(config, crate::state::MemoryBudget::new(64 << 20, 0)))
    }

    async fn send(router: Router, path: &str, body: Vec<u8>, token: Option<&str>) -> StatusCode {
        let mut request = Request::post(path).header("content-type", "application/json");
        if let Some(t) = token {
            request = request.header("x-indexer-token", t);
        }
        router.oneshot(request.body(Body::from(body)).unwrap()).await.unwrap().status()
    }

    fn query() -> Vec<u8> {
        json!({"model": "m", "token_ids": [1, 2, 3, 4]}).to_string().into_bytes()
    }

    /// Only the routed notice checked the token: anyone could open claims, or make the indexer
    /// tokenize for them.
    #[tokio::test]
    async fn with_a_token_every_post_needs_it() {
        let app = test_app(true);
        let notice = json!({"handle": "1", "worker": "A"}).to_string().into_bytes();
        for (path, body) in [("/query", query()), ("/v1/prefix/match", b"{}".to_vec()), ("/v1/prefix/routed", notice)] {
            assert_eq!(
                send(router(Arc::clone(&app)), path, body.clone(), None).await,
                StatusCode::UNAUTHORIZED,
                "{path}"
            );
            let wrong = send(router(Arc::clone(&app)), path, body.clone(), Some("s3cres")).await;
            assert_eq!(wrong, StatusCode::UNAUTHORIZED, "{path}");
            assert_ne!(send(router(Arc::clone(&app)), path, body, Some("s3cret")).await, StatusCode::UNAUTHORIZED);
        }
        assert_eq!(app.stats.unauthorized.load(Ordering::Relaxed), 6);
        let health = Request::get("/health").body(Body::empty()).unwrap();
        assert_ne!(router(Arc::clone(&app)).oneshot(health).await.unwrap().status(), StatusCode::UNAUTHORIZED);
        assert_eq!(send(router(test_app(false)), "/query", query(), None).await, StatusCode::OK, "no token configured");
    }

    #[tokio::test]
    async fn bodies_over_four_mib_get_413_and_at_the_limit_are_read() {
        let app = test_app(false);
        let mut at_limit = query();
        at_limit.resize(MAX_BODY_BYTES, b' ');
        assert_eq!(send(router(Arc::clone(&app)), "/query", at_limit, None).await, StatusCode::OK);
        let mut over = query();
        over.resize(MAX_BODY_BYTES + 1, b' ');
        assert_eq!(send(router(app), "/query", over, None).await, StatusCode::PAYLOAD_TOO_LARGE);
    }

    /// Work is bounded: a query that finds every permit taken waits no longer than the filter
    /// would for its answer, then is refused and counted.
    #[tokio::test]
    async fn a_query_waits_for_capacity_until_its_deadline_then_is_shed() {
        let app = Arc::new(Arc::into_inner(test_app(false)).unwrap().with_max_concurrent(1));
        let held = app.work.acquire().await.unwrap();
        let started = Instant::now();
        assert_eq!(send(router(Arc::clone(&app)), "/query", query(), None).await, StatusCode::SERVICE_UNAVAILABLE);
        assert!(started.elapsed() >= std::time::Duration::from_millis(20));
        assert_eq!(app.stats.shed.load(Ordering::Relaxed), 1);
        drop(held);
        assert_eq!(send(router(app), "/query", query(), None).await, StatusCode::OK);
    }

    /// With `panic = "abort"` a panic anywhere ended the process. Now it is its request's 500.
    #[tokio::test]
    async fn a_panic_is_its_own_requests_500_and_is_counted() {
        let app = test_app(false);
        let panicking: Router = Router::new()
            .route("/boom", post(|| async { panic!("a tokenizer bug") as StatusCode }))
            .layer(catch_panics(Arc::clone(&app.stats.panics)));
        let r = router(Arc::clone(&app)).merge(panicking);
        assert_eq!(send(r.clone(), "/boom", vec![], None).await, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(send(r, "/query", query(), None).await, StatusCode::OK, "the next request is served");
        assert_eq!(app.stats.panics.load(Ordering::Relaxed), 1);
    }
}
