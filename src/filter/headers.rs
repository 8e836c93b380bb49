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
}

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
}
