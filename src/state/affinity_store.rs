//! Scoped engine bindings for session and sticky routing (design §6 "Affinity state"). Bindings
//! live in a fixed number of shards in shared data (never a key per session), updated with cas.
//! Concurrent first assignments converge on one binding; the caller re-checks whichever engine
//! won. A binding is keyed by a 128-bit hash of its scope, never by the client's key itself. The service sweeps idle bindings; each shard also caps its entries so memory stays bounded
//! even between sweeps: at most `SHARDS × MAX_PER_SHARD` = 262,144 bindings in all, the least
//! recently used evicted first (counted). A shard that does not decode is counted, logged and
//! rewritten empty on its next change; the other shards keep their bindings.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::keys;
use super::shared::{fetch_add, read_u64, stable_hash, update};
use crate::host::{Host, HostError};
use crate::registry::Role;

/// Fixed number of shard keys.
pub const SHARDS: u64 = 64;
/// Entries a shard keeps at most; past it the least recently used go first.
pub const MAX_PER_SHARD: usize = 4096;

/// What a binding is for; each kind has its own idle timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BindingKind {
    Session,
    Sticky,
}

/// Where a binding applies: model, bucket, stage and the client's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope<'a> {
    pub kind: BindingKind,
    pub model: &'a str,
    pub bucket: &'a str,
    pub stage: Role,
    pub key: &'a str,
}

impl Scope<'_> {
    fn hash(&self) -> u128 {
        let kind = match self.kind {
            BindingKind::Session => "s",
            BindingKind::Sticky => "k",
        };
        stable_hash([kind, self.model, self.bucket, self.stage.as_str(), self.key])
    }

    /// The binding's id in its shard: the hash, so a client's key costs the same few bytes there
    /// whatever its length (spec §3).
    fn id(&self) -> String {
        format!("{:032x}", self.hash())
    }

    fn shard(&self) -> u64 {
        let h = self.hash();
        ((h >> 64) as u64 ^ h as u64) % SHARDS
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Binding {
    worker: String,
    kind: BindingKind,
    model: String,
    last_used_ms: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Shard {
    bindings: HashMap<String, Binding>,
}

impl Shard {
    fn decode(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_else(|_| b"{\"bindings\":{}}".to_vec())
    }

    /// Evicts the least recently used past `max`; returns how many went.
    fn cap(&mut self, max: usize) -> u64 {
        let mut evicted = 0;
        while self.bindings.len() > max {
            let oldest = self.bindings.iter().min_by_key(|(_, b)| b.last_used_ms).map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.bindings.remove(&k),
                None => break,
            };
            evicted += 1;
        }
        evicted
    }
}

/// The outcome of trying to bind a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    /// Our engine is now the binding.
    Ours,
    /// Someone else bound the key first; the caller must check this engine before using it.
    Theirs(String),
}

#[derive(Debug, Clone)]
pub struct AffinityStore {
    host: Arc<dyn Host>,
    max_per_shard: usize,
}

impl AffinityStore {
    pub fn new(host: Arc<dyn Host>) -> Self {
        Self { host, max_per_shard: MAX_PER_SHARD }
    }

    fn read(&self, shard: u64) -> Shard {
        match self.host.shared_get(&keys::affinity_shard(shard)) {
            Ok(Some(v)) => Shard::decode(&v.bytes).unwrap_or_else(|e| {
                log::warn!("affinity shard {shard} does not decode ({e}); its bindings are unusable");
                Shard::default()
            }),
            _ => Shard::default(),
        }
    }

    fn change<R>(&self, shard: u64, f: impl FnMut(&mut Shard) -> R) -> Result<R, HostError> {
        let mut f = f;
        let (result, evicted, repaired) =
            update(self.host.as_ref(), &keys::affinity_shard(shard), &Shard::default().encode(), |bytes| {
                let (mut s, repaired) = match Shard::decode(bytes) {
                    Ok(s) => (s, false),
                    Err(_) => (Shard::default(), true),
                };
                let r = f(&mut s);
                let evicted = s.cap(self.max_per_shard);
                (s.encode(), (r, evicted, repaired))
            })?;
        if repaired {
            log::warn!("affinity shard {shard} did not decode; rewritten empty, the other shards are untouched");
            self.count(keys::AFFINITY_REPAIRS, 1);
        }
        if evicted > 0 {
            self.count(keys::AFFINITY_EVICTIONS, evicted);
        }
        Ok(result)
    }

    fn count(&self, key: &str, n: u64) {
        if let Err(e) = fetch_add(self.host.as_ref(), key, n) {
            log::warn!("{key} not counted: {e}");
        }
    }

    /// Bindings evicted by the per-shard cap, and corrupt shards rewritten, since start.
    pub fn counters(&self) -> (u64, u64) {
        let read = |key| read_u64(self.host.as_ref(), key).ok().flatten().unwrap_or(0);
        (read(keys::AFFINITY_EVICTIONS), read(keys::AFFINITY_REPAIRS))
    }

    /// The engine bound to `scope`, if any. A read only: using a binding refreshes it through
    /// [`Self::touch`].
    pub fn get(&self, scope: &Scope<'_>) -> Option<String> {
        self.read(scope.shard()).bindings.get(&scope.id()).map(|b| b.worker.clone())
    }

    /// Binds `scope` to `worker` unless someone else did first. `replace` names the binding the
    /// caller saw and decided to replace (it was outside its candidates); only that one may be
    /// overwritten, so a concurrent fresh binding still wins.
    pub fn bind(&self, scope: &Scope<'_>, worker: &str, replace: Option<&str>) -> Result<Bound, HostError> {
        let id = scope.id();
        let now = self.host.now_ms();
        let binding =
            Binding { worker: worker.to_string(), kind: scope.kind, model: scope.model.to_string(), last_used_ms: now };
        self.change(scope.shard(), |s| match s.bindings.get(&id) {
            Some(existing) if Some(existing.worker.as_str()) != replace && existing.worker != worker => {
                Bound::Theirs(existing.worker.clone())
            }
            _ => {
                s.bindings.insert(id.clone(), binding.clone());
                Bound::Ours
            }
        })
    }

    /// Marks a binding used. Writes at most once per `resolution_ms`, so a busy session does not
    /// write shared data on every request.
    pub fn touch(&self, scope: &Scope<'_>, resolution_ms: u64) {
        let id = scope.id();
        let now = self.host.now_ms();
        let stale = self
            .read(scope.shard())
            .bindings
            .get(&id)
            .is_some_and(|b| now.saturating_sub(b.last_used_ms) >= resolution_ms);
        if stale {
            let _ = self.change(scope.shard(), |s| {
                if let Some(b) = s.bindings.get_mut(&id) {
                    b.last_used_ms = now;
                }
            });
        }
    }

    /// The service's sweep: drops bindings idle past their kind's timeout for their model, and
    /// bindings to workers that no longer exist. Returns how many went.
    pub fn sweep(&self, idle_ms: &dyn Fn(&str, BindingKind) -> u64, known_worker: &dyn Fn(&str) -> bool) -> usize {
        let now = self.host.now_ms();
        let mut removed = 0;
        for shard in 0..SHARDS {
            let expired =
                self.read(shard).bindings.values().any(|b| {
                    now.saturating_sub(b.last_used_ms) > idle_ms(&b.model, b.kind) || !known_worker(&b.worker)
                });
            if !expired {
                continue;
            }
            removed += self
                .change(shard, |s| {
                    let before = s.bindings.len();
                    s.bindings.retain(|_, b| {
                        now.saturating_sub(b.last_used_ms) <= idle_ms(&b.model, b.kind) && known_worker(&b.worker)
                    });
                    before - s.bindings.len()
                })
                .unwrap_or(0);
        }
        removed
    }

    pub fn len(&self) -> usize {
        (0..SHARDS).map(|s| self.read(s).bindings.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    fn scope(key: &str) -> Scope<'_> {
        Scope { kind: BindingKind::Session, model: "m", bucket: "b", stage: Role::Plain, key }
    }

    #[test]
    fn bindings_are_scoped_by_model_bucket_stage_and_key() {
        let store = AffinityStore::new(Arc::new(MemoryHost::default()));
        store.bind(&scope("s1"), "A", None).unwrap();
        assert_eq!(store.get(&scope("s1")).as_deref(), Some("A"));
        for other in [
            Scope { bucket: "b2", ..scope("s1") },
            Scope { stage: Role::Prefill, ..scope("s1") },
            Scope { model: "m2", ..scope("s1") },
            Scope { kind: BindingKind::Sticky, ..scope("s1") },
            scope("s2"),
        ] {
            assert_eq!(store.get(&other), None, "{other:?}");
        }
    }

    /// A session header's value is the client's to choose: a megabyte key once cost a megabyte in
    /// its shard, decoded and encoded again on every request of every client sharing the shard.
    #[test]
    fn a_key_of_any_length_costs_the_same_few_bytes_in_its_shard() {
        let host = Arc::new(MemoryHost::default());
        let store = AffinityStore::new(host.clone());
        let long = "k".repeat(1 << 20);
        store.bind(&scope(&long), "A", None).unwrap();
        assert_eq!(store.get(&scope(&long)).as_deref(), Some("A"));
        let mut longer = long.clone();
        longer.push('k');
        assert_eq!(store.get(&scope(&longer)), None, "a different key, a different binding");
        let shard = host.shared_get(&keys::affinity_shard(scope(&long).shard())).unwrap().unwrap();
        assert!(shard.bytes.len() < 200, "{} bytes", shard.bytes.len());
    }

    #[test]
    fn the_first_binding_wins_and_later_ones_learn_it() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let vm1 = AffinityStore::new(Arc::clone(&host));
        let vm2 = AffinityStore::new(host);
        assert_eq!(vm1.bind(&scope("s"), "A", None).unwrap(), Bound::Ours);
        assert_eq!(vm2.bind(&scope("s"), "B", None).unwrap(), Bound::Theirs("A".into()));
        assert_eq!(vm2.get(&scope("s")).as_deref(), Some("A"));
    }

    #[test]
    fn only_the_binding_the_caller_saw_can_be_replaced() {
        let store = AffinityStore::new(Arc::new(MemoryHost::default()));
        store.bind(&scope("s"), "A", None).unwrap();
        assert_eq!(store.bind(&scope("s"), "B", Some("Z")).unwrap(), Bound::Theirs("A".into()));
        assert_eq!(store.bind(&scope("s"), "B", Some("A")).unwrap(), Bound::Ours);
        assert_eq!(store.get(&scope("s")).as_deref(), Some("B"));
    }

    #[test]
    fn idle_bindings_and_bindings_to_departed_workers_are_swept() {
        let host = Arc::new(MemoryHost::default());
        let store = AffinityStore::new(host.clone());
        store.bind(&scope("old"), "A", None).unwrap();
        host.advance_ms(500);
        store.bind(&scope("new"), "A", None).unwrap();
        store.bind(&scope("gone"), "X", None).unwrap();
        host.advance_ms(600);
        let removed = store.sweep(&|_, _| 1000, &|w| w != "X");
        assert_eq!(removed, 2);
        assert_eq!(store.get(&scope("old")), None);
        assert_eq!(store.get(&scope("new")).as_deref(), Some("A"));
    }

    #[test]
    fn touching_keeps_a_binding_alive_and_writes_rarely() {
        let host = Arc::new(MemoryHost::default());
        let store = AffinityStore::new(host.clone());
        store.bind(&scope("s"), "A", None).unwrap();
        host.advance_ms(900);
        store.touch(&scope("s"), 100);
        host.advance_ms(900);
        assert_eq!(store.sweep(&|_, _| 1000, &|_| true), 0, "touched 900 ms ago");
        assert_eq!(store.get(&scope("s")).as_deref(), Some("A"));
    }

    #[test]
    fn the_number_of_keys_is_fixed_whatever_the_number_of_sessions() {
        let store = AffinityStore::new(Arc::new(MemoryHost::default()));
        let keys: Vec<String> = (0..2000).map(|i| format!("session-{i}")).collect();
        let shards: std::collections::HashSet<u64> = keys.iter().map(|k| scope(k).shard()).collect();
        assert!(shards.len() as u64 <= SHARDS);
        for k in keys.iter().take(200) {
            store.bind(&scope(k), "A", None).unwrap();
        }
        assert_eq!(store.len(), 200);
    }

    #[test]
    fn a_corrupt_shard_is_counted_and_repaired_and_the_other_shards_keep_their_bindings() {
        let host = Arc::new(MemoryHost::default());
        let store = AffinityStore::new(host.clone());
        let (a, b) = (scope("a"), (0..).map(|i| format!("k{i}")).find(|k| scope(k).shard() != scope("a").shard()));
        let b = b.unwrap();
        store.bind(&a, "A", None).unwrap();
        store.bind(&scope(&b), "B", None).unwrap();
        host.shared_set(&keys::affinity_shard(a.shard()), b"{not json", None).unwrap();
        assert_eq!(store.get(&a), None, "unusable, not misread");
        assert_eq!(store.counters(), (0, 0), "a read repairs nothing");
        store.bind(&a, "C", None).unwrap();
        assert_eq!(store.get(&a).as_deref(), Some("C"), "the shard works again");
        assert_eq!(store.get(&scope(&b)).as_deref(), Some("B"), "the other shard kept its binding");
        assert_eq!(store.counters(), (0, 1));
    }

    #[test]
    fn evictions_past_the_shard_cap_are_counted() {
        let host = Arc::new(MemoryHost::default());
        let store = AffinityStore { max_per_shard: 8, ..AffinityStore::new(host.clone()) };
        let shard = scope("x0").shard();
        let same: Vec<String> = (0..).map(|i| format!("x{i}")).filter(|k| scope(k).shard() == shard).take(11).collect();
        for k in &same {
            host.advance_ms(1);
            store.bind(&scope(k), "A", None).unwrap();
        }
        assert_eq!(store.counters(), (3, 0));
        assert_eq!(store.get(&scope(&same[0])), None, "the least recently used went first");
        assert!(store.get(&scope(same.last().unwrap())).is_some());
    }
}
