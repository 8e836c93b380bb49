//! Where one request's work goes (issue 13's profile). The filter's whole per-request path — the
//! request's life from its headers (routing headers stripped, the route), its body (prepare,
//! selection, dispatch accounting), the upstream's answer and the stream's end, one hook each as
//! `proxy/filter.rs` calls them — over a `MemoryHost` behind a counting
//! `Host`, with a counting allocator, the service publishing load and health beside it. Prints per
//! request: time per phase, host calls by kind and by table, allocations per phase, and the
//! counters the glue bumps, for each policy over 8, 512 and 4,096 engines. Runs natively
//! (`cargo bench --bench request`) and inside wasm under Node
//! (`cargo bench --bench request --target wasm32-wasip1 --no-default-features`). Never asserted.

// A benchmark stops at the first thing that is not what it measures.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::Ordering;
use std::time::Instant;

use sgl_envoy_router::config::parse_and_validate;
use sgl_envoy_router::filter::life::{Action, RequestLife};

#[path = "../tests/support/counting.rs"]
mod counting;

use counting::{Counting, ALLOCATED_BYTES, ALLOCATIONS};

#[global_allocator]
static GLOBAL: Counting = Counting;

fn router_config(engines: usize, policy: &str) -> String {
    let workers: Vec<_> = (0..engines)
        .map(|i| serde_json::json!({"id": format!("E{i:04}"), "url": format!("http://10.0.{}.{}:30000", i / 256, i % 256), "model": "m"}))
        .collect();
    serde_json::json!({
        "workers": workers,
        "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": policy}}}}]}},
    })
    .to_string()
}

#[derive(Default)]
struct Phase {
    ns: u128,
    allocations: u64,
    bytes: u64,
}

struct Meter {
    started: Instant,
    allocations: u64,
    bytes: u64,
}

impl Meter {
    fn start() -> Self {
        Self {
            allocations: ALLOCATIONS.load(Ordering::Relaxed),
            bytes: ALLOCATED_BYTES.load(Ordering::Relaxed),
            started: Instant::now(),
        }
    }
    fn stop(self, phase: &mut Phase) {
        phase.ns += self.started.elapsed().as_nanos();
        phase.allocations += ALLOCATIONS.load(Ordering::Relaxed) - self.allocations;
        phase.bytes += ALLOCATED_BYTES.load(Ordering::Relaxed) - self.bytes;
    }
}

const PHASES: [&str; 4] = ["request headers", "body (prepare, select, dispatch)", "answer (headers)", "end (release)"];

fn run(engines: usize, policy: &str, requests: u32) {
    let config = parse_and_validate(&router_config(engines, policy)).unwrap_or_else(|e| panic!("{e}"));
    let (host, app) = counting::counted_app(config);
    // 4 KiB of conversation, as the overhead bench sends; the prompt varies per request.
    let filler = "routing ".repeat(500);
    let bodies: Vec<Vec<u8>> = (0..64)
        .map(|i| {
            serde_json::json!({"model": "m", "max_tokens": 1, "stream": false,
                "messages": [{"role": "user", "content": format!("{i} {filler}")}]})
            .to_string()
            .into_bytes()
        })
        .collect();

    let mut phases: Vec<Phase> = PHASES.iter().map(|_| Phase::default()).collect();
    let (mut counters, mut handed) = (0usize, 0usize);
    let headers: Vec<(String, Vec<u8>)> = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "router"),
        ("content-type", "application/json"),
        ("x-sgl-cluster", "spoofed"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
    .collect();
    // The glue's part: count what would be bumps and hand back the body.
    let count = |actions: &mut Vec<Action>, handed: &mut usize| {
        for action in actions.drain(..) {
            if let Action::Count(bumps) = action {
                *handed += bumps.len();
            }
        }
    };
    let one = |i: u32, phases: &mut [Phase], counters: &mut usize, handed: &mut usize| {
        let body = &bodies[i as usize % bodies.len()];
        let mut life = RequestLife::new(None, 1);
        let mut out = Vec::new();
        let meter = Meter::start();
        life.on_request_headers(&app, headers.clone(), false, &mut out);
        count(&mut out, handed);
        meter.stop(&mut phases[0]);
        let meter = Meter::start();
        life.on_request_body(&app, body.len(), true, &mut |_| body.clone(), &mut out);
        assert!(out.contains(&Action::Proceed), "a local selection routes at once: {out:?}");
        *counters += 4;
        count(&mut out, handed);
        meter.stop(&mut phases[1]);
        let meter = Meter::start();
        life.on_response_headers(&app, Some(200), true, &mut || None, &mut out);
        count(&mut out, handed);
        meter.stop(&mut phases[2]);
        let meter = Meter::start();
        life.on_end(&app, &mut out);
        count(&mut out, handed);
        meter.stop(&mut phases[3]);
    };
    for i in 0..requests / 10 {
        one(i, &mut phases, &mut counters, &mut handed);
    }
    let mut phases: Vec<Phase> = PHASES.iter().map(|_| Phase::default()).collect();
    (counters, handed) = (0, 0);
    host.take();
    for i in 0..requests {
        one(i, &mut phases, &mut counters, &mut handed);
        // A request every 100 µs: the clock moves as it does under load.
        if i % 10 == 0 {
            host.inner.advance_ms(1);
        }
    }
    let n = u128::from(requests);
    let total: u128 = phases.iter().map(|p| p.ns).sum();
    println!("\n{policy}, {engines} engines: {:.1} µs per request", total as f64 / n as f64 / 1000.0);
    for (name, p) in PHASES.iter().zip(&phases) {
        println!(
            "  {name:<26} {:>8.2} µs {:>6.1} allocations {:>8.0} bytes",
            p.ns as f64 / n as f64 / 1000.0,
            p.allocations as f64 / n as f64,
            p.bytes as f64 / n as f64
        );
    }
    let calls = host.take();
    let line: Vec<String> = calls.iter().map(|(name, c)| format!("{name} {:.1}", *c as f64 / n as f64)).collect();
    println!("  host calls per request: {}", line.join(", "));
    println!(
        "  counters bumped per request: {:.1}, handed to Envoy in {:.1} host calls",
        counters as f64 / n as f64,
        handed as f64 / n as f64
    );
}

fn main() {
    let target = if cfg!(target_arch = "wasm32") { "wasm32-wasip1 (Node)" } else { "native" };
    println!("one request through the core, {target}");
    // `-- <policy> <engines> [requests]` runs one of them (for a profiler).
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let requests: Option<u32> = only.get(2).and_then(|n| n.parse().ok());
    for engines in [8, 512, 4096] {
        for policy in ["round_robin", "power_of_two", "cache_aware"] {
            if only.first().is_some_and(|p| p != policy) || only.get(1).is_some_and(|n| *n != engines.to_string()) {
                continue;
            }
            run(
                engines,
                policy,
                requests.unwrap_or(if engines > 64 { 20_000_000 / engines as u32 / 10 } else { 20_000 }),
            );
        }
    }
}
