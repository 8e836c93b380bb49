//! The generation endpoints (`/v1/chat/completions`, `/v1/completions`, `/generate`): buffer the
//! body, prepare its facts once ([`Ticket`]), walk the resolved buckets, turn the selection into a
//! [`Decision`], and follow the routed request to its end ([`Exchange`], PD's hand-off).

pub mod abort;
pub mod body_edit;
pub mod bucket_loop;
mod chat_body;
pub mod decision;
pub mod dp_rank;
pub mod endpoint;
pub mod exchange;
pub mod pd;
mod prepare;
pub mod request_id;

pub use bucket_loop::{select, Selection, SelectionFailure};
pub use decision::{decide, Decision, Outcome, PrefixWait, Target, Ticket, Verdict, Wiring};
pub use endpoint::{prepare_endpoint, token_id_text, Endpoint, Prepared, Prompts};
pub use exchange::{Effects, Exchange};
pub use prepare::{prepare, prepare_chat, RequestFacts, MAX_PROMPT_BYTES};

use crate::filter::errors::{payload_too_large, MAX_BODY_BYTES};
use crate::filter::RouteError;

pub const CHAT_PATH: &str = "/v1/chat/completions";

/// Where the body of a chat request stands after a body callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyStep {
    /// More is coming; keep buffering.
    Wait,
    /// Over the limit: answer 413 now.
    TooLarge(RouteError),
    /// The whole body is buffered.
    Ready,
}

/// `size` is everything buffered so far (spec §3: above 32 MiB the filter answers 413 itself).
pub fn body_step(size: usize, end_of_stream: bool) -> BodyStep {
    if size > MAX_BODY_BYTES {
        BodyStep::TooLarge(payload_too_large(size))
    } else if end_of_stream {
        BodyStep::Ready
    } else {
        BodyStep::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn the_body_is_buffered_until_its_end_and_refused_above_the_limit() {
        assert_eq!(body_step(10, false), BodyStep::Wait);
        assert_eq!(body_step(10, true), BodyStep::Ready);
        assert_eq!(body_step(MAX_BODY_BYTES, true), BodyStep::Ready);
        assert!(matches!(body_step(MAX_BODY_BYTES + 1, false), BodyStep::TooLarge(_)));
    }
}
