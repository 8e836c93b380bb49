//! The precise prefix index: which engine (and data-parallel rank, and medium) holds which block of
//! tokens, as its own KV events say.
//!
//! Keys are the indexer's own, never the engines': a chain over `block_tokens`-token blocks, seeded
//! by the request's namespace (LoRA adapter and cache salt), so a salted request only meets blocks
//! stored with its salt, and engines with different page sizes or hash schemes key alike. Small
//! pages (SGLang's page size 1: one event per token) are accumulated: each engine page remembers
//! the chain state after it, so a child page continues where its parent left off, and the page that
//! completes a block is the one whose removal removes the block's holder. Engine hashes are used
//! only to find those pages again.
//!
//! Memory is bounded by `max_pages` engine pages in all; past it, the oldest pages of the engine
//! rank and medium holding the most go first. What a page costs is measured, not assumed: see `BYTES_PER_PAGE` in
//! `state` and docs/reliability.md.

use std::collections::VecDeque;

// foldhash, seeded per process: a match looks up every block of a prompt.
use hashbrown::HashMap;

use crate::events::{EngineHash, KvEvent, Medium, StoredBlocks};

/// Speculative entries (block, engine) held at most, unless the memory budget says otherwise.
pub const MAX_SPECULATIVE: usize = 1 << 20;

/// The running hash of a chain at a page boundary: the blocks before it, and the tokens of the
/// block being filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chain {
    state: u64,
    filled: u32,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finalizer: every input bit moves every output bit.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv(bytes: &[u8], seed: u64) -> u64 {
    bytes.iter().fold(seed, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

impl Chain {
    /// The start of a chain in a namespace. Length-prefixed parts: no LoRA name and salt can pose
    /// as another pair.
    pub fn root(lora: Option<&str>, salt: Option<&str>) -> Self {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for part in [lora, salt] {
            let part = part.unwrap_or("");
            h = fnv(&(part.len() as u64).to_le_bytes(), h);
            h = fnv(part.as_bytes(), h);
        }
        Chain { state: mix(h), filled: 0 }
    }

    /// The state as a snapshot carries it: (running hash, tokens in the block being filled).
    pub fn parts(self) -> (u64, u32) {
        (self.state, self.filled)
    }

    pub fn from_parts(state: u64, filled: u32) -> Self {
        Chain { state, filled }
    }

    /// Feeds `tokens`; `on_block` gets each key completed on the way.
    pub fn extend(mut self, tokens: &[u32], block_tokens: u32, mut on_block: impl FnMut(u64)) -> Self {
        for t in tokens {
            self.state = mix(self.state ^ (u64::from(*t) | 1 << 40));
            self.filled += 1;
            if self.filled == block_tokens {
                let key = mix(self.state ^ 0x9e37_79b9_7f4a_7c15);
                on_block(key);
                self = Chain { state: key, filled: 0 };
            }
        }
        self
    }
}

/// The keys of every full block of `tokens` in a namespace.
pub fn block_keys(tokens: &[u32], block_tokens: u32, lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
    let mut keys = Vec::with_capacity(tokens.len() / block_tokens.max(1) as usize);
    Chain::root(lora, salt).extend(tokens, block_tokens.max(1), |k| keys.push(k));
    keys
}

/// One engine page as a snapshot carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedPage {
    pub hash: EngineHash,
    pub medium: Medium,
    pub after: Chain,
    pub completes: Vec<u64>,
}

/// A 64-bit hash or key stored in 4-byte halves: beside a `u32` it packs into 12 bytes, not 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Id([u32; 2]);

impl Id {
    fn of(x: u64) -> Self {
        Id([x as u32, (x >> 32) as u32])
    }

    fn wide(self) -> u64 {
        u64::from(self.0[0]) | u64::from(self.0[1]) << 32
    }
}

/// Which blocks a page completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Completes {
    Nothing,
    /// One block, ending the page: its key is the chain state after the page.
    TheState,
    /// Anything else: the keys are kept beside the page (`Pages::listed`).
    Listed,
}

/// One engine page in 12 bytes: the chain state after it, and which blocks it completed. Pages of
/// a block's size complete exactly the block they end, so their key is their chain state and
/// nothing more is kept. `filled` fits: blocks are at most 65,536 tokens.
#[derive(Debug, Clone, Copy)]
struct Page {
    state: Id,
    filled: u16,
    completes: Completes,
}

impl Page {
    fn after(&self) -> Chain {
        Chain::from_parts(self.state.wide(), u32::from(self.filled))
    }
}

/// The pages one engine rank published in one medium, with their arrival order for eviction. A
/// removed page leaves its hash in `order` (finding it there would cost a scan); `order` is
/// compacted whenever it holds twice as many hashes as there are pages, so churn cannot grow it.
#[derive(Debug, Default)]
struct Pages {
    pages: HashMap<Id, Page>,
    /// The keys of pages that completed more than their own block, or a block before their end.
    listed: HashMap<Id, Box<[u64]>>,
    order: VecDeque<Id>,
}

impl Pages {
    fn insert(&mut self, hash: EngineHash, page: Page, keys: &[u64]) -> bool {
        let hash = Id::of(hash);
        if page.completes == Completes::Listed {
            self.listed.insert(hash, keys.into());
        } else {
            self.listed.remove(&hash);
        }
        let added = self.pages.insert(hash, page).is_none();
        if added {
            self.order.push_back(hash);
            if self.order.len() > 2 * self.pages.len() + 64 {
                let pages = &self.pages;
                self.order.retain(|h| pages.contains_key(h));
            }
        }
        added
    }

    /// Removes a page: the keys it completed, if it was there.
    fn remove(&mut self, hash: EngineHash) -> Option<Vec<u64>> {
        let hash = Id::of(hash);
        let page = self.pages.remove(&hash)?;
        Some(match page.completes {
            Completes::Nothing => Vec::new(),
            Completes::TheState => vec![page.state.wide()],
            Completes::Listed => self.listed.remove(&hash).map(Vec::from).unwrap_or_default(),
        })
    }

    fn keys_of(&self, hash: Id, page: &Page) -> Vec<u64> {
        match page.completes {
            Completes::Nothing => Vec::new(),
            Completes::TheState => vec![page.state.wide()],
            Completes::Listed => self.listed.get(&hash).map(|k| k.to_vec()).unwrap_or_default(),
        }
    }
}

/// A page's record, from the chain state after it and the keys it completed.
fn page_of(after: Chain, completes: &[u64]) -> Page {
    let kind = match completes {
        [] => Completes::Nothing,
        [key] if *key == after.state && after.filled == 0 => Completes::TheState,
        _ => Completes::Listed,
    };
    Page { state: Id::of(after.state), filled: after.filled.min(u32::from(u16::MAX)) as u16, completes: kind }
}

/// An engine rank's pages, by medium.
#[derive(Debug, Default)]
struct Source {
    media: [Pages; 4],
}

impl Source {
    fn pages(&self) -> usize {
        self.media.iter().map(|m| m.pages.len()).sum()
    }
}

/// An engine's data-parallel rank, by the index's engine number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct EngineRank {
    engine: u32,
    rank: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Holder {
    engine: u32,
    rank: u32,
    medium: Medium,
}

/// Set on a block's first holder when it has others.
const MORE: u32 = 1 << 31;

/// Which holders (by number, see `Index::holder_id`) hold each block: the first inline, in 16
/// bytes a block, any others beside it.
#[derive(Debug, Default)]
struct Holders {
    first: HashMap<Id, u32>,
    more: HashMap<Id, Vec<u32>>,
}

impl Holders {
    fn add(&mut self, key: u64, holder: u32) {
        let key = Id::of(key);
        let first = self.first.entry(key).or_insert(holder);
        if *first & !MORE == holder {
            return;
        }
        let more = self.more.entry(key).or_default();
        if !more.contains(&holder) {
            more.push(holder);
        }
        *first |= MORE;
    }

    fn remove(&mut self, key: u64, holder: u32) {
        let key = Id::of(key);
        let Some(&first) = self.first.get(&key) else { return };
        if first & MORE == 0 {
            if first == holder {
                self.first.remove(&key);
            }
            return;
        }
        let Some(more) = self.more.get_mut(&key) else { return };
        if first & !MORE == holder {
            // The first goes: another takes its place.
            let Some(next) = more.pop() else { return };
            self.first.insert(key, next | MORE);
        } else {
            more.retain(|h| *h != holder);
        }
        if more.is_empty() {
            self.more.remove(&key);
            if let Some(first) = self.first.get_mut(&key) {
                *first &= !MORE;
            }
        }
    }

    /// Calls `each` with every holder of `key`.
    fn each(&self, key: &u64, mut each: impl FnMut(u32)) {
        let key = Id::of(*key);
        let Some(&first) = self.first.get(&key) else { return };
        each(first & !MORE);
        if first & MORE != 0 {
            self.more.get(&key).into_iter().flatten().for_each(|h| each(*h));
        }
    }

    fn blocks(&self) -> usize {
        self.first.len()
    }
}

/// What one engine holds of a query's prefix, in tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineMatch {
    /// Longest prefix held in any medium, or routed there moments ago (speculative).
    pub matched_tokens: u64,
    /// Longest prefix its own events confirm, in any medium.
    pub confirmed_tokens: u64,
    /// Longest prefix held in each medium.
    pub by_medium: Vec<(Medium, u64)>,
    /// Longest prefix per data-parallel rank (held or routed there), for ranks that match.
    pub ranks: Vec<(u32, u64)>,
}

#[derive(Debug)]
pub struct Index {
    block_tokens: u32,
    max_pages: usize,
    engines: Vec<String>,
    engine_ids: HashMap<String, u32>,
    sources: HashMap<EngineRank, Source>,
    /// Every (engine, rank, medium) that held a block, numbered for `holders`.
    holder_list: Vec<Holder>,
    holder_ids: HashMap<Holder, u32>,
    holders: Holders,
    /// Blocks a router just sent to an engine rank, before the engine's own event: key → (engine
    /// rank, until).
    speculative: HashMap<u64, Vec<(EngineRank, u64)>>,
    /// Every speculative entry as (until, key, engine rank), in the order they expire: one TTL for
    /// all, so arrival order is expiry order and expiring costs what expires, not a scan.
    expiries: VecDeque<(u64, u64, EngineRank)>,
    max_speculative: usize,
    /// Blocks routed to engines that publish no KV events: what routers' notices say is all the
    /// index knows of them, so the entries stay until the least recently routed go, past
    /// `max_routed` entries for the model (as a router's own tree evicts).
    routed: HashMap<u64, Vec<(EngineRank, u64)>>,
    /// Every routed entry as (stamp, key, engine rank), least recently routed first; an entry
    /// routed again leaves a stale one behind, skipped when it comes up.
    routed_order: VecDeque<(u64, u64, EngineRank)>,
    routed_entries: usize,
    routed_stamp: u64,
    max_routed: usize,
    pages: usize,
    /// The keys the page being stored completed (kept to spare an allocation a page).
    scratch: Vec<u64>,
    pub counters: Counters,
}

/// Since start, for `/metrics`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counters {
    pub events: u64,
    pub orphan_pages: u64,
    pub evicted_pages: u64,
    pub speculative_added: u64,
}

impl Counters {
    pub fn add(&mut self, other: &Counters) {
        self.events += other.events;
        self.orphan_pages += other.orphan_pages;
        self.evicted_pages += other.evicted_pages;
        self.speculative_added += other.speculative_added;
    }
}

impl Index {
    pub fn new(block_tokens: u32, max_pages: usize) -> Self {
        Self {
            block_tokens: block_tokens.clamp(1, 1 << 16),
            max_pages: max_pages.max(1),
            engines: Vec::new(),
            engine_ids: HashMap::new(),
            sources: HashMap::new(),
            holder_list: Vec::new(),
            holder_ids: HashMap::new(),
            holders: Holders::default(),
            speculative: HashMap::new(),
            expiries: VecDeque::new(),
            max_speculative: MAX_SPECULATIVE,
            routed: HashMap::new(),
            routed_order: VecDeque::new(),
            routed_entries: 0,
            routed_stamp: 0,
            max_routed: MAX_SPECULATIVE,
            pages: 0,
            scratch: Vec::new(),
            counters: Counters::default(),
        }
    }

    /// Bounds the speculative entries (default [`MAX_SPECULATIVE`]).
    pub fn with_max_speculative(mut self, entries: usize) -> Self {
        self.max_speculative = entries.max(1);
        self
    }

    /// Bounds the entries routed to engines without KV events (default [`MAX_SPECULATIVE`]).
    pub fn with_max_routed(mut self, entries: usize) -> Self {
        self.max_routed = entries.max(1);
        self
    }

    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    fn engine_id(&mut self, engine: &str) -> u32 {
        if let Some(id) = self.engine_ids.get(engine) {
            return *id;
        }
        let id = self.engines.len() as u32;
        self.engines.push(engine.to_string());
        self.engine_ids.insert(engine.to_string(), id);
        id
    }

    /// The number `holders` knows a holder by. Holders are the configured engines' ranks and
    /// media, so there are few; past `MORE` of them (never, in practice) the last number is shared.
    fn holder_id(&mut self, holder: Holder) -> u32 {
        if let Some(id) = self.holder_ids.get(&holder) {
            return *id;
        }
        let id = (self.holder_list.len() as u32).min(MORE - 1);
        self.holder_list.push(holder);
        self.holder_ids.insert(holder, id);
        id
    }

    /// Applies one engine rank's event.
    pub fn apply(&mut self, engine: &str, rank: u32, event: &KvEvent) {
        self.counters.events += 1;
        let e = self.engine_id(engine);
        match event {
            KvEvent::Stored(stored) => self.store(e, rank, stored),
            KvEvent::Removed { block_hashes, medium } => {
                for h in block_hashes {
                    self.remove_page(EngineRank { engine: e, rank }, *medium, *h);
                }
            }
            KvEvent::AllCleared => self.clear(engine, Some(rank)),
        }
    }

    fn store(&mut self, e: u32, rank: u32, stored: &StoredBlocks) {
        let block_tokens = self.block_tokens;
        let at = EngineRank { engine: e, rank };
        let holder = self.holder_id(Holder { engine: e, rank, medium: stored.medium });
        let source = self.sources.entry(at).or_default();
        let mut chain = match stored.parent {
            None => Some(Chain::root(stored.lora.as_deref(), stored.cache_salt.as_deref())),
            Some(parent) => source.media.iter().find_map(|m| m.pages.get(&Id::of(parent))).map(Page::after),
        };
        let pages = &mut source.media[stored.medium as usize];
        let mut added = 0usize;
        let completes = &mut self.scratch;
        for (i, hash) in stored.block_hashes.iter().enumerate() {
            let tokens = stored.token_ids.get(i * stored.block_size..(i + 1) * stored.block_size).unwrap_or_default();
            completes.clear();
            chain = chain.map(|c| c.extend(tokens, block_tokens, |k| completes.push(k)));
            // A page whose parent was never seen (or was evicted) keys nothing, and neither will its
            // children: holding it would only push out pages that do.
            let Some(after) = chain else {
                self.counters.orphan_pages += 1;
                continue;
            };
            for key in completes.iter() {
                self.holders.add(*key, holder);
                // The engine rank's own event confirms what was routed to it.
                if let Some(spec) = self.speculative.get_mut(key) {
                    spec.retain(|(x, _)| *x != at);
                    if spec.is_empty() {
                        self.speculative.remove(key);
                    }
                }
            }
            if pages.insert(*hash, page_of(after, completes), completes) {
                added += 1;
            }
        }
        self.pages += added;
        while self.pages > self.max_pages {
            if !self.evict_one() {
                break;
            }
        }
    }

    /// Drops the oldest page of the engine rank and medium holding the most pages.
    fn evict_one(&mut self) -> bool {
        let fullest = self
            .sources
            .iter()
            .flat_map(|(at, s)| Medium::ALL.iter().map(move |m| ((*at, *m), s.media[*m as usize].pages.len())))
            .max_by_key(|(_, n)| *n);
        let Some(((at, medium), _)) = fullest else { return false };
        let oldest = self.sources.get_mut(&at).and_then(|s| {
            let pages = &mut s.media[medium as usize];
            while let Some(hash) = pages.order.pop_front() {
                if pages.pages.contains_key(&hash) {
                    return Some(hash.wide());
                }
            }
            None
        });
        match oldest {
            Some(hash) => {
                self.counters.evicted_pages += 1;
                self.remove_page(at, medium, hash)
            }
            None => false,
        }
    }

    fn remove_page(&mut self, at: EngineRank, medium: Medium, hash: EngineHash) -> bool {
        let Some(keys) = self.sources.get_mut(&at).and_then(|s| s.media[medium as usize].remove(hash)) else {
            return false;
        };
        self.pages -= 1;
        if let Some(&holder) = self.holder_ids.get(&Holder { engine: at.engine, rank: at.rank, medium }) {
            for key in keys {
                self.holders.remove(key, holder);
            }
        }
        true
    }

    /// Forgets what an engine holds: every rank (`None`: a restart or the engine left), or one
    /// rank (its `AllBlocksCleared`, or its publisher restarted).
    pub fn clear(&mut self, engine: &str, rank: Option<u32>) {
        let Some(&e) = self.engine_ids.get(engine) else { return };
        let ranks: Vec<EngineRank> =
            self.sources.keys().filter(|at| at.engine == e && rank.is_none_or(|r| r == at.rank)).copied().collect();
        for at in ranks {
            let Some(source) = self.sources.remove(&at) else { continue };
            self.pages -= source.pages();
            for (medium, pages) in Medium::ALL.iter().zip(&source.media) {
                let Some(&holder) = self.holder_ids.get(&Holder { engine: at.engine, rank: at.rank, medium: *medium })
                else {
                    continue;
                };
                for (hash, page) in &pages.pages {
                    for key in pages.keys_of(*hash, page) {
                        self.holders.remove(key, holder);
                    }
                }
            }
        }
    }

    /// A router sent these blocks to `engine`: it will hold them as soon as it prefilled, before
    /// its event says so. Held until `until_ms` unless the engine's own event confirms them.
    /// Past its bound on speculative entries the oldest go first, whatever their time.
    pub fn add_speculative(&mut self, engine: &str, rank: u32, keys: &[u64], until_ms: u64) {
        let e = EngineRank { engine: self.engine_id(engine), rank };
        for key in keys {
            let entry = self.speculative.entry(*key).or_default();
            match entry.iter_mut().find(|(x, _)| *x == e) {
                Some(slot) => slot.1 = until_ms,
                None => {
                    entry.push((e, until_ms));
                    self.counters.speculative_added += 1;
                }
            }
            self.expiries.push_back((until_ms, *key, e));
        }
        while self.expiries.len() > self.max_speculative {
            if let Some((until, key, e)) = self.expiries.pop_front() {
                self.drop_speculative(key, e, until);
            }
        }
    }

    /// A router sent these blocks to `engine`, which publishes no KV events: the index holds them
    /// for it until they are the least recently routed past the bound. Routed again, an entry is
    /// the most recent once more.
    pub fn add_routed(&mut self, engine: &str, rank: u32, keys: &[u64]) {
        let e = EngineRank { engine: self.engine_id(engine), rank };
        for key in keys {
            self.routed_stamp += 1;
            let stamp = self.routed_stamp;
            let entry = self.routed.entry(*key).or_default();
            match entry.iter_mut().find(|(x, _)| *x == e) {
                Some(slot) => slot.1 = stamp,
                None => {
                    entry.push((e, stamp));
                    self.routed_entries += 1;
                }
            }
            self.routed_order.push_back((stamp, *key, e));
        }
        while self.routed_entries > self.max_routed {
            let Some((stamp, key, e)) = self.routed_order.pop_front() else { break };
            let Some(entry) = self.routed.get_mut(&key) else { continue };
            let before = entry.len();
            entry.retain(|(x, s)| *x != e || *s != stamp);
            self.routed_entries -= before - entry.len();
            if entry.is_empty() {
                self.routed.remove(&key);
            }
        }
        // Stale entries (routed again since) are dropped once they outnumber the live ones.
        if self.routed_order.len() > 2 * self.routed_entries + 1024 {
            let mut live: Vec<(u64, u64, EngineRank)> =
                self.routed.iter().flat_map(|(key, v)| v.iter().map(move |(e, s)| (*s, *key, *e))).collect();
            live.sort_unstable_by_key(|(s, _, _)| *s);
            self.routed_order = live.into();
        }
    }

    /// Entries routed to engines without KV events.
    pub fn routed_blocks(&self) -> usize {
        self.routed_entries
    }

    /// Drops speculative entries past their time (the indexer runs it on a timer).
    pub fn expire_speculative(&mut self, now_ms: u64) {
        while self.expiries.front().is_some_and(|(until, _, _)| *until <= now_ms) {
            if let Some((until, key, e)) = self.expiries.pop_front() {
                self.drop_speculative(key, e, until);
            }
        }
    }

    /// Drops `key`'s entry for engine `e` unless a later notice renewed it past `until`.
    fn drop_speculative(&mut self, key: u64, e: EngineRank, until: u64) {
        if let Some(entry) = self.speculative.get_mut(&key) {
            entry.retain(|(x, u)| *x != e || *u > until);
            if entry.is_empty() {
                self.speculative.remove(&key);
            }
        }
    }

    /// What every engine holds of the prefix these keys spell, longest first per engine, with
    /// its longest per data-parallel rank (a request is served by one rank, so an engine's match is
    /// its best rank's). Only the engine ranks holding the first block can match at all, so the
    /// walk follows just those, and stops as soon as none of them holds the next block.
    pub fn match_keys(&self, keys: &[u64], now_ms: u64) -> Vec<(String, EngineMatch)> {
        struct Walk {
            at: EngineRank,
            any: bool,
            confirmed: bool,
            media: [bool; 4],
            matched: u64,
            confirmed_tokens: u64,
            per_medium: [u64; 4],
        }
        let block = u64::from(self.block_tokens);
        // Every block's holders go through one buffer.
        let holders_of = |key: &u64, into: &mut Vec<Holder>| {
            into.clear();
            self.holders.each(key, |h| into.extend(self.holder_list.get(h as usize).copied()));
        };
        let mut holders: Vec<Holder> = Vec::new();
        let routed_to = |key: &u64, at: EngineRank| {
            self.speculative.get(key).is_some_and(|s| s.iter().any(|(x, until)| *x == at && *until > now_ms))
                || self.routed.get(key).is_some_and(|r| r.iter().any(|(x, _)| *x == at))
        };
        let Some(first) = keys.first() else { return Vec::new() };
        let mut walks: Vec<Walk> = Vec::new();
        holders_of(first, &mut holders);
        let starters = holders
            .iter()
            .map(|h| EngineRank { engine: h.engine, rank: h.rank })
            .chain(self.speculative.get(first).into_iter().flatten().filter(|(_, u)| *u > now_ms).map(|(at, _)| *at))
            .chain(self.routed.get(first).into_iter().flatten().map(|(at, _)| *at));
        for at in starters {
            if !walks.iter().any(|w| w.at == at) {
                walks.push(Walk {
                    at,
                    any: true,
                    confirmed: true,
                    media: [true; 4],
                    matched: 0,
                    confirmed_tokens: 0,
                    per_medium: [0; 4],
                });
            }
        }
        for key in keys {
            holders_of(key, &mut holders);
            let mut still = false;
            for w in walks.iter_mut().filter(|w| w.any) {
                let mut held = [false; 4];
                let mut any_held = false;
                for h in holders.iter().filter(|h| h.engine == w.at.engine && h.rank == w.at.rank) {
                    held[h.medium as usize] = true;
                    any_held = true;
                }
                w.confirmed &= any_held;
                if w.confirmed {
                    w.confirmed_tokens += block;
                }
                w.any = any_held || routed_to(key, w.at);
                if w.any {
                    w.matched += block;
                    still = true;
                }
                for (i, alive) in w.media.iter_mut().enumerate() {
                    *alive &= held[i];
                    if *alive {
                        w.per_medium[i] += block;
                    }
                }
            }
            if !still {
                break;
            }
        }
        let mut by_engine: Vec<(u32, EngineMatch)> = Vec::new();
        for w in walks.into_iter().filter(|w| w.matched > 0) {
            let i = match by_engine.iter().position(|(e, _)| *e == w.at.engine) {
                Some(i) => i,
                None => {
                    let fresh = EngineMatch {
                        by_medium: Medium::ALL.iter().map(|m| (*m, 0)).collect(),
                        ..EngineMatch::default()
                    };
                    by_engine.push((w.at.engine, fresh));
                    by_engine.len() - 1
                }
            };
            let m = &mut by_engine[i].1;
            m.matched_tokens = m.matched_tokens.max(w.matched);
            m.confirmed_tokens = m.confirmed_tokens.max(w.confirmed_tokens);
            for ((_, tokens), walked) in m.by_medium.iter_mut().zip(w.per_medium) {
                *tokens = (*tokens).max(walked);
            }
            m.ranks.push((w.at.rank, w.matched));
        }
        let mut result: Vec<(String, EngineMatch)> = by_engine
            .into_iter()
            .map(|(e, mut m)| {
                m.ranks.sort_unstable();
                (self.engines[e as usize].clone(), m)
            })
            .collect();
        result.sort_by(|a, b| b.1.matched_tokens.cmp(&a.1.matched_tokens).then_with(|| a.0.cmp(&b.0)));
        result
    }

    /// Every engine rank's pages, oldest first in each medium: (engine, rank, pages as (engine
    /// hash, medium, chain after, keys completed)). What a peer's snapshot carries.
    pub fn export(&self) -> Vec<(String, u32, Vec<ExportedPage>)> {
        let mut out = Vec::new();
        for (at, source) in &self.sources {
            let mut exported = Vec::new();
            for (medium, pages) in Medium::ALL.iter().zip(&source.media) {
                let mut seen = std::collections::HashSet::new();
                for hash in pages.order.iter().filter(|h| seen.insert(**h)) {
                    let Some(page) = pages.pages.get(hash) else { continue };
                    exported.push(ExportedPage {
                        hash: hash.wide(),
                        medium: *medium,
                        after: page.after(),
                        completes: pages.keys_of(*hash, page),
                    });
                }
            }
            out.push((self.engines[at.engine as usize].clone(), at.rank, exported));
        }
        out
    }

    /// Adds one page a peer's snapshot brought, as if its event had arrived.
    pub fn import(&mut self, engine: &str, rank: u32, page: ExportedPage) {
        let e = self.engine_id(engine);
        let holder = self.holder_id(Holder { engine: e, rank, medium: page.medium });
        for key in &page.completes {
            self.holders.add(*key, holder);
        }
        let source = self.sources.entry(EngineRank { engine: e, rank }).or_default();
        let record = page_of(page.after, &page.completes);
        if source.media[page.medium as usize].insert(page.hash, record, &page.completes) {
            self.pages += 1;
        }
        while self.pages > self.max_pages {
            if !self.evict_one() {
                break;
            }
        }
    }

    /// Engine pages held per engine (every rank and medium), for the blocks-per-engine gauge.
    pub fn pages_per_engine(&self) -> Vec<(String, usize)> {
        let mut counts = vec![0usize; self.engines.len()];
        for (at, s) in &self.sources {
            counts[at.engine as usize] += s.pages();
        }
        self.engines.iter().cloned().zip(counts).collect()
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn distinct_blocks(&self) -> usize {
        self.holders.blocks()
    }

    pub fn speculative_blocks(&self) -> usize {
        self.speculative.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: usize) -> KvEvent {
        KvEvent::Stored(StoredBlocks {
            block_hashes: hashes.to_vec(),
            parent,
            token_ids: tokens.to_vec(),
            block_size,
            lora: None,
            medium: Medium::Gpu,
            cache_salt: None,
        })
    }

    fn tokens(n: u32) -> Vec<u32> {
        (100..100 + n).collect()
    }

    fn matched(index: &Index, query: &[u32]) -> Vec<(String, u64)> {
        let keys = block_keys(query, index.block_tokens(), None, None);
        index.match_keys(&keys, 0).into_iter().map(|(e, m)| (e, m.matched_tokens)).collect()
    }

    /// A request is served by one rank: an engine's match is its best rank's, and each rank's is
    /// told apart, speculative entries included.
    #[test]
    fn each_data_parallel_rank_matches_on_its_own() {
        let mut index = Index::new(4, 1000);
        let t = tokens(16);
        index.apply("A", 0, &stored(&[1], None, &t[..4], 4));
        index.apply("A", 1, &stored(&[1, 2, 3], None, &t[..12], 4));
        let keys = block_keys(&t, 4, None, None);
        let m = &index.match_keys(&keys, 0)[0].1;
        assert_eq!((m.matched_tokens, m.ranks.clone()), (12, vec![(0, 4), (1, 12)]));
        index.add_speculative("A", 0, &keys, 100);
        let m = &index.match_keys(&keys, 0)[0].1;
        assert_eq!(m.ranks, [(0, 16), (1, 12)], "routed to rank 0 moments ago");
        assert_eq!(m.confirmed_tokens, 12, "rank 1's own events confirm its 12");
    }

    /// A block's first holder is kept inline and the others beside it: removing any of them,
    /// the first included, leaves the rest holding it.
    #[test]
    fn a_block_held_by_several_engines_loses_only_the_holder_removed() {
        let mut index = Index::new(4, 1000);
        let t = tokens(8);
        for engine in ["A", "B", "C"] {
            index.apply(engine, 0, &stored(&[1, 2], None, &t, 4));
        }
        let engines = |index: &Index| matched(index, &t).into_iter().map(|(e, _)| e).collect::<Vec<_>>();
        assert_eq!(engines(&index), ["A", "B", "C"]);
        index.apply("A", 0, &KvEvent::Removed { block_hashes: vec![1], medium: Medium::Gpu });
        assert_eq!(engines(&index), ["B", "C"], "the first holder went; the others stay");
        index.apply("C", 0, &KvEvent::Removed { block_hashes: vec![1], medium: Medium::Gpu });
        assert_eq!(engines(&index), ["B"]);
        index.apply("B", 0, &KvEvent::AllCleared);
        assert!(engines(&index).is_empty());
        index.apply("A", 0, &KvEvent::AllCleared);
        index.apply("C", 0, &KvEvent::AllCleared);
        assert_eq!((index.pages(), index.distinct_blocks()), (0, 0));
        assert!(index.holders.more.is_empty());
    }

    /// Pages that complete more than their own block (a page of 24 tokens over blocks of 16)
    /// keep their keys beside them, and removing one removes exactly those.
    #[test]
    fn pages_completing_several_blocks_remove_all_of_them() {
        let mut index = Index::new(4, 1000);
        let t = tokens(24);
        index.apply("A", 0, &stored(&[1, 2], None, &t[..12], 6));
        index.apply("A", 0, &stored(&[3, 4], Some(2), &t[12..], 6));
        assert_eq!(matched(&index, &t), [("A".to_string(), 24)]);
        index.apply("A", 0, &KvEvent::Removed { block_hashes: vec![3], medium: Medium::Gpu });
        assert_eq!(matched(&index, &t), [("A".to_string(), 12)], "page 3 completed the block of tokens 12 to 16");
        let exported = index.export();
        let mut copy = Index::new(4, 1000);
        for (engine, rank, pages) in exported {
            for page in pages {
                copy.import(&engine, rank, page);
            }
        }
        assert_eq!(matched(&copy, &t), [("A".to_string(), 12)], "a snapshot carries listed keys");
        assert_eq!(copy.pages(), 3);
    }

    #[test]
    fn pages_of_one_token_accumulate_into_blocks() {
        let mut index = Index::new(4, 1000);
        let t = tokens(10);
        // SGLang with page size 1: one event per token, each the child of the previous.
        for (i, tok) in t.iter().enumerate() {
            let parent = (i > 0).then_some(i as u64);
            index.apply("B", 0, &stored(&[i as u64 + 1], parent, &[*tok], 1));
        }
        assert_eq!(matched(&index, &t), [("B".to_string(), 8)], "two full blocks of 4; the 2 left over do not count");
        assert_eq!(matched(&index, &tokens(6)), [("B".to_string(), 4)]);
        let mut other = t.clone();
        other[1] = 7;
        assert!(matched(&index, &other).is_empty(), "a different first block matches nothing");
    }

    #[test]
    fn engines_with_different_page_sizes_key_alike() {
        let mut index = Index::new(4, 1000);
        let t = tokens(16);
        index.apply("A", 0, &stored(&[1, 2], None, &t, 8));
        index.apply("B", 0, &stored(&[1, 2, 3, 4, 5, 6, 7, 8], None, &t, 2));
        assert_eq!(matched(&index, &t), [("A".to_string(), 16), ("B".to_string(), 16)]);
    }

    #[test]
    fn removing_the_page_that_completed_a_block_removes_that_block_and_what_follows() {
        let mut index = Index::new(4, 1000);
        let t = tokens(12);
        index.apply("B", 0, &stored(&[1, 2, 3], None, &t, 4));
        index.apply("B", 0, &KvEvent::Removed { block_hashes: vec![3], medium: Medium::Gpu });
        assert_eq!(matched(&index, &t), [("B".to_string(), 8)]);
        index.apply("B", 0, &KvEvent::Removed { block_hashes: vec![1], medium: Medium::Gpu });
        assert!(matched(&index, &t).is_empty(), "the first block is gone, so no prefix is held");
        assert_eq!(index.pages(), 1);
        index.apply("B", 0, &KvEvent::AllCleared);
        assert_eq!((index.pages(), index.distinct_blocks()), (0, 0));
    }

    #[test]
    fn salt_and_lora_namespace_the_keys() {
        let mut index = Index::new(4, 1000);
        let t = tokens(8);
        let mut salted = StoredBlocks {
            block_hashes: vec![1, 2],
            parent: None,
            token_ids: t.clone(),
            block_size: 4,
            lora: None,
            medium: Medium::Gpu,
            cache_salt: Some("tenant-a".into()),
        };
        index.apply("A", 0, &KvEvent::Stored(salted.clone()));
        salted.cache_salt = None;
        salted.lora = Some("sql".into());
        index.apply("L", 0, &KvEvent::Stored(salted));
        assert!(matched(&index, &t).is_empty(), "an unsalted, adapter-less request matches neither");
        let keys = block_keys(&t, 4, None, Some("tenant-a"));
        assert_eq!(index.match_keys(&keys, 0)[0].0, "A");
        let keys = block_keys(&t, 4, Some("sql"), None);
        assert_eq!(index.match_keys(&keys, 0)[0].0, "L");
        assert!(index.match_keys(&block_keys(&t, 4, None, Some("tenant-b")), 0).is_empty());
    }

    #[test]
    fn media_and_ranks_are_held_apart() {
        let mut index = Index::new(4, 1000);
        let t = tokens(8);
        index.apply("A", 0, &stored(&[1, 2], None, &t, 4));
        let mut cpu = StoredBlocks {
            block_hashes: vec![1, 2],
            parent: None,
            token_ids: t.clone(),
            block_size: 4,
            lora: None,
            medium: Medium::CpuPinned,
            cache_salt: None,
        };
        index.apply("B", 1, &KvEvent::Stored(cpu.clone()));
        let m = index.match_keys(&block_keys(&t, 4, None, None), 0);
        let b = &m.iter().find(|(e, _)| e == "B").unwrap().1;
        assert!(b.by_medium.contains(&(Medium::CpuPinned, 8)) && b.by_medium.contains(&(Medium::Gpu, 0)));
        // GPU eviction of A's copy leaves B's CPU copy.
        index.apply("A", 0, &KvEvent::Removed { block_hashes: vec![1], medium: Medium::Gpu });
        assert_eq!(matched(&index, &t), [("B".to_string(), 8)]);
        cpu.medium = Medium::Gpu;
        index.apply("B", 0, &KvEvent::Stored(cpu));
        index.clear("B", Some(1));
        assert_eq!(matched(&index, &t), [("B".to_string(), 8)], "rank 0's copy stays when rank 1 clears");
    }

    /// Orphans once took their place in the page budget: under pressure, the pages of prompts
    /// whose prefix had been evicted pushed out the pages that still keyed something.
    #[test]
    fn a_page_whose_parent_was_never_seen_is_counted_and_not_kept() {
        let mut index = Index::new(2, 1000);
        index.apply("A", 0, &stored(&[5, 6], Some(999), &[1, 2, 3, 4], 2));
        assert_eq!((index.pages(), index.distinct_blocks(), index.counters.orphan_pages), (0, 0, 2));
        index.apply("A", 0, &stored(&[7], Some(6), &[5, 6], 2));
        assert_eq!((index.pages(), index.counters.orphan_pages), (0, 3), "its children are orphans too");
        index.apply("A", 0, &KvEvent::Removed { block_hashes: vec![5], medium: Medium::Gpu });
        assert_eq!(index.pages(), 0, "removing what was never kept is nothing");
    }

    #[test]
    fn memory_stays_within_its_page_budget() {
        let mut index = Index::new(4, 64);
        for engine in ["A", "B"] {
            for i in 0..100u32 {
                let t: Vec<u32> = (i * 4..i * 4 + 4).collect();
                index.apply(engine, 0, &stored(&[u64::from(i)], None, &t, 4));
            }
        }
        assert!(index.pages() <= 64);
        assert!(index.counters.evicted_pages >= 136);
        let recent: Vec<u32> = (396..400).collect();
        assert_eq!(matched(&index, &recent).len(), 2, "the newest pages survive");
    }

    #[test]
    fn routed_entries_stay_past_any_ttl_and_the_least_recently_routed_go_first() {
        let mut index = Index::new(4, 100).with_max_routed(6);
        index.add_routed("A", 0, &[1, 2, 3]);
        index.add_routed("B", 0, &[1, 2, 3]);
        let far = u64::MAX / 2;
        assert_eq!(
            index.match_keys(&[1, 2, 3], far).iter().map(|(e, m)| (e.as_str(), m.matched_tokens)).collect::<Vec<_>>(),
            [("A", 12), ("B", 12)]
        );
        assert_eq!(index.match_keys(&[1, 2, 3], far)[0].1.confirmed_tokens, 0, "routed, not confirmed");
        index.add_routed("A", 0, &[1, 2, 3]); // A's entries are the most recent now
        index.add_routed("C", 0, &[7]);
        assert_eq!(index.routed_blocks(), 6);
        let matched: Vec<String> = index.match_keys(&[1, 2, 3], far).into_iter().map(|(e, _)| e).collect();
        assert_eq!(matched, ["A"], "B's first block, the least recently routed, went first: B matches nothing");
        for i in 0..5_000 {
            index.add_routed("A", 0, &[100 + i % 3]);
        }
        assert!(index.routed_order.len() <= 2 * index.routed_entries + 1024 + 1, "stale entries are compacted");
        assert_eq!(index.routed_blocks(), 6);
    }

    #[test]
    fn speculative_entries_expire_in_order_renewals_survive_and_the_total_is_capped() {
        let mut index = Index::new(4, 1000);
        index.add_speculative("B", 0, &[1, 2, 3], 100);
        index.add_speculative("B", 0, &[2], 300);
        index.expire_speculative(100);
        assert_eq!(index.speculative_blocks(), 1, "the renewed block stays");
        index.expire_speculative(300);
        assert_eq!((index.speculative_blocks(), index.expiries.len()), (0, 0));
        let keys: Vec<u64> = (0..MAX_SPECULATIVE as u64 + 10).collect();
        index.add_speculative("B", 0, &keys, 1_000);
        assert_eq!((index.speculative_blocks(), index.expiries.len()), (MAX_SPECULATIVE, MAX_SPECULATIVE));
    }

    /// Stored and removed pages once left their ids in the eviction order for good: on a
    /// page-size-1 engine, one id per token ever stored.
    #[test]
    fn churn_does_not_grow_the_eviction_order() {
        let mut index = Index::new(4, 1 << 20);
        for i in 0..100_000u64 {
            index.apply("A", 0, &stored(&[i], None, &[i as u32], 1));
            if i >= 10 {
                index.apply("A", 0, &KvEvent::Removed { block_hashes: vec![i - 10], medium: Medium::Gpu });
            }
        }
        let pages = &index.sources[&EngineRank { engine: 0, rank: 0 }].media[Medium::Gpu as usize];
        assert_eq!(pages.pages.len(), 10);
        assert!(pages.order.len() <= 2 * 10 + 65, "{} ids in the order", pages.order.len());
    }

    #[test]
    fn speculative_entries_count_until_confirmed_or_expired() {
        let mut index = Index::new(4, 1000);
        let t = tokens(8);
        let keys = block_keys(&t, 4, None, None);
        index.add_speculative("B", 0, &keys, 2_000);
        let m = index.match_keys(&keys, 1_000);
        assert_eq!((m[0].0.as_str(), m[0].1.matched_tokens, m[0].1.confirmed_tokens), ("B", 8, 0));
        assert!(index.match_keys(&keys, 2_000).is_empty(), "expired");
        index.apply("B", 0, &stored(&[1, 2], None, &t, 4));
        assert_eq!(index.speculative_blocks(), 0, "the engine's event confirmed them");
        let m = index.match_keys(&keys, 0);
        assert_eq!((m[0].1.matched_tokens, m[0].1.confirmed_tokens), (8, 8));
    }
}
