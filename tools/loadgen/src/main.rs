//! sgl-loadgen: drives an OpenAI chat endpoint with a workload and reports latency, throughput,
//! errors and (when given the simulators) their cache hit rate, as JSON.

mod measure;
mod workload;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde_json::json;
use tokio::sync::Mutex;

use crate::measure::{send, Sample};
use crate::workload::Workload;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Kind {
    /// Multi-turn sessions over shared system prompts (each turn extends its history).
    SharedPrefix,
    /// Independent prompts, a mix of short and long ones that exercises buckets.
    MixedLength,
    /// The same body every time, of `--body-bytes`: for overhead measurements.
    Fixed,
}

#[derive(Debug, Clone, Parser)]
#[command(name = "sgl-loadgen", about = "Drive an OpenAI chat endpoint and measure it")]
pub struct Args {
    /// Chat completions URL.
    #[arg(long, default_value = "http://127.0.0.1:10000/v1/chat/completions")]
    pub url: String,
    #[arg(long, default_value = "demo-model")]
    pub model: String,
    #[arg(long, value_enum, default_value_t = Kind::SharedPrefix)]
    pub workload: Kind,
    /// Closed loop: this many requests in flight. Ignored when --rate is given.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Total requests to send.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Stop sending after this long, whatever is left.
    #[arg(long, default_value_t = 300)]
    pub max_seconds: u64,
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub stream: bool,
    /// Shared-prefix workload: groups of sessions sharing one system prompt.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// Shared-prefix workload: sessions per group.
    #[arg(long, default_value_t = 4)]
    pub sessions_per_group: usize,
    #[arg(long, default_value_t = 2048)]
    pub system_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub question_tokens: usize,
    #[arg(long, default_value_t = 32)]
    pub output_tokens: u64,
    /// Mixed-length workload: fraction of long prompts, and the two lengths.
    #[arg(long, default_value_t = 0.2)]
    pub long_fraction: f64,
    #[arg(long, default_value_t = 256)]
    pub short_tokens: usize,
    #[arg(long, default_value_t = 8192)]
    pub long_tokens: usize,
    /// Fixed workload: body size.
    #[arg(long, default_value_t = 4096)]
    pub body_bytes: usize,
    /// This fraction of the requests, evenly spaced, is interactive and the rest batch (see
    /// `Workload::next`); the report then gives each class its own summary.
    #[arg(long, default_value_t = 0.0)]
    pub high_fraction: f64,
    /// Goodput counts the requests completed with their first token within this many ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// The interactive requests' own TTFT SLO (default: `--slo-ttft-ms`).
    #[arg(long)]
    pub high_slo_ttft_ms: Option<f64>,
    /// Simulator base URLs whose cache hit rates are read after the run.
    #[arg(long, value_delimiter = ',')]
    pub sims: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A label carried into the JSON.
    #[arg(long, default_value = "")]
    pub label: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let client = reqwest::Client::builder().pool_max_idle_per_host(1024).build().unwrap_or_default();
    let workload = Arc::new(Mutex::new(Workload::new(&args)));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::with_capacity(args.requests)));
    let deadline = Instant::now() + Duration::from_secs(args.max_seconds);
    let started = Instant::now();

    let run_one = {
        let (client, workload, samples, args) = (client.clone(), workload.clone(), samples.clone(), args.clone());
        move || {
            let (client, workload, samples, args) = (client.clone(), workload.clone(), samples.clone(), args.clone());
            async move {
                let Some(request) = workload.lock().await.next() else { return false };
                let mut sample = send(&client, &args.url, &request, args.stream).await;
                sample.class = request.class;
                workload.lock().await.finished(&request, &sample);
                samples.lock().await.push(sample);
                true
            }
        }
    };

    if let Some(rate) = args.rate {
        // Open loop: arrivals do not wait for answers.
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
        let mut tasks = Vec::new();
        for _ in 0..args.requests {
            if Instant::now() >= deadline {
                break;
            }
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let gap = -(1.0 - u).ln() / rate.max(1e-9);
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
            tasks.push(tokio::spawn(run_one()));
        }
        for t in tasks {
            let _ = t.await;
        }
    } else {
        let workers: Vec<_> = (0..args.concurrency.max(1))
            .map(|_| {
                let run = run_one.clone();
                tokio::spawn(async move { while Instant::now() < deadline && run().await {} })
            })
            .collect();
        for w in workers {
            let _ = w.await;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let samples = samples.lock().await;
    let cache = measure::cache_hit_rate(&client, &args.sims).await;
    let slo =
        |s: &Sample| if s.class == "high" { args.high_slo_ttft_ms.or(args.slo_ttft_ms) } else { args.slo_ttft_ms };
    let report = json!({
        "label": args.label,
        "workload": format!("{:?}", args.workload),
        "mode": if args.rate.is_some() { "open_loop" } else { "closed_loop" },
        "offered_rate": args.rate,
        "concurrency": args.rate.is_none().then_some(args.concurrency),
        "elapsed_s": elapsed,
        "summary": measure::summarize(&samples, elapsed, &slo),
        "by_class": (args.high_fraction > 0.0).then(|| {
            let of = |class| samples.iter().filter(|s| s.class == class).cloned().collect::<Vec<_>>();
            json!({
                "high": measure::summarize(&of("high"), elapsed, &slo),
                "low": measure::summarize(&of("low"), elapsed, &slo),
            })
        }),
        "cache": cache,
    });
    println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
}
