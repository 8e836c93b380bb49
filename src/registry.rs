//! WorkerRegistry: the live engines, their model and role (authoritative), and their address.

use std::sync::Arc;

use crate::config::{Role, RouterConfig, WorkerConfig};

/// Where an engine listens, from its configured `url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAddress {
    pub host: String,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error("`{0}` is not an http:// URL (https to engines is not supported)")]
    Scheme(String),
    #[error("`{0}` has no host")]
    NoHost(String),
    #[error("`{0}` has an invalid port")]
    Port(String),
}

impl EngineAddress {
    pub fn parse(url: &str) -> Result<Self, AddressError> {
        let rest = url.strip_prefix("http://").ok_or_else(|| AddressError::Scheme(url.to_string()))?;
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            // [v6]:port
            let (h, after) = bracketed.split_once(']').ok_or_else(|| AddressError::NoHost(url.to_string()))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| AddressError::Port(url.to_string()))?,
                None if after.is_empty() => 80,
                None => return Err(AddressError::Port(url.to_string())),
            };
            (h.to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().map_err(|_| AddressError::Port(url.to_string()))?),
                None => (authority.to_string(), 80),
            }
        };
        if host.is_empty() {
            return Err(AddressError::NoHost(url.to_string()));
        }
        if port == 0 {
            return Err(AddressError::Port(url.to_string()));
        }
        Ok(Self { host, port })
    }

    /// `host:port`, bracketing IPv6 literals, as ORIGINAL_DST expects.
    pub fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// An engine. Groups refer to workers by id; the registry owns them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub id: String,
    pub model: String,
    pub role: Role,
    pub address: EngineAddress,
    pub cluster: String,
    /// SGLang's PD bootstrap port, prefill workers only.
    pub bootstrap_port: Option<u16>,
    pub dp_size: u32,
}

/// The Envoy cluster of a worker: configured, else `sgl_<id>`.
pub fn cluster_name(w: &WorkerConfig) -> String {
    w.cluster.clone().unwrap_or_else(|| format!("sgl_{}", w.id))
}

/// SGLang's default bootstrap port, used when a prefill worker does not name one.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

#[derive(Debug, Default)]
pub struct WorkerRegistry {
    workers: Vec<Arc<Worker>>,
}

impl WorkerRegistry {
    /// Builds the registry from a validated configuration; a worker whose URL does not parse was
    /// already refused by validation, so it is skipped here rather than failing twice.
    pub fn from_config(config: &RouterConfig) -> Self {
        let mut workers: Vec<Arc<Worker>> = config
            .workers
            .iter()
            .filter_map(|w| {
                let address = EngineAddress::parse(&w.url).ok()?;
                Some(Arc::new(Worker {
                    id: w.id.clone(),
                    model: w.model.clone(),
                    role: w.role,
                    address,
                    cluster: cluster_name(w),
                    bootstrap_port: (w.role == Role::Prefill)
                        .then(|| w.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT)),
                    dp_size: w.dp_size,
                }))
            })
            .collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        Self { workers }
    }

    /// Every worker, sorted by id.
    pub fn all(&self) -> &[Arc<Worker>] {
        &self.workers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_host_and_port() {
        let a = EngineAddress::parse("http://10.0.0.1:30000").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("10.0.0.1", 30000));
        assert_eq!(a.host_port(), "10.0.0.1:30000");
    }

    #[test]
    fn default_port_and_path() {
        let a = EngineAddress::parse("http://engine.local/v1").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("engine.local", 80));
    }

    #[test]
    fn ipv6_literal_is_bracketed_again() {
        let a = EngineAddress::parse("http://[::1]:8000").unwrap();
        assert_eq!(a.host, "::1");
        assert_eq!(a.host_port(), "[::1]:8000");
    }

    #[test]
    fn rejects_https_missing_host_and_bad_port() {
        assert!(matches!(EngineAddress::parse("https://a:1"), Err(AddressError::Scheme(_))));
        assert!(matches!(EngineAddress::parse("http://:80"), Err(AddressError::NoHost(_))));
        assert!(matches!(EngineAddress::parse("http://a:x"), Err(AddressError::Port(_))));
        assert!(matches!(EngineAddress::parse("http://a:0"), Err(AddressError::Port(_))));
    }
}
