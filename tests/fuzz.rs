//! Property-based fuzzing of everything in the filter that reads untrusted bytes: the bodies of
//! all three generation endpoints, the router configuration, every engine load report, and the
//! prefix events filters queue to the service. (The indexer's readers have their own targets in
//! `tools/indexer/tests/fuzz.rs`.)
//! Each property is "never panics, and what it accepts is consistent". Run by `scripts/fuzz`
//! (ignored in `scripts/test`); `FUZZ_CASES` sets the cases per target (default 1,000,000).
//! Failing inputs proptest finds are kept in `tests/fuzz.proptest-regressions` and replayed first;
//! the ones that showed real defects also became unit tests next to the code they broke.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{json, Map, Value};
use sgl_envoy_router::config;
use sgl_envoy_router::filter::generation::{prepare_chat, prepare_endpoint, Endpoint};
use sgl_envoy_router::state::load_monitor::{parse_get_load, parse_prometheus, parse_v1_loads};
use sgl_envoy_router::state::prefix::{apply, wire, PrefixEvent, RadixTree};

#[path = "support/fuzz_config.rs"]
mod fuzz_config;
use fuzz_config::config;

/// Field names the readers look for, so generated documents reach past the first check.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "stream",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "tools",
    "bootstrap_room",
    "loads",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "num_waiting_uncached_tokens",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "num_reqs",
    "num_tokens",
    "workers",
    "id",
    "url",
    "buckets",
    "groups",
    "plain",
    "pd",
    "prefill",
    "decode",
    "policy",
    "worker_ids",
    "limits",
    "min",
    "max",
    "max_context_tokens",
    "admission",
    "load",
    "source",
    "health",
    "upstream",
    "mode",
    "header",
    "event",
    "worker",
    "tier",
    "circuit_breaker",
    "tokens",
    "bytes_per_token",
    "fallback",
    "min_hit_ratio",
    "pressure_guard",
    "saturation_floor",
    "worker_queue_limit",
    "min_candidates",
    "max_candidates",
    "dp_size",
    "bootstrap_port",
    "cluster",
    "rank",
    "models",
    "demo",
    "prompt",
    "input_ids",
    "sampling_params",
    "max_new_tokens",
];

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        prop_oneof![Just(f64::MAX), Just(f64::MIN_POSITIVE), Just(-0.0)].prop_map(Value::from),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "text",
            "image_url",
            "demo",
            "m",
            "round_robin",
            "cache_aware",
            "power_of_two",
            "prefill",
            "decode",
            "plain",
            "sglang_loads",
            "none",
            "http://127.0.0.1:1",
            "stored",
            "removed",
            "all_cleared",
            "gpu",
            "",
            "é漢字🙂",
            "\u{0}",
        ])
        .prop_map(Value::from),
        ".{0,40}".prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
        ]
    })
}

/// A valid chat body with one field replaced by anything.
fn chat_body() -> impl Strategy<Value = Vec<u8>> {
    let base = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8});
    (prop::sample::select(KEYS), json_value(), any::<bool>()).prop_map(move |(key, value, nested)| {
        let mut body = base.clone();
        if nested {
            body["messages"][0][key] = value;
        } else {
            body[key] = value;
        }
        body.to_string().into_bytes()
    })
}

/// A valid `/v1/completions` or `/generate` body with one field (or one sampling parameter)
/// replaced by anything, or a prompt of many token ids or many prompts.
fn endpoint_body() -> impl Strategy<Value = (Endpoint, Vec<u8>)> {
    let completions = json!({"model": "demo", "prompt": ["a", "bc"], "max_tokens": 8, "n": 2});
    let generate = json!({"text": "hi", "sampling_params": {"max_new_tokens": 8, "n": 1}});
    let prompts = prop_oneof![
        prop::collection::vec(any::<u32>().prop_map(Value::from), 0..64).prop_map(Value::Array),
        prop::collection::vec(".{0,8}".prop_map(Value::from), 0..1100).prop_map(Value::Array),
        prop::collection::vec(
            prop::collection::vec(any::<u16>().prop_map(Value::from), 1..4).prop_map(Value::Array),
            0..9
        )
        .prop_map(Value::Array),
    ];
    let value = prop_oneof![json_value(), prompts];
    (any::<bool>(), prop::sample::select(KEYS), value, any::<bool>()).prop_map(move |(gen, key, value, nested)| {
        let (endpoint, mut body) =
            if gen { (Endpoint::Generate, generate.clone()) } else { (Endpoint::Completions, completions.clone()) };
        if nested && gen {
            body["sampling_params"][key] = value;
        } else {
            body[key] = value;
        }
        (endpoint, body.to_string().into_bytes())
    })
}

/// A valid chat body's text with one raw member put in among its own: the members no JSON tree
/// holds (`1e400`), a `rid` of any type or spelling, several copies of what the filter sets.
fn raw_chat_body() -> impl Strategy<Value = Vec<u8>> {
    let raw = prop_oneof![
        Just(r#""x": 1e400"#.to_string()),
        Just(r#""x": -1e-400"#.to_string()),
        Just(r#""rid": null"#.to_string()),
        Just(r#""r\u0069d": ["a", 1]"#.to_string()),
        Just(r#""routed_dp_rank": 1e999, "routed_dp_rank": "s""#.to_string()),
        Just(r#""bootstrap_room" : {"a": [1e400]}"#.to_string()),
        (prop::sample::select(KEYS), json_value()).prop_map(|(k, v)| format!("{}:{v}", Value::from(k))),
    ];
    (raw, 0usize..3, "[ \t\n]{0,2}").prop_map(|(member, at, space)| {
        let parts = [r#""model": "demo""#, r#""messages": [{"role": "user", "content": "hi"}]"#, r#""max_tokens": 8"#];
        let mut members: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
        members.insert(at, member);
        format!("{space}{{{}}}{space}", members.join(&format!(",{space}"))).into_bytes()
    })
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..256), json_value().prop_map(|v| v.to_string().into_bytes()),]
}

fn router_config() -> impl Strategy<Value = Value> {
    let base = json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:30001", "model": "m"},
                    {"id": "B", "url": "http://127.0.0.1:30002", "model": "m"}],
        "models": {"m": {"buckets": [{"id": "b", "limits": {"min": 0, "max": 4096},
            "groups": {"plain": {"policy": {"type": "cache_aware", "min_hit_ratio": 0.5}}}}]}}
    });
    let paths: Vec<Vec<&'static str>> = vec![
        vec![],
        vec!["workers", "0"],
        vec!["models", "m"],
        vec!["models", "m", "buckets", "0"],
        vec!["models", "m", "buckets", "0", "groups", "plain"],
        vec!["models", "m", "buckets", "0", "groups", "plain", "policy"],
        vec!["models", "m", "buckets", "0", "limits"],
    ];
    // Half the time a numeric knob the document really has, so many documents pass the structure
    // and reach the semantic checks.
    let knobs = vec![
        "min_hit_ratio",
        "min_candidates",
        "max_candidates",
        "rank",
        "max",
        "min",
        "dp_size",
        "max_context_tokens",
    ];
    let value = prop_oneof![json_value(), (0u64..5000).prop_map(Value::from), (0.0f64..1.5).prop_map(Value::from)];
    let key = prop_oneof![prop::sample::select(KEYS), prop::sample::select(knobs)];
    (prop::sample::select(paths), key, value, json_value()).prop_map(move |(path, key, value, whole)| {
        if key == "demo" {
            return whole;
        }
        let mut doc = base.clone();
        let mut at = &mut doc;
        for p in &path {
            at = match p.parse::<usize>() {
                Ok(i) => &mut at[i],
                Err(_) => &mut at[*p],
            };
        }
        if let Value::Object(m) = at {
            m.insert(key.to_string(), value);
        }
        doc
    })
}

fn prefix_event() -> impl Strategy<Value = Vec<u8>> {
    let text = prop_oneof![".{0,64}", "(ab){0,40}", Just("x".repeat(5000))];
    let event = (0..4u8, "[ab]", "[AB]", text, prop::sample::select(vec!["gpu", "cpu", "disk", "tape"])).prop_map(
        |(kind, model, worker, text, tier)| match kind {
            0 => json!({"stored": [model, worker, text, tier]}),
            1 => json!({"removed": {"model": model, "worker": worker, "text": text}}),
            2 => json!({"all_cleared": [worker]}),
            _ => json!({ text: [] }),
        },
    );
    // The queue's wire form (MessagePack); a struct may come as an array or a map.
    let encoded = event.prop_map(|e| rmp_serde::to_vec(&e).unwrap_or_default());
    prop_oneof![4 => encoded, 1 => bytes()]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    #[ignore = "scripts/fuzz"]
    fn the_chat_body_parser_never_panics_and_its_facts_are_consistent(body in prop_oneof![chat_body(), bytes()]) {
        if let Ok((facts, prompt)) = prepare_chat(&body, 4, true) {
            prop_assert!(!facts.model.is_empty());
            prop_assert!((1..=128).contains(&facts.n));
            if let Some(peak) = facts.expected_peak_tokens {
                prop_assert!(peak >= facts.input_tokens);
                prop_assert_eq!(Some(peak - facts.input_tokens), facts.output_budget);
            }
            // Every message contributes at least its "role: " and line end.
            prop_assert!(prompt.is_some());
        }
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn a_body_the_filter_accepts_is_edited_and_keeps_its_facts(body in prop_oneof![raw_chat_body(), chat_body(), bytes()]) {
        use sgl_envoy_router::filter::generation::body_edit::{edit_members, with_members, Member};
        let Ok((facts, _)) = prepare_chat(&body, 4, true) else { return Ok(()) };
        let set = [
            Member::new("rid", &json!("sgl-0")),
            Member::new("routed_dp_rank", &json!(1)),
            Member::new("bootstrap_room", &json!([1, 2])),
        ];
        let edited = with_members(&body, &set);
        prop_assert!(edited.is_ok(), "{:?}: {}", edited, String::from_utf8_lossy(&body));
        let edited = edited.unwrap();
        // The edit as the glue hands it to Envoy: the first bytes replaced, the length as sent.
        let edit = edit_members(&body, &set).unwrap();
        prop_assert_eq!(edit.len, edited.len());
        prop_assert_eq!([edit.head.as_slice(), &body[edit.replaced..]].concat(), edited.clone());
        let again = prepare_chat(&edited, 4, true);
        prop_assert!(again.is_ok(), "{}", String::from_utf8_lossy(&edited));
        prop_assert_eq!(again.unwrap().0, facts);
        // Every copy is the filter's already: editing again changes nothing.
        prop_assert_eq!(with_members(&edited, &set).unwrap(), edited.clone());
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn the_completions_and_generate_parsers_never_panic_and_keep_their_limits(
        (endpoint, body) in prop_oneof![endpoint_body(), (prop::sample::select(vec![Endpoint::Completions, Endpoint::Generate]), bytes())]
    ) {
        if let Ok(prepared) = prepare_endpoint(endpoint, &body, 4, Some("demo"), true) {
            let facts = prepared.facts;
            prop_assert!(!facts.model.is_empty());
            prop_assert!((1..=1024).contains(&facts.n), "{} sequences", facts.n);
            if let Some(peak) = facts.expected_peak_tokens {
                prop_assert!(peak >= facts.input_tokens);
            }
            prop_assert!(prepared.prompt_text.is_some_and(|t| t.len() <= sgl_envoy_router::filter::generation::MAX_PROMPT_BYTES));
        }
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn the_router_configuration_never_panics_and_every_error_names_a_path(doc in router_config()) {
        match config::from_value(doc) {
            Ok(c) => prop_assert!(!c.workers.is_empty() && !c.models.is_empty()),
            Err(errors) => {
                prop_assert!(!errors.0.is_empty());
                for e in &errors.0 {
                    prop_assert!(!e.path.is_empty() && !e.message.is_empty(), "{:?}", e);
                }
            }
        }
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn every_load_report_parser_never_panics(body in bytes(), text in "(sglang|vllm):[a-z_]{3,24}(\\{[a-z_]{0,8}=\"[0-9]{0,3}\"\\})? -?[0-9e.+]{0,12}\n{0,2}") {
        let parsed = [parse_v1_loads(&body), parse_get_load(&body), parse_prometheus(&body), parse_prometheus(text.as_bytes())];
        for ranks in parsed.into_iter().flatten() {
            prop_assert!(ranks.len() <= 1 << 16);
        }
    }

    #[test]
    #[ignore = "scripts/fuzz"]
    fn prefix_events_never_panic_and_the_trees_stay_within_budget(events in prop::collection::vec(prefix_event(), 1..24)) {
        let budget = 4096;
        let mut trees: BTreeMap<String, RadixTree> = BTreeMap::new();
        // A queue message is a VM's held events back to back, as the service reads it.
        let message = events.concat();
        let (Ok(decoded) | Err((decoded, _))) = wire::decode_each::<PrefixEvent>(&message);
        for (seq, event) in decoded.iter().enumerate() {
            apply(&mut trees, event, seq as u64, &|_| budget);
        }
        for tree in trees.values() {
            prop_assert!(tree.size_bytes() <= budget, "{} > {budget}", tree.size_bytes());
            let _ = tree.match_prefix(b"abab");
        }
    }
}

#[test]
fn the_generators_reach_past_the_first_check() {
    // A smoke check of the generators themselves, run with the rest of the suite.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let accepted = (0..500)
        .filter(|_| {
            let body = chat_body().new_tree(&mut runner).unwrap().current();
            prepare_chat(&body, 4, false).is_ok()
        })
        .count();
    assert!(accepted > 50, "only {accepted} of 500 generated chat bodies parse");
    let configs = (0..200)
        .filter(|_| config::from_value(router_config().new_tree(&mut runner).unwrap().current()).is_ok())
        .count();
    assert!(configs > 5, "only {configs} of 200 generated configurations validate");
    let events = (0..200)
        .filter(|_| wire::decode::<PrefixEvent>(&prefix_event().new_tree(&mut runner).unwrap().current()).is_ok())
        .count();
    assert!(events > 50, "only {events} of 200 generated prefix events decode");
    let endpoints = (0..500)
        .filter(|_| {
            let (endpoint, body) = endpoint_body().new_tree(&mut runner).unwrap().current();
            prepare_endpoint(endpoint, &body, 4, Some("demo"), false).is_ok()
        })
        .count();
    assert!(endpoints > 50, "only {endpoints} of 500 generated completions and generate bodies parse");
    let raw = (0..500)
        .filter(|_| prepare_chat(&raw_chat_body().new_tree(&mut runner).unwrap().current(), 4, false).is_ok())
        .count();
    assert!(raw > 200, "only {raw} of 500 generated raw chat bodies parse");
    let _ = Map::<String, Value>::new();
}
