//! sgl-envoy-router: SGLang's bucket-first engine selection as an Envoy proxy-wasm filter.
//!
//! Everything outside `proxy/` is pure Rust behind the [`host::Host`] trait and runs natively and
//! under Node's WASI in unit tests; `proxy/` is the thin proxy-wasm glue.

pub mod buckets;
pub mod config;
pub mod host;
pub mod policies;
pub mod registry;
pub mod server;
pub mod state;

#[cfg(test)]
pub(crate) mod testing;

#[cfg(all(target_arch = "wasm32", feature = "proxy"))]
mod proxy;
