//! The engine's KV prefix cache: the prompt is tokenized deterministically (4-byte chunks, as the
//! router's estimator counts), grouped in blocks of 16 tokens, and each block is keyed by the hash
//! of everything before it — a radix tree over tokens with fixed-size edges, as paged engines keep
//! it. A request reuses the leading blocks present; over capacity, least recently used blocks go.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

pub const BYTES_PER_TOKEN: usize = 4;
pub const BLOCK_TOKENS: u64 = 16;

/// Token ids of a prompt: one per 4 bytes.
pub fn tokenize(text: &str) -> Vec<u64> {
    text.as_bytes()
        .chunks(BYTES_PER_TOKEN)
        .map(|c| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            c.hash(&mut h);
            h.finish()
        })
        .collect()
}

/// Hashes of each full block, each chained to the ones before it.
fn block_hashes(tokens: &[u64]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(BLOCK_TOKENS as usize)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

#[derive(Default)]
struct Inner {
    /// block hash → last use
    blocks: HashMap<u64, u64>,
    /// last use → block hash (for eviction)
    by_age: BTreeMap<u64, u64>,
    clock: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

pub struct PrefixCache {
    capacity_blocks: u64,
    inner: Mutex<Inner>,
}

impl PrefixCache {
    pub fn new(capacity_tokens: u64) -> Self {
        Self { capacity_blocks: (capacity_tokens / BLOCK_TOKENS).max(1), inner: Mutex::new(Inner::default()) }
    }

    /// How many leading tokens of `tokens` are cached; then records all of its blocks as used.
    pub fn serve(&self, tokens: &[u64]) -> u64 {
        let hashes = block_hashes(tokens);
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let hit_blocks = hashes.iter().take_while(|h| inner.blocks.contains_key(h)).count() as u64;
        for h in &hashes {
            inner.clock += 1;
            let now = inner.clock;
            if let Some(old) = inner.blocks.insert(*h, now) {
                inner.by_age.remove(&old);
            }
            inner.by_age.insert(now, *h);
        }
        while inner.blocks.len() as u64 > self.capacity_blocks {
            let Some((&age, &h)) = inner.by_age.iter().next() else { break };
            inner.by_age.remove(&age);
            inner.blocks.remove(&h);
        }
        let cached = hit_blocks * BLOCK_TOKENS;
        inner.prompt_tokens += tokens.len() as u64;
        inner.cached_tokens += cached.min(tokens.len() as u64);
        cached.min(tokens.len() as u64)
    }

    /// Cached / prompt tokens over the engine's life.
    pub fn hit_rate(&self) -> (u64, u64) {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (inner.cached_tokens, inner.prompt_tokens)
    }

    pub fn cached_blocks(&self) -> u64 {
        self.inner.lock().map(|i| i.blocks.len() as u64).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_reused_in_whole_blocks() {
        let cache = PrefixCache::new(10_000);
        let system = "s".repeat(64 * 4); // 64 tokens = 4 blocks
        assert_eq!(cache.serve(&tokenize(&format!("{system} first question"))), 0);
        assert_eq!(cache.serve(&tokenize(&format!("{system} second question"))), 64);
        assert_eq!(cache.hit_rate().0, 64);
    }

    #[test]
    fn least_recently_used_blocks_are_evicted_over_capacity() {
        let cache = PrefixCache::new(64);
        let a = tokenize(&"a".repeat(256));
        let b = tokenize(&"b".repeat(256));
        cache.serve(&a);
        cache.serve(&b);
        assert_eq!(cache.serve(&a), 0, "a was evicted by b");
        assert!(cache.cached_blocks() <= 4);
    }
}
