//! Prefix events: what an engine (or our own routing decision) says it stored or dropped. Engine
//! KV events will arrive through this same interface.

use serde::{Deserialize, Serialize};

use super::radix::RadixTree;

/// Where an engine keeps a cached prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Gpu,
    Cpu,
    Disk,
}

/// How an engine holds a prefix: where, and since when by the router's own dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub tier: Tier,
    /// When the router first sent the prefix there (its host clock, ms); 0 when the engine said it
    /// holds it. Until that dispatch is answered the engine may not hold it yet: SGLang matches
    /// its cache when it schedules a request, so requests batched with the one that brings a
    /// prefix prefill it again.
    pub sent_ms: u64,
}

impl From<Tier> for Held {
    fn from(tier: Tier) -> Self {
        Held { tier, sent_ms: 0 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixEvent {
    /// `sent_ms`: see [`Held::sent_ms`].
    Stored {
        model: String,
        worker: String,
        text: String,
        tier: Tier,
        sent_ms: u64,
    },
    Removed {
        model: String,
        worker: String,
        text: String,
    },
    AllCleared {
        worker: String,
    },
}

/// Applies one event at sequence `seq` to the trees of every model (created on first use with
/// `budget_bytes(model)`).
pub fn apply(
    trees: &mut std::collections::BTreeMap<String, RadixTree>,
    event: &PrefixEvent,
    seq: u64,
    budget_bytes: &dyn Fn(&str) -> u64,
) {
    match event {
        PrefixEvent::Stored { model, worker, text, tier, sent_ms } => trees
            .entry(model.clone())
            .or_insert_with(|| RadixTree::new(budget_bytes(model)))
            .insert(text.as_bytes(), worker, Held { tier: *tier, sent_ms: *sent_ms }, seq),
        PrefixEvent::Removed { model, worker, text } => {
            if let Some(t) = trees.get_mut(model) {
                t.remove(text.as_bytes(), worker);
            }
        }
        PrefixEvent::AllCleared { worker } => {
            for t in trees.values_mut() {
                t.clear_worker(worker);
            }
        }
    }
}
