//! Envoy stats from the filter and the service. Each metric is defined once per VM and its id
//! kept; names come from the core (`server::metrics`).

use hashbrown::HashMap;
use std::cell::RefCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

/// Metric ids by kind and name, looked up by `&str` so a hit allocates nothing (and hashes with
/// hashbrown's default hasher: several lookups per request).
#[derive(Default)]
pub struct Stats {
    counters: RefCell<HashMap<String, u32>>,
    gauges: RefCell<HashMap<String, u32>>,
    histograms: RefCell<HashMap<String, u32>>,
}

impl Stats {
    fn id(&self, kind: MetricType, name: &str) -> Option<u32> {
        let ids = match kind {
            MetricType::Counter => &self.counters,
            MetricType::Gauge => &self.gauges,
            _ => &self.histograms,
        };
        if let Some(id) = ids.borrow().get(name) {
            return Some(*id);
        }
        match hostcalls::define_metric(kind, name) {
            Ok(id) => {
                ids.borrow_mut().insert(name.to_string(), id);
                Some(id)
            }
            Err(status) => {
                log::debug!("metric {name} not defined: {status:?}");
                None
            }
        }
    }

    pub fn count(&self, name: &str) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    pub fn count_all(&self, names: &[String]) {
        for name in names {
            self.count(name);
        }
    }

    pub fn histogram(&self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn gauge(&self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
