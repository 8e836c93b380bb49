//! The request's id at its engines (spec §8): SGLang's `rid`, which `/abort_request` names. The
//! client's own `rid` when it sent a usable one, else Envoy's `x-request-id`, else one the filter
//! draws; the filter writes it into the body when the client sent none.

use std::sync::Arc;

use super::prepare::{ClientRid, MAX_RID_BYTES};
use crate::policies::RandomSource;

/// The header Envoy's connection manager fills with the stream's id.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId {
    pub value: Arc<str>,
    /// The client sent no `rid`: the filter writes this one into every body it sends.
    pub injected: bool,
}

/// The request's id, or `None` when the client's `rid` is not one string (it stays as sent).
/// An `x-request-id` is taken only when it is short printable ASCII: it may come from the client.
pub fn request_id(client: &ClientRid, envoy_id: Option<&str>, random: &dyn RandomSource) -> Option<RequestId> {
    match client {
        ClientRid::Id(id) => Some(RequestId { value: Arc::from(id.as_str()), injected: false }),
        ClientRid::Other => None,
        ClientRid::Absent => {
            let usable =
                |id: &&str| !id.is_empty() && id.len() <= MAX_RID_BYTES && id.bytes().all(|b| b.is_ascii_graphic());
            let value = match envoy_id.filter(usable) {
                Some(id) => Arc::from(id),
                None => Arc::from(format!("sgl-{:016x}", random.next_u64()).as_str()),
            };
            Some(RequestId { value, injected: true })
        }
    }
}

/// `body` (a JSON object, as validated) with `"rid"` as its first member. Spliced into the bytes:
/// the one rewrite a plain request gets, so the body is not parsed again to make it.
pub fn with_rid(mut body: Vec<u8>, rid: &str) -> Vec<u8> {
    let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace()).filter(|&i| body[i] == b'{') else {
        return body;
    };
    let empty = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut member = b"\"rid\":".to_vec();
    member.extend(serde_json::to_vec(rid).unwrap_or_else(|_| b"\"\"".to_vec()));
    if !empty {
        member.push(b',');
    }
    body.splice(open + 1..open + 1, member);
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::SeededRandom;
    use crate::testing::test;
    use serde_json::Value;

    #[test]
    fn the_clients_rid_wins_then_envoys_then_one_drawn() {
        let random = SeededRandom::new(1);
        let own = request_id(&ClientRid::Id("mine".into()), Some("envoy"), &random).unwrap();
        assert_eq!((&*own.value, own.injected), ("mine", false));
        let envoys = request_id(&ClientRid::Absent, Some("5d1c-77"), &random).unwrap();
        assert_eq!((&*envoys.value, envoys.injected), ("5d1c-77", true));
        let drawn = request_id(&ClientRid::Absent, Some("has space"), &random).unwrap();
        assert!(drawn.value.starts_with("sgl-") && drawn.injected);
        let long = "x".repeat(MAX_RID_BYTES + 1);
        assert!(request_id(&ClientRid::Absent, Some(&long), &random).unwrap().value.starts_with("sgl-"));
        assert_eq!(request_id(&ClientRid::Other, Some("envoy"), &random), None, "a list stays the client's");
    }

    #[test]
    fn the_rid_is_spliced_in_as_the_first_member() {
        let body = with_rid(br#"  {"model": "m", "messages": []}"#.to_vec(), "a\"b");
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!((v["rid"].as_str(), v["model"].as_str()), (Some("a\"b"), Some("m")));
        let empty: Value = serde_json::from_slice(&with_rid(b"{ }".to_vec(), "r")).unwrap();
        assert_eq!(empty, serde_json::json!({"rid": "r"}));
        assert_eq!(with_rid(b"[1]".to_vec(), "r"), b"[1]", "not an object: untouched");
    }
}
