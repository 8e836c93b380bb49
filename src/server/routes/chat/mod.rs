//! `POST /v1/chat/completions`: prepare the facts once, then walk the resolved buckets.

mod bucket_loop;
mod prepare;

pub use bucket_loop::{select, Selection, SelectionFailure};
pub use prepare::{prepare, ChatFacts};
