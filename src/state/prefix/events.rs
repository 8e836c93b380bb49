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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefixEvent {
    Stored { model: String, worker: String, text: String, tier: Tier },
    Removed { model: String, worker: String, text: String },
    AllCleared { worker: String },
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
        PrefixEvent::Stored { model, worker, text, tier } => trees
            .entry(model.clone())
            .or_insert_with(|| RadixTree::new(budget_bytes(model)))
            .insert(text.as_bytes(), worker, *tier, seq),
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
