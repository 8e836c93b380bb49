//! The request side of the core and the wiring: building what the configuration describes,
//! preparing requests, routing decisions and their HTTP errors, and the service's tick.

pub mod app_context;
pub mod errors;
pub mod factory;
pub mod headers;
pub mod metrics;
pub mod routes;
pub mod service;
pub mod upstream;

pub use app_context::AppContext;
pub use errors::{ErrorKind, RouteError};
pub use routes::chat::Decision;
