//! Parsers for the three load endpoints of spec §5. A field that is absent stays `None`: unknown
//! is never read as zero.

use serde_json::Value;

/// Native reports (`/v1/loads`) feed pressure comparisons; basic ones feed admission only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportKind {
    Native,
    Basic,
}

/// One data-parallel rank's report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankReport {
    pub dp_rank: u32,
    pub running: Option<u64>,
    pub waiting: Option<u64>,
    pub kv_used: Option<u64>,
    pub kv_capacity: Option<u64>,
    /// Fraction of the KV cache in use, when only that is reported (Prometheus).
    pub kv_usage: Option<f64>,
    pub max_running: Option<u64>,
    pub waiting_uncached_tokens: Option<u64>,
    /// Cumulative counters; two samples give prefill throughput.
    pub prefill_tokens_total: Option<u64>,
    pub prefill_busy_us_total: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("load report is not JSON: {0}")]
    Json(String),
    #[error("load report has an unexpected shape: {0}")]
    Shape(&'static str),
}

fn field(v: &Value, name: &str) -> Option<u64> {
    let n = v.get(name)?;
    n.as_u64().or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

fn rank(v: &Value, fallback: usize) -> u32 {
    field(v, "dp_rank").and_then(|r| u32::try_from(r).ok()).unwrap_or(u32::try_from(fallback).unwrap_or(u32::MAX))
}

/// `GET /v1/loads` → `{"loads": [{dp_rank, num_running_reqs, …}]}`.
pub fn parse_v1_loads(body: &[u8]) -> Result<Vec<RankReport>, ReportError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ReportError::Json(e.to_string()))?;
    let loads = v.get("loads").and_then(Value::as_array).ok_or(ReportError::Shape("no `loads` array"))?;
    Ok(loads
        .iter()
        .enumerate()
        .map(|(i, l)| RankReport {
            dp_rank: rank(l, i),
            running: field(l, "num_running_reqs"),
            waiting: field(l, "num_waiting_reqs"),
            kv_used: field(l, "num_used_tokens"),
            kv_capacity: field(l, "max_total_num_tokens"),
            kv_usage: None,
            max_running: field(l, "max_running_requests"),
            waiting_uncached_tokens: field(l, "num_waiting_uncached_tokens"),
            prefill_tokens_total: field(l, "total_prefill_uncached_tokens"),
            prefill_busy_us_total: field(l, "total_prefill_busy_us"),
        })
        .collect())
}

/// `GET /get_load` → `[{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]`.
pub fn parse_get_load(body: &[u8]) -> Result<Vec<RankReport>, ReportError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ReportError::Json(e.to_string()))?;
    let loads = v.as_array().ok_or(ReportError::Shape("not an array"))?;
    Ok(loads
        .iter()
        .enumerate()
        .map(|(i, l)| RankReport {
            dp_rank: rank(l, i),
            running: field(l, "num_reqs"),
            waiting: field(l, "num_waiting_reqs"),
            kv_used: field(l, "num_tokens"),
            ..RankReport::default()
        })
        .collect())
}

/// `GET /metrics` (Prometheus text) with SGLang's or vLLM's names. Samples of one metric with
/// different `dp_rank` labels are separate ranks; without the label all samples are rank 0.
pub fn parse_prometheus(body: &[u8]) -> Result<Vec<RankReport>, ReportError> {
    let text = std::str::from_utf8(body).map_err(|_| ReportError::Shape("metrics are not UTF-8"))?;
    let mut ranks: Vec<RankReport> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name_labels, value) = match line.rsplit_once(char::is_whitespace) {
            Some(p) => p,
            None => continue,
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let (name, labels) = match name_labels.split_once('{') {
            Some((n, l)) => (n.trim(), l.trim_end_matches('}')),
            None => (name_labels.trim(), ""),
        };
        let dp_rank = label(labels, "dp_rank").and_then(|r| r.parse::<u32>().ok()).unwrap_or(0);
        let report = match ranks.iter_mut().position(|r| r.dp_rank == dp_rank) {
            Some(i) => &mut ranks[i],
            None => {
                ranks.push(RankReport { dp_rank, ..RankReport::default() });
                let last = ranks.len() - 1;
                &mut ranks[last]
            }
        };
        let count = || (value >= 0.0).then_some(value as u64);
        match name {
            "sglang:num_running_reqs" | "vllm:num_requests_running" => report.running = count(),
            "sglang:num_queue_reqs" | "vllm:num_requests_waiting" => report.waiting = count(),
            "sglang:token_usage" | "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                report.kv_usage = Some(value.clamp(0.0, 1.0))
            }
            "sglang:num_used_tokens" => report.kv_used = count(),
            "sglang:max_total_num_tokens" => report.kv_capacity = count(),
            _ => {}
        }
    }
    if ranks.iter().all(|r| r.running.is_none() && r.waiting.is_none()) {
        return Err(ReportError::Shape("no running or waiting metric"));
    }
    // KV tokens from a usage fraction need a capacity metric; without one they stay unknown.
    for r in &mut ranks {
        if r.kv_used.is_none() {
            if let (Some(u), Some(c)) = (r.kv_usage, r.kv_capacity) {
                r.kv_used = Some((u * c as f64).round() as u64);
            }
        }
    }
    ranks.sort_by_key(|r| r.dp_rank);
    Ok(ranks)
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn v1_loads_keeps_every_field_and_leaves_missing_ones_unknown() {
        let body = br#"{"loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 100,
             "max_total_num_tokens": 1000, "max_running_requests": 64, "num_waiting_uncached_tokens": 40,
             "total_prefill_uncached_tokens": 5000, "total_prefill_busy_us": 250000},
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_used_tokens": 7, "max_total_num_tokens": 1000}
        ]}"#;
        let r = parse_v1_loads(body).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].running, r[0].waiting, r[0].kv_used, r[0].kv_capacity),
            (Some(3), Some(2), Some(100), Some(1000))
        );
        assert_eq!(r[0].waiting_uncached_tokens, Some(40));
        assert_eq!((r[0].prefill_tokens_total, r[0].prefill_busy_us_total), (Some(5000), Some(250000)));
        assert_eq!((r[1].dp_rank, r[1].waiting_uncached_tokens, r[1].prefill_tokens_total), (1, None, None));
    }

    #[test]
    fn get_load_maps_num_reqs_to_running() {
        let r = parse_get_load(br#"[{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 1, "num_tokens": 77}]"#).unwrap();
        assert_eq!((r[0].running, r[0].waiting, r[0].kv_used, r[0].kv_capacity), (Some(5), Some(1), Some(77), None));
    }

    #[test]
    fn prometheus_reads_sglang_names() {
        let text = b"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:token_usage{model_name=\"m\"} 0.25\n";
        let r = parse_prometheus(text).unwrap();
        assert_eq!((r[0].running, r[0].waiting, r[0].kv_usage, r[0].kv_used), (Some(4), Some(2), Some(0.25), None));
    }

    #[test]
    fn prometheus_kv_tokens_need_a_capacity_metric() {
        let text = b"sglang:num_running_reqs 1\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 1000\n";
        assert_eq!(parse_prometheus(text).unwrap()[0].kv_used, Some(500));
    }

    #[test]
    fn prometheus_reads_vllm_names_and_ranks() {
        let text = b"vllm:num_requests_running{dp_rank=\"0\"} 2\nvllm:num_requests_running{dp_rank=\"1\"} 3\nvllm:num_requests_waiting{dp_rank=\"1\"} 1\nvllm:kv_cache_usage_perc{dp_rank=\"0\"} 0.1\n";
        let r = parse_prometheus(text).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].running, r[0].waiting), (Some(2), None));
        assert_eq!((r[1].running, r[1].waiting), (Some(3), Some(1)));
    }

    #[test]
    fn garbage_is_an_error_not_zero_load() {
        assert!(parse_v1_loads(b"nope").is_err());
        assert!(parse_v1_loads(b"{}").is_err());
        assert!(parse_get_load(b"{}").is_err());
        assert!(parse_prometheus(b"other_metric 3\n").is_err());
    }
}
