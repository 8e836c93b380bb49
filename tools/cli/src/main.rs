use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sgl_envoy_router::config;
use sgl_envoy_router_cli::render::{render, render_snippet, RenderOptions, DEFAULT_WASM};
use sgl_envoy_router_cli::translate::translate;

#[derive(Parser)]
#[command(name = "sgl-envoy-router", version, about = "SGLang engine selection inside Envoy: configuration tools")]
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
        /// Only what an existing Envoy needs (filter entry, routes, clusters, bootstrap service,
        /// stats labels), each with a comment naming where it goes.
        #[arg(long)]
        snippet: bool,
    },
    /// Turn an sglang-router 0.3.2 command line into a router configuration (YAML on stdout).
    Translate {
        /// The served model name the workers get.
        #[arg(long)]
        model: String,
        /// Write what carries over even when some options are refused (listed as comments).
        #[arg(long)]
        skip_refused: bool,
        /// sglang-router's launch arguments, after `--`.
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Validate { config } => match config::load_file(&config) {
            Ok(c) => {
                let buckets: usize = c.models.values().map(|m| m.buckets.len()).sum();
                println!("ok: {} workers, {} models, {} buckets", c.workers.len(), c.models.len(), buckets);
                ExitCode::SUCCESS
            }
            Err(errors) => report(&config, &errors),
        },
        Command::Translate { model, skip_refused, args } => run_translate(&model, &args, skip_refused),
        Command::Render { config, wasm, listen, admin, snippet } => {
            let Some((address, port)) = listen.rsplit_once(':').and_then(|(a, p)| Some((a, p.parse().ok()?))) else {
                eprintln!("error: --listen must be ADDR:PORT, got `{listen}`");
                return ExitCode::FAILURE;
            };
            let loaded = match config::load_file(&config) {
                Ok(c) => c,
                Err(errors) => return report(&config, &errors),
            };
            let options = RenderOptions {
                wasm_path: wasm,
                listen_address: address.trim_matches(['[', ']']).to_string(),
                listen_port: port,
                admin_port: admin,
            };
            let rendered = if snippet { render_snippet(&loaded, &options) } else { render(&loaded, &options) };
            match rendered {
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

fn run_translate(model: &str, args: &[String], skip_refused: bool) -> ExitCode {
    let translation = match translate(model, args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    for note in &translation.notes {
        eprintln!("note: {note}");
    }
    for refusal in &translation.refused {
        eprintln!("refused: {refusal}");
    }
    if !translation.refused.is_empty() && !skip_refused {
        eprintln!(
            "error: {} option(s) refused; nothing written (--skip-refused writes the rest, with the refusals as comments)",
            translation.refused.len()
        );
        return ExitCode::FAILURE;
    }
    let yaml = match serde_yaml_ng::to_string(&translation.config) {
        Ok(y) => y,
        Err(e) => {
            eprintln!("error: cannot write YAML: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Print only what the filter would accept.
    if let Err(errors) = config::parse_document(&yaml) {
        for e in &errors.0 {
            eprintln!("error: {e}");
        }
        return ExitCode::FAILURE;
    }
    println!("# Translated from: sglang-router {}", args.join(" "));
    for refusal in &translation.refused {
        println!("# Not carried over: {refusal}");
    }
    print!("{yaml}");
    ExitCode::SUCCESS
}

fn report(path: &std::path::Path, errors: &sgl_envoy_router::config::ConfigErrors) -> ExitCode {
    eprintln!("{}: invalid router configuration", path.display());
    for e in &errors.0 {
        eprintln!("error: {e}");
    }
    ExitCode::FAILURE
}
