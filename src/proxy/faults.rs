//! Test-only faults, compiled with `--features fault-injection` into a module of its own
//! (`scripts/build` writes `sgl_envoy_router_faults.wasm` for the takeover test; the shipped
//! module has none of this). A request carrying `x-sgl-fault: trap-service` arms a trap in shared
//! data, answered 202; the VM doing the service's work springs it on its next tick and traps, as
//! a crash would, so Envoy's `failure_policy` takes over.

use proxy_wasm::hostcalls;

use crate::host::Host;

const HEADER: &str = "x-sgl-fault";
const TRAP_SERVICE: &[u8] = b"trap-service";
const KEY: &str = "sgl.fault.trap_service";

/// Arms the trap when `headers` ask for it; true when the request was answered.
pub fn arm_if_asked(headers: &[(String, Vec<u8>)], host: &dyn Host) -> bool {
    if !headers.iter().any(|(name, value)| name == HEADER && value == TRAP_SERVICE) {
        return false;
    }
    if let Err(e) = host.shared_set(KEY, b"1", None) {
        log::warn!("fault not armed: {e}");
    }
    let _ = hostcalls::send_http_response(202, vec![], Some(b"armed"));
    true
}

/// Traps this VM when the trap is armed (it is disarmed first, so the next holder runs on).
pub fn spring_if_armed(host: &dyn Host) {
    let armed = host.shared_get(KEY).ok().flatten().is_some_and(|v| v.bytes == b"1");
    if armed && host.shared_set(KEY, b"0", None).is_ok() {
        log::warn!("fault injection: the VM doing the service's work traps now");
        std::process::abort();
    }
}
