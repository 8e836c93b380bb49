//! sgl-envoy-router: SGLang's bucket-first engine selection as an Envoy proxy-wasm filter.
//!
//! # Layout
//!
//! Dependencies point down this list; no module imports one above it, and none imports `proxy`
//! (`scripts/check-layers` fails on a cycle).
//!
//! - [`host`]: the [`host::Host`] trait (shared data with cas, queues, clocks, randomness) and the
//!   callouts the core asks for, with an in-memory host for native tests. The only door out.
//! - [`registry`]: [`registry::EngineRegistry`], the engines with their model, role and health.
//! - [`config`]: the router configuration, a leaf that describes: serde types, validation with field
//!   paths, refusal of dropped options, and the tools' file loader. It builds nothing.
//! - [`protocol`]: wire formats shared with processes outside Envoy (the indexer's), serde only.
//! - [`state`]: everything shared between VMs: reported load and in-flight counts, health and
//!   breakers, affinity bindings, the router's prefix index and its replicated log, each model's
//!   waiting queue.
//! - [`policies`]: the [`policies::Policy`] contract, admission, and one file per policy, named as
//!   the configuration names it.
//! - [`buckets`]: [`buckets::BucketResolver`], [`buckets::Bucket`], [`buckets::EngineGroup`].
//! - [`wiring`]: what both roots are built from: `factory` turns the configuration into policy
//!   instances and state handles; the stat counters; the upstream header and answer.
//! - [`filter`]: the request side: the route table, a request's life ([`filter::life`]: one
//!   synchronous state machine from its headers to its stream's end), the generation endpoints'
//!   preparation, bucket loop, decision and PD exchange, the VM's waiting room, the indexer's
//!   client, HTTP errors.
//! - [`service`]: the singleton's core: polls engines, owns the authoritative tables.
//! - `proxy` (wasm32 only): the proxy-wasm glue. Each hook asks the core and maps the actions it
//!   gets back to host calls; it holds no decision.
//!
//! # Glossary
//!
//! - **engine**: one SGLang (or vLLM) HTTP server, [`registry::Engine`]. The external contract
//!   calls it a worker (`workers`, `worker_ids`, `x-sgl-worker`, the `worker` label of stats and
//!   of wire fields), and those names are fixed; the code's types say engine.
//! - **role**: what an engine is configured to serve: plain, prefill or decode ([`registry::Role`]).
//! - **stage**: the role a group call is picking for. A PD bucket picks the prefill stage, then the
//!   decode stage; a plain bucket the plain stage.
//! - **bucket**: an input-length range and context capacity with its engine groups; the resolver
//!   orders the buckets a request fits, and the first that supplies a complete pick wins.
//! - **group**: the engines of one stage in one bucket, with the one policy instance that picks
//!   among them. A policy instance is logical: its state lives in shared data, across every VM.
//! - **pick**: one engine from the exact candidate set, why, and how much of the prompt it holds
//!   ([`policies::Pick`]).
//! - **admission**: absolute per-engine caps checked on an engine a policy chose; a rejection
//!   advances the bucket loop, never substitutes another engine.
//! - **ticket**: a prepared request: its facts and everything selection reads, the indexer's answer
//!   once it came ([`filter::generation::Ticket`]).
//! - **decision**: the complete outcome the filter carries out: upstream header, PD body and
//!   prefill callout, response headers ([`filter::Decision`]).
//! - **action**: one thing the glue does for the core ([`filter::life::Action`]).
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
