//! Prefill/decode hand-off. A prefill engine finishes a bootstrap room when it serves the prefill
//! request for it and answers on its bootstrap port when a room is done; a decode engine waits
//! there for its rooms before it generates, and fails clearly after a timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Notify;

use crate::engine::Engine;

/// Finished rooms are remembered for a bounded number of rooms.
const REMEMBERED_ROOMS: usize = 100_000;

#[derive(Default)]
pub struct Rooms {
    finished: Mutex<(HashMap<u64, u64>, VecDeque<u64>)>,
    changed: Notify,
}

impl Rooms {
    pub fn finish(&self, room: u64) {
        {
            let mut guard = self.finished.lock().unwrap_or_else(|p| p.into_inner());
            let (map, order) = &mut *guard;
            if map.insert(room, Engine::now_unix_ms()).is_none() {
                order.push_back(room);
                if order.len() > REMEMBERED_ROOMS {
                    if let Some(old) = order.pop_front() {
                        map.remove(&old);
                    }
                }
            }
        }
        self.changed.notify_waiters();
    }

    fn is_finished(&self, room: u64) -> bool {
        self.finished.lock().unwrap_or_else(|p| p.into_inner()).0.contains_key(&room)
    }

    pub fn finished_count(&self) -> usize {
        self.finished.lock().unwrap_or_else(|p| p.into_inner()).0.len()
    }

    async fn wait(&self, room: u64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_finished(room) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.is_finished(room);
            }
        }
    }
}

#[derive(Deserialize)]
struct WaitQuery {
    timeout_ms: Option<u64>,
}

pub fn bootstrap_router(engine: Arc<Engine>) -> Router {
    Router::new().route("/sim/bootstrap/{room}", get(wait_room)).with_state(engine)
}

async fn wait_room(State(engine): State<Arc<Engine>>, Path(room): Path<u64>, Query(q): Query<WaitQuery>) -> Response {
    let timeout = Duration::from_millis(q.timeout_ms.unwrap_or(30_000));
    if engine.rooms.wait(room, timeout).await {
        Json(json!({"room": room, "prefill_engine": engine.id})).into_response()
    } else {
        (StatusCode::REQUEST_TIMEOUT, Json(json!({"error": format!("room {room} was not prefilled on {}", engine.id)})))
            .into_response()
    }
}

/// Rooms named by a PD request: one integer, or an array of them (one per choice when `n > 1`).
pub fn rooms_of(body: &serde_json::Value) -> Vec<u64> {
    match body.get("bootstrap_room") {
        Some(serde_json::Value::Number(n)) => n.as_u64().into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(serde_json::Value::as_u64).collect(),
        _ => Vec::new(),
    }
}

/// Where each room's prefill engine is: `bootstrap_host`/`bootstrap_port` are one value for all
/// rooms, or arrays with one entry per room.
pub fn targets_of(body: &serde_json::Value, rooms: &[u64]) -> Option<Vec<(String, u64, u64)>> {
    let nth = |field: &str, i: usize| -> Option<serde_json::Value> {
        match body.get(field)? {
            serde_json::Value::Array(a) => a.get(i).cloned(),
            v => Some(v.clone()),
        }
    };
    rooms
        .iter()
        .enumerate()
        .map(|(i, room)| {
            let host = nth("bootstrap_host", i)?.as_str()?.to_string();
            Some((host, nth("bootstrap_port", i)?.as_u64()?, *room))
        })
        .collect()
}

/// The decode side: waits until each room's prefill engine finished it.
pub async fn await_prefill(engine: &Engine, targets: &[(String, u64, u64)]) -> Result<(), String> {
    let timeout_ms = engine.args.bootstrap_timeout_ms;
    for (host, port, room) in targets {
        let host_part = if host.contains(':') { format!("[{host}]") } else { host.to_string() };
        let url = format!("http://{host_part}:{port}/sim/bootstrap/{room}?timeout_ms={timeout_ms}");
        let response =
            engine.client.get(&url).timeout(Duration::from_millis(timeout_ms + 2_000)).send().await.map_err(|e| {
                format!("KV transfer failed: bootstrap server {host}:{port} unreachable for room {room}: {e}")
            })?;
        if !response.status().is_success() {
            return Err(format!(
                "KV transfer failed: room {room} was not prefilled by {host}:{port} within {timeout_ms} ms"
            ));
        }
    }
    Ok(())
}
