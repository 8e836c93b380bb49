//! The HTTP filter: strip routing headers, buffer the chat body, hand it to the core, carry out the
//! decision, release accounting when the stream ends. No selection logic lives here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::host::clear_route_cache;
use crate::server::app_context::Target;
use crate::server::errors::{payload_too_large, MAX_BODY_BYTES};
use crate::server::routes::models::list_models;
use crate::server::{AppContext, Decision, ErrorKind, RouteError};
use crate::state::load_monitor::InflightGuard;

const CHAT_PATH: &str = "/v1/chat/completions";
const MODELS_PATH: &str = "/v1/models";

pub struct Filter {
    app: Rc<RefCell<AppContext>>,
    is_chat: bool,
    /// Session and routing-key headers, read while request headers may still be read.
    keys: HashMap<String, String>,
    decision: Option<Decision>,
    /// Held for the life of the stream; dropped in `on_log`, however the stream ended.
    inflight: Vec<InflightGuard>,
}

impl Filter {
    pub fn new(app: Rc<RefCell<AppContext>>) -> Self {
        Self {
            app,
            is_chat: false,
            keys: HashMap::new(),
            decision: None,
            inflight: Vec::new(),
        }
    }

    fn send_error(&self, error: &RouteError) {
        self.send_http_response(
            u32::from(error.status()),
            vec![("content-type", "application/json")],
            Some(&error.body()),
        );
    }

    fn apply(&mut self, decision: Decision) -> Action {
        let Target::Plain(worker) = &decision.target else {
            self.send_error(&RouteError::new(
                ErrorKind::InvalidConfiguration,
                "prefill/decode dispatch is not available in this build",
            ));
            return Action::Pause;
        };
        let (name, value) = &decision.upstream_header;
        self.set_http_request_header(name, Some(value));
        clear_route_cache();
        let inflight = Arc::clone(&self.app.borrow().handles().inflight);
        self.inflight
            .push(InflightGuard::acquire(inflight, &worker.id));
        self.decision = Some(decision);
        Action::Continue
    }
}

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let app = self.app.borrow();
        for header in app.routing_headers() {
            self.set_http_request_header(&header, None);
        }
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let path = path.split('?').next().unwrap_or_default();
        let method = self.get_http_request_header(":method").unwrap_or_default();
        match (method.as_str(), path) {
            ("GET", MODELS_PATH) => {
                let body = list_models(app.config());
                drop(app);
                self.send_http_response(
                    200,
                    vec![("content-type", "application/json")],
                    Some(&body),
                );
                Action::Pause
            }
            ("POST", CHAT_PATH) => {
                let key_headers: Vec<String> = app
                    .config()
                    .models
                    .values()
                    .flat_map(|m| [m.session_id_header.clone(), m.routing_key_header.clone()])
                    .collect();
                drop(app);
                for name in key_headers {
                    if let Some(value) = self.get_http_request_header(&name) {
                        self.keys.insert(name, value);
                    }
                }
                self.is_chat = true;
                // The pick is not known yet and a PD pick rewrites the body.
                self.set_http_request_header("content-length", None);
                if end_of_stream {
                    self.send_error(&RouteError::invalid("a chat request needs a JSON body"));
                }
                Action::Pause
            }
            _ => {
                drop(app);
                // A route chosen before the headers were stripped must not survive them.
                clear_route_cache();
                Action::Continue
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.is_chat || self.decision.is_some() {
            return Action::Continue;
        }
        if body_size > MAX_BODY_BYTES {
            self.send_error(&payload_too_large(body_size));
            return Action::Pause;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        let keys = &self.keys;
        let started = self
            .app
            .borrow_mut()
            .begin_chat(&body, &|name| keys.get(name).cloned());
        let mut pending = match started {
            Ok(p) => p,
            Err(error) => {
                self.send_error(&error);
                return Action::Pause;
            }
        };
        match pending.poll() {
            Poll::Ready(Ok(decision)) => self.apply(decision),
            Poll::Ready(Err(error)) => {
                self.send_error(&error);
                Action::Pause
            }
            Poll::Pending => {
                self.send_error(&RouteError::new(
                    ErrorKind::InvalidConfiguration,
                    "a policy needed asynchronous work, which this build cannot wait for",
                ));
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Some(decision) = &self.decision {
            self.set_http_response_header("x-sgl-bucket", Some(&decision.bucket_id));
            self.set_http_response_header("x-sgl-worker", Some(&decision.target.upstream().id));
            if let Target::Pd { prefill, .. } = &decision.target {
                self.set_http_response_header("x-sgl-prefill-worker", Some(&prefill.id));
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.inflight.clear();
    }
}
