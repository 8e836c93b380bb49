//! Fixtures shared by the crate's unit tests: workers, load reports, policy state, requests.

use std::sync::{Arc, Mutex};

use crate::config::AdmissionLimits;
use crate::policies::admission::AdmissionGate;
use crate::policies::{Pick, PickError, PickReason, PickRequest, Policy};
use crate::registry::Role;
use crate::registry::{Engine, EngineAddress};
use crate::state::load_monitor::{
    EngineLoad, FirstByte, InflightTable, LoadSnapshot, MemoryInflight, PrefillWork, ReportKind, Sample, SentCounts,
    StaticLoad,
};

pub fn worker_with(id: &str, role: Role, model: &str) -> Arc<Engine> {
    Arc::new(Engine {
        id: id.to_string(),
        model: model.to_string(),
        role,
        address: EngineAddress::new("127.0.0.1", 1),
        cluster: format!("sgl_{id}"),
        override_host: None,
        bootstrap_port: (role == Role::Prefill).then_some(8998),
        dp_size: 1,
        draining: false,
    })
}

pub fn worker(id: &str) -> Arc<Engine> {
    worker_with(id, Role::Plain, "m")
}

pub fn workers(ids: &[&str]) -> Vec<Arc<Engine>> {
    ids.iter().map(|id| worker(id)).collect()
}

/// A fresh native report with `running` and `waiting` and room in the KV cache.
pub fn native_load(running: u64, waiting: u64) -> EngineLoad {
    EngineLoad {
        kind: ReportKind::Native,
        running: Some(running),
        waiting: Some(waiting),
        kv_used: Some(10),
        kv_capacity: Some(1000),
        max_running: Some(64),
        waiting_uncached_tokens: None,
        prefill_queue_ms: None,
        prefill_tokens_per_ms: None,
        reported_at_ms: 0,
        sent_at_report: SentCounts::default(),
        rank_loads: Vec::new(),
    }
}

pub fn basic_load(running: u64, waiting: u64) -> EngineLoad {
    EngineLoad { kind: ReportKind::Basic, kv_capacity: None, ..native_load(running, waiting) }
}

/// The state a policy reads, held so a test can change it.
pub struct State {
    pub load: Arc<StaticLoad>,
    pub inflight: Arc<MemoryInflight>,
}

impl State {
    pub fn new() -> Self {
        Self { load: Arc::new(StaticLoad::default()), inflight: Arc::new(MemoryInflight::default()) }
    }

    pub fn loads(&self, loads: &[(&str, EngineLoad)]) {
        self.load.set(LoadSnapshot::from_loads(loads.iter().map(|(id, l)| (id.to_string(), l.clone()))));
    }

    pub fn gate(&self, limits: AdmissionLimits) -> AdmissionGate {
        AdmissionGate { admission: Arc::new(limits), load: self.load.clone(), inflight: self.inflight.clone() }
    }
}

pub fn request(stage: Role) -> crate::policies::PickRequest<'static> {
    crate::policies::PickRequest {
        model: "m",
        stage,
        bucket_id: "b",
        input_tokens: 10,
        expected_peak_tokens: None,
        token_ids: None,
        prompt_text: None,
        indexer: None,
        session_key: None,
        routing_key: None,
        prefix_wait_over: false,
    }
}

type Answer = Box<dyn Fn(&[Arc<Engine>]) -> Result<Pick, PickError> + Send>;

/// Returns a scripted answer and records which candidates it was offered.
#[derive(Default)]
pub struct Scripted {
    answer: Mutex<Option<Answer>>,
    pub offered: Mutex<Vec<Vec<String>>>,
}

impl Scripted {
    pub fn new(answer: impl Fn(&[Arc<Engine>]) -> Result<Pick, PickError> + Send + 'static) -> Arc<Self> {
        Arc::new(Self { answer: Mutex::new(Some(Box::new(answer))), offered: Mutex::default() })
    }

    /// Takes the first candidate.
    pub fn first() -> Arc<Self> {
        Self::new(|c| Ok(Pick::new(Arc::clone(&c[0]), PickReason::Rotation)))
    }

    pub fn failing(error: PickError) -> Arc<Self> {
        Self::new(move |_| Err(error.clone()))
    }
}

impl std::fmt::Debug for Scripted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scripted")
    }
}

impl Policy for Scripted {
    fn pick(&self, engines: &[Arc<Engine>], _: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.offered.lock().unwrap().push(engines.iter().map(|w| w.id.clone()).collect());
        let answer = self.answer.lock().unwrap();
        let result = (answer.as_ref().unwrap())(engines);
        result
    }
}

/// A valid configuration serving `models`, each on one round-robin engine.
pub fn router_config_with_models(models: &[&str]) -> crate::config::RouterConfig {
    let workers: Vec<_> = models
        .iter()
        .enumerate()
        .map(|(i, m)| serde_json::json!({"id": format!("W{i}"), "url": format!("http://10.0.0.{i}:30000"), "model": m}))
        .collect();
    let models: serde_json::Map<String, serde_json::Value> = models
        .iter()
        .map(|m| {
            let bucket = serde_json::json!({"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}});
            (m.to_string(), serde_json::json!({"buckets": [bucket]}))
        })
        .collect();
    let json = serde_json::json!({"workers": workers, "models": models}).to_string();
    crate::config::parse_and_validate(&json).unwrap_or_else(|e| panic!("{e}"))
}

/// The `#[test]` every test module uses: the standard harness's, except on
/// `wasm32-unknown-unknown`, where `wasm-bindgen-test` registers the same functions for its runner.
#[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
pub use core::prelude::v1::test;
#[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
pub use wasm_bindgen_test::wasm_bindgen_test as test;

/// `worker` answered one streamed request of each of `lengths` tokens, its first byte `overhead_ms`
/// plus the prompt at `tokens_per_ms` after it was sent, and was released as it answered: how the
/// router times an engine.
pub fn answered(
    inflight: &MemoryInflight,
    worker: &str,
    tokens_per_ms: f64,
    overhead_ms: u64,
    lengths: impl IntoIterator<Item = u64>,
) {
    for tokens in lengths {
        inflight.acquire(worker, PrefillWork { tokens, tokens_per_ms: 20.0, ahead: 0, slot_wait_ms: 0 });
        let ms = overhead_ms + (tokens as f64 / tokens_per_ms) as u64;
        let timed = FirstByte { prefill_tokens: tokens, sent_ms: 0, sample: Some(Sample { tokens, ms }) };
        inflight.first_byte(worker, timed, 20.0);
        inflight.release(worker, 0, ms);
    }
}
