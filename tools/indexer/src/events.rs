//! Engine KV events (spec §7, KV_EVENTS_NOTES): SGLang's and vLLM's ZeroMQ frames
//! `[topic, seq (8 bytes big-endian), msgpack payload]`, decoded into one normalized form.
//!
//! Accepted payloads: the batch as a positional array `[ts, events, dp_rank?]` (SGLang) or as a map
//! `{ts, events, data_parallel_rank | attn_dp_rank}` (vLLM); each event as a map tagged by `type`
//! (current SGLang and vLLM) or as a positional array whose first element is the type name (older
//! SGLang and vLLM, trailing fields that equal their defaults omitted). Engine block hashes are
//! opaque ids: integers are kept, byte strings (vLLM's non-integer hashes) are folded to 64 bits.

/// Where an engine keeps a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    Gpu,
    CpuPinned,
    Disk,
    External,
}

impl Medium {
    pub const ALL: [Medium; 4] = [Medium::Gpu, Medium::CpuPinned, Medium::Disk, Medium::External];

    /// Unknown or absent media are the GPU, as both engines default.
    pub fn parse(name: Option<&str>) -> Self {
        match name.map(str::to_ascii_uppercase).as_deref() {
            Some("CPU_PINNED" | "CPU") => Medium::CpuPinned,
            Some("DISK") => Medium::Disk,
            Some("EXTERNAL") => Medium::External,
            _ => Medium::Gpu,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::CpuPinned => "CPU_PINNED",
            Medium::Disk => "DISK",
            Medium::External => "EXTERNAL",
        }
    }
}

/// An engine's id for one of its blocks.
pub type EngineHash = u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBlocks {
    pub block_hashes: Vec<EngineHash>,
    pub parent: Option<EngineHash>,
    /// The tokens of every block, in order (`block_size` per block).
    pub token_ids: Vec<u32>,
    pub block_size: usize,
    /// The LoRA adapter: its name when published, else its numeric id.
    pub lora: Option<String>,
    pub medium: Medium,
    pub cache_salt: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    Stored(StoredBlocks),
    Removed { block_hashes: Vec<EngineHash>, medium: Medium },
    AllCleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("malformed {what}: {why}")]
    Shape { what: &'static str, why: String },
    #[error("unexpected frame count {0} (live: topic, seq, payload; replay: delimiter, [topic,] seq, payload)")]
    Frames(usize),
}

fn shape(what: &'static str, why: impl Into<String>) -> DecodeError {
    DecodeError::Shape { what, why: why.into() }
}

/// `[topic, seq, payload]` → the sequence number and the batch.
pub fn decode_frames(frames: &[impl AsRef<[u8]>]) -> Result<(u64, EventBatch), DecodeError> {
    let [_, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    Ok((decode_seq(seq.as_ref())?, decode_batch(payload.as_ref())?))
}

/// A replay answer after the DEALER stripped the identity: SGLang's `["", topic, seq, payload]`,
/// vLLM's `["", seq, payload]`. The end of a replay is seq -1 (read as `u64::MAX`).
pub fn replay_frames<B: AsRef<[u8]>>(frames: &[B]) -> Result<(u64, &[u8]), DecodeError> {
    match frames {
        [delimiter, _, seq, payload] | [delimiter, seq, payload] if delimiter.as_ref().is_empty() => {
            Ok((decode_seq(seq.as_ref())?, payload.as_ref()))
        }
        _ => Err(DecodeError::Frames(frames.len())),
    }
}

/// The 8-byte big-endian sequence number (`-1` ends a replay).
pub fn decode_seq(bytes: &[u8]) -> Result<u64, DecodeError> {
    let array: [u8; 8] = bytes.try_into().map_err(|_| shape("sequence number", format!("{} bytes", bytes.len())))?;
    Ok(u64::from_be_bytes(array))
}

pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let batch: RawBatch = rmp_serde::from_slice(payload).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let events = batch.events.ok_or_else(|| shape("batch", "no event list"))?;
    Ok(EventBatch {
        ts: batch.ts,
        events: events.into_iter().map(RawEvent::into_event).collect::<Result<_, _>>()?,
        dp_rank: batch.dp_rank,
    })
}

// The payload is decoded straight into these, field by field, without a tree of values: both
// engines' forms (positional or named) meet in the same raw fields, checked once decoded.

/// A batch as either engine sends it.
struct RawBatch {
    ts: f64,
    events: Option<Vec<RawEvent>>,
    dp_rank: Option<u32>,
}

/// One event's fields, whichever form carried them.
#[derive(Default)]
struct RawEvent {
    kind: Option<Kind>,
    block_hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u64>,
    lora_id: Option<i64>,
    lora_name: Option<String>,
    medium: Option<Medium>,
    cache_salt: Option<String>,
}

enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown(String),
}

/// A field read leniently: what is not of its type counts as absent.
struct Lenient<T>(Option<T>);

/// An engine block hash: an integer as its 64 bits (SGLang's are signed), bytes folded with FNV-1a.
struct Hash(EngineHash);

impl RawEvent {
    fn into_event(self) -> Result<KvEvent, DecodeError> {
        match self.kind {
            Some(Kind::Stored) => {
                let block_hashes = self.block_hashes.ok_or_else(|| shape("event", "no block_hashes list"))?;
                let token_ids = self.token_ids.ok_or_else(|| shape("BlockStored", "no token_ids"))?;
                let block_size = self
                    .block_size
                    .and_then(|b| usize::try_from(b).ok())
                    .filter(|b| *b > 0)
                    .ok_or_else(|| shape("BlockStored", "no positive block_size"))?;
                if token_ids.len() != block_size.saturating_mul(block_hashes.len()) {
                    return Err(shape(
                        "BlockStored",
                        format!("{} tokens for {} blocks of {block_size}", token_ids.len(), block_hashes.len()),
                    ));
                }
                Ok(KvEvent::Stored(StoredBlocks {
                    block_hashes,
                    parent: self.parent,
                    token_ids,
                    block_size,
                    lora: self.lora_name.or_else(|| self.lora_id.map(|id| format!("lora-id:{id}"))),
                    medium: self.medium.unwrap_or(Medium::Gpu),
                    cache_salt: self.cache_salt,
                }))
            }
            Some(Kind::Removed) => Ok(KvEvent::Removed {
                block_hashes: self.block_hashes.ok_or_else(|| shape("event", "no block_hashes list"))?,
                medium: self.medium.unwrap_or(Medium::Gpu),
            }),
            Some(Kind::Cleared) => Ok(KvEvent::AllCleared),
            Some(Kind::Unknown(other)) => Err(shape("event", format!("unknown type `{other}`"))),
            None => Err(shape("event", "no type tag")),
        }
    }
}

mod raw {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    use super::{EngineHash, Hash, Kind, Lenient, Medium, RawBatch, RawEvent};

    impl<'de> Deserialize<'de> for RawBatch {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(BatchVisitor)
        }
    }

    struct BatchVisitor;

    impl<'de> Visitor<'de> for BatchVisitor {
        type Value = RawBatch;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an event batch: an array or a map")
        }

        /// SGLang: `[ts, events, dp_rank?]`.
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawBatch, A::Error> {
            let ts = seq.next_element::<Lenient<f64>>()?.and_then(|t| t.0).unwrap_or(0.0);
            let events = seq.next_element::<Option<Vec<RawEvent>>>()?.flatten();
            let dp_rank = seq.next_element::<Lenient<u32>>()?.and_then(|r| r.0);
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(RawBatch { ts, events, dp_rank })
        }

        /// vLLM: `{ts, events, data_parallel_rank | attn_dp_rank}`.
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawBatch, A::Error> {
            let mut batch = RawBatch { ts: 0.0, events: None, dp_rank: None };
            while let Some(key) = map.next_key::<Lenient<&str>>()? {
                match key.0 {
                    Some("ts") => batch.ts = map.next_value::<Lenient<f64>>()?.0.unwrap_or(0.0),
                    Some("events") => batch.events = map.next_value()?,
                    Some("data_parallel_rank" | "attn_dp_rank") => {
                        let rank = map.next_value::<Lenient<u32>>()?.0;
                        batch.dp_rank = batch.dp_rank.or(rank);
                    }
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(batch)
        }
    }

    impl<'de> Deserialize<'de> for RawEvent {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(EventVisitor)
        }
    }

    struct EventVisitor;

    impl<'de> Visitor<'de> for EventVisitor {
        type Value = RawEvent;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an event: a map tagged by `type`, or an array led by its type")
        }

        /// `[type, block_hashes, parent, token_ids, block_size, lora_id, medium]` for a stored
        /// block, `[type, block_hashes, medium]` for a removal; trailing defaults may be omitted.
        /// SGLang's and vLLM's positional forms differ after `medium`: what follows is ignored.
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawEvent, A::Error> {
            let mut event =
                RawEvent { kind: seq.next_element::<Lenient<Kind>>()?.and_then(|k| k.0), ..RawEvent::default() };
            let stored = matches!(event.kind, Some(Kind::Stored));
            if matches!(event.kind, Some(Kind::Stored | Kind::Removed)) {
                event.block_hashes = seq.next_element::<Option<Vec<Hash>>>()?.flatten().map(hashes);
            }
            if stored {
                event.parent = seq.next_element::<Option<Hash>>()?.flatten().map(|h| h.0);
                event.token_ids = seq.next_element::<Option<Vec<u32>>>()?.flatten();
                event.block_size = seq.next_element::<Lenient<u64>>()?.and_then(|b| b.0);
                event.lora_id = seq.next_element::<Lenient<i64>>()?.and_then(|l| l.0);
            }
            event.medium = seq.next_element::<Lenient<&str>>()?.and_then(|m| m.0).map(|m| Medium::parse(Some(m)));
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(event)
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEvent, A::Error> {
            let mut event = RawEvent::default();
            while let Some(key) = map.next_key::<Lenient<&str>>()? {
                match key.0 {
                    Some("type") => event.kind = map.next_value::<Lenient<Kind>>()?.0,
                    Some("block_hashes") => event.block_hashes = map.next_value::<Option<Vec<Hash>>>()?.map(hashes),
                    Some("parent_block_hash") => event.parent = map.next_value::<Option<Hash>>()?.map(|h| h.0),
                    Some("token_ids") => event.token_ids = map.next_value()?,
                    Some("block_size") => event.block_size = map.next_value::<Lenient<u64>>()?.0,
                    Some("lora_id") => event.lora_id = map.next_value::<Lenient<i64>>()?.0,
                    Some("lora_name") => event.lora_name = map.next_value::<Lenient<&str>>()?.0.map(str::to_string),
                    Some("medium") => {
                        event.medium = map.next_value::<Lenient<&str>>()?.0.map(|m| Medium::parse(Some(m)))
                    }
                    Some("cache_salt") => event.cache_salt = map.next_value::<Lenient<&str>>()?.0.map(str::to_string),
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(event)
        }
    }

    fn hashes(list: Vec<Hash>) -> Vec<EngineHash> {
        list.into_iter().map(|h| h.0).collect()
    }

    impl<'de> Deserialize<'de> for Hash {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(HashVisitor)
        }
    }

    struct HashVisitor;

    impl Visitor<'_> for HashVisitor {
        type Value = Hash;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a block hash: an integer or bytes")
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Hash, E> {
            Ok(Hash(v as u64))
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Hash, E> {
            Ok(Hash(v))
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Hash, E> {
            Ok(Hash(v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))))
        }
    }

    impl<'de> Deserialize<'de> for Kind {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let name = <&str>::deserialize(d)?;
            Ok(match name {
                "BlockStored" => Kind::Stored,
                "BlockRemoved" => Kind::Removed,
                "AllBlocksCleared" => Kind::Cleared,
                other => Kind::Unknown(other.to_string()),
            })
        }
    }

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Lenient<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(LenientVisitor(PhantomData))
        }
    }

    /// Hands a value of `T`'s kind to `T`, and takes anything else (nil included) as absent.
    struct LenientVisitor<T>(PhantomData<T>);

    macro_rules! forward {
        ($($method:ident: $ty:ty),* $(,)?) => {
            $(fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                Ok(Lenient(T::deserialize(de::IntoDeserializer::<E>::into_deserializer(v)).ok()))
            })*
        };
    }

    impl<'de, T: Deserialize<'de>> Visitor<'de> for LenientVisitor<T> {
        type Value = Lenient<T>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any value")
        }

        forward!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64);

        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Lenient(T::deserialize(de::value::BorrowedStrDeserializer::<E>::new(v)).ok()))
        }

        fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
            Ok(Lenient(None))
        }

        fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Self::Value, E> {
            Ok(Lenient(None))
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Lenient(None))
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(Lenient(None))
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Lenient(None))
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Lenient(None))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value as V;

    fn pack(v: &V) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> V {
        V::from(x)
    }

    fn ints(xs: &[i64]) -> V {
        V::Array(xs.iter().map(|x| V::from(*x)).collect())
    }

    fn map(kv: Vec<(&str, V)>) -> V {
        V::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
    }

    /// SGLang today: a positional batch whose events are maps tagged by `type`, defaults omitted.
    #[test]
    fn sglang_tagged_map_events() {
        let stored = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", ints(&[-5, 7])),
            ("parent_block_hash", V::Nil),
            ("token_ids", ints(&[1, 2])),
            ("block_size", V::from(1)),
            ("lora_id", V::Nil),
            ("medium", s("CPU_PINNED")),
            ("cache_salt", s("tenant-a")),
            ("lora_name", s("sql-adapter")),
        ]);
        let removed = map(vec![("type", s("BlockRemoved")), ("block_hashes", ints(&[7])), ("medium", s("GPU"))]);
        let cleared = map(vec![("type", s("AllBlocksCleared"))]);
        let batch = V::Array(vec![V::from(1.5), V::Array(vec![stored, removed, cleared]), V::from(2)]);
        let frames = [b"topic".to_vec(), 42u64.to_be_bytes().to_vec(), pack(&batch)];
        let (seq, b) = decode_frames(&frames).unwrap();
        assert_eq!((seq, b.ts, b.dp_rank), (42, 1.5, Some(2)));
        assert_eq!(
            b.events[0],
            KvEvent::Stored(StoredBlocks {
                block_hashes: vec![-5i64 as u64, 7],
                parent: None,
                token_ids: vec![1, 2],
                block_size: 1,
                lora: Some("sql-adapter".into()),
                medium: Medium::CpuPinned,
                cache_salt: Some("tenant-a".into()),
            })
        );
        assert_eq!(b.events[1], KvEvent::Removed { block_hashes: vec![7], medium: Medium::Gpu });
        assert_eq!(b.events[2], KvEvent::AllCleared);
    }

    /// Older SGLang (msgspec `array_like=True, tag=True`): every event an array led by its type,
    /// the batch `[ts, events]` with no rank, trailing defaults omitted.
    #[test]
    fn older_positional_events() {
        let stored = V::Array(vec![s("BlockStored"), ints(&[11, 12]), V::from(10), ints(&[5, 6, 7, 8]), V::from(2)]);
        let with_lora =
            V::Array(vec![s("BlockStored"), ints(&[13]), V::from(12), ints(&[9]), V::from(1), V::from(3), s("DISK")]);
        let removed = V::Array(vec![s("BlockRemoved"), ints(&[11])]);
        let batch = V::Array(vec![
            V::from(0.0),
            V::Array(vec![stored, with_lora, removed, V::Array(vec![s("AllBlocksCleared")])]),
        ]);
        let b = decode_batch(&pack(&batch)).unwrap();
        assert_eq!(b.dp_rank, None);
        match &b.events[0] {
            KvEvent::Stored(s) => {
                assert_eq!((s.parent, s.block_size, s.token_ids.len(), s.medium), (Some(10), 2, 4, Medium::Gpu));
                assert_eq!(s.lora, None);
            }
            other => panic!("{other:?}"),
        }
        match &b.events[1] {
            KvEvent::Stored(s) => assert_eq!((s.lora.as_deref(), s.medium), (Some("lora-id:3"), Medium::Disk)),
            other => panic!("{other:?}"),
        }
        assert_eq!(b.events[2], KvEvent::Removed { block_hashes: vec![11], medium: Medium::Gpu });
        assert_eq!(b.events[3], KvEvent::AllCleared);
    }

    /// vLLM: the batch is a map with `data_parallel_rank`; hashes may be byte strings; extra fields
    /// (extra_keys, group_idx, kv_cache_spec_*) are ignored.
    #[test]
    fn vllm_map_batch_with_byte_hashes() {
        let stored = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", V::Array(vec![V::Binary(vec![1, 2, 3]), V::Binary(vec![4])])),
            ("parent_block_hash", V::Binary(vec![9])),
            ("token_ids", ints(&(0..32).collect::<Vec<_>>())),
            ("block_size", V::from(16)),
            ("lora_id", V::Nil),
            ("medium", s("GPU")),
            ("lora_name", V::Nil),
            ("extra_keys", V::Array(vec![V::Nil, V::Nil])),
            ("group_idx", V::from(0)),
        ]);
        let removed = map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", V::Array(vec![V::Binary(vec![4])])),
            ("medium", V::Nil),
        ]);
        let batch = map(vec![
            ("ts", V::from(3.0)),
            ("events", V::Array(vec![stored, removed])),
            ("data_parallel_rank", V::from(1)),
        ]);
        let b = decode_batch(&pack(&batch)).unwrap();
        assert_eq!(b.dp_rank, Some(1));
        let KvEvent::Stored(stored) = &b.events[0] else { panic!("{:?}", b.events[0]) };
        let KvEvent::Removed { block_hashes, .. } = &b.events[1] else { panic!("{:?}", b.events[1]) };
        assert_eq!(stored.block_hashes[1], block_hashes[0], "the same bytes fold to the same id");
        assert_ne!(stored.block_hashes[0], stored.block_hashes[1]);
        assert!(stored.parent.is_some());
    }

    #[test]
    fn malformed_payloads_are_errors_not_panics() {
        assert!(decode_batch(b"\xc1").is_err());
        assert!(decode_batch(&pack(&V::from(3))).is_err());
        let bad_tokens = V::Array(vec![
            V::from(0.0),
            V::Array(vec![V::Array(vec![s("BlockStored"), ints(&[1]), V::Nil, ints(&[1, 2, 3]), V::from(2)])]),
        ]);
        assert!(decode_batch(&pack(&bad_tokens)).is_err(), "3 tokens cannot be one block of 2");
        let unknown = V::Array(vec![V::from(0.0), V::Array(vec![map(vec![("type", s("Teleported"))])])]);
        assert!(decode_batch(&pack(&unknown)).is_err());
        assert!(decode_frames(&[b"t".to_vec()]).is_err());
        assert!(decode_seq(b"short").is_err());
        assert_eq!(decode_seq(&(-1i64).to_be_bytes()).unwrap(), u64::MAX, "the replay's end marker");
    }

    /// SGLang 0.5.23's ROUTER answers with a topic frame (four frames once the DEALER strips the
    /// identity), vLLM's without; both end with seq -1 and an empty payload.
    #[test]
    fn replay_answers_of_both_engines_are_read() {
        let seq = 7u64.to_be_bytes().to_vec();
        let end = (-1i64).to_be_bytes().to_vec();
        let sglang = [vec![], b"kv".to_vec(), seq.clone(), b"payload".to_vec()];
        assert_eq!(replay_frames(&sglang).unwrap(), (7, &b"payload"[..]));
        let sglang_end = [vec![], vec![], end.clone(), vec![]];
        assert_eq!(replay_frames(&sglang_end).unwrap(), (u64::MAX, &b""[..]));
        let vllm = [vec![], seq.clone(), b"payload".to_vec()];
        assert_eq!(replay_frames(&vllm).unwrap(), (7, &b"payload"[..]));
        assert_eq!(replay_frames(&[vec![], end, vec![]]).unwrap().0, u64::MAX);
        assert!(replay_frames(&[b"x".to_vec(), seq.clone(), vec![]]).is_err(), "no delimiter");
        assert!(replay_frames(&[vec![], seq]).is_err());
    }
}
