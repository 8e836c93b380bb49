//! `render`: a complete Envoy bootstrap for a router configuration (spec §6).

use serde_json::{json, Value};
use sgl_envoy_router::config::{RouterConfig, ServiceMode, UpstreamMode};
use sgl_envoy_router::filter::generation::Endpoint;
use sgl_envoy_router::filter::{ErrorKind, RouteError};
use sgl_envoy_router::registry::EngineAddress;
use sgl_envoy_router::wiring::factory;
use sgl_envoy_router::wiring::upstream::{ENDPOINT_HEADER, ENGINES_CLUSTER};

pub const DEFAULT_WASM: &str = "target/wasm32-wasip1/release/sgl_envoy_router.wasm";
const VM_ID: &str = "sgl_router";
/// The filter plugin's name and root id, and the namespace `render` writes when the router
/// configuration names none: the filter's and the service's plugin names differ, so each is told
/// the one namespace (spec §10).
pub(crate) const FILTER_PLUGIN: &str = "sgl_router";

/// The router configuration as the plugins get it: every default spelled out, the namespace named.
pub(crate) fn plugin_json(config: &RouterConfig) -> String {
    serde_json::to_string(&with_namespace(config)).unwrap_or_default()
}

/// `config` with its namespace named.
pub(crate) fn with_namespace(config: &RouterConfig) -> RouterConfig {
    let mut config = config.clone();
    config.namespace.get_or_insert_with(|| FILTER_PLUGIN.to_string());
    config
}
/// Above the filter's own 32 MiB limit, so the filter answers 413 itself.
const BUFFER_LIMIT_BYTES: u64 = 40 * 1024 * 1024;
const ORIGINAL_DST_CLUSTER: &str = "sgl_original_dst";

#[derive(Debug, Clone)]
pub struct RenderOptions {
    pub wasm_path: String,
    pub listen_address: String,
    pub listen_port: u16,
    pub admin_port: u16,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self {
            wasm_path: DEFAULT_WASM.to_string(),
            listen_address: "127.0.0.1".to_string(),
            listen_port: 10000,
            admin_port: 9901,
        }
    }
}

pub fn render(config: &RouterConfig, options: &RenderOptions) -> Result<String, serde_yaml_ng::Error> {
    let bootstrap = bootstrap(config, options);
    let yaml = serde_yaml_ng::to_string(&bootstrap)?;
    Ok(format!("# Rendered by `sgl-envoy-router render`; edit the router configuration and render again.\n{yaml}"))
}

/// Only what an existing Envoy needs, each part under the key it merges into and a comment naming
/// where it goes: the HTTP filter entry, the routes, the clusters, the bootstrap service with the
/// same `vm_id`, and the stats labels.
pub fn render_snippet(config: &RouterConfig, options: &RenderOptions) -> Result<String, serde_yaml_ng::Error> {
    let router_json = plugin_json(config);
    let part = |key: &str, value: Value| serde_yaml_ng::to_string(&json!({ key: value }));
    let mut out = String::from(
        "# sgl-envoy-router for an existing Envoy (`render --snippet`): merge each part where its comment says.\n\
         # The listener that carries these routes needs per_connection_buffer_limit_bytes >= 41943040 (bodies up to\n\
         # 32 MiB are buffered by the filter), and its HttpConnectionManager no route timeout on them.\n\n\
         # 1. Into that HttpConnectionManager's http_filters, before envoy.filters.http.router:\n",
    );
    out += &part("http_filters", json!([http_filter(&router_json, options)]))?;
    out += "\n# 2. Into the virtual host that serves the model API, before any catch-all route:\n";
    out += &part("routes", Value::Array(generation_routes(config)))?;
    out += "\n# 3. Into static_resources.clusters (one per engine, and the indexer's when configured):\n";
    out += &part("clusters", Value::Array(clusters(config)))?;
    if config.service.mode == ServiceMode::Embedded {
        out += "\n# 4. No bootstrap service: `service.mode: embedded`, a filter VM elected by lease does its work.\n";
    } else {
        out += "\n# 4. Into the bootstrap's bootstrap_extensions: the service (polls load and health) on the filter's vm_id:\n";
        out += &part("bootstrap_extensions", service_extensions(config, &router_json, options))?;
    }
    out += "\n# 5. Into the bootstrap's stats_config.stats_tags: Prometheus labels for the filter's stats:\n";
    out += &part("stats_tags", stats_tags())?;
    Ok(out)
}

/// The bootstrap service, unless the filter VMs do its work (`service.mode: embedded`).
pub(crate) fn service_extensions(config: &RouterConfig, service_json: &str, options: &RenderOptions) -> Value {
    if config.service.mode == ServiceMode::Embedded {
        json!([])
    } else {
        json!([bootstrap_extension(service_json, options)])
    }
}

pub(crate) fn bootstrap_extension(router_json: &str, options: &RenderOptions) -> Value {
    json!({
        "name": "envoy.bootstrap.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService",
            "singleton": true,
            "config": plugin("sgl_router_service", router_json, options, false),
        }
    })
}

pub(crate) fn http_filter(router_json: &str, options: &RenderOptions) -> Value {
    json!({
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": plugin(FILTER_PLUGIN, router_json, options, true),
        }
    })
}

/// Every generation endpoint goes to the engine the filter picks.
fn generation_routes(config: &RouterConfig) -> Vec<Value> {
    let mut route = match (config.upstream.mode, config.upstream.shared_cluster()) {
        (_, Some(shared)) => json!({"cluster": shared}),
        (UpstreamMode::OriginalDst, None) => json!({"cluster": ORIGINAL_DST_CLUSTER}),
        (_, None) => json!({"cluster_header": config.upstream.header_name()}),
    };
    // 0s = no route timeout: generations can run for minutes (Envoy's default would cut at 15 s).
    route["timeout"] = json!(duration(config.timeouts.request_ms));
    // A refused connection or a reset before any response header goes to the next engine the
    // filter named (spec §8); the filter sets how many it named per request.
    if has_engines_cluster(config) {
        route["retry_policy"] = json!({"retry_on": "connect-failure,reset", "num_retries": config.retry_attempts()});
    }
    Endpoint::ALL.iter().map(|e| json!({"match": {"path": e.path()}, "route": route.clone()})).collect()
}

/// Prometheus labels from the filter's metric names (wasmcustom.<metric>[.stage.<s>][.worker.<w>]
/// and friends).
pub(crate) fn stats_tags() -> Value {
    json!([
                {"tag_name": "stage", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.stage\\.([^.]+))"},
                {"tag_name": "worker", "regex": "^wasmcustom\\.sgl_router_\\w+(?:\\.stage\\.[^.]+)?(\\.worker\\.([^.]+))$"},
                {"tag_name": "bucket", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.bucket\\.([^.]+))$"},
                {"tag_name": "outcome", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.outcome\\.([^.]+))$"},
                {"tag_name": "limit", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.limit\\.([^.]+))$"},
                {"tag_name": "vm", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.vm\\.([^.]+))$"},
                {"tag_name": "indexer", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.indexer\\.([^.]+))"},
                {"tag_name": "result", "regex": "^wasmcustom\\.sgl_router_\\w+(?:\\.indexer\\.[^.]+)?(\\.result\\.([^.]+))$"},
                {"tag_name": "reason", "regex": "^wasmcustom\\.sgl_router_\\w+(?:\\.stage\\.[^.]+)?(?:\\.class\\.[^.]+)?(\\.reason\\.([^.]+))$"},
                {"tag_name": "class", "regex": "^wasmcustom\\.sgl_router_queue_\\w+(\\.class\\.([^.]+))"},
                {"tag_name": "model", "regex": "^wasmcustom\\.sgl_router_\\w+(\\.model\\.([^.]+))$"},
    ])
}

fn bootstrap(config: &RouterConfig, options: &RenderOptions) -> Value {
    let router_json = plugin_json(config);
    json!({
        "admin": {
            "address": socket("127.0.0.1", options.admin_port),
        },
        "bootstrap_extensions": service_extensions(config, &router_json, options),
        "stats_config": {"stats_tags": stats_tags()},
        "static_resources": {
            "listeners": [listener(config, options, http_filter(&router_json, options))],
            "clusters": clusters(config),
        }
    })
}

pub(crate) fn socket(address: &str, port: u16) -> Value {
    json!({"socket_address": {"address": address, "port_value": port}})
}

fn plugin(root_id: &str, router_json: &str, options: &RenderOptions, http_filter: bool) -> Value {
    let mut config = json!({
        "name": root_id,
        "root_id": root_id,
        "vm_config": {
            "vm_id": VM_ID,
            "runtime": "envoy.wasm.runtime.v8",
            "code": {"local": {"filename": options.wasm_path}},
        },
        "configuration": {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": router_json,
        },
        "failure_policy": "FAIL_RELOAD",
    });
    if http_filter {
        // Without it, pausing in the headers phase stops the body callbacks (field notes).
        config["allow_on_headers_stop_iteration"] = json!(true);
    }
    config
}

/// The filter's own error shape (spec §4), for paths the router does not serve.
fn not_found_body() -> String {
    let error = RouteError::new(
        ErrorKind::NotFound,
        "no route for this path; the router serves POST /v1/chat/completions, /v1/completions and /generate, GET /v1/models and /v1/models/{id}",
    );
    String::from_utf8_lossy(&error.body()).into_owned()
}

/// The listener, its routes and HTTP filters; `router_filter` is the filter's entry (inline, or
/// discovered from a file).
pub(crate) fn listener(config: &RouterConfig, options: &RenderOptions, router_filter: Value) -> Value {
    let generation_routes = generation_routes(config);
    let json_content_type = json!([{
        "header": {"key": "content-type", "value": "application/json"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }]);
    json!({
        "name": "sgl_listener",
        "address": socket(&options.listen_address, options.listen_port),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "sgl",
                    "stream_idle_timeout": duration(config.timeouts.stream_idle_ms),
                    "local_reply_config": local_reply_config(),
                    "route_config": {
                        "name": "sgl_routes",
                        "virtual_hosts": [{
                            "name": "sgl",
                            "domains": ["*"],
                            "routes": generation_routes.into_iter().chain([json!(
                                {
                                    "match": {"prefix": "/"},
                                    "direct_response": {"status": 404, "body": {"inline_string": not_found_body()}},
                                    "response_headers_to_add": json_content_type,
                                }
                            )]).collect::<Vec<_>>(),
                        }],
                    },
                    "http_filters": [
                        router_filter,
                        {
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                        },
                    ],
                },
            }],
        }],
    })
}

/// Envoy's own replies about an engine (connect failure, no healthy host, timeouts, overflow) in
/// the filter's error shape (spec §4), naming the engine's cluster. Matched by response flag, so
/// the filter's own JSON replies (which carry none) pass untouched.
fn local_reply_config() -> Value {
    let mapper = |kind: &str, flags: &[&str]| {
        json!({
            "filter": {"response_flag_filter": {"flags": flags}},
            "body_format_override": {
                "json_format": {"error": {
                    "message": "%LOCAL_REPLY_BODY% (engine cluster: %UPSTREAM_CLUSTER%, host: %UPSTREAM_HOST%, flags: %RESPONSE_FLAGS%)",
                    "type": kind,
                    "code": "%RESPONSE_CODE%",
                }},
            },
        })
    };
    json!({"mappers": [
        mapper("upstream_timeout", &["UT", "SI"]),
        mapper("upstream_overflow", &["UO", "OM"]),
        mapper("upstream_unavailable", &["UF", "UH", "UC", "URX", "NR", "LR", "UR", "UMSDR", "DF", "NC", "UPE"]),
    ]})
}

fn duration(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{}.{:03}s", ms / 1000, ms % 1000)
    }
}

/// Envoy's own per-cluster limits default to 1,024 requests; a router must not cap engines below
/// what their admission allows.
fn circuit_breakers() -> Value {
    json!({"thresholds": [{
        "max_connections": 100000,
        "max_pending_requests": 100000,
        "max_requests": 100000,
        "max_retries": 3,
    }]})
}

/// One host: STATIC for an IP, STRICT_DNS for a name.
fn static_cluster(name: &str, address: &EngineAddress) -> Value {
    let is_ip = address.host().parse::<std::net::IpAddr>().is_ok();
    json!({
        "name": name,
        "type": if is_ip { "STATIC" } else { "STRICT_DNS" },
        "connect_timeout": "5s",
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "circuit_breakers": circuit_breakers(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket(address.host(), address.port())}}]}],
        },
    })
}

/// Whether requests may be routed through an engines cluster, so Envoy can retry them elsewhere.
fn has_engines_cluster(config: &RouterConfig) -> bool {
    config.retry_attempts() > 0
        && match config.upstream.mode {
            UpstreamMode::ClusterHeader => factory::registry(config).all().iter().any(|w| w.in_engines_cluster()),
            UpstreamMode::OverrideHost => true,
            UpstreamMode::OriginalDst => false,
        }
}

/// Engines routed by the address the filter names (Envoy's override-host policy reads the engine,
/// then its fallbacks, from one header): with `cluster_header`, [`ENGINES_CLUSTER`] of every plain
/// and decode engine with an IP address, beside their own clusters; with `override_host`, the one
/// cluster of every engine, reached by requests and callouts alike.
fn engines_cluster(config: &RouterConfig) -> Value {
    let registry = factory::registry(config);
    let (name, header) = match config.upstream.shared_cluster() {
        Some(shared) => (shared, config.upstream.header_name()),
        None => (ENGINES_CLUSTER, ENDPOINT_HEADER),
    };
    let shared = config.upstream.shared_cluster().is_some();
    let mut sockets: Vec<String> = registry
        .all()
        .iter()
        .filter(|w| shared || w.in_engines_cluster())
        .filter_map(|w| w.address.socket().map(str::to_string))
        .collect();
    sockets.sort();
    sockets.dedup();
    let endpoints: Vec<Value> = sockets
        .iter()
        .filter_map(|s| s.parse::<std::net::SocketAddr>().ok())
        .map(|a| json!({"endpoint": {"address": socket(&a.ip().to_string(), a.port())}}))
        .collect();
    let mut breakers = circuit_breakers();
    // Every request of an engine that just died is retried at once.
    breakers["thresholds"][0]["max_retries"] = json!(100000);
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "circuit_breakers": breakers,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": header}],
                // No address the filter named is in the cluster (a stale cluster, an update Envoy
                // has not taken up): no host, a 503, never another model's or role's engine.
                "fallback_policy": {"policies": [{"typed_extension_config": refusing_policy()}]},
            },
        }}]},
    })
}

/// A load-balancing policy that picks no host: a subset policy whose one selector no host
/// matches, with no fallback.
pub(crate) fn refusing_policy() -> Value {
    json!({
        "name": "envoy.load_balancing_policies.subset",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.subset.v3.Subset",
            "fallback_policy": "NO_FALLBACK",
            "subset_selectors": [{"keys": ["sgl_no_such_key"]}],
            "subset_lb_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
            }}]},
        },
    })
}

pub(crate) fn clusters(config: &RouterConfig) -> Vec<Value> {
    let registry = factory::registry(config);
    let mut clusters: Vec<Value> = if config.upstream.shared_cluster().is_some() {
        vec![engines_cluster(config)]
    } else {
        registry.all().iter().map(|w| static_cluster(&w.cluster, &w.address)).collect()
    };
    if config.upstream.shared_cluster().is_none() && has_engines_cluster(config) {
        clusters.push(engines_cluster(config));
    }
    // The indexers the filter asks once per request (spec §7): a cluster each, so the filter
    // chooses the replica and fails over itself within its budget. A replica that is down must
    // fail fast: its connect timeout is the filter's whole wait.
    if let Some(index) = &config.prefix_index {
        for endpoint in index.endpoints() {
            if let Ok(address) = EngineAddress::parse(&endpoint.url) {
                let mut cluster = static_cluster(&endpoint.cluster, &address);
                cluster["connect_timeout"] = json!(duration(index.timeout_ms.max(1)));
                clusters.push(cluster);
            }
        }
    }
    if config.upstream.mode == UpstreamMode::OriginalDst {
        clusters.push(json!({
            "name": ORIGINAL_DST_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
            "circuit_breakers": circuit_breakers(),
            "original_dst_lb_config": {
                "use_http_header": true,
                "http_header_name": config.upstream.header_name(),
            },
        }));
    }
    clusters
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_indexer_gets_its_cluster_and_envoys_replies_their_json_shape() {
        let config = sgl_envoy_router::config::parse_and_validate(
            r#"{"workers": [{"id": "A", "url": "http://127.0.0.1:30001", "model": "m"}],
                "prefix_index": {"url": "http://127.0.0.1:9100"},
                "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}}"#,
        )
        .unwrap();
        let b = bootstrap(&config, &RenderOptions::default());
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        let indexer = clusters.iter().find(|c| c["name"] == "sgl_indexer").unwrap();
        let address =
            &indexer["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        assert_eq!((address["address"].as_str(), address["port_value"].as_u64()), (Some("127.0.0.1"), Some(9100)));
        assert_eq!(indexer["connect_timeout"], "0.050s", "a dead replica fails within the filter's budget");
        let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        let mappers = hcm["local_reply_config"]["mappers"].as_array().unwrap();
        assert_eq!(mappers.len(), 3);
        assert!(mappers.iter().all(|m| m["body_format_override"]["json_format"]["error"]["message"]
            .as_str()
            .is_some_and(|s| s.contains("%UPSTREAM_CLUSTER%"))));
    }

    #[test]
    fn several_indexers_get_a_cluster_each_and_their_stats_a_label() {
        let config = sgl_envoy_router::config::parse_and_validate(
            r#"{"workers": [{"id": "A", "url": "http://127.0.0.1:30001", "model": "m"}],
                "prefix_index": {"urls": ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]},
                "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}}"#,
        )
        .unwrap();
        let b = bootstrap(&config, &RenderOptions::default());
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        for (name, port) in [("sgl_indexer", 9100), ("sgl_indexer_1", 9101)] {
            let c = clusters.iter().find(|c| c["name"] == name).unwrap();
            let address =
                &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
            assert_eq!(address["port_value"].as_u64(), Some(port), "{name}");
        }
        let tags = stats_tags();
        let regex =
            |tag: &str| tags.as_array().unwrap().iter().find(|t| t["tag_name"] == tag).unwrap()["regex"].clone();
        assert!(regex("indexer").as_str().unwrap().contains("indexer"));
        assert!(regex("result").as_str().unwrap().contains("(?:\\.indexer\\.[^.]+)?"));
    }
}
