//! `sgl-indexer --config ROUTER.yaml --listen ADDR:PORT`: subscribes to every configured engine's
//! KV events and serves the query API (spec §7).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use clap::Parser;
use sgl_envoy_router::config;
use sgl_indexer::state::{App, DEFAULT_MAX_PAGES};
use sgl_indexer::{http, subscriber};

#[derive(Debug, Parser)]
#[command(name = "sgl-indexer", about = "Precise prefix index from engine KV events")]
struct Args {
    /// The router configuration (YAML or JSON), the same the filter and the CLI read.
    #[arg(long)]
    config: PathBuf,
    #[arg(long, default_value = "127.0.0.1:9100")]
    listen: SocketAddr,
    /// Engine pages kept across all models (about 190 bytes each); the oldest go first.
    #[arg(long, default_value_t = DEFAULT_MAX_PAGES)]
    max_pages: usize,
}

fn load(path: &PathBuf) -> Result<config::RouterConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let value: serde_json::Value = serde_yaml_ng::from_str(&text).map_err(|e| format!("(document): {e}"))?;
    config::from_value(value).map_err(|errors| errors.0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let config = match load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sgl-indexer: configuration rejected:\n{e}");
            return ExitCode::from(1);
        }
    };
    let app = match App::load(config, args.max_pages) {
        Ok(app) => Arc::new(app),
        Err(e) => {
            eprintln!("sgl-indexer: {e}");
            return ExitCode::from(1);
        }
    };
    let subs = subscriber::subscriptions(&app.config);
    app.stats.subscriptions.store(subs.len() as u64, Ordering::Relaxed);
    for sub in subs {
        tokio::spawn(subscriber::run(sub, Arc::clone(&app)));
    }
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sgl-indexer: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(1);
        }
    };
    eprintln!("sgl-indexer listening on {}", args.listen);
    match axum::serve(listener, http::router(app)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sgl-indexer: server stopped: {e}");
            ExitCode::from(1)
        }
    }
}
