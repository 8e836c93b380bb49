//! The generation endpoints: `POST /v1/chat/completions` and `/v1/completions` (OpenAI-shaped JSON
//! or SSE) and SGLang's `POST /generate` (`text` or `input_ids`, `sampling_params`), generated token
//! by token at the configured delay, holding a running slot for the request's whole life.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::abort::{Aborts, Registered};
use crate::control;
use crate::engine::{Engine, RequestRecord, Role, BYTES_PER_TOKEN};
use crate::kv;
use crate::pd;
use crate::trace;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The most tokens one request may ask the simulator to generate.
const MAX_GENERATED: u64 = 1_000_000;

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let message = message.into();
    (status, Json(json!({"object": "error", "error": {"message": message, "type": kind, "code": status.as_u16()}, "message": message})))
        .into_response()
}

/// Which API a request came in on: it decides where the prompt and budget are and the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Generate,
}

impl Api {
    fn of(path: &str) -> Self {
        match path {
            "/v1/completions" => Api::Completions,
            "/generate" => Api::Generate,
            _ => Api::Chat,
        }
    }

    /// `/generate` keeps its sampling fields in `sampling_params`.
    fn params(self, body: &Value) -> &Value {
        match self {
            Api::Generate => body.get("sampling_params").unwrap_or(&Value::Null),
            _ => body,
        }
    }

    fn budget(self, body: &Value) -> Option<u64> {
        let params = self.params(body);
        match self {
            Api::Generate => params.get("max_new_tokens").and_then(Value::as_u64),
            _ => params
                .get("max_completion_tokens")
                .and_then(Value::as_u64)
                .or_else(|| params.get("max_tokens").and_then(Value::as_u64)),
        }
    }

    /// The prompt of a completions or generate body: its text, or its token ids.
    fn raw_prompt(self, body: &Value) -> Option<&Value> {
        match self {
            Api::Chat => None,
            Api::Completions => body.get("prompt"),
            Api::Generate => body.get("text").or_else(|| body.get("input_ids")),
        }
    }
}

/// Token ids a body carries directly (a token-id prompt), each prompt of a batch in turn.
fn carried_ids(prompt: &Value) -> Option<Vec<u64>> {
    let items = prompt.as_array()?;
    match items.first()? {
        Value::Number(_) => items.iter().map(Value::as_u64).collect(),
        Value::Array(_) => {
            Some(items.iter().flat_map(|p| p.as_array().into_iter().flatten().filter_map(Value::as_u64)).collect())
        }
        _ => None,
    }
}

/// The text of a string prompt or of a batch of them.
fn raw_text(prompt: &Value) -> String {
    match prompt {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n"),
        _ => String::new(),
    }
}

fn prompt_tokens(body: &Value) -> u64 {
    let bytes: u64 = body
        .get("messages")
        .and_then(Value::as_array)
        .map(|messages| {
            messages
                .iter()
                .map(|m| match m.get("content") {
                    Some(Value::String(s)) => s.len() as u64,
                    Some(Value::Array(parts)) => {
                        parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).map(|t| t.len() as u64).sum()
                    }
                    _ => 0,
                })
                .sum()
        })
        .unwrap_or(0);
    bytes.div_ceil(BYTES_PER_TOKEN)
}

pub async fn chat_completions(
    State(engine): State<Arc<Engine>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received_ms = Engine::now_unix_ms();
    let body_bytes = body.len();
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestError", format!("invalid JSON body: {e}")),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let api = Api::of(uri.path());
    let rooms = pd::rooms_of(&body);
    let authorized = engine.args.api_key.as_ref().is_none_or(|key| {
        headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(format!("Bearer {key}").as_str())
    });
    let dp_rank = engine.rank_for(body.get("routed_dp_rank").or_else(|| body.get("data_parallel_rank")));
    let registered = Aborts::register(&engine, body.get("rid").and_then(Value::as_str).map(str::to_string));
    engine.record(RequestRecord {
        rid: body.get("rid").cloned(),
        path: uri.path().to_string(),
        stream,
        bootstrap_room: body.get("bootstrap_room").cloned(),
        bootstrap_host: body.get("bootstrap_host").cloned(),
        bootstrap_port: body.get("bootstrap_port").cloned(),
        received_ms,
        finished_ms: None,
        status: 0,
        headers: headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
            .collect(),
        body_bytes,
        routed_dp_rank: body.get("routed_dp_rank").cloned(),
        dp_rank,
    });
    let response = if authorized {
        let abort = Arc::clone(&registered.abort);
        // An abort before the answer starts drops the work where it is (and its slot with it).
        tokio::select! {
            r = serve(&engine, api, body, stream, rooms, received_ms, dp_rank, registered) => r,
            () = abort.aborted() => error(StatusCode::BAD_REQUEST, "AbortedError", "the request was aborted"),
        }
    } else {
        error(StatusCode::UNAUTHORIZED, "UnauthorizedError", "missing or wrong API key")
    };
    if !stream || !response.status().is_success() {
        engine.finish_record(received_ms, response.status().as_u16());
    }
    response
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    engine: &Arc<Engine>,
    api: Api,
    body: Value,
    stream: bool,
    rooms: Vec<u64>,
    received_ms: u64,
    dp_rank: u32,
    registered: Registered,
) -> Response {
    let arrived = std::time::Instant::now();
    let fault = engine.control().chat.clone();
    if let Some(r) = control::apply(fault, "chat").await {
        return r;
    }
    if let Some(r) = command_line_faults(engine).await {
        return r;
    }
    if engine.role != Role::Plain && rooms.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            "Disaggregated request received without bootstrap room id",
        );
    }
    if engine.role == Role::Decode {
        let Some(targets) = pd::targets_of(&body, &rooms) else {
            return error(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "Disaggregated request received without bootstrap host and port",
            );
        };
        if let Err(message) = pd::await_prefill(engine, &targets).await {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", message);
        }
    }
    // The prompt as this engine counts it: the model's tokenizer when it has one (as a real
    // engine), else the router's 4-byte estimate.
    let raw = api.raw_prompt(&body);
    let (prompt_ids, prompt): (Vec<u64>, u64) = match (raw, raw.and_then(carried_ids)) {
        (_, Some(ids)) => {
            let n = ids.len() as u64;
            (ids, n)
        }
        (Some(raw), None) => {
            let text = raw_text(raw);
            let n = (text.len() as u64).div_ceil(BYTES_PER_TOKEN);
            (kv::tokenize(&text), n)
        }
        (None, None) => match engine.tokenizer.as_ref().map(|t| t.tokenize_chat(&body)) {
            Some(Ok(ids)) => {
                let n = ids.len() as u64;
                (ids.into_iter().map(u64::from).collect(), n)
            }
            _ => (kv::tokenize(&prompt_text(&body)), prompt_tokens(&body)),
        },
    };
    let uncached_on_arrival = match engine.role {
        Role::Decode => 0,
        _ => prompt.saturating_sub(engine.caches[dp_rank as usize].cached_tokens(&prompt_ids)),
    };
    let Some(mut slot) = engine.admit(prompt, uncached_on_arrival, dp_rank).await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", "engine is shutting down");
    };
    let slotted = std::time::Instant::now();
    // A batch (several prompts) is answered per prompt, each `n` times.
    let prompts = raw.map_or(1, |r| match r {
        Value::Array(items) if matches!(items.first(), Some(Value::String(_) | Value::Array(_))) => items.len() as u64,
        _ => 1,
    });
    let choices = (api.params(&body).get("n").and_then(Value::as_u64).unwrap_or(1) * prompts).clamp(1, 128);
    let budget = api.budget(&body);

    // Prefill: the uncached part of the prompt at the engine's throughput, one prefill (or one
    // batch) at a time; then the rooms are ready for their decode engines.
    let cached = if engine.role == Role::Decode {
        prompt_ids.len() as u64
    } else {
        let served = engine.caches[dp_rank as usize].serve(&prompt_ids);
        if let Some(events) = engine.events.get(dp_rank as usize) {
            events.served(&served);
        }
        served.cached_tokens
    };
    let uncached = (prompt_ids.len() as u64).saturating_sub(cached);
    let (laned, prefilled) = engine.prefill(uncached).await;
    let marks = trace::Marks { arrived, slotted, laned, prefilled };
    // Written once the prefill lane is free: the file's I/O must not delay the next prefill.
    engine.trace.write(&engine.id, received_ms, marks, prompt_ids.len() as u64, cached, prompt_ids.get(3).copied());
    let tokens = if engine.role == Role::Prefill {
        for room in &rooms {
            engine.rooms.finish(*room);
        }
        let linger = engine.control().prefill_linger_ms;
        if linger > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(linger)).await;
        }
        1
    } else {
        budget.unwrap_or(engine.args.default_output_tokens).min(MAX_GENERATED)
    };
    let finish_reason = if budget.is_some_and(|b| b <= tokens) { "length" } else { "stop" };
    let include_usage = body.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let meta = Meta {
        id: format!("chatcmpl-sim-{}-{}", engine.id, NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        created: Engine::now_unix_ms() / 1000,
        model: body.get("model").and_then(Value::as_str).unwrap_or(&engine.model).to_string(),
        engine: engine.id.clone(),
    };
    engine.served.fetch_add(1, Ordering::SeqCst);

    if !stream {
        for _ in 1..tokens {
            tokio::time::sleep(engine.decode_step()).await;
            slot.add_kv_token();
        }
        drop(slot);
        let text = token_text(0, tokens);
        let usage = usage(prompt, cached, tokens * choices);
        let answer = match api {
            Api::Chat => json!({
                "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                "sim_engine": meta.engine, "usage": usage,
                "choices": (0..choices).map(|i| json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason})).collect::<Vec<_>>(),
            }),
            Api::Completions => json!({
                "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                "sim_engine": meta.engine, "usage": usage,
                "choices": (0..choices).map(|i| json!({"index": i, "text": text, "logprobs": null, "finish_reason": finish_reason})).collect::<Vec<_>>(),
            }),
            Api::Generate => {
                let one = |i: u64| generate_answer(&meta, &text, i, prompt, cached, tokens, Some(finish_reason));
                if choices == 1 {
                    one(0)
                } else {
                    Value::Array((0..choices).map(one).collect())
                }
            }
        };
        return Json(answer).into_response();
    }

    let engine_for_stream = Arc::clone(engine);
    let events = async_stream::stream! {
        // The token `t` (or the end, `None`) of choice `c`, in the API's streaming shape.
        let chunk = |c: u64, t: Option<u64>| -> Bytes {
            let finish = if t.is_none() { Some(finish_reason) } else { None };
            match api {
                Api::Chat => sse(&json!({
                    "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                    "sim_engine": meta.engine,
                    "choices": [{"index": c, "delta": t.map_or(json!({}), |t| json!({"content": token_text(t, t + 1)})), "finish_reason": finish}],
                })),
                Api::Completions => sse(&json!({
                    "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
                    "sim_engine": meta.engine,
                    "choices": [{"index": c, "text": t.map_or(String::new(), |t| token_text(t, t + 1)), "logprobs": null, "finish_reason": finish}],
                })),
                // SGLang streams the text so far.
                Api::Generate => {
                    let upto = t.map_or(tokens, |t| t + 1);
                    sse(&generate_answer(&meta, &token_text(0, upto), c, prompt, cached, upto, finish))
                }
            }
        };
        if api == Api::Chat {
            for c in 0..choices {
                yield Ok::<Bytes, Infallible>(sse(&json!({
                    "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                    "sim_engine": meta.engine,
                    "choices": [{"index": c, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}],
                })));
            }
        }
        let mut aborted = false;
        for t in 0..tokens {
            if t > 0 {
                tokio::time::sleep(engine_for_stream.decode_step()).await;
                slot.add_kv_token();
            }
            if registered.abort.is_set() {
                aborted = true;
                break;
            }
            for c in 0..choices {
                yield Ok::<Bytes, Infallible>(chunk(c, Some(t)));
            }
        }
        if aborted {
            for c in 0..choices {
                yield Ok(sse(&json!({
                    "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                    "sim_engine": meta.engine,
                    "choices": [{"index": c, "delta": {}, "finish_reason": "abort"}],
                })));
            }
        } else if api != Api::Generate {
            for c in 0..choices {
                yield Ok(chunk(c, None));
            }
        }
        if include_usage {
            yield Ok(sse(&json!({
                "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                "sim_engine": meta.engine, "choices": [],
                "usage": usage(prompt, cached, tokens * choices),
            })));
        }
        yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
        drop(slot);
        engine_for_stream.finish_record(received_ms, 200);
    };
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(events))
        .into_response()
}

/// The faults given on the command line: added latency, an error rate, hanging, crashing.
async fn command_line_faults(engine: &Engine) -> Option<Response> {
    let args = &engine.args;
    let served = engine.chat_requests.fetch_add(1, Ordering::SeqCst) + 1;
    if args.crash_after.is_some_and(|n| served > n) {
        eprintln!("sgl-sim {}: crashing after {} requests, as asked", engine.id, served - 1);
        std::process::exit(3);
    }
    if args.fault_latency_ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(args.fault_latency_ms)).await;
    }
    if args.fault_hang {
        std::future::pending::<()>().await;
    }
    (args.fault_error_rate > 0.0 && engine.fault_draw() < args.fault_error_rate)
        .then(|| error(StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", "simulated engine error"))
}

/// What the engine's cache sees: each message's role and text, as the router's prefix index does.
fn prompt_text(body: &Value) -> String {
    let mut out = String::new();
    for m in body.get("messages").and_then(Value::as_array).into_iter().flatten() {
        out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
        out.push_str(": ");
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    out.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""));
                }
            }
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// OpenAI's usage, with the prompt tokens served from the prefix cache as SGLang reports them.
fn usage(prompt: u64, cached: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached.min(prompt)},
    })
}

/// SGLang's `/generate` answer for one sequence.
fn generate_answer(
    meta: &Meta,
    text: &str,
    index: u64,
    prompt: u64,
    cached: u64,
    completion: u64,
    finish: Option<&str>,
) -> Value {
    json!({
        "text": text,
        "index": index,
        "sim_engine": meta.engine,
        "meta_info": {
            "id": meta.id, "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "finish_reason": finish.map(|f| json!({"type": f})),
        },
    })
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    engine: String,
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// Tokens `from..to` of the simulated answer.
fn token_text(from: u64, to: u64) -> String {
    (from..to).map(|i| format!("tok{i} ")).collect()
}
