//! One timed request, and the statistics over many.

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::{json, Value};

use crate::workload::Request;

#[derive(Debug, Clone)]
pub struct Sample {
    pub ok: bool,
    pub status: u16,
    /// Time to the first generated content (or the whole answer when not streaming).
    pub ttft_ms: f64,
    /// Mean gap between content chunks after the first.
    pub itl_ms: Option<f64>,
    pub e2e_ms: f64,
    pub chunks: u64,
    /// The request's class (see `Request::class`).
    pub class: &'static str,
}

pub async fn send(client: &reqwest::Client, url: &str, request: &Request, stream: bool) -> Sample {
    let started = Instant::now();
    let mut body = request.body.clone();
    body["stream"] = json!(stream);
    let mut builder = client.post(url).json(&body);
    for (k, v) in &request.headers {
        builder = builder.header(k, v);
    }
    let failed = |status: u16| Sample {
        ok: false,
        status,
        ttft_ms: 0.0,
        itl_ms: None,
        e2e_ms: started.elapsed().as_secs_f64() * 1e3,
        chunks: 0,
        class: "",
    };
    let response = match builder.send().await {
        Ok(r) => r,
        Err(_) => return failed(0),
    };
    let status = response.status().as_u16();
    if !response.status().is_success() {
        let _ = response.bytes().await;
        return failed(status);
    }
    if !stream {
        let ok = response.bytes().await.is_ok();
        let ms = started.elapsed().as_secs_f64() * 1e3;
        return Sample { ok, status, ttft_ms: ms, itl_ms: None, e2e_ms: ms, chunks: 1, class: "" };
    }
    let mut first: Option<f64> = None;
    let mut last = 0.0;
    let mut chunks = 0u64;
    let mut done = false;
    let mut buffer: Vec<u8> = Vec::new();
    let mut bytes = response.bytes_stream();
    while let Some(piece) = bytes.next().await {
        let Ok(piece) = piece else { return failed(status) };
        buffer.extend_from_slice(&piece);
        // SSE events end with a blank line; parse whole events only (chunks may split them).
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let has_content = serde_json::from_str::<Value>(data)
                .ok()
                .and_then(|v| v["choices"][0]["delta"]["content"].as_str().map(|c| !c.is_empty()))
                .unwrap_or(false);
            if has_content {
                let now = started.elapsed().as_secs_f64() * 1e3;
                first.get_or_insert(now);
                last = now;
                chunks += 1;
            }
        }
    }
    let e2e = started.elapsed().as_secs_f64() * 1e3;
    let ttft = first.unwrap_or(e2e);
    let itl = (chunks > 1).then(|| (last - ttft) / (chunks - 1) as f64);
    Sample { ok: done, status, ttft_ms: ttft, itl_ms: itl, e2e_ms: e2e, chunks, class: "" }
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted.get(rank.min(sorted.len() - 1)).copied()
}

fn stats(mut values: Vec<f64>) -> Value {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let mean = if values.is_empty() { None } else { Some(values.iter().sum::<f64>() / values.len() as f64) };
    json!({"p50": percentile(&values, 50.0), "p90": percentile(&values, 90.0), "p99": percentile(&values, 99.0), "mean": mean})
}

/// `slo_ttft_ms`: goodput counts the completed requests whose first token came within it.
/// `slo_ttft_ms` gives each sample's TTFT SLO (none: goodput is not counted).
pub fn summarize(samples: &[Sample], elapsed_s: f64, slo_ttft_ms: &dyn Fn(&Sample) -> Option<f64>) -> Value {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let judged = samples.iter().any(|s| slo_ttft_ms(s).is_some());
    let within = judged.then(|| ok.iter().filter(|s| slo_ttft_ms(s).is_some_and(|slo| s.ttft_ms <= slo)).count());
    let mut by_status = std::collections::BTreeMap::<String, u64>::new();
    for s in samples.iter().filter(|s| !s.ok) {
        *by_status.entry(if s.status == 0 { "connection".to_string() } else { s.status.to_string() }).or_default() += 1;
    }
    json!({
        "errors_by_status": by_status,
        "requests": samples.len(),
        "succeeded": ok.len(),
        "errors": samples.len() - ok.len(),
        "requests_per_s": ok.len() as f64 / elapsed_s.max(1e-9),
        "within_slo": within,
        "goodput_per_s": within.map(|n| n as f64 / elapsed_s.max(1e-9)),
        "output_chunks_per_s": ok.iter().map(|s| s.chunks).sum::<u64>() as f64 / elapsed_s.max(1e-9),
        "ttft_ms": stats(ok.iter().map(|s| s.ttft_ms).collect()),
        "itl_ms": stats(ok.iter().filter_map(|s| s.itl_ms).collect()),
        "e2e_ms": stats(ok.iter().map(|s| s.e2e_ms).collect()),
    })
}

/// Cached / prompt tokens over the simulators, read from their `/sim/state`.
pub async fn cache_hit_rate(client: &reqwest::Client, sims: &[String]) -> Value {
    let (mut cached, mut prompt) = (0u64, 0u64);
    for base in sims {
        if let Ok(r) = client.get(format!("{base}/sim/state")).send().await {
            if let Ok(v) = r.json::<Value>().await {
                cached += v["cache"]["cached_tokens"].as_u64().unwrap_or(0);
                prompt += v["cache"]["prompt_tokens"].as_u64().unwrap_or(0);
            }
        }
    }
    json!({"cached_tokens": cached, "prompt_tokens": prompt, "hit_rate": if prompt == 0 { None } else { Some(cached as f64 / prompt as f64) }})
}
