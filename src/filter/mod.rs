//! The request side of the core: the route table, a generation request's life from its body to
//! its stream's end (`life`), the indexer's client, the VM's side of the waiting queue (`queue`),
//! and the HTTP errors the filter answers with.

pub mod app;
pub mod errors;
pub mod generation;
pub mod headers;
pub mod indexer;
pub mod life;
pub mod metrics;
pub mod models;
pub mod queue;
pub mod routes;
pub mod ticks;

pub use app::AppContext;
pub use errors::{ErrorKind, RouteError};
pub use generation::Decision;
