//! The proxy-wasm glue, and the only code that names proxy-wasm. It carries out what the core
//! decides: the filter applies decisions to requests, the service runs the core's monitors on its
//! ticks and publishes their tables.

#[cfg(feature = "fault-injection")]
mod faults;
mod filter;
mod host;
mod root;
mod service;
mod stats;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new(context_id))
    });
}}
