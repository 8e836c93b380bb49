//! An in-memory [`Host`] for native and wasm unit tests: shared data with the same cas rules as
//! Envoy's, a settable clock and a seeded random source.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use super::{Host, HostError, SharedValue};

#[derive(Debug)]
pub struct MemoryHost {
    data: Mutex<HashMap<String, SharedValue>>,
    queues: Mutex<HashMap<String, Vec<Vec<u8>>>>,
    now_ms: AtomicU64,
    rng: Mutex<Xoshiro256PlusPlus>,
    /// Keys under this prefix refuse every cas write, as a key other VMs write without pause.
    contended: Mutex<Option<String>>,
}

impl MemoryHost {
    pub fn new(seed: u64) -> Self {
        Self {
            data: Mutex::new(HashMap::new()),
            queues: Mutex::new(HashMap::new()),
            now_ms: AtomicU64::new(1_000_000),
            rng: Mutex::new(Xoshiro256PlusPlus::seed_from_u64(seed)),
            contended: Mutex::new(None),
        }
    }

    /// From now on, cas writes of keys starting with `prefix` fail with a mismatch (`None`: none).
    pub fn contend(&self, prefix: Option<&str>) {
        if let Ok(mut c) = self.contended.lock() {
            *c = prefix.map(str::to_string);
        }
    }

    pub fn set_now_ms(&self, now: u64) {
        self.now_ms.store(now, Ordering::SeqCst);
    }

    pub fn advance_ms(&self, by: u64) {
        self.now_ms.fetch_add(by, Ordering::SeqCst);
    }

    /// Takes every message queued on `name`, oldest first.
    pub fn drain(&self, name: &str) -> Vec<Vec<u8>> {
        self.queues.lock().map(|mut q| q.remove(name).unwrap_or_default()).unwrap_or_default()
    }
}

impl Default for MemoryHost {
    fn default() -> Self {
        Self::new(0x5eed)
    }
}

fn poisoned() -> HostError {
    HostError::Failed("memory host lock poisoned".to_string())
}

impl Host for MemoryHost {
    fn shared_get(&self, key: &str) -> Result<Option<SharedValue>, HostError> {
        let data = self.data.lock().map_err(|_| poisoned())?;
        Ok(data.get(key).filter(|v| !v.bytes.is_empty()).cloned())
    }

    fn shared_set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), HostError> {
        let contended = self.contended.lock().map_err(|_| poisoned())?;
        if cas.is_some_and(|c| c != 0) && contended.as_deref().is_some_and(|p| key.starts_with(p)) {
            return Err(HostError::CasMismatch);
        }
        let mut data = self.data.lock().map_err(|_| poisoned())?;
        match data.get_mut(key) {
            Some(existing) => {
                if cas.is_some_and(|c| c != 0 && c != existing.cas) {
                    return Err(HostError::CasMismatch);
                }
                existing.bytes = value.to_vec();
                existing.cas = existing.cas.wrapping_add(1).max(1);
            }
            None => {
                data.insert(key.to_string(), SharedValue { bytes: value.to_vec(), cas: 1 });
            }
        }
        Ok(())
    }

    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }

    fn enqueue(&self, name: &str, message: &[u8]) -> Result<(), HostError> {
        let mut q = self.queues.lock().map_err(|_| poisoned())?;
        q.entry(name.to_string()).or_default().push(message.to_vec());
        Ok(())
    }

    fn random_u64(&self) -> u64 {
        match self.rng.lock() {
            Ok(mut rng) => rng.next_u64(),
            Err(_) => 4, // a poisoned test lock; any value keeps the caller going
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn stale_cas_is_refused() {
        let host = MemoryHost::default();
        host.shared_set("k", b"a", None).unwrap();
        let v = host.shared_get("k").unwrap().unwrap();
        host.shared_set("k", b"b", Some(v.cas)).unwrap();
        assert_eq!(host.shared_set("k", b"c", Some(v.cas)), Err(HostError::CasMismatch));
        assert_eq!(host.shared_get("k").unwrap().unwrap().bytes, b"b");
    }

    #[test]
    fn absent_key_reads_none() {
        assert_eq!(MemoryHost::default().shared_get("nope").unwrap(), None);
    }
}
