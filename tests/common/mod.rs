//! End-to-end harness: simulated engines and a real Envoy running our filter, on free loopback
//! ports, cleaned up on drop (also when a test panics, when Envoy's log is printed).

#![allow(dead_code)] // each test binary uses its own part of the harness

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"))
}

fn require(path: PathBuf, what: &str) -> PathBuf {
    assert!(path.exists(), "{what} not found at {} — run scripts/test (it builds everything first)", path.display());
    path
}

pub fn sim_bin() -> PathBuf {
    require(target_dir().join("debug/sgl-sim"), "sgl-sim")
}

pub fn indexer_bin() -> PathBuf {
    require(target_dir().join("debug/sgl-indexer"), "sgl-indexer")
}

/// The project's small tokenizer and chat template (assets/tokenizer).
pub fn tokenizer_dir() -> PathBuf {
    repo_root().join("assets/tokenizer")
}

/// Starts `sgl-indexer` on `port` with the router configuration `render` wrote into `dir`, and
/// waits until it is subscribed and serving.
pub fn start_indexer(dir: &Path, port: u16) -> Process {
    start_indexer_with(dir, port, &[])
}

/// [`start_indexer`] with more `sgl-indexer` flags.
pub fn start_indexer_with(dir: &Path, port: u16, args: &[&str]) -> Process {
    let mut cmd = Command::new(indexer_bin());
    cmd.args(["--config", &dir.join("router.json").to_string_lossy(), "--listen", &format!("127.0.0.1:{port}")]);
    cmd.args(args);
    let p = Process::spawn("sgl-indexer", &mut cmd, dir.join(format!("indexer-{port}.log")));
    let a = agent();
    wait_for("the indexer's health", Duration::from_secs(20), || {
        a.get(&format!("http://127.0.0.1:{port}/health")).call().ok().filter(|r| r.status() == 200)
    });
    p
}

pub fn cli_bin() -> PathBuf {
    require(target_dir().join("debug/sgl-envoy-router"), "the sgl-envoy-router CLI")
}

pub fn wasm_module() -> PathBuf {
    require(target_dir().join("wasm32-wasip1/release/sgl_envoy_router.wasm"), "the wasm module")
}

/// The module with test-only faults (`--features fault-injection`, src/proxy/faults.rs).
pub fn wasm_module_with_faults() -> PathBuf {
    require(target_dir().join("wasm32-wasip1/release/sgl_envoy_router_faults.wasm"), "the module with faults")
}

/// `scripts/envoy`: `$ENVOY`, else func-e's Envoy when func-e is on PATH, else the pinned wheel's.
pub fn envoy_bin() -> PathBuf {
    match std::env::var_os("ENVOY_BIN") {
        Some(p) => PathBuf::from(p),
        None => {
            require(repo_root().join(".venv/bin/envoy"), "Envoy (scripts/setup installs it)");
            repo_root().join("scripts/envoy")
        }
    }
}

/// Ports handed out in this test process.
static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Where test ports come from: below the kernel's ephemeral range, so no outgoing connection (of
/// Envoy, an engine, a client) takes a port between our check and the engine's bind; the
/// kernel's pick when that range leaves no room.
fn port_range() -> Option<(u16, u16)> {
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())?;
    (low > 12_000).then_some((10_000, low))
}

/// `n` consecutive free ports, none handed out before: an engine of `n` data-parallel ranks
/// publishes on a base port plus its rank.
pub fn free_ports(n: u16) -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let Some((low, high)) = port_range() else {
        return kernel_ports(n);
    };
    let span = u32::from(high - low - n);
    // Each test process starts somewhere else, so two of them rarely probe the same ports.
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..span {
        let offset = (start.wrapping_add(NEXT.fetch_add(u32::from(n), Ordering::SeqCst))) % span;
        let base = low + u16::try_from(offset).unwrap_or(0);
        let ports: Vec<u16> = (base..base + n).collect();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if ports.iter().all(|p| !given.contains(p) && TcpListener::bind(("127.0.0.1", *p)).is_ok()) {
            given.extend(&ports);
            return base;
        }
    }
    panic!("no {n} free ports in {low}..{high}");
}

/// A port nobody listens on right now, and never handed out before in this test process: tests run
/// side by side, and the kernel may give the port one test picked (and closed, to hand it to its
/// engine or indexer) to the next test's pick before the first one binds it.
pub fn free_port() -> u16 {
    free_ports(1)
}

fn kernel_ports(n: u16) -> u16 {
    loop {
        let base = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("no free port: {e}"));
        let ports: Vec<u16> = (0..n).filter_map(|i| base.checked_add(i)).collect();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if ports.len() == usize::from(n)
            && ports.iter().all(|p| !given.contains(p))
            && ports[1..].iter().all(|p| TcpListener::bind(("127.0.0.1", *p)).is_ok())
        {
            given.extend(&ports);
            return base;
        }
    }
}

/// A fresh directory for one test's files.
pub fn scratch_dir(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let dir =
        target_dir().join("e2e").join(format!("{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// Polls `check` until it returns `Some`, or panics with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        sleep(Duration::from_millis(50));
    }
}

/// A child process killed on drop.
pub struct Process {
    pub name: String,
    child: Child,
    pub log: PathBuf,
}

impl Process {
    pub fn spawn(name: &str, command: &mut Command, log: PathBuf) -> Self {
        let out = fs::File::create(&log).unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let err = out.try_clone().unwrap_or_else(|e| panic!("cannot clone log handle: {e}"));
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self { name: name.to_string(), child, log }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the process now (an engine that crashed).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Clone)]
pub struct SimSpec {
    pub id: String,
    pub role: &'static str,
    pub model: String,
    pub token_delay_ms: u64,
    pub max_running: usize,
    pub dp_size: u32,
    pub bootstrap_timeout_ms: u64,
    /// More sgl-sim flags.
    pub extra: Vec<String>,
}

impl SimSpec {
    pub fn plain(id: &str) -> Self {
        Self {
            id: id.to_string(),
            role: "plain",
            model: "demo-model".to_string(),
            token_delay_ms: 2,
            max_running: 64,
            dp_size: 1,
            bootstrap_timeout_ms: 5_000,
            extra: Vec::new(),
        }
    }

    pub fn prefill(id: &str) -> Self {
        Self { role: "prefill", ..Self::plain(id) }
    }

    pub fn decode(id: &str) -> Self {
        Self { role: "decode", ..Self::plain(id) }
    }

    pub fn model(mut self, model: &str) -> Self {
        self.model = model.to_string();
        self
    }
}

pub struct Sim {
    pub spec: SimSpec,
    pub port: u16,
    pub bootstrap_port: Option<u16>,
    process: Process,
}

impl Sim {
    pub fn start(spec: SimSpec, dir: &Path) -> Self {
        let port = free_port();
        let bootstrap_port = (spec.role == "prefill").then(free_port);
        let mut cmd = Command::new(sim_bin());
        cmd.args(["--id", &spec.id, "--port", &port.to_string(), "--model", &spec.model, "--role", spec.role])
            .args(["--token-delay-ms", &spec.token_delay_ms.to_string()])
            .args(["--max-running", &spec.max_running.to_string()])
            .args(["--dp-size", &spec.dp_size.to_string()])
            .args(["--bootstrap-timeout-ms", &spec.bootstrap_timeout_ms.to_string()]);
        if let Some(b) = bootstrap_port {
            cmd.args(["--bootstrap-port", &b.to_string()]);
        }
        cmd.args(&spec.extra);
        let process = Process::spawn(&format!("sim {}", spec.id), &mut cmd, dir.join(format!("sim-{}.log", spec.id)));
        let mut sim = Self { spec, port, bootstrap_port, process };
        let a = agent();
        let url = sim.url("/sim/state");
        // An engine publishing through SGLang's Python publisher starts one per rank first.
        wait_for(&format!("sim {} to listen", sim.spec.id), Duration::from_secs(30), || {
            let up = a.get(&url).call().ok().filter(|r| r.status() == 200);
            assert!(
                up.is_some() || sim.process.is_running(),
                "sim {} exited while starting:\n{}",
                sim.spec.id,
                sim.process.log_text()
            );
            up
        });
        sim
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The engine dies: its port refuses connections from now on.
    pub fn stop(&mut self) {
        self.process.stop();
    }

    pub fn control(&self, update: Value) {
        let r = agent()
            .post(&self.url("/sim/control"))
            .send_json(&update)
            .unwrap_or_else(|e| panic!("control of sim {} failed: {e}", self.spec.id));
        assert_eq!(r.status(), 200, "control of sim {} refused {update}", self.spec.id);
    }

    pub fn state(&self) -> Value {
        let mut r = agent()
            .get(&self.url("/sim/state"))
            .call()
            .unwrap_or_else(|e| panic!("state of sim {} failed: {e}", self.spec.id));
        r.body_mut().read_json().unwrap_or_else(|e| panic!("state of sim {} is not JSON: {e}", self.spec.id))
    }

    /// The worker entry of a router configuration for this engine.
    pub fn worker_json(&self) -> Value {
        let mut w = json!({
            "id": self.spec.id,
            "url": format!("http://127.0.0.1:{}", self.port),
            "model": self.spec.model,
            "role": self.spec.role,
        });
        if let Some(b) = self.bootstrap_port {
            w["bootstrap_port"] = json!(b);
        }
        if self.spec.dp_size > 1 {
            w["dp_size"] = json!(self.spec.dp_size);
        }
        w
    }
}

/// Renders a router configuration to an Envoy bootstrap with the CLI.
pub fn render(router: &Value, dir: &Path, listen_port: u16, admin_port: u16) -> PathBuf {
    let router_path = dir.join("router.json");
    fs::write(&router_path, serde_json::to_vec_pretty(router).unwrap_or_default())
        .unwrap_or_else(|e| panic!("cannot write router config: {e}"));
    let out = Command::new(cli_bin())
        .arg("render")
        .arg(&router_path)
        .arg("--wasm")
        .arg(wasm_module())
        .args(["--listen", &format!("127.0.0.1:{listen_port}"), "--admin", &admin_port.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the CLI: {e}"));
    assert!(out.status.success(), "render failed: {}", String::from_utf8_lossy(&out.stderr));
    let envoy_path = dir.join("envoy.yaml");
    fs::write(&envoy_path, &out.stdout).unwrap_or_else(|e| panic!("cannot write envoy config: {e}"));
    envoy_path
}

pub struct Envoy {
    pub port: u16,
    pub admin_port: u16,
    process: Process,
}

impl Envoy {
    /// Starts Envoy on a rendered bootstrap with two worker threads and waits for admin `/ready`.
    pub fn start(config: &Path, listen_port: u16, admin_port: u16, dir: &Path) -> Self {
        Self::start_on(config, listen_port, admin_port, dir, 2)
    }

    /// The same with `concurrency` worker threads.
    pub fn start_on(config: &Path, listen_port: u16, admin_port: u16, dir: &Path, concurrency: u32) -> Self {
        let mut cmd = Command::new(envoy_bin());
        let threads = concurrency.to_string();
        let args = ["--concurrency", threads.as_str(), "--disable-hot-restart", "-l", "info"];
        cmd.arg("-c").arg(config).args(args).current_dir(dir);
        let mut envoy =
            Self { port: listen_port, admin_port, process: Process::spawn("envoy", &mut cmd, dir.join("envoy.log")) };
        let a = agent();
        let url = format!("http://127.0.0.1:{admin_port}/ready");
        let start = Instant::now();
        loop {
            if let Ok(r) = a.get(&url).call() {
                if r.status() == 200 {
                    break;
                }
            }
            if !envoy.process.is_running() || start.elapsed() > Duration::from_secs(30) {
                panic!("Envoy did not become ready:\n{}", envoy.process.log_text());
            }
            sleep(Duration::from_millis(50));
        }
        envoy
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn admin(&self, path: &str) -> String {
        let mut r = agent()
            .get(&format!("http://127.0.0.1:{}{path}", self.admin_port))
            .call()
            .unwrap_or_else(|e| panic!("admin {path} failed: {e}"));
        r.body_mut().read_to_string().unwrap_or_default()
    }

    pub fn log_text(&self) -> String {
        self.process.log_text()
    }
}

/// Engines plus Envoy in front of them; prints Envoy's log when the test fails.
pub struct Deployment {
    pub sims: Vec<Sim>,
    pub envoy: Envoy,
    pub dir: PathBuf,
}

impl Deployment {
    /// Starts the engines, lets `router` build the router configuration from them, renders it,
    /// lets `adjust` edit the Envoy bootstrap, and starts Envoy.
    pub fn start_with(
        name: &str,
        specs: Vec<SimSpec>,
        router: impl FnOnce(&[Sim]) -> Value,
        adjust: impl FnOnce(&mut serde_yaml_ng::Value),
    ) -> Self {
        Self::start_full(name, 2, specs, router, adjust)
    }

    /// [`Deployment::start`] with Envoy on `concurrency` worker threads.
    pub fn start_on(name: &str, concurrency: u32, specs: Vec<SimSpec>, router: impl FnOnce(&[Sim]) -> Value) -> Self {
        Self::start_full(name, concurrency, specs, router, |_| {})
    }

    fn start_full(
        name: &str,
        concurrency: u32,
        specs: Vec<SimSpec>,
        router: impl FnOnce(&[Sim]) -> Value,
        adjust: impl FnOnce(&mut serde_yaml_ng::Value),
    ) -> Self {
        let dir = scratch_dir(name);
        let sims: Vec<Sim> = specs.into_iter().map(|s| Sim::start(s, &dir)).collect();
        let router = router(&sims);
        let (port, admin) = (free_port(), free_port());
        let rendered = render(&router, &dir, port, admin);
        let text = fs::read_to_string(&rendered).unwrap_or_default();
        let mut yaml: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}"));
        adjust(&mut yaml);
        fs::write(&rendered, serde_yaml_ng::to_string(&yaml).unwrap_or_default())
            .unwrap_or_else(|e| panic!("cannot write envoy config: {e}"));
        let envoy = Envoy::start_on(&rendered, port, admin, &dir, concurrency);
        Self { sims, envoy, dir }
    }

    pub fn start(name: &str, specs: Vec<SimSpec>, router: impl FnOnce(&[Sim]) -> Value) -> Self {
        Self::start_with(name, specs, router, |_| {})
    }

    pub fn sim(&self, id: &str) -> &Sim {
        self.sims.iter().find(|s| s.spec.id == id).unwrap_or_else(|| panic!("no sim {id}"))
    }

    pub fn chat(&self, body: &Value) -> Reply {
        self.chat_with_headers(body, &[])
    }

    pub fn chat_with_headers(&self, body: &Value, headers: &[(&str, &str)]) -> Reply {
        send(&self.envoy.url("/v1/chat/completions"), "POST", Some(body), headers)
    }

    /// Two clients with one kept-alive connection each. With the listener's `exact_balance`, the
    /// second connection lands on the other worker VM while the first stays open.
    pub fn two_vm_clients(&self) -> [ureq::Agent; 2] {
        let (a, b) = (agent(), agent());
        for client in [&a, &b] {
            let r = send_with(client, &self.envoy.url("/v1/models"), "GET", None, &[]);
            assert_eq!(r.status, 200);
        }
        [a, b]
    }

    /// `engine` fails its health checks until it is out of the rotation, then passes them until
    /// it is back: what the service's health checks must do, wherever they run.
    pub fn health_out_and_back(&self, engine: &str) {
        self.sim(engine).control(json!({"health": {"status": 503}}));
        wait_for(&format!("{engine} out of rotation"), Duration::from_secs(15), || {
            (!self.served_counts(4).contains_key(engine)).then_some(())
        });
        self.sim(engine).control(json!({"health": {"status": null}}));
        wait_for(&format!("{engine} back"), Duration::from_secs(15), || {
            self.served_counts(4).contains_key(engine).then_some(())
        });
    }

    /// `n` chats of 40 tokens sent at once, alternately from each worker thread's client: their
    /// statuses (what admission caps let through across threads).
    pub fn statuses_at_once(&self, n: usize) -> Vec<u16> {
        let clients = self.two_vm_clients();
        std::thread::scope(|s| {
            let running: Vec<_> = (0..n)
                .map(|i| {
                    let client = &clients[i % 2];
                    s.spawn(move || self.chat_on(client, &chat_body(&format!("at once {i}"), 40, false), &[]).status)
                })
                .collect();
            running.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        })
    }

    /// Sends `requests` short chats, each answered 200 with `x-sgl-worker` naming the engine
    /// that served it; how many each engine served.
    pub fn served_counts(&self, requests: usize) -> std::collections::HashMap<String, usize> {
        let mut counts = std::collections::HashMap::new();
        for i in 0..requests {
            let r = self.chat(&chat_body(&format!("count {i}"), 1, false));
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(
                r.header("x-sgl-worker"),
                Some(r.engine().as_str()),
                "x-sgl-worker names the engine that served"
            );
            *counts.entry(r.engine()).or_insert(0) += 1;
        }
        counts
    }

    pub fn chat_on(&self, client: &ureq::Agent, body: &Value, headers: &[(&str, &str)]) -> Reply {
        send_with(client, &self.envoy.url("/v1/chat/completions"), "POST", Some(body), headers)
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("----- Envoy log ({}) -----\n{}", self.dir.display(), self.envoy.log_text());
        }
    }
}

/// A finished HTTP exchange.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// The engine that served, as the simulator reports it.
    pub fn engine(&self) -> String {
        self.header("x-sim-engine")
            .unwrap_or_else(|| panic!("no x-sim-engine header (status {}): {}", self.status, self.body))
            .to_string()
    }
}

pub fn send(url: &str, method: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> Reply {
    send_with(&agent(), url, method, body, headers)
}

/// [`send`] on a given agent, reusing its kept-alive connection.
pub fn send_with(a: &ureq::Agent, url: &str, method: &str, body: Option<&Value>, headers: &[(&str, &str)]) -> Reply {
    let result = match (method, body) {
        ("GET" | "DELETE" | "HEAD", _) => {
            let mut req = match method {
                "DELETE" => a.delete(url),
                "HEAD" => a.head(url),
                _ => a.get(url),
            };
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            req.call()
        }
        (_, body) => {
            let mut req = if method == "PUT" { a.put(url) } else { a.post(url) };
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            match body {
                Some(b) => req.header("content-type", "application/json").send(b.to_string()),
                None => req.send_empty(),
            }
        }
    };
    let mut response = result.unwrap_or_else(|e| panic!("{method} {url} failed: {e}"));
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or_default().to_string()))
        .collect();
    let mut body = String::new();
    let _ = response.body_mut().as_reader().read_to_string(&mut body);
    Reply { status, headers, body }
}

/// A chat body with `content` as the single user message.
pub fn chat_body(content: &str, max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "demo-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A plain router configuration over `sims` with one round-robin bucket.
pub fn plain_router(sims: &[Sim]) -> Value {
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "health": {"interval_ms": 200, "timeout_ms": 150, "failure_threshold": 2, "success_threshold": 1},
        "models": {
            "demo-model": {
                "buckets": [{"id": "default", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]
            }
        }
    })
}

/// Splits an SSE body into its `data:` payloads, in order.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data event: {e:?}")).to_string())
        .collect()
}

impl Envoy {
    /// The value of one Prometheus sample, e.g. `sgl_router_inflight{worker="A"}`.
    pub fn metric(&self, sample: &str) -> Option<f64> {
        self.admin("/stats/prometheus")
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.trim().parse().ok()))
    }
}

impl Deployment {
    /// Waits until the service has published health and has a fresh load report for `workers`
    /// engines (pass 0 when `load.source` is `none`).
    pub fn wait_for_service(&self, workers: usize) {
        wait_for("the service's first health and load data", Duration::from_secs(20), || {
            let health = self.envoy.metric("sgl_router_health_published{}")? >= 1.0;
            let fresh = self.envoy.metric("sgl_router_fresh_load_reports{}")? >= workers as f64;
            (health && fresh).then_some(())
        });
    }

    /// The in-flight count the filters share, as the service exports it.
    pub fn inflight(&self, worker: &str) -> f64 {
        self.envoy.metric(&format!("sgl_router_inflight{{worker=\"{worker}\"}}")).unwrap_or(-1.0)
    }

    /// Waits until every listed worker's shared in-flight count is zero.
    pub fn wait_for_idle(&self, workers: &[&str]) {
        wait_for("every in-flight count back to zero", Duration::from_secs(20), || {
            workers.iter().all(|w| self.inflight(w) == 0.0).then_some(())
        });
    }
}

/// A PD bucket for [`pd_router`]: id, rank, max input, context, prefill ids, decode ids.
pub type PdBucket<'a> = (&'a str, i64, u64, u64, &'a [&'a str], &'a [&'a str]);

/// A PD router configuration over `sims`. Admission caps running requests at 64 everywhere, as
/// the design's example.
pub fn pd_router(sims: &[Sim], buckets: &[PdBucket<'_>]) -> Value {
    let buckets: Vec<Value> = buckets
        .iter()
        .map(|(id, rank, max, ctx, prefill, decode)| {
            json!({
                "id": id, "rank": rank, "limits": {"min": 0, "max": max}, "max_context_tokens": ctx,
                "groups": {"pd": {
                    "prefill": {"worker_ids": prefill, "policy": {"type": "power_of_two", "admission": {"max_running_requests": 64}}},
                    "decode": {"worker_ids": decode, "policy": {"type": "power_of_two", "admission": {"max_running_requests": 64}}},
                }}
            })
        })
        .collect();
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "load": {"interval_ms": 100, "stale_after_ms": 1000},
        "health": {"interval_ms": 200, "timeout_ms": 150},
        "pd": {"prefill_timeout_ms": 10000},
        "models": {"demo-model": {"buckets": buckets}}
    })
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
