//! The HTTP filter: strip routing headers, buffer the chat body, hand it to the core, carry out the
//! decision (upstream header; for PD, the rewritten body, the prefill callout and holding the
//! decode response until it succeeds), report dispatch results, release accounting when the
//! stream ends. No selection logic lives here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::host::{clear_route_cache, ProxyHost};
use super::stats::Stats;
use crate::host::CalloutResponse;
use crate::host::Host;
use crate::registry::Worker;
use crate::server::app_context::{PendingChat, Target};
use crate::server::errors::{payload_too_large, MAX_BODY_BYTES};
use crate::server::metrics;
use crate::server::routes::models::list_models;
use crate::server::{AppContext, Decision, ErrorKind, RouteError};
use crate::state::keys;
use crate::state::load_monitor::InflightGuard;

const CHAT_PATH: &str = "/v1/chat/completions";
const MODELS_PATH: &str = "/v1/models";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefillState {
    Pending,
    Succeeded,
    Failed,
    /// The decode engine already failed and its answer went to the client.
    Ignored,
}

struct PrefillCall {
    token: u32,
    worker: Arc<Worker>,
    state: PrefillState,
    /// Released when the callout returns.
    inflight: Option<InflightGuard>,
}

pub struct Filter {
    app: Rc<RefCell<AppContext>>,
    stats: Rc<Stats>,
    /// Set when the configuration asks responses to say which VM decided.
    vm_header: Option<String>,
    is_chat: bool,
    body_size: usize,
    /// Session and routing-key headers, read while request headers may still be read.
    keys: HashMap<String, String>,
    pending: Option<(PendingChat, Instant)>,
    /// Callouts the pending selection waits on; empty means nothing can wake it.
    awaiting: Vec<u32>,
    decision: Option<Decision>,
    prefill: Option<PrefillCall>,
    /// The decode or plain engine's slot, held for the life of the stream; dropped in `on_log`.
    inflight: Option<InflightGuard>,
    /// The filter answered itself; its own reply is not an upstream result.
    local_reply: bool,
    response_held: bool,
}

impl Filter {
    pub fn new(app: Rc<RefCell<AppContext>>, stats: Rc<Stats>, vm: u64) -> Self {
        let vm_header = app.borrow().config().debug.vm_header.then(|| format!("{vm:016x}"));
        Self {
            app,
            stats,
            vm_header,
            is_chat: false,
            body_size: 0,
            keys: HashMap::new(),
            pending: None,
            awaiting: Vec::new(),
            decision: None,
            prefill: None,
            inflight: None,
            local_reply: false,
            response_held: false,
        }
    }

    fn reply(&mut self, error: &RouteError) {
        self.local_reply = true;
        self.send_http_response(
            u32::from(error.status()),
            vec![("content-type", "application/json")],
            Some(&error.body()),
        );
    }

    /// An error the selection did not already count.
    fn fail(&mut self, error: &RouteError) -> Action {
        self.stats.count(&metrics::error_outcome(error.kind));
        self.reply(error);
        Action::Pause
    }

    fn poll_selection(&mut self) -> Action {
        let callouts = Arc::clone(&self.app.borrow().handles().callouts);
        let Some((pending, started)) = self.pending.as_mut() else {
            return Action::Continue;
        };
        let before = callouts.board().tokens();
        let polled = pending.poll();
        self.awaiting.extend(callouts.board().tokens().into_iter().filter(|t| !before.contains(t)));
        self.awaiting.retain(|t| callouts.board().is_outstanding(*t));
        let outcome = match polled {
            Poll::Ready(outcome) => outcome,
            // Polled again when one of its callouts answers (each has a timeout).
            Poll::Pending if !self.awaiting.is_empty() => return Action::Pause,
            Poll::Pending => {
                self.pending = None;
                return self.fail(&RouteError::new(
                    ErrorKind::InvalidConfiguration,
                    "the selection is waiting, but on no callout",
                ));
            }
        };
        let elapsed = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.pending = None;
        self.stats.histogram(metrics::SELECTION_US, elapsed);
        self.stats.count_all(&outcome.counters);
        match outcome.result {
            Ok(decision) => self.apply(decision),
            Err(error) => {
                self.reply(&error);
                Action::Pause
            }
        }
    }

    fn apply(&mut self, decision: Decision) -> Action {
        let (name, value) = &decision.upstream_header;
        self.set_http_request_header(name, Some(value));
        clear_route_cache();
        let inflight = Arc::clone(&self.app.borrow().handles().inflight);
        if let Some(pd) = &decision.pd {
            self.set_http_request_body(0, self.body_size, &pd.body);
            let authority = pd.prefill.address.host_port();
            let headers = vec![
                (":method", "POST"),
                (":path", CHAT_PATH),
                (":authority", authority.as_str()),
                ("content-type", "application/json"),
            ];
            let timeout = Duration::from_millis(pd.prefill_timeout_ms);
            match self.dispatch_http_call(&pd.prefill.cluster, headers, Some(&pd.body), vec![], timeout) {
                Ok(token) => {
                    self.app.borrow().on_dispatch(&pd.prefill.id);
                    self.prefill = Some(PrefillCall {
                        token,
                        worker: Arc::clone(&pd.prefill),
                        state: PrefillState::Pending,
                        inflight: Some(InflightGuard::acquire(Arc::clone(&inflight), &pd.prefill.id)),
                    });
                }
                Err(status) => {
                    return self.fail(&RouteError::new(
                        ErrorKind::PrefillFailed,
                        format!("the prefill request to {} could not be sent: {status:?}", pd.prefill.id),
                    ));
                }
            }
        }
        let upstream = decision.target.upstream();
        self.app.borrow().on_dispatch(&upstream.id);
        self.inflight = Some(InflightGuard::acquire(inflight, &upstream.id));
        if let Some(event) = &decision.prefix_event {
            let sent = serde_json::to_vec(event)
                .map_err(|e| e.to_string())
                .and_then(|bytes| ProxyHost.enqueue(keys::PREFIX_QUEUE, &bytes).map_err(|e| e.to_string()));
            if let Err(e) = sent {
                log::warn!("prefix event not sent to the service: {e}");
            }
        }
        self.decision = Some(decision);
        Action::Continue
    }

    fn on_prefill_done(&mut self, ok: bool, status: &str) {
        let Some(prefill) = self.prefill.as_mut() else {
            return;
        };
        prefill.inflight = None;
        let ignored = prefill.state == PrefillState::Ignored;
        prefill.state = if ok { PrefillState::Succeeded } else { PrefillState::Failed };
        let worker = Arc::clone(&prefill.worker);
        self.app.borrow().on_dispatch_result(&worker.id, ok);
        if ignored {
            return;
        }
        if ok {
            if std::mem::take(&mut self.response_held) {
                self.resume_http_response();
            }
            return;
        }
        let why = if status.is_empty() {
            "no answer (timeout or connection failure)".to_string()
        } else {
            format!("status {status}")
        };
        self.fail(&RouteError::new(ErrorKind::PrefillFailed, format!("prefill engine {} failed: {why}", worker.id)));
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if self.prefill.as_ref().is_some_and(|p| p.token == token) {
            let status = self.get_http_call_response_header(":status").unwrap_or_default();
            self.on_prefill_done(status.starts_with('2'), &status);
            return;
        }
        if !self.awaiting.contains(&token) {
            return;
        }
        let status = self.get_http_call_response_header(":status").and_then(|s| s.parse().ok());
        let body = self.get_http_call_response_body(0, body_size).unwrap_or_default();
        let callouts = Arc::clone(&self.app.borrow().handles().callouts);
        callouts.board().complete(token, CalloutResponse { status, body });
        if self.poll_selection() == Action::Continue {
            self.resume_http_request();
        }
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let app = self.app.borrow();
        for header in app.routing_headers() {
            self.set_http_request_header(header, None);
        }
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let path = path.split('?').next().unwrap_or_default();
        let method = self.get_http_request_header(":method").unwrap_or_default();
        match (method.as_str(), path) {
            ("GET", MODELS_PATH) => {
                let body = list_models(app.config());
                drop(app);
                self.local_reply = true;
                self.send_http_response(200, vec![("content-type", "application/json")], Some(&body));
                Action::Pause
            }
            ("POST", CHAT_PATH) => {
                let found: Vec<(String, String)> = app
                    .key_headers()
                    .iter()
                    .filter_map(|name| Some((name.clone(), self.get_http_request_header(name)?)))
                    .collect();
                drop(app);
                self.keys.extend(found);
                self.is_chat = true;
                // The pick is not known yet and a PD pick rewrites the body.
                self.set_http_request_header("content-length", None);
                if end_of_stream {
                    return self.fail(&RouteError::invalid("a chat request needs a JSON body"));
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
        if self.local_reply || self.pending.is_some() {
            return Action::Pause;
        }
        if body_size > MAX_BODY_BYTES {
            return self.fail(&payload_too_large(body_size));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.body_size = body_size;
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        let started = Instant::now();
        let keys = &self.keys;
        let begun = self.app.borrow_mut().begin_chat(&body, &|name| keys.get(name).cloned());
        match begun {
            Ok(pending) => {
                self.pending = Some((pending, started));
                self.poll_selection()
            }
            Err(error) => self.fail(&error),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        if self.local_reply {
            return Action::Continue;
        }
        let Some(decision) = &self.decision else {
            return Action::Continue;
        };
        let upstream = Arc::clone(decision.target.upstream());
        if let Some(vm) = self.vm_header.clone() {
            self.set_http_response_header("x-sgl-vm", Some(&vm));
        }
        self.set_http_response_header("x-sgl-bucket", Some(&decision.bucket_id));
        self.set_http_response_header("x-sgl-worker", Some(&upstream.id));
        if let Target::Pd { prefill, .. } = &decision.target {
            let id = prefill.id.clone();
            self.set_http_response_header("x-sgl-prefill-worker", Some(&id));
        }
        let status: u16 = self.get_http_response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        self.app.borrow().on_dispatch_result(&upstream.id, status != 0 && status < 500);
        match self.prefill.as_ref().map(|p| p.state) {
            // A failing decode answer goes to the client at once; the prefill no longer matters.
            Some(PrefillState::Pending) if !(200..300).contains(&status) => {
                if let Some(p) = self.prefill.as_mut() {
                    p.state = PrefillState::Ignored;
                }
                Action::Continue
            }
            Some(PrefillState::Pending) => {
                self.response_held = true;
                Action::Pause
            }
            _ => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        if self.response_held {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_log(&mut self) {
        // However the stream ended: completed, failed, or the client went away.
        self.inflight = None;
        self.prefill = None;
        self.pending = None;
    }
}
