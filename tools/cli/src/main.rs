use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sgl_envoy_router::config;
use sgl_envoy_router_cli::dynamic;
use sgl_envoy_router_cli::render::{render, render_snippet, RenderOptions, DEFAULT_WASM};
use sgl_envoy_router_cli::translate::translate;
use sgl_envoy_router_cli::{mesh, package};
use std::time::Duration;

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
        #[arg(long, conflicts_with = "dynamic")]
        snippet: bool,
        /// Write DIR/envoy.yaml and the files it watches (listener, filter configuration,
        /// clusters), so `update --dynamic DIR` changes the engines without a restart.
        #[arg(long, value_name = "DIR")]
        dynamic: Option<PathBuf>,
        /// Print the Istio resources (an EnvoyFilter) that install the filter from --image in
        /// every sidecar calling --engines.
        #[arg(long, conflicts_with_all = ["snippet", "dynamic", "envoy_gateway"], requires_all = ["image", "engines"])]
        istio: bool,
        /// Print the Envoy Gateway resources (HTTPRoute, EnvoyExtensionPolicy,
        /// BackendTrafficPolicy, EnvoyPatchPolicy) that route --gateway's traffic to --engines.
        #[arg(long, conflicts_with_all = ["snippet", "dynamic"], requires_all = ["image", "engines"])]
        envoy_gateway: bool,
        /// The module's OCI image (`package --oci` wrote it from --wasm, whose digest is checked).
        #[arg(long, value_name = "REGISTRY/REPOSITORY:TAG")]
        image: Option<String>,
        /// The engines' Kubernetes Service.
        #[arg(long, value_name = "HOST:PORT")]
        engines: Option<String>,
        /// The Kubernetes namespace of the resources.
        #[arg(long, default_value = "default")]
        k8s_namespace: String,
        /// Istio: the workloads whose sidecars run the filter (default: all of the namespace).
        #[arg(long, value_name = "KEY=VALUE")]
        selector: Option<String>,
        /// Envoy Gateway: the Gateway the route attaches to, and its listener.
        #[arg(long, default_value = "eg")]
        gateway: String,
        #[arg(long, default_value = "http")]
        gateway_listener: String,
    },
    /// Validate a router configuration and put it live in an Envoy started from
    /// `render --dynamic DIR`, without a restart: nothing changes when it is invalid.
    Update {
        config: PathBuf,
        /// The directory `render --dynamic` wrote.
        #[arg(long, value_name = "DIR")]
        dynamic: PathBuf,
        /// How long removed workers' clusters stay, for requests routed just before the update.
        #[arg(long, default_value_t = 2000)]
        settle_ms: u64,
        /// No Envoy runs on DIR: write the files without confirming with Envoy's admin that it
        /// took up new engines (without it, `update` fails when it cannot tell).
        #[arg(long)]
        offline: bool,
    },
    /// Write the wasm module as a Wasm OCI image (the variant Istio and Envoy Gateway pull), and
    /// print its digest and the module's sha256.
    #[command(group = clap::ArgGroup::new("out").required(true))]
    Package {
        /// The wasm module.
        #[arg(long, default_value = DEFAULT_WASM)]
        wasm: PathBuf,
        /// Write an OCI image layout directory (`skopeo copy oci:DIR:TAG docker://…`).
        #[arg(long, value_name = "DIR", group = "out")]
        oci: Option<PathBuf>,
        /// Write the layout as one tar (`skopeo copy oci-archive:FILE:TAG docker://…`).
        #[arg(long, value_name = "FILE", group = "out")]
        oci_archive: Option<PathBuf>,
        /// The tag the layout names the image by.
        #[arg(long, default_value = "latest")]
        tag: String,
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
        Command::Package { wasm, oci, oci_archive, tag } => {
            let out = match (&oci, &oci_archive) {
                (Some(dir), _) => package::Output::Dir(dir),
                (None, Some(file)) => package::Output::Archive(file),
                (None, None) => return ExitCode::FAILURE, // clap requires one
            };
            match package::package(&wasm, &tag, out) {
                Ok(p) => {
                    let written =
                        oci.as_ref().or(oci_archive.as_ref()).map(|p| p.display().to_string()).unwrap_or_default();
                    println!("wrote {written} (tag {tag})");
                    println!(
                        "image digest {} (Istio's WasmPlugin sha256 and Envoy Gateway's image.sha256 take its hex)",
                        p.image_digest
                    );
                    println!("module sha256 {} (http and file sources)", p.module_sha256);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Translate { model, skip_refused, args } => run_translate(&model, &args, skip_refused),
        Command::Update { config, dynamic, settle_ms, offline } => {
            let loaded = match config::load_file(&config) {
                Ok(c) => c,
                Err(errors) => return report(&config, &errors),
            };
            let confirm = if offline { dynamic::Confirm::Offline } else { dynamic::Confirm::WithEnvoy };
            match dynamic::update(&loaded, &dynamic, Duration::from_millis(settle_ms), confirm) {
                Ok(done) => {
                    println!(
                        "updated {}: {} workers; clusters added [{}], removed [{}]; filter configuration {}; listener {}",
                        dynamic.display(),
                        loaded.workers.len(),
                        done.clusters_added.join(", "),
                        done.clusters_removed.join(", "),
                        if done.filter { "replaced" } else { "unchanged" },
                        if done.listener { "replaced" } else { "unchanged" },
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Render {
            config,
            wasm,
            listen,
            admin,
            snippet,
            dynamic,
            istio,
            envoy_gateway,
            image,
            engines,
            k8s_namespace,
            selector,
            gateway,
            gateway_listener,
        } => {
            if istio || envoy_gateway {
                let loaded = match config::load_file(&config) {
                    Ok(c) => c,
                    Err(errors) => return report(&config, &errors),
                };
                let image_sha256 = match package::image_digest(std::path::Path::new(&wasm)) {
                    Ok(d) => d.trim_start_matches("sha256:").to_string(),
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let options = mesh::MeshOptions {
                    image: image.unwrap_or_default(),
                    image_sha256,
                    engines: engines.unwrap_or_default(),
                    namespace: k8s_namespace,
                    selector,
                    gateway,
                    gateway_listener,
                };
                let rendered = if istio {
                    mesh::render_istio(&loaded, &options)
                } else {
                    mesh::render_envoy_gateway(&loaded, &options)
                };
                return match rendered {
                    Ok(yaml) => {
                        print!("{yaml}");
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("error: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
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
            if let Some(dir) = dynamic {
                return match dynamic::render_dynamic(&loaded, &options, &dir) {
                    Ok(bootstrap) => {
                        println!("{}", bootstrap.display());
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        eprintln!("error: {e}");
                        ExitCode::FAILURE
                    }
                };
            }
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
