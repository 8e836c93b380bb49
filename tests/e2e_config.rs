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
