//! The request side of the core: preparation, routing decisions and their HTTP errors.

pub mod app_context;
pub mod errors;
pub mod metrics;
pub mod routes;

pub use app_context::{AppContext, Decision};
pub use errors::{ErrorKind, RouteError};
