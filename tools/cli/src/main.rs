use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sgl_envoy_router_cli::document;
use sgl_envoy_router_cli::render::{render, RenderOptions, DEFAULT_WASM};

#[derive(Parser)]
#[command(
    name = "sgl-envoy-router",
    version,
    about = "SGLang engine selection inside Envoy: configuration tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a router configuration exactly as the filter does at startup.
    Validate { config: PathBuf },
    /// Print a complete Envoy bootstrap (YAML) that runs the filter and service on this configuration.
    Render {
        config: PathBuf,
        /// Path of the wasm module, as Envoy will see it.
        #[arg(long, default_value = DEFAULT_WASM)]
        wasm: String,
        /// Listener address, ADDR:PORT.
        #[arg(long, default_value = "127.0.0.1:10000")]
        listen: String,
        /// Admin port (always bound to loopback).
        #[arg(long, default_value_t = 9901)]
        admin: u16,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Validate { config } => match document::load(&config) {
            Ok(c) => {
                let buckets: usize = c.models.values().map(|m| m.buckets.len()).sum();
                println!(
                    "ok: {} workers, {} models, {} buckets",
                    c.workers.len(),
                    c.models.len(),
                    buckets
                );
                ExitCode::SUCCESS
            }
            Err(errors) => report(&config, &errors),
        },
        Command::Render {
            config,
            wasm,
            listen,
            admin,
        } => {
            let Some((address, port)) = listen
                .rsplit_once(':')
                .and_then(|(a, p)| Some((a, p.parse().ok()?)))
            else {
                eprintln!("error: --listen must be ADDR:PORT, got `{listen}`");
                return ExitCode::FAILURE;
            };
            let loaded = match document::load(&config) {
                Ok(c) => c,
                Err(errors) => return report(&config, &errors),
            };
            let options = RenderOptions {
                wasm_path: wasm,
                listen_address: address.trim_matches(['[', ']']).to_string(),
                listen_port: port,
                admin_port: admin,
            };
            match render(&loaded, &options) {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: cannot write YAML: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn report(path: &std::path::Path, errors: &sgl_envoy_router::config::ConfigErrors) -> ExitCode {
    eprintln!("{}: invalid router configuration", path.display());
    for e in &errors.0 {
        eprintln!("error: {e}");
    }
    ExitCode::FAILURE
}
