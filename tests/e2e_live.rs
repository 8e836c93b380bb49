//! Live operations against real Envoy (spec §8): an Envoy started from `render --dynamic`, its
//! engines added, removed and drained by `update` under steady load, without a restart and
//! without a failed request.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, sleep, JoinHandle};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// Engines, and an Envoy on the files of `render --dynamic`.
struct Live {
    sims: Vec<Sim>,
    envoy: Envoy,
    dir: PathBuf,
    files: PathBuf,
}

impl Live {
    fn start(name: &str, specs: Vec<SimSpec>, router: impl FnOnce(&[Sim]) -> Value) -> Self {
        let dir = scratch_dir(name);
        let sims: Vec<Sim> = specs.into_iter().map(|s| Sim::start(s, &dir)).collect();
        let files = dir.join("live");
        let (port, admin) = (free_port(), free_port());
        let config = router(&sims);
        let router_path = write_router(&dir, &config);
        let out = Command::new(cli_bin())
            .arg("render")
            .arg(&router_path)
            .args(["--wasm", &wasm_module().to_string_lossy()])
            .args(["--listen", &format!("127.0.0.1:{port}"), "--admin", &admin.to_string()])
            .arg("--dynamic")
            .arg(&files)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the CLI: {e}"));
        assert!(out.status.success(), "render --dynamic failed: {}", String::from_utf8_lossy(&out.stderr));
        let envoy = Envoy::start(&files.join("envoy.yaml"), port, admin, &dir);
        let live = Self { sims, envoy, dir, files };
        live.wait_for_monitoring(&config["workers"]);
        live
    }

    /// Waits until the service monitors `workers` (a router configuration's list) and has a
    /// fresh load report of each.
    fn wait_for_monitoring(&self, workers: &Value) {
        let n = workers.as_array().map_or(0, Vec::len) as f64;
        wait_for("the service to monitor every worker", Duration::from_secs(20), || {
            let healthy = self.envoy.metric("sgl_router_healthy_workers{}")?;
            let fresh = self.envoy.metric("sgl_router_fresh_load_reports{}")?;
            (healthy == n && fresh == n).then_some(())
        });
    }

    fn sim(&self, id: &str) -> &Sim {
        self.sims.iter().find(|s| s.spec.id == id).unwrap_or_else(|| panic!("no sim {id}"))
    }

    /// `update ROUTER --dynamic DIR`; returns the CLI's output.
    fn update(&self, router: &Value) -> String {
        let path = write_router(&self.dir, router);
        let out = Command::new(cli_bin())
            .arg("update")
            .arg(&path)
            .arg("--dynamic")
            .arg(&self.files)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the CLI: {e}"));
        assert!(out.status.success(), "update failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Requests each engine received at or after `since_ms` (Unix ms), as its own log says.
    fn received_since(&self, id: &str, since_ms: u64) -> usize {
        let state = self.sim(id).state();
        let recent = state["recent"].as_array().cloned().unwrap_or_default();
        recent.iter().filter(|r| r["received_ms"].as_u64().is_some_and(|t| t >= since_ms)).count()
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("----- Envoy log ({}) -----\n{}", self.dir.display(), self.envoy.log_text());
        }
    }
}

fn write_router(dir: &std::path::Path, router: &Value) -> PathBuf {
    let path = dir.join("router.json");
    fs::write(&path, serde_json::to_vec_pretty(router).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    path
}

fn router(sims: &[&Sim]) -> Value {
    json!({
        "workers": sims.iter().map(|s| s.worker_json()).collect::<Vec<_>>(),
        "load": {"interval_ms": 100, "stale_after_ms": 1000},
        "health": {"interval_ms": 200, "timeout_ms": 150},
        "models": {"demo-model": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "session_aware"}}}}]}},
    })
}

/// One finished request of the steady load.
#[derive(Debug, Clone)]
struct Done {
    status: u16,
    engine: String,
    started_ms: u64,
    /// The start of the body, for the failure message.
    #[allow(dead_code)]
    body: String,
}

/// Clients, each on its own kept-alive connection, sending streamed requests back to back.
struct SteadyLoad {
    stop: Arc<AtomicBool>,
    done: Arc<Mutex<Vec<Done>>>,
    clients: Vec<JoinHandle<()>>,
}

impl SteadyLoad {
    fn start(envoy: &Envoy, clients: usize, max_tokens: u64) -> Self {
        let (stop, done) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let url = envoy.url("/v1/chat/completions");
        let clients = (0..clients)
            .map(|c| {
                let (stop, done, url) = (Arc::clone(&stop), Arc::clone(&done), url.clone());
                thread::spawn(move || {
                    let client = agent();
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        let started_ms = now_unix_ms();
                        let body = chat_body(&format!("client {c} request {n}"), max_tokens, true);
                        let r = send_with(&client, &url, "POST", Some(&body), &[]);
                        let complete = sse_events(&r.body).last().map(String::as_str) == Some("[DONE]");
                        let status = if r.status == 200 && !complete { 0 } else { r.status };
                        let engine = r.engine();
                        if let Ok(mut d) = done.lock() {
                            d.push(Done { status, engine, started_ms, body: r.body.chars().take(300).collect() });
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        Self { stop, done, clients }
    }

    fn so_far(&self) -> Vec<Done> {
        self.done.lock().map(|d| d.clone()).unwrap_or_default()
    }

    fn finish(mut self) -> Vec<Done> {
        self.stop.store(true, Ordering::SeqCst);
        for c in std::mem::take(&mut self.clients) {
            let _ = c.join();
        }
        self.so_far()
    }
}

fn per_engine(done: &[Done]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for d in done {
        *counts.entry(d.engine.clone()).or_insert(0) += 1;
    }
    counts
}

fn assert_none_failed(done: &[Done]) {
    let failed: Vec<&Done> = done.iter().filter(|d| d.status != 200).collect();
    assert!(failed.is_empty(), "{} of {} requests failed, first: {:?}", failed.len(), done.len(), failed.first());
}

fn session_engine(live: &Live, session: &str) -> String {
    let r = send(
        &live.envoy.url("/v1/chat/completions"),
        "POST",
        Some(&chat_body("bound", 2, false)),
        &[("x-session-id", session)],
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.engine()
}

/// An engine added by `update` under load takes traffic within 5 s, no request fails, and a
/// session bound before the update stays on its engine.
#[test]
fn an_engine_added_by_update_takes_traffic_and_nothing_fails() {
    let specs = ["A", "B", "C"].map(SimSpec::plain).to_vec();
    let live = Live::start("live_add", specs, |sims| router(&[&sims[0], &sims[1]]));
    let bound = session_engine(&live, "s-1");
    let load = SteadyLoad::start(&live.envoy, 4, 20);
    sleep(Duration::from_secs(1));
    let updated_ms = now_unix_ms();
    let report = live.update(&router(&[live.sim("A"), live.sim("B"), live.sim("C")]));
    assert!(report.contains("added [sgl_C]"), "{report}");
    let first_on_c = wait_for("C to take traffic", Duration::from_secs(5), || {
        load.so_far().iter().filter(|d| d.engine == "C").map(|d| d.started_ms).min()
    });
    sleep(Duration::from_secs(1));
    let done = load.finish();
    assert_none_failed(&done);
    let counts = per_engine(&done);
    assert!(first_on_c.saturating_sub(updated_ms) < 5_000, "C's first request {first_on_c} vs update {updated_ms}");
    assert!(counts.get("C").copied().unwrap_or(0) > 0, "{counts:?}");
    assert_eq!(session_engine(&live, "s-1"), bound, "the session keeps its engine across the update");
    assert!(live.envoy.log_text().contains("following the filter configuration: 3 workers (1 added"));
}

/// The mesh's shape from files: no bootstrap service (a filter VM elected by lease does its
/// work), every engine on one override-host cluster, the filter by ECDS. An engine added by an
/// update is health-checked and takes traffic; its health failing takes it out.
#[test]
fn with_an_embedded_service_an_engine_added_by_update_is_health_checked() {
    let mesh = |sims: &[&Sim]| {
        let mut config = router(sims);
        config["service"] = json!({"mode": "embedded"});
        config["upstream"] = json!({"mode": "override_host"});
        config
    };
    let specs = ["A", "B", "C"].map(SimSpec::plain).to_vec();
    let live = Live::start("live_embedded", specs, |sims| mesh(&[&sims[0], &sims[1]]));
    assert!(!fs::read_to_string(live.files.join("envoy.yaml")).unwrap().contains("sgl_router_service"));
    live.update(&mesh(&[live.sim("A"), live.sim("B"), live.sim("C")]));
    wait_for("C monitored", Duration::from_secs(10), || {
        (live.envoy.metric("sgl_router_healthy_workers{}")? == 3.0).then_some(())
    });
    let on_c = |n: usize| {
        (0..n)
            .filter(|i| {
                let body = chat_body(&format!("mesh update {i}"), 1, false);
                let r = send(
                    &live.envoy.url("/v1/chat/completions"),
                    "POST",
                    Some(&body),
                    &[("x-session-id", &format!("s{i}"))],
                );
                assert_eq!(r.status, 200, "{}", r.body);
                r.engine() == "C"
            })
            .count()
    };
    wait_for("C to take traffic", Duration::from_secs(10), || (on_c(12) > 0).then_some(()));
    live.sim("C").control(json!({"health": {"status": 503}}));
    wait_for("C out", Duration::from_secs(10), || {
        (live.envoy.metric("sgl_router_healthy_workers{}")? == 2.0).then_some(())
    });
    assert_eq!(on_c(12), 0, "an unhealthy engine gets nothing");
}

/// Removing (or draining) an engine under load: no request reaches it once the update is done,
/// its streams in flight at the update complete, and no request fails.
fn leaves_under_load(name: &str, drain: bool) {
    let specs = ["A", "B", "C"].map(|id| SimSpec { token_delay_ms: 10, ..SimSpec::plain(id) }).to_vec();
    let live = Live::start(name, specs, |sims| router(&[&sims[0], &sims[1], &sims[2]]));
    let load = SteadyLoad::start(&live.envoy, 6, 60);
    wait_for("C to be busy", Duration::from_secs(10), || {
        (live.sim("C").state()["running"].as_u64().unwrap_or(0) > 0).then_some(())
    });
    let mut next = router(&[live.sim("A"), live.sim("B"), live.sim("C")]);
    let workers = next["workers"].as_array_mut().unwrap();
    if drain {
        workers[2]["drain"] = json!(true);
    } else {
        workers.remove(2);
    }
    let in_flight_on_c = live.sim("C").state()["running"].as_u64().unwrap_or(0);
    live.update(&next);
    let updated_ms = now_unix_ms();
    sleep(Duration::from_secs(2));
    let done = load.finish();
    assert_none_failed(&done);
    assert!(in_flight_on_c > 0);
    assert_eq!(live.received_since("C", updated_ms), 0, "C got a request after the update");
    let after: Vec<&Done> = done.iter().filter(|d| d.started_ms >= updated_ms).collect();
    assert!(after.len() >= 6, "the load went on: {}", after.len());
    assert!(after.iter().all(|d| d.engine != "C"), "{:?}", per_engine(&done));
    let c = live.sim("C").state();
    assert_eq!(c["running"], 0, "C finished what it had: {c}");
    if drain {
        wait_for("the draining gauge", Duration::from_secs(10), || {
            (live.envoy.metric("sgl_router_draining_workers{}")? == 1.0).then_some(())
        });
        assert!(live.envoy.log_text().contains("1 draining"));
    } else {
        assert!(live.envoy.log_text().contains("1 removed: C"));
    }
}

#[test]
fn an_engine_removed_by_update_finishes_its_streams_and_gets_nothing_new() {
    leaves_under_load("live_remove", false);
}

#[test]
fn a_drained_engine_finishes_its_streams_and_gets_nothing_new() {
    leaves_under_load("live_drain", true);
}

/// An invalid configuration changes nothing: exit 1 with every error, the files as they were.
#[test]
fn an_invalid_update_changes_nothing() {
    let live = Live::start("live_invalid", vec![SimSpec::plain("A")], |sims| router(&[&sims[0]]));
    let before: Vec<String> = ["filter.yaml", "clusters.yaml", "listeners.yaml"]
        .iter()
        .map(|f| fs::read_to_string(live.files.join(f)).unwrap_or_default())
        .collect();
    let mut bad = router(&[live.sim("A")]);
    bad["workers"][0]["url"] = json!("not a url");
    bad["models"]["demo-model"]["buckets"][0]["groups"]["plain"]["worker_ids"] = json!(["Z"]);
    let path = write_router(&live.dir, &bad);
    let out = Command::new(cli_bin()).arg("update").arg(&path).arg("--dynamic").arg(&live.files).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("workers[0].url") && stderr.contains("worker_ids"), "every error: {stderr}");
    let after: Vec<String> = ["filter.yaml", "clusters.yaml", "listeners.yaml"]
        .iter()
        .map(|f| fs::read_to_string(live.files.join(f)).unwrap_or_default())
        .collect();
    assert_eq!(before, after);
    let r = send(&live.envoy.url("/v1/chat/completions"), "POST", Some(&chat_body("still", 2, false)), &[]);
    assert_eq!((r.status, r.engine()), (200, "A".to_string()));
}

/// Sends `body` to `path` on a raw connection, reads `read_bytes` of the answer (0: none), waits
/// `after`, and goes away.
fn send_and_leave(envoy: &Envoy, path: &str, body: &Value, read_bytes: usize, after: Duration) {
    send_and_leave_with(envoy, path, body, &[], read_bytes, after)
}

/// The same, with extra request headers.
fn send_and_leave_with(
    envoy: &Envoy,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
    read_bytes: usize,
    after: Duration,
) {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
    let body = body.to_string();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nHost: sgl\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = vec![0u8; read_bytes];
    if read_bytes > 0 {
        socket.read_exact(&mut got).unwrap();
    }
    sleep(after);
    drop(socket);
}

/// The rid the engine saw on its last request, and the ids aborts named there.
fn last_rid_and_aborts(sim: &Sim) -> (String, Vec<String>) {
    let state = sim.state();
    let rid = state["recent"].as_array().and_then(|r| r.last()).map(|r| r["rid"].clone()).unwrap_or_default();
    let aborts = state["aborts"].as_array().map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect());
    (rid.as_str().unwrap_or_default().to_string(), aborts.unwrap_or_default())
}

/// A client that leaves mid-stream: its engine receives `/abort_request` with the request's id
/// (Envoy's, written into the body) and stops.
#[test]
fn a_client_gone_mid_stream_is_aborted_at_its_engine() {
    let specs = vec![SimSpec { token_delay_ms: 50, ..SimSpec::plain("A") }];
    let d = Deployment::start("abort_plain", specs, plain_router);
    d.wait_for_service(1);
    send_and_leave(
        &d.envoy,
        "/v1/chat/completions",
        &chat_body("leave early", 200, true),
        200,
        Duration::from_millis(300),
    );
    let a = d.sim("A");
    let (rid, aborts) = wait_for("the abort at A", Duration::from_secs(10), || {
        let (rid, aborts) = last_rid_and_aborts(a);
        aborts.contains(&rid).then_some((rid, aborts))
    });
    assert!(!rid.is_empty(), "the request carried an id: {aborts:?}");
    wait_for("A to stop", Duration::from_secs(5), || (a.state()["running"] == 0).then_some(()));
    wait_for("the abort counted", Duration::from_secs(10), || {
        (d.envoy.metric("sgl_router_aborts_total{stage=\"plain\"}")? >= 1.0).then_some(())
    });
    // A request that completes is not aborted.
    let r = d.chat(&chat_body("stay", 2, true));
    assert_eq!(r.status, 200);
    sleep(Duration::from_millis(300));
    assert_eq!(last_rid_and_aborts(a).1.len(), 1, "nothing more aborted");
}

/// The ids the engine saw on its recent requests.
fn recent_rids(sim: &Sim) -> Vec<Value> {
    sim.state()["recent"].as_array().map(|r| r.iter().map(|r| r["rid"].clone()).collect()).unwrap_or_default()
}

/// A client that names another request's `rid` (and its `x-request-id`) and goes away aborts
/// only its own request: each request gets the filter's own id, whatever the client sent.
#[test]
fn a_client_cannot_abort_another_request_by_naming_its_id() {
    let specs = vec![SimSpec { token_delay_ms: 20, ..SimSpec::plain("A") }];
    let d = Deployment::start("abort_spoofed", specs, plain_router);
    d.wait_for_service(1);
    let mut victim_body = chat_body("the victim", 60, true);
    victim_body["rid"] = json!("shared-id");
    let ids = [("x-request-id", "shared-request-id")];
    let victim = {
        let url = d.envoy.url("/v1/chat/completions");
        let body = victim_body.clone();
        thread::spawn(move || send(&url, "POST", Some(&body), &ids))
    };
    wait_for("the victim running", Duration::from_secs(5), || (d.sim("A").state()["running"] == 1).then_some(()));
    let mut attacker_body = chat_body("the attacker", 60, true);
    attacker_body["rid"] = json!("shared-id");
    send_and_leave_with(&d.envoy, "/v1/chat/completions", &attacker_body, &ids, 200, Duration::from_millis(200));
    let aborts = wait_for("the attacker's abort", Duration::from_secs(10), || {
        let aborts = last_rid_and_aborts(d.sim("A")).1;
        (!aborts.is_empty()).then_some(aborts)
    });
    let r = victim.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"finish_reason\":\"length\""), "the victim ran to its end: {}", r.body);
    let rids = recent_rids(d.sim("A"));
    assert_eq!(rids.len(), 2, "{rids:?}");
    assert_ne!(rids[0], rids[1], "two requests, two ids");
    assert!(rids.iter().all(|r| r.as_str().is_some_and(|r| r.starts_with("sgl-"))), "never the client's: {rids:?}");
    assert_eq!(aborts.len(), 1, "{aborts:?}");
}

/// A body with `"rid": null` is still aborted when its client goes away: the id the engine keeps
/// is the filter's, not the client's `null`.
#[test]
fn a_request_whose_rid_is_null_is_still_aborted() {
    let specs = vec![SimSpec { token_delay_ms: 50, ..SimSpec::plain("A") }];
    let d = Deployment::start("abort_null_rid", specs, plain_router);
    d.wait_for_service(1);
    let mut body = chat_body("null id", 200, true);
    body["rid"] = Value::Null;
    send_and_leave(&d.envoy, "/v1/chat/completions", &body, 200, Duration::from_millis(300));
    let a = d.sim("A");
    let (rid, aborts) = wait_for("the abort at A", Duration::from_secs(10), || {
        let (rid, aborts) = last_rid_and_aborts(a);
        (!aborts.is_empty()).then_some((rid, aborts))
    });
    assert!(!rid.is_empty() && aborts.contains(&rid), "the engine's id {rid:?} is the one aborted: {aborts:?}");
    wait_for("A to stop", Duration::from_secs(5), || (a.state()["running"] == 0).then_some(()));
}

/// Envoy's engines cluster lacks the engine the filter names (a stale cluster file, an update
/// whose Envoy did not answer): the request gets a 503, and never goes to an engine the filter did
/// not name, here the only other host, another model's.
#[test]
fn a_request_never_falls_back_to_an_engine_the_filter_did_not_name() {
    let specs = vec![SimSpec::plain("A"), SimSpec::plain("B").model("other-model")];
    let live = Live::start("no_fallback", specs, |sims| {
        let mut config = router(&[&sims[0], &sims[1]]);
        config["models"]["other-model"] = config["models"]["demo-model"].clone();
        config
    });
    let path = live.files.join("clusters.yaml");
    let mut doc: Value = serde_yaml_ng::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    let a_port = json!(live.sim("A").port);
    for cluster in doc["resources"].as_array_mut().unwrap() {
        if cluster["name"] == "sgl_engines" {
            let hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"].as_array_mut().unwrap();
            hosts.retain(|h| h["endpoint"]["address"]["socket_address"]["port_value"] != a_port);
        }
    }
    let staged = live.files.join(".clusters.yaml.stale");
    fs::write(&staged, serde_json::to_string(&doc).unwrap()).unwrap();
    fs::rename(&staged, &path).unwrap();
    let a_host = format!("sgl_engines::127.0.0.1:{}::", live.sim("A").port);
    wait_for("Envoy to drop A from the engines cluster", Duration::from_secs(10), || {
        (!live.envoy.admin("/clusters").contains(&a_host)).then_some(())
    });
    let served_before = live.sim("B").state()["served"].as_u64();
    for _ in 0..4 {
        let r = send(&live.envoy.url("/v1/chat/completions"), "POST", Some(&chat_body("for A only", 2, false)), &[]);
        assert_eq!(r.status, 503, "{}", r.body);
    }
    assert_eq!(live.sim("B").state()["served"].as_u64(), served_before, "another model's engine served nothing");
}

/// A client that leaves after an update removed its engine (and the settle removed the engine's
/// cluster): the abort cannot be sent, and is counted as such rather than lost without a trace.
#[test]
fn an_abort_to_an_engine_an_update_removed_is_counted_unsent() {
    use std::io::{Read, Write};
    let specs = vec![SimSpec::plain("A"), SimSpec { token_delay_ms: 50, ..SimSpec::plain("B") }];
    let live = Live::start("abort_removed", specs, |sims| router(&[&sims[1]]));
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", live.envoy.port)).unwrap();
    let body = chat_body("outlive the update", 400, true).to_string();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sgl\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 200];
    socket.read_exact(&mut first).unwrap();
    live.update(&router(&[live.sim("A")]));
    wait_for("Envoy to drop B's cluster", Duration::from_secs(10), || {
        (!live.envoy.admin("/clusters").contains("sgl_B::")).then_some(())
    });
    assert_eq!(live.sim("B").state()["running"], 1, "B still works on the request");
    drop(socket);
    wait_for("the unsent abort counted", Duration::from_secs(10), || {
        (live.envoy.metric("sgl_router_aborts_unsent_total{stage=\"plain\"}")? == 1.0).then_some(())
    });
    assert_eq!(live.envoy.metric("sgl_router_aborts_total{stage=\"plain\"}").unwrap_or(0.0), 0.0, "none sent");
}

/// In PD the client leaves while the prefill is still running: the prefill engine and the decode
/// engine both receive the abort, with the same id, and both stop.
#[test]
fn a_client_gone_during_the_prefill_is_aborted_at_both_engines() {
    let prefill = SimSpec { extra: vec!["--prefill-tps".into(), "400".into()], ..SimSpec::prefill("P") };
    let d = Deployment::start("abort_pd", vec![prefill, SimSpec::decode("D")], |sims| {
        pd_router(sims, &[("pd", 0, 1_000_000, 2_000_000, &["P"], &["D"])])
    });
    d.wait_for_service(2);
    let long = "a prompt that takes the prefill engine a while ".repeat(40);
    send_and_leave(&d.envoy, "/v1/chat/completions", &chat_body(&long, 20, true), 0, Duration::from_millis(500));
    let (p, dec) = (d.sim("P"), d.sim("D"));
    let (prid, paborts) = wait_for("the abort at P", Duration::from_secs(10), || {
        let (rid, aborts) = last_rid_and_aborts(p);
        aborts.contains(&rid).then_some((rid, aborts))
    });
    let (drid, _) = wait_for("the abort at D", Duration::from_secs(10), || {
        let (rid, aborts) = last_rid_and_aborts(dec);
        aborts.contains(&rid).then_some((rid, aborts))
    });
    assert_eq!(prid, drid, "one id at both engines: {paborts:?}");
    for sim in [p, dec] {
        wait_for("the engines to stop", Duration::from_secs(5), || (sim.state()["running"] == 0).then_some(()));
    }
    for stage in ["prefill", "decode"] {
        wait_for("the aborts counted", Duration::from_secs(10), || {
            (d.envoy.metric(&format!("sgl_router_aborts_total{{stage=\"{stage}\"}}"))? >= 1.0).then_some(())
        });
    }
}

/// Engines behind a round robin whose health checks are far apart, so a dead engine keeps its
/// turn: only the retry saves its requests.
fn slow_health_router(sims: &[Sim], retry: Option<u32>) -> Value {
    let mut router = plain_router(sims);
    router["health"] = json!({"interval_ms": 60_000, "timeout_ms": 500});
    if let Some(attempts) = retry {
        router["retry"] = json!({"attempts": attempts});
    }
    router
}

/// Sends `n` requests one after the other; (status, engine) of each.
fn statuses(d: &Deployment, n: usize) -> Vec<(u16, String)> {
    (0..n)
        .map(|i| {
            let r = d.chat(&chat_body(&format!("retry {i}"), 2, i % 2 == 0));
            (r.status, r.header("x-sgl-worker").unwrap_or_default().to_string())
        })
        .collect()
}

/// An engine that refuses connections: each request routed to it succeeds on the next engine the
/// rotation names (default `retry.attempts: 1`); with `attempts: 0` it fails as before.
#[test]
fn a_refused_request_is_retried_on_the_engine_the_policy_names_next() {
    let specs = ["A", "B", "C"].map(SimSpec::plain).to_vec();
    let mut d = Deployment::start("retry_plain", specs, |sims| slow_health_router(sims, None));
    d.wait_for_service(3);
    d.sims[2].stop();
    let answers = statuses(&d, 12);
    assert!(answers.iter().all(|(s, w)| *s == 200 && w != "C"), "{answers:?}");
    let on_a = answers.iter().filter(|(_, w)| w == "A").count();
    assert!(on_a >= 6, "C's turns went to A, the next in the rotation: {answers:?}");
    // C's turns: four with one rotation, fewer while two VMs' cursors meet (docs/architecture.md).
    wait_for("the retries counted", Duration::from_secs(10), || {
        (d.envoy.metric("sgl_router_retries_total{stage=\"plain\"}")? >= 1.0).then_some(())
    });

    let mut off = Deployment::start("retry_off", ["A", "B", "C"].map(SimSpec::plain).to_vec(), |sims| {
        slow_health_router(sims, Some(0))
    });
    off.wait_for_service(3);
    off.sims[2].stop();
    let answers = statuses(&off, 12);
    let failed = answers.iter().filter(|(s, _)| *s == 503).count();
    assert!((3..=5).contains(&failed), "about every third request reached C: {answers:?}");
    assert!(answers.iter().all(|(s, w)| *s == 200 || w == "C"), "only C's turns failed: {answers:?}");
}

/// In PD a decode engine that refuses the connection: the request goes to the other decode
/// engine, with the same prefill and bootstrap room, and succeeds.
#[test]
fn a_refused_decode_is_retried_on_another_decode_engine() {
    let specs = vec![SimSpec::prefill("P"), SimSpec::decode("D1"), SimSpec::decode("D2")];
    let mut d = Deployment::start("retry_decode", specs, |sims| {
        let mut router = pd_router(sims, &[("pd", 0, 1_000_000, 2_000_000, &["P"], &["D1", "D2"])]);
        router["health"] = json!({"interval_ms": 60_000, "timeout_ms": 500});
        router["models"]["demo-model"]["buckets"][0]["groups"]["pd"]["decode"]["policy"] =
            json!({"type": "round_robin"});
        router
    });
    d.wait_for_service(3);
    d.sims[1].stop();
    let answers = statuses(&d, 8);
    assert!(answers.iter().all(|(s, w)| *s == 200 && w == "D2"), "{answers:?}");
    wait_for("the retries counted", Duration::from_secs(10), || {
        (d.envoy.metric("sgl_router_retries_total{stage=\"decode\"}")? >= 1.0).then_some(())
    });
}
