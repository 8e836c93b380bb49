//! Prefill/decode dispatch (spec §3): the body both engines receive, with SGLang's bootstrap
//! fields injected (client-sent ones overwritten; `n > 1` gets one fresh room per choice, as
//! arrays), the prefill callout, and the exchange that holds the decode response until the prefill
//! succeeded. The filter carries out what [`PdExchange`] answers; it decides nothing itself.

use std::sync::Arc;

use serde_json::json;

use super::body_edit::Member;

use crate::filter::{ErrorKind, RouteError};
use crate::host::CalloutRequest;
use crate::policies::RandomSource;
use crate::registry::{Engine, DEFAULT_BOOTSTRAP_PORT};
use crate::wiring::upstream::UpstreamAnswer;

/// What the filter sends where for one PD request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdDispatch {
    pub prefill: Arc<Engine>,
    /// The endpoint's path: the prefill engine gets the same request as the decode engine.
    pub path: &'static str,
    /// The body for the decode upstream request, and for the prefill callout unless that one
    /// differs (another data-parallel rank named).
    pub body: Vec<u8>,
    pub prefill_body: Option<Vec<u8>>,
    pub rooms: Vec<u64>,
    pub prefill_timeout_ms: u64,
}

/// Hop-by-hop headers (RFC 9110 §7.6.1 and the old proxy ones): they describe one connection, not
/// the request, so they never go on to the prefill engine.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Headers the prefill callout sets itself: the body changed, so its length and framing are new.
const SET_BY_CALLOUT: [&str; 4] = ["host", "content-length", "content-type", "expect"];

/// The client's end-to-end headers, for the prefill engine exactly as for the decode engine:
/// authorization, request ids, trace context and the like. Pseudo-headers, hop-by-hop headers
/// (and those `connection` names), Envoy's internal `x-envoy-*`, framing, and every routing header
/// the filter strips are left out.
pub fn forwarded_headers(client: Vec<(String, String)>, routing: &[String]) -> Vec<(String, String)> {
    let named_by_connection: Vec<String> = client
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("connection"))
        .flat_map(|(_, v)| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .collect();
    client
        .into_iter()
        .filter(|(k, _)| {
            let k = k.to_ascii_lowercase();
            !(k.starts_with(':')
                || k.starts_with("x-envoy-")
                || HOP_BY_HOP.contains(&k.as_str())
                || SET_BY_CALLOUT.contains(&k.as_str())
                || named_by_connection.contains(&k)
                || routing.iter().any(|r| r.eq_ignore_ascii_case(&k)))
        })
        .collect()
}

impl PdDispatch {
    /// The prefill request and the decode engine's body: the same body (but for a data-parallel
    /// rank) and end-to-end headers, the request to the prefill engine's cluster. `client_headers`
    /// come from [`forwarded_headers`]. The bodies (up to the body limit) move out: nothing holds
    /// them once both are dispatched.
    pub fn take_requests(&mut self, client_headers: Vec<(String, String)>) -> (CalloutRequest, Arc<Vec<u8>>) {
        let mut headers = client_headers;
        headers.push(("content-type".to_string(), "application/json".to_string()));
        let upstream = Arc::new(std::mem::take(&mut self.body));
        let prefill = match self.prefill_body.take() {
            Some(body) => Arc::new(body),
            None => Arc::clone(&upstream),
        };
        let mut request = self.prefill.callout("POST", self.path, self.prefill_timeout_ms);
        request.headers.extend(headers);
        request.body = Some(prefill);
        (request, upstream)
    }
}

/// Whether the filter lets the decode response through now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Pass,
    Hold,
}

/// What the filter does when the prefill callout answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillDone {
    /// Release the held decode response.
    Resume,
    /// Answer the client with this error instead of the decode response.
    Fail(RouteError),
    /// Nothing to do: the response was not held yet, or the decode already failed on its own.
    Nothing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillState {
    Pending,
    Succeeded,
    Failed,
    /// The decode engine failed first and its answer went to the client; the prefill no longer
    /// matters.
    Ignored,
}

/// One PD request's prefill/decode hand-off (spec §3): the decode response is released only
/// after the prefill answered 2xx; a failed prefill becomes a 502 `PrefillFailed`; a decode answer
/// that is itself not 2xx goes to the client at once.
#[derive(Debug, Clone)]
pub struct PdExchange {
    prefill: Arc<Engine>,
    state: PrefillState,
    held: bool,
}

impl PdExchange {
    pub fn new(prefill: Arc<Engine>) -> Self {
        Self { prefill, state: PrefillState::Pending, held: false }
    }

    pub fn prefill(&self) -> &Arc<Engine> {
        &self.prefill
    }

    /// The decode engine's response headers arrived with `status`.
    pub fn on_decode_headers(&mut self, status: Option<u16>) -> Flow {
        match self.state {
            PrefillState::Pending if !UpstreamAnswer::from_status(status).succeeded() => {
                self.state = PrefillState::Ignored;
                Flow::Pass
            }
            PrefillState::Pending => {
                self.held = true;
                Flow::Hold
            }
            // A prefill that already failed replied to the client; what follows is not sent.
            PrefillState::Succeeded | PrefillState::Failed | PrefillState::Ignored => Flow::Pass,
        }
    }

    /// A chunk of the decode response body arrived.
    pub fn on_decode_body(&self) -> Flow {
        if self.held {
            Flow::Hold
        } else {
            Flow::Pass
        }
    }

    /// The prefill callout answered with `status` (`None`: timeout or connection failure).
    pub fn on_prefill_done(&mut self, status: Option<u16>) -> PrefillDone {
        let answer = UpstreamAnswer::from_status(status);
        let ignored = self.state == PrefillState::Ignored;
        self.state = if answer.succeeded() { PrefillState::Succeeded } else { PrefillState::Failed };
        if ignored {
            return PrefillDone::Nothing;
        }
        if answer.succeeded() {
            return if std::mem::take(&mut self.held) { PrefillDone::Resume } else { PrefillDone::Nothing };
        }
        self.held = false;
        let why = match status {
            Some(s) if s > 0 => format!("status {s}"),
            _ => "no answer (timeout or connection failure)".to_string(),
        };
        PrefillDone::Fail(RouteError::new(
            ErrorKind::PrefillFailed,
            format!("prefill engine {} failed: {why}", self.prefill.id),
        ))
    }
}

/// A bootstrap room: a random u64 masked to 63 bits, as SGLang's router draws them.
pub fn new_room(random: &dyn RandomSource) -> u64 {
    random.next_u64() & (u64::MAX >> 1)
}

/// The bootstrap fields naming `prefill` (each a list, one per choice, when `n` > 1), and the
/// rooms drawn for them.
pub fn bootstrap_members(prefill: &Engine, n: u64, random: &dyn RandomSource) -> (Vec<Member>, Vec<u64>) {
    let host = prefill.address.host().to_string();
    let port = prefill.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    let choices = n.max(1);
    let rooms: Vec<u64> = (0..choices).map(|_| new_room(random)).collect();
    let (host, port, room) = if choices == 1 {
        (json!(host), json!(port), json!(rooms[0]))
    } else {
        let count = rooms.len();
        (json!(vec![host; count]), json!(vec![port; count]), json!(rooms))
    };
    let members = vec![
        Member::new("bootstrap_host", &host),
        Member::new("bootstrap_port", &port),
        Member::new("bootstrap_room", &room),
    ];
    (members, rooms)
}

#[cfg(test)]
mod tests {
    use super::super::body_edit::with_members;
    use super::super::CHAT_PATH;
    use super::*;
    use crate::policies::SeededRandom;
    use crate::registry::Role;
    use crate::testing::test;
    use crate::testing::worker_with;
    use serde_json::Value;

    /// The body with the bootstrap fields, and its rooms.
    fn bootstrap_body(body: Value, prefill: &Engine, n: u64, random: &dyn RandomSource) -> (Vec<u8>, Vec<u64>) {
        let (members, rooms) = bootstrap_members(prefill, n, random);
        (with_members(body.to_string().as_bytes(), &members).unwrap(), rooms)
    }

    #[test]
    fn bootstrap_fields_name_the_prefill_engine_and_overwrite_the_clients() {
        let p = worker_with("P1", Role::Prefill, "m");
        let body = json!({"model": "m", "messages": [], "bootstrap_room": 5, "bootstrap_host": "evil"});
        let (bytes, rooms) = bootstrap_body(body, &p, 1, &SeededRandom::new(3));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["bootstrap_host"], "127.0.0.1");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], json!(rooms[0]));
        assert_ne!(rooms[0], 5);
        assert_eq!(v["messages"], json!([]), "the rest of the body is kept");
    }

    fn exchange() -> PdExchange {
        PdExchange::new(worker_with("P1", Role::Prefill, "m"))
    }

    #[test]
    fn decode_is_held_until_the_prefill_succeeds() {
        let mut x = exchange();
        assert_eq!(x.on_decode_headers(Some(200)), Flow::Hold);
        assert_eq!(x.on_decode_body(), Flow::Hold);
        assert_eq!(x.on_prefill_done(Some(200)), PrefillDone::Resume);
        assert_eq!(x.on_decode_body(), Flow::Pass);
    }

    #[test]
    fn a_prefill_that_finishes_first_lets_decode_through() {
        let mut x = exchange();
        assert_eq!(x.on_prefill_done(Some(200)), PrefillDone::Nothing);
        assert_eq!(x.on_decode_headers(Some(200)), Flow::Pass);
        assert_eq!(x.on_decode_body(), Flow::Pass);
    }

    #[test]
    fn a_failed_prefill_fails_the_request_whether_or_not_decode_answered() {
        for decode_first in [true, false] {
            let mut x = exchange();
            if decode_first {
                assert_eq!(x.on_decode_headers(Some(200)), Flow::Hold);
            }
            for status in [Some(500), Some(404), None] {
                let mut y = x.clone();
                match y.on_prefill_done(status) {
                    PrefillDone::Fail(e) => {
                        assert_eq!(e.kind, ErrorKind::PrefillFailed);
                        assert!(e.message.contains("P1"), "{}", e.message);
                    }
                    other => panic!("{other:?}"),
                }
            }
            x.on_prefill_done(None);
            assert_eq!(x.on_decode_body(), Flow::Pass, "nothing is held once the error replied");
        }
    }

    #[test]
    fn a_failing_decode_goes_to_the_client_at_once_and_the_prefill_no_longer_matters() {
        let mut x = exchange();
        assert_eq!(x.on_decode_headers(Some(503)), Flow::Pass);
        assert_eq!(x.on_decode_body(), Flow::Pass);
        assert_eq!(x.on_prefill_done(None), PrefillDone::Nothing);
        let mut y = exchange();
        assert_eq!(y.on_decode_headers(None), Flow::Pass);
        assert_eq!(y.on_prefill_done(Some(200)), PrefillDone::Nothing);
    }

    #[test]
    fn the_prefill_request_carries_the_decode_body_to_the_prefill_cluster() {
        let p = worker_with("P1", Role::Prefill, "m");
        let mut d = PdDispatch {
            prefill: p,
            path: CHAT_PATH,
            body: b"{}".to_vec(),
            prefill_body: None,
            rooms: vec![1],
            prefill_timeout_ms: 7,
        };
        let (r, upstream) = d.take_requests(vec![("authorization".into(), "Bearer k".into())]);
        assert!(d.body.is_empty(), "the decision keeps no copy of the body for the rest of the stream");
        assert_eq!(
            r.headers,
            [("authorization".to_string(), "Bearer k".to_string()), ("content-type".into(), "application/json".into())]
        );
        assert_eq!((r.cluster.as_str(), r.method.as_str(), r.path.as_str()), ("sgl_P1", "POST", CHAT_PATH));
        assert_eq!(
            (r.authority.as_str(), r.body.as_deref().map(Vec::as_slice), r.timeout_ms),
            ("127.0.0.1:1", Some(&b"{}"[..]), 7)
        );
        assert!(Arc::ptr_eq(r.body.as_ref().unwrap(), &upstream), "one body for both, not a copy");
        let mut ranked = PdDispatch { prefill_body: Some(b"{\"routed_dp_rank\":1}".to_vec()), ..d };
        ranked.body = b"{\"routed_dp_rank\":0}".to_vec();
        let (r, upstream) = ranked.take_requests(vec![]);
        assert_eq!(
            (r.body.unwrap().as_slice(), upstream.as_slice()),
            (&b"{\"routed_dp_rank\":1}"[..], &b"{\"routed_dp_rank\":0}"[..])
        );
    }

    #[test]
    fn end_to_end_client_headers_go_to_prefill_and_nothing_else() {
        let h = |k: &str, v: &str| (k.to_string(), v.to_string());
        let client = vec![
            h(":method", "POST"),
            h(":authority", "router"),
            h("authorization", "Bearer secret"),
            h("x-request-id", "r1"),
            h("traceparent", "00-abc-def-01"),
            h("Connection", "keep-alive, x-hop"),
            h("x-hop", "1"),
            h("keep-alive", "timeout=5"),
            h("transfer-encoding", "chunked"),
            h("content-length", "12"),
            h("content-type", "application/json"),
            h("x-envoy-expected-rq-timeout-ms", "1000"),
            h("x-sgl-cluster", "sgl_evil"),
            h("x-my-upstream", "evil"),
            h("x-session-id", "s1"),
        ];
        let routing = vec!["x-sgl-cluster".to_string(), "x-my-upstream".to_string()];
        let kept = forwarded_headers(client, &routing);
        assert_eq!(
            kept,
            [
                h("authorization", "Bearer secret"),
                h("x-request-id", "r1"),
                h("traceparent", "00-abc-def-01"),
                h("x-session-id", "s1")
            ]
        );
    }

    #[test]
    fn rooms_are_63_bit() {
        let r = SeededRandom::new(9);
        assert!((0..1000).all(|_| new_room(&r) < (1 << 63)));
    }

    #[test]
    fn n_greater_than_one_gets_arrays_with_a_fresh_room_per_choice() {
        let p = worker_with("P1", Role::Prefill, "m");
        let (bytes, rooms) = bootstrap_body(json!({"n": 3}), &p, 3, &SeededRandom::new(1));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(rooms.len(), 3);
        assert_eq!(v["bootstrap_room"], json!(rooms));
        assert_eq!(v["bootstrap_host"].as_array().map(Vec::len), Some(3));
        assert_eq!(v["bootstrap_port"], json!([8998, 8998, 8998]));
        let distinct: std::collections::HashSet<_> = rooms.iter().collect();
        assert_eq!(distinct.len(), 3);
    }
}
