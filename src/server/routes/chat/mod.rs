//! `POST /v1/chat/completions`: accept the body, prepare the facts once, walk the resolved
//! buckets, and turn the selection into a [`Decision`] the filter carries out.

pub mod bucket_loop;
mod chat_body;
pub mod decision;
pub mod endpoint;
pub mod exchange;
pub mod pd;
mod prepare;

pub use bucket_loop::{select, Selection, SelectionFailure};
pub use decision::{ChatOutcome, Decision, PendingChat, Target};
pub use endpoint::{prepare_endpoint, token_id_text, Endpoint, Prepared, Prompts};
pub use exchange::{ChatExchange, Effects};
pub use prepare::{prepare, prepare_chat, ChatFacts, MAX_PROMPT_BYTES};

use crate::server::errors::{payload_too_large, MAX_BODY_BYTES};
use crate::server::RouteError;

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
