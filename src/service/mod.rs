//! The singleton service's core (design "How state walks"): on each tick it says which health
//! checks and load polls are due, publishes the load and health tables when they change, expires
//! idle affinity bindings, reclaims the in-flight shares of filter VMs that died, and applies the
//! filters' prefix events to the authoritative trees. The glue (`proxy/service`) only dispatches
//! the polls it is given and hands the answers back.

mod follow;

use std::sync::Arc;

pub use follow::FollowingService;

use crate::config::RouterConfig;
use crate::host::{CalloutRequest, Host};
use crate::registry::Engine;
use crate::state::affinity_store::{AffinityStore, BindingKind};
use crate::state::health::HealthMonitor;
use crate::state::load_monitor::{InflightTable, LoadPoller, SentCounts, SharedInflight};
use crate::state::prefix::{wire, PrefixEvent, PrefixLog};
use crate::state::seats::SeatBook;
use crate::state::{keys, shared, vm_registry};
use crate::wiring::counters::label;
use crate::wiring::factory::{self, prefix_budgets};
use crate::wiring::upstream::UpstreamAnswer;

/// The longest the service sleeps between ticks.
const TICK_MS: u64 = 100;

/// What a poll was for, so its answer goes back to the right monitor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollKind {
    Health(usize),
    Load(usize),
}

/// A poll the glue should dispatch now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PollRequest {
    pub kind: PollKind,
    /// The worker list it was sent for: an answer to an older list is not recorded.
    pub generation: u32,
    pub request: CalloutRequest,
}

/// What one tick asks of the glue.
#[derive(Debug, Default)]
pub struct TickPlan {
    pub polls: Vec<PollRequest>,
    /// Gauges to export, when they are due.
    pub gauges: Vec<(String, u64)>,
}

pub struct ServiceCore {
    host: Arc<dyn Host>,
    config: RouterConfig,
    workers: Vec<Arc<Engine>>,
    health: HealthMonitor,
    load: LoadPoller,
    /// Reads the filters' shared counts (the service dispatches nothing itself).
    inflight: SharedInflight,
    /// When the health table was last published: it goes out again every check interval.
    health_published_ms: Option<u64>,
    last_sweep_ms: u64,
    last_affinity_sweep_ms: u64,
    prefixes: PrefixLog,
    affinity: AffinityStore,
    /// Counts the worker lists followed; see [`PollRequest::generation`].
    generation: u32,
    /// Removed workers whose per-worker gauges go to 0 at the next export: Envoy keeps a gauge's
    /// last value, and a removed worker's would read as requests in flight forever.
    retired: Vec<String>,
}

impl ServiceCore {
    pub fn new(config: RouterConfig, host: Arc<dyn Host>) -> Self {
        let workers = factory::registry(&config).all().to_vec();
        let health = HealthMonitor::new(factory::health_thresholds(&config.health), &workers);
        let load = LoadPoller::new(factory::report_endpoint(config.load.source), config.load.interval_ms, &workers);
        let prefixes = PrefixLog::resume(host.as_ref(), prefix_budgets(&config));
        if let Err(e) = prefixes.publish_start(host.as_ref()) {
            log::warn!("prefix log not started: {e}");
        }
        Self {
            prefixes,
            affinity: AffinityStore::new(Arc::clone(&host)),
            inflight: SharedInflight::new(Arc::clone(&host), 0, config.workers.iter().map(|w| w.id.as_str())),
            host,
            config,
            workers,
            health,
            load,
            health_published_ms: None,
            last_sweep_ms: 0,
            last_affinity_sweep_ms: 0,
            generation: 0,
            retired: Vec::new(),
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Follows a new filter configuration (spec §8). What the workers configured before and after
    /// have (health verdicts, load reports, prefix entries, affinity bindings, in-flight counts,
    /// breakers) is kept; what removed workers have is dropped: their prefix entries at once, their
    /// bindings now, their reports from the table.
    pub fn reconfigure(&mut self, config: RouterConfig) {
        let workers = factory::registry(&config).all().to_vec();
        let removed: Vec<String> =
            self.workers.iter().filter(|w| !workers.iter().any(|n| n.id == w.id)).map(|w| w.id.clone()).collect();
        let added = workers.iter().filter(|w| !self.workers.iter().any(|o| o.id == w.id)).count();
        let draining = workers.iter().filter(|w| w.draining).count();
        self.health.follow(factory::health_thresholds(&config.health), &workers);
        self.load.follow(factory::report_endpoint(config.load.source), config.load.interval_ms, &workers);
        self.inflight = SharedInflight::new(Arc::clone(&self.host), 0, config.workers.iter().map(|w| w.id.as_str()));
        self.prefixes.set_budgets(prefix_budgets(&config));
        let cleared = removed.iter().map(|w| PrefixEvent::AllCleared { worker: w.clone() }).collect();
        if let Err(e) = self.prefixes.append(self.host.as_ref(), cleared) {
            log::warn!("prefix entries of removed workers not dropped: {e}");
        }
        self.retired.retain(|id| !workers.iter().any(|w| &w.id == id));
        self.retired.extend(removed.iter().cloned());
        self.workers = workers;
        self.config = config;
        self.generation = self.generation.wrapping_add(1);
        self.sweep_affinity();
        self.publish_health();
        log::info!(
            "following the filter configuration: {} workers ({added} added, {} removed{}, {draining} draining)",
            self.workers.len(),
            removed.len(),
            if removed.is_empty() { String::new() } else { format!(": {}", removed.join(", ")) },
        );
    }

    pub fn tick_period_ms(&self) -> u64 {
        TICK_MS.min(self.config.health.interval_ms).min(self.config.load.interval_ms).max(10)
    }

    fn poll(&self, kind: PollKind, worker: &Engine, path: &str, timeout_ms: u64) -> PollRequest {
        PollRequest { kind, generation: self.generation, request: worker.callout("GET", path, timeout_ms) }
    }

    /// Everything due at `now`: the polls to dispatch, tables published, sweeps run.
    pub fn tick(&mut self, now: u64) -> TickPlan {
        let mut plan = TickPlan::default();
        // Unchanged verdicts go out again too: the timestamp tells the filters the service lives.
        if self.health_published_ms.is_none_or(|at| now.saturating_sub(at) >= self.config.health.interval_ms) {
            self.publish_health();
        }
        for index in self.health.due(now) {
            if let Some(w) = self.workers.get(index) {
                let (path, timeout) = (&self.config.health.path, self.config.health.timeout_ms);
                plan.polls.push(self.poll(PollKind::Health(index), w, path, timeout));
            }
        }
        if let Some(path) = self.load.path() {
            for index in self.load.due(now) {
                if let Some(w) = self.workers.get(index) {
                    plan.polls.push(self.poll(PollKind::Load(index), w, path, self.config.load.timeout_ms));
                }
            }
        }
        self.publish_load();
        if now.saturating_sub(self.last_affinity_sweep_ms) >= self.config.affinity_sweep_ms {
            self.last_affinity_sweep_ms = now;
            self.sweep_affinity();
        }
        if now.saturating_sub(self.last_sweep_ms) >= vm_registry::HEARTBEAT_MS {
            self.last_sweep_ms = now;
            self.sweep_dead_vms(now);
            plan.gauges = self.gauges(now);
        }
        plan
    }

    /// A poll could not even be dispatched: a health check counts as failed, so it is not retried
    /// forever; a load poll records nothing, so the old report ages out.
    pub fn not_dispatched(&mut self, kind: PollKind, now: u64) {
        match kind {
            PollKind::Health(index) => {
                if self.health.abandon(index) {
                    self.health_flipped(index, false);
                }
            }
            PollKind::Load(index) => {
                let _ = self.load.record(index, None, now, SentCounts::default());
            }
        }
    }

    /// A poll answered (`status: None` for a timeout or connection failure).
    pub fn on_poll_answer(&mut self, kind: PollKind, generation: u32, status: Option<u16>, body: &[u8], now: u64) {
        if generation != self.generation {
            return;
        }
        let ok = UpstreamAnswer::from_status(status).succeeded();
        match kind {
            PollKind::Health(index) => {
                if self.health.record(index, ok) {
                    self.health_flipped(index, ok);
                }
            }
            PollKind::Load(index) => {
                self.inflight.sync_if_due();
                let sent = self.workers.get(index).map(|w| self.inflight.local_load(&w.id).sent()).unwrap_or_default();
                if let Err(e) = self.load.record(index, ok.then_some(body), now, sent) {
                    if let Some(w) = self.workers.get(index) {
                        log::warn!("load report of {} not understood: {e}", w.id);
                    }
                }
                self.publish_load();
            }
        }
    }

    fn health_flipped(&mut self, index: usize, healthy: bool) {
        if let Some(w) = self.workers.get(index) {
            log::info!("worker {} is now {}", w.id, if healthy { "healthy" } else { "unhealthy" });
            if !healthy {
                // What a failed engine cached is unknown once it comes back.
                let cleared = PrefixEvent::AllCleared { worker: w.id.clone() };
                if let Err(e) = self.prefixes.append(self.host.as_ref(), vec![cleared]) {
                    log::warn!("prefix invalidation of {} not logged: {e}", w.id);
                }
            }
        }
        self.publish_health();
    }

    /// The prefix events the filters queued (each message a VM's held events), appended to the
    /// log as one batch.
    pub fn on_prefix_messages(&mut self, messages: impl IntoIterator<Item = Vec<u8>>) {
        let mut events: Vec<PrefixEvent> = Vec::new();
        for message in messages {
            match wire::decode_each::<PrefixEvent>(&message) {
                Ok(decoded) => events.extend(decoded),
                Err((decoded, e)) => {
                    log::warn!("prefix events not understood after {} of them: {e}", decoded.len());
                    events.extend(decoded);
                }
            }
        }
        if let Err(e) = self.prefixes.append(self.host.as_ref(), events) {
            log::warn!("prefix events not logged: {e}");
        }
    }

    fn publish_load(&mut self) {
        if let Some(table) = self.load.take_publication() {
            if let Err(e) = shared::publish(self.host.as_ref(), keys::LOAD_TABLE, &table) {
                log::warn!("load table not published: {e}");
            }
        }
    }

    fn publish_health(&mut self) {
        let now = self.host.now_ms();
        match serde_json::to_vec(&self.health.table(now)) {
            Ok(bytes) => match shared::publish(self.host.as_ref(), keys::HEALTH_TABLE, &bytes) {
                Ok(_) => self.health_published_ms = Some(now),
                Err(e) => log::warn!("health table not published: {e}"),
            },
            Err(e) => log::warn!("health table not encoded: {e}"),
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

    /// A filter VM that stopped heartbeating crashed (FAIL_RELOAD made a new one); what it held
    /// would otherwise stay counted forever.
    fn sweep_dead_vms(&self, now: u64) {
        let dead = match vm_registry::sweep(self.host.as_ref(), now) {
            Ok(dead) => dead,
            Err(e) => {
                log::warn!("VM sweep failed: {e}");
                return;
            }
        };
        if dead.is_empty() {
            return;
        }
        match self.inflight.reclaim(&dead) {
            Ok(0) => {}
            Ok(n) => log::warn!("reclaimed {n} in-flight requests from {} dead VMs", dead.len()),
            Err(e) => log::warn!("in-flight of dead VMs not reclaimed: {e}"),
        }
        let seats = SeatBook::new(Arc::clone(&self.host), 0);
        match seats.reclaim(self.workers.iter().map(|w| w.id.as_str()), &dead) {
            Ok(0) => {}
            Ok(n) => log::warn!("reclaimed {n} seats from {} dead VMs", dead.len()),
            Err(e) => log::warn!("seats of dead VMs not reclaimed: {e}"),
        }
    }

    fn gauges(&mut self, now: u64) -> Vec<(String, u64)> {
        self.inflight.sync_if_due();
        let snapshot = self.load.table().snapshot(now, self.config.load.stale_after_ms);
        let mut gauges = Vec::with_capacity(6 * self.workers.len() + 8);
        for id in std::mem::take(&mut self.retired) {
            let id = label(&id);
            gauges.push((format!("sgl_router_inflight.worker.{id}"), 0));
            gauges.push((format!("sgl_router_fresh_load_report.worker.{id}"), 0));
            gauges.push((format!("sgl_router_prefill_tokens_per_s.worker.{id}"), 0));
            gauges.push((format!("sgl_router_first_byte_overhead_ms.worker.{id}"), 0));
            gauges.push((format!("sgl_router_batched_first_bytes_pct.worker.{id}"), 0));
            gauges.push((format!("sgl_router_prefill_batches.worker.{id}"), 0));
        }
        let fleet = self.inflight.prior(self.config.load.prefill_tokens_per_s / 1000.0);
        let mut fresh = 0;
        for w in &self.workers {
            let id = label(&w.id);
            let local = self.inflight.local_load(&w.id);
            gauges.push((format!("sgl_router_inflight.worker.{id}"), local.inflight));
            // The speed the filters route on: the engine's own fit, leaning while young on what
            // the fleet has shown.
            let speed = local.speed.speed(fleet.of(&local));
            gauges
                .push((format!("sgl_router_prefill_tokens_per_s.worker.{id}"), (speed.tokens_per_ms * 1000.0) as u64));
            gauges.push((format!("sgl_router_first_byte_overhead_ms.worker.{id}"), speed.overhead_ms as u64));
            gauges.push((format!("sgl_router_batched_first_bytes_pct.worker.{id}"), local.batching.together_pct()));
            gauges.push((format!("sgl_router_prefill_batches.worker.{id}"), u64::from(local.batching.batches())));
            let has_report = snapshot.get(&w.id).is_some();
            fresh += u64::from(has_report);
            gauges.push((format!("sgl_router_fresh_load_report.worker.{id}"), u64::from(has_report)));
        }
        let unhealthy = self.health.unhealthy() as u64;
        let bytes: u64 = self.prefixes.trees().values().map(|t| t.size_bytes()).sum();
        gauges.extend([
            ("sgl_router_fresh_load_reports".to_string(), fresh),
            ("sgl_router_healthy_workers".to_string(), (self.workers.len() as u64).saturating_sub(unhealthy)),
            ("sgl_router_health_published".to_string(), u64::from(self.health_published_ms.is_some())),
            ("sgl_router_prefix_log_head".to_string(), self.prefixes.head()),
            ("sgl_router_prefix_service_bytes".to_string(), bytes),
            ("sgl_router_affinity_bindings".to_string(), self.affinity.len() as u64),
        ]);
        let (evictions, repairs) = self.affinity.counters();
        gauges.push(("sgl_router_affinity_evictions".to_string(), evictions));
        gauges.push(("sgl_router_affinity_repaired_shards".to_string(), repairs));
        gauges
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServiceMode;
    use crate::host::MemoryHost;
    use crate::state::health::HealthTable;
    use crate::state::load_monitor::{LoadView, SharedLoadView};
    use crate::testing::test;

    fn config(extra: &str) -> RouterConfig {
        crate::config::parse_and_validate(&format!(
            r#"{{"workers": [{{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}},
                            {{"id": "B", "url": "http://127.0.0.1:2", "model": "m"}}],
                "health": {{"interval_ms": 100, "failure_threshold": 2, "success_threshold": 1}},
                "load": {{"interval_ms": 50}}
                {extra},
                "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "cache_aware"}}}}}}}}]}}}}}}"#
        ))
        .unwrap()
    }

    fn service() -> (Arc<MemoryHost>, ServiceCore) {
        let host = Arc::new(MemoryHost::default());
        let core = ServiceCore::new(config(""), host.clone());
        (host, core)
    }

    fn health(host: &MemoryHost) -> HealthTable {
        shared::VersionedReader::<HealthTable>::new(keys::HEALTH_TABLE).current(host).cloned().unwrap_or_default()
    }

    #[test]
    fn the_first_tick_publishes_health_and_asks_for_every_check_and_poll() {
        let (host, mut core) = service();
        let plan = core.tick(0);
        let kinds: Vec<PollKind> = plan.polls.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, [PollKind::Health(0), PollKind::Health(1), PollKind::Load(0), PollKind::Load(1)]);
        let health = &plan.polls[0].request;
        assert_eq!(
            (health.cluster.as_str(), health.path.as_str(), health.method.as_str()),
            ("sgl_A", "/health", "GET")
        );
        assert_eq!(plan.polls[2].request.path, "/v1/loads");
        let published = health_published(&host).unwrap();
        assert_eq!((published.unhealthy.len(), published.monitored), (0, vec!["A".to_string(), "B".to_string()]));
        assert!(core.tick(10).polls.is_empty(), "nothing is due again while the polls are out");
        let later = core.tick(vm_registry::HEARTBEAT_MS);
        assert!(later.gauges.contains(&("sgl_router_healthy_workers".to_string(), 2)), "{:?}", later.gauges);
    }

    /// A dead service once froze its last verdicts in every filter: the table goes out every
    /// interval, flipped or not, stamped, so a filter can tell when it stopped.
    #[test]
    fn health_is_published_again_every_interval_with_its_time() {
        let (host, mut core) = service();
        core.tick(host.now_ms());
        let first = health_published(&host).unwrap().published_ms;
        assert_eq!(first, host.now_ms());
        host.advance_ms(99);
        core.tick(host.now_ms());
        assert_eq!(health_published(&host).unwrap().published_ms, first, "not before the interval");
        host.advance_ms(1);
        core.tick(host.now_ms());
        assert_eq!(health_published(&host).unwrap().published_ms, first + 100);
    }

    fn health_published(host: &MemoryHost) -> Option<HealthTable> {
        shared::VersionedReader::<HealthTable>::new(keys::HEALTH_TABLE).current(host).cloned()
    }

    #[test]
    fn failed_checks_flip_health_publish_it_and_clear_the_workers_prefixes() {
        let (host, mut core) = service();
        core.on_prefix_messages([wire::encode(&PrefixEvent::Stored {
            model: "m".into(),
            worker: "A".into(),
            text: "hello world".into(),
            tier: crate::state::prefix::Tier::Gpu,
            sent_ms: 0,
        })
        .unwrap()]);
        let head = core.prefixes.head();
        core.tick(0);
        core.on_poll_answer(PollKind::Health(0), 0, Some(503), b"", 1);
        assert!(health(&host).unhealthy.is_empty(), "one failure is below the threshold");
        core.tick(100);
        core.on_poll_answer(PollKind::Health(0), 0, None, b"", 101);
        assert_eq!(health(&host).unhealthy, ["A"]);
        assert_eq!(core.prefixes.head(), head + 1, "the unhealthy engine's prefixes are cleared");
        core.tick(200);
        core.on_poll_answer(PollKind::Health(0), 0, Some(200), b"", 201);
        assert!(health(&host).unhealthy.is_empty(), "one success recovers it");
    }

    fn config_of(workers: &[&str]) -> RouterConfig {
        let workers: Vec<String> = workers
            .iter()
            .enumerate()
            .map(|(i, id)| format!(r#"{{"id": "{id}", "url": "http://127.0.0.1:{}", "model": "m"}}"#, i + 1))
            .collect();
        crate::config::parse_and_validate(&format!(
            r#"{{"workers": [{}], "health": {{"interval_ms": 100, "failure_threshold": 1, "success_threshold": 1}},
                "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "cache_aware"}}}}}}}}]}}}}}}"#,
            workers.join(",")
        ))
        .unwrap()
    }

    fn stored(worker: &str) -> Vec<u8> {
        let text = "hello world".into();
        wire::encode(&PrefixEvent::Stored {
            model: "m".into(),
            worker: worker.into(),
            text,
            tier: crate::state::prefix::Tier::Gpu,
            sent_ms: 0,
        })
        .unwrap()
    }

    /// A live update (spec §8): B stays with its verdict and its prefixes, A's prefixes go, C
    /// comes in monitored and healthy, and an answer to a poll of the old list is not recorded.
    #[test]
    fn a_new_worker_list_keeps_what_stayed_and_drops_what_left() {
        let host = Arc::new(MemoryHost::default());
        let mut core = ServiceCore::new(config_of(&["A", "B"]), host.clone());
        core.tick(0);
        core.on_poll_answer(PollKind::Health(1), 0, None, b"", 1);
        assert_eq!(health(&host).unhealthy, ["B"]);
        core.on_prefix_messages([stored("A"), stored("B")]);
        core.tick(100);
        core.reconfigure(config_of(&["C", "B"]));
        let table = health(&host);
        assert_eq!((table.monitored, table.unhealthy), (vec!["B".to_string(), "C".to_string()], vec!["B".to_string()]));
        let holders: Vec<String> =
            core.prefixes.trees()["m"].match_prefix(b"hello world").into_iter().map(|m| m.worker).collect();
        assert_eq!(holders, ["B"]);
        core.on_poll_answer(PollKind::Health(1), 0, Some(200), b"", 101);
        assert_eq!(health(&host).unhealthy, ["B"], "an answer to the old list's poll is not B's");
        let plan = core.tick(200);
        let polled: Vec<&str> = plan.polls.iter().map(|p| p.request.cluster.as_str()).collect();
        assert!(polled.contains(&"sgl_C") && polled.contains(&"sgl_B") && !polled.contains(&"sgl_A"), "{polled:?}");
        let b =
            plan.polls.iter().find(|p| p.request.cluster == "sgl_B" && matches!(p.kind, PollKind::Health(_))).unwrap();
        core.on_poll_answer(b.kind, b.generation, Some(200), b"", 201);
        assert!(health(&host).unhealthy.is_empty(), "B recovers on a check of the new list");
        let gauges = core.tick(10 * vm_registry::HEARTBEAT_MS).gauges;
        assert!(gauges.contains(&("sgl_router_inflight.worker.A".to_string(), 0)), "A's gauge goes to 0: {gauges:?}");
        let again = core.tick(20 * vm_registry::HEARTBEAT_MS).gauges;
        assert!(!again.iter().any(|(name, _)| name.ends_with(".worker.A")), "once");
    }

    /// Without a configuration of its own the service waits for a filter's, then follows each new
    /// one announced.
    #[test]
    fn the_service_follows_the_announced_filter_configuration() {
        let host = Arc::new(MemoryHost::default());
        let mut service = FollowingService::new(None, host.clone(), true);
        assert!(service.tick(0).polls.is_empty(), "nothing to monitor yet");
        let text = |workers: &[&str]| serde_json::to_string(&config_of(workers)).unwrap();
        crate::state::filter_config::announce(host.as_ref(), &text(&["A"]), 0).unwrap();
        let clusters = |plan: TickPlan| {
            let mut c: Vec<String> = plan.polls.into_iter().map(|p| p.request.cluster).collect();
            c.sort();
            c.dedup();
            c
        };
        assert_eq!(clusters(service.tick(0)), ["sgl_A"]);
        crate::state::filter_config::announce(host.as_ref(), &text(&["A", "B"]), 0).unwrap();
        assert_eq!(clusters(service.tick(1)), ["sgl_A", "sgl_B"]);
        assert_eq!(health(&host).monitored, ["A", "B"]);
    }

    /// A bootstrap service whose filter configuration leaves the work to the filter VMs
    /// (`service.mode: embedded`) polls nothing; in `auto` it takes the lease and works.
    #[test]
    fn the_singleton_stays_idle_when_the_configuration_embeds_the_service() {
        for (mode, polls) in [("embedded", false), ("auto", true)] {
            let host = Arc::new(MemoryHost::default());
            let mut service = FollowingService::new(None, host.clone(), true);
            let mut config = config_of(&["A"]);
            config.service.mode = if mode == "embedded" { ServiceMode::Embedded } else { ServiceMode::Auto };
            let text = serde_json::to_string(&config).unwrap();
            crate::state::filter_config::announce(host.as_ref(), &text, 0).unwrap();
            assert_eq!(!service.tick(1).polls.is_empty(), polls, "{mode}");
        }
    }

    /// The crash-reload case: a filter VM reloaded on the configuration it started with announces
    /// it again after the newer one. The service keeps monitoring the newer configuration's
    /// engines; before generations it went back, and the newer engines were taken out of service.
    #[test]
    fn a_vm_reloaded_on_an_older_configuration_does_not_take_the_service_back() {
        let host = Arc::new(MemoryHost::default());
        let mut service = FollowingService::new(None, host.clone(), true);
        let text = |generation: u64, workers: &[&str]| {
            let mut config = config_of(workers);
            config.generation = generation;
            serde_json::to_string(&config).unwrap()
        };
        let announce = |t: &str, g: u64| crate::state::filter_config::announce(host.as_ref(), t, g).unwrap();
        announce(&text(1, &["A"]), 1);
        service.tick(0);
        announce(&text(2, &["A", "B"]), 2);
        service.tick(1);
        assert_eq!(health(&host).monitored, ["A", "B"]);
        announce(&text(1, &["A"]), 1);
        service.tick(2);
        assert_eq!(health(&host).monitored, ["A", "B"], "generation 2 is still the newest");
    }

    #[test]
    fn an_undispatchable_check_counts_as_failed() {
        let (host, mut core) = service();
        core.tick(0);
        core.not_dispatched(PollKind::Health(1), 0);
        core.tick(100);
        core.not_dispatched(PollKind::Health(1), 100);
        assert_eq!(health(&host).unhealthy, ["B"]);
    }

    #[test]
    fn load_answers_are_published_and_failed_ones_are_not() {
        let (host, mut core) = service();
        core.tick(0);
        let report = br#"{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1,
            "num_used_tokens": 10, "max_total_num_tokens": 100, "max_running_requests": 8}]}"#;
        host.set_now_ms(5);
        core.on_poll_answer(PollKind::Load(0), 0, Some(200), report, 5);
        core.on_poll_answer(PollKind::Load(1), 0, Some(500), report, 5);
        let view = SharedLoadView::new(host.clone(), 1000, 0);
        let snapshot = view.snapshot();
        assert_eq!(snapshot.get("A").and_then(|l| l.running), Some(3));
        assert!(snapshot.get("B").is_none(), "a 500 answer is not a report");
    }
}
