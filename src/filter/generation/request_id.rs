//! The request's id at its engines (spec §8): SGLang's `rid`, which `/abort_request` names. The
//! filter draws a fresh one for every request and writes it over whatever `rid` the client sent
//! (a string, a list, `null`, several copies): an id a client chose could be another request's,
//! and an abort naming it would stop that one too. The client's `x-request-id` is not used either;
//! it travels as a header, as sent.

use std::sync::Arc;

use serde_json::Value;

use super::body_edit::Member;
use crate::policies::RandomSource;

/// The member an engine reads the id from.
pub const RID: &str = "rid";

/// A request's id: `sgl-` and 128 random bits in hex, from the VM's host-seeded generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub Arc<str>);

impl RequestId {
    pub fn draw(random: &dyn RandomSource) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut id = [0u8; 36];
        id[..4].copy_from_slice(b"sgl-");
        for (half, bits) in [random.next_u64(), random.next_u64()].into_iter().enumerate() {
            for (i, byte) in id[4 + 16 * half..][..16].iter_mut().enumerate() {
                *byte = HEX[(bits >> (60 - 4 * i) & 0xf) as usize];
            }
        }
        Self(Arc::from(std::str::from_utf8(&id).unwrap_or("sgl-")))
    }

    /// The body member that carries it.
    pub fn member(&self) -> Member {
        Member::new(RID, &Value::String(self.0.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::SeededRandom;
    use crate::testing::test;

    #[test]
    fn every_request_draws_its_own_id() {
        let random = SeededRandom::new(1);
        let (a, b) = (RequestId::draw(&random), RequestId::draw(&random));
        assert_ne!(a, b);
        assert!(a.0.starts_with("sgl-") && a.0.len() == 4 + 32, "{}", a.0);
        let again = SeededRandom::new(1);
        let (x, y) = (again.next_u64(), again.next_u64());
        assert_eq!(&*a.0, format!("sgl-{x:016x}{y:016x}"), "128 bits in hex, most significant first");
        assert_eq!(a.member().value, format!("\"{}\"", a.0).into_bytes());
    }
}
