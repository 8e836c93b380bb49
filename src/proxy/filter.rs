//! The HTTP filter: strip routing headers, ask the route table, buffer the chat body, hand it to
//! the core, carry out the decision (upstream header; for PD, the rewritten body, the prefill
//! callout, and whatever the PD exchange answers), report dispatch results, release accounting
//! when the stream ends. Every branch here maps a core answer to an Action.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use super::host::{clear_route_cache, dispatch, ClockScope};
use super::stats::Stats;
use crate::host::CalloutResponse;
use crate::server::metrics;
use crate::server::routes::chat::pd::{forwarded_headers, Flow, PrefillDone};
use crate::server::routes::chat::{body_step, BodyStep, ChatExchange, Effects, Endpoint, PendingChat};
use crate::server::routes::models::{list_models, retrieve_model};
use crate::server::routes::{method_not_allowed, route, Route};
use crate::server::{AppContext, Decision, ErrorKind, RouteError};
use crate::state::load_monitor::InflightGuard;

struct PrefillCall {
    token: u32,
    /// Released when the callout returns.
    inflight: Option<InflightGuard>,
}

pub struct Filter {
    app: Rc<RefCell<AppContext>>,
    stats: Rc<Stats>,
    /// Set when the configuration asks responses to say which VM decided.
    vm_header: Option<String>,
    /// The generation endpoint this request is for, if any.
    endpoint: Option<Endpoint>,
    body_size: usize,
    /// Session and routing-key headers, read while request headers may still be read.
    keys: HashMap<String, String>,
    /// The client's request headers as they arrived, for a PD prefill callout.
    request_headers: Vec<(String, Vec<u8>)>,
    pending: Option<(PendingChat, Instant)>,
    /// Callouts the pending selection waits on; empty means nothing can wake it.
    awaiting: Vec<u32>,
    exchange: Option<ChatExchange>,
    prefill: Option<PrefillCall>,
    /// The decode or plain engine's slot, held for the life of the stream; dropped in `on_log`.
    inflight: Option<InflightGuard>,
    /// The filter answered itself; its own reply is not an upstream result.
    local_reply: bool,
}

fn to_flow(flow: Flow) -> Action {
    match flow {
        Flow::Pass => Action::Continue,
        Flow::Hold => Action::Pause,
    }
}

impl Filter {
    pub fn new(app: Rc<RefCell<AppContext>>, stats: Rc<Stats>, vm: u64) -> Self {
        let vm_header = app.borrow().config().debug.vm_header.then(|| format!("{vm:016x}"));
        Self {
            app,
            stats,
            vm_header,
            endpoint: None,
            body_size: 0,
            keys: HashMap::new(),
            request_headers: Vec::new(),
            pending: None,
            awaiting: Vec::new(),
            exchange: None,
            prefill: None,
            inflight: None,
            local_reply: false,
        }
    }

    fn reply(&mut self, status: u16, body: &[u8]) {
        self.reply_with(status, body, vec![]);
    }

    fn reply_with(&mut self, status: u16, body: &[u8], mut headers: Vec<(&str, &str)>) {
        self.local_reply = true;
        headers.push(("content-type", "application/json"));
        self.send_http_response(u32::from(status), headers, Some(body));
    }

    /// Exchanges in-flight counts and prefix events with the other VMs if due, and bumps the
    /// counters due.
    fn sync_shared(&self) {
        let due = self.app.borrow().sync_shared();
        self.stats.count_all(&due);
    }

    fn carry_out(&self, effects: Effects) {
        self.app.borrow().carry_out(effects);
    }

    /// An error the selection did not already count.
    fn fail(&mut self, error: &RouteError) -> Action {
        self.app.borrow().count([metrics::error_outcome(error.kind)]);
        self.reply(error.status(), &error.body());
        Action::Pause
    }

    fn poll_selection(&mut self) -> Action {
        let callouts = Arc::clone(&self.app.borrow().handles().callouts);
        let Some((pending, started)) = self.pending.as_mut() else {
            return Action::Continue;
        };
        let before = callouts.board().tokens();
        let awaiting = &mut self.awaiting;
        let polled = pending.poll(|| {
            awaiting.extend(callouts.board().tokens().into_iter().filter(|t| !before.contains(t)));
            awaiting.retain(|t| callouts.board().is_outstanding(*t));
            !awaiting.is_empty()
        });
        let outcome = match polled {
            Poll::Ready(outcome) => outcome,
            // Polled again when one of its callouts answers (each has a timeout).
            Poll::Pending => return Action::Pause,
        };
        let elapsed = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.pending = None;
        self.stats.histogram(metrics::SELECTION_US, elapsed);
        self.app.borrow().count(outcome.counters);
        match outcome.result {
            Ok(decision) => self.apply(decision),
            Err(error) => {
                self.reply(error.status(), &error.body());
                Action::Pause
            }
        }
    }

    fn apply(&mut self, mut decision: Decision) -> Action {
        let (name, value) = &decision.upstream_header;
        self.set_http_request_header(name, Some(value));
        clear_route_cache();
        let prefill = decision.pd.as_mut().map(|pd| {
            let routing = Arc::clone(self.app.borrow().headers());
            // A header value that is not UTF-8 cannot be put on a callout; it is left out.
            let client = self
                .request_headers
                .iter()
                .filter_map(|(name, value)| Some((name.clone(), String::from_utf8(value.clone()).ok()?)))
                .collect();
            let request = pd.take_prefill_request(forwarded_headers(client, routing.stripped()));
            let body = request.body.as_deref().unwrap_or_default();
            self.set_http_request_body(0, self.body_size, body);
            // The headers are still held, so the rewritten body keeps a length: dropping it would
            // send every request chunked.
            self.set_http_request_header("content-length", Some(&body.len().to_string()));
            (Arc::clone(&pd.prefill), request)
        });
        let mut exchange = ChatExchange::new(decision);
        if let Some((worker, request)) = prefill {
            match dispatch(&request) {
                Ok(token) => {
                    let inflight = self.app.borrow().on_dispatch(&worker.id, exchange.decision().prefill_tokens);
                    exchange.dispatched(&worker.id);
                    self.prefill = Some(PrefillCall { token, inflight: Some(inflight) });
                }
                Err(e) => {
                    return self.fail(&RouteError::new(
                        ErrorKind::PrefillFailed,
                        format!("the prefill request to {} could not be sent: {e}", worker.id),
                    ));
                }
            }
        }
        let upstream = Arc::clone(exchange.decision().target.upstream());
        // The upstream does the prefill work unless a prefill engine did it.
        let prefill_tokens = if exchange.decision().pd.is_some() { 0 } else { exchange.decision().prefill_tokens };
        self.inflight = Some(self.app.borrow().on_dispatch(&upstream.id, prefill_tokens));
        exchange.dispatched(&upstream.id);
        for notice in &exchange.decision().notices {
            // Fire and forget: its answer, if any, is ignored.
            if let Err(e) = dispatch(notice) {
                log::debug!("routed notice not sent: {e}");
            }
        }
        self.exchange = Some(exchange);
        self.sync_shared();
        Action::Continue
    }

    fn on_prefill_done(&mut self, status: Option<u16>) {
        if let Some(prefill) = self.prefill.as_mut() {
            prefill.inflight = None;
        }
        self.sync_shared();
        let Some(exchange) = self.exchange.as_mut() else {
            return;
        };
        let (done, effects) = exchange.on_prefill_done(status);
        self.carry_out(effects);
        match done {
            PrefillDone::Resume => self.resume_http_response(),
            // Its outcome was counted by the exchange.
            PrefillDone::Fail(error) => self.reply(error.status(), &error.body()),
            PrefillDone::Nothing => {}
        }
    }
}

impl Context for Filter {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let _clock = ClockScope::enter();
        let status = self.get_http_call_response_header(":status").and_then(|s| s.parse().ok());
        if self.prefill.as_ref().is_some_and(|p| p.token == token) {
            self.on_prefill_done(status);
            return;
        }
        if !self.awaiting.contains(&token) {
            return;
        }
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
        let headers = Arc::clone(self.app.borrow().headers());
        // The whole map in one host call: each header read alone is a copy into the VM of its own,
        // and removing a header the client did not send is a host call for nothing.
        self.request_headers = self.get_http_request_headers_bytes();
        let (mut path, mut method) = (String::new(), String::new());
        for (name, value) in &self.request_headers {
            if headers.stripped().iter().any(|h| h.eq_ignore_ascii_case(name)) {
                self.set_http_request_header(name, None);
            }
            match name.as_str() {
                ":path" => path = String::from_utf8_lossy(value).into_owned(),
                ":method" => method = String::from_utf8_lossy(value).into_owned(),
                _ => {}
            }
        }
        match route(&method, &path) {
            Route::ListModels => {
                let body = list_models(self.app.borrow().config());
                self.reply(200, &body);
                Action::Pause
            }
            Route::RetrieveModel => {
                let answer = retrieve_model(self.app.borrow().config(), &path);
                match answer {
                    Ok(body) => self.reply(200, &body),
                    Err(error) => self.reply(error.status(), &error.body()),
                }
                Action::Pause
            }
            Route::Generation(endpoint) => {
                for (name, value) in &self.request_headers {
                    if let Some(key) = headers.keys().iter().find(|k| k.eq_ignore_ascii_case(name)) {
                        // The first of repeated values, as a single-header read gives.
                        self.keys.entry(key.clone()).or_insert_with(|| String::from_utf8_lossy(value).into_owned());
                    }
                }
                self.endpoint = Some(endpoint);
                if end_of_stream {
                    return self.fail(&RouteError::invalid(format!("POST {} needs a JSON body", endpoint.path())));
                }
                Action::Pause
            }
            Route::MethodNotAllowed { allow } => {
                let error = method_not_allowed(&method, &path, allow);
                self.app.borrow().count([metrics::error_outcome(error.kind)]);
                self.reply_with(error.status(), &error.body(), vec![("allow", allow)]);
                Action::Pause
            }
            Route::PassThrough => {
                // A route chosen before the headers were stripped must not survive them.
                clear_route_cache();
                Action::Continue
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let _clock = ClockScope::enter();
        let Some(endpoint) = self.endpoint else { return Action::Continue };
        if self.exchange.is_some() {
            return Action::Continue;
        }
        if self.local_reply || self.pending.is_some() {
            return Action::Pause;
        }
        match body_step(body_size, end_of_stream) {
            BodyStep::Wait => return Action::Pause,
            BodyStep::TooLarge(error) => return self.fail(&error),
            BodyStep::Ready => {}
        }
        self.body_size = body_size;
        // The other VMs' counts as of at most one sync period ago.
        self.sync_shared();
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        let started = Instant::now();
        let keys = &self.keys;
        let begun = self.app.borrow().begin(endpoint, &body, &|name| keys.get(name).cloned());
        match begun {
            Ok(pending) => {
                self.pending = Some((pending, started));
                self.poll_selection()
            }
            Err(error) => self.fail(&error),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let _clock = ClockScope::enter();
        if self.local_reply {
            return Action::Continue;
        }
        let Some(exchange) = self.exchange.as_ref() else {
            return Action::Continue;
        };
        for (name, value) in exchange.decision().response_headers(self.vm_header.as_deref()) {
            self.set_http_response_header(name, Some(&value));
        }
        let status = self.get_http_response_header(":status").and_then(|s| s.parse().ok());
        let Some(exchange) = self.exchange.as_mut() else {
            return Action::Continue;
        };
        let (flow, effects) = exchange.on_upstream_headers(status);
        self.carry_out(effects);
        to_flow(flow)
    }

    fn on_http_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        match &self.exchange {
            Some(exchange) => to_flow(exchange.on_upstream_body()),
            None => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        let _clock = ClockScope::enter();
        // However the stream ended: completed, failed, or the client went away.
        if let Some(mut exchange) = self.exchange.take() {
            let effects = exchange.on_end();
            self.carry_out(effects);
        }
        self.inflight = None;
        self.prefill = None;
        self.pending = None;
        self.sync_shared();
    }
}
