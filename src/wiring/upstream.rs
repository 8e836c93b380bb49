//! How a decision reaches Envoy's router filter, and how an upstream's answer counts. One
//! definition of each, for the filter's upstream request, the PD prefill callout and the breaker.

use crate::config::{UpstreamConfig, UpstreamMode};
use crate::registry::Engine;

/// The header the router filter routes on, and what it carries for an engine.
#[derive(Debug, Clone)]
pub struct UpstreamHeader {
    mode: UpstreamMode,
    name: String,
}

impl UpstreamHeader {
    pub fn new(config: &UpstreamConfig) -> Self {
        Self { mode: config.mode, name: config.header_name().to_string() }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(header, value)`: the engine's cluster, or its `host:port` for an ORIGINAL_DST cluster.
    pub fn for_worker(&self, worker: &Engine) -> (String, String) {
        let value = match self.mode {
            UpstreamMode::ClusterHeader => worker.cluster.clone(),
            UpstreamMode::OriginalDst => worker.address.host_port(),
        };
        (self.name.clone(), value)
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
    fn the_header_carries_the_cluster_or_the_address() {
        let w = crate::testing::worker("A");
        let cluster = UpstreamHeader::new(&UpstreamConfig::default());
        assert_eq!(cluster.for_worker(&w), ("x-sgl-cluster".to_string(), "sgl_A".to_string()));
        let dst = UpstreamHeader::new(&UpstreamConfig { mode: UpstreamMode::OriginalDst, header: None });
        assert_eq!(dst.for_worker(&w), ("x-gateway-destination-endpoint".to_string(), "127.0.0.1:1".to_string()));
    }
}
