//! Engine KV events (spec §7, KV_EVENTS_NOTES): SGLang's and vLLM's ZeroMQ frames
//! `[topic, seq (8 bytes big-endian), msgpack payload]`, decoded into one normalized form.
//!
//! Accepted payloads: the batch as a positional array `[ts, events, dp_rank?]` (SGLang) or as a map
//! `{ts, events, data_parallel_rank | attn_dp_rank}` (vLLM); each event as a map tagged by `type`
//! (current SGLang and vLLM) or as a positional array whose first element is the type name (older
//! SGLang and vLLM, trailing fields that equal their defaults omitted). Engine block hashes are
//! opaque ids: integers are kept, byte strings (vLLM's non-integer hashes) are folded to 64 bits.

use rmpv::Value;

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
    let value: Value = rmp_serde::from_slice(payload).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank").or_else(|| field(&value, "attn_dp_rank")),
        ),
        other => return Err(shape("batch", format!("expected an array or a map, got {other}"))),
    };
    let events = match events {
        Some(Value::Array(events)) => events.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?,
        _ => return Err(shape("batch", "no event list")),
    };
    Ok(EventBatch {
        ts: ts.and_then(Value::as_f64).unwrap_or(0.0),
        events,
        dp_rank: rank.and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok()),
    })
}

fn field<'a>(value: &'a Value, name: &str) -> Option<&'a Value> {
    match value {
        Value::Map(entries) => entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v),
        _ => None,
    }
}

/// Field `name` of an event, by name in the map form, by `position` (after the tag) in the
/// positional form.
struct Fields<'a> {
    value: &'a Value,
    positional: Option<&'a [Value]>,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str, position: usize) -> Option<&'a Value> {
        let v = match self.positional {
            Some(items) => items.get(position + 1),
            None => field(self.value, name),
        };
        v.filter(|v| !v.is_nil())
    }
}

fn decode_event(value: &Value) -> Result<KvEvent, DecodeError> {
    let (kind, fields) = match value {
        Value::Map(_) => (field(value, "type").and_then(Value::as_str), Fields { value, positional: None }),
        Value::Array(items) => (items.first().and_then(Value::as_str), Fields { value, positional: Some(items) }),
        other => return Err(shape("event", format!("expected a map or an array, got {other}"))),
    };
    match kind {
        Some("BlockStored") => {
            let block_hashes = hashes(fields.get("block_hashes", 0))?;
            let token_ids = match fields.get("token_ids", 2) {
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| shape("BlockStored", "a token id is not a u32"))?,
                _ => return Err(shape("BlockStored", "no token_ids")),
            };
            let block_size = fields
                .get("block_size", 3)
                .and_then(Value::as_u64)
                .and_then(|b| usize::try_from(b).ok())
                .filter(|b| *b > 0)
                .ok_or_else(|| shape("BlockStored", "no positive block_size"))?;
            if token_ids.len() != block_size.saturating_mul(block_hashes.len()) {
                return Err(shape(
                    "BlockStored",
                    format!("{} tokens for {} blocks of {block_size}", token_ids.len(), block_hashes.len()),
                ));
            }
            // Map form only: SGLang's and vLLM's positional forms put different fields after medium.
            let lora_name = fields.positional.is_none().then(|| fields.get("lora_name", usize::MAX)).flatten();
            let lora = lora_name
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| fields.get("lora_id", 4).and_then(Value::as_i64).map(|id| format!("lora-id:{id}")));
            Ok(KvEvent::Stored(StoredBlocks {
                block_hashes,
                parent: fields.get("parent_block_hash", 1).map(hash).transpose()?,
                token_ids,
                block_size,
                lora,
                medium: Medium::parse(fields.get("medium", 5).and_then(Value::as_str)),
                cache_salt: fields
                    .positional
                    .is_none()
                    .then(|| fields.get("cache_salt", usize::MAX))
                    .flatten()
                    .and_then(Value::as_str)
                    .map(str::to_string),
            }))
        }
        Some("BlockRemoved") => Ok(KvEvent::Removed {
            block_hashes: hashes(fields.get("block_hashes", 0))?,
            medium: Medium::parse(fields.get("medium", 1).and_then(Value::as_str)),
        }),
        Some("AllBlocksCleared") => Ok(KvEvent::AllCleared),
        Some(other) => Err(shape("event", format!("unknown type `{other}`"))),
        None => Err(shape("event", "no type tag")),
    }
}

fn hashes(value: Option<&Value>) -> Result<Vec<EngineHash>, DecodeError> {
    match value {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => Err(shape("event", "no block_hashes list")),
    }
}

/// An integer as its 64 bits (SGLang's are signed), bytes folded with FNV-1a.
fn hash(value: &Value) -> Result<EngineHash, DecodeError> {
    if let Some(i) = value.as_i64() {
        return Ok(i as u64);
    }
    if let Some(u) = value.as_u64() {
        return Ok(u);
    }
    match value {
        Value::Binary(bytes) => {
            Ok(bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)))
        }
        other => Err(shape("block hash", format!("expected an integer or bytes, got {other}"))),
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
