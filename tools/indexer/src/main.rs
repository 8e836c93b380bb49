//! `sgl-indexer --config ROUTER.yaml --listen ADDR:PORT`: subscribes to every configured engine's
//! KV events and serves the query API (spec §7).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use sgl_envoy_router::config;
use sgl_indexer::replicas::Replicas;
use sgl_indexer::snapshot::Snapshot;
use sgl_indexer::state::{App, MemoryBudget, DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_MEMORY_MB};
use sgl_indexer::{http, subscriber};

#[derive(Debug, Parser)]
#[command(name = "sgl-indexer", about = "Precise prefix index from engine KV events")]
struct Args {
    /// The router configuration (YAML or JSON), the same the filter and the CLI read.
    #[arg(long)]
    config: PathBuf,
    /// Where to listen. A non-loopback address needs `prefix_index.token` (or `--insecure`).
    #[arg(long, default_value = "127.0.0.1:9100")]
    listen: SocketAddr,
    /// Memory for the index and its caches, in MiB: 3/4 for engine pages (100 bytes each; 66-95
    /// measured over the wire), 1/8 for the tokenizers' piece caches, 1/16 for match handles, 1/16
    /// for speculative entries.
    #[arg(long, default_value_t = DEFAULT_MAX_MEMORY_MB)]
    max_memory_mb: usize,
    /// Engine pages kept across all models, instead of the memory budget's 3/4 (66-95 bytes of
    /// resident memory per page, measured over the wire by indexer-compare); oldest go first.
    #[arg(long)]
    max_pages: Option<usize>,
    /// Queries that tokenize or match at once; the others wait, no longer than the filter does.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT)]
    max_concurrent: usize,
    /// Listen beyond loopback without a token: anyone who reaches the port can steer routing.
    #[arg(long)]
    insecure: bool,
    /// A running indexer (its base URL): its view (`GET /v1/snapshot`) is loaded before the
    /// engines are subscribed, and each rank repaired from where the peer was by replay.
    #[arg(long)]
    peer: Option<String>,
    /// This indexer's URL in `prefix_index.urls`, when its `--listen` address does not say which
    /// it is (the replicas agree claims and handles among themselves).
    #[arg(long)]
    advertise: Option<String>,
}

/// How long fetching a peer's snapshot may take before the indexer starts cold.
const PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// Fetches and loads a peer's view; the indexer starts cold (and says why) when it cannot.
async fn warm_from_peer(app: &Arc<App>, peer: &str, limit_bytes: u64) -> Result<usize, String> {
    let url = format!("{}{}", peer.trim_end_matches('/'), http::SNAPSHOT_PATH);
    let token = app.config.prefix_index.as_ref().and_then(|p| p.token_header.clone().zip(p.token.clone()));
    let block_tokens = app.block_tokens;
    let bytes = tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(PEER_TIMEOUT)).build().into();
        let mut request = agent.get(&url);
        if let Some((header, value)) = &token {
            request = request.header(header.as_str(), value.as_str());
        }
        let mut response = request.call().map_err(|e| format!("{url}: {e}"))?;
        response.body_mut().with_config().limit(limit_bytes).read_to_vec().map_err(|e| format!("{url}: {e}"))
    })
    .await
    .map_err(|e| e.to_string())??;
    let snapshot = Snapshot::decode(&bytes, block_tokens).map_err(|e| e.to_string())?;
    Ok(app.load_snapshot(snapshot))
}

fn load(path: &std::path::Path) -> Result<config::RouterConfig, String> {
    config::load_file(path).map_err(|errors| errors.0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))
}

// A panic is caught per request and answered 500 (`http::router`); with `panic = "abort"` it would
// end the process, and every engine subscription and the index with it.
const _: () = assert!(cfg!(panic = "unwind"), "sgl-indexer must be built with panic = \"unwind\"");

/// How often speculative entries past their time are dropped.
const EXPIRY_PERIOD: Duration = Duration::from_millis(100);

/// Refuses what would let anyone write to the index: a non-loopback listener without a token.
fn check_trust(args: &Args, config: &config::RouterConfig) -> Result<(), String> {
    let token = config.prefix_index.as_ref().is_some_and(|p| p.token.is_some());
    if args.listen.ip().is_loopback() || token || args.insecure {
        return Ok(());
    }
    Err(format!(
        "refusing to listen on {} without prefix_index.token: anyone reaching it could steer routing \
         (set a token, listen on loopback, or pass --insecure)",
        args.listen
    ))
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
    if let Err(e) = check_trust(&args, &config) {
        eprintln!("sgl-indexer: {e}");
        return ExitCode::from(2);
    }
    let mut budget = MemoryBudget::from_mb(args.max_memory_mb, &config);
    if let Some(pages) = args.max_pages {
        budget.index_pages = pages.max(1);
    }
    let replicas = Replicas::new(&config, args.listen, args.advertise.as_deref());
    let replica_count = config.prefix_index.as_ref().map_or(0, |p| p.endpoints().len());
    if replica_count > 1 && replicas.me().is_none() {
        eprintln!(
            "sgl-indexer: {} is not one of prefix_index.urls (pass --advertise URL): claims are not agreed with the others",
            args.listen
        );
    }
    let app = match App::load(config, budget) {
        Ok(app) => Arc::new(app.with_max_concurrent(args.max_concurrent).with_replicas(replicas.start())),
        Err(e) => {
            eprintln!("sgl-indexer: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(peer) = &args.peer {
        let limit = (args.max_memory_mb as u64).saturating_mul(1 << 20);
        match warm_from_peer(&app, peer, limit).await {
            Ok(ranks) => eprintln!("sgl-indexer: {ranks} engine ranks loaded from {peer}"),
            Err(e) => eprintln!("sgl-indexer: starting cold, the peer's snapshot did not load: {e}"),
        }
    }
    let subs = subscriber::subscriptions(&app.config);
    app.stats.subscriptions.store(subs.len() as u64, Ordering::Relaxed);
    for sub in subs {
        tokio::spawn(subscriber::run(sub, Arc::clone(&app)));
    }
    let expiring = Arc::clone(&app);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(EXPIRY_PERIOD);
        loop {
            every.tick().await;
            expiring.expire_speculative();
        }
    });
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sgl-indexer: cannot listen on {}: {e}", args.listen);
            return ExitCode::from(1);
        }
    };
    eprintln!("sgl-indexer listening on {}", args.listen);
    // Answers are small and the filter waits on each: nothing should hold them back for a
    // delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    match axum::serve(listener, http::router(app)).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sgl-indexer: server stopped: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(token: bool) -> config::RouterConfig {
        let token = if token { r#", "token_header": "x-t", "token": "s""# } else { "" };
        config::parse_and_validate(&format!(
            r#"{{"workers": [{{"id": "A", "url": "http://127.0.0.1:1", "model": "m"}}],
                "prefix_index": {{"url": "http://127.0.0.1:9"{token}}},
                "models": {{"m": {{"buckets": [{{"id": "b", "groups": {{"plain": {{"policy": {{"type": "random"}}}}}}}}]}}}}}}"#
        ))
        .unwrap()
    }

    fn args(listen: &str, insecure: bool) -> Args {
        let mut argv = vec!["sgl-indexer", "--config", "x.yaml", "--listen", listen];
        if insecure {
            argv.push("--insecure");
        }
        Args::parse_from(argv)
    }

    /// The index steers traffic: beyond loopback it takes a token, or an explicit --insecure.
    #[test]
    fn beyond_loopback_a_token_or_insecure_is_required() {
        assert!(check_trust(&args("0.0.0.0:9100", false), &config(false)).is_err());
        assert!(check_trust(&args("[::]:9100", false), &config(false)).is_err());
        assert!(check_trust(&args("0.0.0.0:9100", false), &config(true)).is_ok());
        assert!(check_trust(&args("0.0.0.0:9100", true), &config(false)).is_ok());
        assert!(check_trust(&args("127.0.0.1:9100", false), &config(false)).is_ok());
        assert!(check_trust(&args("[::1]:9100", false), &config(false)).is_ok());
    }
}
