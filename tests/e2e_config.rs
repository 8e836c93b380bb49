//! Configuration checks that involve the CLI and Envoy itself.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::fs;
use std::process::Command;

use common::*;

/// A bucket with a misspelled field: both the CLI and Envoy must name its path.
const BAD_FIELD_PATH: &str = "models.demo-model.buckets[0].limitz";

fn bad_router() -> serde_json::Value {
    serde_json::json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "demo-model"}],
        "models": {"demo-model": {"buckets": [{
            "id": "default", "limitz": {"max": 5},
            "groups": {"plain": {"policy": {"type": "round_robin"}}}
        }]}}
    })
}

#[test]
fn an_invalid_router_config_is_rejected_by_the_cli_naming_the_field() {
    let dir = scratch_dir("cli_invalid");
    let path = dir.join("bad.json");
    fs::write(&path, bad_router().to_string()).unwrap_or_default();
    let out = Command::new(cli_bin()).arg("validate").arg(&path).output().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(BAD_FIELD_PATH), "CLI output names the field: {stderr}");
}

#[test]
fn an_invalid_router_config_is_rejected_by_envoy_validate_naming_the_field() {
    let dir = scratch_dir("envoy_invalid");
    // Render a good configuration, then swap in the bad one where the plugins read it.
    let good = plain_router_for_ports(&[1]);
    let rendered = render(&good, &dir, free_port(), free_port());
    let text = fs::read_to_string(&rendered).unwrap_or_default();
    let mut yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap_or_default();
    let bad = serde_yaml_ng::Value::String(bad_router().to_string());
    yaml["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
        ["typed_config"]["config"]["configuration"]["value"] = bad.clone();
    yaml["bootstrap_extensions"][0]["typed_config"]["config"]["configuration"]["value"] = bad;
    fs::write(&rendered, serde_yaml_ng::to_string(&yaml).unwrap_or_default()).unwrap_or_default();

    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&rendered)
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "Envoy accepted a bad configuration:\n{log}");
    assert!(log.contains(BAD_FIELD_PATH), "Envoy's log names the field:\n{log}");
}

#[test]
fn a_valid_router_config_passes_envoy_validate() {
    let dir = scratch_dir("envoy_valid");
    let rendered = render(&plain_router_for_ports(&[1, 2]), &dir, free_port(), free_port());
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&rendered)
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn shipped_envoy_configs_match_their_router_configs() {
    let envoy_dir = repo_root().join("envoy");
    let mut checked = 0;
    for entry in fs::read_dir(&envoy_dir).unwrap_or_else(|e| panic!("{e}")).flatten() {
        let path = entry.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let Some(stem) = name.strip_suffix(".router.yaml") else {
            continue;
        };
        let out = Command::new(cli_bin()).arg("render").arg(&path).output().unwrap_or_else(|e| panic!("{e}"));
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let shipped_path = envoy_dir.join(format!("{stem}.yaml"));
        let shipped = fs::read_to_string(&shipped_path)
            .unwrap_or_else(|e| panic!("{} is missing ({e}); run scripts/render-configs", shipped_path.display()));
        assert!(
            shipped == String::from_utf8_lossy(&out.stdout),
            "{} drifted from {name}; run scripts/render-configs",
            shipped_path.display()
        );
        checked += 1;
    }
    assert!(checked >= 1, "no router configs found in envoy/");
}

fn plain_router_for_ports(ports: &[u16]) -> serde_json::Value {
    let workers: Vec<_> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| serde_json::json!({"id": format!("W{i}"), "url": format!("http://127.0.0.1:{p}"), "model": "demo-model"}))
        .collect();
    serde_json::json!({
        "workers": workers,
        "models": {"demo-model": {"buckets": [{"id": "default", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}}
    })
}

/// An operator's own bootstrap: two listeners, its own routes and filters, its own cluster.
fn existing_bootstrap(port: u16, other_port: u16, admin: u16, legacy_port: u16) -> serde_json::Value {
    let yaml = format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: api
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    per_connection_buffer_limit_bytes: 41943040
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: api
          route_config:
            virtual_hosts:
            - name: api
              domains: ["*"]
              routes:
              - match: {{path: /health}}
                route: {{cluster: legacy}}
              - match: {{prefix: /}}
                direct_response: {{status: 200, body: {{inline_string: "their own catch-all"}}}}
          http_filters:
          - name: envoy.filters.http.cors
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors}}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  - name: other
    address: {{socket_address: {{address: 127.0.0.1, port_value: {other_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: other
          route_config:
            virtual_hosts: [{{name: other, domains: ["*"], routes: [{{match: {{prefix: /}}, direct_response: {{status: 200, body: {{inline_string: "other listener"}}}}}}]}}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: legacy
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: legacy
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {legacy_port}}}}}}}}}]}}]
"#
    );
    serde_yaml_ng::from_str(&yaml).unwrap()
}

#[test]
fn the_rendered_snippet_merges_into_an_existing_bootstrap_and_routes_through_it() {
    let dir = scratch_dir("snippet_merge");
    let sims = [Sim::start(SimSpec::plain("A"), &dir), Sim::start(SimSpec::plain("B"), &dir)];
    let router_path = dir.join("router.json");
    std::fs::write(&router_path, plain_router(&sims).to_string()).unwrap();
    let out = std::process::Command::new(cli_bin())
        .args(["render", router_path.to_str().unwrap(), "--snippet", "--wasm", wasm_module().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    for says in [
        "http_filters, before envoy.filters.http.router",
        "before any catch-all route",
        "static_resources.clusters",
        "bootstrap_extensions",
        "stats_tags",
    ] {
        assert!(text.contains(says), "the snippet's comments name where each part goes: {says}\n{text}");
    }
    let snippet: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    assert!(snippet.get("admin").is_none() && snippet.get("static_resources").is_none(), "only the parts");

    // Merge it as an operator would, by hand: each part where its comment says.
    let (port, other_port, admin) = (free_port(), free_port(), free_port());
    let mut bootstrap = existing_bootstrap(port, other_port, admin, sims[1].port);
    let hcm = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array_mut().unwrap();
    filters.insert(filters.len() - 1, snippet["http_filters"][0].clone());
    let routes = hcm["route_config"]["virtual_hosts"][0]["routes"].as_array_mut().unwrap();
    for (i, route) in snippet["routes"].as_array().unwrap().iter().enumerate() {
        routes.insert(i, route.clone());
    }
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .extend(snippet["clusters"].as_array().unwrap().iter().cloned());
    bootstrap["bootstrap_extensions"] = snippet["bootstrap_extensions"].clone();
    bootstrap["stats_config"] = serde_json::json!({"stats_tags": snippet["stats_tags"]});
    let path = dir.join("merged.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&bootstrap).unwrap()).unwrap();

    let envoy = Envoy::start(&path, port, admin, &dir);
    let served: Vec<String> = (0..4)
        .map(|i| {
            let r = send(&envoy.url("/v1/chat/completions"), "POST", Some(&chat_body(&format!("q{i}"), 2, false)), &[]);
            assert_eq!(r.status, 200, "{}", r.body);
            assert!(r.header("x-sgl-worker").is_some(), "the filter picked the engine");
            r.engine()
        })
        .collect();
    assert!(
        served.contains(&"A".to_string()) && served.contains(&"B".to_string()),
        "round robin over both: {served:?}"
    );
    let r = send(&envoy.url("/generate"), "POST", Some(&serde_json::json!({"text": "x"})), &[]);
    assert_eq!(r.status, 200, "the only model serves /generate: {}", r.body);
    assert!(r.header("x-sgl-worker").is_some(), "through the filter's pick");
    // Their own routes, filters and listener still work.
    assert_eq!(send(&envoy.url("/somewhere"), "GET", None, &[]).body, "their own catch-all");
    let legacy = send(&envoy.url("/health"), "GET", None, &[]);
    assert_eq!(legacy.status, 200, "their own cluster: {}", legacy.body);
    assert_eq!(send(&format!("http://127.0.0.1:{other_port}/"), "GET", None, &[]).body, "other listener");
    assert!(envoy.admin("/stats/prometheus").contains("sgl_router_picks_total{"), "the stats labels came along");
}
