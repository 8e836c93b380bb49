//! The HTTP filter: each hook hands its event to the request's life in the core
//! ([`RequestLife`]) and carries out the actions it gets back with host calls. It holds one state
//! value per request and decides nothing. A parked stream is woken by its root's tick
//! ([`Waiters`]) when the core's room names it, under its own context id.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::{Rc, Weak};
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action as Flow, BufferType, MapType};

use super::host::{clear_route_cache, dispatch, ClockScope};
use super::stats::Stats;
use crate::filter::life::{Action, Actions, RequestLife};
use crate::filter::ticks::Ticks;
use crate::filter::AppContext;

/// A VM's parked streams by context id, for its root to wake, and its root's clock.
#[derive(Default)]
pub struct WaitingStreams {
    pub streams: RefCell<BTreeMap<u32, Weak<RefCell<Stream>>>>,
    pub ticks: RefCell<Ticks>,
}

pub type Waiters = Rc<WaitingStreams>;

/// Envoy's handle on a stream: the stream itself is shared with the root while it waits.
pub struct Filter {
    stream: Rc<RefCell<Stream>>,
}

pub struct Stream {
    app: Rc<RefCell<AppContext>>,
    stats: Rc<Stats>,
    life: RequestLife,
    /// Every hook's actions, in one buffer kept for the stream: a streamed response's chunks
    /// allocate nothing.
    actions: Actions,
    /// This stream's context id and its root's.
    context_id: u32,
    root_id: u32,
    waiters: Waiters,
    this: Weak<RefCell<Stream>>,
}

impl Filter {
    /// `contexts`: this stream's context id and its root's.
    pub fn new(
        app: Rc<RefCell<AppContext>>,
        stats: Rc<Stats>,
        vm: u64,
        contexts: (u32, u32),
        waiters: Waiters,
    ) -> Self {
        let vm_header = app.borrow().vm_header(vm);
        let (context_id, root_id) = contexts;
        let stream = Rc::new_cyclic(|this| {
            RefCell::new(Stream {
                app,
                stats,
                life: RequestLife::new(vm_header, context_id),
                actions: Vec::new(),
                context_id,
                root_id,
                waiters,
                this: this.clone(),
            })
        });
        Self { stream }
    }
}

impl Stream {
    /// Its turn in the queue, or its wait is over; called by the root under this stream's id.
    pub fn on_turn(&mut self) {
        let _clock = ClockScope::enter();
        let mut actions = self.take_actions();
        let mut read = |size| read_buffer(BufferType::HttpRequestBody, size);
        self.life.on_turn(&self.app.borrow(), &mut read, &mut actions);
        if self.carry_out(actions) {
            let _ = hostcalls::resume_http_request();
        }
    }

    /// Joins the VM's parked streams; the root looks for turns at once and then every tick.
    fn park(&self) {
        self.waiters.streams.borrow_mut().insert(self.context_id, self.this.clone());
        let period = self.waiters.ticks.borrow_mut().period(true, None);
        if let Some(ms) = period {
            if hostcalls::set_effective_context(self.root_id).is_ok() {
                let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
            }
            let _ = hostcalls::set_effective_context(self.context_id);
        }
    }

    /// Sends `request` as the root context's callout: Envoy cancels a stream's callouts when the
    /// stream goes, and this one must reach its engine after. Its answer goes to the root, which
    /// reads none.
    fn detach(&self, request: &crate::host::CalloutRequest) -> Result<u32, String> {
        if let Err(status) = hostcalls::set_effective_context(self.root_id) {
            log::warn!("{} to {} not sent: no root context ({status:?})", request.path, request.cluster);
            return Err(format!("no root context ({status:?})"));
        }
        let sent = dispatch(request).map_err(|e| e.to_string());
        if let Err(e) = &sent {
            log::warn!("{} to {} not sent: {e}", request.path, request.cluster);
        }
        let _ = hostcalls::set_effective_context(self.context_id);
        sent
    }

    /// The buffer for one hook's actions.
    fn take_actions(&mut self) -> Actions {
        let mut actions = std::mem::take(&mut self.actions);
        actions.clear();
        actions
    }

    /// Carries out `actions` in order and keeps the buffer; whether the stream may go on.
    fn carry_out(&mut self, mut actions: Actions) -> bool {
        let proceed = self.carry_out_each(&mut actions);
        actions.clear();
        self.actions = actions;
        proceed
    }

    fn carry_out_each(&mut self, actions: &mut Actions) -> bool {
        let mut proceed = false;
        let mut i = 0;
        while i < actions.len() {
            match std::mem::replace(&mut actions[i], Action::Proceed) {
                Action::Proceed => proceed = true,
                Action::RemoveRequestHeader(name) => {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, None);
                }
                Action::SetRequestHeader(name, value) => {
                    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, &name, Some(&value));
                }
                Action::ReplaceRequestBody { size, body } => {
                    let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, &body);
                }
                Action::ClearRouteCache => clear_route_cache(),
                Action::Dispatch(request) => {
                    let result = dispatch(&request).map_err(|e| e.to_string());
                    let mut more = Vec::new();
                    self.life.on_dispatched(&self.app.borrow(), result, &mut more);
                    actions.splice(i + 1..i + 1, more);
                }
                Action::Detach(request, stage) => {
                    let sent = self.detach(&request);
                    let mut more = Vec::new();
                    self.life.on_detached(stage, sent, &mut more);
                    actions.splice(i + 1..i + 1, more);
                }
                Action::Notify(request) => {
                    let result = dispatch(&request).map_err(|e| e.to_string());
                    self.life.on_notice_dispatched(&self.app.borrow(), &request.cluster, result);
                }
                Action::Reply { status, body, headers } => {
                    let headers = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    let _ = hostcalls::send_http_response(u32::from(status), headers, Some(&body));
                }
                Action::SetResponseHeader(name, value) => {
                    let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(&value));
                }
                Action::ResumeResponse => {
                    let _ = hostcalls::resume_http_response();
                }
                Action::Count(bumps) => self.stats.count_all(&bumps),
                Action::Observe(name, value) => self.stats.histogram(&name, value),
                Action::Park => self.park(),
            }
            i += 1;
        }
        proceed
    }

    fn flow(proceed: bool) -> Flow {
        if proceed {
            Flow::Continue
        } else {
            Flow::Pause
        }
    }
}

/// The first `size` bytes of a buffer (empty when the host has none).
fn read_buffer(buffer: BufferType, size: usize) -> Vec<u8> {
    hostcalls::get_buffer(buffer, 0, size).ok().flatten().unwrap_or_default()
}

impl Stream {
    fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        let _clock = ClockScope::enter();
        let status = header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse().ok());
        let mut actions = self.take_actions();
        let mut read = || read_buffer(BufferType::HttpCallResponseBody, body_size);
        self.life.on_callout_answer(&self.app.borrow(), token, status, &mut read, &mut actions);
        if self.carry_out(actions) {
            let _ = hostcalls::resume_http_request();
        }
    }

    fn on_request_headers(&mut self, end_of_stream: bool) -> Flow {
        // The whole map in one host call: each header read alone is a copy into the VM of its own.
        let headers = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        #[cfg(feature = "fault-injection")]
        if super::faults::arm_if_asked(&headers, self.app.borrow().handles().host.as_ref()) {
            return Flow::Pause;
        }
        let mut actions = self.take_actions();
        self.life.on_request_headers(&self.app.borrow(), headers, end_of_stream, &mut actions);
        Self::flow(self.carry_out(actions))
    }

    fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Flow {
        let _clock = ClockScope::enter();
        let mut actions = self.take_actions();
        let mut read = |size| read_buffer(BufferType::HttpRequestBody, size);
        self.life.on_request_body(&self.app.borrow(), body_size, end_of_stream, &mut read, &mut actions);
        Self::flow(self.carry_out(actions))
    }

    fn on_response_headers(&mut self, end_of_stream: bool) -> Flow {
        let _clock = ClockScope::enter();
        let status = header(MapType::HttpResponseHeaders, ":status").and_then(|s| s.parse().ok());
        let mut actions = self.take_actions();
        let mut upstream_host = || {
            hostcalls::get_property(vec!["upstream", "address"]).ok().flatten().and_then(|b| String::from_utf8(b).ok())
        };
        self.life.on_response_headers(&self.app.borrow(), status, end_of_stream, &mut upstream_host, &mut actions);
        Self::flow(self.carry_out(actions))
    }

    fn on_response_body(&mut self, end_of_stream: bool) -> Flow {
        let mut actions = self.take_actions();
        self.life.on_response_body(end_of_stream, &mut actions);
        Self::flow(self.carry_out(actions))
    }

    fn on_log(&mut self) {
        let _clock = ClockScope::enter();
        let mut actions = self.take_actions();
        self.life.on_end(&self.app.borrow(), &mut actions);
        self.carry_out(actions);
        self.waiters.streams.borrow_mut().remove(&self.context_id);
    }
}

fn header(map: MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value(map, name).ok().flatten()
}

impl Context for Filter {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        self.stream.borrow_mut().on_http_call_response(token, body_size);
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Flow {
        self.stream.borrow_mut().on_request_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Flow {
        self.stream.borrow_mut().on_request_body(body_size, end_of_stream)
    }

    fn on_http_response_headers(&mut self, _headers: usize, end_of_stream: bool) -> Flow {
        self.stream.borrow_mut().on_response_headers(end_of_stream)
    }

    fn on_http_response_body(&mut self, _body_size: usize, end_of_stream: bool) -> Flow {
        self.stream.borrow_mut().on_response_body(end_of_stream)
    }

    fn on_log(&mut self) {
        self.stream.borrow_mut().on_log();
    }
}
