//! A chat body read in one pass without building a JSON tree: the fields routing reads, as small
//! values, and each message's role and text borrowed from the request's own bytes (copied only
//! when the JSON string has escapes). Everything else in the body — tools, images, unknown fields
//! — is skipped, not kept. The PD rewrite is the one path that needs the whole body as a tree, and
//! parses it itself.
//!
//! Messages are read as leniently as before: a role or text part of an unexpected type reads as
//! absent, never as an error; only `messages` that is not an array is refused.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

/// The fields of a chat body routing reads. A scalar field is `None` when absent and
/// `Some(Value::Null)` when sent as `null`, as validation tells the two apart.
#[derive(Debug, Default, Deserialize)]
pub struct ChatBody<'a> {
    #[serde(default, deserialize_with = "present")]
    pub model: Option<Value>,
    #[serde(default, borrow)]
    pub messages: Messages<'a>,
    #[serde(default, deserialize_with = "present")]
    pub stream: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub n: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub max_tokens: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub max_completion_tokens: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub temperature: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub top_p: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub top_k: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub min_p: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub frequency_penalty: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub presence_penalty: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    pub repetition_penalty: Option<Value>,
}

impl ChatBody<'_> {
    /// A sampling field by its name (the names `validate_sampling` checks).
    pub fn field(&self, name: &str) -> Option<&Value> {
        match name {
            "n" => self.n.as_ref(),
            "max_tokens" => self.max_tokens.as_ref(),
            "max_completion_tokens" => self.max_completion_tokens.as_ref(),
            "temperature" => self.temperature.as_ref(),
            "top_p" => self.top_p.as_ref(),
            "top_k" => self.top_k.as_ref(),
            "min_p" => self.min_p.as_ref(),
            "frequency_penalty" => self.frequency_penalty.as_ref(),
            "presence_penalty" => self.presence_penalty.as_ref(),
            "repetition_penalty" => self.repetition_penalty.as_ref(),
            _ => None,
        }
    }
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// `messages`: absent, an array of messages, or anything else (refused by validation).
#[derive(Debug, Default)]
pub enum Messages<'a> {
    #[default]
    Absent,
    List(Vec<Message<'a>>),
    NotAnArray,
}

#[derive(Debug, Default, PartialEq)]
pub struct Message<'a> {
    pub role: Option<Cow<'a, str>>,
    /// The string content, or the text of each `{"type": "text"}` part, in order.
    pub texts: Vec<Cow<'a, str>>,
}

impl Message<'_> {
    pub fn text_bytes(&self) -> u64 {
        self.texts.iter().map(|t| t.len() as u64).fold(0, u64::saturating_add)
    }
}

/// The visits of a lenient visitor for scalars it does not expect: each reads as `$absent`.
macro_rules! other_scalars_read_as {
    ($absent:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($absent)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($absent)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($absent)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($absent)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($absent)
        }
    };
}

/// Likewise for a string where a visitor expects a container.
macro_rules! strings_read_as {
    ($absent:expr) => {
        fn visit_borrowed_str<E: de::Error>(self, _: &'de str) -> Result<Self::Value, E> {
            Ok($absent)
        }
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok($absent)
        }
    };
}

/// Skips whatever value is next (the lenient reading of an unexpected type).
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A string borrowed from the body when it can be; any other JSON value reads as `None`.
struct Text<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Borrowed(s))))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Owned(s.to_string()))))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Text(Some(Cow::Owned(s))))
            }
            other_scalars_read_as!(Text(None));
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Text(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Text(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// One message: its role and text; its other fields and non-text parts are skipped.
impl<'de: 'a, 'a> Deserialize<'de> for Message<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a message")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut message = Message::default();
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match key.as_ref() {
                        "role" => message.role = map.next_value::<Text>()?.0,
                        "content" => message.texts = map.next_value::<Content>()?.0,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(message)
            }
            // A message that is not an object has no role and no text.
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Message::default())
            }
            strings_read_as!(Message::default());
            other_scalars_read_as!(Message::default());
        }
        d.deserialize_any(V)
    }
}

/// `content`: a string is its text; an array contributes the `text` of its `type: "text"` parts.
struct Content<'a>(Vec<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("message content")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut texts = Vec::new();
                while let Some(part) = seq.next_element::<Part>()? {
                    texts.extend(part.0);
                }
                Ok(Content(texts))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Content(Vec::new()))
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(Content(vec![Cow::Borrowed(s)]))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Content(vec![Cow::Owned(s.to_string())]))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
                Ok(Content(vec![Cow::Owned(s)]))
            }
            other_scalars_read_as!(Content(Vec::new()));
        }
        d.deserialize_any(V)
    }
}

/// A content part: its text when its type is `text`.
struct Part<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Part<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let (mut kind, mut text) = (None, None);
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match key.as_ref() {
                        "type" => kind = map.next_value::<Text>()?.0,
                        "text" => text = map.next_value::<Text>()?.0,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Part(text.filter(|_| kind.as_deref() == Some("text"))))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Part(None))
            }
            strings_read_as!(Part(None));
            other_scalars_read_as!(Part(None));
        }
        d.deserialize_any(V)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Messages<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(4));
                while let Some(m) = seq.next_element::<Message>()? {
                    list.push(m);
                }
                Ok(Messages::List(list))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Messages::NotAnArray)
            }
            strings_read_as!(Messages::NotAnArray);
            other_scalars_read_as!(Messages::NotAnArray);
        }
        d.deserialize_any(V)
    }
}
