//! The engine's state: its identity, the FIFO of request slots that makes running and waiting
//! counts real, and what the control endpoint has pinned or broken.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::control::Control;
use crate::pd::Rooms;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Plain,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Plain => "plain",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

#[derive(Debug, Clone, Parser)]
#[command(name = "sgl-sim", about = "A simulated SGLang engine")]
pub struct Args {
    /// Engine id, reported in `x-sim-engine` and in every JSON response.
    #[arg(long)]
    pub id: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long)]
    pub port: u16,
    #[arg(long, default_value = "demo-model")]
    pub model: String,
    #[arg(long, value_enum, default_value_t = Role::Plain)]
    pub role: Role,
    /// PD bootstrap port (prefill engines); SGLang's default is 8998.
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Delay per generated token, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub token_delay_ms: u64,
    /// Requests generating at once; beyond it requests wait in a FIFO queue.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Tokens generated when the request sets no output budget.
    #[arg(long, default_value_t = 16)]
    pub default_output_tokens: u64,
    /// KV cache capacity in tokens.
    #[arg(long, default_value_t = 1_000_000)]
    pub kv_capacity: u64,
    /// Data-parallel ranks reported by the load endpoints.
    #[arg(long, default_value_t = 1)]
    pub dp_size: u32,
    /// How long a decode engine waits for its prefill engine to finish a room.
    #[arg(long, default_value_t = 30_000)]
    pub bootstrap_timeout_ms: u64,
    /// Prefill throughput: uncached prompt tokens processed per second (one prefill at a time).
    #[arg(long, default_value_t = 50_000.0)]
    pub prefill_tps: f64,
    /// Requests that reach the prefill lane while it is busy are prefilled together in its next
    /// turn, one batch that answers their first tokens at once, as SGLang's scheduler does;
    /// without it, one prefill at a time.
    #[arg(long)]
    pub prefill_batching: bool,
    /// Each decode step takes this much longer per other running request (0.02 = 2 %).
    #[arg(long, default_value_t = 0.02)]
    pub batch_slowdown: f64,
    /// Multiplies every simulated duration, so long workloads run fast.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Added to every chat request before it is served.
    #[arg(long, default_value_t = 0)]
    pub fault_latency_ms: u64,
    /// Fraction of chat requests answered with 500.
    #[arg(long, default_value_t = 0.0)]
    pub fault_error_rate: f64,
    /// Chat requests never answer.
    #[arg(long)]
    pub fault_hang: bool,
    /// The process exits after serving this many chat requests.
    #[arg(long)]
    pub crash_after: Option<u64>,
    /// As SGLang's `--api-key`: generation requests without `Authorization: Bearer KEY` get 401.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model's `tokenizer.json`: prompts are tokenized as the real engine does.
    #[arg(long)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// A chat template file or `tokenizer_config.json` (default: beside the tokenizer).
    #[arg(long)]
    pub chat_template: Option<std::path::PathBuf>,
    /// Tokens per KV page (SGLang's default 1 with a tokenizer; 16 without).
    #[arg(long)]
    pub page_size: Option<u64>,
    /// Publishes KV events on this ZeroMQ PUB endpoint (needs --tokenizer).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// Answers replay requests on this ZeroMQ ROUTER endpoint.
    #[arg(long)]
    pub kv_events_replay: Option<String>,
    /// The medium the events name for this engine's cache: `CPU_PINNED` stands in for an engine
    /// that holds its prefix cache in host memory (SGLang's HiCache).
    #[arg(long, default_value = "GPU", value_parser = ["GPU", "CPU_PINNED", "DISK"])]
    pub kv_events_medium: String,
    /// Publish through SGLang's own `ZmqEventPublisher`: the path of `kv_events.py` from its
    /// wheel (`scripts/setup --tests` unpacks it under `.tools/sglang`).
    #[arg(long)]
    pub kv_events_sglang: Option<std::path::PathBuf>,
    /// The Python that runs SGLang's publisher (it needs msgspec, pyzmq and pydantic).
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Appends one JSON line per request: where its time to first token went (`trace.rs`).
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
}

/// Bytes per simulated token, as the router's default estimator counts.
pub const BYTES_PER_TOKEN: u64 = 4;

/// What a test can see of the traffic the engine received.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub path: String,
    pub stream: bool,
    pub bootstrap_room: Option<serde_json::Value>,
    pub bootstrap_host: Option<serde_json::Value>,
    pub bootstrap_port: Option<serde_json::Value>,
    pub received_ms: u64,
    pub finished_ms: Option<u64>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The request body's length as it arrived.
    pub body_bytes: usize,
    /// The data-parallel rank the body named (`routed_dp_rank`), and the rank that served it.
    pub routed_dp_rank: Option<serde_json::Value>,
    pub dp_rank: u32,
    /// The request's `rid`, when it has one.
    pub rid: Option<serde_json::Value>,
}

const RECENT_REQUESTS: usize = 256;

/// Requests prefilled in one turn of the lane: their uncached tokens, and when the lane took them
/// up and finished (set once, by the request that waited for the lane).
struct Batch {
    tokens: AtomicU64,
    done: tokio::sync::watch::Sender<Option<(std::time::Instant, std::time::Instant)>>,
}

pub struct Engine {
    pub id: String,
    pub model: String,
    pub role: Role,
    pub args: Args,
    slots: Arc<Semaphore>,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub kv_used: AtomicU64,
    pub waiting_uncached_tokens: AtomicU64,
    pub served: AtomicU64,
    pub prefill_tokens_total: AtomicU64,
    pub prefill_busy_us_total: AtomicU64,
    pub control: Mutex<Control>,
    pub rooms: Rooms,
    pub recent: Mutex<Vec<RequestRecord>>,
    pub client: reqwest::Client,
    /// One prefix cache per data-parallel rank: a prefix lives on the rank that served it.
    pub caches: Vec<crate::kv::PrefixCache>,
    pub tokenizer: Option<sgl_indexer::tokenize::ModelTokenizer>,
    /// One publisher per rank, when events are published.
    pub events: Vec<crate::events::Publisher>,
    /// Where a request that names no rank goes: round robin, as SGLang's DP controller's default.
    next_rank: AtomicU64,
    /// Running and waiting requests per data-parallel rank (their sums are `running`, `waiting`).
    rank_counts: Vec<(AtomicU64, AtomicU64)>,
    /// One prefill at a time, as an engine's prefill batch runs.
    pub prefill_lock: tokio::sync::Mutex<()>,
    /// With `--prefill-batching`: the batch gathering for the lane's next turn.
    forming: Mutex<Option<Arc<Batch>>>,
    pub chat_requests: AtomicU64,
    fault_rng: AtomicU64,
    /// Requests that can be aborted by id, and the ids aborts named.
    pub aborts: crate::abort::Aborts,
    pub trace: crate::trace::Trace,
}

impl Engine {
    pub fn new(args: &Args) -> Self {
        let bootstrap_port = match args.role {
            Role::Prefill => Some(args.bootstrap_port.unwrap_or(8998)),
            _ => args.bootstrap_port,
        };
        let mut args = args.clone();
        args.bootstrap_port = bootstrap_port;
        Self {
            id: args.id.clone(),
            model: args.model.clone(),
            role: args.role,
            slots: Arc::new(Semaphore::new(args.max_running.max(1))),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_used: AtomicU64::new(0),
            waiting_uncached_tokens: AtomicU64::new(0),
            served: AtomicU64::new(0),
            prefill_tokens_total: AtomicU64::new(0),
            prefill_busy_us_total: AtomicU64::new(0),
            control: Mutex::new(Control::new(args.token_delay_ms)),
            rooms: Rooms::default(),
            recent: Mutex::new(Vec::new()),
            client: reqwest::Client::new(),
            caches: (0..args.dp_size.max(1))
                .map(|_| {
                    crate::kv::PrefixCache::new(
                        args.kv_capacity / u64::from(args.dp_size.max(1)),
                        args.page_size.unwrap_or(if args.tokenizer.is_some() { 1 } else { crate::kv::BLOCK_TOKENS }),
                    )
                })
                .collect(),
            tokenizer: None,
            events: Vec::new(),
            next_rank: AtomicU64::new(0),
            rank_counts: (0..args.dp_size.max(1)).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect(),
            prefill_lock: tokio::sync::Mutex::new(()),
            forming: Mutex::new(None),
            chat_requests: AtomicU64::new(0),
            aborts: crate::abort::Aborts::default(),
            trace: crate::trace::Trace::default(),
            fault_rng: AtomicU64::new(u64::from(args.port).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            args,
        }
    }

    /// The rank serving a request: the one its body names, else the next in turn.
    pub fn rank_for(&self, named: Option<&serde_json::Value>) -> u32 {
        let ranks = self.args.dp_size.max(1);
        match named.and_then(serde_json::Value::as_u64) {
            Some(r) if r < u64::from(ranks) => r as u32,
            _ => (self.next_rank.fetch_add(1, Ordering::Relaxed) % u64::from(ranks)) as u32,
        }
    }

    /// Cached and prompt tokens over the engine's life, every rank together.
    pub fn cache_totals(&self) -> (u64, u64) {
        self.caches.iter().map(|c| c.hit_rate()).fold((0, 0), |(a, b), (c, p)| (a + c, b + p))
    }

    pub fn bootstrap_port(&self) -> Option<u16> {
        self.args.bootstrap_port
    }

    pub fn control(&self) -> MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn now_unix_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    /// Waits in FIFO order for a running slot. The returned guard keeps the counts true however
    /// the request ends (completed, failed, or dropped when the client goes away).
    /// `rank` is the data-parallel rank serving the request, whose own counts move too.
    /// `uncached_tokens`: what of its `prompt_tokens` the request will prefill, as the cache stood
    /// when it arrived (what `num_waiting_uncached_tokens` adds up).
    pub async fn admit(self: &Arc<Self>, prompt_tokens: u64, uncached_tokens: u64, rank: u32) -> Option<RunningGuard> {
        let rank = (rank as usize).min(self.rank_counts.len().saturating_sub(1));
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.rank_counts[rank].1.fetch_add(1, Ordering::SeqCst);
        self.waiting_uncached_tokens.fetch_add(uncached_tokens, Ordering::SeqCst);
        let waiting = WaitingGuard { engine: Arc::clone(self), uncached_tokens, rank };
        let permit = Arc::clone(&self.slots).acquire_owned().await.ok()?;
        drop(waiting);
        self.running.fetch_add(1, Ordering::SeqCst);
        self.rank_counts[rank].0.fetch_add(1, Ordering::SeqCst);
        self.kv_used.fetch_add(prompt_tokens, Ordering::SeqCst);
        Some(RunningGuard { engine: Arc::clone(self), _permit: permit, kv_tokens: prompt_tokens, rank })
    }

    /// Running and waiting requests of data-parallel rank `rank`.
    pub fn rank_load(&self, rank: u32) -> (u64, u64) {
        self.rank_counts
            .get(rank as usize)
            .map_or((0, 0), |(r, w)| (r.load(Ordering::SeqCst), w.load(Ordering::SeqCst)))
    }

    pub fn record(&self, record: RequestRecord) -> usize {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() >= RECENT_REQUESTS {
            recent.remove(0);
        }
        recent.push(record);
        recent.len() - 1
    }

    /// Marks the newest record matching `received_ms` and path as finished.
    pub fn finish_record(&self, received_ms: u64, status: u16) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = recent.iter_mut().rev().find(|r| r.received_ms == received_ms && r.finished_ms.is_none()) {
            r.finished_ms = Some(Self::now_unix_ms());
            r.status = status;
        }
    }

    pub fn scaled(&self, ms: f64) -> Duration {
        Duration::from_secs_f64((ms * self.args.time_scale).max(0.0) / 1000.0)
    }

    /// One decode step: the base per-token delay, slower with every other running request.
    pub fn decode_step(&self) -> Duration {
        let base = self.control().token_delay_ms as f64;
        let others = self.running.load(Ordering::SeqCst).saturating_sub(1) as f64;
        self.scaled(base * (1.0 + self.args.batch_slowdown * others))
    }

    /// Prefills `uncached` tokens on the lane: alone, or with `--prefill-batching` in the batch
    /// gathering for the lane's next turn. Returns when the lane took it up and when it was done.
    pub async fn prefill(&self, uncached: u64) -> (std::time::Instant, std::time::Instant) {
        if !self.args.prefill_batching {
            let _lane = self.prefill_lock.lock().await;
            let laned = std::time::Instant::now();
            self.run_prefill(uncached).await;
            return (laned, std::time::Instant::now());
        }
        let (batch, leads) = {
            let mut forming = self.forming.lock().unwrap_or_else(|e| e.into_inner());
            match forming.as_ref() {
                Some(batch) => {
                    batch.tokens.fetch_add(uncached, Ordering::SeqCst);
                    (Arc::clone(batch), false)
                }
                None => {
                    let batch =
                        Arc::new(Batch { tokens: AtomicU64::new(uncached), done: tokio::sync::watch::channel(None).0 });
                    *forming = Some(Arc::clone(&batch));
                    (batch, true)
                }
            }
        };
        let mut done = batch.done.subscribe();
        if leads {
            let _lane = self.prefill_lock.lock().await;
            // The lane's turn closes the batch: later arrivals gather for the next.
            self.forming.lock().unwrap_or_else(|e| e.into_inner()).take();
            let laned = std::time::Instant::now();
            self.run_prefill(batch.tokens.load(Ordering::SeqCst)).await;
            batch.done.send_replace(Some((laned, std::time::Instant::now())));
        }
        let marks = done.wait_for(Option::is_some).await.ok().and_then(|m| *m);
        marks.unwrap_or_else(|| (std::time::Instant::now(), std::time::Instant::now()))
    }

    async fn run_prefill(&self, uncached: u64) {
        let busy = self.prefill_time(uncached);
        tokio::time::sleep(busy).await;
        self.prefill_tokens_total.fetch_add(uncached, Ordering::SeqCst);
        self.prefill_busy_us_total
            .fetch_add(u64::try_from(busy.as_micros()).unwrap_or(u64::MAX).max(1), Ordering::SeqCst);
    }

    /// Prefill time of `uncached` tokens at the configured throughput.
    pub fn prefill_time(&self, uncached: u64) -> Duration {
        self.scaled(uncached as f64 * 1000.0 / self.args.prefill_tps.max(1.0))
    }

    /// A uniform draw in [0, 1) for fault injection (xorshift; no shared RNG needed).
    pub fn fault_draw(&self) -> f64 {
        let mut x = self.fault_rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.fault_rng.store(x, Ordering::Relaxed);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct WaitingGuard {
    engine: Arc<Engine>,
    uncached_tokens: u64,
    rank: usize,
}

impl Drop for WaitingGuard {
    fn drop(&mut self) {
        self.engine.waiting.fetch_sub(1, Ordering::SeqCst);
        self.engine.rank_counts[self.rank].1.fetch_sub(1, Ordering::SeqCst);
        self.engine.waiting_uncached_tokens.fetch_sub(self.uncached_tokens, Ordering::SeqCst);
    }
}

pub struct RunningGuard {
    engine: Arc<Engine>,
    _permit: OwnedSemaphorePermit,
    kv_tokens: u64,
    rank: usize,
}

impl RunningGuard {
    /// A generated token occupies KV cache until the request ends.
    pub fn add_kv_token(&mut self) {
        self.kv_tokens += 1;
        self.engine.kv_used.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.engine.running.fetch_sub(1, Ordering::SeqCst);
        self.engine.rank_counts[self.rank].0.fetch_sub(1, Ordering::SeqCst);
        self.engine.kv_used.fetch_sub(self.kv_tokens, Ordering::SeqCst);
    }
}
