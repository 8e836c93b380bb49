//! EngineRegistry (design "Data ownership"): the live engines, their model, role (authoritative)
//! and health, and where each listens. Every other module speaks this vocabulary; the registry
//! imports none of them.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Where an engine listens, from its configured `url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAddress {
    host: String,
    port: u16,
    /// `ip:port` when the host is an IP literal, written once: every request names it.
    socket: Option<Arc<str>>,
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
        Ok(Self::new(host, port))
    }

    pub fn new(host: impl Into<String>, port: u16) -> Self {
        let host = host.into();
        let socket = host.parse::<std::net::IpAddr>().ok().map(|ip| Arc::from(SocketAddr::new(ip, port).to_string()));
        Self { host, port, socket }
    }

    /// `ip:port` as Envoy names a host of a STATIC cluster, when the host is an IP literal.
    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn socket(&self) -> Option<&str> {
        self.socket.as_deref()
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

/// The stage an engine serves: a plain engine does a whole request; PD splits it into a prefill
/// and a decode engine. The registry's role is authoritative when groups filter candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Plain,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Plain => "plain",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// An engine. Groups refer to workers by id; the registry owns them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Engine {
    pub id: String,
    pub model: String,
    pub role: Role,
    pub address: EngineAddress,
    /// The Envoy cluster its requests and callouts go to: its own, or the engines' shared one.
    pub cluster: String,
    /// On a shared cluster (`upstream.mode: override_host`): the header, and its value, that names
    /// this engine to the cluster's override-host policy. Every callout to it carries it.
    pub override_host: Option<(Arc<str>, String)>,
    /// SGLang's PD bootstrap port, prefill workers only.
    pub bootstrap_port: Option<u16>,
    pub dp_size: u32,
    /// Draining: it takes no new request (its requests in flight complete).
    pub draining: bool,
}

impl Engine {
    /// A callout to this engine: its cluster, its authority, and on a shared cluster the header
    /// that names it.
    pub fn callout(&self, method: &str, path: &str, timeout_ms: u64) -> crate::host::CalloutRequest {
        crate::host::CalloutRequest {
            cluster: self.cluster.clone(),
            method: method.to_string(),
            path: path.to_string(),
            authority: self.address.host_port(),
            headers: self.override_host.iter().map(|(h, v)| (h.to_string(), v.clone())).collect(),
            body: None,
            timeout_ms,
        }
    }

    /// Whether the engine is a host of the engines cluster (spec §8): Envoy routes its requests
    /// by address there, and can send one it refused to another. A prefill engine is reached by
    /// callout, and a host named by DNS has no address Envoy's host map knows.
    pub fn in_engines_cluster(&self) -> bool {
        self.role != Role::Prefill && self.address.socket().is_some()
    }
}

/// SGLang's default bootstrap port, used when a prefill worker does not name one.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Which workers are out of service right now (failed health checks, an open breaker). The
/// registry asks it once per request; shared state implements it.
pub trait Availability: Send + Sync + std::fmt::Debug {
    fn unavailable(&self) -> Arc<HashSet<String>>;
}

/// Every worker is available: for the service, which monitors workers rather than routes to them,
/// and for tests.
#[derive(Debug, Default)]
pub struct AllAvailable;

impl Availability for AllAvailable {
    fn unavailable(&self) -> Arc<HashSet<String>> {
        Arc::default()
    }
}

/// The live engines: every configured worker (sorted by id), its model and role, and its health.
#[derive(Debug)]
pub struct EngineRegistry {
    workers: Arc<[Arc<Engine>]>,
    availability: Arc<dyn Availability>,
}

impl EngineRegistry {
    pub fn new(workers: impl IntoIterator<Item = Engine>, availability: Arc<dyn Availability>) -> Self {
        let mut workers: Vec<Arc<Engine>> = workers.into_iter().map(Arc::new).collect();
        workers.sort_by(|a, b| a.id.cmp(&b.id));
        Self { workers: workers.into(), availability }
    }

    /// Every worker, sorted by id, whatever its health.
    pub fn all(&self) -> &[Arc<Engine>] {
        &self.workers
    }

    /// The workers a request may use now, read once for the whole request.
    pub fn live(&self) -> LiveEngines {
        LiveEngines { workers: Arc::clone(&self.workers), unavailable: self.availability.unavailable() }
    }
}

/// A set of engines by their place in the registry (id order), in a fixed 256 bits: a waiting
/// request's record in shared data names the engines it could use in 32 bytes, whatever their
/// number. Past 256 engines two share a bit, so a set may name more engines than it holds; what
/// reads it treats them as held (a request then waits behind one it does not compete with, never
/// the reverse).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineSet([u64; 4]);

impl EngineSet {
    pub const SLOTS: usize = 256;

    pub fn insert(&mut self, slot: usize) {
        let s = slot % Self::SLOTS;
        if let Some(word) = self.0.get_mut(s / 64) {
            *word |= 1 << (s % 64);
        }
    }

    pub fn contains(&self, slot: usize) -> bool {
        let s = slot % Self::SLOTS;
        self.0.get(s / 64).is_some_and(|w| w & (1 << (s % 64)) != 0)
    }

    pub fn union(&mut self, other: &EngineSet) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a |= b;
        }
    }

    pub fn intersects(&self, other: &EngineSet) -> bool {
        self.0.iter().zip(other.0).any(|(a, b)| a & b != 0)
    }

    /// Whether every engine of this set is in `other`.
    pub fn is_subset(&self, other: &EngineSet) -> bool {
        self.0.iter().zip(other.0).all(|(a, b)| a & !b == 0)
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
}

/// One request's view of the registry: the workers minus those health or the breaker took out.
#[derive(Debug, Clone)]
pub struct LiveEngines {
    workers: Arc<[Arc<Engine>]>,
    unavailable: Arc<HashSet<String>>,
}

impl LiveEngines {
    /// A fixed view, for tests and benchmarks; `workers` in id order, as the registry keeps them.
    pub fn new(workers: Arc<[Arc<Engine>]>, unavailable: Arc<HashSet<String>>) -> Self {
        Self { workers, unavailable }
    }

    /// Whether `other` is this very view (the same registry and unavailable set, not equal copies):
    /// what was computed from one holds for the other. Holding the view keeps its allocations
    /// alive, so a later view cannot reuse their addresses.
    pub fn is_same_view(&self, other: &LiveEngines) -> bool {
        Arc::ptr_eq(&self.workers, &other.workers) && Arc::ptr_eq(&self.unavailable, &other.unavailable)
    }

    /// The registry places of `engines` (each found by id), as a set.
    pub fn places<'a>(&self, engines: impl IntoIterator<Item = &'a Arc<Engine>>) -> EngineSet {
        let mut set = EngineSet::default();
        for engine in engines {
            if let Ok(i) = self.workers.binary_search_by(|w| w.id.as_str().cmp(&engine.id)) {
                set.insert(i);
            }
        }
        set
    }

    /// This view without the engines whose places are in `reserved`: what a request may take
    /// while requests ahead of it wait for those (spec §9). An empty set is this very view.
    pub fn without(&self, reserved: &EngineSet) -> LiveEngines {
        if reserved.is_empty() {
            return self.clone();
        }
        let mut unavailable: HashSet<String> = (*self.unavailable).clone();
        for (i, w) in self.workers.iter().enumerate() {
            if reserved.contains(i) {
                unavailable.insert(w.id.clone());
            }
        }
        Self { workers: Arc::clone(&self.workers), unavailable: Arc::new(unavailable) }
    }

    /// Whether `engine` may take requests: not draining, and health or the breaker did not take
    /// it out.
    pub fn in_service(&self, engine: &Engine) -> bool {
        !engine.draining && !self.unavailable.contains(&engine.id)
    }

    /// Available workers of `model` serving `stage`, in id order; a draining worker is not one.
    pub fn serving<'a>(&'a self, model: &'a str, stage: Role) -> impl Iterator<Item = &'a Arc<Engine>> + 'a {
        self.workers.iter().filter(move |w| w.model == model && w.role == stage && self.in_service(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

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
    fn live_workers_leave_out_the_unavailable_and_keep_id_order() {
        #[derive(Debug)]
        struct Down(&'static str);
        impl Availability for Down {
            fn unavailable(&self) -> Arc<HashSet<String>> {
                Arc::new([self.0.to_string()].into_iter().collect())
            }
        }
        let worker = |id: &str, role| Engine {
            id: id.into(),
            model: "m".into(),
            role,
            address: EngineAddress::new("h", 1),
            cluster: format!("sgl_{id}"),
            override_host: None,
            bootstrap_port: None,
            dp_size: 1,
            draining: id == "D",
        };
        let registry = EngineRegistry::new(
            [
                worker("C", Role::Plain),
                worker("A", Role::Plain),
                worker("B", Role::Plain),
                worker("D", Role::Plain),
                worker("P", Role::Prefill),
            ],
            Arc::new(Down("B")),
        );
        let live = registry.live();
        let ids: Vec<&str> = live.serving("m", Role::Plain).map(|w| w.id.as_str()).collect();
        assert_eq!(ids, ["A", "C"], "B is down, D draining");
        assert_eq!(live.serving("other", Role::Plain).count(), 0);
        assert_eq!(registry.all().len(), 5);
    }

    #[test]
    fn rejects_https_missing_host_and_bad_port() {
        assert!(matches!(EngineAddress::parse("https://a:1"), Err(AddressError::Scheme(_))));
        assert!(matches!(EngineAddress::parse("http://:80"), Err(AddressError::NoHost(_))));
        assert!(matches!(EngineAddress::parse("http://a:x"), Err(AddressError::Port(_))));
        assert!(matches!(EngineAddress::parse("http://a:0"), Err(AddressError::Port(_))));
    }
}
