//! A radix tree over prompt bytes. Each node records which engines hold the prefix ending there
//! (and in which storage tier). Owners of a node are a subset of its parent's, because holding a
//! prefix means holding all of its prefixes. Size is the bytes of all edges; over budget, the least
//! recently inserted leaves go first.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::events::{Held, Tier};

const ROOT: u32 = 0;

/// A node's few children or owners as a sorted vector: a `BTreeMap` allocates a node of eleven
/// slots for one entry, and a tree has a map of each per node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
struct VecMap<K, V>(Vec<(K, V)>);

impl<K: Ord + Copy, V: Copy> VecMap<K, V> {
    fn new() -> Self {
        Self(Vec::new())
    }

    fn get(&self, key: &K) -> Option<&V> {
        self.0.binary_search_by(|(k, _)| k.cmp(key)).ok().map(|i| &self.0[i].1)
    }

    fn insert(&mut self, key: K, value: V) {
        match self.0.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => self.0[i].1 = value,
            Err(i) => self.0.insert(i, (key, value)),
        }
    }

    fn remove(&mut self, key: &K) {
        if let Ok(i) = self.0.binary_search_by(|(k, _)| k.cmp(key)) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }

    fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// Empties the map and gives its memory back.
    fn clear(&mut self) {
        self.0 = Vec::new();
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Node {
    #[serde(with = "serde_bytes")]
    edge: Vec<u8>,
    parent: u32,
    children: VecMap<u8, u32>,
    owners: VecMap<u16, Held>,
    /// The event sequence of the last insert through this node.
    last_seq: u64,
    /// Bytes from the root to the end of this node's edge.
    depth: u64,
    live: bool,
}

impl Node {
    fn new(edge: Vec<u8>, parent: u32, depth: u64, last_seq: u64) -> Self {
        Self { edge, parent, children: VecMap::new(), owners: VecMap::new(), last_seq, depth, live: true }
    }
}

/// How much of a prompt one engine holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixMatch {
    pub worker: String,
    pub matched_bytes: u64,
    pub tier: Tier,
    /// [`Held::sent_ms`] of the deepest part matched.
    pub sent_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RadixTree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    workers: Vec<String>,
    budget_bytes: u64,
    size_bytes: u64,
    /// Leaves by recency, oldest first; rebuilt after decoding.
    #[serde(skip)]
    leaves: BTreeSet<(u64, u32)>,
}

impl PartialEq for RadixTree {
    fn eq(&self, other: &Self) -> bool {
        self.nodes == other.nodes && self.workers == other.workers && self.size_bytes == other.size_bytes
    }
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixTree {
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            nodes: vec![Node::new(Vec::new(), ROOT, 0, 0)],
            free: Vec::new(),
            workers: Vec::new(),
            budget_bytes,
            size_bytes: 0,
            leaves: BTreeSet::new(),
        }
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Live nodes other than the root.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().skip(1).filter(|n| n.live).count()
    }

    /// Restores what decoding skipped.
    pub fn rebuild_index(&mut self) {
        self.leaves = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| n.live && n.children.is_empty())
            .map(|(i, n)| (n.last_seq, i as u32))
            .collect();
    }

    fn worker_index(&mut self, worker: &str) -> u16 {
        match self.workers.iter().position(|w| w == worker) {
            Some(i) => i as u16,
            None => {
                self.workers.push(worker.to_string());
                (self.workers.len() - 1) as u16
            }
        }
    }

    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn set_recency(&mut self, id: u32, seq: u64) {
        let (old, is_leaf) = {
            let n = self.node(id);
            (n.last_seq, n.children.is_empty())
        };
        if is_leaf && id != ROOT {
            self.leaves.remove(&(old, id));
            self.leaves.insert((seq, id));
        }
        self.node_mut(id).last_seq = seq;
    }

    /// Splits `id`'s edge after `at` bytes; the new upper node takes the child's place.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let (parent, upper_edge, lower_edge, owners, last_seq, depth) = {
            let n = self.node(id);
            let lower = n.edge.len() - at;
            (
                n.parent,
                n.edge[..at].to_vec(),
                n.edge[at..].to_vec(),
                n.owners.clone(),
                n.last_seq,
                n.depth - lower as u64,
            )
        };
        let first = upper_edge[0];
        let lower_first = lower_edge[0];
        let mut upper = Node::new(upper_edge, parent, depth, last_seq);
        upper.owners = owners;
        upper.children.insert(lower_first, id);
        let upper_id = self.alloc(upper);
        self.node_mut(parent).children.insert(first, upper_id);
        let n = self.node_mut(id);
        n.edge = lower_edge;
        n.parent = upper_id;
        upper_id
    }

    /// Records that `worker` holds `text` (and so all of its prefixes). A part it held already
    /// keeps the time it was first sent.
    pub fn insert(&mut self, text: &[u8], worker: &str, held: impl Into<Held>, seq: u64) {
        let held = held.into();
        let w = self.worker_index(worker);
        let (mut cur, mut pos) = (ROOT, 0usize);
        while pos < text.len() {
            let next = self.node(cur).children.get(&text[pos]).copied();
            match next {
                None => {
                    let depth = self.node(cur).depth + (text.len() - pos) as u64;
                    let mut leaf = Node::new(text[pos..].to_vec(), cur, depth, seq);
                    leaf.owners.insert(w, held);
                    if cur != ROOT && self.node(cur).children.is_empty() {
                        let last = self.node(cur).last_seq;
                        self.leaves.remove(&(last, cur));
                    }
                    let id = self.alloc(leaf);
                    self.node_mut(cur).children.insert(text[pos], id);
                    self.leaves.insert((seq, id));
                    self.size_bytes += (text.len() - pos) as u64;
                    break;
                }
                Some(child) => {
                    let common = common_prefix(&self.node(child).edge, &text[pos..]);
                    let node = if common < self.node(child).edge.len() { self.split(child, common) } else { child };
                    let owners = &mut self.node_mut(node).owners;
                    let sent_ms = owners.get(&w).map_or(held.sent_ms, |h| h.sent_ms.min(held.sent_ms));
                    owners.insert(w, Held { sent_ms, ..held });
                    self.set_recency(node, seq);
                    pos += common;
                    cur = node;
                }
            }
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.size_bytes > self.budget_bytes {
            let Some(&(seq, id)) = self.leaves.iter().next() else { break };
            self.leaves.remove(&(seq, id));
            self.remove_leaf(id);
        }
    }

    fn remove_leaf(&mut self, id: u32) {
        let (parent, first, len) = {
            let n = self.node(id);
            (n.parent, n.edge[0], n.edge.len() as u64)
        };
        self.size_bytes -= len;
        let n = self.node_mut(id);
        n.live = false;
        // A freed slot keeps nothing: its edge counted against the budget until now.
        n.edge = Vec::new();
        n.children.clear();
        n.owners.clear();
        self.free.push(id);
        self.node_mut(parent).children.remove(&first);
        if parent != ROOT && self.node(parent).children.is_empty() {
            let last = self.node(parent).last_seq;
            self.leaves.insert((last, parent));
        }
    }

    /// Removes `id` and everything below it.
    fn remove_subtree(&mut self, id: u32) {
        let children: Vec<u32> = self.node(id).children.values().copied().collect();
        for c in children {
            self.remove_subtree(c);
        }
        let last = self.node(id).last_seq;
        self.leaves.remove(&(last, id));
        self.remove_leaf(id);
    }

    /// Drops `worker` from `id` and its descendants; nodes left without owners go.
    fn disown(&mut self, id: u32, w: u16) {
        let children: Vec<u32> = self.node(id).children.values().copied().collect();
        for c in children {
            self.disown(c, w);
        }
        if id == ROOT {
            return;
        }
        self.node_mut(id).owners.remove(&w);
        if self.node(id).owners.is_empty() {
            self.remove_subtree(id);
        }
    }

    /// `worker` no longer holds `text` (nor anything extending it).
    pub fn remove(&mut self, text: &[u8], worker: &str) {
        let Some(w) = self.workers.iter().position(|x| x == worker).map(|i| i as u16) else { return };
        let (mut cur, mut pos) = (ROOT, 0usize);
        while pos < text.len() {
            let Some(child) = self.node(cur).children.get(&text[pos]).copied() else { return };
            let common = common_prefix(&self.node(child).edge, &text[pos..]);
            pos += common;
            cur = child;
            if common < self.node(child).edge.len() {
                break;
            }
        }
        if pos == text.len() && cur != ROOT {
            self.disown(cur, w);
        }
    }

    /// `worker` holds nothing any more (cleared its cache, or left).
    pub fn clear_worker(&mut self, worker: &str) {
        if let Some(w) = self.workers.iter().position(|x| x == worker) {
            self.disown(ROOT, w as u16);
        }
    }

    /// How much of `text` each engine holds; engines holding nothing are absent.
    pub fn match_prefix(&self, text: &[u8]) -> Vec<PrefixMatch> {
        let mut best: BTreeMap<u16, (u64, Held)> = BTreeMap::new();
        let (mut cur, mut pos) = (ROOT, 0usize);
        while pos < text.len() {
            let Some(child) = self.node(cur).children.get(&text[pos]).copied() else { break };
            let n = self.node(child);
            let common = common_prefix(&n.edge, &text[pos..]);
            let reached = self.node(cur).depth + common as u64;
            for (w, held) in n.owners.iter() {
                best.insert(*w, (reached, *held));
            }
            pos += common;
            if common < n.edge.len() {
                break;
            }
            cur = child;
        }
        best.into_iter()
            .filter_map(|(w, (matched_bytes, held))| {
                let worker = self.workers.get(w as usize)?.clone();
                Some(PrefixMatch { worker, matched_bytes, tier: held.tier, sent_ms: held.sent_ms })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    fn matched(t: &RadixTree, text: &str) -> Vec<(String, u64)> {
        t.match_prefix(text.as_bytes()).into_iter().map(|m| (m.worker, m.matched_bytes)).collect()
    }

    #[test]
    fn matches_report_how_much_of_the_prompt_each_engine_holds() {
        let mut t = RadixTree::new(1 << 20);
        t.insert(b"system prompt: be nice. question one", "A", Tier::Gpu, 1);
        t.insert(b"system prompt: be nice. question two", "B", Tier::Gpu, 2);
        let m = matched(&t, "system prompt: be nice. question three");
        assert_eq!(m, vec![("A".to_string(), 33), ("B".to_string(), 34)], "\"question t\" matches one byte more of B");
        assert_eq!(
            matched(&t, "system prompt: be nice. question one, again"),
            vec![("A".into(), 36), ("B".into(), 33)]
        );
        assert!(matched(&t, "unrelated").is_empty());
    }

    #[test]
    fn size_is_the_bytes_of_all_edges() {
        let mut t = RadixTree::new(1 << 20);
        t.insert(b"abcdef", "A", Tier::Gpu, 1);
        t.insert(b"abcxyz", "B", Tier::Gpu, 2);
        assert_eq!(t.size_bytes(), 9); // abc + def + xyz
        t.insert(b"abcdef", "B", Tier::Gpu, 3);
        assert_eq!(t.size_bytes(), 9);
    }

    #[test]
    fn the_least_recently_inserted_leaves_are_evicted_under_the_budget() {
        let mut t = RadixTree::new(12);
        t.insert(b"aaaa-one", "A", Tier::Gpu, 1);
        t.insert(b"bbbb-two", "A", Tier::Gpu, 2);
        assert!(t.size_bytes() <= 12);
        assert!(matched(&t, "aaaa-one").is_empty(), "the older prompt went");
        assert_eq!(matched(&t, "bbbb-two"), vec![("A".into(), 8)]);
    }

    #[test]
    fn re_inserting_refreshes_recency() {
        let mut t = RadixTree::new(16);
        t.insert(b"aaaa-one", "A", Tier::Gpu, 1);
        t.insert(b"bbbb-two", "A", Tier::Gpu, 2);
        t.insert(b"aaaa-one", "A", Tier::Gpu, 3);
        t.insert(b"cccc-333", "A", Tier::Gpu, 4);
        assert_eq!(matched(&t, "aaaa-one"), vec![("A".into(), 8)]);
        assert!(matched(&t, "bbbb-two").is_empty());
    }

    #[test]
    fn removing_a_prefix_drops_it_and_every_extension_for_that_engine() {
        let mut t = RadixTree::new(1 << 20);
        t.insert(b"shared-prefix-1", "A", Tier::Gpu, 1);
        t.insert(b"shared-prefix-2", "A", Tier::Gpu, 2);
        t.insert(b"shared-prefix-1", "B", Tier::Gpu, 3);
        t.remove(b"shared-prefix-", "A");
        assert!(matched(&t, "shared-prefix-2").iter().all(|(w, _)| w != "A"));
        assert_eq!(matched(&t, "shared-prefix-1"), vec![("B".into(), 15)]);
    }

    #[test]
    fn a_match_says_when_its_deepest_part_was_first_sent_there() {
        let sent = |sent_ms| Held { tier: Tier::Gpu, sent_ms };
        let at = |t: &RadixTree, text: &str| {
            t.match_prefix(text.as_bytes()).into_iter().map(|m| (m.worker, m.sent_ms)).collect::<Vec<_>>()
        };
        let mut t = RadixTree::new(1 << 20);
        t.insert(b"system prompt / first user", "A", sent(100), 1);
        t.insert(b"system prompt / second user", "A", sent(200), 2);
        assert_eq!(at(&t, "system prompt / third user"), [("A".into(), 100)], "the split part keeps its first send");
        assert_eq!(at(&t, "system prompt / second user, again"), [("A".into(), 200)]);
        t.insert(b"system prompt / first user", "A", sent(300), 3);
        assert_eq!(at(&t, "system prompt / first user"), [("A".into(), 100)], "sent again: held since the first");
        t.insert(b"system prompt / first user", "A", Tier::Gpu, 4);
        assert_eq!(at(&t, "system prompt / first user"), [("A".into(), 0)], "the engine said it holds it");
        t.remove(b"system prompt / first user", "A");
        t.insert(b"system prompt / first user", "A", sent(400), 5);
        assert_eq!(at(&t, "system prompt / first user"), [("A".into(), 400)], "dropped, then sent anew");
    }

    #[test]
    fn clearing_a_worker_invalidates_all_it_held() {
        let mut t = RadixTree::new(1 << 20);
        t.insert(b"one", "A", Tier::Gpu, 1);
        t.insert(b"two", "A", Tier::Gpu, 2);
        t.insert(b"two", "B", Tier::Cpu, 3);
        t.clear_worker("A");
        assert!(matched(&t, "one").is_empty());
        assert_eq!(t.match_prefix(b"two")[0].tier, Tier::Cpu);
        assert_eq!(t.size_bytes(), 3);
    }

    #[test]
    fn the_same_events_give_the_same_tree_and_it_survives_encoding() {
        let build = || {
            let mut t = RadixTree::new(200);
            for i in 0..300u64 {
                let text = format!("prompt {} body {}", i % 17, i % 5);
                t.insert(text.as_bytes(), ["A", "B", "C"][(i % 3) as usize], Tier::Gpu, i);
                if i % 50 == 0 {
                    t.clear_worker("B");
                }
            }
            t
        };
        let (a, b) = (build(), build());
        assert_eq!(a, b);
        let mut decoded: RadixTree =
            crate::state::prefix::wire::decode(&crate::state::prefix::wire::encode(&a).unwrap()).unwrap();
        decoded.rebuild_index();
        assert_eq!(decoded, a);
        let (mut x, mut y) = (a.clone(), decoded);
        for i in 300..400u64 {
            x.insert(format!("late {i}").as_bytes(), "A", Tier::Gpu, i);
            y.insert(format!("late {i}").as_bytes(), "A", Tier::Gpu, i);
        }
        assert_eq!(x, y, "a decoded replica evolves exactly like the original");
    }

    #[test]
    fn the_tree_stays_within_its_budget_for_many_distinct_prompts() {
        let mut t = RadixTree::new(64 * 1024);
        for i in 0..20_000u64 {
            t.insert(format!("a distinct prompt number {i} with some padding text").as_bytes(), "A", Tier::Gpu, i);
            assert!(t.size_bytes() <= t.budget_bytes());
        }
        assert!(t.node_count() > 100);
    }
}
