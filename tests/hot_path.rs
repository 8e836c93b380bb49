//! The hot path's budget (issue 55): the host calls and allocations of one request in steady
//! state through the core, for each policy and with the queue, a hold and retries on or off,
//! against the budgets written below. A change that adds work to every request fails here and
//! names the call that grew; a cut lowers its budget in the same change.
//!
//! One request: the headers, the body (prepare, select, dispatch), the upstream's answer, the
//! stream's end, as `proxy/filter.rs` calls them, on 8 engines whose loads and health the service
//! publishes beside. Counted over 100 requests after 200 of warm-up, the clock moving 1 ms every
//! 10 requests: the core's calls to the host by kind and shared-data table, the glue's (one per
//! header set, body replaced, callout, stat bumped or sample recorded), and allocations. Budgets are
//! per 100 requests.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/counting.rs"]
mod counting;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use counting::{Counting, ALLOCATIONS};
use serde_json::{json, Value};
use sgl_envoy_router::config::parse_and_validate;
use sgl_envoy_router::filter::life::{Action, RequestLife};

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARM_UP: u32 = 200;
const MEASURED: u32 = 100;

fn config(policy: Value, extra: Value) -> Value {
    let workers: Vec<Value> = (0..8)
        .map(|i| json!({"id": format!("E{i:02}"), "url": format!("http://10.0.0.{}:30000", i + 1), "model": "m"}))
        .collect();
    let mut c = json!({
        "workers": workers,
        "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": policy}}}]}},
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

/// The glue's host calls for `actions`, by kind.
fn glue_calls(actions: &mut Vec<Action>, into: &mut BTreeMap<&'static str, u64>) {
    for action in actions.drain(..) {
        let (name, n) = match &action {
            Action::Proceed | Action::Park => continue,
            Action::RemoveRequestHeader(_) | Action::SetRequestHeader(..) => ("glue request header", 1),
            Action::ReplaceRequestBody { body, .. } => {
                *into.entry("glue body bytes handed over").or_default() += body.len() as u64;
                ("glue body replaced", 1)
            }
            Action::ClearRouteCache => ("glue route cache cleared", 1),
            Action::Dispatch(_) | Action::Notify(_) | Action::Detach(..) => ("glue callout", 1),
            Action::Reply { .. } => ("glue reply", 1),
            Action::SetResponseHeader(..) => ("glue response header", 1),
            Action::ResumeResponse => ("glue response resumed", 1),
            Action::Count(bumps) => ("glue stat bumped", bumps.len() as u64),
            Action::Observe(..) => ("glue sample recorded", 1),
        };
        *into.entry(name).or_default() += n;
    }
}

/// What `MEASURED` requests of `scenario` cost: calls by name, and "allocations".
fn measure(router: &Value, distinct: bool) -> BTreeMap<String, u64> {
    let config = parse_and_validate(&router.to_string()).unwrap_or_else(|e| panic!("{e}"));
    let (host, app) = counting::counted_app(config);
    // 4 KiB of conversation, as the overhead bench sends.
    let filler = "routing ".repeat(500);
    let bodies: Vec<Vec<u8>> = (0..(WARM_UP + MEASURED))
        .map(|i| {
            let content = if distinct { format!("{i} {filler}") } else { filler.clone() };
            json!({"model": "m", "max_tokens": 1, "stream": false, "messages": [{"role": "user", "content": content}]})
                .to_string()
                .into_bytes()
        })
        .collect();
    let headers: Vec<(String, Vec<u8>)> = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        (":authority", "router"),
        ("content-type", "application/json"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
    .collect();
    let mut glue = BTreeMap::new();
    let mut allocations = 0;
    let mut out = Vec::with_capacity(64);
    for i in 0..(WARM_UP + MEASURED) {
        if i == WARM_UP {
            host.take();
            glue.clear();
        }
        let body = &bodies[i as usize];
        let request_headers = headers.clone();
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        let mut life = RequestLife::new(None, 1);
        life.on_request_headers(&app, request_headers, false, &mut out);
        glue_calls(&mut out, &mut glue);
        life.on_request_body(&app, body.len(), true, &mut |_| body.clone(), &mut out);
        assert!(out.contains(&Action::Proceed), "routed at once: {out:?}");
        glue_calls(&mut out, &mut glue);
        life.on_response_headers(&app, Some(200), true, &mut || None, &mut out);
        glue_calls(&mut out, &mut glue);
        life.on_end(&app, &mut out);
        glue_calls(&mut out, &mut glue);
        drop(life);
        if i >= WARM_UP {
            // The body the glue hands over is Envoy's copy, not the core's work.
            allocations += ALLOCATIONS.load(Ordering::Relaxed) - before - 1;
        }
        if i % 10 == 0 {
            host.inner.advance_ms(1);
        }
    }
    let mut measured: BTreeMap<String, u64> = host.take().into_iter().collect();
    measured.extend(glue.into_iter().map(|(k, v)| (k.to_string(), v)));
    measured.insert("allocations".to_string(), allocations);
    measured
}

struct Scenario {
    name: &'static str,
    policy: Value,
    extra: Value,
    distinct: bool,
    /// A policy or queue that weighs the engine model: [`ENGINE_MODEL`] applies.
    engine_model: bool,
    /// Where this scenario's budget differs from [`BASE`] (0: the call may not be made). A call in
    /// neither may not be made.
    budget: &'static [(&'static str, u64)],
}

/// round_robin with default settings, per 100 requests: what every other scenario is written
/// against.
const BASE: &[(&str, u64)] = &[
    ("allocations", 4907),
    // The id goes first: only the bytes up to the body's `{` are replaced, not the 4 KiB.
    ("glue body bytes handed over", 4600),
    ("glue body replaced", 100),
    ("glue request header", 300),
    ("glue response header", 200),
    ("glue route cache cleared", 100),
    ("glue sample recorded", 100),
    ("glue stat bumped", 400),
    ("now_ms", 2000),
    ("shared_get sgl.health", 2),
    ("shared_get sgl.inflight", 2),
    ("shared_get sgl.rr", 100),
    ("shared_get sgl.vms", 2),
    ("shared_set sgl.inflight", 100),
    ("shared_set sgl.rr", 100),
];

/// What a policy or a queue that weighs the engine model (pending prefill, learned speed) adds to
/// [`BASE`]: the engines' load reports read, clock reads, and a dispatch that sends a prompt to
/// prefill told to the other VMs at once.
const ENGINE_MODEL: &[(&str, u64)] = &[("shared_get sgl.load", 2), ("shared_set sgl.inflight", 110)];

/// cache_aware against [`BASE`]: a prefix event queued and the replica's head read per request, no
/// cursor; repeated and distinct prompts cost the same.
const CACHE_AWARE: &[(&str, u64)] = &[
    ("allocations", 8240),
    ("enqueue", 100),
    ("now_ms", 3700),
    ("shared_get sgl.prefix", 100),
    ("shared_get sgl.rr", 0),
    ("shared_set sgl.rr", 0),
];

fn scenarios() -> Vec<Scenario> {
    let rr = || json!({"type": "round_robin"});
    let ca = || json!({"type": "cache_aware"});
    vec![
        Scenario {
            name: "round_robin, defaults",
            policy: rr(),
            extra: json!({}),
            distinct: true,
            engine_model: false,
            budget: &[],
        },
        Scenario {
            name: "round_robin, retries off",
            policy: rr(),
            extra: json!({"retry": {"attempts": 0}}),
            distinct: true,
            engine_model: false,
            budget: &[("allocations", 4207), ("glue request header", 200), ("now_ms", 1900)],
        },
        Scenario {
            name: "round_robin, max_inflight_requests 64",
            policy: json!({"type": "round_robin", "admission": {"max_inflight_requests": 64}}),
            extra: json!({}),
            distinct: true,
            engine_model: false,
            budget: &[("allocations", 6307), ("shared_get sgl.seats", 200), ("shared_set sgl.seats", 200)],
        },
        Scenario {
            name: "round_robin, with a queue",
            policy: rr(),
            extra: json!({"queue": {}}),
            distinct: true,
            engine_model: true,
            budget: &[
                ("allocations", 5905),
                ("now_ms", 2800),
                ("shared_get sgl.inflight", 100),
                ("shared_get sgl.queue", 100),
                ("shared_get sgl.vms", 100),
                ("shared_set sgl.inflight", 200),
            ],
        },
        Scenario {
            name: "power_of_two, defaults",
            policy: json!({"type": "power_of_two"}),
            extra: json!({}),
            distinct: true,
            engine_model: true,
            budget: &[("allocations", 4839), ("now_ms", 3400), ("shared_get sgl.rr", 0), ("shared_set sgl.rr", 0)],
        },
        Scenario {
            name: "cache_aware, repeated prompt",
            policy: ca(),
            extra: json!({}),
            distinct: false,
            engine_model: true,
            budget: CACHE_AWARE,
        },
        Scenario {
            name: "cache_aware, distinct prompts",
            policy: ca(),
            extra: json!({}),
            distinct: true,
            engine_model: true,
            budget: CACHE_AWARE,
        },
        Scenario {
            name: "cache_aware, hold_for_prefix",
            policy: json!({"type": "cache_aware", "hold_for_prefix": true}),
            extra: json!({}),
            distinct: true,
            engine_model: true,
            budget: CACHE_AWARE,
        },
    ]
}

#[test]
fn one_request_in_steady_state_stays_within_its_budget() {
    let mut over = Vec::new();
    for s in scenarios() {
        let measured = measure(&config(s.policy, s.extra), s.distinct);
        println!("{}: {measured:?}", s.name);
        let mut budget: BTreeMap<&str, u64> = BASE.iter().copied().collect();
        if s.engine_model {
            budget.extend(ENGINE_MODEL.iter().copied());
        }
        budget.extend(s.budget.iter().copied());
        for (call, n) in &measured {
            let allowed = budget.get(call.as_str()).copied().unwrap_or(0);
            if *n > allowed {
                over.push(format!("{}: `{call}` {n} per {MEASURED} requests, budget {allowed}", s.name));
            }
        }
    }
    assert!(over.is_empty(), "over budget (raise a budget only with the change that needs it):\n{}", over.join("\n"));
}
