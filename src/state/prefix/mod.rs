//! The prefix index (design §6 "Cache state"): which engines hold which prompt prefixes, as a radix
//! tree per model. Routing decisions feed it through the same event interface engine KV events will
//! use. Each VM's routing events reach the service in batches (its outbox); the service owns the
//! authoritative trees; every worker VM keeps a replica current from a bounded, versioned update
//! log in shared data, in MessagePack like the snapshot (`wire`). Application is deterministic (recency is the
//! event sequence, never a clock), so a replica that applied the same events holds the same tree.

mod events;
mod log;
mod outbox;
mod radix;
pub mod wire;

pub use events::{apply, PrefixEvent, Tier};
pub use log::{Budgets, PrefixLog, PrefixReplica, LOG_SLOTS};
pub use outbox::PrefixOutbox;
pub use radix::{PrefixMatch, RadixTree};
