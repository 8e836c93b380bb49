//! The root context of both plugins. Which one it is comes from the `plugin_root_id` property.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use super::filter::{Filter, Waiters};
use super::host::ProxyHost;
use super::service::Service;
use super::stats::Stats;
use crate::config;
use crate::config::ServiceMode;
use crate::filter::AppContext;
use crate::host::{Host, Namespaced};
use crate::policies::cache_aware::LocalCacheSource;
use crate::state::filter_config::{self, Announced};
use crate::state::lease::{self, Claimant};
use crate::state::vm_registry;
use crate::wiring::counters::{queue_bytes, queue_depth};
use crate::wiring::factory::filter_handles;
use std::time::Duration;

pub const FILTER_ROOT_ID: &str = "sgl_router";
pub const SERVICE_ROOT_ID: &str = "sgl_router_service";

#[derive(Default)]
pub struct Root {
    /// This root's context id: callouts that outlive a stream are sent on its behalf.
    context_id: u32,
    filter: Option<Rc<RefCell<AppContext>>>,
    /// The filter's host: its shared data under the configuration's namespace.
    host: Option<Arc<dyn Host>>,
    stats: Rc<Stats>,
    /// This filter VM's identity for its in-flight shares; kept across `on_configure` calls.
    vm: Option<u64>,
    /// This VM's label on its own gauges, from its heartbeat (see `vm_registry::VM_SLOTS`).
    slot: Cell<Option<u64>>,
    /// Whether this VM has served a request (the main thread's filter VM never does).
    serving: Cell<bool>,
    /// This VM's replica of the prefix index.
    prefixes: Option<Arc<LocalCacheSource>>,
    service: Option<Service>,
    /// This VM's streams waiting in the queue, woken from the tick, and the root's clock.
    waiters: Waiters,
}

/// Wakes per tick at most: a stream whose turn comes because another left is woken in the same tick.
const TURN_ROUNDS: usize = 8;

fn property(name: &str) -> String {
    hostcalls::get_property(vec![name]).ok().flatten().and_then(|b| String::from_utf8(b).ok()).unwrap_or_default()
}

fn root_id() -> String {
    property("plugin_root_id")
}

/// The namespace of a configuration that names none (spec §10).
fn plugin_name() -> String {
    property("plugin_name")
}

impl Root {
    pub fn new(context_id: u32) -> Self {
        Self { context_id, ..Self::default() }
    }

    /// Keeps an idle replica current and reports how far it is, so tests and operators can see
    /// replicas agree.
    fn export_replica(&self) {
        let Some(prefixes) = &self.prefixes else { return };
        prefixes.refresh();
        // Labelled by the VM's slot, not its id: see `vm_registry::VM_SLOTS`.
        let Some(slot) = self.slot.get() else { return };
        let names = ["version", "bytes", "resyncs", "stalls"];
        for (name, value) in names.into_iter().zip(prefixes.replica_status()) {
            self.stats.gauge(&format!("sgl_router_prefix_replica_{name}.vm.{slot}"), value);
        }
    }

    /// Tells the service this VM is alive, so its in-flight shares are kept.
    fn heartbeat(&self) {
        if let (Some(vm), Some(host)) = (self.vm, &self.host) {
            match vm_registry::heartbeat(host.as_ref(), vm, host.now_ms(), self.serving.get()) {
                Ok(heartbeat) => {
                    self.slot.set(heartbeat.slot);
                    if let Some(app) = &self.filter {
                        app.borrow().handles().solitude.observe(heartbeat);
                    }
                }
                Err(e) => log::warn!("heartbeat not written: {e}"),
            }
        }
    }
}

impl Root {
    /// Wakes the parked streams the room names, each under its own context id, then again for
    /// streams whose turn came as others left; each stream at most once per tick.
    fn take_turns(&self, app: &Rc<RefCell<AppContext>>) {
        let mut woken = Vec::new();
        for _ in 0..TURN_ROUNDS {
            let turns: Vec<u32> = app.borrow().waiting().turns().into_iter().filter(|id| !woken.contains(id)).collect();
            if turns.is_empty() {
                break;
            }
            for id in turns {
                woken.push(id);
                let stream = self.waiters.streams.borrow().get(&id).and_then(std::rc::Weak::upgrade);
                match stream {
                    Some(stream) if hostcalls::set_effective_context(id).is_ok() => stream.borrow_mut().on_turn(),
                    // Gone without its end being heard: its place goes.
                    _ => app.borrow().waiting().leave(id, false),
                }
            }
        }
        let _ = hostcalls::set_effective_context(self.context_id);
        let app = app.borrow();
        self.waiters.streams.borrow_mut().retain(|id, _| app.waiting().holds(*id));
    }

    /// Each queued model's depth and bytes waiting, counted over every VM.
    fn export_depths(&self, app: &Rc<RefCell<AppContext>>) {
        let app = app.borrow();
        let config = app.config();
        for model in config.models.keys().filter(|m| config.queue_for(m).is_some()) {
            let (depth, bytes) = app.waiting().depth(model);
            self.stats.gauge(&queue_depth(model), depth as u64);
            self.stats.gauge(&queue_bytes(model), bytes);
        }
    }

    /// A filter VM's turn at the service lease (spec §10): it runs the service while it holds
    /// the lease, and stops when another (the singleton, or a VM that took over) does.
    fn take_or_leave_the_service(&mut self, app: &Rc<RefCell<AppContext>>, now: u64) {
        let (Some(vm), Some(host)) = (self.vm, self.host.clone()) else { return };
        let config = app.borrow().config().clone();
        let holds = config.service.mode != ServiceMode::Singleton
            && lease::claim(host.as_ref(), vm, Claimant::Filter { serving: self.serving.get() }, now).unwrap_or_else(
                |e| {
                    log::warn!("service lease not claimed: {e}");
                    false
                },
            );
        match (holds, self.service.is_some()) {
            (true, false) => {
                log::info!("this filter VM does the service's work (lease taken)");
                let namespace = config.namespace.clone().unwrap_or_else(plugin_name);
                self.start_service(None, &namespace);
            }
            (false, true) => {
                log::info!("this filter VM leaves the service's work (lease held elsewhere)");
                self.service = None;
            }
            _ => {}
        }
    }

    /// Sets the tick period the clock wants now (`waiting`: streams of this VM wait).
    fn retick(&self, waiting: bool) {
        let service_ms = self.service.as_ref().map(Service::tick_period_ms);
        let period = self.waiters.ticks.borrow_mut().period(waiting, service_ms);
        if let Some(ms) = period {
            self.set_tick_period(Duration::from_millis(ms));
        }
    }

    fn start_service(&mut self, own: Option<(config::RouterConfig, String)>, namespace: &str) -> bool {
        let singleton = self.filter.is_none();
        self.service = Some(Service::new(own, Rc::clone(&self.stats), namespace, singleton));
        let waiting = self.waiters.ticks.borrow().fast();
        self.retick(waiting);
        true
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if let Some(service) = self.service.as_mut() {
            service.on_http_call_response(token, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = self.get_plugin_configuration().unwrap_or_default();
        let text = String::from_utf8_lossy(&raw).into_owned();
        let id = root_id();
        // The service may go without one, or name only its namespace: it follows the filter's
        // (spec §8, §10).
        if id == SERVICE_ROOT_ID {
            if text.trim().is_empty() {
                return self.start_service(None, &plugin_name());
            }
            match config::namespace_only(&text) {
                Some(Ok(namespace)) => return self.start_service(None, &namespace),
                Some(Err(errors)) => {
                    log::error!("sgl-envoy-router configuration rejected: {errors}");
                    return false;
                }
                None => {}
            }
        }
        let parsed = match config::parse_and_validate(&text) {
            Ok(c) => c,
            Err(errors) => {
                for e in &errors.0 {
                    log::error!("sgl-envoy-router configuration rejected: {e}");
                }
                return false;
            }
        };
        let namespace = parsed.namespace.clone().unwrap_or_else(plugin_name);
        // Every root but the service's is a filter: a mesh makes the plugin's name its root id
        // (Istio's pluginName), and two pools of this module in one VM need two root ids.
        match id.as_str() {
            SERVICE_ROOT_ID => self.start_service(Some((parsed, text)), &namespace),
            filter_root => {
                if filter_root != FILTER_ROOT_ID {
                    log::info!("filter root `{filter_root}`, namespace `{namespace}`");
                }
                let host: Arc<dyn Host> = Arc::new(Namespaced::new(Arc::new(ProxyHost), &namespace));
                self.host = Some(Arc::clone(&host));
                match filter_config::announce(host.as_ref(), &text, parsed.generation) {
                    Ok(Announced::Older { followed }) => log::warn!(
                        "this VM runs filter configuration generation {}; the service follows generation {followed}",
                        parsed.generation
                    ),
                    Ok(Announced::Conflict) => log::warn!(
                        "another filter configuration of generation {} is followed; generations name one configuration each",
                        parsed.generation
                    ),
                    Ok(Announced::Followed | Announced::Already) => {}
                    Err(e) => log::warn!("filter configuration not announced to the service: {e}"),
                }
                let vm = *self.vm.get_or_insert_with(|| host.random_u64());
                let (handles, prefixes) = filter_handles(&parsed, host, vm);
                self.prefixes = Some(prefixes);
                self.filter = Some(Rc::new(RefCell::new(AppContext::new(parsed, handles))));
                self.heartbeat();
                let waiting = self.waiters.ticks.borrow().fast();
                self.retick(waiting);
                true
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(service) = self.service.as_mut() {
            service.on_queue_ready(queue_id);
        }
    }

    fn on_tick(&mut self) {
        #[cfg(feature = "fault-injection")]
        if let (Some(_), Some(_), Some(host)) = (&self.service, &self.filter, &self.host) {
            super::faults::spring_if_armed(host.as_ref());
        }
        if let Some(service) = self.service.as_mut() {
            service.on_tick();
        }
        let Some(app) = self.filter.clone() else {
            // The bootstrap service: its own period (a followed configuration may change it).
            return self.retick(false);
        };
        let now = ProxyHost.now_ms();
        let waiting = !app.borrow().waiting().is_empty();
        if waiting {
            self.take_turns(&app);
        }
        let depths_due = self.waiters.ticks.borrow_mut().depths_due(now, waiting);
        if depths_due {
            self.export_depths(&app);
        }
        let heartbeat_due = self.waiters.ticks.borrow_mut().heartbeat_due(now);
        if heartbeat_due {
            // What this VM did just before it went quiet reaches the others here at the latest.
            let due = app.borrow().sync_shared_now();
            self.stats.count_all(&due);
            self.heartbeat();
            self.take_or_leave_the_service(&app, now);
            self.export_replica();
            let unmonitored = app.borrow().unmonitored_workers() as u64;
            self.stats.gauge("sgl_router_unmonitored_workers", unmonitored);
            let draining = app.borrow().draining_workers() as u64;
            self.stats.gauge("sgl_router_draining_workers", draining);
            let stale = u64::from(app.borrow().health_stale());
            self.stats.gauge("sgl_router_health_table_stale", stale);
        }
        let still_waiting = !app.borrow().waiting().is_empty();
        self.retick(still_waiting);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let app = self.filter.as_ref()?;
        if !self.serving.replace(true) {
            // The other VMs learn at their next heartbeat that this one serves too.
            self.heartbeat();
        }
        let contexts = (context_id, self.context_id);
        let waiters = Rc::clone(&self.waiters);
        Some(Box::new(Filter::new(Rc::clone(app), Rc::clone(&self.stats), self.vm.unwrap_or(0), contexts, waiters)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
