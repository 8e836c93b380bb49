//! Every error the filter itself answers with (spec §4): a status and an OpenAI-style body.

use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    NoMatchingBucket,
    ModelNotFound,
    PayloadTooLarge,
    AdmissionRejected,
    NoCandidates,
    InvalidSignal,
    InvalidConfiguration,
    OutsideCandidates,
    PrefillFailed,
    NotFound,
    MethodNotAllowed,
    /// Flow control (spec §9): the model's queue is full, or the request waited its longest.
    QueueFull,
    QueueTimeout,
    /// The model's shared queue could not be written: the request is not sent past it.
    QueueUnavailable,
}

impl ErrorKind {
    pub fn type_name(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::NoMatchingBucket => "NoMatchingBucket",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::AdmissionRejected => "AdmissionRejected",
            ErrorKind::NoCandidates => "NoCandidates",
            ErrorKind::InvalidSignal => "InvalidSignal",
            ErrorKind::InvalidConfiguration => "InvalidConfiguration",
            ErrorKind::OutsideCandidates => "OutsideCandidates",
            ErrorKind::PrefillFailed => "PrefillFailed",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::QueueTimeout => "queue_timeout",
            ErrorKind::QueueUnavailable => "queue_unavailable",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::NoMatchingBucket => 400,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::QueueFull | ErrorKind::QueueTimeout => 429,
            ErrorKind::AdmissionRejected | ErrorKind::NoCandidates | ErrorKind::QueueUnavailable => 503,
            ErrorKind::InvalidSignal | ErrorKind::InvalidConfiguration | ErrorKind::OutsideCandidates => 500,
            ErrorKind::PrefillFailed => 502,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {}: {message}", .kind.status(), .kind.type_name())]
pub struct RouteError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RouteError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// `{"error": {"message", "type", "code"}}`, sent with `content-type: application/json`.
    pub fn body(&self) -> Vec<u8> {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind.type_name(),
                "code": self.status(),
            }
        })
        .to_string()
        .into_bytes()
    }
}

/// The largest chat body the filter reads; above it the answer is 413.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

pub fn payload_too_large(size: usize) -> RouteError {
    RouteError::new(
        ErrorKind::PayloadTooLarge,
        format!("request body of at least {size} bytes exceeds the limit of {MAX_BODY_BYTES} bytes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    #[test]
    fn body_is_openai_shaped() {
        let e = RouteError::new(ErrorKind::ModelNotFound, "model `x` is not served");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(v["error"]["type"], "model_not_found");
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["message"], "model `x` is not served");
    }

    #[test]
    fn statuses_follow_the_contract() {
        assert_eq!(ErrorKind::InvalidRequest.status(), 400);
        assert_eq!(ErrorKind::NoMatchingBucket.status(), 400);
        assert_eq!(ErrorKind::PayloadTooLarge.status(), 413);
        assert_eq!(ErrorKind::AdmissionRejected.status(), 503);
        assert_eq!(ErrorKind::NoCandidates.status(), 503);
        assert_eq!(ErrorKind::OutsideCandidates.status(), 500);
        assert_eq!(ErrorKind::PrefillFailed.status(), 502);
        assert_eq!(ErrorKind::QueueFull.status(), 429);
        assert_eq!(ErrorKind::QueueTimeout.type_name(), "queue_timeout");
    }
}
