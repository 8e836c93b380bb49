//! Installing the filter the way a mesh or a gateway does: the module as a Wasm OCI image pushed
//! to a registry and pulled back by other implementations.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what} failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

fn tool(name: &str) -> &str {
    let found =
        Command::new("sh").args(["-c", &format!("command -v {name}")]).output().is_ok_and(|o| o.status.success());
    assert!(found, "{name} not found: run scripts/setup --tests (it installs Debian's docker-registry and skopeo)");
    name
}

/// Debian's `docker-registry` (the CNCF distribution registry) on a loopback port.
fn registry(dir: &Path) -> (Process, u16) {
    let port = free_port();
    let config = dir.join("registry.yml");
    let storage = dir.join("registry");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {}}}}}\nhttp: {{addr: 127.0.0.1:{port}}}\n",
            storage.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(tool("docker-registry"));
    cmd.args(["serve", &config.to_string_lossy()]);
    let p = Process::spawn("docker-registry", &mut cmd, dir.join("registry.log"));
    let a = agent();
    wait_for("the registry", Duration::from_secs(20), || {
        a.get(&format!("http://127.0.0.1:{port}/v2/")).call().ok().filter(|r| r.status() == 200)
    });
    (p, port)
}

/// Pulls `image` as Istio's and Envoy Gateway's fetchers do, in Python's standard library (an
/// implementation independent of ours and of skopeo's): the manifest, its compat annotation, the
/// last layer, `plugin.wasm` out of its tar+gzip. Prints the manifest digest the registry gave.
const PULL: &str = r#"
import gzip, io, json, sys, tarfile, urllib.request
registry, name, tag, out = sys.argv[1:5]
req = urllib.request.Request(f"http://{registry}/v2/{name}/manifests/{tag}",
                             headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
with urllib.request.urlopen(req) as r:
    digest, manifest = r.headers["Docker-Content-Digest"], json.load(r)
assert manifest["annotations"]["module.wasm.image/variant"] == "compat", manifest
layer = manifest["layers"][-1]
assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip", layer
with urllib.request.urlopen(f"http://{registry}/v2/{name}/blobs/{layer['digest']}") as r:
    blob = r.read()
with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as t:
    open(out, "wb").write(t.extractfile("plugin.wasm").read())
print(digest)
"#;

/// `package --oci` and `--oci-archive` write an image that skopeo pushes to a real registry and
/// that pulls back, by another implementation, byte-identical, under the digest `package` printed.
#[test]
fn the_packaged_image_round_trips_through_a_registry() {
    let dir = scratch_dir("package");
    let module = wasm_module();
    let (_registry, port) = registry(&dir);
    let host = format!("127.0.0.1:{port}");
    let (layout, archive) = (dir.join("layout"), dir.join("image.tar"));
    let printed = |out: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix("image digest "))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("no digest in {out}"))
            .to_string()
    };
    let mut cli = Command::new(cli_bin());
    let from_dir = printed(&run(
        "package --oci",
        cli.args(["package", "--tag", "v1", "--oci"]).arg(&layout).arg("--wasm").arg(&module),
    ));
    let mut cli = Command::new(cli_bin());
    let from_archive = printed(&run(
        "package --oci-archive",
        cli.args(["package", "--tag", "v2", "--oci-archive"]).arg(&archive).arg("--wasm").arg(&module),
    ));
    assert_eq!(from_dir, from_archive, "the same module, the same image");

    for (source, tag) in
        [(format!("oci:{}:v1", layout.display()), "v1"), (format!("oci-archive:{}:v2", archive.display()), "v2")]
    {
        run(
            "skopeo copy",
            Command::new(tool("skopeo")).args([
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                &source,
                &format!("docker://{host}/sgl-router:{tag}"),
            ]),
        );
        let pulled = dir.join(format!("pulled-{tag}.wasm"));
        let digest = run(
            "the Python pull",
            Command::new(repo_root().join(".venv/bin/python"))
                .args(["-c", PULL, &host, "sgl-router", tag])
                .arg(&pulled),
        );
        assert_eq!(digest.trim(), from_dir, "the registry serves the manifest `package` wrote, unchanged");
        assert!(
            std::fs::read(&pulled).unwrap() == std::fs::read(&module).unwrap(),
            "plugin.wasm pulled for {tag} differs from the module"
        );
    }
}

// ---- The control planes' shapes -------------------------------------------------------------
//
// Each test renders the resources for one control plane, turns them into the Envoy configuration
// that control plane sends (per docs/deploy.md and the control planes' sources: what istiod and
// istio-agent, or Envoy Gateway's translator, make of them), and runs it in real Envoy at two
// worker threads with no bootstrap service. Only the parts of the resources the router's
// rendering uses are converted; anything else fails the conversion loudly.

const ENGINES_HOST: &str = "engines.llm.svc.cluster.local";
const ENGINES_PORT: u16 = 8000;

/// The router of `sims`: one round-robin group whose engines take one request at a time.
fn mesh_router(sims: &[&Sim]) -> serde_json::Value {
    serde_json::json!({
        "workers": sims.iter().map(|s| s.worker_json()).collect::<Vec<_>>(),
        "health": {"interval_ms": 200, "failure_threshold": 2, "success_threshold": 1},
        "models": {"demo-model": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {
            "type": "round_robin", "admission": {"max_inflight_requests": 1}}}}}]}},
    })
}

/// `render ROUTER --istio|--envoy-gateway`, as YAML documents.
fn render_mesh(router: &serde_json::Value, dir: &Path, flag: &str) -> Vec<serde_json::Value> {
    let path = dir.join("router.json");
    std::fs::write(&path, router.to_string()).unwrap();
    let out = run(
        "render",
        Command::new(cli_bin()).arg("render").arg(&path).arg(flag).arg("--wasm").arg(wasm_module()).args([
            "--image",
            "127.0.0.1:5000/sgl-router:v1",
            "--engines",
            &format!("{ENGINES_HOST}:{ENGINES_PORT}"),
            "--k8s-namespace",
            "llm",
        ]),
    );
    out.split("\n---\n").skip(1).map(|d| serde_yaml_ng::from_str(d).unwrap()).collect()
}

/// The stats labels `render` gives its own bootstraps (a mesh's proxy config can carry the same).
fn stats_config(router_dir: &Path) -> serde_json::Value {
    let rendered = render(
        &serde_json::from_str(&std::fs::read_to_string(router_dir.join("router.json")).unwrap()).unwrap(),
        router_dir,
        1,
        2,
    );
    let yaml: serde_json::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(rendered).unwrap()).unwrap();
    yaml["stats_config"].clone()
}

/// Writes `value` to `dir/file` by a rename, as a file Envoy watches.
fn replace(dir: &Path, file: &str, value: &serde_json::Value) {
    let temporary = dir.join(format!(".{file}.new"));
    std::fs::write(&temporary, serde_json::to_vec(value).unwrap()).unwrap();
    std::fs::rename(&temporary, dir.join(file)).unwrap();
}

fn watched(dir: &Path, file: &str) -> serde_json::Value {
    serde_json::json!({
        "path_config_source": {"path": dir.join(file), "watched_directory": {"path": dir}},
        "resource_api_version": "V3",
    })
}

fn endpoints(cluster: &str, sims: &[&Sim]) -> serde_json::Value {
    let lb: Vec<serde_json::Value> = sims
        .iter()
        .map(|s| serde_json::json!({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": s.port}}}}))
        .collect();
    serde_json::json!({"resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": cluster, "endpoints": [{"lb_endpoints": lb}],
    }]})
}

/// An EDS cluster named `name`, its endpoints in `dir/eds.json`, as a control plane builds a
/// Service's cluster.
fn eds_cluster(name: &str, dir: &Path) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "type": "EDS",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "eds_cluster_config": {"service_name": name, "eds_config": watched(dir, "eds.json")},
    })
}

/// Shallow-merges `patch` into `target`, key by key, as an EnvoyFilter MERGE does for the keys
/// the router's patches set.
fn merge(target: &mut serde_json::Value, patch: &serde_json::Value) {
    for (k, v) in patch.as_object().unwrap() {
        target[k] = v.clone();
    }
}

/// Envoy with `listener` and `clusters` and the stats labels, at two worker threads.
fn start_envoy(dir: &Path, port: u16, listener: serde_json::Value, clusters: Vec<serde_json::Value>) -> Envoy {
    let admin = free_port();
    let bootstrap = serde_json::json!({
        "node": {"id": "sidecar~127.0.0.1~client.llm~llm.svc.cluster.local", "cluster": "client.llm"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "stats_config": stats_config(dir),
        "static_resources": {"listeners": [listener], "clusters": clusters},
    });
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&bootstrap).unwrap()).unwrap();
    Envoy::start_on(&path, port, admin, dir, 2)
}

/// A listener on `port` whose connection manager runs `filters` then the router, on `routes`.
fn listener(port: u16, filters: Vec<serde_json::Value>, routes: serde_json::Value) -> serde_json::Value {
    let mut http_filters = filters;
    http_filters.push(serde_json::json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}));
    serde_json::json!({
        "name": format!("0.0.0.0_{port}"),
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "per_connection_buffer_limit_bytes": 41943040,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "outbound_0.0.0.0_8000",
            "route_config": {"name": "8000", "virtual_hosts": [{"name": "engines", "domains": ["*"], "routes": routes}]},
            "http_filters": http_filters,
        }}]}],
    })
}

/// Round robin shared by both threads, health taking an engine out and back, and a cap of one
/// request per engine holding over both threads: what every shape must keep.
fn routes_checks_health_and_holds_caps(d: &Deployment) {
    d.wait_for_service(2);
    assert!(
        d.envoy.log_text().contains("does the service's work (lease taken)"),
        "a filter VM took the service's work"
    );
    let counts = d.served_counts(8);
    assert_eq!((counts.get("A"), counts.get("B")), (Some(&4), Some(&4)), "one rotation over both threads: {counts:?}");
    d.health_out_and_back("A");
    let answers = d.statuses_at_once(6);
    assert_eq!(answers.iter().filter(|s| **s == 200).count(), 2, "one per engine over both threads: {answers:?}");
}

fn slow(id: &str) -> SimSpec {
    SimSpec { token_delay_ms: 20, ..SimSpec::plain(id) }
}

/// `render --istio` as istiod and istio-agent hand it to a sidecar: the plugin by ECDS (the
/// agent's local copy of the module, checked against the image digest `package` gives), inserted
/// before the router on the engines' outbound listener, the engines' EDS cluster merged with the
/// override-host policy. An ECDS update adds an engine, which is health-checked before it serves.
#[test]
fn the_istio_shape_routes_and_follows_an_ecds_update() {
    let dir = scratch_dir("istio");
    let sims: Vec<Sim> = ["A", "B", "C"].into_iter().map(|id| Sim::start(slow(id), &dir)).collect();
    let (a, b) = (&sims[0], &sims[1]);
    let docs = render_mesh(&mesh_router(&[a, b]), &dir, "--istio");
    assert_eq!((docs.len(), docs[0]["kind"].as_str()), (1, Some("EnvoyFilter")));
    let patches = docs[0]["spec"]["configPatches"].as_array().unwrap().clone();
    let by = |apply: &str| {
        patches.iter().find(|p| p["applyTo"] == apply).unwrap_or_else(|| panic!("no {apply} patch")).clone()
    };
    let (extension, http_filter, cluster_patch) = (by("EXTENSION_CONFIG"), by("HTTP_FILTER"), by("CLUSTER"));
    assert_eq!(http_filter["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(
        http_filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    assert_eq!(http_filter["match"]["listener"]["portNumber"], ENGINES_PORT);

    // istio-agent: the image it pulls must match the sha256 the resource names.
    let mut cli = Command::new(cli_bin());
    let packaged =
        run("package", cli.args(["package", "--oci"]).arg(dir.join("image")).arg("--wasm").arg(wasm_module()));
    let ecds_for = |docs: &[serde_json::Value]| {
        let mut ext = docs[0]["spec"]["configPatches"][0]["patch"]["value"].clone();
        let code = &mut ext["typed_config"]["config"]["vm_config"]["code"];
        let sha = code["remote"]["sha256"].as_str().unwrap().to_string();
        assert!(
            packaged.contains(&format!("image digest sha256:{sha}")),
            "the rendered sha256 is the image's: {packaged}"
        );
        *code = serde_json::json!({"local": {"filename": wasm_module()}});
        ext["@type"] = serde_json::json!("type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig");
        serde_json::json!({"resources": [ext]})
    };
    replace(&dir, "ecds.json", &ecds_for(&docs));
    let cluster_name = format!("outbound|{ENGINES_PORT}||{ENGINES_HOST}");
    replace(&dir, "eds.json", &endpoints(&cluster_name, &[a, b]));
    let mut cluster = eds_cluster(&cluster_name, &dir);
    assert_eq!(cluster_patch["patch"]["operation"], "MERGE");
    merge(&mut cluster, &cluster_patch["patch"]["value"]);
    // istiod: the filter by ADS (here the file it would send), the route to the Service's cluster.
    let mut discovered = http_filter["patch"]["value"].clone();
    assert!(discovered["config_discovery"]["config_source"]["ads"].is_object());
    discovered["config_discovery"]["config_source"] = watched(&dir, "ecds.json");
    assert_eq!(discovered["name"], extension["patch"]["value"]["name"], "the filter names the extension");
    let port = free_port();
    let routes = serde_json::json!([{"match": {"prefix": "/"}, "route": {"cluster": cluster_name, "timeout": "0s"}}]);
    let envoy = start_envoy(&dir, port, listener(port, vec![discovered], routes), vec![cluster]);
    let d = Deployment { sims, envoy, dir: dir.clone() };
    routes_checks_health_and_holds_caps(&d);

    // An engine added by an ECDS update (and to the Service's endpoints) is health-checked: one
    // that fails its checks is taken out, and serves once they pass.
    let c = d.sim("C");
    c.control(serde_json::json!({"health": {"status": 503}}));
    let (a, b) = (d.sim("A"), d.sim("B"));
    let docs = render_mesh(&mesh_router(&[a, b, c]), &dir, "--istio");
    replace(&dir, "eds.json", &endpoints(&cluster_name, &[a, b, c]));
    replace(&dir, "ecds.json", &ecds_for(&docs));
    wait_for("C checked and out", Duration::from_secs(15), || {
        let monitored = d.envoy.metric("sgl_router_inflight{worker=\"C\"}").is_some();
        (monitored && d.envoy.metric("sgl_router_healthy_workers{}")? == 2.0).then_some(())
    });
    assert!(!d.served_counts(6).contains_key("C"), "C fails its health checks: no traffic");
    c.control(serde_json::json!({"health": {"status": null}}));
    wait_for("C in rotation", Duration::from_secs(15), || d.served_counts(6).contains_key("C").then_some(()));

    // An update that removes B (from the plugin's configuration and the Service's endpoints):
    // B gets nothing once it is live.
    let docs = render_mesh(&mesh_router(&[a, c]), &dir, "--istio");
    replace(&dir, "ecds.json", &ecds_for(&docs));
    replace(&dir, "eds.json", &endpoints(&cluster_name, &[a, c]));
    wait_for("B gone from the rotation", Duration::from_secs(15), || {
        let counts = d.served_counts(6);
        (!counts.contains_key("B") && counts.contains_key("A") && counts.contains_key("C")).then_some(())
    });
    assert!(!d.served_counts(12).contains_key("B"), "a removed engine gets nothing");
}

/// `render --envoy-gateway` as Envoy Gateway's translator hands it to its proxy: the plugin inline
/// in the listener, disabled there and enabled on the HTTPRoute's route, its VM named after the
/// policy, its module served over HTTP by the controller (`wasm_cluster`, checked by the module's
/// sha256); the EnvoyPatchPolicy's JSON patches applied to that listener; the route's cluster
/// with the BackendTrafficPolicy's endpoint override.
#[test]
fn the_envoy_gateway_shape_routes_checks_health_and_holds_caps() {
    let dir = scratch_dir("envoy_gateway");
    let sims: Vec<Sim> = ["A", "B"].into_iter().map(|id| Sim::start(slow(id), &dir)).collect();
    let docs = render_mesh(&mesh_router(&[&sims[0], &sims[1]]), &dir, "--envoy-gateway");
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k}")).clone();
    let (route, extension, traffic, patch) =
        (kind("HTTPRoute"), kind("EnvoyExtensionPolicy"), kind("BackendTrafficPolicy"), kind("EnvoyPatchPolicy"));
    let ns = route["metadata"]["namespace"].as_str().unwrap().to_string();
    let route_name = route["metadata"]["name"].as_str().unwrap().to_string();
    for policy in [&extension, &traffic] {
        assert_eq!(policy["spec"]["targetRefs"][0]["name"], route["metadata"]["name"], "the policies target the route");
    }

    // The controller serves the module it pulled; the proxy checks it by the module's sha256.
    let served = dir.join("served");
    std::fs::create_dir_all(&served).unwrap();
    std::fs::copy(wasm_module(), served.join("plugin.wasm")).unwrap();
    let server_port = free_port();
    let mut http = Command::new(repo_root().join(".venv/bin/python"));
    http.args(["-m", "http.server", &server_port.to_string(), "--bind", "127.0.0.1", "--directory"]).arg(&served);
    let _server = Process::spawn("wasm server", &mut http, dir.join("wasm-server.log"));
    wait_for("the wasm server", Duration::from_secs(10), || {
        agent().get(&format!("http://127.0.0.1:{server_port}/plugin.wasm")).call().ok().filter(|r| r.status() == 200)
    });
    let mut cli = Command::new(cli_bin());
    let packaged =
        run("package", cli.args(["package", "--oci"]).arg(dir.join("image")).arg("--wasm").arg(wasm_module()));
    let module_sha =
        packaged.lines().find_map(|l| l.strip_prefix("module sha256 ")).unwrap().split(' ').next().unwrap();
    let image_sha = extension["spec"]["wasm"][0]["code"]["image"]["sha256"].as_str().unwrap();
    assert!(
        packaged.contains(&format!("image digest sha256:{image_sha}")),
        "the policy checks the image `package` wrote"
    );

    // The translator's filter (internal/xds/translator/wasm.go).
    let wasm = &extension["spec"]["wasm"][0];
    let vm = format!("envoyextensionpolicy/{ns}/{}/wasm/0", extension["metadata"]["name"].as_str().unwrap());
    let filter_name = format!("envoy.filters.http.wasm/{vm}");
    let filter = serde_json::json!({
        "name": filter_name,
        "disabled": true,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": wasm["name"],
                "root_id": wasm["rootID"],
                "vm_config": {"vm_id": vm, "runtime": "envoy.wasm.runtime.v8", "code": {"remote": {
                    "http_uri": {"uri": format!("http://127.0.0.1:{server_port}/plugin.wasm"), "cluster": "wasm_cluster", "timeout": "10s"},
                    "sha256": module_sha,
                }}},
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": wasm["config"].to_string()},
                "fail_open": wasm["failOpen"],
            },
        },
    });
    let cluster_name = format!("httproute/{ns}/{route_name}/rule/0");
    let rule = &route["spec"]["rules"][0];
    assert_eq!(rule["matches"][0]["path"]["value"], "/");
    let routes = serde_json::json!([{
        "match": {"prefix": "/"},
        "route": {"cluster": cluster_name, "timeout": rule["timeouts"]["request"]},
        "typed_per_filter_config": {filter_name.clone(): {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}},
    }]);
    let port = free_port();
    let gateway = patch["spec"]["targetRef"]["name"].as_str().unwrap();
    let mut listener_json = listener(port, vec![filter], routes);
    listener_json["name"] = serde_json::json!(format!("{ns}/{gateway}/http"));

    // The EnvoyPatchPolicy: each patch adds a field to the plugin the JSONPath names by filter name.
    for p in patch["spec"]["jsonPatches"].as_array().unwrap() {
        assert_eq!(
            (p["type"].as_str(), &p["name"]),
            (Some("type.googleapis.com/envoy.config.listener.v3.Listener"), &listener_json["name"])
        );
        let op = &p["operation"];
        assert_eq!(op["op"], "add");
        let json_path = op["jsonPath"].as_str().unwrap();
        let named = json_path
            .strip_prefix("..http_filters[?(@.name=='")
            .and_then(|r| r.strip_suffix("')].typed_config.config"))
            .unwrap_or_else(|| panic!("a JSONPath this conversion does not know: {json_path}"));
        let filters =
            listener_json["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"].as_array_mut().unwrap();
        let target = filters.iter_mut().find(|f| f["name"] == named).unwrap_or_else(|| panic!("no filter {named}"));
        let field = op["path"].as_str().unwrap().trim_start_matches('/');
        target["typed_config"]["config"][field] = op["value"].clone();
    }

    // The route's cluster: EDS, with the policy's load balancer and endpoint override.
    let lb = &traffic["spec"]["loadBalancer"];
    assert_eq!(lb["type"], "RoundRobin");
    let header = lb["endpointOverride"]["extractFrom"][0]["header"].as_str().unwrap();
    replace(&dir, "eds.json", &endpoints(&cluster_name, &[&sims[0], &sims[1]]));
    let mut cluster = eds_cluster(&cluster_name, &dir);
    cluster.as_object_mut().unwrap().remove("lb_policy");
    cluster["load_balancing_policy"] = serde_json::json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"header": header}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
            }}]},
        },
    }}]});
    let wasm_cluster = serde_json::json!({
        "name": "wasm_cluster", "type": "STATIC", "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "wasm_cluster", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": server_port}}}}]}]},
    });
    let envoy = start_envoy(&dir, port, listener_json, vec![cluster, wasm_cluster]);
    let d = Deployment { sims, envoy, dir: dir.clone() };
    routes_checks_health_and_holds_caps(&d);
}
