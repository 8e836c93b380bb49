//! The HTTP filter: strip routing headers, buffer the chat body, hand it to the core, apply the
//! decision. No selection logic lives here.

use std::cell::RefCell;
use std::rc::Rc;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::host::clear_route_cache;
use crate::server::errors::{payload_too_large, MAX_BODY_BYTES};
use crate::server::routes::models::list_models;
use crate::server::{AppContext, Decision, RouteError};

const CHAT_PATH: &str = "/v1/chat/completions";
const MODELS_PATH: &str = "/v1/models";

pub struct Filter {
    app: Rc<RefCell<AppContext>>,
    is_chat: bool,
    decision: Option<Decision>,
}

impl Filter {
    pub fn new(app: Rc<RefCell<AppContext>>) -> Self {
        Self {
            app,
            is_chat: false,
            decision: None,
        }
    }

    fn send_error(&self, error: &RouteError) {
        self.send_http_response(
            u32::from(error.status()),
            vec![("content-type", "application/json")],
            Some(&error.body()),
        );
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
                drop(app);
                self.is_chat = true;
                // The pick is not known yet and a PD pick rewrites the body.
                self.set_http_request_header("content-length", None);
                if end_of_stream {
                    self.send_error(&RouteError::invalid("a chat request needs a JSON body"));
                }
                Action::Pause
            }
            _ => Action::Continue,
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
        let routed = self.app.borrow_mut().route_chat(&body);
        match routed {
            Ok(decision) => {
                let (name, value) = &decision.upstream_header;
                self.set_http_request_header(name, Some(value));
                clear_route_cache();
                self.decision = Some(decision);
                Action::Continue
            }
            Err(error) => {
                self.send_error(&error);
                Action::Pause
            }
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if let Some(decision) = &self.decision {
            self.set_http_response_header("x-sgl-worker", Some(&decision.worker.id));
        }
        Action::Continue
    }
}
