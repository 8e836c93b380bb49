//! The binary form of what the service and the filter VMs exchange about prefixes: queue messages,
//! log batches and the snapshot. MessagePack through serde, structs as arrays, prompt bytes as
//! binary. Both ends are the same module, so the form needs no field names; JSON cost a pass of
//! escaping per copy and spelled each edge byte of the snapshot as a number, several times the tree.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::host::HostError;

pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, HostError> {
    rmp_serde::to_vec(value).map_err(|e| HostError::Failed(format!("not encoded: {e}")))
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, HostError> {
    rmp_serde::from_slice(bytes).map_err(|e| HostError::Failed(format!("not decoded: {e}")))
}

/// Values encoded back to back, as one queue message carries a VM's held events. A value that
/// does not decode ends the message: what came before it is kept.
pub fn decode_each<T: DeserializeOwned>(bytes: &[u8]) -> Result<Vec<T>, (Vec<T>, HostError)> {
    let mut rest = bytes;
    let mut values = Vec::new();
    while !rest.is_empty() {
        let mut reader = rmp_serde::Deserializer::new(&mut rest);
        match T::deserialize(&mut reader) {
            Ok(value) => values.push(value),
            Err(e) => return Err((values, HostError::Failed(format!("not decoded: {e}")))),
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn values_back_to_back_decode_in_order_and_a_bad_tail_keeps_the_head() {
        let mut bytes = encode(&("a", 1u8)).unwrap();
        bytes.extend(encode(&("bc", 2u8)).unwrap());
        assert_eq!(decode_each::<(String, u8)>(&bytes).unwrap(), [("a".into(), 1), ("bc".into(), 2)]);
        bytes.push(0xc1); // never used in MessagePack
        let (head, _) = decode_each::<(String, u8)>(&bytes).unwrap_err();
        assert_eq!(head, [("a".into(), 1), ("bc".into(), 2)]);
        assert!(decode_each::<(String, u8)>(&[]).unwrap().is_empty());
    }
}
