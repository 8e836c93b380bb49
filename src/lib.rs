//! sgl-envoy-router: SGLang's bucket-first engine selection as an Envoy proxy-wasm filter.
//!
//! # Layout
//!
//! Dependencies point down this list; no module imports one above it, and none imports `proxy`.
//!
//! - [`host`]: the [`host::Host`] trait (shared data with cas, queues, clock, randomness) and HTTP
//!   callouts, with an in-memory host for native tests. The only door to the outside.
//! - [`registry`]: [`registry::WorkerRegistry`], the engines with their model, role and health.
//! - [`config`]: the router configuration, a leaf that describes: serde types, validation with field
//!   paths, refusal of dropped options. It builds nothing.
//! - [`state`]: everything shared between VMs: reported load and in-flight counts, health and
//!   breakers, affinity bindings, the prefix index and its replicated log.
//! - [`policies`]: the [`policies::Policy`] contract, admission, and one file per policy.
//! - [`buckets`]: [`buckets::BucketResolver`], [`buckets::Bucket`], [`buckets::EngineGroup`].
//! - [`server`]: the wiring (`factory` builds what the configuration describes; `AppContext` holds
//!   it), the route table and the chat route (prepare, bucket loop, decision, PD exchange), HTTP
//!   errors, stat names, and the service's tick.
//! - `proxy` (wasm32 only): the proxy-wasm glue. It maps each core answer to an Envoy action and
//!   holds no decision.
//!
//! # Glossary
//!
//! - **engine** / **worker**: one SGLang (or vLLM) HTTP server. "Engine" in the design's prose,
//!   [`registry::Worker`] in code; the same thing.
//! - **role**: what an engine is configured to serve: plain, prefill or decode ([`registry::Role`]).
//! - **stage**: the role a group call is picking for. A PD bucket picks the prefill stage, then the
//!   decode stage; a plain bucket the plain stage.
//! - **bucket**: an input-length range and context capacity with its engine groups; the resolver
//!   orders the buckets a request fits, and the first that supplies a complete pick wins.
//! - **group**: the engines of one stage in one bucket, with the one policy instance that picks
//!   among them. A policy instance is logical: its state lives in shared data, across every VM.
//! - **pick**: one engine from the exact candidate set, and why ([`policies::Pick`]).
//! - **admission**: absolute per-engine caps checked on an engine a policy chose; a rejection
//!   advances the bucket loop, never substitutes another engine.
//! - **decision**: the complete outcome the filter carries out: upstream header, PD body and
//!   prefill callout, response headers ([`filter::Decision`]).
//! - **service**: the singleton bootstrap VM that polls engines and owns the authoritative tables;
//!   **filter VM**: one per Envoy worker thread.

pub mod buckets;
pub mod config;
pub mod filter;
pub mod host;
pub mod policies;
pub mod protocol;
pub mod registry;
pub mod service;
pub mod state;
pub mod wiring;

#[cfg(test)]
pub(crate) mod testing;

#[cfg(all(target_arch = "wasm32", feature = "proxy"))]
mod proxy;
