//! The singleton service: on each tick it dispatches the health checks the core's monitor says are
//! due, and publishes the monitor's table when a worker's health flips.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proxy_wasm::hostcalls;

use super::host::ProxyHost;
use crate::config::RouterConfig;
use crate::host::Host;
use crate::registry::{Worker, WorkerRegistry};
use crate::state::health::HealthMonitor;
use crate::state::{keys, shared};

const TICK_MS: u64 = 100;

pub struct Service {
    config: RouterConfig,
    workers: Vec<Arc<Worker>>,
    health: HealthMonitor,
    pending_health: HashMap<u32, usize>,
    published_once: bool,
}

impl Service {
    pub fn new(config: RouterConfig) -> Self {
        let workers = WorkerRegistry::from_config(&config).all().to_vec();
        let health = HealthMonitor::new(config.health.clone(), &workers);
        Self {
            config,
            workers,
            health,
            pending_health: HashMap::new(),
            published_once: false,
        }
    }

    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(TICK_MS.min(self.config.health.interval_ms))
    }

    pub fn on_tick(&mut self) {
        if !self.published_once {
            self.publish_health();
        }
        let now = ProxyHost.now_ms();
        let timeout = Duration::from_millis(self.config.health.timeout_ms);
        for index in self.health.due(now) {
            let Some(worker) = self.workers.get(index) else {
                continue;
            };
            let authority = worker.address.host_port();
            let headers = vec![
                (":method", "GET"),
                (":path", self.config.health.path.as_str()),
                (":authority", authority.as_str()),
            ];
            match hostcalls::dispatch_http_call(&worker.cluster, headers, None, vec![], timeout) {
                Ok(token) => {
                    self.pending_health.insert(token, index);
                }
                Err(status) => {
                    log::warn!("health check of {} not dispatched: {status:?}", worker.id);
                    if self.health.abandon(index) {
                        self.publish_health();
                    }
                }
            }
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, _body_size: usize) {
        let Some(index) = self.pending_health.remove(&token) else {
            return;
        };
        let status = hostcalls::get_map_value(
            proxy_wasm::types::MapType::HttpCallResponseHeaders,
            ":status",
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let ok = status.starts_with('2');
        if self.health.record(index, ok) {
            if let Some(w) = self.workers.get(index) {
                log::info!(
                    "worker {} is now {}",
                    w.id,
                    if ok { "healthy" } else { "unhealthy" }
                );
            }
            self.publish_health();
        }
    }

    fn publish_health(&mut self) {
        let table = self.health.table();
        match serde_json::to_vec(&table) {
            Ok(bytes) => match shared::publish(&ProxyHost, keys::HEALTH_TABLE, &bytes) {
                Ok(_) => self.published_once = true,
                Err(e) => log::warn!("health table not published: {e}"),
            },
            Err(e) => log::warn!("health table not encoded: {e}"),
        }
    }
}
