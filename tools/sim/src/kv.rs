//! The engine's KV prefix cache: the prompt's tokens (the model's tokenizer with `--tokenizer`, else
//! 4-byte chunks as the router's estimator counts) grouped in pages (`--page-size`, SGLang's 1 with
//! a tokenizer, else 16), each keyed by the hash of everything before it — a radix tree over tokens
//! with fixed-size edges, as paged engines keep it. A request reuses the leading pages present;
//! over capacity, least recently used pages go. What was stored and evicted is reported, so the
//! engine can publish it as KV events.

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

/// Hashes of each full page, each chained to the ones before it.
fn block_hashes(tokens: &[u64], page: usize) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(page)
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
    page: usize,
    inner: Mutex<Inner>,
}

/// A page the cache stored for the first time: its hash, its parent's, and its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPage {
    pub hash: u64,
    pub parent: Option<u64>,
    pub tokens: Vec<u64>,
}

/// What one request did to the cache.
#[derive(Debug, Default)]
pub struct Served {
    pub cached_tokens: u64,
    pub stored: Vec<StoredPage>,
    pub evicted: Vec<u64>,
}

impl PrefixCache {
    pub fn new(capacity_tokens: u64, page_tokens: u64) -> Self {
        let page = page_tokens.max(1);
        Self {
            capacity_blocks: (capacity_tokens / page).max(1),
            page: page as usize,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn page_tokens(&self) -> u64 {
        self.page as u64
    }

    /// How many leading tokens of `tokens` are cached now, recording nothing.
    pub fn cached_tokens(&self, tokens: &[u64]) -> u64 {
        let hashes = block_hashes(tokens, self.page);
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let hit_blocks = hashes.iter().take_while(|h| inner.blocks.contains_key(h)).count() as u64;
        (hit_blocks * self.page as u64).min(tokens.len() as u64)
    }

    /// How many leading tokens of `tokens` are cached; then records all of its pages as used.
    pub fn serve(&self, tokens: &[u64]) -> Served {
        let hashes = block_hashes(tokens, self.page);
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let hit_blocks = hashes.iter().take_while(|h| inner.blocks.contains_key(h)).count() as u64;
        let mut served = Served::default();
        for (i, h) in hashes.iter().enumerate() {
            inner.clock += 1;
            let now = inner.clock;
            match inner.blocks.insert(*h, now) {
                Some(old) => {
                    inner.by_age.remove(&old);
                }
                None => served.stored.push(StoredPage {
                    hash: *h,
                    parent: i.checked_sub(1).map(|p| hashes[p]),
                    tokens: tokens[i * self.page..(i + 1) * self.page].to_vec(),
                }),
            }
            inner.by_age.insert(now, *h);
        }
        while inner.blocks.len() as u64 > self.capacity_blocks {
            let Some((&age, &h)) = inner.by_age.iter().next() else { break };
            inner.by_age.remove(&age);
            inner.blocks.remove(&h);
            served.evicted.push(h);
        }
        let cached = (hit_blocks * self.page as u64).min(tokens.len() as u64);
        inner.prompt_tokens += tokens.len() as u64;
        inner.cached_tokens += cached;
        served.cached_tokens = cached;
        served
    }

    /// Drops everything (a cache flush).
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.blocks.clear();
        inner.by_age.clear();
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
        let cache = PrefixCache::new(10_000, BLOCK_TOKENS);
        let system = "s".repeat(64 * 4); // 64 tokens = 4 blocks
        assert_eq!(cache.serve(&tokenize(&format!("{system} first question"))).cached_tokens, 0);
        assert_eq!(cache.serve(&tokenize(&format!("{system} second question"))).cached_tokens, 64);
        assert_eq!(cache.hit_rate().0, 64);
    }

    #[test]
    fn least_recently_used_blocks_are_evicted_over_capacity() {
        let cache = PrefixCache::new(64, BLOCK_TOKENS);
        let a = tokenize(&"a".repeat(256));
        let b = tokenize(&"b".repeat(256));
        cache.serve(&a);
        let served = cache.serve(&b);
        assert_eq!(served.evicted.len(), 4, "b's pages pushed a's out");
        assert_eq!(cache.serve(&a).cached_tokens, 0, "a was evicted by b");
        assert!(cache.cached_blocks() <= 4);
    }

    #[test]
    fn new_pages_are_reported_once_with_their_parents() {
        let cache = PrefixCache::new(1_000, 1);
        let first = cache.serve(&[7, 8, 9]);
        assert_eq!(first.stored.len(), 3);
        assert_eq!((first.stored[0].parent, first.stored[1].parent), (None, Some(first.stored[0].hash)));
        let second = cache.serve(&[7, 8, 5]);
        assert_eq!((second.cached_tokens, second.stored.len()), (2, 1), "only the new page is stored");
        assert_eq!(second.stored[0].parent, Some(first.stored[1].hash));
    }
}
