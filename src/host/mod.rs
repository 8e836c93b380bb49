//! The host the core runs on: shared data with cas, a clock and randomness. In Envoy it is
//! proxy-wasm (`proxy/host.rs`); in unit tests it is [`MemoryHost`].

pub mod callouts;
mod memory;

pub use callouts::CalloutRequest;
pub use memory::MemoryHost;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// Someone else wrote the key since it was read.
    #[error("shared data changed since it was read")]
    CasMismatch,
    #[error("host call failed: {0}")]
    Failed(String),
}

/// A value in shared data and the cas to write it back with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedValue {
    pub bytes: Vec<u8>,
    pub cas: u32,
}

pub trait Host: Send + Sync + std::fmt::Debug {
    /// `Ok(None)` when the key was never written (or was written empty).
    fn shared_get(&self, key: &str) -> Result<Option<SharedValue>, HostError>;
    /// With `cas`, fails with [`HostError::CasMismatch`] when the key changed since that read. An
    /// absent key is not checked by the host, so first writers must re-read to converge.
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError>;
    /// Milliseconds of wall-clock time.
    fn now_ms(&self) -> u64;
    /// Microseconds of a monotonic clock, for durations the stats report (selection latency).
    fn monotonic_us(&self) -> u64 {
        self.now_ms().saturating_mul(1000)
    }
    fn random_u64(&self) -> u64;
    /// Sends a message to the shared queue `name`, which only the service registers and drains.
    fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError>;
}

/// `key` (a shared-data key or a queue name) under `namespace` (spec §10); the empty namespace is
/// the key itself.
pub fn in_namespace(namespace: &str, key: &str) -> String {
    if namespace.is_empty() {
        key.to_string()
    } else {
        format!("{namespace}/{key}")
    }
}

/// A host whose shared-data keys and queue names all live under one namespace (spec §10): two
/// router configurations in one Envoy, even in one VM, with the same model names and worker ids,
/// never read each other's state when their namespaces differ.
#[derive(Debug, Clone)]
pub struct Namespaced {
    inner: std::sync::Arc<dyn Host>,
    namespace: std::sync::Arc<str>,
}

impl Namespaced {
    pub fn new(inner: std::sync::Arc<dyn Host>, namespace: &str) -> Self {
        Self { inner, namespace: std::sync::Arc::from(namespace) }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

impl Host for Namespaced {
    fn shared_get(&self, key: &str) -> Result<Option<SharedValue>, HostError> {
        self.inner.shared_get(&in_namespace(&self.namespace, key))
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        self.inner.shared_set(&in_namespace(&self.namespace, key), value, cas)
    }

    fn now_ms(&self) -> u64 {
        self.inner.now_ms()
    }

    fn monotonic_us(&self) -> u64 {
        self.inner.monotonic_us()
    }

    fn random_u64(&self) -> u64 {
        self.inner.random_u64()
    }

    fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError> {
        self.inner.enqueue(&in_namespace(&self.namespace, name), message)
    }
}
