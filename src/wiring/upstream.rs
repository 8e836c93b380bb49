//! How a decision reaches Envoy's router filter, and how an upstream's answer counts. One
//! definition of each, for the filter's upstream request, the PD prefill callout and the breaker.

use crate::config::{UpstreamConfig, UpstreamMode};
use crate::registry::Engine;

/// The cluster of every engine Envoy may retry a request on: it routes by the address the
/// filter names in [`ENDPOINT_HEADER`] (override-host), then the fallbacks after it (spec §8).
pub const ENGINES_CLUSTER: &str = "sgl_engines";
/// The engine's `ip:port`, then each fallback's, comma-separated, as Envoy's override-host
/// load-balancing policy reads them.
pub const ENDPOINT_HEADER: &str = "x-sgl-endpoint";
/// Envoy's per-request retry count: the fallbacks named, so a retry never goes elsewhere.
pub const MAX_RETRIES_HEADER: &str = "x-envoy-max-retries";
/// Envoy's per-request retry conditions, which a client must not widen (retry after headers).
pub const RETRY_ON_HEADER: &str = "x-envoy-retry-on";

/// The header the router filter routes on, and what it carries for an engine.
#[derive(Debug, Clone)]
pub struct UpstreamHeader {
    mode: UpstreamMode,
    name: String,
    /// Fallbacks a request may be retried on (0: no retry).
    retries: u32,
}

impl UpstreamHeader {
    pub fn new(config: &UpstreamConfig, retries: u32) -> Self {
        let retries = if config.mode == UpstreamMode::OriginalDst { 0 } else { retries };
        Self { mode: config.mode, name: config.header_name().to_string(), retries }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many fallbacks a request names.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Whether `worker` may be named as a request's engine or fallback in the engines cluster.
    pub fn retriable(&self, worker: &Engine) -> bool {
        self.retries > 0 && worker.in_engines_cluster()
    }

    /// `(header, value)`: the engine's cluster, or its `host:port` for an ORIGINAL_DST or an
    /// override-host cluster.
    pub fn for_worker(&self, worker: &Engine) -> (String, String) {
        let value = match self.mode {
            UpstreamMode::ClusterHeader => worker.cluster.clone(),
            UpstreamMode::OriginalDst => worker.address.host_port(),
            UpstreamMode::OverrideHost => {
                worker.address.socket().map_or_else(|| worker.address.host_port(), str::to_string)
            }
        };
        (self.name.clone(), value)
    }

    /// Every header that sends a request to `worker`, and on a refused connection to each of
    /// `fallbacks` in turn. With retries on, a request Envoy cannot retry elsewhere is told so.
    pub fn for_request(&self, worker: &Engine, fallbacks: &[std::sync::Arc<Engine>]) -> Vec<(String, String)> {
        if self.retries == 0 {
            return vec![self.for_worker(worker)];
        }
        let Some(primary) = worker.address.socket().filter(|_| self.retriable(worker)) else {
            return vec![self.for_worker(worker), (MAX_RETRIES_HEADER.to_string(), "0".to_string())];
        };
        let sockets = || fallbacks.iter().filter_map(|f| f.address.socket());
        let mut endpoints = String::with_capacity(primary.len() + sockets().map(|s| s.len() + 1).sum::<usize>());
        endpoints.push_str(primary);
        let mut named = 0;
        for socket in sockets() {
            endpoints.push(',');
            endpoints.push_str(socket);
            named += 1;
        }
        let retries = (MAX_RETRIES_HEADER.to_string(), named.to_string());
        match self.mode {
            // The route's cluster is the engines' already; the policy reads the list from the header.
            // The route is the mesh's, with the mesh's retry count: the header always says ours.
            UpstreamMode::OverrideHost => vec![(self.name.clone(), endpoints), retries],
            _ => {
                let mut headers =
                    vec![(self.name.clone(), ENGINES_CLUSTER.to_string()), (ENDPOINT_HEADER.to_string(), endpoints)];
                // `render` writes the route's retry count as `retry.attempts`: the header is needed
                // only where fewer fallbacks were named.
                if named != self.retries {
                    headers.push(retries);
                }
                headers
            }
        }
    }
}

/// What an engine's answer (or its absence) means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamAnswer {
    /// 2xx: the stage did its work.
    Success,
    /// Another status below 500: the engine is up, this request was not served.
    Refused,
    /// No answer (connect error, reset, timeout) or a 5xx: the engine failed.
    Failed,
}

impl UpstreamAnswer {
    /// `None` (or 0, as Envoy reports a missing status) is no answer at all.
    pub fn from_status(status: Option<u16>) -> Self {
        match status {
            Some(s @ 200..=299) if s > 0 => UpstreamAnswer::Success,
            Some(s) if s > 0 && s < 500 => UpstreamAnswer::Refused,
            _ => UpstreamAnswer::Failed,
        }
    }

    /// Parses Envoy's `:status` pseudo-header.
    pub fn from_header(status: Option<&str>) -> Self {
        Self::from_status(status.and_then(|s| s.trim().parse().ok()))
    }

    pub fn succeeded(self) -> bool {
        self == UpstreamAnswer::Success
    }

    /// What the circuit breaker records: only a failed engine counts against it.
    pub fn engine_ok(self) -> bool {
        self != UpstreamAnswer::Failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn answers_are_classified_once_for_every_caller() {
        assert_eq!(UpstreamAnswer::from_status(Some(200)), UpstreamAnswer::Success);
        assert_eq!(UpstreamAnswer::from_status(Some(204)), UpstreamAnswer::Success);
        assert_eq!(UpstreamAnswer::from_status(Some(404)), UpstreamAnswer::Refused);
        assert_eq!(UpstreamAnswer::from_status(Some(302)), UpstreamAnswer::Refused);
        assert_eq!(UpstreamAnswer::from_status(Some(503)), UpstreamAnswer::Failed);
        assert_eq!(UpstreamAnswer::from_status(Some(0)), UpstreamAnswer::Failed);
        assert_eq!(UpstreamAnswer::from_status(None), UpstreamAnswer::Failed);
        assert_eq!(UpstreamAnswer::from_header(Some("201")), UpstreamAnswer::Success);
        assert_eq!(UpstreamAnswer::from_header(Some("garbage")), UpstreamAnswer::Failed);
        assert!(UpstreamAnswer::Refused.engine_ok() && !UpstreamAnswer::Refused.succeeded());
        assert!(!UpstreamAnswer::Failed.engine_ok());
    }

    #[test]
    fn with_retries_the_engines_cluster_gets_the_engine_then_its_fallbacks() {
        let a = crate::testing::worker("A");
        let mut b = (*crate::testing::worker("B")).clone();
        b.address = crate::registry::EngineAddress::new("127.0.0.1", 2);
        let retrying = UpstreamHeader::new(&UpstreamConfig::default(), 2);
        let headers = retrying.for_request(&a, &[std::sync::Arc::new(b)]);
        let expected =
            [("x-sgl-cluster", "sgl_engines"), (ENDPOINT_HEADER, "127.0.0.1:1,127.0.0.1:2"), (MAX_RETRIES_HEADER, "1")];
        assert_eq!(headers, expected.map(|(k, v)| (k.to_string(), v.to_string())), "one fallback named: one retry");
        let as_routed = UpstreamHeader::new(&UpstreamConfig::default(), 1);
        let mut b = (*crate::testing::worker("B")).clone();
        b.address = crate::registry::EngineAddress::new("127.0.0.1", 2);
        assert_eq!(
            as_routed.for_request(&a, &[std::sync::Arc::new(b)]),
            [("x-sgl-cluster", "sgl_engines"), (ENDPOINT_HEADER, "127.0.0.1:1,127.0.0.1:2")]
                .map(|(k, v)| (k.to_string(), v.to_string())),
            "as many fallbacks as the route retries: the route's count stands"
        );
        let mut named = (*crate::testing::worker("N")).clone();
        named.address = crate::registry::EngineAddress::new("engine-n.internal", 1);
        assert_eq!(
            retrying.for_request(&named, &[]),
            [("x-sgl-cluster".to_string(), "sgl_N".to_string()), (MAX_RETRIES_HEADER.to_string(), "0".to_string())],
            "a host Envoy knows by name only keeps its own cluster, and is not retried"
        );
        let plain = UpstreamHeader::new(&UpstreamConfig::default(), 0);
        assert_eq!(plain.for_request(&a, &[]), [plain.for_worker(&a)]);
    }

    #[test]
    fn the_header_carries_the_cluster_or_the_address() {
        let w = crate::testing::worker("A");
        let cluster = UpstreamHeader::new(&UpstreamConfig::default(), 0);
        assert_eq!(cluster.for_worker(&w), ("x-sgl-cluster".to_string(), "sgl_A".to_string()));
        let dst =
            UpstreamHeader::new(&UpstreamConfig { mode: UpstreamMode::OriginalDst, ..UpstreamConfig::default() }, 1);
        assert_eq!(dst.retries(), 0, "an ORIGINAL_DST cluster cannot retry elsewhere");
        assert_eq!(dst.for_worker(&w), ("x-gateway-destination-endpoint".to_string(), "127.0.0.1:1".to_string()));
    }

    #[test]
    fn override_host_names_the_engine_then_its_fallbacks_in_one_header() {
        let a = crate::testing::worker("A");
        let mut b = (*crate::testing::worker("B")).clone();
        b.address = crate::registry::EngineAddress::new("127.0.0.1", 2);
        let config = UpstreamConfig { mode: UpstreamMode::OverrideHost, ..UpstreamConfig::default() };
        let retrying = UpstreamHeader::new(&config, 1);
        let expected = [("x-gateway-destination-endpoint", "127.0.0.1:1,127.0.0.1:2"), (MAX_RETRIES_HEADER, "1")];
        assert_eq!(
            retrying.for_request(&a, &[std::sync::Arc::new(b)]),
            expected.map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let once = UpstreamHeader::new(&config, 0);
        assert_eq!(
            once.for_request(&a, &[]),
            [("x-gateway-destination-endpoint".to_string(), "127.0.0.1:1".to_string())]
        );
    }
}
