//! KV events as SGLang publishes them (`--kv-events tcp://HOST:PORT`): ZeroMQ PUB frames
//! `[topic, seq as 8 bytes big-endian, msgpack EventBatch]`, the batch `[ts, events, dp_rank]`,
//! each event a map tagged by `type` (BlockStored on prefill, BlockRemoved on eviction,
//! AllBlocksCleared on a flush). With `--kv-events-replay`, a ROUTER answers replay requests from
//! the last batches, ending with sequence -1, as SGLang's publisher does. Each data-parallel rank
//! publishes on its own, on the ports offset by its rank.
//!
//! With `--kv-events-sglang MODULE` the batches go out through SGLang's own `ZmqEventPublisher`
//! instead (the module from its wheel, run by `sglang_publisher.py`): the engine's wire, replay
//! buffer and framing are then SGLang's, not this project's idea of them.

use std::collections::VecDeque;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::kv::Served;

/// Batches kept for replay (SGLang's `buffer_steps` default is 10,000).
const REPLAY_BATCHES: usize = 10_000;
/// SGLang's publisher, driven over stdin.
const SGLANG_PUBLISHER: &str = include_str!("../sglang_publisher.py");

type Buffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// Where a rank's batches go.
enum Sink {
    /// This simulator's own ZeroMQ sockets.
    Own(mpsc::UnboundedSender<Vec<Value>>),
    /// SGLang's publisher process: one JSON line per batch.
    Sglang(Mutex<(Child, std::process::ChildStdin)>),
}

pub struct Publisher {
    sink: Sink,
    page: u64,
    medium: String,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Sink::Sglang(process) = &self.sink {
            if let Ok(mut p) = process.lock() {
                let _ = p.0.kill();
                let _ = p.0.wait();
            }
        }
    }
}

/// SGLang publishes hashes as signed 64-bit integers.
fn hash(h: u64) -> Value {
    json!(h as i64)
}

/// `tcp://host:port` with the port offset by `rank`.
pub fn offset(endpoint: &str, rank: u32) -> String {
    match endpoint.rsplit_once(':').and_then(|(base, port)| Some((base, port.parse::<u32>().ok()?))) {
        Some((base, port)) => format!("{base}:{}", port + rank),
        None => endpoint.to_string(),
    }
}

fn port_of(endpoint: &str) -> Result<u16, String> {
    endpoint.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).ok_or_else(|| format!("no port in {endpoint}"))
}

/// How rank `rank` publishes.
pub struct PublisherSpec<'a> {
    pub endpoint: &'a str,
    pub replay: Option<&'a str>,
    pub rank: u32,
    pub page: u64,
    pub medium: &'a str,
    /// SGLang's `kv_events.py` and the Python that runs it, to publish through SGLang's own code.
    pub sglang: Option<(&'a std::path::Path, &'a str)>,
}

impl Publisher {
    /// Binds the rank's PUB (and replay ROUTER) sockets — or starts SGLang's publisher on them —
    /// and starts publishing.
    pub async fn start(spec: PublisherSpec<'_>) -> Result<Self, String> {
        let (page, medium) = (spec.page, spec.medium.to_string());
        if let Some((module, python)) = spec.sglang {
            // SGLang offsets the ports by the rank itself: it gets the base ones.
            let events = port_of(spec.endpoint)?;
            let replay = spec.replay.map(port_of).transpose()?.unwrap_or(0);
            let mut child = Command::new(python)
                .args(["-c", SGLANG_PUBLISHER])
                .arg(module)
                .args([events.to_string(), replay.to_string(), spec.rank.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("cannot start SGLang's publisher with {python}: {e}"))?;
            let stdin = child.stdin.take().ok_or("no stdin")?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            // Python starts slowly: the ranks' publishers start side by side, each waited for off
            // the async workers.
            let ready = tokio::task::spawn_blocking(move || {
                let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
                match lines.next() {
                    Some(Ok(line)) if line.trim() == "ready" => {}
                    other => return Err(format!("SGLang's publisher did not start: {other:?}")),
                }
                // Its acknowledgements are read and dropped, so its stdout never fills.
                std::thread::spawn(move || lines.for_each(drop));
                Ok(())
            });
            ready.await.map_err(|e| e.to_string())??;
            return Ok(Self { sink: Sink::Sglang(Mutex::new((child, stdin))), page, medium });
        }
        let endpoint = offset(spec.endpoint, spec.rank);
        let mut socket = PubSocket::new();
        socket.bind(&endpoint).await.map_err(|e| format!("cannot bind {endpoint}: {e}"))?;
        let buffer: Buffer = Arc::default();
        if let Some(replay) = spec.replay.map(|r| offset(r, spec.rank)) {
            let mut router = RouterSocket::new();
            router.bind(&replay).await.map_err(|e| format!("cannot bind {replay}: {e}"))?;
            tokio::spawn(serve_replay(router, Arc::clone(&buffer)));
        }
        let rank = spec.rank;
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Value>>();
        tokio::spawn(async move {
            let mut seq = 0u64;
            while let Some(events) = rx.recv().await {
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(0.0);
                let Ok(payload) = rmp_serde::to_vec(&(ts, events, rank)) else { continue };
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
        Ok(Self { sink: Sink::Own(tx), page, medium })
    }

    fn send(&self, events: Vec<Value>) {
        match &self.sink {
            Sink::Own(tx) => {
                let _ = tx.send(events);
            }
            Sink::Sglang(process) => {
                if let Ok(mut p) = process.lock() {
                    let _ = writeln!(p.1, "{}", json!({"events": events}));
                }
            }
        }
    }

    /// One batch for what a request stored and evicted.
    pub fn served(&self, served: &Served) {
        let mut events: Vec<Value> = served
            .stored
            .iter()
            .map(|p| {
                json!({
                    "type": "BlockStored",
                    "block_hashes": [hash(p.hash)],
                    "parent_block_hash": p.parent.map_or(Value::Null, hash),
                    "token_ids": p.tokens,
                    "block_size": self.page,
                    "medium": self.medium,
                })
            })
            .collect();
        if !served.evicted.is_empty() {
            events.push(json!({
                "type": "BlockRemoved",
                "block_hashes": served.evicted.iter().map(|h| hash(*h)).collect::<Vec<_>>(),
                "medium": self.medium,
            }));
        }
        if !events.is_empty() {
            self.send(events);
        }
    }

    pub fn cleared(&self) {
        self.send(vec![json!({"type": "AllBlocksCleared"})]);
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
