//! Cost of the selection core: one pick per policy over 8, 64, 512 and 4,096 engines, and one resolve
//! over 4 and 32 buckets. Runs natively (`cargo bench --bench selection`) and inside wasm under
//! Node (`--target wasm32-wasip1 --no-default-features`). Prints ns per operation; never asserted.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use sgl_envoy_router::buckets::{Bucket, BucketGroups, BucketResolver, EngineGroup};
use sgl_envoy_router::config::AdmissionLimits;
use sgl_envoy_router::host::{Host, MemoryHost};
use sgl_envoy_router::policies::admission::AdmissionGate;
use sgl_envoy_router::policies::{
    LoadBasedPolicy, MemoryCursor, PickRequest, Policy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, SeededRandom,
    SharedCursor,
};
use sgl_envoy_router::registry::Role;
use sgl_envoy_router::registry::{Engine, EngineAddress};
use sgl_envoy_router::state::load_monitor::{EngineLoad, LoadSnapshot, MemoryInflight, ReportKind, StaticLoad};

fn workers(n: usize) -> Vec<Arc<Engine>> {
    (0..n)
        .map(|i| {
            Arc::new(Engine {
                id: format!("w{i:04}"),
                model: "m".into(),
                role: Role::Plain,
                address: EngineAddress::new("127.0.0.1", 1),
                cluster: format!("sgl_w{i:04}"),
                override_host: None,
                bootstrap_port: None,
                dp_size: 1,
                draining: false,
            })
        })
        .collect()
}

fn loads(ws: &[Arc<Engine>]) -> LoadSnapshot {
    LoadSnapshot::from_loads(ws.iter().enumerate().map(|(i, w)| {
        (
            w.id.clone(),
            EngineLoad {
                kind: ReportKind::Native,
                running: Some((i * 7 % 13) as u64),
                waiting: Some((i * 5 % 11) as u64),
                kv_used: Some(1000),
                kv_capacity: Some(100_000),
                max_running: Some(64),
                waiting_uncached_tokens: Some((i * 3 % 17) as u64 * 100),
                prefill_queue_ms: None,
                prefill_tokens_per_ms: None,
                reported_at_ms: 0,
                sent_at_report: Default::default(),
                rank_loads: Vec::new(),
            },
        )
    }))
}

fn time(label: &str, iterations: u32, mut op: impl FnMut()) {
    for _ in 0..iterations / 10 {
        op();
    }
    let start = Instant::now();
    for _ in 0..iterations {
        op();
    }
    let ns = start.elapsed().as_nanos() as f64 / f64::from(iterations);
    println!("{label:<52} {ns:>10.0} ns/op");
}

fn main() {
    let target = if cfg!(target_arch = "wasm32") { "wasm32-wasip1 (Node)" } else { "native" };
    println!("selection core, {target}");
    let request = PickRequest {
        model: "m",
        stage: Role::Plain,
        bucket_id: "b",
        input_tokens: 1000,
        expected_peak_tokens: Some(2000),
        token_ids: None,
        prompt_text: None,
        indexer: None,
        session_key: None,
        routing_key: None,
        prefix_wait_over: false,
    };
    let limits =
        AdmissionLimits { max_running_requests: Some(1_000), max_inflight_requests: Some(1_000), ..Default::default() };
    for n in [8usize, 64, 512, 4096] {
        let ws = workers(n);
        let load = Arc::new(StaticLoad::new(loads(&ws)));
        let inflight = Arc::new(MemoryInflight::default());
        let gate = AdmissionGate { admission: Arc::new(limits), load: load.clone(), inflight: inflight.clone() };
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let policies: Vec<(&str, Box<dyn Policy>)> = vec![
            (
                "round_robin (local cursor)",
                Box::new(RoundRobinPolicy::new(Box::new(MemoryCursor::default()), gate.clone())),
            ),
            (
                "round_robin (shared-data cursor)",
                Box::new(RoundRobinPolicy::new(
                    Box::new(SharedCursor::new(host, "m/b/plain", Arc::default())),
                    gate.clone(),
                )),
            ),
            ("random", Box::new(RandomPolicy::new(Arc::new(SeededRandom::new(1)), gate.clone()))),
            ("power_of_two", Box::new(PowerOfTwoPolicy::new(Arc::new(SeededRandom::new(1)), gate.clone()))),
            ("load_based", Box::new(LoadBasedPolicy::new(gate.clone()))),
        ];
        for (name, policy) in &policies {
            let iterations = if n >= 512 && *name == "load_based" { 20_000 * 512 / n as u32 } else { 200_000 };
            time(&format!("pick {name}, {n} engines"), iterations, || {
                black_box(policy.pick(black_box(&ws), &request).ok());
            });
        }
    }
    for count in [4usize, 32] {
        let buckets: Vec<Bucket> = (0..count)
            .map(|i| Bucket {
                id: format!("b{i:02}").into(),
                rank: (i % 3) as i64,
                min_input: 0,
                max_input: Some(1024 << (i % 8)),
                max_context: Some(2048 << (i % 8)),
                groups: BucketGroups::Plain(EngineGroup::new(
                    Role::Plain,
                    Arc::new(RandomPolicy::new(
                        Arc::new(SeededRandom::new(1)),
                        AdmissionGate {
                            admission: Arc::new(AdmissionLimits::default()),
                            load: Arc::new(StaticLoad::default()),
                            inflight: Arc::new(MemoryInflight::default()),
                        },
                    )),
                )),
            })
            .collect();
        let resolver = BucketResolver::new(buckets);
        time(&format!("resolve, {count} buckets"), 500_000, || {
            black_box(resolver.resolve(black_box(900), Some(1800)).ok());
        });
    }
}
