//! The three load endpoints (spec §5): `/v1/loads` (native), `/get_load` and `/metrics` (basic).
//! Counts are the engine's real ones unless the control endpoint pinned them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::control;
use crate::engine::Engine;

struct Snapshot {
    running: u64,
    waiting: u64,
    kv_used: u64,
    waiting_uncached: u64,
}

fn snapshot(engine: &Engine) -> Snapshot {
    let pinned = engine.control().pinned.clone().unwrap_or_default();
    Snapshot {
        running: pinned.running.unwrap_or_else(|| engine.running.load(Ordering::SeqCst)),
        waiting: pinned.waiting.unwrap_or_else(|| engine.waiting.load(Ordering::SeqCst)),
        kv_used: pinned.kv_tokens.unwrap_or_else(|| engine.kv_used.load(Ordering::SeqCst)),
        waiting_uncached: pinned
            .waiting_uncached_tokens
            .unwrap_or_else(|| engine.waiting_uncached_tokens.load(Ordering::SeqCst)),
    }
}

/// Splits a total over the ranks so that the ranks add up to it exactly.
fn share(total: u64, rank: u32, ranks: u32) -> u64 {
    let ranks = u64::from(ranks.max(1));
    let rank = u64::from(rank);
    total / ranks + u64::from(rank < total % ranks)
}

async fn load_fault(engine: &Engine) -> Option<Response> {
    let fault = engine.control().loads.clone();
    control::apply(fault, "load endpoint").await
}

pub async fn v1_loads(State(engine): State<Arc<Engine>>) -> Response {
    if let Some(r) = load_fault(&engine).await {
        return r;
    }
    let s = snapshot(&engine);
    let ranks = engine.args.dp_size.max(1);
    let pinned = engine.control().pinned.is_some();
    let loads: Vec<_> = (0..ranks)
        .map(|r| {
            // Each rank's own requests, unless the control endpoint pinned the engine's totals.
            let (running, waiting) =
                if pinned { (share(s.running, r, ranks), share(s.waiting, r, ranks)) } else { engine.rank_load(r) };
            json!({
                "dp_rank": r,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_used_tokens": share(s.kv_used, r, ranks),
                "max_total_num_tokens": share(engine.args.kv_capacity, r, ranks),
                "max_running_requests": share(engine.args.max_running as u64, r, ranks),
                "num_waiting_uncached_tokens": share(s.waiting_uncached, r, ranks),
                "total_prefill_uncached_tokens": share(engine.prefill_tokens_total.load(Ordering::SeqCst), r, ranks),
                "total_prefill_busy_us": share(engine.prefill_busy_us_total.load(Ordering::SeqCst), r, ranks),
            })
        })
        .collect();
    Json(json!({"timestamp_ms": Engine::now_unix_ms(), "loads": loads})).into_response()
}

pub async fn get_load(State(engine): State<Arc<Engine>>) -> Response {
    if let Some(r) = load_fault(&engine).await {
        return r;
    }
    let s = snapshot(&engine);
    let ranks = engine.args.dp_size.max(1);
    let pinned = engine.control().pinned.is_some();
    let loads: Vec<_> = (0..ranks)
        .map(|r| {
            let (running, waiting) =
                if pinned { (share(s.running, r, ranks), share(s.waiting, r, ranks)) } else { engine.rank_load(r) };
            json!({
                "dp_rank": r,
                "num_reqs": running,
                "num_waiting_reqs": waiting,
                "num_tokens": share(s.kv_used, r, ranks),
            })
        })
        .collect();
    Json(loads).into_response()
}

/// Cached / prompt tokens over the engine's life.
pub fn hit_rate(engine: &Engine) -> f64 {
    let (cached, total) = engine.cache_totals();
    if total == 0 {
        0.0
    } else {
        cached as f64 / total as f64
    }
}

pub async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    if let Some(r) = load_fault(&engine).await {
        return r;
    }
    let s = snapshot(&engine);
    let capacity = engine.args.kv_capacity.max(1);
    let usage = s.kv_used as f64 / capacity as f64;
    let labels = format!("model_name=\"{}\",engine=\"{}\"", engine.model, engine.id);
    let mut text = String::new();
    for (name, kind, value) in [
        ("sglang:num_running_reqs", "gauge", s.running.to_string()),
        ("sglang:num_queue_reqs", "gauge", s.waiting.to_string()),
        ("sglang:num_used_tokens", "gauge", s.kv_used.to_string()),
        ("sglang:max_total_num_tokens", "gauge", capacity.to_string()),
        ("sglang:token_usage", "gauge", format!("{usage:.6}")),
        ("sglang:prompt_tokens_total", "counter", engine.prefill_tokens_total.load(Ordering::SeqCst).to_string()),
        ("sglang:cache_hit_rate", "gauge", format!("{:.6}", hit_rate(&engine))),
    ] {
        text.push_str(&format!("# HELP {name} simulated\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
