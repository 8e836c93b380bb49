//! State shared between the service and every worker VM, kept in the host's shared data.

pub mod affinity_store;
pub mod availability;
pub mod breaker;
pub mod filter_config;
pub mod health;
pub mod keys;
pub mod lease;
pub mod load_monitor;
pub mod prefix;
pub mod schedule;
pub mod seats;
pub mod shared;
pub mod vm_registry;
pub mod wait_queue;
