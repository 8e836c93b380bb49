//! `render --dynamic DIR` and `update --dynamic DIR` (spec §8): an Envoy whose listener, filter
//! configuration and clusters come from files it watches, so the engine set changes without a
//! restart. The filter configuration is discovered on its own (ECDS): replacing it reaches the
//! connections already open at their next request, where a listener update would leave them on
//! the old configuration until they drain. The service's bootstrap configuration is empty: it
//! follows the filter's.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sgl_envoy_router::config::RouterConfig;

use crate::render::{
    clusters, http_filter, listener, plugin_json, service_extensions, socket, stats_tags, with_namespace, RenderOptions,
};
use sgl_envoy_router::wiring::upstream::ENGINES_CLUSTER;

pub const BOOTSTRAP: &str = "envoy.yaml";
pub const LISTENERS: &str = "listeners.yaml";
pub const CLUSTERS: &str = "clusters.yaml";
pub const FILTER: &str = "filter.yaml";
/// What `render` was given, so `update` renders the same way.
pub const OPTIONS: &str = "render-options.json";
/// The ECDS resource name of the filter configuration.
const FILTER_NAME: &str = "sgl_router";
const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const EXTENSION_TYPE: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
/// How long `update` waits for Envoy to take up new clusters before it routes to them.
const CLUSTER_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum DynamicError {
    #[error("{0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("cannot write YAML: {0}")]
    Yaml(#[from] serde_yaml_ng::Error),
    #[error("{0} is not from `render --dynamic`: {1}")]
    NotRendered(PathBuf, String),
    #[error(
        "the namespace was `{0}` and is `{1}` now: the service follows `{0}`; render the directory again to move it"
    )]
    NamespaceChanged(String, String),
    #[error("generation {given} is not above the running configuration's {running}: the service would not follow it")]
    GenerationNotAbove { given: u64, running: u64 },
    #[error(
        "cannot tell whether Envoy has {0}: {1}; the filter configuration was not replaced (run `update` again, \
         or pass --offline when no Envoy runs on this directory)"
    )]
    Unconfirmed(String, String),
}

/// Whether `update` confirms with Envoy's admin that it took up new engines before it routes to
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirm {
    /// Wait for Envoy to list every new cluster and engine host; fail when it cannot tell.
    WithEnvoy,
    /// No Envoy runs on the directory: write the files.
    Offline,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedOptions {
    wasm: String,
    listen_address: String,
    listen_port: u16,
    admin_port: u16,
}

impl From<&RenderOptions> for SavedOptions {
    fn from(o: &RenderOptions) -> Self {
        Self {
            wasm: o.wasm_path.clone(),
            listen_address: o.listen_address.clone(),
            listen_port: o.listen_port,
            admin_port: o.admin_port,
        }
    }
}

impl From<SavedOptions> for RenderOptions {
    fn from(o: SavedOptions) -> Self {
        Self {
            wasm_path: o.wasm,
            listen_address: o.listen_address,
            listen_port: o.listen_port,
            admin_port: o.admin_port,
        }
    }
}

/// The watched files' contents for one configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Watched {
    pub listeners: Value,
    pub clusters: Vec<Value>,
    pub filter: Value,
}

/// Absolute: Envoy resolves the paths in its files against its own working directory.
fn absolute(dir: &Path) -> Result<PathBuf, DynamicError> {
    fs::create_dir_all(dir).map_err(|e| DynamicError::Io(dir.to_path_buf(), e))?;
    dir.canonicalize().map_err(|e| DynamicError::Io(dir.to_path_buf(), e))
}

/// A file Envoy watches, by a rename into the directory it watches.
fn watched_source(dir: &Path, file: &str) -> Value {
    json!({
        "path_config_source": {
            "path": dir.join(file).to_string_lossy(),
            "watched_directory": {"path": dir.to_string_lossy()},
        },
        "resource_api_version": "V3",
    })
}

fn discovery_response(type_url: &str, resources: &[Value]) -> Value {
    let resources: Vec<Value> = resources
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(map) = r.as_object_mut() {
                map.insert("@type".to_string(), json!(type_url));
            }
            r
        })
        .collect();
    json!({"resources": resources})
}

pub fn watched(config: &RouterConfig, options: &RenderOptions, dir: &Path) -> Watched {
    let router_json = plugin_json(config);
    let discovered = json!({
        "name": FILTER_NAME,
        "config_discovery": {"config_source": watched_source(dir, FILTER), "type_urls": [WASM_TYPE]},
    });
    let filter = http_filter(&router_json, options)["typed_config"].clone();
    Watched {
        listeners: discovery_response(LISTENER_TYPE, &[listener(config, options, discovered)]),
        clusters: clusters(config),
        filter: json!({"resources": [{"@type": EXTENSION_TYPE, "name": FILTER_NAME, "typed_config": filter}]}),
    }
}

fn bootstrap(config: &RouterConfig, options: &RenderOptions, dir: &Path) -> Value {
    let namespace = config.namespace.as_deref().unwrap_or_default();
    json!({
        "node": {"id": "sgl-envoy-router", "cluster": "sgl-envoy-router"},
        "admin": {"address": socket("127.0.0.1", options.admin_port)},
        // Only the namespace: the service follows the filter configuration announced there.
        "bootstrap_extensions": service_extensions(config, &json!({"namespace": namespace}).to_string(), options),
        "stats_config": {"stats_tags": stats_tags()},
        "dynamic_resources": {
            "lds_config": watched_source(dir, LISTENERS),
            "cds_config": watched_source(dir, CLUSTERS),
        },
    })
}

fn yaml(value: &Value, what: &str) -> Result<String, DynamicError> {
    Ok(format!(
        "# {what}; written by `sgl-envoy-router render --dynamic` or `update --dynamic`, edit the router configuration instead.\n{}",
        serde_yaml_ng::to_string(value)?
    ))
}

/// Writes `text` to `dir/file` by a rename, so Envoy never reads half a file. Returns whether the
/// file changed.
fn replace(dir: &Path, file: &str, text: &str) -> Result<bool, DynamicError> {
    let path = dir.join(file);
    if fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return Ok(false);
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let temporary = dir.join(format!(".{file}.{}.{nanos}.new", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&temporary)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()
    };
    write().map_err(|e| DynamicError::Io(temporary.clone(), e))?;
    fs::rename(&temporary, &path).map_err(|e| DynamicError::Io(path, e))?;
    // The rename itself is durable only once the directory is.
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| DynamicError::Io(dir.to_path_buf(), e))?;
    Ok(true)
}

/// The directory's lock, held while `render` or `update` writes it: two at once would interleave
/// their files.
fn lock(dir: &Path) -> Result<File, DynamicError> {
    let path = dir.join(".sgl-envoy-router.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| DynamicError::Io(path.clone(), e))?;
    file.lock().map_err(|e| DynamicError::Io(path, e))?;
    Ok(file)
}

/// The router configuration `dir`'s filter configuration carries, as JSON (`None`: no file yet).
fn running_config(dir: &Path) -> Option<Value> {
    let text = fs::read_to_string(dir.join(FILTER)).ok()?;
    let doc = serde_yaml_ng::from_str::<Value>(&text).ok()?;
    let embedded = doc.pointer("/resources/0/typed_config/config/configuration/value")?.as_str()?;
    serde_json::from_str(embedded).ok()
}

/// `config` with the generation it goes out as (spec §8): its own when it names one, above the
/// running one; the running one when nothing else changed; else the clock in Unix ms, above the
/// running one.
fn stamped(config: &RouterConfig, running: Option<Value>) -> Result<RouterConfig, DynamicError> {
    let mut config = with_namespace(config);
    let mut running = running.unwrap_or(Value::Null);
    // The bootstrap's service was told the namespace once, by `render`.
    if let (Some(was), Some(now)) = (running["namespace"].as_str(), config.namespace.as_deref()) {
        if was != now {
            return Err(DynamicError::NamespaceChanged(was.to_string(), now.to_string()));
        }
    }
    let generation = running.get("generation").and_then(Value::as_u64).unwrap_or(0);
    if config.generation != 0 {
        if config.generation <= generation {
            return Err(DynamicError::GenerationNotAbove { given: config.generation, running: generation });
        }
        return Ok(config);
    }
    if let Some(map) = running.as_object_mut() {
        map.remove("generation");
    }
    if serde_json::to_value(&config).is_ok_and(|c| c == running) {
        config.generation = generation;
        return Ok(config);
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    config.generation = now.max(generation + 1);
    Ok(config)
}

fn write_clusters(dir: &Path, clusters: &[Value]) -> Result<bool, DynamicError> {
    replace(dir, CLUSTERS, &yaml(&discovery_response(CLUSTER_TYPE, clusters), "The engines' and indexers' clusters")?)
}

/// `render --dynamic DIR`: every file, from scratch. Returns the bootstrap's path.
pub fn render_dynamic(config: &RouterConfig, options: &RenderOptions, dir: &Path) -> Result<PathBuf, DynamicError> {
    let dir = absolute(dir)?;
    let _lock = lock(&dir)?;
    // Rendering writes the service's namespace too: it may move.
    let running = running_config(&dir).map(|mut r| {
        if let Some(map) = r.as_object_mut() {
            map.remove("namespace");
        }
        r
    });
    let config = stamped(config, running)?;
    let files = watched(&config, options, &dir);
    let saved = serde_json::to_string_pretty(&SavedOptions::from(options)).unwrap_or_default();
    replace(&dir, OPTIONS, &saved)?;
    write_clusters(&dir, &files.clusters)?;
    replace(&dir, FILTER, &yaml(&files.filter, "The router filter's configuration (ECDS)")?)?;
    replace(&dir, LISTENERS, &yaml(&files.listeners, "The listener")?)?;
    replace(&dir, BOOTSTRAP, &yaml(&bootstrap(&config, options, &dir), "Envoy's bootstrap")?)?;
    Ok(dir.join(BOOTSTRAP))
}

/// What `update` did, for its report.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Updated {
    pub clusters_added: Vec<String>,
    pub clusters_removed: Vec<String>,
    pub filter: bool,
    pub listener: bool,
}

fn cluster_names(clusters: &[Value]) -> Vec<String> {
    clusters.iter().filter_map(|c| c["name"].as_str().map(str::to_string)).collect()
}

/// The clusters `dir` has now, as `render` or the last `update` wrote them.
fn current_clusters(dir: &Path) -> Result<Vec<Value>, DynamicError> {
    let path = dir.join(CLUSTERS);
    let text = fs::read_to_string(&path).map_err(|e| DynamicError::Io(path.clone(), e))?;
    let doc: Value =
        serde_yaml_ng::from_str(&text).map_err(|e| DynamicError::NotRendered(path.clone(), e.to_string()))?;
    let mut clusters = doc["resources"]
        .as_array()
        .cloned()
        .ok_or_else(|| DynamicError::NotRendered(path, "no `resources`".to_string()))?;
    for c in &mut clusters {
        if let Some(map) = c.as_object_mut() {
            map.remove("@type");
        }
    }
    Ok(clusters)
}

/// `update ROUTER.yaml --dynamic DIR` on a valid configuration. Order keeps every request
/// routable: new clusters first (and, when Envoy's admin answers, until Envoy has them), then the
/// filter configuration, then the listener if its routes changed, and only after `settle` the
/// clusters of removed workers, whose streams still run (Envoy lets them finish either way; a
/// request routed just before the filter update must still find its cluster).
pub fn update(config: &RouterConfig, dir: &Path, settle: Duration, confirm: Confirm) -> Result<Updated, DynamicError> {
    let dir = absolute(dir)?;
    let _lock = lock(&dir)?;
    let config = &stamped(config, running_config(&dir))?;
    let options_path = dir.join(OPTIONS);
    let saved = fs::read_to_string(&options_path).map_err(|e| DynamicError::Io(options_path.clone(), e))?;
    let options: RenderOptions = serde_json::from_str::<SavedOptions>(&saved)
        .map_err(|e| DynamicError::NotRendered(options_path, e.to_string()))?
        .into();
    let files = watched(config, &options, &dir);
    let old = current_clusters(&dir)?;
    let (old_names, new_names) = (cluster_names(&old), cluster_names(&files.clusters));
    let mut report = Updated {
        clusters_added: new_names.iter().filter(|n| !old_names.contains(n)).cloned().collect(),
        clusters_removed: old_names.iter().filter(|n| !new_names.contains(n)).cloned().collect(),
        ..Updated::default()
    };
    // The cluster routed by address: its old hosts stay until the settle, its new ones are awaited.
    let engines = config.upstream.shared_cluster().unwrap_or(ENGINES_CLUSTER);
    let kept_old =
        old.iter().filter(|c| c["name"].as_str().is_some_and(|n| report.clusters_removed.iter().any(|r| r == n)));
    // Until the filter names only the new engines, the old ones stay reachable: their clusters,
    // and their hosts in the engines cluster.
    let union: Vec<Value> = files
        .clusters
        .iter()
        .map(|c| match old.iter().find(|o| o["name"] == c["name"] && c["name"] == engines) {
            Some(previous) => with_hosts_of(c, previous),
            None => c.clone(),
        })
        .chain(kept_old.cloned())
        .collect();
    let shrinks = union != files.clusters;
    // What Envoy must list before the filter names it: each cluster, and each host of the engines
    // cluster, that the running filter configuration does not name (a host Envoy lacks gets no
    // request: the cluster's fallback refuses). Against the running filter, not the clusters file:
    // an update that could not confirm wrote the clusters already.
    let running = running_config(&dir)
        .and_then(|c| sgl_envoy_router::config::parse_and_validate(&c.to_string()).ok())
        .map_or_else(|| old.clone(), |c| clusters(&c));
    let mut awaited: Vec<String> = cluster_names(&files.clusters)
        .into_iter()
        .filter(|n| !cluster_names(&running).contains(n))
        .map(|n| format!("{n}::"))
        .collect();
    let old_engines = running.iter().find(|c| c["name"] == engines);
    if let Some(shared) = files.clusters.iter().find(|c| c["name"] == engines) {
        let before = old_engines.map(hosts_of).unwrap_or_default();
        awaited
            .extend(hosts_of(shared).into_iter().filter(|h| !before.contains(h)).map(|h| format!("{engines}::{h}::")));
    }
    write_clusters(&dir, &union)?;
    if !awaited.is_empty() && confirm == Confirm::WithEnvoy {
        wait_for_clusters(options.admin_port, &awaited)?;
    }
    report.filter = replace(&dir, FILTER, &yaml(&files.filter, "The router filter's configuration (ECDS)")?)?;
    report.listener = replace(&dir, LISTENERS, &yaml(&files.listeners, "The listener")?)?;
    if shrinks {
        std::thread::sleep(settle);
        write_clusters(&dir, &files.clusters)?;
    }
    Ok(report)
}

/// `cluster` with the hosts `previous` had and it lacks added.
fn with_hosts_of(cluster: &Value, previous: &Value) -> Value {
    let pointer = "/load_assignment/endpoints/0/lb_endpoints";
    let mut merged = cluster.clone();
    let old_hosts = previous.pointer(pointer).and_then(Value::as_array).cloned().unwrap_or_default();
    if let Some(hosts) = merged.pointer_mut(pointer).and_then(Value::as_array_mut) {
        for host in old_hosts {
            if !hosts.contains(&host) {
                hosts.push(host);
            }
        }
    }
    merged
}

/// `ip:port` of each host of a cluster, as Envoy's admin lists them.
fn hosts_of(cluster: &Value) -> Vec<String> {
    let hosts = cluster.pointer("/load_assignment/endpoints/0/lb_endpoints").and_then(Value::as_array);
    hosts
        .into_iter()
        .flatten()
        .filter_map(|h| {
            let a = &h["endpoint"]["address"]["socket_address"];
            Some(format!("{}:{}", a["address"].as_str()?, a["port_value"].as_u64()?))
        })
        .collect()
}

/// Waits until Envoy's admin lists a line starting with each of `prefixes` (`cluster::` or
/// `cluster::host::`); an error when it does not answer, or has not within [`CLUSTER_WAIT`].
fn wait_for_clusters(admin_port: u16, prefixes: &[String]) -> Result<(), DynamicError> {
    let what = || prefixes.iter().map(|p| p.trim_end_matches("::")).collect::<Vec<_>>().join(", ");
    let deadline = Instant::now() + CLUSTER_WAIT;
    loop {
        let Some(listing) = admin_get(admin_port, "/clusters") else {
            return Err(DynamicError::Unconfirmed(what(), format!("its admin on port {admin_port} did not answer")));
        };
        if prefixes.iter().all(|p| listing.lines().any(|l| l.starts_with(p.as_str()))) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(DynamicError::Unconfirmed(what(), format!("it did not list them within {CLUSTER_WAIT:?}")));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn admin_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(workers: &[&str]) -> RouterConfig {
        let workers: Vec<String> = workers
            .iter()
            .enumerate()
            .map(|(i, id)| format!(r#"{{"id": "{id}", "url": "http://127.0.0.1:{}", "model": "m"}}"#, 30001 + i))
            .collect();
        sgl_envoy_router::config::parse_and_validate(&format!(
            r#"{{"workers": [{}], "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "round_robin"}}}}}}}}]}}}}}}"#,
            workers.join(",")
        ))
        .unwrap()
    }

    fn names_in(dir: &Path) -> Vec<String> {
        cluster_names(&current_clusters(dir).unwrap())
    }

    #[test]
    fn an_update_adds_clusters_first_and_removes_them_last() {
        let dir = std::env::temp_dir().join(format!("sgl-dynamic-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let options = RenderOptions { admin_port: 1, ..RenderOptions::default() };
        let bootstrap = render_dynamic(&config(&["A", "B"]), &options, &dir).unwrap();
        let text = fs::read_to_string(bootstrap).unwrap();
        assert!(text.contains("lds_config") && text.contains("cds_config") && text.contains("watched_directory"));
        let filter = fs::read_to_string(dir.join(FILTER)).unwrap();
        assert!(filter.contains("\\\"id\\\":\\\"B\\\"") || filter.contains(r#""id":"B""#), "{filter}");
        let listeners = fs::read_to_string(dir.join(LISTENERS)).unwrap();
        assert!(listeners.contains("config_discovery") && !listeners.contains("\"workers\""));
        assert_eq!(names_in(&dir), ["sgl_A", "sgl_B", "sgl_engines"]);

        let report = update(&config(&["A", "C"]), &dir, Duration::ZERO, Confirm::Offline).unwrap();
        assert_eq!(
            report,
            Updated {
                clusters_added: vec!["sgl_C".into()],
                clusters_removed: vec!["sgl_B".into()],
                filter: true,
                listener: false
            }
        );
        assert_eq!(names_in(&dir), ["sgl_A", "sgl_C", "sgl_engines"]);
        let engines = current_clusters(&dir).unwrap().into_iter().find(|c| c["name"] == ENGINES_CLUSTER).unwrap();
        let ports: Vec<u64> = engines["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["endpoint"]["address"]["socket_address"]["port_value"].as_u64())
            .collect();
        assert_eq!(ports, [30001, 30002], "A and C (C took B's port), B's host gone after the settle");
        let again = update(&config(&["A", "C"]), &dir, Duration::ZERO, Confirm::WithEnvoy).unwrap();
        assert_eq!(again, Updated::default(), "nothing changed, nothing written, the generation kept");
        // No Envoy answers: it cannot tell whether Envoy has D, says so, and leaves the filter;
        // run again, it still cannot (the clusters file has D now, the running filter does not).
        for _ in 0..2 {
            let unconfirmed = update(&config(&["A", "C", "D"]), &dir, Duration::ZERO, Confirm::WithEnvoy);
            assert!(
                matches!(&unconfirmed, Err(DynamicError::Unconfirmed(what, _)) if what == "sgl_D, sgl_engines::127.0.0.1:30003"),
                "{unconfirmed:?}"
            );
            let ids: Vec<Value> =
                running_config(&dir).unwrap()["workers"].as_array().unwrap().iter().map(|w| w["id"].clone()).collect();
            assert_eq!(ids, ["A", "C"], "the filter still names A and C");
        }
        let _ = fs::remove_dir_all(&dir);
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sgl-dynamic-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn generation_in(dir: &Path) -> u64 {
        running_config(dir).and_then(|c| c["generation"].as_u64()).unwrap_or(0)
    }

    #[test]
    fn each_change_goes_out_above_the_running_generation() {
        let dir = scratch("generation");
        let options = RenderOptions { admin_port: 1, ..RenderOptions::default() };
        render_dynamic(&config(&["A"]), &options, &dir).unwrap();
        let first = generation_in(&dir);
        assert!(first > 0, "render writes one");
        update(&config(&["A", "B"]), &dir, Duration::ZERO, Confirm::Offline).unwrap();
        let second = generation_in(&dir);
        assert!(second > first, "{second} after {first}");
        let mut named = config(&["A"]);
        named.generation = second;
        let refused = update(&named, &dir, Duration::ZERO, Confirm::Offline);
        assert!(
            matches!(refused, Err(DynamicError::GenerationNotAbove { given, running }) if given == second && running == second)
        );
        named.generation = second + 10;
        update(&named, &dir, Duration::ZERO, Confirm::Offline).unwrap();
        assert_eq!(generation_in(&dir), second + 10, "a control plane's own order is kept");
        let _ = fs::remove_dir_all(&dir);
    }

    /// A fake Envoy admin that lists the new engine's host in the engines cluster only from its
    /// fourth answer on: `update` routes to it only after that.
    #[test]
    fn an_update_waits_for_envoy_to_list_each_new_engine_host() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let answers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let served = std::sync::Arc::clone(&answers);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut request = Vec::new();
                let mut byte = [0u8; 1];
                while !request.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
                    request.push(byte[0]);
                }
                let n = served.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut listing =
                    String::from("sgl_A::127.0.0.1:30001::cx_active::0\nsgl_C::127.0.0.1:30003::cx_active::0\n");
                if n >= 3 {
                    listing.push_str("sgl_engines::127.0.0.1:30003::cx_active::0\n");
                }
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{listing}", listing.len());
            }
        });
        let dir = scratch("hosts");
        let options = RenderOptions { admin_port: port, ..RenderOptions::default() };
        render_dynamic(&config(&["A", "B"]), &options, &dir).unwrap();
        let report = update(&config(&["A", "B", "C"]), &dir, Duration::ZERO, Confirm::WithEnvoy).unwrap();
        assert_eq!(report.clusters_added, ["sgl_C"]);
        assert!(answers.load(std::sync::atomic::Ordering::SeqCst) >= 4, "it waited for the host, not only the cluster");
        let _ = fs::remove_dir_all(&dir);
    }

    /// Updates racing on one directory each finish whole, one after another: every one succeeds,
    /// and the files left name one configuration.
    #[test]
    fn concurrent_updates_do_not_interleave() {
        let dir = scratch("concurrent");
        let options = RenderOptions { admin_port: 1, ..RenderOptions::default() };
        render_dynamic(&config(&["A", "B"]), &options, &dir).unwrap();
        let racers: Vec<_> = (0..8)
            .map(|i| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    let workers: &[&str] = if i % 2 == 0 { &["A", "B"] } else { &["A", "C", "D"] };
                    update(&config(workers), &dir, Duration::ZERO, Confirm::Offline)
                })
            })
            .collect();
        for racer in racers {
            racer.join().unwrap().unwrap();
        }
        let filter = running_config(&dir).unwrap();
        let ids: Vec<&str> = filter["workers"].as_array().unwrap().iter().filter_map(|w| w["id"].as_str()).collect();
        let clusters: Vec<String> = names_in(&dir).into_iter().filter(|n| n != ENGINES_CLUSTER).collect();
        let expected: Vec<String> = ids.iter().map(|id| format!("sgl_{id}")).collect();
        assert_eq!(clusters, expected, "the clusters are the filter's");
        let leftovers: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".new"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        let _ = fs::remove_dir_all(&dir);
    }

    /// The filter's and the service's plugin names differ: both are told one namespace, and an
    /// update cannot move it (the service was told it once).
    #[test]
    fn render_names_one_namespace_for_filter_and_service_and_update_keeps_it() {
        let dir = scratch("namespace");
        let options = RenderOptions { admin_port: 1, ..RenderOptions::default() };
        let bootstrap = render_dynamic(&config(&["A"]), &options, &dir).unwrap();
        assert!(fs::read_to_string(bootstrap).unwrap().contains(r#"value: '{"namespace":"sgl_router"}'"#));
        assert_eq!(running_config(&dir).unwrap()["namespace"], "sgl_router");
        let mut moved = config(&["A"]);
        moved.namespace = Some("pool-b".to_string());
        let refused = update(&moved, &dir, Duration::ZERO, Confirm::Offline);
        assert!(
            matches!(refused, Err(DynamicError::NamespaceChanged(ref was, ref now)) if was == "sgl_router" && now == "pool-b")
        );
        render_dynamic(&moved, &options, &dir).unwrap();
        assert_eq!(running_config(&dir).unwrap()["namespace"], "pool-b", "render moves it");
        let _ = fs::remove_dir_all(&dir);
    }
}
