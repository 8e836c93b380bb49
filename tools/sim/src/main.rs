//! sgl-sim: one simulated SGLang engine per process. It serves the engine API the router talks to
//! (chat completions, load, health, server info) with real running/waiting counts, plus a control
//! endpoint that lets a test pin load or inject faults.

mod abort;
mod chat;
mod control;
mod engine;
mod events;
mod info;
mod kv;
mod loads;
mod pd;
mod trace;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::HeaderValue;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use clap::Parser;

use crate::engine::{Args, Engine};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let mut engine = Engine::new(&args);
    engine.trace = match trace::Trace::open(args.trace.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("sgl-sim: --trace: {e}");
            std::process::exit(2);
        }
    };
    if let Some(tokenizer) = &args.tokenizer {
        let template = args.chat_template.clone().unwrap_or_else(|| tokenizer.with_file_name("tokenizer_config.json"));
        match sgl_indexer::tokenize::ModelTokenizer::load(tokenizer, &template) {
            Ok(t) => engine.tokenizer = Some(t),
            Err(e) => {
                eprintln!("sgl-sim: {e}");
                std::process::exit(2);
            }
        }
    }
    if let Some(endpoint) = &args.kv_events {
        if engine.tokenizer.is_none() {
            eprintln!("sgl-sim: --kv-events needs --tokenizer (events carry real token ids)");
            std::process::exit(2);
        }
        let page = engine.caches[0].page_tokens();
        let starts = (0..args.dp_size.max(1)).map(|rank| {
            events::Publisher::start(events::PublisherSpec {
                endpoint,
                replay: args.kv_events_replay.as_deref(),
                rank,
                page,
                medium: &args.kv_events_medium,
                sglang: args.kv_events_sglang.as_deref().map(|m| (m, args.python.as_str())),
            })
        });
        for started in futures_util::future::join_all(starts).await {
            match started {
                Ok(p) => engine.events.push(p),
                Err(e) => {
                    eprintln!("sgl-sim: {e}");
                    std::process::exit(2);
                }
            }
        }
    }
    let engine = Arc::new(engine);
    let engine_id = HeaderValue::from_str(&args.id).unwrap_or(HeaderValue::from_static("invalid-id"));

    let app = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::chat_completions))
        .route("/generate", post(chat::chat_completions))
        .route("/v1/loads", get(loads::v1_loads))
        .route("/get_load", get(loads::get_load))
        .route("/metrics", get(loads::metrics))
        .route("/abort_request", post(abort::abort_request))
        .route("/health", get(info::health))
        .route("/health_generate", get(info::health))
        .route("/server_info", get(info::server_info))
        .route("/get_server_info", get(info::server_info))
        .route("/model_info", get(info::model_info))
        .route("/get_model_info", get(info::model_info))
        .route("/v1/models", get(info::models))
        .route("/flush_cache", post(info::flush_cache).get(info::flush_cache))
        .route("/sim/control", post(control::update))
        .route("/sim/state", get(control::state))
        // SGLang accepts large prompts; the router's own 32 MiB limit is what a test exercises.
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .layer(axum::middleware::map_response(move |mut response: axum::response::Response| {
            let id = engine_id.clone();
            async move {
                response.headers_mut().insert("x-sim-engine", id);
                response
            }
        }))
        .with_state(Arc::clone(&engine));

    if let Some(port) = engine.bootstrap_port() {
        let addr = SocketAddr::new(args.host, port);
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bootstrap = pd::bootstrap_router(Arc::clone(&engine));
        let id = args.id.clone();
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, bootstrap).await {
                eprintln!("sgl-sim {id}: bootstrap server stopped: {e}");
            }
        });
    }

    let addr = SocketAddr::new(args.host, args.port);
    // SGLang's server (uvicorn on asyncio) sets TCP_NODELAY on every connection; without it a
    // streamed chunk written while an earlier one awaits a delayed ACK waits up to 40 ms.
    let listener = tokio::net::TcpListener::bind(addr).await?.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    eprintln!("sgl-sim {} ({}, model {}) listening on {addr}", args.id, args.role.as_str(), args.model);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}
