//! Which filter VMs are alive. Each VM heartbeats into one bounded shared key; the service drops
//! VMs that stopped (a crashed VM is recreated with a new id by FAIL_RELOAD) and reclaims what they
//! held.

use super::keys;
use super::shared::{decode_u64, update};
use crate::host::{Host, HostError};

/// A VM that has not heartbeated for this long is gone.
pub const DEAD_AFTER_MS: u64 = 10_000;
/// How often a filter VM heartbeats.
pub const HEARTBEAT_MS: u64 = 1_000;

/// Leads every value: shared data reads an empty value as absent, so an empty list needs a header.
const HEADER: [u8; 8] = *b"sglvms01";

fn decode(bytes: &[u8]) -> Vec<(u64, u64)> {
    bytes
        .get(HEADER.len()..)
        .unwrap_or_default()
        .chunks_exact(16)
        .filter_map(|c| Some((decode_u64(c.get(..8)?)?, decode_u64(c.get(8..)?)?)))
        .collect()
}

fn encode(entries: &[(u64, u64)]) -> Vec<u8> {
    let body = entries.iter().flat_map(|(vm, seen)| vm.to_le_bytes().into_iter().chain(seen.to_le_bytes()));
    HEADER.into_iter().chain(body).collect()
}

pub fn heartbeat(host: &dyn Host, vm: u64, now_ms: u64) -> Result<(), HostError> {
    update(host, keys::VMS, &HEADER, |bytes| {
        let mut entries = decode(bytes);
        match entries.iter_mut().find(|(id, _)| *id == vm) {
            Some(entry) => entry.1 = now_ms,
            None => entries.push((vm, now_ms)),
        }
        (encode(&entries), ())
    })
}

/// Removes VMs silent for [`DEAD_AFTER_MS`] and returns their ids.
pub fn sweep(host: &dyn Host, now_ms: u64) -> Result<Vec<u64>, HostError> {
    update(host, keys::VMS, &HEADER, |bytes| {
        let (alive, dead): (Vec<_>, Vec<_>) =
            decode(bytes).into_iter().partition(|(_, seen)| now_ms.saturating_sub(*seen) <= DEAD_AFTER_MS);
        (encode(&alive), dead.into_iter().map(|(vm, _)| vm).collect())
    })
}

pub fn alive(host: &dyn Host) -> Result<Vec<u64>, HostError> {
    Ok(host
        .shared_get(keys::VMS)?
        .map(|v| decode(&v.bytes).into_iter().map(|(vm, _)| vm).collect())
        .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    #[test]
    fn silent_vms_are_swept_and_live_ones_kept() {
        let host = MemoryHost::default();
        heartbeat(&host, 1, 0).unwrap();
        heartbeat(&host, 2, 0).unwrap();
        heartbeat(&host, 2, 9_000).unwrap();
        assert_eq!(sweep(&host, 10_000).unwrap(), Vec::<u64>::new());
        assert_eq!(sweep(&host, 10_001).unwrap(), vec![1]);
        assert_eq!(alive(&host).unwrap(), vec![2]);
    }
}
