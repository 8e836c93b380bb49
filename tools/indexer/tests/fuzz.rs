//! Property-based fuzzing of everything the indexer reads from outside: engine event frames in
//! SGLang's forms (tagged maps, older positional arrays) and vLLM's (a map batch, byte hashes),
//! replay answers with and without a topic frame, and HTTP requests to every endpoint (chat bodies
//! through the real chat template and tokenizer). Each property is "never panics, never a 5xx it
//! should not give, and what it accepts is consistent". Run by `scripts/fuzz` (ignored in
//! `scripts/test`); `FUZZ_CASES` sets the cases per target (default 1,000,000).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::Config;
use rmpv::Value as V;
use serde_json::{json, Value};
use sgl_indexer::events::{decode_frames, replay_frames, KvEvent};
use sgl_indexer::index::{block_keys, Index};
use sgl_indexer::state::{App, MemoryBudget};
use tower::ServiceExt;

#[path = "../../../tests/support/fuzz_config.rs"]
mod fuzz_config;
use fuzz_config::config;

/// Names the decoder looks for, so generated events reach past the first check.
const EVENT_KEYS: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "cache_salt",
    "extra_keys",
    "group_idx",
    "ts",
    "events",
    "data_parallel_rank",
    "attn_dp_rank",
];

fn mp_scalar() -> impl Strategy<Value = V> {
    prop_oneof![
        Just(V::Nil),
        any::<bool>().prop_map(V::from),
        any::<i64>().prop_map(V::from),
        any::<u64>().prop_map(V::from),
        (0u64..64).prop_map(V::from),
        any::<f64>().prop_map(V::from),
        prop::sample::select(vec![
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "GPU",
            "CPU_PINNED",
            "DISK",
            "EXTERNAL",
            "tenant",
            "",
        ])
        .prop_map(V::from),
        prop::collection::vec(any::<u8>(), 0..12).prop_map(V::Binary),
    ]
}

fn mp_value() -> impl Strategy<Value = V> {
    mp_scalar().prop_recursive(4, 48, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(V::Array),
            prop::collection::vec((prop::sample::select(EVENT_KEYS), inner), 0..6)
                .prop_map(|kv| V::Map(kv.into_iter().map(|(k, v)| (V::from(k), v)).collect())),
        ]
    })
}

fn ints(xs: &[i64]) -> V {
    V::Array(xs.iter().map(|x| V::from(*x)).collect())
}

/// A well-formed event in one of the engines' forms, with at most one field replaced by anything.
fn event() -> impl Strategy<Value = V> {
    let shape = (
        prop_oneof![10 => 0..3u8, 1 => Just(3u8)],
        prop::collection::vec(-4i64..4, 1..4),
        prop::option::of(-4i64..4),
        1u64..4,
        any::<bool>(),
        prop::sample::select(EVENT_KEYS),
        prop::option::weighted(0.3, mp_value()),
    );
    shape.prop_map(|(kind, hashes, parent, block_size, positional, key, replaced)| {
        let tokens: Vec<i64> = (0..hashes.len() as i64 * block_size as i64).collect();
        let parent = parent.map(V::from).unwrap_or(V::Nil);
        let mut event = match (kind, positional) {
            (0, false) => V::Map(vec![
                (V::from("type"), V::from("BlockStored")),
                (V::from("block_hashes"), ints(&hashes)),
                (V::from("parent_block_hash"), parent),
                (V::from("token_ids"), ints(&tokens)),
                (V::from("block_size"), V::from(block_size)),
                (V::from("medium"), V::from("GPU")),
            ]),
            (0, true) => V::Array(vec![
                V::from("BlockStored"),
                ints(&hashes),
                parent,
                ints(&tokens),
                V::from(block_size),
                V::Nil,
                V::from("CPU_PINNED"),
            ]),
            (1, false) => {
                V::Map(vec![(V::from("type"), V::from("BlockRemoved")), (V::from("block_hashes"), ints(&hashes))])
            }
            (1, true) => V::Array(vec![V::from("BlockRemoved"), ints(&hashes)]),
            (2, _) => V::Map(vec![(V::from("type"), V::from("AllBlocksCleared"))]),
            _ => return V::Nil,
        };
        if let (Some(value), V::Map(fields)) = (replaced, &mut event) {
            fields.push((V::from(key), value));
        }
        event
    })
}

/// A batch in SGLang's positional form or vLLM's map form, or anything at all.
fn batch() -> impl Strategy<Value = V> {
    let events = prop::collection::vec(prop_oneof![20 => event(), 1 => mp_value()], 0..6);
    prop_oneof![
        4 => (events.clone(), prop::option::of(0u64..4)).prop_map(|(e, rank)| {
            V::Array(vec![V::from(1.5), V::Array(e), rank.map(V::from).unwrap_or(V::Nil)])
        }),
        2 => events.prop_map(|e| V::Map(vec![
            (V::from("ts"), V::from(2.0)),
            (V::from("events"), V::Array(e)),
            (V::from("data_parallel_rank"), V::from(0)),
        ])),
        1 => mp_value(),
    ]
}

fn pack(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn seq_frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => any::<u64>().prop_map(|s| s.to_be_bytes().to_vec()),
        1 => Just((-1i64).to_be_bytes().to_vec()),
        1 => prop::collection::vec(any::<u8>(), 0..12),
    ]
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![6 => batch().prop_map(|b| pack(&b)), 1 => prop::collection::vec(any::<u8>(), 0..64)]
}

/// Live frames `[topic, seq, payload]`, a tenth of the time with a frame too many or too few.
fn live_frames() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let miscount = prop::option::weighted(0.1, 0..6usize);
    (prop::collection::vec(any::<u8>(), 0..4), seq_frame(), payload(), miscount).prop_map(|(topic, seq, payload, n)| {
        let mut frames = vec![topic, seq, payload];
        if let Some(n) = n {
            frames.resize(n, vec![]);
        }
        frames
    })
}

/// Replay answers: SGLang's `["", topic, seq, payload]`, vLLM's `["", seq, payload]`, or neither.
fn replay_answer() -> impl Strategy<Value = Vec<Vec<u8>>> {
    (any::<bool>(), any::<bool>(), seq_frame(), payload(), 0..6usize).prop_map(|(topic, empty, seq, payload, n)| {
        let delimiter = if empty { vec![] } else { b"id".to_vec() };
        let mut frames = vec![delimiter];
        if topic {
            frames.push(b"kv".to_vec());
        }
        frames.extend([seq, payload]);
        if n < frames.len() && n > 0 {
            frames.truncate(n);
        }
        frames
    })
}

fn assets() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer")
}

/// An indexer with the shipped tokenizer and chat template, and a token.
fn app() -> Arc<App> {
    let tok = assets();
    let config = sgl_envoy_router::config::from_value(json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}],
        "prefix_index": {"url": "http://127.0.0.1:9", "block_tokens": 4, "token_header": "x-t", "token": "s"},
        "models": {"m": {"tokenizer": tok.join("tokenizer.json"), "chat_template": tok.join("tokenizer_config.json"),
                         "buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}
    }))
    .unwrap();
    Arc::new(App::load(config, MemoryBudget::new(64 << 20, 1)).unwrap())
}

fn json_value() -> impl Strategy<Value = Value> {
    let scalar = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        ".{0,24}".prop_map(Value::from),
        prop::sample::select(vec!["m", "user", "system", "assistant", "text", "<|im_start|>", "<|im_end|>"])
            .prop_map(Value::from),
    ];
    scalar.prop_recursive(4, 32, 6, |inner| {
        let keys = prop::sample::select(vec![
            "model",
            "messages",
            "role",
            "content",
            "type",
            "text",
            "tools",
            "token_ids",
            "handle",
            "worker",
            "cache_salt",
            "lora_path",
        ]);
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((keys, inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// A request to one of the POST endpoints: a valid body with one field replaced, or anything.
fn request() -> impl Strategy<Value = (&'static str, Vec<u8>, bool)> {
    let path = prop::sample::select(vec!["/query", "/v1/prefix/match", "/v1/prefix/routed"]);
    let body = (
        prop::sample::select(vec!["model", "messages", "token_ids", "handle", "worker", "tools", "cache_salt"]),
        json_value(),
    )
        .prop_map(|(key, value)| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hello there"}],
                                  "token_ids": [1, 2, 3, 4], "handle": "1", "worker": "A"});
            body[key] = value;
            body.to_string().into_bytes()
        });
    let body = prop_oneof![4 => body, 1 => prop::collection::vec(any::<u8>(), 0..64)];
    (path, body, prop::bool::weighted(0.9))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    #[ignore = "scripts/fuzz"]
    fn live_event_frames_never_panic_and_what_they_store_stays_within_the_index_budget(
        messages in prop::collection::vec(live_frames(), 1..12),
        query in prop::collection::vec(0u32..8, 0..24),
    ) {
        let mut index = Index::new(4, 32);
        for frames in messages {
            if let Ok((_, batch)) = decode_frames(&frames) {
                for event in &batch.events {
                    if let KvEvent::Stored(s) = event {
                        prop_assert_eq!(s.token_ids.len(), s.block_size * s.block_hashes.len());
                    }
                    index.apply("A", batch.dp_rank.unwrap_or(0), event);
                }
            }
        }
        prop_assert!(index.pages() <= 32);
        let _ = index.match_keys(&block_keys(&query, 4, None, None), 0);
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn replay_answers_never_panic_and_read_their_sequence_number(frames in replay_answer()) {
        if let Ok((seq, _)) = replay_frames(&frames) {
            let at = frames.len() - 2;
            prop_assert!(frames[0].is_empty());
            prop_assert_eq!(seq.to_be_bytes().to_vec(), frames[at].clone());
        }
    }
}

proptest! {
    // Each case is a whole HTTP exchange through the tokenizer: a tenth of the cases of the others.
    #![proptest_config(Config { cases: config().cases / 10, ..config() })]

    #[test]
    #[ignore = "scripts/fuzz"]
    fn http_requests_never_panic_nor_fail_on_the_server_side((path, body, token) in request()) {
        thread_local! {
            static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            static APP: Arc<App> = app();
        }
        let status = RT.with(|rt| APP.with(|app| rt.block_on(async {
            let mut request = Request::post(path).header("content-type", "application/json");
            if token {
                request = request.header("x-t", "s");
            }
            let router = sgl_indexer::http::router(Arc::clone(app));
            router.oneshot(request.body(Body::from(body.clone())).unwrap()).await.unwrap().status()
        })));
        // A 503 is a deadline passed on a slow machine, never a fault.
        prop_assert!(!status.is_server_error() || status == StatusCode::SERVICE_UNAVAILABLE, "{status} for {path} {}", String::from_utf8_lossy(&body));
        prop_assert!(token || status == StatusCode::UNAUTHORIZED);
        let panics = APP.with(|app| app.stats.panics.load(std::sync::atomic::Ordering::Relaxed));
        prop_assert_eq!(panics, 0);
    }
}

#[test]
fn the_generators_reach_past_the_first_check() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let decoded = (0..300)
        .filter(|_| {
            decode_frames(&live_frames().new_tree(&mut runner).unwrap().current())
                .is_ok_and(|(_, b)| !b.events.is_empty())
        })
        .count();
    assert!(decoded > 30, "only {decoded} of 300 generated frame sets decode to events");
    let replays =
        (0..300).filter(|_| replay_frames(&replay_answer().new_tree(&mut runner).unwrap().current()).is_ok()).count();
    assert!(replays > 30, "only {replays} of 300 generated replay answers read");
}
