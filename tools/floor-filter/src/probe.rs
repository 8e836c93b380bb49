//! One host call, made `times` times per request on top of the floor's work, so the bench can
//! price it: Envoy's CPU per request of this build minus the plain floor's, divided by `times`.
//! Chosen at build time (`FLOOR_PROBE=<call>:<times>`), because the floor reads the router's own
//! configuration, which has no place for it.

use std::cell::{Cell, RefCell};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, MetricType};

/// The calls a routing filter makes per request, each as the filter makes it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// The request's header map, all pairs in one call.
    HeaderMap,
    /// The request body again (the floor already read it once).
    Body,
    /// A request header set.
    SetRequestHeader,
    /// `:status` of the upstream's response.
    Status,
    /// A response header set.
    SetResponseHeader,
    /// A small shared-data value read.
    SharedGet,
    /// A small shared-data value read, then written back with its cas.
    SharedCas,
    /// A counter bumped.
    Counter,
    /// A histogram value recorded.
    Histogram,
    /// The proxy-wasm clock.
    Clock,
}

impl Call {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "header_map" => Self::HeaderMap,
            "body" => Self::Body,
            "set_request_header" => Self::SetRequestHeader,
            "status" => Self::Status,
            "set_response_header" => Self::SetResponseHeader,
            "shared_get" => Self::SharedGet,
            "shared_cas" => Self::SharedCas,
            "counter" => Self::Counter,
            "histogram" => Self::Histogram,
            "clock" => Self::Clock,
            _ => return None,
        })
    }

    fn on_response(self) -> bool {
        matches!(self, Self::Status | Self::SetResponseHeader)
    }
}

const SHARED_KEY: &str = "sgl.floor_probe";
/// Header names, one per repetition, so a set is never a replace of the previous one.
const NAMES: [&str; 16] = [
    "x-probe-0",
    "x-probe-1",
    "x-probe-2",
    "x-probe-3",
    "x-probe-4",
    "x-probe-5",
    "x-probe-6",
    "x-probe-7",
    "x-probe-8",
    "x-probe-9",
    "x-probe-a",
    "x-probe-b",
    "x-probe-c",
    "x-probe-d",
    "x-probe-e",
    "x-probe-f",
];

thread_local! {
    /// Metric ids, defined once per VM as the real filter does.
    static METRICS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static SHARED_WRITTEN: Cell<bool> = const { Cell::new(false) };
}

pub struct Probe {
    call: Call,
    times: usize,
}

impl Probe {
    pub fn from_build() -> Option<Self> {
        let (call, times) = option_env!("FLOOR_PROBE")?.split_once(':')?;
        let times = times.parse::<usize>().ok()?.min(NAMES.len());
        Some(Self { call: Call::parse(call)?, times })
    }

    pub fn on_request(&self, body_size: usize) {
        if !self.call.on_response() {
            self.run(body_size);
        }
    }

    pub fn on_response(&self) {
        if self.call.on_response() {
            self.run(0);
        }
    }

    fn run(&self, body_size: usize) {
        if matches!(self.call, Call::Counter | Call::Histogram) {
            self.record();
            return;
        }
        if matches!(self.call, Call::SharedGet | Call::SharedCas) && !SHARED_WRITTEN.get() {
            // A read that finds nothing returns early; the filter's cursor is always there.
            let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&[0; 8]), None);
            SHARED_WRITTEN.set(true);
        }
        for name in NAMES.iter().take(self.times) {
            match self.call {
                Call::HeaderMap => {
                    let _ = hostcalls::get_map(MapType::HttpRequestHeaders);
                }
                Call::Body => {
                    let _ = hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpRequestBody, 0, body_size);
                }
                Call::SetRequestHeader => {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some("v"));
                }
                Call::Status => {
                    let _ = hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status");
                }
                Call::SetResponseHeader => {
                    let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some("v"));
                }
                Call::SharedGet => {
                    let _ = hostcalls::get_shared_data(SHARED_KEY);
                }
                Call::SharedCas => {
                    if let Ok((value, cas)) = hostcalls::get_shared_data(SHARED_KEY) {
                        let value = value.unwrap_or_else(|| vec![0; 8]);
                        let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&value), cas);
                    }
                }
                Call::Clock => {
                    let _ = hostcalls::get_current_time();
                }
                Call::Counter | Call::Histogram => {}
            }
        }
    }

    /// One metric per repetition, as a request bumps several different ones.
    fn record(&self) {
        let histogram = self.call == Call::Histogram;
        METRICS.with(|ids| {
            let mut ids = ids.borrow_mut();
            if ids.is_empty() {
                let kind = if histogram { MetricType::Histogram } else { MetricType::Counter };
                *ids = (0..self.times)
                    .filter_map(|i| hostcalls::define_metric(kind, &format!("sgl_floor_probe_{i}")).ok())
                    .collect();
            }
            for id in ids.iter() {
                let _ = if histogram { hostcalls::record_metric(*id, 17) } else { hostcalls::increment_metric(*id, 1) };
            }
        });
    }
}
