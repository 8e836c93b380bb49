//! Two shapes every shared table takes: a table published by one writer and read by many through
//! a version key, and a counter updated by everyone with cas.

use std::marker::PhantomData;

use serde::de::DeserializeOwned;

use super::keys;
use super::schedule::Period;
use crate::host::{Host, HostError};

/// How often a cas update is retried before giving up; contention is between a handful of VMs.
const CAS_RETRIES: usize = 32;

/// The cas a first write carries. The host checks a cas only against an existing key, so this one
/// writes when the key is absent and fails with a mismatch when anyone wrote it first: no existing
/// value carries it (cas values count up from 1 and would need 2³² writes to reach it).
const ONLY_IF_ABSENT: u32 = u32::MAX;

/// Publishes a table written by the service alone: the table first, then its version, so a
/// reader that sees the new version always finds the new table.
pub fn publish(host: &dyn Host, table: &str, bytes: &[u8]) -> Result<u64, HostError> {
    host.shared_set(table, bytes, None)?;
    let version_key = keys::version_of(table);
    let next = read_u64(host, &version_key)?.unwrap_or(0).wrapping_add(1);
    host.shared_set(&version_key, &next.to_le_bytes(), None)?;
    Ok(next)
}

/// A worker VM's copy of a published table, decoded again only when its version moved.
#[derive(Debug)]
pub struct VersionedReader<T> {
    table: String,
    version_key: String,
    seen: Option<u64>,
    value: Option<T>,
    /// A reader on the request path looks at the version at most this often (0: every time).
    recheck: Period,
    _marker: PhantomData<T>,
}

impl<T: DeserializeOwned> VersionedReader<T> {
    pub fn new(table: &str) -> Self {
        Self {
            table: table.to_string(),
            version_key: keys::version_of(table),
            seen: None,
            value: None,
            recheck: Period::every(0),
            _marker: PhantomData,
        }
    }

    /// Looks at the version at most every `ms` once a table was read: a filter reads its tables
    /// per request, and the version read is a host call that almost always finds nothing new.
    pub fn rechecked_every(mut self, ms: u64) -> Self {
        self.recheck = Period::every(ms);
        self
    }

    /// Reads the version and decodes the table if it moved; returns whether it did. A table that
    /// fails to decode keeps the previous copy: a reader never acts on half-understood data.
    pub fn refresh(&mut self, host: &dyn Host) -> bool {
        if self.recheck.ms() > 0 {
            let now = host.now_ms();
            if !self.recheck.elapsed(now) && self.value.is_some() {
                return false;
            }
            self.recheck.done(now);
        }
        if let Ok(Some(version)) = read_u64(host, &self.version_key) {
            if self.seen != Some(version) {
                if let Ok(Some(raw)) = host.shared_get(&self.table) {
                    if let Ok(decoded) = serde_json::from_slice(&raw.bytes) {
                        self.value = Some(decoded);
                        self.seen = Some(version);
                        return true;
                    }
                }
            }
        }
        false
    }

    /// The last decoded table, or `None` before the first publication.
    pub fn value(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// [`Self::refresh`], then [`Self::value`].
    pub fn current(&mut self, host: &dyn Host) -> Option<&T> {
        self.refresh(host);
        self.value()
    }

    pub fn version(&self) -> Option<u64> {
        self.seen
    }
}

pub fn read_u64(host: &dyn Host, key: &str) -> Result<Option<u64>, HostError> {
    Ok(host.shared_get(key)?.and_then(|v| decode_u64(&v.bytes)))
}

pub fn decode_u64(bytes: &[u8]) -> Option<u64> {
    let array: [u8; 8] = bytes.try_into().ok()?;
    Some(u64::from_le_bytes(array))
}

/// Applies `change` to a shared value with cas until it sticks and returns what `change` returned.
/// An absent key is first seeded with `seed`. Every VM may call it concurrently; no update is lost.
pub fn update<R>(
    host: &dyn Host,
    key: &str,
    seed: &[u8],
    mut change: impl FnMut(&[u8]) -> (Vec<u8>, R),
) -> Result<R, HostError> {
    if seed.is_empty() {
        // An empty value reads back as absent; the key could never be updated.
        return Err(HostError::Failed(format!("`{key}` needs a non-empty seed")));
    }
    for _ in 0..CAS_RETRIES {
        match host.shared_get(key)? {
            None => match host.shared_set(key, seed, Some(ONLY_IF_ABSENT)) {
                // Seeded, or someone else seeded (and maybe already updated) it: read it again.
                Ok(()) | Err(HostError::CasMismatch) => continue,
                Err(e) => return Err(e),
            },
            Some(current) => {
                let (next, result) = change(&current.bytes);
                match host.shared_set(key, &next, Some(current.cas)) {
                    Ok(()) => return Ok(result),
                    Err(HostError::CasMismatch) => continue,
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Err(HostError::Failed(format!("`{key}` stayed contended for {CAS_RETRIES} cas attempts")))
}

/// Publishes what `next` makes of the current value (`None`: absent), atomically: `next` returns
/// `None` to leave it. Returns whether it published (and so moved the table's version).
pub fn publish_if(
    host: &dyn Host,
    table: &str,
    next: impl Fn(Option<&[u8]>) -> Option<Vec<u8>>,
) -> Result<bool, HostError> {
    for _ in 0..CAS_RETRIES {
        let current = host.shared_get(table)?;
        let Some(bytes) = next(current.as_ref().map(|c| c.bytes.as_slice())) else { return Ok(false) };
        let cas = current.map_or(ONLY_IF_ABSENT, |c| c.cas);
        match host.shared_set(table, &bytes, Some(cas)) {
            Ok(()) => {
                let version_key = keys::version_of(table);
                fetch_add(host, &version_key, 1)?;
                return Ok(true);
            }
            Err(HostError::CasMismatch) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(HostError::Failed(format!("`{table}` stayed contended for {CAS_RETRIES} cas attempts")))
}

/// 128-bit FNV-1a over the length-prefixed parts: stable across VMs and builds (std's hasher is
/// seeded per process), and no choice of parts can pose as another.
pub fn stable_hash<'a>(parts: impl IntoIterator<Item = &'a str>) -> u128 {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h = OFFSET;
    for part in parts {
        for b in (part.len() as u64).to_le_bytes().iter().chain(part.as_bytes()) {
            h = (h ^ u128::from(*b)).wrapping_mul(PRIME);
        }
    }
    h
}

/// Adds `delta` to a shared counter and returns the value before the addition.
pub fn fetch_add(host: &dyn Host, key: &str, delta: u64) -> Result<u64, HostError> {
    update(host, key, &0u64.to_le_bytes(), |bytes| {
        let value = decode_u64(bytes).unwrap_or(0);
        (value.wrapping_add(delta).to_le_bytes().to_vec(), value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    #[test]
    fn reader_sees_publications_and_skips_unchanged_versions() {
        let host = MemoryHost::default();
        let mut reader: VersionedReader<Vec<u32>> = VersionedReader::new("t");
        assert_eq!(reader.current(&host), None);
        publish(&host, "t", b"[1,2]").unwrap();
        assert_eq!(reader.current(&host), Some(&vec![1, 2]));
        // Overwrite the table without a version bump: the reader keeps its decoded copy.
        host.shared_set("t", b"[9]", None).unwrap();
        assert_eq!(reader.current(&host), Some(&vec![1, 2]));
        publish(&host, "t", b"[3]").unwrap();
        assert_eq!(reader.current(&host), Some(&vec![3]));
        assert_eq!(reader.version(), Some(2));
    }

    #[test]
    fn a_rechecking_reader_looks_at_the_version_once_per_interval() {
        let host = MemoryHost::default();
        let mut reader: VersionedReader<Vec<u32>> = VersionedReader::new("t").rechecked_every(5);
        publish(&host, "t", b"[1]").unwrap();
        assert_eq!(reader.current(&host), Some(&vec![1]), "the first read is never held back");
        publish(&host, "t", b"[2]").unwrap();
        assert_eq!(reader.current(&host), Some(&vec![1]), "checked under 5 ms ago");
        host.advance_ms(5);
        assert_eq!(reader.current(&host), Some(&vec![2]));
    }

    #[test]
    fn undecodable_table_keeps_previous_copy() {
        let host = MemoryHost::default();
        let mut reader: VersionedReader<Vec<u32>> = VersionedReader::new("t");
        publish(&host, "t", b"[1]").unwrap();
        reader.current(&host);
        publish(&host, "t", b"not json").unwrap();
        assert_eq!(reader.current(&host), Some(&vec![1]));
    }

    /// Another VM seeds and updates the key between this VM's read (absent) and its seed.
    #[derive(Debug)]
    struct Interleaved {
        inner: MemoryHost,
        raced: std::sync::atomic::AtomicBool,
    }

    impl Host for Interleaved {
        fn shared_get(&self, key: &str) -> Result<Option<crate::host::SharedValue>, HostError> {
            let seen = self.inner.shared_get(key)?;
            if seen.is_none() && !self.raced.swap(true, std::sync::atomic::Ordering::SeqCst) {
                fetch_add(&self.inner, key, 5)?;
            }
            Ok(seen)
        }
        fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
            self.inner.shared_set(key, value, cas)
        }
        fn now_ms(&self) -> u64 {
            self.inner.now_ms()
        }
        fn random_u64(&self) -> u64 {
            self.inner.random_u64()
        }
        fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError> {
            self.inner.enqueue(name, message)
        }
    }

    #[test]
    fn a_racing_first_write_never_overwrites_a_completed_update() {
        let host = Interleaved { inner: MemoryHost::default(), raced: Default::default() };
        assert_eq!(fetch_add(&host, "c", 1).unwrap(), 5, "the other VM's +5 is kept and seen");
        assert_eq!(read_u64(&host, "c").unwrap(), Some(6));
    }

    #[test]
    fn fetch_add_counts_from_zero() {
        let host = MemoryHost::default();
        assert_eq!(fetch_add(&host, "c", 1).unwrap(), 0);
        assert_eq!(fetch_add(&host, "c", 1).unwrap(), 1);
        assert_eq!(fetch_add(&host, "c", 5).unwrap(), 2);
        assert_eq!(read_u64(&host, "c").unwrap(), Some(7));
    }
}
