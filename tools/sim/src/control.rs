//! The control endpoint: a test talking to the simulator directly pins the reported load or breaks
//! health, the load endpoints or chat, each on its own.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::engine::Engine;

/// Load values reported instead of the real ones while pinned.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinnedLoad {
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub kv_tokens: Option<u64>,
    pub waiting_uncached_tokens: Option<u64>,
}

/// How an endpoint misbehaves: answer `status`, after `delay_ms`, or never (`hang`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    #[serde(default)]
    pub status: Option<u16>,
    #[serde(default)]
    pub delay_ms: u64,
    #[serde(default)]
    pub hang: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Control {
    pub token_delay_ms: u64,
    /// Prefill engines: how long the prefill answer waits after its rooms are finished (the
    /// decode side can already generate).
    pub prefill_linger_ms: u64,
    pub pinned: Option<PinnedLoad>,
    pub health: Fault,
    pub loads: Fault,
    pub chat: Fault,
    default_token_delay_ms: u64,
}

impl Control {
    pub fn new(token_delay_ms: u64) -> Self {
        Self {
            token_delay_ms,
            prefill_linger_ms: 0,
            pinned: None,
            health: Fault::default(),
            loads: Fault::default(),
            chat: Fault::default(),
            default_token_delay_ms: token_delay_ms,
        }
    }
}

/// A partial update: every field present replaces the current one; `null` clears `pin`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlUpdate {
    #[serde(default)]
    reset: bool,
    token_delay_ms: Option<u64>,
    prefill_linger_ms: Option<u64>,
    #[serde(default, with = "double_option")]
    pin: Option<Option<PinnedLoad>>,
    health: Option<Fault>,
    loads: Option<Fault>,
    chat: Option<Fault>,
}

mod double_option {
    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de>,
    {
        Option::<T>::deserialize(d).map(Some)
    }
}

/// Takes the body as JSON whatever its content type, so a bare `curl -d` works.
pub async fn update(State(engine): State<Arc<Engine>>, body: axum::body::Bytes) -> Response {
    let update: ControlUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, Json(json!({"error": format!("bad control update: {e}")})))
                .into_response()
        }
    };
    let mut control = engine.control();
    if update.reset {
        *control = Control::new(control.default_token_delay_ms);
    }
    if let Some(d) = update.token_delay_ms {
        control.token_delay_ms = d;
    }
    if let Some(d) = update.prefill_linger_ms {
        control.prefill_linger_ms = d;
    }
    if let Some(pin) = update.pin {
        control.pinned = pin;
    }
    if let Some(f) = update.health {
        control.health = f;
    }
    if let Some(f) = update.loads {
        control.loads = f;
    }
    if let Some(f) = update.chat {
        control.chat = f;
    }
    Json(control.clone()).into_response()
}

pub async fn state(State(engine): State<Arc<Engine>>) -> Response {
    let recent = engine.recent.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Json(json!({
        "id": engine.id,
        "model": engine.model,
        "role": engine.role,
        "running": engine.running.load(Ordering::SeqCst),
        "waiting": engine.waiting.load(Ordering::SeqCst),
        "kv_used": engine.kv_used.load(Ordering::SeqCst),
        "served": engine.served.load(Ordering::SeqCst),
        "rooms_finished": engine.rooms.finished_count(),
        "cache": {
            "cached_tokens": engine.cache_totals().0,
            "prompt_tokens": engine.cache_totals().1,
            "hit_rate": crate::loads::hit_rate(&engine),
            "cached_blocks": engine.caches.iter().map(|c| c.cached_blocks()).sum::<u64>(),
        },
        "control": engine.control().clone(),
        "recent": recent,
        "aborts": engine.aborts.received(),
    }))
    .into_response()
}

/// Applies a fault before an endpoint answers. `Some` is the response to send instead.
pub async fn apply(fault: Fault, what: &str) -> Option<Response> {
    if fault.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(fault.delay_ms)).await;
    }
    if fault.hang {
        // Never answer; the future ends when the client gives up and the connection closes.
        std::future::pending::<()>().await;
    }
    let status = fault.status?;
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    Some(
        (
            code,
            Json(json!({"error": {"message": format!("simulated {what} failure"), "type": "SimulatedFault", "code": status}})),
        )
            .into_response(),
    )
}
