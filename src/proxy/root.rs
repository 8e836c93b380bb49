//! The root context of both plugins. Which one it is comes from the `plugin_root_id` property.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use super::filter::Filter;
use super::host::ProxyHost;
use super::service::Service;
use super::stats::Stats;
use crate::config;
use crate::filter::AppContext;
use crate::host::Host;
use crate::policies::cache_aware::LocalCacheSource;
use crate::state::{filter_config, vm_registry};
use crate::wiring::factory::filter_handles;
use std::time::Duration;

pub const FILTER_ROOT_ID: &str = "sgl_router";
pub const SERVICE_ROOT_ID: &str = "sgl_router_service";

#[derive(Default)]
pub struct Root {
    /// This root's context id: callouts that outlive a stream are sent on its behalf.
    context_id: u32,
    filter: Option<Rc<RefCell<AppContext>>>,
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
}

fn root_id() -> String {
    hostcalls::get_property(vec!["plugin_root_id"])
        .ok()
        .flatten()
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default()
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
        if let Some(vm) = self.vm {
            match vm_registry::heartbeat(&ProxyHost, vm, ProxyHost.now_ms(), self.serving.get()) {
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
    fn start_service(&mut self, own: Option<(config::RouterConfig, String)>) -> bool {
        let mut service = Service::new(own, Rc::clone(&self.stats));
        if let Some(period) = service.new_tick_period() {
            self.set_tick_period(period);
        }
        self.service = Some(service);
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
        // The service may go without one: it follows the filter's (spec §8).
        if id == SERVICE_ROOT_ID && text.trim().is_empty() {
            return self.start_service(None);
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
        match id.as_str() {
            FILTER_ROOT_ID => {
                let host: Arc<dyn Host> = Arc::new(ProxyHost);
                if let Err(e) = filter_config::announce(host.as_ref(), &text) {
                    log::warn!("filter configuration not announced to the service: {e}");
                }
                let vm = *self.vm.get_or_insert_with(|| host.random_u64());
                let (handles, prefixes) = filter_handles(&parsed, host, vm);
                self.prefixes = Some(prefixes);
                self.filter = Some(Rc::new(RefCell::new(AppContext::new(parsed, handles))));
                self.heartbeat();
                self.set_tick_period(Duration::from_millis(vm_registry::HEARTBEAT_MS));
                true
            }
            SERVICE_ROOT_ID => self.start_service(Some((parsed, text))),
            other => {
                log::error!(
                    "sgl-envoy-router: unknown root_id `{other}`; use `{FILTER_ROOT_ID}` for the HTTP filter or `{SERVICE_ROOT_ID}` for the bootstrap service"
                );
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(service) = self.service.as_mut() {
            service.on_queue_ready(queue_id);
        }
    }

    fn on_tick(&mut self) {
        if let Some(service) = self.service.as_mut() {
            service.on_tick();
            if let Some(period) = service.new_tick_period() {
                self.set_tick_period(period);
            }
        }
        if let Some(app) = self.filter.clone() {
            // What this VM did just before it went quiet reaches the others here at the latest.
            let due = app.borrow().sync_shared_now();
            self.stats.count_all(&due);
            self.heartbeat();
            self.export_replica();
            let unmonitored = app.borrow().unmonitored_workers() as u64;
            self.stats.gauge("sgl_router_unmonitored_workers", unmonitored);
            let draining = app.borrow().draining_workers() as u64;
            self.stats.gauge("sgl_router_draining_workers", draining);
            let stale = u64::from(app.borrow().health_stale());
            self.stats.gauge("sgl_router_health_table_stale", stale);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let app = self.filter.as_ref()?;
        if !self.serving.replace(true) {
            // The other VMs learn at their next heartbeat that this one serves too.
            self.heartbeat();
        }
        let contexts = (context_id, self.context_id);
        Some(Box::new(Filter::new(Rc::clone(app), Rc::clone(&self.stats), self.vm.unwrap_or(0), contexts)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
