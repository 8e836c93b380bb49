//! Precise prefix routing through real Envoy (spec §7): the filter asks `sgl-indexer` once per
//! request; exact token counts choose the bucket where the byte estimate would choose another; a
//! stopped indexer costs nothing but precision (the estimate returns, no request fails or waits
//! past the timeout), and precision returns with it.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn precise_router(sims: &[Sim], indexer_port: u16) -> Value {
    let tok = tokenizer_dir();
    json!({
        "workers": sims.iter().map(Sim::worker_json).collect::<Vec<_>>(),
        "health": {"interval_ms": 200, "timeout_ms": 150, "failure_threshold": 2, "success_threshold": 1},
        "prefix_index": {"url": format!("http://127.0.0.1:{indexer_port}"), "timeout_ms": 200},
        "models": {"demo-model": {
            "tokenizer": tok.join("tokenizer.json"),
            "chat_template": tok.join("tokenizer_config.json"),
            "buckets": [
                {"id": "short", "limits": {"max": 64}, "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}},
                {"id": "long", "limits": {"max": 100000}, "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}
            ]
        }}
    })
}

/// Thai, a script the project's tokenizer saw none of: 3 bytes a character, so the byte estimate
/// (4 bytes a token) says 60 tokens where the byte-level tokenizer spends 112 (checked against
/// `sgl-indexer`'s own count below).
fn thai_prompt() -> String {
    "กขฃคฅฆงจฉช".repeat(8)
}

#[test]
fn exact_tokens_choose_the_bucket_and_a_stopped_indexer_costs_only_precision() {
    let indexer_port = free_port();
    let d = Deployment::start("precise_buckets", vec![SimSpec::plain("A"), SimSpec::plain("B")], |sims| {
        precise_router(sims, indexer_port)
    });
    let body = chat_body(&thai_prompt(), 4, false);
    // 240 bytes of text: 60 tokens by the estimate, the short bucket.
    let before = d.chat(&body);
    assert_eq!((before.status, before.header("x-sgl-bucket")), (200, Some("short")), "{}", before.body);

    let mut indexer = start_indexer(&d.dir, indexer_port);
    let counted = send(&format!("http://127.0.0.1:{indexer_port}/v1/prefix/match"), "POST", Some(&body), &[]);
    let exact_tokens = counted.json()["input_tokens"].as_u64().unwrap();
    assert!(exact_tokens > 64, "the premise: the tokenizer counts {exact_tokens}");
    let exact = d.chat(&body);
    assert_eq!((exact.status, exact.header("x-sgl-bucket")), (200, Some("long")), "{}", exact.body);

    // The indexer dies mid-load: every request still succeeds, none waits past the timeout.
    indexer.stop();
    for _ in 0..10 {
        let started = Instant::now();
        let r = d.chat(&body);
        assert_eq!((r.status, r.header("x-sgl-bucket")), (200, Some("short")), "{}", r.body);
        assert!(started.elapsed() < Duration::from_secs(2), "waited {:?}", started.elapsed());
    }
    let _indexer = start_indexer(&d.dir, indexer_port);
    wait_for("precise routing to resume", Duration::from_secs(10), || {
        (d.chat(&body).header("x-sgl-bucket") == Some("long")).then_some(())
    });
    // Nothing is cached (no engine publishes events here): answered lookups are misses, the ones
    // while the indexer was down unavailable, and the two are counted apart.
    for result in ["miss", "unavailable"] {
        let sample = format!("sgl_router_prefix_lookups_total{{result=\"{result}\"}}");
        assert!(d.envoy.metric(&sample).unwrap_or(0.0) >= 1.0, "{sample}");
    }
}
