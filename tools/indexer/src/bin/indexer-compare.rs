//! `indexer-compare`: one KV indexer, whichever, measured from the outside over the wire it
//! serves — the same SGLang-format event stream on ZeroMQ and the same token-id queries over
//! HTTP — so `sgl-indexer` and Dynamo's standalone indexer can be put side by side.
//!
//! It binds one PUB socket per engine (`tcp://127.0.0.1:BASE+e`; start the indexer subscribed to
//! them), waits until the indexer sees every engine, publishes ENGINES × PAGES 16-token pages as
//! 2,048-token documents (one batch each, one BlockStored per page as SGLang sends them), and
//! times until the indexer answers every engine's last document in full. Then it checks a sample
//! of documents (pages dropped anywhere show there), and times 1k- and 32k-token `/query` calls.
//! Prints JSON.
//!
//! `indexer-compare --api sgl|dynamo --url http://127.0.0.1:PORT --base-port BASE [--engines 64]
//! [--pages 100000] [--pid PID] [--shared-prefix]` (with `--pid`, the indexer's resident memory
//! before and after).

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Parser, ValueEnum};
use rmpv::Value;
use serde_json::json;
use sgl_indexer::synthetic::{doc_tokens, percentile, rss_mib};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BLOCK: u32 = 16;
const DOC: u32 = 2048;
const MODEL: &str = "bench";
/// Documents per engine published before waiting for the indexer to catch up.
const CHUNK_DOCS: u32 = 8;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Api {
    /// sgl-indexer: `POST /query {"model", "token_ids"}` → `data.<worker>.matched_tokens`.
    Sgl,
    /// Dynamo: `POST /query {"token_ids", "model_name"}` → `scores.<worker>.<dp rank>` in tokens.
    Dynamo,
}

#[derive(Debug, Parser)]
struct Args {
    #[arg(long, value_enum)]
    api: Api,
    #[arg(long)]
    url: String,
    #[arg(long)]
    base_port: u16,
    #[arg(long, default_value_t = 64)]
    engines: u32,
    #[arg(long, default_value_t = 100_000)]
    pages: u32,
    #[arg(long)]
    pid: Option<u32>,
    /// Documents share their first 1,024 tokens in groups of 8, across engines.
    #[arg(long)]
    shared_prefix: bool,
}

/// Engine ids are 1-based integers, as Dynamo's `--workers` takes them.
fn worker(e: u32) -> String {
    (e + 1).to_string()
}

/// A document no other shares, published after each chunk: the indexer has caught up with the
/// chunk when every engine's is held.
fn sentinel(e: u32, chunk: u32) -> Vec<u32> {
    doc_tokens(4_000_000 + e * 10_000 + chunk, DOC, false)
}

fn doc_of(e: u32, k: u32) -> u32 {
    e * 131 + k * 17
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

/// One batch storing `tokens` as chained 16-token pages; hashes unique per engine and document.
fn batch(e: u32, k: u32, tokens: &[u32]) -> Vec<u8> {
    let mut parent: Option<i64> = None;
    let events: Vec<Value> = tokens
        .chunks(BLOCK as usize)
        .enumerate()
        .map(|(p, chunk)| {
            let hash = ((u64::from(e) << 44) | (u64::from(k) << 12) | p as u64) as i64;
            let event = map(vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", Value::Array(vec![Value::from(hash)])),
                ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                ("token_ids", Value::Array(chunk.iter().map(|t| Value::from(*t)).collect())),
                ("block_size", Value::from(BLOCK)),
                ("lora_id", Value::Nil),
                ("medium", Value::from("GPU")),
            ]);
            parent = Some(hash);
            event
        })
        .collect();
    let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let mut out = Vec::new();
    let _ =
        rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::from(ts), Value::Array(events), Value::from(0)]));
    out
}

struct Client {
    api: Api,
    url: String,
    agent: ureq::Agent,
}

impl Client {
    /// Tokens the indexer says `worker` holds of `tokens`, per its API.
    fn matched(&self, tokens: &[u32], worker: &str) -> Result<u64, String> {
        let body = match self.api {
            Api::Sgl => json!({"model": MODEL, "token_ids": tokens}),
            Api::Dynamo => json!({"token_ids": tokens, "model_name": MODEL}),
        };
        let mut response = self
            .agent
            .post(&format!("{}/query", self.url))
            .send_json(&body)
            .map_err(|e| format!("query failed: {e}"))?;
        let v: serde_json::Value = response.body_mut().read_json().map_err(|e| format!("answer not JSON: {e}"))?;
        Ok(match self.api {
            Api::Sgl => v["data"][worker]["matched_tokens"].as_u64().unwrap_or(0),
            Api::Dynamo => v["scores"][worker]
                .as_object()
                .map_or(0, |ranks| ranks.values().filter_map(serde_json::Value::as_u64).max().unwrap_or(0)),
        })
    }
}

async fn send(socket: &mut PubSocket, payload: Vec<u8>, seq: u64) -> Result<(), String> {
    let frames = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
    let message = ZmqMessage::try_from(frames).map_err(|e| format!("{e:?}"))?;
    socket.send(message).await.map_err(|e| e.to_string())
}

fn wait(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Result<Duration, String> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > limit {
            return Err(format!("timed out waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(started.elapsed())
}

// The sockets' I/O runs on the worker thread while the main thread blocks on HTTP queries.
#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let client = Client { api: args.api, url: args.url.clone(), agent: ureq::Agent::new_with_defaults() };
    let mut sockets = Vec::new();
    for e in 0..args.engines {
        let mut s = PubSocket::new();
        s.bind(&format!("tcp://127.0.0.1:{}", u32::from(args.base_port) + e)).await.map_err(|x| x.to_string())?;
        sockets.push(s);
    }
    let mut seq = vec![0u64; args.engines as usize];
    // ZeroMQ's slow joiner: what is published before a subscription is lost, so a marker page
    // goes out until every engine's shows up in the indexer.
    let marker = |e: u32| -> Vec<u32> { (0..BLOCK).map(|i| 3_000_000_000 + e * 100 + i).collect() };
    let started = Instant::now();
    loop {
        for e in 0..args.engines {
            let payload = batch(e, 0xfff, &marker(e));
            send(&mut sockets[e as usize], payload, seq[e as usize]).await?;
            seq[e as usize] += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen = (0..args.engines).filter(|e| client.matched(&marker(*e), &worker(*e)).unwrap_or(0) > 0).count();
        if seen == args.engines as usize {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("the indexer sees {seen} of {} engines after 60 s", args.engines));
        }
    }
    let idle_mib = args.pid.and_then(|p| rss_mib(&p.to_string()));
    let docs = args.pages / (DOC / BLOCK);
    let pages = u64::from(args.engines) * u64::from(docs) * u64::from(DOC / BLOCK);
    // Encoded up front, so the timing is the indexer's, not this program's msgpack.
    let shared = args.shared_prefix;
    let batches: Vec<Vec<Vec<u8>>> = (0..docs)
        .map(|k| (0..args.engines).map(|e| batch(e, k, &doc_tokens(doc_of(e, k), DOC, shared))).collect())
        .collect();
    let client = &client;
    let held = |e: u32, tokens: &[u32]| client.matched(tokens, &worker(e)).unwrap_or(0) >= u64::from(DOC);
    let full = |e: u32, k: u32| held(e, &doc_tokens(doc_of(e, k), DOC, shared));
    let t0 = Instant::now();
    let mut publishing = Duration::ZERO;
    for (chunk, rounds) in batches.chunks(CHUNK_DOCS as usize).enumerate() {
        let t = Instant::now();
        for round in rounds {
            for (e, payload) in round.iter().enumerate() {
                send(&mut sockets[e], payload.clone(), seq[e]).await?;
                seq[e] += 1;
            }
        }
        for e in 0..args.engines {
            let payload = batch(e, 0x10_0000 + chunk as u32, &sentinel(e, chunk as u32));
            send(&mut sockets[e as usize], payload, seq[e as usize]).await?;
            seq[e as usize] += 1;
        }
        publishing += t.elapsed();
        // ZeroMQ drops what a slow subscriber's queue cannot take, so each chunk waits until the
        // indexer holds its sentinel on every engine.
        let caught_up = || (0..args.engines).all(|e| held(e, &sentinel(e, chunk as u32)));
        wait("a chunk's sentinels", Duration::from_secs(120), caught_up).map_err(|e| {
            format!("{e}: chunk {chunk} of {}, {:.0} s in", docs.div_ceil(CHUNK_DOCS), t0.elapsed().as_secs_f64())
        })?;
    }
    let published_s = publishing.as_secs_f64();
    let ingest_s = t0.elapsed().as_secs_f64();
    let held_mib = args.pid.and_then(|p| rss_mib(&p.to_string()));
    // Completeness: a sample of documents across engines, each expected in full.
    let sample: Vec<(u32, u32)> = (0..200u32).map(|i| ((i * 7) % args.engines, (i * 104_729) % docs.max(1))).collect();
    let complete = sample.iter().filter(|(e, k)| full(*e, *k)).count();
    let latency = |len: u32| -> Result<(f64, f64), String> {
        let mut samples = Vec::new();
        for q in 0..1000u32 {
            let (e, k) = (q % args.engines, (q * 31) % docs.max(1));
            let mut tokens = doc_tokens(doc_of(e, k), DOC.min(len), shared);
            tokens.extend((tokens.len() as u32..len).map(|i| 2_000_000_000 + q * 40_000 + i));
            let t = Instant::now();
            client.matched(&tokens, &worker(e))?;
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok((percentile(samples.clone(), 0.5), percentile(samples, 0.99)))
    };
    let (q1k_p50, q1k_p99) = latency(1024)?;
    let (q32k_p50, q32k_p99) = latency(32_768)?;
    let mib = |v: Option<f64>| v.map(|x| (x * 10.0).round() / 10.0);
    println!(
        "{}",
        json!({
            "api": format!("{:?}", args.api).to_lowercase(),
            "engines": args.engines,
            "shared_prefix": shared,
            "pages": pages,
            "publish_pages_per_s": (pages as f64 / published_s).round(),
            "ingest_pages_per_s": (pages as f64 / ingest_s).round(),
            "ingest_s": (ingest_s * 100.0).round() / 100.0,
            "sample_complete": format!("{complete}/{}", sample.len()),
            "rss_mib": {"idle": mib(idle_mib), "held": mib(held_mib),
                        "per_page_bytes": match (idle_mib, held_mib) {
                            (Some(i), Some(h)) => Some(((h - i) * 1048576.0 / pages as f64).round()),
                            _ => None }},
            "query_us": {"1k_p50": q1k_p50.round(), "1k_p99": q1k_p99.round(),
                         "32k_p50": q32k_p50.round(), "32k_p99": q32k_p99.round()},
        })
    );
    Ok(())
}
