//! `indexer-bench`: the indexer's own costs, in-process, on synthetic SGLang-style events:
//! events/s ingested into an index of ENGINES engines × PAGES pages of 16 tokens, `/query`-path
//! match latency (keys + lookup) for 1k- and 32k-token prompts, chat-body tokenization of ~32k-token
//! prompts (the process's first, others new to it, and a conversation whose last message alone is
//! new), and the resident memory the index holds. Prints JSON.
//! `indexer-bench [ENGINES] [PAGES]` (defaults 64 × 100,000).
//! `indexer-bench --http URL [MODEL]`: the same tokenization through a running indexer's
//! `POST /v1/prefix/match` (round trip, and its `server-timing` render and encode).

use std::time::Instant;

use sgl_indexer::events::{KvEvent, Medium, StoredBlocks};
use sgl_indexer::index::{block_keys, Index};
use sgl_indexer::synthetic::{doc_tokens, percentile, prose, rss_mib};
use sgl_indexer::tokenize::ModelTokenizer;

const BLOCK: u32 = 16;

/// Words of prose in a ~32k-token system prompt (with the shipped tokenizer).
const PROMPT_WORDS: usize = 7_800;

/// A conversation: a long system prompt, `turns` earlier exchanges, and a last question.
fn chat(model: &str, system_seed: u64, turns: usize, last: &str) -> serde_json::Value {
    let mut messages = vec![serde_json::json!({"role": "system", "content": prose(system_seed, PROMPT_WORDS)})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": prose(1000 + t as u64, 40)}));
        messages.push(serde_json::json!({"role": "assistant", "content": prose(2000 + t as u64, 120)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": last}));
    serde_json::json!({"model": model, "messages": messages})
}

/// Milliseconds `tokenize` takes: the process's first prompt, the p50 of prompts new to it, and
/// the p50 of a conversation whose last message alone is new.
fn tokenization(mut tokenize: impl FnMut(&serde_json::Value) -> f64, model: &str) -> serde_json::Value {
    let first = tokenize(&chat(model, 1, 0, "first question"));
    let new: Vec<f64> = (2..12).map(|seed| tokenize(&chat(model, seed, 0, "a question"))).collect();
    tokenize(&chat(model, 50, 3, "warming the conversation"));
    let last_new: Vec<f64> =
        (0..50).map(|i| tokenize(&chat(model, 50, 3, &format!("follow-up question {i}")))).collect();
    serde_json::json!({"first": first, "new_prompt_p50": percentile(new, 0.5), "last_message_new_p50": percentile(last_new, 0.5)})
}

/// The tokenization figures through a running indexer: round trips, and what its `server-timing`
/// says render and encode took.
fn over_http(url: &str, model: &str) {
    let agent = ureq::Agent::new_with_defaults();
    let mut server_ms = Vec::new();
    let mut tokens = 0;
    let round_trip = tokenization(
        |body| {
            let started = Instant::now();
            let Ok(mut response) = agent.post(&format!("{url}/v1/prefix/match")).send_json(body) else {
                return f64::NAN;
            };
            let spent = started.elapsed().as_secs_f64() * 1e3;
            let timing =
                response.headers().get("server-timing").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            let phase = |name: &str| {
                timing
                    .split(", ")
                    .find_map(|p| p.strip_prefix(&format!("{name};dur=")))
                    .and_then(|d| d.parse::<f64>().ok())
            };
            server_ms.push(phase("render").unwrap_or(0.0) + phase("encode").unwrap_or(0.0));
            if let Ok(answer) = response.body_mut().read_json::<serde_json::Value>() {
                tokens = answer["input_tokens"].as_u64().unwrap_or(0);
            }
            spent
        },
        model,
    );
    let server = |range: std::ops::Range<usize>| percentile(server_ms.get(range).unwrap_or_default().to_vec(), 0.5);
    println!(
        "{}",
        serde_json::json!({
            "tokenize_32k_http_ms": round_trip,
            "render_and_encode_ms": {"first": server(0..1), "new_prompt_p50": server(1..11), "last_message_new_p50": server(12..62)},
            "tokens_of_last": tokens,
        })
    );
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("--http") {
        let url = args.nth(1).unwrap_or_default();
        let model = args.next().unwrap_or_else(|| "demo-model".to_string());
        return over_http(&url, &model);
    }
    let engines: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let pages: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let per_doc = 2048 / BLOCK;
    let docs_per_engine = pages / per_doc;
    let idle = rss_mib("self").unwrap_or(0.0);
    let mut index = Index::new(BLOCK, (engines as usize) * (pages as usize) + 1);
    let started = Instant::now();
    let mut events = 0u64;
    for e in 0..engines {
        let name = format!("E{e:02}");
        for k in 0..docs_per_engine {
            let d = e * 131 + k * 17;
            let tokens = doc_tokens(d, 2048, true);
            // One event a page, each the child of the previous, as SGLang publishes.
            let mut parent = None;
            for (p, chunk) in tokens.chunks(BLOCK as usize).enumerate() {
                let hash = (u64::from(e) << 40) | (u64::from(k) << 8) | p as u64;
                index.apply(
                    &name,
                    0,
                    &KvEvent::Stored(StoredBlocks {
                        block_hashes: vec![hash],
                        parent,
                        token_ids: chunk.to_vec(),
                        block_size: BLOCK as usize,
                        lora: None,
                        medium: Medium::Gpu,
                        cache_salt: None,
                    }),
                );
                parent = Some(hash);
                events += 1;
            }
        }
    }
    let ingest_s = started.elapsed().as_secs_f64();
    let held = rss_mib("self").unwrap_or(0.0);
    let latency = |len: u32| {
        let samples: Vec<f64> = (0..1000u32)
            .map(|q| {
                let tokens = doc_tokens((q * 7) % (engines * 131), len, true);
                let t = Instant::now();
                let keys = block_keys(&tokens, BLOCK, None, None);
                std::hint::black_box(index.match_keys(&keys, 0));
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        (percentile(samples.clone(), 0.5), percentile(samples, 0.99))
    };
    let (q1k_p50, q1k_p99) = latency(1024);
    let (q32k_p50, q32k_p99) = latency(32_768);

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer");
    let load = || ModelTokenizer::load(&dir.join("tokenizer.json"), &dir.join("tokenizer_config.json")).ok();
    let tok_len = load().and_then(|t| t.tokenize_chat(&chat("m", 1, 0, "")).ok()).map_or(0, |v| v.len());
    // The tokenizer's own encode of a whole new prompt, as the indexer did before `pretokenize`.
    let whole_ms = load().map_or(0.0, |t| {
        let prompts: Vec<String> = (100..105).filter_map(|seed| t.render(&chat("m", seed, 0, "q")).ok()).collect();
        let samples = prompts
            .iter()
            .map(|p| {
                let started = Instant::now();
                std::hint::black_box(t.encode_uncached(p).ok());
                started.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        percentile(samples, 0.5)
    });
    // A tokenizer no prompt went through yet: the first figure is a cold start.
    let tokenize = load().map_or(serde_json::Value::Null, |t| {
        tokenization(
            |body| {
                let started = Instant::now();
                std::hint::black_box(t.tokenize_chat(body).ok());
                started.elapsed().as_secs_f64() * 1e3
            },
            "m",
        )
    });
    println!(
        "{}",
        serde_json::json!({
            "engines": engines,
            "pages_per_engine": docs_per_engine * per_doc,
            "events": events,
            "ingest_events_per_s": (events as f64 / ingest_s).round(),
            "index_rss_mib": ((held - idle) * 10.0).round() / 10.0,
            "bytes_per_page": (((held - idle) * 1048576.0) / events as f64).round(),
            "match_us": {"1k_p50": q1k_p50, "1k_p99": q1k_p99, "32k_p50": q32k_p50, "32k_p99": q32k_p99},
            "tokenize_32k_ms": tokenize,
            "tokens_of_first": tok_len,
            "whole_encode_new_prompt_p50_ms": whole_ms,
        })
    );
}
