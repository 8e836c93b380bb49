//! The core's [`Host`] over proxy-wasm host calls.

use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

use crate::host::{CalloutRequest, Host, HostError, SharedValue};

thread_local! {
    /// Resolved queue ids, once per VM.
    static QUEUES: std::cell::RefCell<std::collections::HashMap<String, u32>> = Default::default();
    /// The clock as first read inside the current filter callback, while a [`ClockScope`] is open.
    static CALLBACK_NOW_MS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
    static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// One clock reading per filter callback: the core asks for the time several times while it
/// handles one event (staleness, breakers, accounting), and each ask would be a host call for the
/// same millisecond. Open at the top of a callback; the reading is dropped with the scope.
pub struct ClockScope(());

impl ClockScope {
    pub fn enter() -> Self {
        IN_CALLBACK.set(true);
        CALLBACK_NOW_MS.set(None);
        Self(())
    }
}

impl Drop for ClockScope {
    fn drop(&mut self) {
        IN_CALLBACK.set(false);
        CALLBACK_NOW_MS.set(None);
    }
}

fn host_now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

#[derive(Debug, Default, Clone, Copy)]
pub struct ProxyHost;

impl Host for ProxyHost {
    fn shared_get(&self, key: &str) -> Result<Option<SharedValue>, HostError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) if !bytes.is_empty() => Ok(Some(SharedValue { bytes, cas: cas.unwrap_or(0) })),
            Ok(_) => Ok(None),
            Err(status) => Err(HostError::Failed(format!("get_shared_data({key}): {status:?}"))),
        }
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(HostError::CasMismatch),
            Err(status) => Err(HostError::Failed(format!("set_shared_data({key}): {status:?}"))),
        }
    }

    fn now_ms(&self) -> u64 {
        if !IN_CALLBACK.get() {
            return host_now_ms();
        }
        if let Some(now) = CALLBACK_NOW_MS.get() {
            return now;
        }
        let now = host_now_ms();
        CALLBACK_NOW_MS.set(Some(now));
        now
    }

    fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError> {
        let queue = QUEUES.with(|q| q.borrow().get(name).copied());
        let queue = match queue {
            Some(id) => id,
            None => {
                let vm_id = hostcalls::get_property(vec!["plugin_vm_id"])
                    .ok()
                    .flatten()
                    .and_then(|b| String::from_utf8(b).ok())
                    .unwrap_or_else(|| "sgl_router".to_string());
                match hostcalls::resolve_shared_queue(&vm_id, name) {
                    Ok(Some(id)) => {
                        QUEUES.with(|q| q.borrow_mut().insert(name.to_string(), id));
                        id
                    }
                    Ok(None) => {
                        return Err(HostError::Failed(format!(
                            "queue {name} is not registered (is the service running?)"
                        )))
                    }
                    Err(status) => return Err(HostError::Failed(format!("resolve_shared_queue({name}): {status:?}"))),
                }
            }
        };
        hostcalls::enqueue_shared_queue(queue, Some(message))
            .map_err(|status| HostError::Failed(format!("enqueue_shared_queue({name}): {status:?}")))
    }

    fn monotonic_us(&self) -> u64 {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let elapsed = START.get_or_init(std::time::Instant::now).elapsed();
        u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
    }

    fn random_u64(&self) -> u64 {
        getrandom::u64().unwrap_or_else(|_| self.now_ms().wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }
}

/// Asks Envoy to pick the route again after the filter set the upstream header.
pub fn clear_route_cache() {
    if let Err(status) = hostcalls::call_foreign_function("clear_route_cache", Some(&[])) {
        log::debug!("clear_route_cache unavailable: {status:?}");
    }
}

/// Dispatches a callout the core described; the answer comes to the context that was active.
pub fn dispatch(request: &CalloutRequest) -> Result<u32, HostError> {
    let mut headers: Vec<(&str, &str)> = vec![
        (":method", request.method.as_str()),
        (":path", request.path.as_str()),
        (":authority", request.authority.as_str()),
    ];
    headers.extend(request.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let timeout = std::time::Duration::from_millis(request.timeout_ms);
    let body = request.body.as_deref().map(Vec::as_slice);
    hostcalls::dispatch_http_call(&request.cluster, headers, body, vec![], timeout)
        .map_err(|status| HostError::Failed(format!("dispatch_http_call({}): {status:?}", request.cluster)))
}
