//! `translate`: an sglang-router 0.3.2 command line as a router configuration for one model.
//! What keeps its meaning carries over; every other option is refused by name, never ignored.

use serde_json::{json, Map, Value};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    #[error("`{flag}` is not supported: {why}")]
    Refused { flag: String, why: String },
    #[error("`{flag}`: {why}")]
    BadValue { flag: String, why: String },
    #[error("no workers: give --worker-urls, or --pd-disaggregation with --prefill and --decode")]
    NoWorkers,
}

fn refuse(flag: &str, why: &str) -> TranslateError {
    TranslateError::Refused { flag: flag.to_string(), why: why.to_string() }
}

fn bad(flag: &str, why: impl Into<String>) -> TranslateError {
    TranslateError::BadValue { flag: flag.to_string(), why: why.into() }
}

/// The result, plus notes for what belongs elsewhere (listener address, for instance) and every
/// option refused, each saying what to use instead. The configuration carries only what keeps its
/// meaning; with refusals it is not the same router, so the CLI prints it only when asked.
#[derive(Debug)]
pub struct Translation {
    pub config: Value,
    pub notes: Vec<String>,
    pub refused: Vec<TranslateError>,
}

const POLICIES: &[&str] = &["random", "round_robin", "power_of_two", "cache_aware", "load_based"];

/// Options design §7 dropped, and modes without a bucket-first design yet.
fn refused_reason(flag: &str, value: Option<&str>) -> Option<&'static str> {
    Some(match (flag, value) {
        ("--policy" | "--prefill-policy" | "--decode-policy", Some("fused_score" | "score_policy")) => {
            "fused-score selection was removed; choose one policy per group"
        }
        ("--decode-policy", Some("legacy_host_affinity")) => "legacy host affinity was removed",
        ("--policy" | "--prefill-policy" | "--decode-policy", Some("manual")) => {
            "manual routing-key assignment has different semantics; use a sticky policy in the router configuration"
        }
        ("--prefill-policy", Some("bucket")) => "length buckets are the router's own bucket list, not a prefill policy",
        ("--stable-pair", _) => "stable prefill/decode pairing was removed; both engines come from one bucket",
        ("--affinity-mode", _) => "only strict admitted-binding reuse remains",
        ("--filter", Some("prefix_cache")) | ("--prefix-cache-min-share", _) => {
            "the prefix-share filter was removed; it is not the cache_aware minimum hit"
        }
        _ if flag.starts_with("--fuse") => "fused-score terms and weights were removed with fused_score",
        _ if flag.starts_with("--slo") => "SLO ordering has no bucket-first design yet",
        _ if flag.starts_with("--session") || flag == "--global-session-mode" => {
            "global session modes need a bucket-first migration design"
        }
        _ => return None,
    })
}

/// Flags that are understood but cannot be reproduced faithfully.
fn unfaithful_reason(flag: &str) -> Option<&'static str> {
    Some(match flag {
        "--balance-abs-threshold" | "--balance-rel-threshold" => {
            "sglang-router's load-imbalance switch has no equivalent; cache_aware moves requests off busy holders by \
             their expected wait, and by pressure_guard.max_extra_waiting_requests / worker_queue_limit if set"
        }
        "--eviction-interval-secs" => "the prefix index evicts by LRU under its token budget, not on a timer",
        "--cb-success-threshold" | "--cb-window-duration-secs" => {
            "the circuit breaker counts consecutive failures and half-opens with one probe"
        }
        "--dp-aware" => "data-parallel-aware scheduling is not supported; give dp_size per worker",
        "--max-payload-size" => "the body limit is fixed at 32 MiB",
        "--enable-igw" | "--mini-lb" => "one router configuration serves every model; no mode switch is needed",
        "--max-concurrent-requests" | "--rate-limit-tokens-per-second" => {
            "a router-wide concurrency or token rate limit belongs to Envoy's local rate limit filter; per-engine \
             caps are admission limits (--max-in-flight)"
        }
        _ if flag.starts_with("--retry") => {
            "the router retries only a refused connection or a reset before response headers, at once, on the engine \
             the policy names next (retry.attempts, at most 4); it never retries an engine's 5xx"
        }
        _ => return None,
    })
}

struct Args<'a> {
    items: Vec<(&'a str, Vec<&'a str>)>,
}

/// Splits `--flag v1 v2 --other=v` into flags and their values.
fn split(args: &[String]) -> Result<Args<'_>, TranslateError> {
    let mut items: Vec<(&str, Vec<&str>)> = Vec::new();
    for arg in args {
        if let Some(flag) = arg.strip_prefix("--").map(|_| arg.as_str()) {
            match flag.split_once('=') {
                Some((f, v)) => items.push((f, vec![v])),
                None => items.push((flag, Vec::new())),
            }
        } else {
            match items.last_mut() {
                Some((_, values)) => values.push(arg),
                None => return Err(bad(arg, "expected an option starting with --")),
            }
        }
    }
    Ok(Args { items })
}

fn one<'a>(flag: &str, values: &[&'a str]) -> Result<&'a str, TranslateError> {
    match values {
        [v] => Ok(v),
        _ => Err(bad(flag, "takes exactly one value")),
    }
}

fn number(flag: &str, values: &[&str]) -> Result<f64, TranslateError> {
    one(flag, values)?.parse::<f64>().map_err(|_| bad(flag, "is not a number"))
}

fn seconds_ms(flag: &str, values: &[&str]) -> Result<u64, TranslateError> {
    let s = number(flag, values)?;
    if s < 0.0 {
        return Err(bad(flag, "must not be negative"));
    }
    Ok((s * 1000.0).round() as u64)
}

fn whole(flag: &str, values: &[&str]) -> Result<u64, TranslateError> {
    one(flag, values)?.parse::<u64>().map_err(|_| bad(flag, "is not a whole number"))
}

/// Every option is read: what cannot be carried over is collected in `refused`, not fatal.
/// `Err` is only for a command line that names no workers or cannot be split into options.
pub fn translate(model: &str, args: &[String]) -> Result<Translation, TranslateError> {
    let parsed = split(args)?;
    let mut refused = Vec::new();
    let mut notes = Vec::new();
    let mut plain_urls: Vec<String> = Vec::new();
    let mut prefills: Vec<(String, Option<u16>)> = Vec::new();
    let mut decodes: Vec<String> = Vec::new();
    let mut pd = false;
    let mut policy = "cache_aware".to_string();
    let (mut prefill_policy, mut decode_policy): (Option<String>, Option<String>) = (None, None);
    let mut cache = Map::new();
    let mut health = Map::new();
    let mut breaker = Some(Map::new());
    let mut timeouts = Map::new();
    let mut max_inflight: Option<u64> = None;
    let mut filter_overloaded = false;
    let mut retries_off = false;
    let mut queue = serde_json::Map::new();

    // A refused --decode-policy was still given: no second refusal for the default it replaces.
    let decode_given = parsed.items.iter().any(|(flag, _)| *flag == "--decode-policy");
    for (flag, values) in &parsed.items {
        let flag = *flag;
        let mut read = || -> Result<(), TranslateError> {
            if let Some(why) = refused_reason(flag, values.first().copied()) {
                return Err(refuse(flag, why));
            }
            if let Some(why) = unfaithful_reason(flag) {
                return Err(refuse(flag, why));
            }
            match flag {
                "--worker-urls" => plain_urls.extend(values.iter().map(|v| v.to_string())),
                "--pd-disaggregation" => pd = true,
                "--prefill" => match values.as_slice() {
                    [url] => prefills.push((url.to_string(), None)),
                    [url, port] if port.eq_ignore_ascii_case("none") => prefills.push((url.to_string(), None)),
                    [url, port] => prefills.push((
                        url.to_string(),
                        Some(port.parse().map_err(|_| bad(flag, "bootstrap port is not a port"))?),
                    )),
                    _ => return Err(bad(flag, "takes URL [BOOTSTRAP_PORT]")),
                },
                "--decode" => decodes.push(one(flag, values)?.to_string()),
                "--policy" | "--prefill-policy" | "--decode-policy" => {
                    let name = one(flag, values)?;
                    if !POLICIES.contains(&name) {
                        return Err(refuse(&format!("{flag} {name}"), "unknown policy"));
                    }
                    match flag {
                        "--policy" => policy = name.to_string(),
                        "--prefill-policy" => prefill_policy = Some(name.to_string()),
                        _ => decode_policy = Some(name.to_string()),
                    }
                }
                "--cache-threshold" => {
                    let t = number(flag, values)?;
                    // sglang-router's threshold is a match-ratio gate; 0 means no gate.
                    if t > 0.0 {
                        cache.insert("min_hit_ratio".into(), json!(t));
                    }
                    // It has no token minimum, so none is added.
                    cache.insert("min_hit_tokens".into(), json!(0));
                }
                "--max-tree-size" => {
                    // Counted in characters there; in tokens of 4 bytes here.
                    cache.insert("max_tree_tokens".into(), json!(whole(flag, values)?.div_ceil(4).max(1)));
                }
                "--max-in-flight" => max_inflight = Some(whole(flag, values)?),
                "--filter" => match one(flag, values)? {
                    "overloaded" => filter_overloaded = true,
                    other => return Err(refuse(&format!("--filter {other}"), "unknown filter")),
                },
                "--health-failure-threshold" => {
                    health.insert("failure_threshold".into(), json!(whole(flag, values)?));
                }
                "--health-success-threshold" => {
                    health.insert("success_threshold".into(), json!(whole(flag, values)?));
                }
                "--health-check-timeout-secs" => {
                    health.insert("timeout_ms".into(), json!(seconds_ms(flag, values)?));
                }
                "--health-check-interval-secs" => {
                    health.insert("interval_ms".into(), json!(seconds_ms(flag, values)?));
                }
                "--health-check-endpoint" => {
                    health.insert("path".into(), json!(one(flag, values)?));
                }
                "--request-timeout-secs" => {
                    timeouts.insert("request_ms".into(), json!(seconds_ms(flag, values)?));
                }
                "--cb-failure-threshold" => {
                    if let Some(b) = breaker.as_mut() {
                        b.insert("failure_threshold".into(), json!(whole(flag, values)?));
                    }
                }
                "--cb-timeout-duration-secs" => {
                    if let Some(b) = breaker.as_mut() {
                        b.insert("cooldown_ms".into(), json!(seconds_ms(flag, values)?));
                    }
                }
                "--disable-circuit-breaker" => breaker = None,
                "--disable-retries" => retries_off = true,
                "--queue-size" => match whole(flag, values)? {
                    // sglang-router's 0: no queue.
                    0 => {}
                    n => {
                        queue.insert("max_requests".into(), json!(n));
                    }
                },
                "--queue-timeout-secs" => {
                    queue.insert("max_wait_ms".into(), json!(seconds_ms(flag, values)?));
                }
                "--host" | "--port" => notes.push(format!(
                    "{flag} {}: the listener is Envoy's; pass it to `render --listen`",
                    values.join(" ")
                )),
                other => return Err(refuse(other, "unknown option, or one this router cannot reproduce")),
            }
            Ok(())
        };
        if let Err(e) = read() {
            refused.push(e);
        }
    }

    if filter_overloaded && max_inflight.is_none() {
        refused.push(bad("--filter overloaded", "needs --max-in-flight N"));
    }
    let mut admission = Map::new();
    if let Some(n) = max_inflight {
        admission.insert("max_inflight_requests".into(), json!(n));
    }
    let group_policy = |name: &str| -> Value {
        let mut p = Map::new();
        p.insert("type".into(), json!(name));
        if !admission.is_empty() {
            p.insert("admission".into(), Value::Object(admission.clone()));
        }
        if name == "cache_aware" {
            for (k, v) in &cache {
                p.insert(k.clone(), v.clone());
            }
        }
        Value::Object(p)
    };

    let mut workers = Vec::new();
    let groups = if pd || !prefills.is_empty() || !decodes.is_empty() {
        if !plain_urls.is_empty() {
            return Err(bad("--worker-urls", "cannot be mixed with --prefill/--decode (one model is plain or PD)"));
        }
        if prefills.is_empty() || decodes.is_empty() {
            return Err(TranslateError::NoWorkers);
        }
        for (i, (url, port)) in prefills.iter().enumerate() {
            let mut w = json!({"id": format!("prefill-{i}"), "url": url, "model": model, "role": "prefill"});
            if let Some(p) = port {
                w["bootstrap_port"] = json!(p);
            }
            workers.push(w);
        }
        for (i, url) in decodes.iter().enumerate() {
            workers.push(json!({"id": format!("decode-{i}"), "url": url, "model": model, "role": "decode"}));
        }
        let mut decode_name = decode_policy.clone().unwrap_or_else(|| policy.clone());
        if decode_name == "cache_aware" && (decode_policy.is_some() || !decode_given) {
            refused.push(refuse(
                if decode_policy.is_some() { "--decode-policy cache_aware" } else { "--policy cache_aware" },
                "cache_aware is valid only for prefill; give --decode-policy (e.g. power_of_two)",
            ));
            decode_name = "power_of_two".to_string();
        }
        json!({"pd": {
            "prefill": {"policy": group_policy(prefill_policy.as_deref().unwrap_or(&policy))},
            "decode": {"policy": group_policy(&decode_name)},
        }})
    } else {
        if plain_urls.is_empty() {
            return Err(TranslateError::NoWorkers);
        }
        if prefill_policy.is_some() || decode_policy.is_some() {
            refused.push(bad("--prefill-policy/--decode-policy", "apply only with --pd-disaggregation"));
        }
        for (i, url) in plain_urls.iter().enumerate() {
            workers.push(json!({"id": format!("worker-{i}"), "url": url, "model": model, "role": "plain"}));
        }
        json!({"plain": {"policy": group_policy(&policy)}})
    };

    let mut config = json!({
        "workers": workers,
        "models": {model: {"buckets": [{"id": "default", "groups": groups}]}},
    });
    if !health.is_empty() {
        config["health"] = Value::Object(health);
    }
    if let Some(b) = breaker {
        // sglang-router's breaker is on by default (10 failures, 60 s).
        let mut b = b;
        b.entry("failure_threshold").or_insert(json!(10));
        b.entry("cooldown_ms").or_insert(json!(60_000));
        config["circuit_breaker"] = Value::Object(b);
    }
    if !timeouts.is_empty() {
        config["timeouts"] = Value::Object(timeouts);
    }
    if retries_off {
        config["retry"] = json!({"attempts": 0});
    }
    if queue.contains_key("max_requests") {
        notes.push(
            "--queue-size: sglang-router queues behind its router-wide concurrency limit; here a request waits \
             when every engine's admission refuses it, so give engines caps (--max-in-flight)"
                .to_string(),
        );
        config["queue"] = Value::Object(queue);
    }
    Ok(Translation { config, notes, refused })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    /// A translation that validates.
    fn valid(s: &str) -> Value {
        let t = translate("m", &args(s)).unwrap();
        assert!(t.refused.is_empty(), "{:?}", t.refused);
        sgl_envoy_router::config::from_value(t.config.clone()).unwrap_or_else(|e| panic!("{e}"));
        t.config
    }

    /// A translation the filter accepts.
    fn ok(s: &str) -> Value {
        valid(s)
    }

    fn refused(s: &str, flag: &str) {
        let t = translate("m", &args(s)).unwrap();
        match t.refused.as_slice() {
            [TranslateError::Refused { flag: f, .. }] => assert!(f.contains(flag), "{f} vs {flag}"),
            other => panic!("{s}: expected one refusal, of {flag}, got {other:?}"),
        }
    }

    #[test]
    fn plain_workers_and_policy_carry_over() {
        let c = ok("--worker-urls http://a:1 http://b:2 --policy round_robin");
        assert_eq!(c["workers"].as_array().unwrap().len(), 2);
        assert_eq!(c["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["type"], "round_robin");
    }

    #[test]
    fn disabled_retries_carry_over_and_sglangs_retry_tuning_is_refused() {
        let c = ok("--worker-urls http://a:1 --disable-retries");
        assert_eq!(c["retry"]["attempts"], 0);
        assert!(ok("--worker-urls http://a:1").get("retry").is_none(), "the default: one retry");
        refused("--worker-urls http://a:1 --retry-max-retries 3", "--retry-max-retries");
    }

    #[test]
    fn load_based_and_power_of_two_are_kept() {
        for p in ["load_based", "power_of_two", "random"] {
            let c = ok(&format!("--worker-urls http://a:1 --policy {p}"));
            assert_eq!(c["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["type"], p);
        }
    }

    #[test]
    fn queue_size_and_timeout_become_the_queue() {
        let c = valid("--worker-urls http://a:1 --max-in-flight 2 --queue-size 64 --queue-timeout-secs 2.5");
        assert_eq!(c["queue"], json!({"max_requests": 64, "max_wait_ms": 2500}));
        let c = valid("--worker-urls http://a:1 --queue-size 0 --queue-timeout-secs 3");
        assert!(c.get("queue").is_none(), "sglang-router's 0 is no queue");
    }

    #[test]
    fn max_in_flight_and_filter_overloaded_become_max_inflight_requests() {
        let c = ok("--worker-urls http://a:1 --policy round_robin --max-in-flight 32 --filter overloaded");
        assert_eq!(
            c["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["admission"]["max_inflight_requests"],
            32
        );
        assert_eq!(translate("m", &args("--worker-urls http://a:1 --filter overloaded")).unwrap().refused.len(), 1);
    }

    #[test]
    fn pd_lists_with_bootstrap_ports_carry_over() {
        let c = ok("--pd-disaggregation --prefill http://p1:30000 9000 --prefill http://p2:30000 none --decode http://d1:30001 --prefill-policy round_robin --decode-policy power_of_two");
        let w = c["workers"].as_array().unwrap();
        assert_eq!((w[0]["role"].as_str(), w[0]["bootstrap_port"].as_u64()), (Some("prefill"), Some(9000)));
        assert_eq!(w[1].get("bootstrap_port"), None);
        assert_eq!(w[2]["role"], "decode");
        let g = &c["models"]["m"]["buckets"][0]["groups"]["pd"];
        assert_eq!(
            (g["prefill"]["policy"]["type"].as_str(), g["decode"]["policy"]["type"].as_str()),
            (Some("round_robin"), Some("power_of_two"))
        );
    }

    #[test]
    fn health_timeouts_and_breaker_knobs_keep_their_meaning() {
        let c = ok("--worker-urls http://a:1 --policy random --health-failure-threshold 4 --health-check-interval-secs 5 --health-check-endpoint /healthz --request-timeout-secs 600 --cb-failure-threshold 7 --cb-timeout-duration-secs 30");
        assert_eq!(
            (c["health"]["failure_threshold"].as_u64(), c["health"]["interval_ms"].as_u64()),
            (Some(4), Some(5000))
        );
        assert_eq!(c["health"]["path"], "/healthz");
        assert_eq!(c["timeouts"]["request_ms"], 600_000);
        assert_eq!(
            (c["circuit_breaker"]["failure_threshold"].as_u64(), c["circuit_breaker"]["cooldown_ms"].as_u64()),
            (Some(7), Some(30_000))
        );
        let c = ok("--worker-urls http://a:1 --policy random --disable-circuit-breaker");
        assert!(c.get("circuit_breaker").is_none());
    }

    #[test]
    fn dropped_options_are_refused_by_name() {
        refused("--worker-urls http://a:1 --policy fused_score", "--policy");
        refused("--worker-urls http://a:1 --policy score_policy", "--policy");
        refused(
            "--pd-disaggregation --prefill http://p:1 --decode http://d:1 --decode-policy legacy_host_affinity",
            "--decode-policy",
        );
        refused("--worker-urls http://a:1 --stable-pair", "--stable-pair");
        refused("--worker-urls http://a:1 --affinity-mode soft", "--affinity-mode");
        refused("--worker-urls http://a:1 --filter prefix_cache", "--filter");
        refused("--worker-urls http://a:1 --prefix-cache-min-share 0.5", "--prefix-cache-min-share");
        refused("--worker-urls http://a:1 --fuse-weights 1,2", "--fuse-weights");
    }

    #[test]
    fn slo_session_and_unknown_options_are_refused_by_name() {
        refused("--worker-urls http://a:1 --slo-ttft-ms 200", "--slo-ttft-ms");
        refused("--worker-urls http://a:1 --session-mode global", "--session-mode");
        refused("--worker-urls http://a:1 --frobnicate", "--frobnicate");
        refused("--worker-urls http://a:1 --balance-abs-threshold 32", "--balance-abs-threshold");
        refused("--worker-urls http://a:1 --policy manual", "--policy");
    }

    #[test]
    fn cache_aware_maps_its_ratio_and_refuses_decode_use() {
        let c = valid("--worker-urls http://a:1 --cache-threshold 0.5 --max-tree-size 4096");
        let p = &c["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"];
        assert_eq!(
            (p["type"].as_str(), p["min_hit_ratio"].as_f64(), p["max_tree_tokens"].as_u64()),
            (Some("cache_aware"), Some(0.5), Some(1024))
        );
        refused("--pd-disaggregation --prefill http://p:1 --decode http://d:1", "--policy cache_aware");
    }

    #[test]
    fn a_typical_cache_aware_command_line_lists_every_refusal_and_keeps_the_rest() {
        let t = translate(
            "m",
            &args(
                "--worker-urls http://a:1 http://b:2 --policy cache_aware --cache-threshold 0.3 \
                 --balance-abs-threshold 32 --balance-rel-threshold 1.5 --eviction-interval-secs 60 \
                 --max-tree-size 67108864 --health-check-interval-secs 10 --request-timeout-secs 1800 \
                 --host 0.0.0.0 --port 30000 --frobnicate 1",
            ),
        )
        .unwrap();
        let flags: Vec<String> = t
            .refused
            .iter()
            .map(|e| match e {
                TranslateError::Refused { flag, .. } | TranslateError::BadValue { flag, .. } => flag.clone(),
                TranslateError::NoWorkers => String::new(),
            })
            .collect();
        assert_eq!(
            flags,
            ["--balance-abs-threshold", "--balance-rel-threshold", "--eviction-interval-secs", "--frobnicate"]
        );
        assert!(t.refused.iter().all(|e| e.to_string().len() > 40), "each says what to use instead");
        let c = &t.config;
        let p = &c["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"];
        assert_eq!((p["type"].as_str(), p["min_hit_ratio"].as_f64()), (Some("cache_aware"), Some(0.3)));
        assert_eq!(
            (c["health"]["interval_ms"].as_u64(), c["timeouts"]["request_ms"].as_u64()),
            (Some(10_000), Some(1_800_000))
        );
        assert_eq!(t.notes.len(), 2, "host and port go to render --listen");
        sgl_envoy_router::config::from_value(t.config.clone()).unwrap();
    }

    #[test]
    fn host_and_port_become_notes() {
        let t = translate("m", &args("--worker-urls http://a:1 --policy random --host 0.0.0.0 --port 8000")).unwrap();
        assert_eq!(t.notes.len(), 2);
    }
}
