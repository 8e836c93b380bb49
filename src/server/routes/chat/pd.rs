//! Prefill/decode dispatch facts (spec §3): the body both engines receive, with SGLang's bootstrap
//! fields injected. Client-sent bootstrap fields are overwritten; `n > 1` gets one fresh room per
//! choice, as arrays.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::policies::RandomSource;
use crate::registry::{Worker, DEFAULT_BOOTSTRAP_PORT};

/// What the filter sends where for one PD request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdDispatch {
    pub prefill: Arc<Worker>,
    /// The body for both the prefill callout and the decode upstream request.
    pub body: Vec<u8>,
    pub rooms: Vec<u64>,
    pub prefill_timeout_ms: u64,
}

/// A bootstrap room: a random u64 masked to 63 bits, as SGLang's router draws them.
pub fn new_room(random: &dyn RandomSource) -> u64 {
    random.next_u64() & (u64::MAX >> 1)
}

pub fn bootstrap_body(
    mut body: Map<String, Value>,
    prefill: &Worker,
    n: u64,
    random: &dyn RandomSource,
) -> (Vec<u8>, Vec<u64>) {
    let host = prefill.address.host.clone();
    let port = prefill.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    let choices = n.max(1);
    let rooms: Vec<u64> = (0..choices).map(|_| new_room(random)).collect();
    if choices == 1 {
        body.insert("bootstrap_host".into(), json!(host));
        body.insert("bootstrap_port".into(), json!(port));
        body.insert("bootstrap_room".into(), json!(rooms[0]));
    } else {
        let count = rooms.len();
        body.insert("bootstrap_host".into(), json!(vec![host; count]));
        body.insert("bootstrap_port".into(), json!(vec![port; count]));
        body.insert("bootstrap_room".into(), json!(rooms));
    }
    (Value::Object(body).to_string().into_bytes(), rooms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Role;
    use crate::policies::testing::worker_with;
    use crate::policies::SeededRandom;

    fn parsed(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn bootstrap_fields_name_the_prefill_engine_and_overwrite_the_clients() {
        let p = worker_with("P1", Role::Prefill, "m");
        let body = parsed(json!({"model": "m", "messages": [], "bootstrap_room": 5, "bootstrap_host": "evil"}));
        let (bytes, rooms) = bootstrap_body(body, &p, 1, &SeededRandom::new(3));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["bootstrap_host"], "127.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], json!(rooms[0]));
        assert_ne!(rooms[0], 5);
        assert_eq!(v["messages"], json!([]), "the rest of the body is kept");
    }

    #[test]
    fn rooms_are_63_bit() {
        let r = SeededRandom::new(9);
        assert!((0..1000).all(|_| new_room(&r) < (1 << 63)));
    }

    #[test]
    fn n_greater_than_one_gets_arrays_with_a_fresh_room_per_choice() {
        let p = worker_with("P1", Role::Prefill, "m");
        let (bytes, rooms) = bootstrap_body(parsed(json!({"n": 3})), &p, 3, &SeededRandom::new(1));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(rooms.len(), 3);
        assert_eq!(v["bootstrap_room"], json!(rooms));
        assert_eq!(v["bootstrap_host"].as_array().map(Vec::len), Some(3));
        assert_eq!(v["bootstrap_port"], json!([8998, 8998, 8998]));
        let distinct: std::collections::HashSet<_> = rooms.iter().collect();
        assert_eq!(distinct.len(), 3);
    }
}
