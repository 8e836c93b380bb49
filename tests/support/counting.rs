//! Counting what one request costs the host, shared by the hot-path budget test and the request
//! bench: a global allocator that counts allocations (each binary installs it with
//! `#[global_allocator]`), and a `Host` over `MemoryHost` that counts calls by kind and by the
//! shared-data table their key belongs to, without allocating.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use sgl_envoy_router::config::RouterConfig;
use sgl_envoy_router::filter::AppContext;
use sgl_envoy_router::host::{Host, HostError, MemoryHost, SharedValue};
use sgl_envoy_router::service::{PollKind, ServiceCore};
use sgl_envoy_router::wiring::factory::filter_handles;

/// Counts every allocation, so a stretch's count is the difference across it.
pub struct Counting;

pub static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
pub static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The shared-data tables calls are counted by: the key without its per-worker or per-instance
/// tail (under no namespace, as a configuration that names none has in tests).
pub const TABLES: [&str; 11] = [
    "sgl.inflight",
    "sgl.load",
    "sgl.health",
    "sgl.breakers",
    "sgl.rr",
    "sgl.affinity",
    "sgl.prefix",
    "sgl.vms",
    "sgl.seats",
    "sgl.queue",
    "other",
];
pub const KINDS: [&str; 5] = ["shared_get", "shared_set", "now_ms", "random_u64", "enqueue"];

#[derive(Debug)]
pub struct CountingHost {
    pub inner: MemoryHost,
    calls: [[AtomicU64; TABLES.len()]; KINDS.len()],
}

fn table(key: &str) -> usize {
    // A namespaced key is `namespace/key`; keys of ours start with `sgl.`.
    let key = if key.starts_with("sgl.") { key } else { key.split_once('/').map_or(key, |(_, k)| k) };
    TABLES.iter().position(|t| key.starts_with(t)).unwrap_or(TABLES.len() - 1)
}

impl CountingHost {
    pub fn new(inner: MemoryHost) -> Self {
        Self { inner, calls: Default::default() }
    }

    fn count(&self, kind: usize, key: &str) {
        self.calls[kind][table(key)].fetch_add(1, Ordering::Relaxed);
    }

    /// The calls since the last take, as ("kind table", count) for shared data and ("kind",
    /// count) for the rest, in a fixed order; zero counts left out.
    pub fn take(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (k, row) in self.calls.iter().enumerate() {
            for (t, n) in row.iter().enumerate() {
                let n = n.swap(0, Ordering::Relaxed);
                if n > 0 {
                    let name = if k >= 2 { KINDS[k].to_string() } else { format!("{} {}", KINDS[k], TABLES[t]) };
                    out.push((name, n));
                }
            }
        }
        out
    }
}

impl Host for CountingHost {
    fn shared_get(&self, key: &str) -> Result<Option<SharedValue>, HostError> {
        self.count(0, key);
        self.inner.shared_get(key)
    }
    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        self.count(1, key);
        self.inner.shared_set(key, value, cas)
    }
    fn now_ms(&self) -> u64 {
        self.count(2, "");
        self.inner.now_ms()
    }
    fn random_u64(&self) -> u64 {
        self.count(3, "");
        self.inner.random_u64()
    }
    fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError> {
        self.count(4, name);
        self.inner.enqueue(name, message)
    }
}

/// One filter VM's core over a counting host, beside a service that has published every engine's
/// load and health.
pub fn counted_app(config: RouterConfig) -> (Arc<CountingHost>, AppContext) {
    let host = Arc::new(CountingHost::new(MemoryHost::new(7)));
    let mut service = ServiceCore::new(config.clone(), Arc::clone(&host) as Arc<dyn Host>);
    publish(&mut service, &host);
    let (handles, _) = filter_handles(&config, Arc::clone(&host) as Arc<dyn Host>, 1);
    (host, AppContext::new(config, handles))
}

/// The service's loads and health for every engine, published as in Envoy: three rounds of polls
/// answered, two seconds apart.
fn publish(service: &mut ServiceCore, host: &CountingHost) {
    let loads = br#"{"loads":[{"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":0,"num_used_tokens":1000,"max_total_num_tokens":100000,"max_running_requests":64}]}"#;
    for _ in 0..3 {
        let now = host.inner.now_ms();
        for poll in service.tick(now).polls {
            let body: &[u8] = match poll.kind {
                PollKind::Load(_) => loads,
                PollKind::Health(_) => b"",
            };
            service.on_poll_answer(poll.kind, poll.generation, Some(200), body, now);
        }
        host.inner.advance_ms(2_000);
    }
}
