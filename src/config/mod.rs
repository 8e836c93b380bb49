//! Router configuration, a leaf that describes: serde types, validation with field paths, and
//! refusal of dropped options. The filter, the service, the CLI and the indexer all go through
//! [`parse_and_validate`]; what the configuration builds is built by `wiring::factory`.

mod dropped;
#[cfg(not(target_arch = "wasm32"))]
mod file;
mod structure;
mod types;
mod validate;
pub use validate::MAX_INDEXERS;

#[cfg(not(target_arch = "wasm32"))]
pub use file::{load_file, parse_document};
use serde::de::DeserializeOwned;
use serde_json::Value;
pub use types::*;

/// A service configuration that only names its namespace (spec §10): the service follows the
/// filter configuration announced there. `None` when `text` is anything else.
pub fn namespace_only(text: &str) -> Option<Result<String, ConfigErrors>> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct NamespaceOnly {
        namespace: String,
    }
    let only: NamespaceOnly = serde_json::from_str(text).ok()?;
    let mut errors = Vec::new();
    validate::validate_namespace(Some(&only.namespace), &mut errors);
    Some(if errors.is_empty() { Ok(only.namespace) } else { Err(ConfigErrors(errors)) })
}

/// One problem in a configuration, always tied to the field it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), message: message.into() }
    }
}

/// Every problem found; a configuration is accepted only when this list is empty.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", join(.0))]
pub struct ConfigErrors(pub Vec<ConfigError>);

fn join(errors: &[ConfigError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// Parses a JSON router configuration and validates it.
pub fn parse_and_validate(json: &str) -> Result<RouterConfig, ConfigErrors> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| ConfigErrors(vec![ConfigError::new("(document)", e.to_string())]))?;
    from_value(value)
}

/// Validates an already-parsed document (the CLI reads YAML into a JSON value first). Every error
/// is reported at once: dropped options, each structural error serde finds (the document is
/// repaired around each one and read again), and every semantic check.
pub fn from_value(value: Value) -> Result<RouterConfig, ConfigErrors> {
    let mut errors = dropped::find_dropped_options(&value);
    let mut value = value;
    // The dropped options were reported by name; read the rest as if they were not there.
    for e in &errors {
        structure::neutralize_dropped(&mut value, &e.path);
    }
    let parsed = structure::read_all(value, &mut errors);
    if let Some(config) = &parsed {
        errors.extend(validate::validate(config));
    }
    match parsed {
        Some(config) if errors.is_empty() => Ok(config),
        _ => Err(ConfigErrors(errors)),
    }
}

fn deserialize_with_path<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { "(document)".to_string() } else { path };
        ConfigError::new(path, e.into_inner().to_string())
    })
}

#[cfg(test)]
mod tests {
    use crate::testing::test;
    use serde_json::{json, Value};

    use super::*;
    use crate::registry::Role;

    fn minimal() -> Value {
        json!({
            "workers": [
                {"id": "A", "url": "http://127.0.0.1:30001", "model": "m"},
                {"id": "B", "url": "http://127.0.0.1:30002", "model": "m"}
            ],
            "models": {"m": {"buckets": [{"id": "default", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}}
        })
    }

    #[test]
    fn override_host_names_engines_by_ip_on_one_cluster() {
        let mut c = minimal();
        c["upstream"] = json!({"mode": "override_host", "cluster": "outbound|8000||llm.default.svc.cluster.local"});
        let ok = parse_and_validate(&c.to_string()).unwrap();
        assert_eq!(ok.upstream.shared_cluster(), Some("outbound|8000||llm.default.svc.cluster.local"));
        assert_eq!((ok.upstream.header_name(), ok.retry_attempts()), ("x-gateway-destination-endpoint", 1));
        c["workers"][0]["url"] = json!("http://engine-a.internal:30001");
        c["workers"][1]["cluster"] = json!("mine");
        let paths: Vec<String> =
            parse_and_validate(&c.to_string()).unwrap_err().0.into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["workers[0].url", "workers[1].cluster"]);
        let mut other = minimal();
        other["upstream"] = json!({"cluster": "x"});
        let errors = parse_and_validate(&other.to_string()).unwrap_err();
        assert_eq!(errors.0[0].path, "upstream.cluster", "{errors}");
    }

    #[test]
    fn a_namespace_is_a_plugin_names_characters_and_a_service_may_name_only_it() {
        let mut c = minimal();
        c["namespace"] = json!("default.sgl-router_1");
        assert_eq!(parse_and_validate(&c.to_string()).unwrap().namespace.as_deref(), Some("default.sgl-router_1"));
        for bad in ["a/b", "has space", &"x".repeat(MAX_NAMESPACE_BYTES + 1)] {
            c["namespace"] = json!(bad);
            let errors = parse_and_validate(&c.to_string()).unwrap_err();
            assert!(errors.0.iter().all(|e| e.path == "namespace"), "{bad}: {errors}");
        }
        assert_eq!(namespace_only(r#"{"namespace": "pool-a"}"#).unwrap(), Ok("pool-a".to_string()));
        assert!(namespace_only(r#"{"namespace": "a/b"}"#).unwrap().is_err());
        assert!(namespace_only(&minimal().to_string()).is_none(), "a whole configuration is not namespace-only");
    }

    fn pd() -> Value {
        json!({
            "workers": [
                {"id": "P1", "url": "http://10.0.0.1:30000", "model": "m", "role": "prefill", "bootstrap_port": 8998},
                {"id": "D1", "url": "http://10.0.0.2:30000", "model": "m", "role": "decode"}
            ],
            "models": {"m": {"buckets": [{
                "id": "short", "rank": 10, "limits": {"min": 0, "max": 4096}, "max_context_tokens": 8192,
                "groups": {"pd": {
                    "prefill": {"worker_ids": ["P1"], "policy": {"type": "cache_aware", "admission": {"max_running_requests": 64}}},
                    "decode": {"worker_ids": ["D1"], "policy": {"type": "power_of_two"}}
                }}
            }]}}
        })
    }

    fn errors(value: Value) -> Vec<ConfigError> {
        match from_value(value) {
            Ok(_) => Vec::new(),
            Err(e) => e.0,
        }
    }

    fn has_error(value: Value, path: &str, needle: &str) {
        let found = errors(value);
        assert!(
            found.iter().any(|e| e.path == path && e.message.contains(needle)),
            "expected `{path}: …{needle}…`, got {found:?}"
        );
    }

    #[test]
    fn retries_default_to_one_where_envoy_can_retry_and_are_bounded() {
        assert_eq!(from_value(minimal()).unwrap().retry_attempts(), 1);
        let written = serde_json::to_value(from_value(minimal()).unwrap()).unwrap();
        assert!(written.get("retry").is_none(), "the default is not written: older builds load it");
        let mut dst = minimal();
        dst["upstream"] = json!({"mode": "original_dst"});
        assert_eq!(from_value(dst.clone()).unwrap().retry_attempts(), 0, "an ORIGINAL_DST cluster cannot retry");
        dst["retry"] = json!({"attempts": 1});
        has_error(dst, "retry.attempts", "cluster_header");
        let mut many = minimal();
        many["retry"] = json!({"attempts": 5});
        has_error(many, "retry.attempts", "at most 4");
        let mut typo = minimal();
        typo["retry"] = json!({"attempt": 1});
        assert!(!errors(typo).is_empty(), "unknown fields are refused");
    }

    #[test]
    fn a_model_queue_wins_over_the_top_level_one_and_both_are_bounded() {
        let mut v = minimal();
        assert!(from_value(v.clone()).unwrap().queue_for("m").is_none(), "no queue unless configured");
        v["queue"] = json!({"max_requests": 8});
        let c = from_value(v.clone()).unwrap();
        let q = c.queue_for("m").unwrap();
        assert_eq!((q.max_requests, q.max_wait_ms, q.class_header.as_str()), (8, 5000, "x-sgl-class"));
        assert_eq!((q.class(Some("unknown")), q.max_per_tenant), (("standard", QueueClass::default()), 64));
        v["models"]["m"]["queue"] = json!({"max_wait_ms": 100, "tenant_header": "x-team"});
        let c = from_value(v.clone()).unwrap();
        let q = c.queue_for("m").unwrap();
        assert_eq!((q.max_requests, q.max_wait_ms, q.tenant_header.as_str()), (256, 100, "x-team"));
        v["queue"] = json!({"max_requests": 0});
        has_error(v.clone(), "queue.max_requests", "between 1 and 4096");
        v["models"]["m"]["queue"] = json!({"max_wait_ms": 600_001, "class_header": "X-Bad"});
        has_error(v.clone(), "models.m.queue.max_wait_ms", "between 1 and 600000");
        has_error(v.clone(), "models.m.queue.class_header", "lowercase");
        v["models"]["m"]["queue"] = json!({"priority_header": "x-sgl-priority"});
        has_error(v.clone(), "models.m.queue.priority_header", "queue.classes");
        v["models"]["m"]["queue"] = json!({"default_class": "gold", "max_per_tenant": 0,
            "classes": {"interactive": {"priority": 101, "max_wait_ms": 0}, "Batch.x": {}}});
        has_error(v.clone(), "models.m.queue.default_class", "not one of the classes (Batch.x, interactive)");
        has_error(v.clone(), "models.m.queue.max_per_tenant", "between 1 and 4096");
        has_error(v.clone(), "models.m.queue.classes.interactive.priority", "between -100 and 100");
        has_error(v.clone(), "models.m.queue.classes.interactive.max_wait_ms", "between 1 and 600000");
        has_error(v.clone(), "models.m.queue.classes.Batch.x", "a class name");
        v["queue"] = json!({});
        v["models"]["m"]["queue"] = json!({"default_class": "batch",
            "classes": {"interactive": {"priority": 10, "max_wait_ms": 1000}, "batch": {"priority": -10}}});
        let c = from_value(v.clone()).unwrap();
        let q = c.queue_for("m").unwrap();
        let interactive = QueueClass { priority: 10, max_wait_ms: Some(1000) };
        assert_eq!(q.class(Some("interactive")), ("interactive", interactive));
        assert_eq!(q.class(None), ("batch", QueueClass { priority: -10, max_wait_ms: None }));
        assert_eq!((q.max_wait_ms(&interactive), q.max_wait_ms(&q.class(None).1)), (1000, 5000));
        v["models"]["m"]["queue"] = json!({"max_wait_ms": 60_000});
        v["timeouts"] = json!({"stream_idle_ms": 60_000});
        has_error(v.clone(), "models.m.queue.max_wait_ms", "stream_idle_ms");
        v["models"]["m"]["queue"] = json!({"max_wait": 1});
        assert!(!errors(v).is_empty(), "unknown fields are refused");
    }

    #[test]
    fn generate_serves_the_only_model_or_the_one_marked_among_several() {
        assert_eq!(from_value(minimal()).unwrap().generate_model(), Some("m"));
        let mut two = minimal();
        two["models"]["n"] = two["models"]["m"].clone();
        assert_eq!(from_value(two.clone()).unwrap().generate_model(), None);
        two["models"]["n"]["serve_generate"] = json!(true);
        assert_eq!(from_value(two).unwrap().generate_model(), Some("n"));
    }

    #[test]
    fn minimal_config_gets_the_spec_defaults() {
        let c = from_value(minimal()).unwrap();
        assert_eq!(c.upstream.mode, UpstreamMode::ClusterHeader);
        assert_eq!(c.upstream.header_name(), "x-sgl-cluster");
        assert_eq!(c.load.source, LoadSource::SglangLoads);
        assert_eq!((c.load.interval_ms, c.load.timeout_ms, c.load.stale_after_ms), (250, 200, 2000));
        assert_eq!(c.health.path, "/health");
        assert_eq!((c.health.interval_ms, c.health.timeout_ms), (2000, 1000));
        assert_eq!((c.health.failure_threshold, c.health.success_threshold), (3, 2));
        assert_eq!(c.circuit_breaker, None);
        assert_eq!(c.pd.prefill_timeout_ms, 300_000);
        assert_eq!((c.timeouts.request_ms, c.timeouts.stream_idle_ms), (0, 300_000));
        assert_eq!(c.tokens.bytes_per_token, 4);
        assert_eq!(c.affinity_sweep_ms, 60_000);
        let m = &c.models["m"];
        assert_eq!(m.session_id_header, "x-session-id");
        assert_eq!(m.routing_key_header, "x-sgl-routing-key");
        assert_eq!((m.session_idle_ms, m.sticky_idle_ms), (600_000, 600_000));
        let b = &m.buckets[0];
        assert_eq!((b.rank, b.limits.min, b.limits.max, b.max_context_tokens), (0, 0, None, None));
        assert_eq!(c.workers[0].role, Role::Plain);
        assert_eq!(c.workers[0].dp_size, 1);
    }

    #[test]
    fn original_dst_defaults_its_header() {
        let mut v = minimal();
        v["upstream"] = json!({"mode": "original_dst"});
        assert_eq!(from_value(v).unwrap().upstream.header_name(), "x-gateway-destination-endpoint");
    }

    #[test]
    fn pd_example_validates() {
        let c = from_value(pd()).unwrap();
        assert!(matches!(c.models["m"].buckets[0].groups, GroupsConfig::Pd(_)));
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_path() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["limitz"] = json!({});
        has_error(v, "models.m.buckets[0].limitz", "unknown field");
        let mut v = minimal();
        v["health"] = json!({"intervl_ms": 5});
        has_error(v, "health.intervl_ms", "unknown field");
    }

    #[test]
    fn unknown_admission_fields_are_rejected() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["admission"] = json!({"max_runing_requests": 1});
        let found = errors(v);
        assert!(found.iter().any(|e| e.message.contains("max_runing_requests")), "{found:?}");
    }

    #[test]
    fn a_group_without_policy_is_rejected() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"] = json!({"worker_ids": ["A"]});
        has_error(v, "models.m.buckets[0].groups.plain", "policy");
    }

    #[test]
    fn a_bucket_cannot_be_both_plain_and_pd() {
        let mut v = pd();
        v["models"]["m"]["buckets"][0]["groups"]["plain"] = json!({"policy": {"type": "random"}});
        assert!(!errors(v).is_empty());
    }

    #[test]
    fn a_pd_bucket_needs_both_groups() {
        let mut v = pd();
        v["models"]["m"]["buckets"][0]["groups"]["pd"].as_object_mut().unwrap().remove("decode");
        has_error(v, "models.m.buckets[0].groups.pd", "decode");
    }

    #[test]
    fn bucket_ids_are_unique_and_non_empty() {
        let mut v = minimal();
        let bucket = v["models"]["m"]["buckets"][0].clone();
        v["models"]["m"]["buckets"].as_array_mut().unwrap().push(bucket);
        has_error(v, "models.m.buckets[1].id", "duplicate bucket id");
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["id"] = json!(" ");
        has_error(v, "models.m.buckets[0].id", "must not be empty");
    }

    #[test]
    fn ranges_must_be_sane() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["limits"] = json!({"min": 10, "max": 5});
        has_error(v, "models.m.buckets[0].limits", "below min");
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["max_context_tokens"] = json!(0);
        has_error(v, "models.m.buckets[0].max_context_tokens", "at least 1");
    }

    #[test]
    fn worker_ids_are_unique_and_groups_name_known_workers() {
        let mut v = minimal();
        v["workers"][1]["id"] = json!("A");
        has_error(v, "workers[1].id", "duplicate worker id");
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["worker_ids"] = json!(["A", "Z"]);
        has_error(v, "models.m.buckets[0].groups.plain.worker_ids[1]", "unknown worker `Z`");
    }

    #[test]
    fn membership_must_match_the_groups_role() {
        let mut v = pd();
        v["models"]["m"]["buckets"][0]["groups"]["pd"]["decode"]["worker_ids"] = json!(["P1"]);
        has_error(v, "models.m.buckets[0].groups.pd.decode.worker_ids[0]", "role prefill");
    }

    #[test]
    fn membership_must_match_the_model() {
        let mut v = minimal();
        v["workers"][1]["model"] = json!("other");
        v["models"]["other"] = v["models"]["m"].clone();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["worker_ids"] = json!(["B"]);
        has_error(v, "models.m.buckets[0].groups.plain.worker_ids[0]", "serves model `other`");
    }

    #[test]
    fn a_model_cannot_mix_plain_and_pd_engines() {
        let mut v = pd();
        v["workers"].as_array_mut().unwrap().push(json!({"id": "X", "url": "http://10.0.0.3:1", "model": "m"}));
        has_error(v, "workers[2].role", "mixes plain and prefill/decode");
    }

    #[test]
    fn plain_buckets_for_pd_models_and_the_reverse_are_rejected() {
        let mut v = pd();
        v["models"]["m"]["buckets"][0]["groups"] = json!({"plain": {"policy": {"type": "random"}}});
        has_error(v, "models.m.buckets[0].groups.plain", "need `pd` groups");
    }

    #[test]
    fn workers_must_serve_a_configured_model() {
        let mut v = minimal();
        v["workers"][0]["model"] = json!("nope");
        has_error(v, "workers[0].model", "not configured");
    }

    #[test]
    fn urls_must_be_http_with_a_host() {
        let mut v = minimal();
        v["workers"][0]["url"] = json!("https://x:1");
        has_error(v, "workers[0].url", "http://");
    }

    #[test]
    fn bootstrap_port_only_on_prefill() {
        let mut v = minimal();
        v["workers"][0]["bootstrap_port"] = json!(8998);
        has_error(v, "workers[0].bootstrap_port", "only prefill");
    }

    #[test]
    fn cache_aware_is_refused_in_decode_groups() {
        let mut v = pd();
        v["models"]["m"]["buckets"][0]["groups"]["pd"]["decode"]["policy"] = json!({"type": "cache_aware"});
        has_error(v, "models.m.buckets[0].groups.pd.decode.policy.type", "only in plain and prefill");
    }

    #[test]
    fn pressure_guard_settings_are_refused_outside_cache_aware() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "session_aware", "pressure_guard": {"max_extra_waiting_requests": 4}});
        let found = errors(v);
        assert!(found.iter().any(|e| e.message.contains("pressure_guard")), "{found:?}");
    }

    #[test]
    fn caps_the_load_source_cannot_supply_are_refused() {
        let mut v = minimal();
        v["load"] = json!({"source": "none"});
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["admission"] = json!({"max_running_requests": 4});
        has_error(
            v.clone(),
            "models.m.buckets[0].groups.plain.policy.admission.max_running_requests",
            "does not report",
        );
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["admission"] = json!({"max_inflight_requests": 4});
        assert!(errors(v).is_empty(), "in-flight is router-local and always known");

        let mut v = minimal();
        v["load"] = json!({"source": "sglang_get_load"});
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"]["admission"] =
            json!({"max_pending_prefill_tokens": 4});
        has_error(v, "models.m.buckets[0].groups.plain.policy.admission.max_pending_prefill_tokens", "does not report");
    }

    #[test]
    fn dropped_options_are_refused_by_name() {
        for (policy, needle) in
            [("fused_score", "fused"), ("score_policy", "score"), ("legacy_host_affinity", "legacy")]
        {
            let mut v = minimal();
            v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] = json!({"type": policy});
            has_error(v, "models.m.buckets[0].groups.plain.policy.type", needle);
        }
        for key in ["stable_pair", "affinity_mode", "prefix_cache_min_share", "fuse"] {
            let mut v = minimal();
            v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"][key] = json!(true);
            has_error(v, &format!("models.m.buckets[0].groups.plain.policy.{key}"), "not supported");
        }
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let mut v = minimal();
        v["workers"][1]["id"] = json!("A");
        v["health"] = json!({"interval_ms": 0});
        v["models"]["m"]["buckets"][0]["limits"] = json!({"min": 10, "max": 5});
        assert!(errors(v).len() >= 3);
    }

    #[test]
    fn invalid_json_names_the_document() {
        let e = parse_and_validate("{not json").unwrap_err();
        assert_eq!(e.0[0].path, "(document)");
    }

    #[test]
    fn the_configuration_round_trips_through_json() {
        let c = from_value(pd()).unwrap();
        let again = parse_and_validate(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(c, again);
    }

    #[test]
    fn every_error_is_reported_at_once_structural_dropped_and_semantic() {
        let mut v = minimal();
        v["workers"][0]["bogus"] = json!(1);
        v["workers"][1]["dp_size"] = json!("two");
        v["load"] = json!({"interval_ms": 0});
        v["stable_pair"] = json!(true);
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "cache_aware", "min_hit_tokens": "lots", "surprise": 1});
        v["models"]["m"]["buckets"][0]["limitz"] = json!({});
        let errors = from_value(v).unwrap_err().0;
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        for expected in [
            "stable_pair",
            "workers[0].bogus",
            "workers[1].dp_size",
            "models.m.buckets[0].groups.plain.policy.min_hit_tokens",
            "models.m.buckets[0].groups.plain.policy.surprise",
            "models.m.buckets[0].limitz",
            "load.interval_ms",
        ] {
            assert!(paths.contains(&expected), "{expected} missing from {paths:?}");
        }
    }

    #[test]
    fn a_dropped_policy_is_refused_by_name_and_the_rest_is_still_read() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] = json!({"type": "fused_score"});
        v["workers"][0]["url"] = json!("ftp://x");
        let errors = from_value(v).unwrap_err().0;
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["models.m.buckets[0].groups.plain.policy.type", "workers[0].url"], "{errors:?}");
    }

    #[test]
    fn a_missing_required_field_ends_the_structural_pass_with_what_was_found() {
        let mut v = minimal();
        v["workers"][0]["nope"] = json!(1);
        v["workers"][1].as_object_mut().unwrap().remove("id");
        let errors = from_value(v).unwrap_err().0;
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["workers[0].nope", "workers[1]"], "{errors:?}");
    }

    #[test]
    fn incompatible_cache_aware_knobs_are_refused_by_path() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] = json!({
            "type": "cache_aware", "min_candidates": 4, "max_candidates": 2, "saturation_floor": 0.5,
            "pressure_guard": {}, "source": "remote", "hold_for_prefix": true
        });
        v["prefix_index"] = json!({"url": "http://10.0.0.9:9100"});
        let errors = from_value(v).unwrap_err().0;
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        let policy = "models.m.buckets[0].groups.plain.policy";
        for field in ["min_candidates", "saturation_floor", "pressure_guard", "hold_for_prefix"] {
            assert!(paths.contains(&format!("{policy}.{field}").as_str()), "{field}: {paths:?}");
        }
    }

    #[test]
    fn hold_for_prefix_takes_a_mode_or_a_boolean() {
        let with = |value: Value| {
            let mut v = minimal();
            v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] =
                json!({"type": "cache_aware", "hold_for_prefix": value});
            from_value(v)
        };
        let mode = |value: Value| match &with(value).unwrap().models["m"].buckets[0].groups {
            GroupsConfig::Plain(GroupConfig { policy: PolicyConfig::CacheAware(c), .. }) => c.hold_for_prefix,
            other => panic!("{other:?}"),
        };
        assert_eq!(mode(json!("auto")), HoldForPrefix::Auto);
        assert_eq!(mode(json!("always")), HoldForPrefix::Always);
        assert_eq!(mode(json!(true)), HoldForPrefix::Always);
        assert_eq!(mode(json!("never")), HoldForPrefix::Never);
        assert_eq!(mode(json!(false)), HoldForPrefix::Never);
        let errors = with(json!("sometimes")).unwrap_err().0;
        assert!(
            errors.iter().any(|e| e.path.ends_with("policy.hold_for_prefix") && e.message.contains("always")),
            "{errors:?}"
        );
        assert!(with(json!(1)).is_err());
    }

    #[test]
    fn the_prefix_index_section_and_event_endpoints_are_checked_by_path() {
        let mut v = minimal();
        v["workers"][0]["kv_events"] = json!("tcp://127.0.0.1:5557");
        v["workers"][0]["kv_events_replay"] = json!("tcp://127.0.0.1:5558");
        v["models"]["m"]["tokenizer"] = json!("/models/m/tokenizer.json");
        v["prefix_index"] = json!({"url": "http://127.0.0.1:9100"});
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "cache_aware", "source": "remote"});
        let c = from_value(v.clone()).unwrap();
        let index = c.prefix_index.unwrap();
        assert_eq!(
            (index.cluster.as_str(), index.timeout_ms, index.max_concurrent, index.block_tokens),
            ("sgl_indexer", 50, 64, 16)
        );

        v["workers"][1]["kv_events"] = json!("ipc:///tmp/x");
        v["workers"][1]["kv_events_replay"] = json!("tcp://h:0");
        v["prefix_index"] = json!({"url": "https://x", "cluster": "sgl_A", "timeout_ms": 0, "token": "t"});
        let errors = from_value(v).unwrap_err().0;
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        for expected in [
            "workers[1].kv_events",
            "workers[1].kv_events_replay",
            "prefix_index.url",
            "prefix_index.cluster",
            "prefix_index.timeout_ms",
            "prefix_index.token_header",
        ] {
            assert!(paths.contains(&expected), "{expected} missing from {paths:?}");
        }
    }

    #[test]
    fn several_indexers_are_listed_once_each_and_named_in_order() {
        let mut v = minimal();
        v["prefix_index"] = json!({"urls": ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]});
        let endpoints = from_value(v.clone()).unwrap().prefix_index.unwrap().endpoints();
        let named: Vec<(&str, &str)> = endpoints.iter().map(|e| (e.cluster.as_str(), e.url.as_str())).collect();
        assert_eq!(named, [("sgl_indexer", "http://127.0.0.1:9100"), ("sgl_indexer_1", "http://127.0.0.1:9101")]);
        for (index, path) in [
            (json!({}), "prefix_index.urls"),
            (json!({"urls": []}), "prefix_index.urls"),
            (json!({"url": "http://a:1", "urls": ["http://b:1"]}), "prefix_index.urls"),
            (json!({"urls": ["http://a:1", "http://a:1/"]}), "prefix_index.urls[1]"),
            (json!({"urls": ["http://a:1", "ftp://b"]}), "prefix_index.urls[1]"),
            (
                json!({"urls": (0..=MAX_INDEXERS).map(|i| format!("http://a:{}", i + 1)).collect::<Vec<_>>()}),
                "prefix_index.urls",
            ),
            (json!({"urls": ["http://a:1", "http://a:2"], "cluster": "sgl"}), "prefix_index.cluster"),
        ] {
            v["prefix_index"] = index.clone();
            if index.get("cluster").is_some() {
                v["workers"][0]["cluster"] = json!("sgl_1");
            }
            let errors = from_value(v.clone()).unwrap_err().0;
            assert!(errors.iter().any(|e| e.path == path), "{index}: {errors:?}");
        }
    }

    #[test]
    fn a_remote_cache_source_without_a_prefix_index_names_its_path() {
        let mut v = minimal();
        v["models"]["m"]["buckets"][0]["groups"]["plain"]["policy"] =
            json!({"type": "cache_aware", "source": "remote"});
        let errors = from_value(v).unwrap_err().0;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].path, "models.m.buckets[0].groups.plain.policy.source");
    }
}
