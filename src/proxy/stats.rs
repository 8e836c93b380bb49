//! Envoy stats from the filter and the service. Each metric is defined once per VM and its id
//! kept; names come from the core (`filter::metrics`).

use hashbrown::HashMap;
use std::cell::RefCell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;

use crate::wiring::counters::{Bumps, Counter};

/// Metric ids: counters by their [`Counter`], so a request's counters are found without building
/// a name; gauges and histograms by name, looked up by `&str`. A hit allocates nothing.
#[derive(Default)]
pub struct Stats {
    counters: RefCell<HashMap<Counter, u32>>,
    gauges: RefCell<HashMap<String, u32>>,
    histograms: RefCell<HashMap<String, u32>>,
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    hostcalls::define_metric(kind, name).map_err(|status| log::debug!("metric {name} not defined: {status:?}")).ok()
}

fn named(ids: &RefCell<HashMap<String, u32>>, kind: MetricType, name: &str) -> Option<u32> {
    if let Some(id) = ids.borrow().get(name) {
        return Some(*id);
    }
    let id = define(kind, name)?;
    ids.borrow_mut().insert(name.to_string(), id);
    Some(id)
}

impl Stats {
    /// Bumps each counter by its count (the core holds a busy VM's bumps and hands them over here).
    pub fn count_all(&self, counts: &Bumps) {
        for (counter, n) in counts {
            let known = self.counters.borrow().get(counter).copied();
            let id = match known {
                Some(id) => id,
                None => {
                    let Some(id) = define(MetricType::Counter, &counter.name()) else { continue };
                    self.counters.borrow_mut().insert(counter.clone(), id);
                    id
                }
            };
            let _ = hostcalls::increment_metric(id, i64::try_from(*n).unwrap_or(i64::MAX));
        }
    }

    pub fn histogram(&self, name: &str, value: u64) {
        if let Some(id) = named(&self.histograms, MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    pub fn gauge(&self, name: &str, value: u64) {
        if let Some(id) = named(&self.gauges, MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}
