//! Wire formats shared with processes outside Envoy: serde types only, used by both ends.

pub mod indexer;
