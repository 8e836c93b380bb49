//! The body an engine receives: the client's bytes as validated, with the members the filter sets
//! (`rid`, `routed_dp_rank`, the bootstrap fields) written over every top-level member of the same
//! name, or inserted first where there is none. Nothing is parsed into a tree or encoded again, so
//! what the engine reads is what validation read: a number no tree can hold (`1e400`), key order,
//! spacing and escapes all travel as sent.
//!
//! Names are compared decoded (`"r\u0069d"` is `rid`), so a client cannot hide a second copy of a
//! member from the filter; duplicates are all overwritten, whichever one an engine keeps.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;

/// Why a body could not be edited: it is not one JSON object (validation refuses those first).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the body is not one JSON object: {0}")]
pub struct EditError(String);

/// A member the filter sets: its name and its value, encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: &'static str,
    pub value: Vec<u8>,
}

impl Member {
    /// `value` encoded; a `Value` of strings, integers, and arrays of them always encodes.
    pub fn new(name: &'static str, value: &Value) -> Self {
        Self { name, value: value.to_string().into_bytes() }
    }
}

/// An edit of a buffered body: its first `replaced` bytes give way to `head`, and the rest travels
/// as sent. A member inserted where there was none changes only the bytes up to the object's `{`,
/// so the host keeps the rest of its buffer and nothing else crosses into or out of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyEdit {
    pub replaced: usize,
    pub head: Vec<u8>,
    /// The edited body's length.
    pub len: usize,
}

impl BodyEdit {
    /// The edited body, whole.
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len);
        out.extend_from_slice(&self.head);
        out.extend_from_slice(body.get(self.replaced..).unwrap_or_default());
        out
    }
}

/// `body` with every member of `set` written: over each top-level member of its name, else first.
pub fn with_members(body: &[u8], set: &[Member]) -> Result<Vec<u8>, EditError> {
    edit_members(body, set).map(|edit| edit.apply(body))
}

/// [`edit_members`] of a body validation read as one JSON object. Where no top-level member can
/// carry one of `set`'s names (no name appears in the body as written, and no `\u` escape could
/// spell one), the members go first with no second pass over the body; otherwise the full edit.
pub fn edit_validated(body: &[u8], set: &[Member]) -> Result<BodyEdit, EditError> {
    let unnamed = memchr::memmem::find(body, b"\\u").is_none()
        && set.iter().all(|m| memchr::memmem::find(body, m.name.as_bytes()).is_none());
    let open = body.iter().position(|b| !b.is_ascii_whitespace());
    match open {
        Some(open) if unnamed && !set.is_empty() && body.get(open) == Some(&b'{') => {
            let empty = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
            let grown: usize = set.iter().map(|m| m.name.len() + m.value.len() + 4).sum();
            let mut head = Vec::with_capacity(open + 1 + grown);
            head.extend_from_slice(&body[..=open]);
            write_first(set.iter(), !empty, &mut head);
            let len = head.len() + body.len() - (open + 1);
            Ok(BodyEdit { replaced: open + 1, head, len })
        }
        _ => edit_members(body, set),
    }
}

/// [`with_members`] as an edit of `body`'s first bytes: up to the end of the last member written.
pub fn edit_members(body: &[u8], set: &[Member]) -> Result<BodyEdit, EditError> {
    if set.is_empty() {
        return Ok(BodyEdit { replaced: 0, head: Vec::new(), len: body.len() });
    }
    let names: Vec<&str> = set.iter().map(|m| m.name).collect();
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de.deserialize_map(Spans { body, names: &names }).map_err(|e| EditError(e.to_string()))?;
    de.end().map_err(|e| EditError(e.to_string()))?;
    let mut cuts: Vec<(usize, usize, &[u8])> = Vec::with_capacity(found.spans.len() + 1);
    let mut missing = Vec::new();
    for (i, member) in set.iter().enumerate() {
        let before = cuts.len();
        cuts.extend(found.spans.iter().filter(|s| s.0 == i).map(|&(_, start, end)| (start, end, &member.value[..])));
        if cuts.len() == before {
            missing.push(member);
        }
    }
    let mut inserted = Vec::new();
    if !missing.is_empty() {
        write_first(missing.into_iter(), found.members > 0, &mut inserted);
        cuts.push((found.open + 1, found.open + 1, &inserted));
    }
    cuts.sort_by_key(|&(start, _, _)| start);
    let grown: usize = cuts.iter().map(|(_, _, v)| v.len()).sum();
    let mut head = Vec::with_capacity(cuts.last().map_or(0, |&(_, end, _)| end) + grown);
    let mut at = 0;
    for (start, end, value) in cuts {
        head.extend_from_slice(&body[at..start]);
        head.extend_from_slice(value);
        at = end;
    }
    let len = head.len() + body.len() - at;
    Ok(BodyEdit { replaced: at, head, len })
}

/// `members` as they go first in an object, after its `{`: `"name":value`, comma-separated, and a
/// comma after them when the object has members of its own (`more`).
fn write_first<'m>(members: impl Iterator<Item = &'m Member>, more: bool, out: &mut Vec<u8>) {
    for (i, member) in members.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(member.name.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(&member.value);
    }
    if more {
        out.push(b',');
    }
}

/// What one pass over the top level found: where the object opens, how many members it has, and
/// the byte range of each value whose name is the `i`th of those sought.
struct Found {
    open: usize,
    members: usize,
    spans: Vec<(usize, usize, usize)>,
}

struct Spans<'b, 'n> {
    body: &'b [u8],
    names: &'n [&'n str],
}

impl<'de, 'n> Visitor<'de> for Spans<'de, 'n> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let open = self.body.iter().position(|b| *b == b'{').unwrap_or(0);
        let mut found = Found { open, members: 0, spans: Vec::new() };
        while let Some(key) = map.next_key_seed(Name)? {
            found.members += 1;
            let raw: &'de RawValue = map.next_value()?;
            if let Some(i) = self.names.iter().position(|n| *n == key) {
                let start = offset_in(self.body, raw.get().as_bytes())
                    .ok_or_else(|| de::Error::custom("value outside the body"))?;
                found.spans.push((i, start, start + raw.get().len()));
            }
        }
        Ok(found)
    }
}

/// Where `part`, a slice of `whole`, starts in it.
fn offset_in(whole: &[u8], part: &[u8]) -> Option<usize> {
    let start = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    (start + part.len() <= whole.len()).then_some(start)
}

/// A member's name, decoded, borrowed from the body when it has no escapes.
struct Name;

impl<'de> DeserializeSeed<'de> for Name {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Name {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;
    use serde_json::json;

    fn rid(value: &str) -> Member {
        Member::new("rid", &json!(value))
    }

    #[test]
    fn a_member_is_inserted_first_and_everything_else_travels_as_sent() {
        let body = br#" { "model" : "m",  "x": 1e400, "messages": [] } "#;
        let out = with_members(body, &[rid("r1")]).unwrap();
        assert_eq!(out, br#" {"rid":"r1", "model" : "m",  "x": 1e400, "messages": [] } "#.to_vec());
        assert_eq!(with_members(b"{ }", &[rid("r")]).unwrap(), br#"{"rid":"r" }"#.to_vec());
    }

    #[test]
    fn every_copy_of_a_member_is_overwritten_whatever_its_spelling() {
        let body = br#"{"rid": null, "model": "m", "r\u0069d": ["a", "b"], "rid": {"x": 1}}"#;
        let out = with_members(body, &[rid("ours"), Member::new("routed_dp_rank", &json!(2))]).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"routed_dp_rank":2,"rid": "ours", "model": "m", "r\u0069d": "ours", "rid": "ours"}"#
        );
    }

    /// An inserted member replaces the bytes up to the `{` only; a member written over replaces
    /// them up to the end of its last copy.
    #[test]
    fn an_edit_replaces_only_the_bytes_before_the_last_member_written() {
        let body = br#" {"model": "m", "messages": [], "x": "a long tail"}"#;
        let edit = edit_members(body, &[rid("r1")]).unwrap();
        assert_eq!((edit.replaced, edit.head.as_slice()), (2, &br#" {"rid":"r1","#[..]));
        assert_eq!(edit.len, edit.apply(body).len());
        let body = br#"{"model": "m", "rid": 7, "messages": []}"#;
        let edit = edit_members(body, &[rid("r1")]).unwrap();
        assert_eq!(edit.head, br#"{"model": "m", "rid": "r1""#.to_vec());
        assert_eq!(edit.apply(body), br#"{"model": "m", "rid": "r1", "messages": []}"#.to_vec());
        assert_eq!(edit.len, edit.apply(body).len());
    }

    /// A validated body in which no name of the set appears takes the members first without a
    /// second pass: the same bytes as the full edit, whatever the spacing.
    #[test]
    fn a_validated_body_without_the_names_is_edited_as_the_full_edit_would() {
        let set = [rid("r1"), Member::new("routed_dp_rank", &json!(1))];
        for body in [
            &br#"{"model": "m", "messages": [{"role": "user", "content": "routing"}]}"#[..],
            b" \n{ }",
            b"{}",
            br#"{"model":"m","meta":{"x":[1e400]}}"#,
            // The names appear, or could be spelled with escapes: the full edit.
            br#"{"model": "m", "rid": 1, "messages": []}"#,
            br#"{"model": "m", "r\u0069d": 1}"#,
            br#"{"model": "m", "messages": [{"content": "a grid"}]}"#,
        ] {
            let (fast, full) = (edit_validated(body, &set).unwrap(), edit_members(body, &set).unwrap());
            assert_eq!(fast.apply(body), full.apply(body), "{}", String::from_utf8_lossy(body));
            assert_eq!(fast.len, full.len);
        }
        let edit = edit_validated(br#"{"model": "m"}"#, &set).unwrap();
        assert_eq!((edit.replaced, edit.head.as_slice()), (1, &br#"{"rid":"r1","routed_dp_rank":1,"#[..]));
    }

    #[test]
    fn only_an_object_is_edited() {
        for bad in [&b"[1]"[..], b"\"s\"", b"{\"a\": }", b"{} {}", b""] {
            assert!(with_members(bad, &[rid("r")]).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(with_members(b"[1]", &[]).unwrap(), b"[1]", "nothing to set: untouched");
    }

    #[test]
    fn nested_members_of_the_same_name_are_left_alone() {
        let body = br#"{"meta": {"rid": "inner"}, "rid": "outer"}"#;
        let out = with_members(body, &[rid("ours")]).unwrap();
        assert_eq!(out, br#"{"meta": {"rid": "inner"}, "rid": "ours"}"#.to_vec());
    }
}
