//! Semantic checks that serde cannot express. Each check names the field it is about; all errors
//! are collected so an operator fixes a configuration in one pass.

use std::collections::{HashMap, HashSet};

use super::{
    AdmissionLimits, CacheSourceKind, ConfigError, GroupConfig, GroupsConfig, HoldForPrefix, LoadSource, PolicyConfig,
    QueueConfig, RouterConfig, UpstreamMode, MAX_CLASS_PRIORITY, MAX_NAMESPACE_BYTES, MAX_QUEUE_CLASSES,
    MAX_QUEUE_REQUESTS, MAX_QUEUE_WAIT_MS, MAX_RETRY_ATTEMPTS,
};
use crate::registry::EngineAddress;
use crate::registry::Role;

/// Indexer replicas at most: each gets every routed notice, so the count multiplies the filter's
/// notice traffic.
pub const MAX_INDEXERS: usize = 8;

pub(super) fn validate(config: &RouterConfig) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    validate_namespace(config.namespace.as_deref(), &mut errors);
    let workers = validate_workers(config, &mut errors);
    validate_sections(config, &mut errors);
    validate_prefix_index(config, &mut errors);
    validate_models(config, &workers, &mut errors);
    errors
}

/// A namespace is a plugin name's characters (Istio's are `<namespace>.<name>`), at most
/// [`MAX_NAMESPACE_BYTES`] of them; the empty one names no prefix.
pub fn validate_namespace(namespace: Option<&str>, errors: &mut Vec<ConfigError>) {
    let Some(ns) = namespace else { return };
    if ns.len() > MAX_NAMESPACE_BYTES {
        errors.push(ConfigError::new("namespace", format!("{} bytes; at most {MAX_NAMESPACE_BYTES}", ns.len())));
    } else if !ns.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) {
        errors.push(ConfigError::new("namespace", format!("`{ns}`: only letters, digits, `_`, `.` and `-`")));
    }
}

fn validate_workers<'a>(config: &'a RouterConfig, errors: &mut Vec<ConfigError>) -> HashMap<&'a str, (&'a str, Role)> {
    let mut by_id = HashMap::new();
    let mut clusters = HashSet::new();
    if config.workers.is_empty() {
        errors.push(ConfigError::new("workers", "at least one worker is required"));
    }
    for (i, w) in config.workers.iter().enumerate() {
        let path = format!("workers[{i}]");
        if w.id.trim().is_empty() {
            errors.push(ConfigError::new(format!("{path}.id"), "must not be empty"));
        } else if by_id.insert(w.id.as_str(), (w.model.as_str(), w.role)).is_some() {
            errors.push(ConfigError::new(format!("{path}.id"), format!("duplicate worker id `{}`", w.id)));
        }
        if let Err(e) = EngineAddress::parse(&w.url) {
            errors.push(ConfigError::new(format!("{path}.url"), e.to_string()));
        }
        if w.model.trim().is_empty() {
            errors.push(ConfigError::new(format!("{path}.model"), "must not be empty"));
        } else if !config.models.contains_key(&w.model) {
            errors.push(ConfigError::new(
                format!("{path}.model"),
                format!("model `{}` is not configured under `models`", w.model),
            ));
        }
        if w.bootstrap_port.is_some() && w.role != Role::Prefill {
            errors
                .push(ConfigError::new(format!("{path}.bootstrap_port"), "only prefill workers have a bootstrap port"));
        }
        if w.dp_size == 0 {
            errors.push(ConfigError::new(format!("{path}.dp_size"), "must be at least 1"));
        }
        let cluster = w.cluster_name();
        if !is_cluster_name(&cluster) {
            errors.push(ConfigError::new(
                format!("{path}.cluster"),
                format!("`{cluster}` is not a usable Envoy cluster name (letters, digits, `_`, `-`, `.`)"),
            ));
        } else if !clusters.insert(cluster.clone()) {
            errors.push(ConfigError::new(format!("{path}.cluster"), format!("duplicate cluster `{cluster}`")));
        }
    }
    validate_model_roles(config, errors);
    by_id
}

/// The registry keeps plain and PD engines apart within one model (design §7).
fn validate_model_roles(config: &RouterConfig, errors: &mut Vec<ConfigError>) {
    let mut first_plain: HashMap<&str, usize> = HashMap::new();
    let mut first_pd: HashMap<&str, usize> = HashMap::new();
    for (i, w) in config.workers.iter().enumerate() {
        match w.role {
            Role::Plain => first_plain.entry(&w.model).or_insert(i),
            Role::Prefill | Role::Decode => first_pd.entry(&w.model).or_insert(i),
        };
    }
    for (model, plain) in &first_plain {
        if let Some(pd) = first_pd.get(model) {
            let i = plain.max(pd);
            errors.push(ConfigError::new(
                format!("workers[{i}].role"),
                format!("model `{model}` mixes plain and prefill/decode engines (workers[{plain}] and workers[{pd}])"),
            ));
        }
    }
}

/// Spec §7: the indexer's address, limits and token, and every worker's event endpoints.
fn validate_prefix_index(config: &RouterConfig, errors: &mut Vec<ConfigError>) {
    for (i, w) in config.workers.iter().enumerate() {
        for (field, value) in [("kv_events", &w.kv_events), ("kv_events_replay", &w.kv_events_replay)] {
            if let Some(endpoint) = value {
                if let Err(e) = tcp_endpoint(endpoint) {
                    errors.push(ConfigError::new(format!("workers[{i}].{field}"), e));
                }
            }
        }
        if w.kv_events_replay.is_some() && w.kv_events.is_none() {
            errors.push(ConfigError::new(
                format!("workers[{i}].kv_events_replay"),
                "a replay endpoint repairs the event stream of `kv_events`, which is not set",
            ));
        }
    }
    let Some(index) = &config.prefix_index else { return };
    match (&index.url, index.urls.len()) {
        (None, 0) => errors.push(ConfigError::new("prefix_index.urls", "set `url` or `urls` (one indexer at least)")),
        (Some(_), n) if n > 0 => {
            errors.push(ConfigError::new("prefix_index.urls", "set `url` (one indexer) or `urls`, not both"))
        }
        (None, n) if n > MAX_INDEXERS => {
            errors.push(ConfigError::new("prefix_index.urls", format!("{n} indexers; at most {MAX_INDEXERS}")))
        }
        _ => {}
    }
    if let Some(url) = &index.url {
        if let Err(e) = EngineAddress::parse(url) {
            errors.push(ConfigError::new("prefix_index.url", e.to_string()));
        }
    }
    let mut seen = HashSet::new();
    for (i, url) in index.urls.iter().enumerate() {
        match EngineAddress::parse(url) {
            Err(e) => errors.push(ConfigError::new(format!("prefix_index.urls[{i}]"), e.to_string())),
            Ok(a) if !seen.insert(a.host_port()) => {
                errors.push(ConfigError::new(format!("prefix_index.urls[{i}]"), format!("`{url}` is listed twice")))
            }
            Ok(_) => {}
        }
    }
    if !is_cluster_name(&index.cluster) {
        errors.push(ConfigError::new(
            "prefix_index.cluster",
            format!("`{}` is not a usable Envoy cluster name (letters, digits, `_`, `-`, `.`)", index.cluster),
        ));
    }
    for endpoint in index.endpoints() {
        if config.workers.iter().any(|w| w.cluster_name() == endpoint.cluster) {
            errors.push(ConfigError::new(
                "prefix_index.cluster",
                format!("`{}` is already a worker's cluster", endpoint.cluster),
            ));
        }
    }
    positive(errors, "prefix_index.timeout_ms", index.timeout_ms);
    positive(errors, "prefix_index.max_concurrent", index.max_concurrent);
    positive(errors, "prefix_index.block_tokens", index.block_tokens);
    match (&index.token_header, &index.token) {
        (Some(h), Some(_)) if !is_header_name(h) => errors
            .push(ConfigError::new("prefix_index.token_header", format!("`{h}` is not a lowercase HTTP header name"))),
        (Some(_), None) => errors.push(ConfigError::new("prefix_index.token", "token_header needs a token")),
        (None, Some(_)) => errors.push(ConfigError::new("prefix_index.token_header", "token needs a token_header")),
        _ => {}
    }
}

/// `tcp://HOST:PORT`, the form SGLang's publisher is reached at.
fn tcp_endpoint(endpoint: &str) -> Result<(), String> {
    let rest =
        endpoint.strip_prefix("tcp://").ok_or_else(|| format!("`{endpoint}` is not a tcp://HOST:PORT endpoint"))?;
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => Ok(()),
        _ => Err(format!("`{endpoint}` is not a tcp://HOST:PORT endpoint")),
    }
}

fn validate_sections(config: &RouterConfig, errors: &mut Vec<ConfigError>) {
    let header = config.upstream.header_name();
    if !is_header_name(header) {
        errors.push(ConfigError::new("upstream.header", format!("`{header}` is not a lowercase HTTP header name")));
    }
    if config.load.source != LoadSource::None {
        positive(errors, "load.interval_ms", config.load.interval_ms);
        positive(errors, "load.timeout_ms", config.load.timeout_ms);
        positive(errors, "load.stale_after_ms", config.load.stale_after_ms);
    }
    let rate = config.load.prefill_tokens_per_s;
    if !(rate.is_finite() && rate > 0.0) {
        errors.push(ConfigError::new("load.prefill_tokens_per_s", format!("must be a positive number, not {rate}")));
    }
    let h = &config.health;
    if !h.path.starts_with('/') {
        errors.push(ConfigError::new("health.path", "must start with `/`"));
    }
    positive(errors, "health.interval_ms", h.interval_ms);
    positive(errors, "health.timeout_ms", h.timeout_ms);
    positive(errors, "health.failure_threshold", u64::from(h.failure_threshold));
    positive(errors, "health.success_threshold", u64::from(h.success_threshold));
    if let Some(cb) = &config.circuit_breaker {
        positive(errors, "circuit_breaker.failure_threshold", u64::from(cb.failure_threshold));
        positive(errors, "circuit_breaker.cooldown_ms", cb.cooldown_ms);
    }
    positive(errors, "pd.prefill_timeout_ms", config.pd.prefill_timeout_ms);
    positive(errors, "tokens.bytes_per_token", config.tokens.bytes_per_token);
    positive(errors, "affinity_sweep_ms", config.affinity_sweep_ms);
    if let Some(queue) = &config.queue {
        validate_queue("queue", queue, config, errors);
    }
    validate_upstream(config, errors);
    if let Some(attempts) = config.retry.attempts {
        if attempts > MAX_RETRY_ATTEMPTS {
            errors.push(ConfigError::new("retry.attempts", format!("at most {MAX_RETRY_ATTEMPTS}, got {attempts}")));
        }
        if attempts > 0 && config.upstream.mode == UpstreamMode::OriginalDst {
            errors.push(ConfigError::new(
                "retry.attempts",
                "retries need `upstream.mode: cluster_header` or `override_host` (an ORIGINAL_DST cluster sends a retry to the same host); set 0",
            ));
        }
    }
}

/// `override_host` names each engine by its `IP:port` on one cluster: an engine named by DNS has
/// no address Envoy's host map knows, and a worker's own cluster would be bypassed.
fn validate_upstream(config: &RouterConfig, errors: &mut Vec<ConfigError>) {
    let upstream = &config.upstream;
    if upstream.header.as_deref().is_some_and(str::is_empty) {
        errors.push(ConfigError::new("upstream.header", "must not be empty"));
    }
    if upstream.mode != UpstreamMode::OverrideHost {
        if upstream.cluster.is_some() {
            errors.push(ConfigError::new("upstream.cluster", "only with `mode: override_host`"));
        }
        return;
    }
    if upstream.cluster.as_deref().is_some_and(str::is_empty) {
        errors.push(ConfigError::new("upstream.cluster", "must not be empty"));
    }
    for (i, w) in config.workers.iter().enumerate() {
        if EngineAddress::parse(&w.url).is_ok_and(|a| a.socket().is_none()) {
            errors.push(ConfigError::new(
                format!("workers[{i}].url"),
                format!("`{}`: `upstream.mode: override_host` names engines by IP address and port", w.url),
            ));
        }
        if w.cluster.is_some() {
            errors.push(ConfigError::new(
                format!("workers[{i}].cluster"),
                "every engine is reached through `upstream.cluster` with `mode: override_host`",
            ));
        }
    }
}

fn validate_models(config: &RouterConfig, workers: &HashMap<&str, (&str, Role)>, errors: &mut Vec<ConfigError>) {
    if config.models.is_empty() {
        errors.push(ConfigError::new("models", "at least one model is required"));
    }
    let generate: Vec<&str> = config.models.iter().filter(|(_, m)| m.serve_generate).map(|(n, _)| n.as_str()).collect();
    if generate.len() > 1 {
        let mut names = generate;
        names.sort_unstable();
        for name in &names[1..] {
            errors.push(ConfigError::new(
                format!("models.{name}.serve_generate"),
                format!("only one model can serve /generate; `{}` already does", names[0]),
            ));
        }
    }
    for (name, model) in &config.models {
        let path = format!("models.{name}");
        if name.trim().is_empty() {
            errors.push(ConfigError::new(&path, "model name must not be empty"));
        }
        for (field, value) in
            [("session_id_header", &model.session_id_header), ("routing_key_header", &model.routing_key_header)]
        {
            if !is_header_name(value) {
                errors.push(ConfigError::new(
                    format!("{path}.{field}"),
                    format!("`{value}` is not a lowercase HTTP header name"),
                ));
            }
        }
        positive(errors, &format!("{path}.session_idle_ms"), model.session_idle_ms);
        if let Some(queue) = &model.queue {
            validate_queue(&format!("{path}.queue"), queue, config, errors);
        }
        positive(errors, &format!("{path}.sticky_idle_ms"), model.sticky_idle_ms);
        if model.buckets.is_empty() {
            errors.push(ConfigError::new(format!("{path}.buckets"), "at least one bucket is required"));
        }
        let model_is_pd = config.workers.iter().any(|w| w.model == *name && w.role != Role::Plain);
        let mut ids = HashSet::new();
        for (b, bucket) in model.buckets.iter().enumerate() {
            let bpath = format!("{path}.buckets[{b}]");
            if bucket.id.trim().is_empty() {
                errors.push(ConfigError::new(format!("{bpath}.id"), "must not be empty"));
            } else if !ids.insert(bucket.id.as_str()) {
                errors.push(ConfigError::new(format!("{bpath}.id"), format!("duplicate bucket id `{}`", bucket.id)));
            }
            if let Some(max) = bucket.limits.max {
                if max < bucket.limits.min {
                    errors.push(ConfigError::new(
                        format!("{bpath}.limits"),
                        format!("max ({max}) is below min ({})", bucket.limits.min),
                    ));
                }
            }
            if bucket.max_context_tokens == Some(0) {
                errors.push(ConfigError::new(format!("{bpath}.max_context_tokens"), "must be at least 1"));
            }
            let mut ctx = GroupCheck { config, model: name, workers, errors: &mut *errors };
            match &bucket.groups {
                GroupsConfig::Plain(group) => {
                    if model_is_pd {
                        ctx.errors.push(ConfigError::new(
                            format!("{bpath}.groups.plain"),
                            format!("model `{name}` is served by prefill/decode engines; its buckets need `pd` groups"),
                        ));
                    }
                    ctx.check(&format!("{bpath}.groups.plain"), group, Role::Plain);
                }
                GroupsConfig::Pd(pd) => {
                    if !model_is_pd {
                        ctx.errors.push(ConfigError::new(
                            format!("{bpath}.groups.pd"),
                            format!("model `{name}` is served by plain engines; its buckets need a `plain` group"),
                        ));
                    }

                    ctx.check(&format!("{bpath}.groups.pd.prefill"), &pd.prefill, Role::Prefill);
                    ctx.check(&format!("{bpath}.groups.pd.decode"), &pd.decode, Role::Decode);
                }
            }
        }
    }
}

struct GroupCheck<'a, 'e> {
    config: &'a RouterConfig,
    model: &'a str,
    workers: &'a HashMap<&'a str, (&'a str, Role)>,
    errors: &'e mut Vec<ConfigError>,
}

impl GroupCheck<'_, '_> {
    fn check(&mut self, path: &str, group: &GroupConfig, role: Role) {
        if let Some(ids) = &group.worker_ids {
            let mut seen = HashSet::new();
            for (i, id) in ids.iter().enumerate() {
                let wpath = format!("{path}.worker_ids[{i}]");
                if !seen.insert(id) {
                    self.errors.push(ConfigError::new(&wpath, format!("`{id}` is listed twice")));
                }
                match self.workers.get(id.as_str()) {
                    None => self.errors.push(ConfigError::new(&wpath, format!("unknown worker `{id}`"))),
                    Some((model, _)) if *model != self.model => self.errors.push(ConfigError::new(
                        &wpath,
                        format!("worker `{id}` serves model `{model}`, not `{}`", self.model),
                    )),
                    Some((_, r)) if *r != role => self.errors.push(ConfigError::new(
                        &wpath,
                        format!("worker `{id}` has role {}, this group needs {}", r.as_str(), role.as_str()),
                    )),
                    Some(_) => {}
                }
            }
        }
        self.check_policy(&format!("{path}.policy"), &group.policy, role);
    }

    fn check_policy(&mut self, path: &str, policy: &PolicyConfig, role: Role) {
        if let PolicyConfig::CacheAware(c) = policy {
            if role == Role::Decode {
                self.errors.push(ConfigError::new(
                    format!("{path}.type"),
                    "cache_aware is valid only in plain and prefill groups",
                ));
            }
            for (field, ratio) in [
                ("min_hit_ratio", c.min_hit_ratio),
                ("candidate_ratio", c.candidate_ratio),
                ("saturation_floor", c.saturation_floor),
            ] {
                if let Some(r) = ratio {
                    if !(r > 0.0 && r <= 1.0) {
                        self.errors.push(ConfigError::new(format!("{path}.{field}"), "must be in (0, 1]"));
                    }
                }
            }
            if c.min_candidates == 0 {
                self.errors.push(ConfigError::new(format!("{path}.min_candidates"), "must be at least 1"));
            }
            if c.max_candidates == Some(0) {
                self.errors.push(ConfigError::new(format!("{path}.max_candidates"), "must be at least 1"));
            }
            if let Some(max) = c.max_candidates {
                if c.min_candidates > max {
                    self.errors.push(ConfigError::new(
                        format!("{path}.min_candidates"),
                        format!("min_candidates ({}) is above max_candidates ({max})", c.min_candidates),
                    ));
                }
            }
            if c.saturation_floor.is_some() && c.worker_queue_limit.is_none() {
                self.errors.push(ConfigError::new(
                    format!("{path}.saturation_floor"),
                    "applies only when holders are past the soft queue gate: set worker_queue_limit too",
                ));
            }
            if let Some(guard) = &c.pressure_guard {
                if guard.max_extra_waiting_requests.is_none() && guard.max_extra_running_requests.is_none() {
                    self.errors.push(ConfigError::new(
                        format!("{path}.pressure_guard"),
                        "an empty pressure guard checks nothing: set max_extra_waiting_requests or max_extra_running_requests",
                    ));
                }
            }
            if c.min_load_choices == 0 {
                self.errors.push(ConfigError::new(format!("{path}.min_load_choices"), "must be at least 1"));
            }
            positive(self.errors, &format!("{path}.max_tree_tokens"), c.max_tree_tokens);
            if c.hold_for_prefix == HoldForPrefix::Always && c.source == CacheSourceKind::Remote {
                self.errors.push(ConfigError::new(
                    format!("{path}.hold_for_prefix"),
                    "holds on when the router itself sent a prefix: `always` only with `source: local`",
                ));
            }
            if c.source == CacheSourceKind::Remote && self.config.prefix_index.is_none() {
                self.errors.push(ConfigError::new(
                    format!("{path}.source"),
                    "`remote` matches on the indexer's answer: configure `prefix_index`",
                ));
            }
        }
        self.check_admission(&format!("{path}.admission"), policy.admission());
    }

    /// A cap the load source cannot supply would never be checked; refuse it instead.
    fn check_admission(&mut self, path: &str, limits: &AdmissionLimits) {
        let source = self.config.load.source;
        let reported = [
            ("max_running_requests", limits.max_running_requests, source != LoadSource::None),
            ("max_waiting_requests", limits.max_waiting_requests, source != LoadSource::None),
            (
                "max_kv_tokens",
                limits.max_kv_tokens,
                matches!(source, LoadSource::SglangLoads | LoadSource::SglangGetLoad),
            ),
            ("max_pending_prefill_tokens", limits.max_pending_prefill_tokens, source == LoadSource::SglangLoads),
        ];
        for (field, cap, supplied) in reported {
            if cap.is_some() && !supplied {
                self.errors.push(ConfigError::new(
                    format!("{path}.{field}"),
                    format!(
                        "load.source `{}` does not report this metric, so the cap could never be checked",
                        source.as_str()
                    ),
                ));
            }
        }
    }
}

fn validate_queue(path: &str, queue: &QueueConfig, config: &RouterConfig, errors: &mut Vec<ConfigError>) {
    if !(1..=MAX_QUEUE_REQUESTS).contains(&queue.max_requests) {
        errors.push(ConfigError::new(
            format!("{path}.max_requests"),
            format!("between 1 and {MAX_QUEUE_REQUESTS}, got {}", queue.max_requests),
        ));
    }
    if !(1..=MAX_QUEUE_WAIT_MS).contains(&queue.max_wait_ms) {
        errors.push(ConfigError::new(
            format!("{path}.max_wait_ms"),
            format!("between 1 and {MAX_QUEUE_WAIT_MS}, got {}", queue.max_wait_ms),
        ));
    }
    // A waiting request sends nothing upstream: Envoy would end it as idle before its wait did.
    let idle = config.timeouts.stream_idle_ms;
    if idle > 0 && queue.max_wait_ms >= idle {
        errors.push(ConfigError::new(
            format!("{path}.max_wait_ms"),
            format!("must be below timeouts.stream_idle_ms ({idle}), which would end a waiting request first"),
        ));
    }
    if queue.classes.is_empty() || queue.classes.len() > MAX_QUEUE_CLASSES {
        errors.push(ConfigError::new(
            format!("{path}.classes"),
            format!("between 1 and {MAX_QUEUE_CLASSES} classes, got {}", queue.classes.len()),
        ));
    }
    for (name, class) in &queue.classes {
        let at = format!("{path}.classes.{name}");
        // A class name is a stats label inside a dotted metric name.
        if name.is_empty()
            || name.len() > 32
            || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            errors.push(ConfigError::new(&at, "a class name is 1 to 32 of a-z, 0-9, `_` and `-`"));
        }
        if class.priority.abs() > MAX_CLASS_PRIORITY {
            errors.push(ConfigError::new(
                format!("{at}.priority"),
                format!("between -{MAX_CLASS_PRIORITY} and {MAX_CLASS_PRIORITY}, got {}", class.priority),
            ));
        }
        if let Some(wait) = class.max_wait_ms {
            if !(1..=MAX_QUEUE_WAIT_MS).contains(&wait) {
                errors.push(ConfigError::new(
                    format!("{at}.max_wait_ms"),
                    format!("between 1 and {MAX_QUEUE_WAIT_MS}, got {wait}"),
                ));
            } else if idle > 0 && wait >= idle {
                errors.push(ConfigError::new(
                    format!("{at}.max_wait_ms"),
                    format!("must be below timeouts.stream_idle_ms ({idle}), which would end a waiting request first"),
                ));
            }
        }
    }
    if !queue.classes.contains_key(&queue.default_class) {
        let names: Vec<&str> = queue.classes.keys().map(String::as_str).collect();
        errors.push(ConfigError::new(
            format!("{path}.default_class"),
            format!("`{}` is not one of the classes ({})", queue.default_class, names.join(", ")),
        ));
    }
    // Above max_requests it adds no limit.
    if !(1..=MAX_QUEUE_REQUESTS).contains(&queue.max_per_tenant) {
        errors.push(ConfigError::new(
            format!("{path}.max_per_tenant"),
            format!("between 1 and {MAX_QUEUE_REQUESTS}, got {}", queue.max_per_tenant),
        ));
    }
    for (field, value) in [("class_header", &queue.class_header), ("tenant_header", &queue.tenant_header)] {
        if !is_header_name(value) {
            errors.push(ConfigError::new(
                format!("{path}.{field}"),
                format!("`{value}` is not a lowercase HTTP header name"),
            ));
        }
    }
}

fn positive(errors: &mut Vec<ConfigError>, path: &str, value: u64) {
    if value == 0 {
        errors.push(ConfigError::new(path, "must be greater than 0"));
    }
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_cluster_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}
