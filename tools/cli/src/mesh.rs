//! `render --istio` and `render --envoy-gateway`: the Kubernetes resources that install the filter
//! through a control plane, with no bootstrap of ours (spec §10). The engines are the endpoints of
//! one Kubernetes Service, reached through the cluster the control plane builds for it, with an
//! override-host policy reading `upstream.header`; the service's work runs in an elected filter VM
//! (`service.mode: auto`).
//!
//! Neither control plane's own wasm resource can carry the router alone: the filter pauses in the
//! request headers to read the body, which Envoy allows only with the plugin's
//! `allow_on_headers_stop_iteration: true` (without it the request hangs), and neither Istio's
//! `WasmPlugin` nor Envoy Gateway's `EnvoyExtensionPolicy` has a field for it. So:
//! - Istio: an `EnvoyFilter` delivers the plugin as an ECDS extension configuration (the route
//!   Istio documents for wasm before `WasmPlugin`; istio-agent still pulls the OCI image), inserts
//!   it before the router on the engines' outbound port, and gives the engines' cluster the
//!   override-host policy with a header source and a fallback that refuses.
//! - Envoy Gateway: an `HTTPRoute` to the engines' Service, the `EnvoyExtensionPolicy` with the
//!   image, a `BackendTrafficPolicy` whose `endpointOverride` reads the header (its fallback is
//!   the policy's load balancer), and an `EnvoyPatchPolicy` that sets the two plugin fields the
//!   extension policy cannot (`allow_on_headers_stop_iteration`, `failure_policy: FAIL_RELOAD`).

use serde_json::{json, Value};
use sgl_envoy_router::config::{RouterConfig, UpstreamMode};

use crate::render::{refusing_policy, with_namespace, FILTER_PLUGIN};

const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
/// The resources' name in Kubernetes.
pub const RESOURCE: &str = "sgl-router";

/// Where the control plane finds what it installs.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    /// The module's OCI image, `oci://REGISTRY/REPOSITORY:TAG` (the scheme is optional).
    pub image: String,
    /// The hex sha256 of the image's manifest (`package` prints it; the same module always gives
    /// the same image).
    pub image_sha256: String,
    /// The engines' Kubernetes Service, `HOST:PORT` (HOST its cluster-local name).
    pub engines: String,
    /// The Kubernetes namespace the resources go in.
    pub namespace: String,
    /// Istio: the workloads whose sidecars run the filter, `KEY=VALUE` (none: every workload of
    /// the namespace).
    pub selector: Option<String>,
    /// Envoy Gateway: the Gateway and its listener the route attaches to.
    pub gateway: String,
    pub gateway_listener: String,
}

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("--engines must be HOST:PORT of the engines' Service, got `{0}`")]
    Engines(String),
    #[error("--selector must be KEY=VALUE, got `{0}`")]
    Selector(String),
    #[error("prefix_index: the indexer's clusters are not rendered for a mesh; install it as a Service and list it in the mesh yourself, or route on the approximate tree")]
    PrefixIndex,
    #[error("the configuration as the mesh runs it is invalid: {0}")]
    Invalid(String),
    #[error("cannot write YAML: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
}

/// The engines' Service.
struct Service<'a> {
    host: &'a str,
    port: u16,
}

impl<'a> Service<'a> {
    fn parse(engines: &'a str) -> Result<Self, MeshError> {
        let (host, port) = engines.rsplit_once(':').ok_or_else(|| MeshError::Engines(engines.to_string()))?;
        let port = port.parse().map_err(|_| MeshError::Engines(engines.to_string()))?;
        if host.is_empty() {
            return Err(MeshError::Engines(engines.to_string()));
        }
        Ok(Self { host, port })
    }

    /// The Service's name: the host's first label.
    fn name(&self) -> &str {
        self.host.split('.').next().unwrap_or(self.host)
    }
}

/// The router configuration as the plugin gets it (its namespace named, the engines reached
/// through `cluster`), and the header it names an engine in.
fn plugin_config(config: &RouterConfig, cluster: &str) -> Result<(Value, String), MeshError> {
    if config.prefix_index.is_some() {
        return Err(MeshError::PrefixIndex);
    }
    let mut config = with_namespace(config);
    config.upstream.mode = UpstreamMode::OverrideHost;
    config.upstream.cluster = Some(cluster.to_string());
    let value = serde_json::to_value(&config).unwrap_or_default();
    // As the filter will read it: engines named by IP, say (the override header carries addresses).
    sgl_envoy_router::config::parse_and_validate(&value.to_string()).map_err(|errors| {
        MeshError::Invalid(errors.0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
    })?;
    Ok((value, config.upstream.header_name().to_string()))
}

fn documents(resources: &[Value], note: &str) -> Result<String, MeshError> {
    let mut out = format!("# Rendered by `sgl-envoy-router render`; {note}\n");
    for r in resources {
        out += "---\n";
        out += &serde_yaml_ng::to_string(r)?;
    }
    Ok(out)
}

/// The override-host policy the engines' cluster gets, reading `header`.
fn override_host(header: &str, fallback: Value) -> Value {
    json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": header}],
            "fallback_policy": {"policies": [{"typed_extension_config": fallback}]},
        },
    }}]})
}

/// Istio's outbound cluster for `service`.
pub fn istio_cluster(host: &str, port: u16) -> String {
    format!("outbound|{port}||{host}")
}

/// The ECDS name of the plugin: namespaced, as Istio names its extension configurations.
pub fn istio_filter_name(namespace: &str) -> String {
    format!("{namespace}.{RESOURCE}")
}

pub fn render_istio(config: &RouterConfig, options: &MeshOptions) -> Result<String, MeshError> {
    let service = Service::parse(&options.engines)?;
    let cluster = istio_cluster(service.host, service.port);
    let (plugin, header) = plugin_config(config, &cluster)?;
    let filter_name = istio_filter_name(&options.namespace);
    let url = if options.image.contains("://") { options.image.clone() } else { format!("oci://{}", options.image) };
    let extension = json!({
        "name": filter_name,
        "typed_config": {
            "@type": WASM_TYPE,
            "config": {
                "name": FILTER_PLUGIN,
                "root_id": FILTER_PLUGIN,
                "vm_config": {
                    // A VM of its own: shared data and queues are keyed by vm_id, and Istio's
                    // WasmPlugins share the empty one.
                    "vm_id": FILTER_PLUGIN,
                    "runtime": "envoy.wasm.runtime.v8",
                    // istio-agent pulls the image and hands Envoy a local file; the cluster is
                    // never used (Istio writes the same placeholder for its WasmPlugins).
                    "code": {"remote": {
                        "http_uri": {"uri": url, "cluster": "_", "timeout": "60s"},
                        "sha256": options.image_sha256,
                    }},
                },
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": plugin.to_string()},
                // A crashed VM is made again on the next request; fail-closed would answer 503
                // on that worker thread until the proxy restarts, fail-open would send every
                // request to whatever engine the Service's own balancing picks.
                "failure_policy": "FAIL_RELOAD",
                "allow_on_headers_stop_iteration": true,
            },
        },
    });
    let mut spec = json!({"configPatches": [
        {"applyTo": "EXTENSION_CONFIG", "patch": {"operation": "ADD", "value": extension}},
        {
            "applyTo": "HTTP_FILTER",
            "match": {"context": "SIDECAR_OUTBOUND", "listener": {"portNumber": service.port, "filterChain": {"filter": {
                "name": "envoy.filters.network.http_connection_manager",
                "subFilter": {"name": "envoy.filters.http.router"},
            }}}},
            "patch": {"operation": "INSERT_BEFORE", "value": {
                "name": filter_name,
                "config_discovery": {
                    "config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
                    "type_urls": [WASM_TYPE],
                },
            }},
        },
        {
            "applyTo": "CLUSTER",
            "match": {"context": "SIDECAR_OUTBOUND", "cluster": {"service": service.host, "portNumber": service.port}},
            // No engine the filter named is in the cluster: a 503, never an engine it did not choose.
            "patch": {"operation": "MERGE", "value": {
                "load_balancing_policy": override_host(&header, refusing_policy()),
            }},
        },
    ]});
    if let Some(selector) = &options.selector {
        let (key, value) = selector.split_once('=').ok_or_else(|| MeshError::Selector(selector.clone()))?;
        spec["workloadSelector"] = json!({"labels": {key: value}});
    }
    let filter = json!({
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": RESOURCE, "namespace": options.namespace},
        "spec": spec,
    });
    documents(&[filter], "`kubectl apply -f` it after pushing the image (`package --oci`).")
}

/// Envoy Gateway's cluster for the first rule of `route` in `namespace`.
pub fn envoy_gateway_cluster(namespace: &str) -> String {
    format!("httproute/{namespace}/{RESOURCE}/rule/0")
}

/// The name Envoy Gateway gives the plugin's HTTP filter (and its `vm_id`, without the prefix).
pub fn envoy_gateway_filter_name(namespace: &str) -> String {
    format!("envoy.filters.http.wasm/envoyextensionpolicy/{namespace}/{RESOURCE}/wasm/0")
}

pub fn render_envoy_gateway(config: &RouterConfig, options: &MeshOptions) -> Result<String, MeshError> {
    let service = Service::parse(&options.engines)?;
    let ns = options.namespace.as_str();
    let (plugin, header) = plugin_config(config, &envoy_gateway_cluster(ns))?;
    let target = json!([{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": RESOURCE}]);
    let route = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": RESOURCE, "namespace": ns},
        "spec": {
            "parentRefs": [{"name": options.gateway, "sectionName": options.gateway_listener}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"name": service.name(), "port": service.port}],
                // Generations run for minutes; the route's default would cut them.
                "timeouts": {"request": "0s"},
            }],
        },
    });
    let image = options.image.trim_start_matches("oci://");
    let extension = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyExtensionPolicy",
        "metadata": {"name": RESOURCE, "namespace": ns},
        "spec": {
            "targetRefs": target,
            "wasm": [{
                "name": FILTER_PLUGIN,
                "rootID": FILTER_PLUGIN,
                "code": {"type": "Image", "image": {"url": image, "sha256": options.image_sha256}},
                "config": plugin,
                "failOpen": false,
            }],
        },
    });
    let traffic = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "BackendTrafficPolicy",
        "metadata": {"name": RESOURCE, "namespace": ns},
        "spec": {
            "targetRefs": target,
            "loadBalancer": {
                "type": "RoundRobin",
                "endpointOverride": {"extractFrom": [{"header": header}]},
            },
        },
    });
    let listener = format!("{ns}/{}/{}", options.gateway, options.gateway_listener);
    let plugin_path = format!("..http_filters[?(@.name=='{}')].typed_config.config", envoy_gateway_filter_name(ns));
    let set = |path: &str, value: Value| {
        json!({
            "type": "type.googleapis.com/envoy.config.listener.v3.Listener",
            "name": listener,
            "operation": {"op": "add", "jsonPath": plugin_path, "path": path, "value": value},
        })
    };
    let patch = json!({
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyPatchPolicy",
        "metadata": {"name": RESOURCE, "namespace": ns},
        "spec": {
            "targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": options.gateway},
            "type": "JSONPatch",
            "jsonPatches": [
                set("/allow_on_headers_stop_iteration", json!(true)),
                set("/failure_policy", json!("FAIL_RELOAD")),
            ],
        },
    });
    documents(
        &[route, extension, traffic, patch],
        "the Gateway must be in the same namespace, and Envoy Gateway's `extensionApis.enableEnvoyPatchPolicy: true`.",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> MeshOptions {
        MeshOptions {
            image: "registry.example/sgl-router:v1".into(),
            image_sha256: "ab".repeat(32),
            engines: "engines.llm.svc.cluster.local:8000".into(),
            namespace: "llm".into(),
            selector: Some("app=client".into()),
            gateway: "eg".into(),
            gateway_listener: "http".into(),
        }
    }

    fn config() -> RouterConfig {
        sgl_envoy_router::config::parse_document(
            "workers: [{id: A, url: 'http://10.0.0.1:8000', model: m}]\nmodels: {m: {buckets: [{id: all, groups: {plain: {policy: {type: round_robin}}}}]}}",
        )
        .unwrap()
    }

    fn docs(text: &str) -> Vec<Value> {
        text.split("\n---\n").skip(1).map(|d| serde_yaml_ng::from_str(d).unwrap()).collect()
    }

    #[test]
    fn istio_names_the_engines_cluster_and_sets_what_wasmplugin_cannot() {
        let out = docs(&render_istio(&config(), &options()).unwrap());
        let patches = &out[0]["spec"]["configPatches"];
        let plugin = &patches[0]["patch"]["value"]["typed_config"]["config"];
        assert_eq!(plugin["allow_on_headers_stop_iteration"], true);
        assert_eq!(plugin["vm_config"]["code"]["remote"]["http_uri"]["uri"], "oci://registry.example/sgl-router:v1");
        let router: Value = serde_json::from_str(plugin["configuration"]["value"].as_str().unwrap()).unwrap();
        assert_eq!(router["upstream"]["cluster"], "outbound|8000||engines.llm.svc.cluster.local");
        assert_eq!(router["namespace"], "sgl_router");
        assert_eq!(patches[1]["patch"]["value"]["name"], "llm.sgl-router");
        assert_eq!(out[0]["spec"]["workloadSelector"]["labels"]["app"], "client");
        let policy = &patches[2]["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
        assert_eq!(policy["typed_config"]["override_host_sources"][0]["header"], "x-gateway-destination-endpoint");
    }

    #[test]
    fn envoy_gateway_patches_the_plugin_its_policy_names() {
        let out = docs(&render_envoy_gateway(&config(), &options()).unwrap());
        let kinds: Vec<&str> = out.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["HTTPRoute", "EnvoyExtensionPolicy", "BackendTrafficPolicy", "EnvoyPatchPolicy"]);
        assert_eq!(out[1]["spec"]["wasm"][0]["config"]["upstream"]["cluster"], "httproute/llm/sgl-router/rule/0");
        let path = out[3]["spec"]["jsonPatches"][0]["operation"]["jsonPath"].as_str().unwrap();
        assert!(path.contains("envoyextensionpolicy/llm/sgl-router/wasm/0"), "{path}");
    }

    #[test]
    fn a_bad_service_and_an_indexer_are_refused() {
        let mut o = options();
        o.engines = "engines".into();
        assert!(matches!(render_istio(&config(), &o), Err(MeshError::Engines(_))));
        let mut c = config();
        c.prefix_index = serde_json::from_value(json!({"urls": ["http://10.0.0.9:9000"]})).unwrap();
        assert!(matches!(render_envoy_gateway(&c, &options()), Err(MeshError::PrefixIndex)));
    }
}
