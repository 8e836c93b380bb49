//! The singleton service. On each tick it dispatches the health checks and load polls the core's
//! monitors say are due, publishes their tables when they change, reclaims the in-flight shares of
//! filter VMs that died, and exports the shared counts as gauges.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MapType;

use super::host::ProxyHost;
use super::stats::Stats;
use crate::config::factory::prefix_budgets;
use crate::config::RouterConfig;
use crate::host::Host;
use crate::registry::{Worker, WorkerRegistry};
use crate::server::metrics::label;
use crate::state::affinity_store::{AffinityStore, BindingKind};
use crate::state::health::HealthMonitor;
use crate::state::kv_events::{PrefixEvent, PrefixLog};
use crate::state::load_monitor::{InflightTable, LoadPoller, SharedInflight};
use crate::state::{keys, shared, vm_registry};

const TICK_MS: u64 = 100;

#[derive(Debug, Clone, Copy)]
enum Poll {
    Health(usize),
    Load(usize),
}

pub struct Service {
    config: RouterConfig,
    workers: Vec<Arc<Worker>>,
    health: HealthMonitor,
    load: LoadPoller,
    /// Reads the filters' shared counts (the service dispatches nothing itself).
    inflight: SharedInflight,
    pending: HashMap<u32, Poll>,
    health_published: bool,
    last_sweep_ms: u64,
    last_affinity_sweep_ms: u64,
    prefixes: PrefixLog,
    prefix_queue: Option<u32>,
    affinity: AffinityStore,
    stats: Rc<Stats>,
}

impl Service {
    pub fn new(config: RouterConfig, stats: Rc<Stats>) -> Self {
        let workers = WorkerRegistry::from_config(&config).all().to_vec();
        let health = HealthMonitor::new(config.health.clone(), &workers);
        let load = LoadPoller::new(&config.load, &workers);
        let prefixes = PrefixLog::new(prefix_budgets(&config));
        if let Err(e) = prefixes.publish_start(&ProxyHost) {
            log::warn!("prefix log not started: {e}");
        }
        let prefix_queue = match hostcalls::register_shared_queue(keys::PREFIX_QUEUE) {
            Ok(id) => Some(id),
            Err(status) => {
                log::warn!("prefix queue not registered: {status:?}");
                None
            }
        };
        Self {
            prefixes,
            prefix_queue,
            affinity: AffinityStore::new(Arc::new(ProxyHost)),
            last_affinity_sweep_ms: 0,
            inflight: SharedInflight::new(Arc::new(ProxyHost), 0),
            config,
            workers,
            health,
            load,
            pending: HashMap::new(),
            health_published: false,
            last_sweep_ms: 0,
            stats,
        }
    }

    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(TICK_MS.min(self.config.health.interval_ms).min(self.config.load.interval_ms).max(10))
    }

    fn dispatch(&mut self, worker: &Worker, path: &str, timeout_ms: u64, what: Poll) -> bool {
        let authority = worker.address.host_port();
        let headers = vec![(":method", "GET"), (":path", path), (":authority", authority.as_str())];
        match hostcalls::dispatch_http_call(&worker.cluster, headers, None, vec![], Duration::from_millis(timeout_ms)) {
            Ok(token) => {
                self.pending.insert(token, what);
                true
            }
            Err(status) => {
                log::warn!("poll of {} ({path}) not dispatched: {status:?}", worker.id);
                false
            }
        }
    }

    pub fn on_tick(&mut self) {
        if !self.health_published {
            self.publish_health();
        }
        let now = ProxyHost.now_ms();
        for index in self.health.due(now) {
            let Some(worker) = self.workers.get(index).cloned() else {
                continue;
            };
            let path = self.config.health.path.clone();
            if !self.dispatch(&worker, &path, self.config.health.timeout_ms, Poll::Health(index))
                && self.health.abandon(index)
            {
                self.publish_health();
            }
        }
        if let Some(path) = self.load.path() {
            for index in self.load.due(now) {
                let Some(worker) = self.workers.get(index).cloned() else {
                    continue;
                };
                if !self.dispatch(&worker, path, self.config.load.timeout_ms, Poll::Load(index)) {
                    let _ = self.load.record(index, None, now, 0);
                }
            }
        }
        if let Some(table) = self.load.take_publication() {
            if let Err(e) = shared::publish(&ProxyHost, keys::LOAD_TABLE, &table) {
                log::warn!("load table not published: {e}");
            }
        }
        if now.saturating_sub(self.last_affinity_sweep_ms) >= self.config.affinity_sweep_ms {
            self.last_affinity_sweep_ms = now;
            self.sweep_affinity();
        }
        if now.saturating_sub(self.last_sweep_ms) >= vm_registry::HEARTBEAT_MS {
            self.last_sweep_ms = now;
            self.sweep_dead_vms();
            self.export_gauges(now);
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        let Some(what) = self.pending.remove(&token) else {
            return;
        };
        let status =
            hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status").ok().flatten().unwrap_or_default();
        let ok = status.starts_with('2');
        match what {
            Poll::Health(index) => {
                if self.health.record(index, ok) {
                    if let Some(w) = self.workers.get(index) {
                        log::info!("worker {} is now {}", w.id, if ok { "healthy" } else { "unhealthy" });
                        if !ok {
                            // What a failed engine cached is unknown once it comes back.
                            let cleared = PrefixEvent::AllCleared { worker: w.id.clone() };
                            if let Err(e) = self.prefixes.append(&ProxyHost, vec![cleared]) {
                                log::warn!("prefix invalidation of {} not logged: {e}", w.id);
                            }
                        }
                    }
                    self.publish_health();
                }
            }
            Poll::Load(index) => {
                let body = if ok {
                    hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpCallResponseBody, 0, body_size)
                        .ok()
                        .flatten()
                } else {
                    None
                };
                let dispatches = self.workers.get(index).map(|w| self.inflight.dispatched_total(&w.id)).unwrap_or(0);
                if let Err(e) = self.load.record(index, body.as_deref(), ProxyHost.now_ms(), dispatches) {
                    if let Some(w) = self.workers.get(index) {
                        log::warn!("load report of {} not understood: {e}", w.id);
                    }
                }
            }
        }
    }

    /// Drains the prefix events the filters sent and appends them to the log as one batch.
    pub fn on_queue_ready(&mut self, queue_id: u32) {
        if Some(queue_id) != self.prefix_queue {
            return;
        }
        let mut events = Vec::new();
        while let Ok(Some(message)) = hostcalls::dequeue_shared_queue(queue_id) {
            match serde_json::from_slice::<PrefixEvent>(&message) {
                Ok(e) => events.push(e),
                Err(e) => log::warn!("prefix event not understood: {e}"),
            }
        }
        if let Err(e) = self.prefixes.append(&ProxyHost, events) {
            log::warn!("prefix events not logged: {e}");
        }
    }

    /// Expires idle session and sticky bindings, and bindings to engines no longer configured.
    fn sweep_affinity(&self) {
        let models = &self.config.models;
        let idle = |model: &str, kind: BindingKind| {
            models.get(model).map_or(0, |m| match kind {
                BindingKind::Session => m.session_idle_ms,
                BindingKind::Sticky => m.sticky_idle_ms,
            })
        };
        let known = |id: &str| self.workers.iter().any(|w| w.id == id);
        let removed = self.affinity.sweep(&idle, &known);
        if removed > 0 {
            log::info!("expired {removed} idle affinity bindings");
        }
    }

    fn publish_health(&mut self) {
        match serde_json::to_vec(&self.health.table()) {
            Ok(bytes) => match shared::publish(&ProxyHost, keys::HEALTH_TABLE, &bytes) {
                Ok(_) => self.health_published = true,
                Err(e) => log::warn!("health table not published: {e}"),
            },
            Err(e) => log::warn!("health table not encoded: {e}"),
        }
    }

    /// A filter VM that stopped heartbeating crashed (FAIL_RELOAD made a new one); what it held
    /// would otherwise stay counted forever.
    fn sweep_dead_vms(&self) {
        let dead = match vm_registry::sweep(&ProxyHost, ProxyHost.now_ms()) {
            Ok(dead) => dead,
            Err(e) => {
                log::warn!("VM sweep failed: {e}");
                return;
            }
        };
        if dead.is_empty() {
            return;
        }
        for worker in &self.workers {
            match SharedInflight::reclaim(&ProxyHost, &worker.id, &dead) {
                Ok(0) => {}
                Ok(n) => log::warn!("reclaimed {n} in-flight requests of {} from {} dead VMs", worker.id, dead.len()),
                Err(e) => log::warn!("in-flight of {} not reclaimed: {e}", worker.id),
            }
        }
    }

    fn export_gauges(&self, now: u64) {
        let snapshot = self.load.table().snapshot(now, self.config.load.stale_after_ms);
        let mut fresh = 0;
        for w in &self.workers {
            let id = label(&w.id);
            self.stats.gauge(&format!("sgl_router_inflight.worker.{id}"), self.inflight.inflight(&w.id));
            let has_report = snapshot.get(&w.id).is_some();
            fresh += u64::from(has_report);
            self.stats.gauge(&format!("sgl_router_fresh_load_report.worker.{id}"), u64::from(has_report));
        }
        self.stats.gauge("sgl_router_fresh_load_reports", fresh);
        let unhealthy = self.health.table().unhealthy.len() as u64;
        self.stats.gauge("sgl_router_healthy_workers", (self.workers.len() as u64).saturating_sub(unhealthy));
        self.stats.gauge("sgl_router_health_published", u64::from(self.health_published));
        self.stats.gauge("sgl_router_prefix_log_head", self.prefixes.head());
        let bytes: u64 = self.prefixes.trees().values().map(|t| t.size_bytes()).sum();
        self.stats.gauge("sgl_router_prefix_service_bytes", bytes);
        self.stats.gauge("sgl_router_affinity_bindings", self.affinity.len() as u64);
    }
}
