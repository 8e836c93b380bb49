//! Request headers a client may never set (spec §3).

use crate::wiring::upstream::{ENDPOINT_HEADER, MAX_RETRIES_HEADER, RETRY_ON_HEADER};

/// Headers the filter sets itself, every header that selects an upstream, and Envoy's retry
/// headers (a client must not send a request to another engine, nor retry after headers).
const ROUTING_HEADERS: [&str; 9] = [
    "x-sgl-cluster",
    ENDPOINT_HEADER,
    MAX_RETRIES_HEADER,
    RETRY_ON_HEADER,
    "x-gateway-destination-endpoint",
    "x-sgl-bucket",
    "x-sgl-worker",
    "x-sgl-prefill-worker",
    "x-sgl-vm",
];

#[derive(Debug, Clone)]
pub struct ProtectedHeaders {
    stripped: Vec<String>,
}

impl ProtectedHeaders {
    /// Computed once per configuration, not per request.
    pub fn new(upstream_header: &str) -> Self {
        let mut stripped: Vec<String> = ROUTING_HEADERS.iter().map(|h| h.to_string()).collect();
        if !stripped.iter().any(|h| h == upstream_header) {
            stripped.push(upstream_header.to_string());
        }
        Self { stripped }
    }

    /// Removed from every request, whatever its path: a client never chooses an engine or a host.
    pub fn stripped(&self) -> &[String] {
        &self.stripped
    }

    /// Whether a request header named `name` goes: a routing header on every request, and on a
    /// generation request every `x-envoy-*` header too. Envoy's router obeys a dozen of those from
    /// whoever sends them (timeouts, retries, hedging, stat names, the original destination), and
    /// which it trusts from a client rests on the listener's settings: on the router's routes only
    /// the filter sets them.
    pub fn strips(&self, name: &str, generation: bool) -> bool {
        let envoys = name.len() > ENVOY_PREFIX.len()
            && name.as_bytes()[..ENVOY_PREFIX.len()].eq_ignore_ascii_case(ENVOY_PREFIX.as_bytes());
        (generation && envoys) || self.stripped.iter().any(|h| h.eq_ignore_ascii_case(name))
    }
}

/// Envoy's own request headers.
const ENVOY_PREFIX: &str = "x-envoy-";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn a_custom_upstream_header_is_stripped_too() {
        let h = ProtectedHeaders::new("x-my-upstream");
        assert!(h.stripped().iter().any(|s| s == "x-my-upstream"));
        assert!(h.stripped().iter().any(|s| s == "x-sgl-cluster"));
        assert_eq!(ProtectedHeaders::new("x-sgl-cluster").stripped().len(), ROUTING_HEADERS.len());
    }

    #[test]
    fn envoys_headers_go_from_generation_requests_only() {
        let h = ProtectedHeaders::new("x-sgl-cluster");
        for name in ["x-envoy-upstream-rq-timeout-ms", "X-Envoy-Hedge-On-Per-Try-Timeout", "x-envoy-original-dst-host"]
        {
            assert!(h.strips(name, true), "{name}");
            assert!(!h.strips(name, false), "{name}: another route's, left to the operator");
        }
        assert!(h.strips("x-envoy-max-retries", false), "a routing header goes from every request");
        assert!(!h.strips("x-envoy-", true) && !h.strips("x-request-id", true) && !h.strips("authorization", true));
    }
}
