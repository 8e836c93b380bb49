//! Request headers the filter treats specially: those a client may never set (spec §3), and the
//! session and routing-key headers it reads while request headers are still readable.

use crate::config::RouterConfig;

/// Headers the filter sets itself, and every header that selects an upstream.
const ROUTING_HEADERS: [&str; 6] = [
    "x-sgl-cluster",
    "x-gateway-destination-endpoint",
    "x-sgl-bucket",
    "x-sgl-worker",
    "x-sgl-prefill-worker",
    "x-sgl-vm",
];

#[derive(Debug, Clone)]
pub struct ProtectedHeaders {
    stripped: Vec<String>,
    keys: Vec<String>,
}

impl ProtectedHeaders {
    /// Computed once per configuration, not per request.
    pub fn new(config: &RouterConfig, upstream_header: &str) -> Self {
        let mut stripped: Vec<String> = ROUTING_HEADERS.iter().map(|h| h.to_string()).collect();
        if !stripped.iter().any(|h| h == upstream_header) {
            stripped.push(upstream_header.to_string());
        }
        let mut keys: Vec<String> =
            config.models.values().flat_map(|m| [m.session_id_header.clone(), m.routing_key_header.clone()]).collect();
        keys.sort();
        keys.dedup();
        Self { stripped, keys }
    }

    /// Removed from every request, whatever its path: a client never chooses an engine or a host.
    pub fn stripped(&self) -> &[String] {
        &self.stripped
    }

    /// Every model's session and routing-key header names.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn a_custom_upstream_header_is_stripped_too_and_key_headers_are_listed_once() {
        let config = crate::config::parse_and_validate(
            r#"{"workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}],
                "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]},
                           "n": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}}}"#,
        )
        .unwrap();
        let h = ProtectedHeaders::new(&config, "x-my-upstream");
        assert!(h.stripped().iter().any(|s| s == "x-my-upstream"));
        assert!(h.stripped().iter().any(|s| s == "x-sgl-cluster"));
        assert_eq!(h.keys(), ["x-session-id", "x-sgl-routing-key"]);
        let default = ProtectedHeaders::new(&config, "x-sgl-cluster");
        assert_eq!(default.stripped().len(), ROUTING_HEADERS.len());
    }
}
