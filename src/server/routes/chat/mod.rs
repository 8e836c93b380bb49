//! `POST /v1/chat/completions`: prepare the facts once, then walk the resolved buckets.

pub mod bucket_loop;
pub mod pd;
mod prepare;

pub use bucket_loop::{select, Selection, SelectionFailure};
pub use prepare::{prepare, prepare_with_body, prompt_text, ChatFacts, MAX_PROMPT_BYTES};
