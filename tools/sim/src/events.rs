//! KV events as SGLang publishes them (`--kv-events tcp://HOST:PORT`): ZeroMQ PUB frames
//! `[topic, seq as 8 bytes big-endian, msgpack EventBatch]`, the batch `[ts, events, dp_rank]`,
//! each event a map tagged by `type` (BlockStored on prefill, BlockRemoved on eviction,
//! AllBlocksCleared on a flush). With `--kv-events-replay`, a ROUTER answers replay requests from
//! the last batches, ending with sequence -1, as SGLang's publisher does.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv::Served;

/// Batches kept for replay (SGLang's `buffer_steps` default is 10,000).
const REPLAY_BATCHES: usize = 10_000;

type Buffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

pub struct Publisher {
    tx: mpsc::UnboundedSender<Vec<Value>>,
    page: u64,
    medium: String,
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

/// SGLang publishes hashes as signed 64-bit integers.
fn hash(h: u64) -> Value {
    Value::from(h as i64)
}

impl Publisher {
    /// Binds the PUB (and replay ROUTER) sockets and starts the publishing task.
    pub async fn start(endpoint: &str, replay: Option<&str>, page: u64, medium: &str) -> Result<Self, String> {
        let mut socket = PubSocket::new();
        socket.bind(endpoint).await.map_err(|e| format!("cannot bind {endpoint}: {e}"))?;
        let buffer: Buffer = Arc::default();
        if let Some(replay) = replay {
            let mut router = RouterSocket::new();
            router.bind(replay).await.map_err(|e| format!("cannot bind {replay}: {e}"))?;
            tokio::spawn(serve_replay(router, Arc::clone(&buffer)));
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Value>>();
        tokio::spawn(async move {
            let mut seq = 0u64;
            while let Some(events) = rx.recv().await {
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                let batch = Value::Array(vec![Value::from(ts), Value::Array(events), Value::from(0)]);
                let mut payload = Vec::new();
                if rmpv::encode::write_value(&mut payload, &batch).is_err() {
                    continue;
                }
                if let Ok(mut b) = buffer.lock() {
                    b.push_back((seq, payload.clone()));
                    while b.len() > REPLAY_BATCHES {
                        b.pop_front();
                    }
                }
                let frames =
                    vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
                if let Ok(m) = ZmqMessage::try_from(frames) {
                    let _ = socket.send(m).await;
                }
                seq += 1;
            }
        });
        Ok(Self { tx, page, medium: medium.to_string() })
    }

    /// One batch for what a request stored and evicted.
    pub fn served(&self, served: &Served) {
        let mut events: Vec<Value> = served
            .stored
            .iter()
            .map(|p| {
                map(vec![
                    ("type", Value::from("BlockStored")),
                    ("block_hashes", Value::Array(vec![hash(p.hash)])),
                    ("parent_block_hash", p.parent.map_or(Value::Nil, hash)),
                    ("token_ids", Value::Array(p.tokens.iter().map(|t| Value::from(*t)).collect())),
                    ("block_size", Value::from(self.page)),
                    ("medium", Value::from(self.medium.as_str())),
                ])
            })
            .collect();
        if !served.evicted.is_empty() {
            events.push(map(vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", Value::Array(served.evicted.iter().map(|h| hash(*h)).collect())),
                ("medium", Value::from(self.medium.as_str())),
            ]));
        }
        if !events.is_empty() {
            let _ = self.tx.send(events);
        }
    }

    pub fn cleared(&self) {
        let _ = self.tx.send(vec![map(vec![("type", Value::from("AllBlocksCleared"))])]);
    }
}

/// `[identity, empty, start seq]` → every buffered batch from it, then `-1`.
async fn serve_replay(mut router: RouterSocket, buffer: Buffer) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (Some(id), Some(start)) = (frames.first().cloned(), frames.last()) else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else { continue };
        let past: Vec<(u64, Vec<u8>)> =
            buffer.lock().map(|b| b.iter().filter(|(s, _)| *s >= start).cloned().collect()).unwrap_or_default();
        for (seq, payload) in past {
            let m = vec![id.clone(), Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
            if let Ok(m) = ZmqMessage::try_from(m) {
                let _ = router.send(m).await;
            }
        }
        let end = vec![id, Bytes::new(), Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = router.send(m).await;
        }
    }
}
