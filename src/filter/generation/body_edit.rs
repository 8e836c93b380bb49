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

/// `body` with every member of `set` written: over each top-level member of its name, else first.
pub fn with_members(body: &[u8], set: &[Member]) -> Result<Vec<u8>, EditError> {
    if set.is_empty() {
        return Ok(body.to_vec());
    }
    let names: Vec<&str> = set.iter().map(|m| m.name).collect();
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = de.deserialize_map(Spans { body, names: &names }).map_err(|e| EditError(e.to_string()))?;
    de.end().map_err(|e| EditError(e.to_string()))?;
    let mut cuts: Vec<(usize, usize, &[u8])> = Vec::with_capacity(found.spans.len() + 1);
    let mut inserted = Vec::new();
    for (i, member) in set.iter().enumerate() {
        let mut any = false;
        for &(which, start, end) in &found.spans {
            if which == i {
                cuts.push((start, end, &member.value));
                any = true;
            }
        }
        if !any {
            if !inserted.is_empty() {
                inserted.push(b',');
            }
            inserted.push(b'"');
            inserted.extend_from_slice(member.name.as_bytes());
            inserted.extend_from_slice(b"\":");
            inserted.extend_from_slice(&member.value);
        }
    }
    if !inserted.is_empty() {
        if found.members > 0 {
            inserted.push(b',');
        }
        cuts.push((found.open + 1, found.open + 1, &inserted));
    }
    cuts.sort_by_key(|&(start, _, _)| start);
    let grown: usize = cuts.iter().map(|(_, _, v)| v.len()).sum();
    let mut out = Vec::with_capacity(body.len() + grown);
    let mut at = 0;
    for (start, end, value) in cuts {
        out.extend_from_slice(&body[at..start]);
        out.extend_from_slice(value);
        at = end;
    }
    out.extend_from_slice(&body[at..]);
    Ok(out)
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
