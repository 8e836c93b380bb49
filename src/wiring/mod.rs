//! What both roots are built from: `factory` turns the configuration into policy instances and
//! state handles, `counters` names the stats the filter bumps, `upstream` names the engine Envoy's
//! router goes to and reads what it answered.

pub mod counters;
pub mod factory;
pub mod upstream;
