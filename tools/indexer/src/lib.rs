//! sgl-indexer: the precise prefix index of spec §7. Engines publish KV events over ZeroMQ
//! (`subscriber`), decoded from SGLang's and vLLM's wire formats (`events`) into one index per
//! model keyed by the indexer's own chained block keys (`index`), every engine byte passing a
//! loopback frame guard first (`relay`); chat bodies are rendered with the model's chat template
//! and tokenized as the engine does (`tokenize`, long new pieces fast by `pretokenize`); `http`
//! answers the filter and anyone else, timing each phase (`timing`). `state` holds what they
//! share. Replicas of `prefix_index.urls` agree claims and match handles (`replicas`), and a
//! replica starting late loads a running one's view (`snapshot`) before it warms each rank up from
//! the engine's replay (`subscriber`).
//!
//! Glossary: an engine *page* is what one of its events names (one block hash); a *block* is the
//! indexer's `block_tokens`-token unit of matching; a *holder* is an engine rank and medium that
//! holds a block; *speculative* entries are blocks a router just sent to an engine, counted until
//! the engine's own event confirms them or they expire; a *claim* is a match whose routed notice
//! is still to come, which concurrent queries sharing its prefix wait for (`claims`).

pub mod claims;
pub mod events;
pub mod http;
pub mod index;
pub mod pretokenize;
pub mod relay;
pub mod replicas;
pub mod snapshot;
pub mod state;
pub mod subscriber;
pub mod synthetic;
pub mod timing;
pub mod tokenize;
