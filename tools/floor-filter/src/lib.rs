//! The floor of `scripts/bench --only overhead`: what any proxy-wasm filter that routes on the
//! request body must do at least, and nothing more. It pauses the headers, buffers the body,
//! copies it into the VM once, names the next engine's cluster in the routing header (round
//! robin) and continues. No parse, no shared data, no stats, no accounting. It reads the same
//! router configuration as the real filter (only the worker ids, once at start), so the bench runs
//! both on one rendered Envoy configuration with only the module swapped.
//!
//! Built with `FLOOR_PROBE=<call>:<times>` it also makes one host call that many times per request
//! (see [`probe`]): `scripts/bench --only hostcalls` runs such builds beside the plain floor to
//! price each call a routing filter makes.
#![cfg(target_arch = "wasm32")]

mod probe;

use std::cell::Cell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

/// The real filter's routing header and cluster names (`upstream.mode: cluster_header`).
const ROUTING_HEADER: &str = "x-sgl-cluster";
const CLUSTER_PREFIX: &str = "sgl_";

#[derive(serde::Deserialize)]
struct RouterConfig {
    workers: Vec<Engine>,
}

#[derive(serde::Deserialize)]
struct Engine {
    id: String,
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot::default()) });
}}

#[derive(Default)]
struct FloorRoot {
    clusters: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match serde_json::from_slice::<RouterConfig>(&bytes) {
            Ok(config) if !config.workers.is_empty() => {
                self.clusters = Rc::new(config.workers.iter().map(|w| format!("{CLUSTER_PREFIX}{}", w.id)).collect());
                true
            }
            _ => false,
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorFilter {
            clusters: Rc::clone(&self.clusters),
            next: Rc::clone(&self.next),
            probe: probe::Probe::from_build(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FloorFilter {
    clusters: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
    probe: Option<probe::Probe>,
}

impl Context for FloorFilter {}

impl HttpContext for FloorFilter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        // The real filter pauses here too, so the routing header can still be set after the body.
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        // The one copy of the body into the VM that routing on it costs (a host call: never elided).
        let _body = self.get_http_request_body(0, body_size);
        if let Some(probe) = &self.probe {
            probe.on_request(body_size);
        }
        let turn = self.next.get();
        self.next.set(turn.wrapping_add(1));
        if let Some(cluster) = self.clusters.get(turn % self.clusters.len().max(1)) {
            self.set_http_request_header(ROUTING_HEADER, Some(cluster));
            // As the real filter does (ENVOY_FIELD_NOTES); an Envoy without it re-routes anyway.
            let _ = proxy_wasm::hostcalls::call_foreign_function("clear_route_cache", Some(&[]));
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Some(probe) = &self.probe {
            probe.on_response();
        }
        Action::Continue
    }
}
