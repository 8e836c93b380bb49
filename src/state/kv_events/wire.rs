//! The binary form of what the service and the filter VMs exchange about prefixes: queue messages,
//! log batches and the snapshot. MessagePack through serde, structs as arrays, prompt bytes as
//! binary. Both ends are the same module, so the form needs no field names; JSON cost a pass of
//! escaping per copy and spelled each edge byte of the snapshot as a number (~3.8× the tree).

use serde::{Deserialize, Serialize};

use crate::host::HostError;

pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, HostError> {
    rmp_serde::to_vec(value).map_err(|e| HostError::Failed(format!("not encoded: {e}")))
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, HostError> {
    rmp_serde::from_slice(bytes).map_err(|e| HostError::Failed(format!("not decoded: {e}")))
}
