//! Envoy stats from the filter and the service. Each metric is defined once per VM and its id
//! kept; names come from the core (`server::metrics`).

use std::cell::RefCell;
use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

#[derive(Default)]
pub struct Stats {
    ids: RefCell<HashMap<(String, u8), u32>>,
}

fn kind_key(kind: MetricType) -> u8 {
    match kind {
        MetricType::Counter => 0,
        MetricType::Gauge => 1,
        _ => 2,
    }
}

impl Stats {
    fn id(&self, kind: MetricType, name: &str) -> Option<u32> {
        let key = (name.to_string(), kind_key(kind));
        if let Some(id) = self.ids.borrow().get(&key) {
            return Some(*id);
        }
        match hostcalls::define_metric(kind, name) {
            Ok(id) => {
                self.ids.borrow_mut().insert(key, id);
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
