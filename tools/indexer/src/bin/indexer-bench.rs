//! `indexer-bench`: the indexer's own costs, in-process, on synthetic SGLang-style events:
//! events/s ingested into an index of ENGINES engines × PAGES pages of 16 tokens, `/query`-path
//! match latency (keys + lookup) for 1k- and 32k-token prompts, chat-body tokenization for a 32k-token
//! prompt (first and repeated), and the resident memory the index holds. Prints JSON.
//! `indexer-bench [ENGINES] [PAGES]` (defaults 64 × 100,000).

use std::time::Instant;

use sgl_indexer::events::{KvEvent, Medium, StoredBlocks};
use sgl_indexer::index::{block_keys, Index};
use sgl_indexer::synthetic::{doc_tokens, percentile, rss_mib};
use sgl_indexer::tokenize::ModelTokenizer;

const BLOCK: u32 = 16;

fn main() {
    let mut args = std::env::args().skip(1);
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
    let tok = ModelTokenizer::load(&dir.join("tokenizer.json"), &dir.join("tokenizer_config.json")).ok();
    let (tok_first, tok_repeat, tok_len) = match tok {
        Some(t) => {
            let system = "the model router explains buckets prefill decode and the prefix cache. ".repeat(2300);
            let chat = |q: &str| serde_json::json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]});
            let t0 = Instant::now();
            let len = t.tokenize_chat(&chat("first question")).map(|v| v.len()).unwrap_or(0);
            let first = t0.elapsed().as_secs_f64() * 1e3;
            let repeats: Vec<f64> = (0..50)
                .map(|i| {
                    let t1 = Instant::now();
                    std::hint::black_box(t.tokenize_chat(&chat(&format!("question {i}"))).ok());
                    t1.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            (first, percentile(repeats, 0.5), len)
        }
        None => (0.0, 0.0, 0),
    };
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
            "tokenize_32k_ms": {"tokens": tok_len, "first": tok_first, "repeated_prefix_p50": tok_repeat},
        })
    );
}
