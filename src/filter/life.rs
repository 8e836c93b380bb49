//! A request's life in the filter, as one synchronous state machine. Each proxy hook (request
//! headers, request body, a callout dispatched, a callout answered, response headers and body, the
//! stream's end) is one call here; each returns, through `out`, the short list of [`Action`]s the
//! glue carries out with host calls and nothing else. Nothing waits: waiting for the indexer or for
//! a PD prefill is a state, and its answer is the next event.
//!
//! ```text
//!  New ──headers──▶ Passing                     (not ours, or answered by the filter: models, 405)
//!   │
//!   └─generation──▶ Buffering ──body──▶ Awaiting indexer ──answer──▶┐
//!                       │                    (dispatched; timed out │
//!                       │                     or failed: unavailable)│
//!                       └──────────(no indexer call)────────────────▶ decide ──failed──▶ Answered
//!                                                                    │ ▲
//!       refused, queue configured: Parked (Queue seat) ◀──────────────┤ └── a turn: room may have freed
//!               (full, hopeless, wait over: 429) ◀─┘                  │     (selected again), or its
//!       held: Parked (Hold seat) ◀───────────────────────────────────┤     engine started on the
//!               (its engine has not started on its prefix; ≤ 1 s)     │     prefix, or its hold is over
//!                                                                    │
//!                                          plain ◀──── routed ───────┤
//!                                            │          PD: Dispatching prefill ──failed──▶ Answered
//!                                            ▼                 │
//!                                          Routed ◀────────────┘  (prefill answered, upstream
//!                                            │                     answered, held or passed)
//!                                            ▼
//!                                          Ended  (from every state: the stream ended, however)
//! ```
//!
//! A parked request's seat (its queue place, or one of the VM's hold slots) is a value it owns:
//! dropping the state gives the seat back, whatever path ends the wait.
//!
//! A new capability (retry on another engine, abort notices, the waiting queue) is a new state and
//! the actions it answers with.

use std::borrow::Cow;
use std::mem;
use std::sync::Arc;

use super::generation::abort::abort_request;
use super::generation::pd::{forwarded_headers, Flow, PrefillDone};
use super::generation::{
    body_step, BodyStep, Decision, Endpoint, Exchange, Outcome, PrefixWait, Target, Ticket, Verdict,
};
use super::indexer::IndexerCall;
use super::metrics::error_outcome;
use super::models::{list_models, retrieve_model};
use super::queue::{
    displaced, timed_out, Capacity, Entrant, HoldSlot, QueueExit, QueuePlace, RETRY_AFTER_S, UNKNOWN_BUDGET_TOKENS,
};
use super::routes::{method_not_allowed, route, Route};
use super::{AppContext, ErrorKind, RouteError};
use crate::config::QueueConfig;
use crate::host::CalloutRequest;
use crate::policies::pressure::PREFILL_QUANTUM_TOKENS;
use crate::protocol::indexer::IndexerAnswer;
use crate::registry::{EngineSet, Role};
use crate::state::load_monitor::InflightGuard;
use crate::wiring::counters::{
    queue_wait_ms, Bumps, Counter, IndexerEvent, INDEXER_WAIT_US, PREFIX_HOLD_MS, SELECTION_US,
};

/// What the glue does for the core, in order.
#[derive(Debug, PartialEq)]
pub enum Action {
    /// Let the request go on: the hook answers Continue, or a held request resumes.
    Proceed,
    RemoveRequestHeader(String),
    SetRequestHeader(String, String),
    /// Replace the first `size` buffered bytes of the request body with `body`; the bytes after
    /// them stay as buffered.
    ReplaceRequestBody {
        size: usize,
        body: Arc<Vec<u8>>,
    },
    /// The upstream headers changed: Envoy's route must be chosen again.
    ClearRouteCache,
    /// A callout whose answer this request waits for. The glue reports how dispatching went with
    /// [`RequestLife::on_dispatched`] before carrying out any later action.
    Dispatch(CalloutRequest),
    /// A callout whose answer nobody reads.
    Notify(CalloutRequest),
    /// An abort of the stage's engine, sent as the stream ends: the glue sends it on behalf of the
    /// VM, so Envoy does not cancel it with the stream, and reports how that went with
    /// [`RequestLife::on_detached`].
    Detach(CalloutRequest, Role),
    /// Answer the client from the filter.
    Reply {
        status: u16,
        body: Vec<u8>,
        headers: Vec<(&'static str, String)>,
    },
    SetResponseHeader(&'static str, String),
    /// Release a held upstream response.
    ResumeResponse,
    /// Counter bumps due for Envoy's stats.
    Count(Bumps),
    /// A histogram sample.
    Observe(Cow<'static, str>, u64),
    /// The request is parked (waiting in the queue, or held for its prefix): the glue keeps its
    /// stream where the root reaches it and calls [`RequestLife::on_turn`] whenever the VM's room
    /// names it ([`WaitingRoom::turns`](super::queue::WaitingRoom::turns)).
    Park,
}

/// The actions of one hook.
pub type Actions = Vec<Action>;

/// A generation request's facts from its headers, kept until it is routed.
#[derive(Debug)]
struct Held {
    endpoint: Endpoint,
    /// The client's request headers as they arrived: session and routing keys are read from them,
    /// and a PD prefill callout carries them on.
    headers: Vec<(String, Vec<u8>)>,
    body_size: usize,
}

impl Held {
    /// The first of repeated values, as a single-header read gives.
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }
}

#[derive(Debug)]
struct Awaiting {
    held: Held,
    ticket: Ticket,
    call: IndexerCall,
    /// The host's token once dispatched.
    token: Option<u32>,
    started_us: u64,
}

/// A parked request: waiting in its model's queue for room (spec §9), or held for its prefix.
/// Its ticket is parked (Envoy holds the body; the request is prepared again from it when it is
/// tried) and its seat is given back when the seat is dropped, whatever ends the wait.
#[derive(Debug)]
struct Parked {
    held: Held,
    ticket: Ticket,
    seat: Seat,
}

#[derive(Debug)]
enum Seat {
    Queue(Box<Queued>),
    /// Held until `wait`'s engine started on the prefix, or the request's hold is over; the slot
    /// is kept for what its drop does.
    Hold {
        _slot: HoldSlot,
        wait: PrefixWait,
    },
}

/// A request's wait in its model's queue.
#[derive(Debug)]
struct Queued {
    place: QueuePlace,
    entrant: Entrant,
    deadline_ms: u64,
    since_ms: u64,
    /// Its engines as its last selection found them: it is selected again only when room may
    /// have freed since.
    seen: Capacity,
}

/// The longest a request waits for its prefix's first dispatch before it goes regardless (an
/// engine that never answers it holds nothing back for longer).
pub const MAX_HOLD_MS: u64 = 1_000;

/// A decision whose prefill callout is being dispatched.
#[derive(Debug)]
struct Dispatching {
    exchange: Exchange,
}

/// A routed request, until its stream ends.
#[derive(Debug)]
struct Routed {
    exchange: Exchange,
    /// PD: the prefill callout's token and its engine's in-flight slot until it answers.
    prefill: Option<(u32, Option<InflightGuard>)>,
    /// The upstream (plain or decode) engine's slot, for the life of the stream.
    upstream: InflightGuard,
    /// The filter answered the client itself (a failed prefill): the response is not the engine's.
    answered: bool,
    /// Routed notices awaiting the indexer's answer: (token, replica), for its counters.
    notices: Vec<(u32, Arc<str>)>,
    /// The engine's response reached its end: nothing is left to abort.
    complete: bool,
    /// The response's first body byte times the engine's prefill (a streamed success of the
    /// engine that prefilled).
    timed: bool,
}

#[derive(Debug, Default)]
enum State {
    #[default]
    New,
    /// Not routed by the filter: passed through, or answered before any engine was chosen.
    Passing,
    Buffering(Held),
    AwaitingIndexer(Box<Awaiting>),
    Parked(Box<Parked>),
    DispatchingPrefill(Box<Dispatching>),
    Routed(Box<Routed>),
    /// Answered by the filter after the body was read; whatever comes later is not ours.
    Answered,
    Ended,
}

/// One stream's life. See the module documentation for its states.
#[derive(Debug, Default)]
pub struct RequestLife {
    state: State,
    /// `x-sgl-vm`, when the configuration asks for it.
    vm_header: Option<String>,
    /// The stream's id in its VM: its place in a waiting queue is named by it.
    id: u32,
    /// When its wait for its prefix ends, once it has begun.
    hold_until_ms: Option<u64>,
}

/// A 429 tells the client when to come back (spec §9).
fn reply(error: &RouteError, mut headers: Vec<(&'static str, String)>) -> Action {
    if error.status() == 429 {
        headers.push(("retry-after", RETRY_AFTER_S.to_string()));
    }
    Action::Reply { status: error.status(), body: error.body(), headers: json_headers(headers) }
}

fn json_headers(mut headers: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
    headers.push(("content-type", "application/json".to_string()));
    headers
}

impl RequestLife {
    pub fn new(vm_header: Option<String>, id: u32) -> Self {
        Self { state: State::New, vm_header, id, hold_until_ms: None }
    }

    /// An error not counted yet: counted, and answered.
    fn fail(&mut self, app: &AppContext, error: &RouteError, out: &mut Actions) {
        app.count([error_outcome(error.kind)]);
        out.push(reply(error, vec![]));
        self.state = State::Answered;
    }

    fn sync(app: &AppContext, out: &mut Actions) {
        let due = app.sync_shared();
        if !due.is_empty() {
            out.push(Action::Count(due));
        }
    }

    /// The request's headers, all of them: the client's routing headers go, and the route decides
    /// what comes next.
    pub fn on_request_headers(
        &mut self,
        app: &AppContext,
        headers: Vec<(String, Vec<u8>)>,
        end_of_stream: bool,
        out: &mut Actions,
    ) {
        let (mut path, mut method) = (String::new(), String::new());
        for (name, value) in &headers {
            match name.as_str() {
                ":path" => path = String::from_utf8_lossy(value).into_owned(),
                ":method" => method = String::from_utf8_lossy(value).into_owned(),
                _ => {}
            }
        }
        let route = route(&method, &path);
        let generation = matches!(route, Route::Generation(_));
        for (name, _) in &headers {
            if app.headers().strips(name, generation) {
                out.push(Action::RemoveRequestHeader(name.clone()));
            }
        }
        self.state = State::Passing;
        match route {
            Route::ListModels => {
                out.push(Action::Reply { status: 200, body: list_models(app.config()), headers: json_headers(vec![]) })
            }
            Route::RetrieveModel => match retrieve_model(app.config(), &path) {
                Ok(body) => out.push(Action::Reply { status: 200, body, headers: json_headers(vec![]) }),
                Err(error) => out.push(reply(&error, vec![])),
            },
            Route::Generation(endpoint) if end_of_stream => {
                self.fail(app, &RouteError::invalid(format!("POST {} needs a JSON body", endpoint.path())), out)
            }
            Route::Generation(endpoint) => self.state = State::Buffering(Held { endpoint, headers, body_size: 0 }),
            Route::MethodNotAllowed { allow } => {
                let error = method_not_allowed(&method, &path, allow);
                app.count([error_outcome(error.kind)]);
                out.push(reply(&error, vec![("allow", allow.to_string())]));
            }
            Route::PassThrough => {
                // A route chosen before the headers were stripped must not survive them.
                out.push(Action::ClearRouteCache);
                out.push(Action::Proceed);
            }
        }
    }

    /// A body callback: `size` bytes are buffered so far; `read` reads them.
    pub fn on_request_body(
        &mut self,
        app: &AppContext,
        size: usize,
        end_of_stream: bool,
        read: &mut dyn FnMut(usize) -> Vec<u8>,
        out: &mut Actions,
    ) {
        match &self.state {
            State::Buffering(_) => {}
            State::New | State::Passing | State::Routed(_) | State::Ended => return out.push(Action::Proceed),
            // Held until the answer comes, or answered already.
            State::AwaitingIndexer(_) | State::Parked(_) | State::DispatchingPrefill(_) | State::Answered => return,
        }
        match body_step(size, end_of_stream) {
            BodyStep::Wait => return,
            BodyStep::TooLarge(error) => return self.fail(app, &error, out),
            BodyStep::Ready => {}
        }
        let State::Buffering(mut held) = mem::take(&mut self.state) else { return };
        held.body_size = size;
        // The other VMs' counts as of at most one sync period ago.
        Self::sync(app, out);
        let body = read(size);
        let started_us = app.monotonic_us();
        let mut ticket = match app.prepare(held.endpoint, body, &|name| held.header(name), true) {
            Ok(ticket) => ticket,
            Err(error) => return self.fail(app, &error, out),
        };
        match ticket.take_indexer_call() {
            Some(mut call) => match call.take_request(started_us) {
                Some(request) => {
                    out.push(Action::Dispatch(request));
                    self.state =
                        State::AwaitingIndexer(Box::new(Awaiting { held, ticket, call, token: None, started_us }));
                }
                None => self.decide(app, held, ticket, started_us, out),
            },
            None => self.decide(app, held, ticket, started_us, out),
        }
    }

    /// How dispatching the callout of the last [`Action::Dispatch`] went.
    pub fn on_dispatched(&mut self, app: &AppContext, result: Result<u32, String>, out: &mut Actions) {
        match mem::take(&mut self.state) {
            State::AwaitingIndexer(mut awaiting) if awaiting.token.is_none() => match result {
                Ok(token) => {
                    awaiting.token = Some(token);
                    self.state = State::AwaitingIndexer(awaiting);
                }
                Err(e) => self.indexer_failed(app, awaiting, format!("the indexer callout was not sent: {e}"), out),
            },
            State::DispatchingPrefill(dispatching) => {
                let Dispatching { mut exchange } = *dispatching;
                match result {
                    Ok(token) => {
                        let Some(prefill) = exchange.decision().pd.as_ref().map(|pd| Arc::clone(&pd.prefill)) else {
                            return;
                        };
                        // A prefill engine answers once its prefill is done: its wait times it.
                        let guard = app
                            .on_dispatch(&prefill.id, exchange.decision().prefill_tokens, true)
                            .with_seat(exchange.take_seat(&prefill.id));
                        app.carry_out(exchange.dispatched(&prefill.id));
                        self.route(app, exchange, Some((token, Some(guard))), out);
                    }
                    Err(e) => {
                        let prefill =
                            exchange.decision().pd.as_ref().map(|pd| pd.prefill.id.clone()).unwrap_or_default();
                        let error = RouteError::new(
                            ErrorKind::PrefillFailed,
                            format!("the prefill request to {prefill} could not be sent: {e}"),
                        );
                        self.fail(app, &error, out);
                    }
                }
            }
            other => self.state = other,
        }
    }

    /// A callout answered (`status` `None`: it failed or timed out); `read` reads its body.
    pub fn on_callout_answer(
        &mut self,
        app: &AppContext,
        token: u32,
        status: Option<u16>,
        read: &mut dyn FnMut() -> Vec<u8>,
        out: &mut Actions,
    ) {
        match &mut self.state {
            State::AwaitingIndexer(awaiting) if awaiting.token == Some(token) => {
                let State::AwaitingIndexer(mut awaiting) = mem::take(&mut self.state) else { return };
                match awaiting.call.answer(status, &read()) {
                    Err(why) => self.indexer_failed(app, awaiting, why, out),
                    answer => self.indexer_done(app, *awaiting, answer, out),
                }
            }
            State::Routed(routed) if routed.notices.iter().any(|(t, _)| *t == token) => {
                if let Some(i) = routed.notices.iter().position(|(t, _)| *t == token) {
                    let (_, replica) = routed.notices.swap_remove(i);
                    let event = match status {
                        Some(200..=299) => IndexerEvent::NoticeSent,
                        _ => IndexerEvent::NoticeFailed,
                    };
                    app.count([Counter::Indexer(replica, event)]);
                }
            }
            State::Routed(routed) if routed.prefill.as_ref().is_some_and(|(t, _)| *t == token) => {
                if let Some((_, guard)) = routed.prefill.as_mut() {
                    // A prefill engine answers once its prefill is done: the time is a sample.
                    if let (Some(g), Some(200..=299)) = (guard.as_mut(), status) {
                        g.first_byte(true);
                    }
                    *guard = None;
                }
                Self::sync(app, out);
                let (done, effects) = routed.exchange.on_prefill_done(status);
                app.carry_out(effects);
                match done {
                    PrefillDone::Resume => out.push(Action::ResumeResponse),
                    // Its outcome was counted by the exchange.
                    PrefillDone::Fail(error) => {
                        routed.answered = true;
                        out.push(reply(&error, vec![]));
                    }
                    PrefillDone::Nothing => {}
                }
            }
            _ => {}
        }
    }

    /// The replica asked last could not answer: the next one is asked within the call's budget,
    /// or the request goes on without the index.
    fn indexer_failed(&mut self, app: &AppContext, mut awaiting: Box<Awaiting>, why: String, out: &mut Actions) {
        match awaiting.call.fail_over(app.monotonic_us()) {
            Some(request) => {
                out.push(Action::Dispatch(request));
                awaiting.token = None;
                self.state = State::AwaitingIndexer(awaiting);
            }
            None => self.indexer_done(app, *awaiting, Err(why), out),
        }
    }

    fn indexer_done(&mut self, app: &AppContext, awaiting: Awaiting, answer: IndexerAnswer, out: &mut Actions) {
        let Awaiting { held, mut ticket, mut call, started_us, .. } = awaiting;
        out.push(Action::Observe(Cow::Borrowed(INDEXER_WAIT_US), app.monotonic_us().saturating_sub(started_us)));
        app.count(call.take_counters());
        // Its in-flight slot is given back before the selection runs.
        drop(call);
        ticket.answered(answer);
        self.decide(app, held, ticket, started_us, out);
    }

    /// How sending a routed notice (an [`Action::Notify`]) to the indexer behind `cluster` went.
    pub fn on_notice_dispatched(&mut self, app: &AppContext, cluster: &str, result: Result<u32, String>) {
        let Some(replica) = app.indexer_replica(cluster) else { return };
        match (result, &mut self.state) {
            (Ok(token), State::Routed(routed)) => routed.notices.push((token, replica)),
            (Ok(_), _) => {}
            (Err(_), _) => app.count([Counter::Indexer(replica, IndexerEvent::NoticeFailed)]),
        }
    }

    /// Selects, and carries out the decision or answers the error. With a queue, a request waits
    /// when every engine it may take refused it; it may not take the engines the requests waiting
    /// ahead of it could use (spec §9), and takes any other at once.
    fn decide(&mut self, app: &AppContext, held: Held, ticket: Ticket, started_us: u64, out: &mut Actions) {
        let queue = app.config().queue_for(&ticket.facts.model);
        let mut queued = None;
        if let Some(config) = queue {
            let entrant = Self::entrant(config, &held, &ticket);
            let reserved = match app.waiting().reserved_ahead(&entrant) {
                Ok(reserved) => reserved,
                Err(e) => {
                    app.count([Counter::QueueRejection(QueueExit::Unavailable, Arc::clone(&entrant.class))]);
                    let message = format!("the queue of model `{}` could not be read: {e}", entrant.model);
                    return self.fail(app, &RouteError::new(ErrorKind::QueueUnavailable, message), out);
                }
            };
            queued = Some((config, entrant, reserved));
            // A model with a queue relies on its caps: its arrivals decide on fresh counts and
            // tell theirs at once, so two VMs seldom fill one free slot twice in a burst.
            app.exchange_counts_now();
        }
        let reserved = queued.as_ref().map(|(_, _, r)| *r).unwrap_or_default();
        let Outcome { verdict, counters } = app.decide(ticket, &reserved, false);
        if let Verdict::Held { ticket, wait } = verdict {
            return self.hold(app, held, ticket, wait, started_us, out);
        }
        out.push(Action::Observe(Cow::Borrowed(SELECTION_US), app.monotonic_us().saturating_sub(started_us)));
        match (verdict, queued) {
            (Verdict::Refused { ticket, .. }, Some((config, entrant, _))) => {
                // The refusals are counted; the outcome is the wait's.
                app.count(counters.into_iter().filter(|c| !matches!(c, Counter::Outcome(_))));
                self.wait(app, config, held, ticket, entrant, out)
            }
            (verdict, queued) => {
                let dispatched = matches!(verdict, Verdict::Routed(_));
                self.conclude(app, held, counters, verdict, out);
                if dispatched && queued.is_some() {
                    app.publish_counts_now();
                }
            }
        }
    }

    /// What a request of a model with a queue would join it as: its class, tenant and work. The
    /// engines it could use are named only when it joins ([`RequestLife::wait`]): an arrival that
    /// goes at once never needs them.
    fn entrant(config: &QueueConfig, held: &Held, ticket: &Ticket) -> Entrant {
        let facts = &ticket.facts;
        let budget = facts.output_budget.unwrap_or(UNKNOWN_BUDGET_TOKENS);
        let cost = ticket.request.input_tokens.saturating_add(budget);
        let bytes = held.body_size as u64;
        Entrant::new(config, &facts.model, &|name| held.header(name), (cost, bytes), EngineSet::default())
    }

    /// A selection's counters go; its decision is carried out, or its error answered.
    fn conclude(&mut self, app: &AppContext, held: Held, counters: Vec<Counter>, verdict: Verdict, out: &mut Actions) {
        app.count(counters);
        match verdict {
            Verdict::Routed(decision) => self.apply(app, held, decision, out),
            Verdict::Refused { error, .. } | Verdict::Failed(error) => {
                out.push(reply(&error, vec![]));
                self.state = State::Answered;
            }
            // Decided again at once: it may not wait for its prefix any longer.
            Verdict::Held { mut ticket, .. } => {
                ticket.request.prefix_wait_over = true;
                self.decide(app, held, ticket, app.monotonic_us(), out)
            }
        }
    }

    /// Joins the model's queue as `entrant`, or is answered at once: the queue is full (for it or
    /// its tenant), its expected wait is past its class's, or the queue cannot be written (a 503:
    /// nobody skips the queue).
    fn wait(
        &mut self,
        app: &AppContext,
        config: &QueueConfig,
        held: Held,
        mut ticket: Ticket,
        mut entrant: Entrant,
        out: &mut Actions,
    ) {
        // Selected again on its turn: it has waited enough.
        ticket.request.prefix_wait_over = true;
        entrant.engines = app.engines_of(&ticket);
        let deadline_ms = app.now_ms().saturating_add(entrant.max_wait_ms);
        match app.waiting().join(self.id, &entrant, config, deadline_ms) {
            Ok(place) => {
                let seen = app.capacity(&entrant.engines, &app.waiting().reserved(self.id));
                let since_ms = app.now_ms();
                let queued = Queued { place, entrant, deadline_ms, since_ms, seen };
                self.park(held, ticket, Seat::Queue(Box::new(queued)), out);
            }
            Err(refusal) => {
                app.count([Counter::QueueRejection(refusal.exit, Arc::clone(&entrant.class))]);
                self.fail(app, &refusal.error, out);
            }
        }
    }

    fn park(&mut self, held: Held, mut ticket: Ticket, seat: Seat, out: &mut Actions) {
        ticket.park();
        self.state = State::Parked(Box::new(Parked { held, ticket, seat }));
        out.push(Action::Park);
    }

    /// Waits at the router for the engine to start on its prefix's first dispatch, for at most
    /// [`MAX_HOLD_MS`] in all, while the VM holds fewer than
    /// [`MAX_HELD`](super::queue::MAX_HELD); else it is decided again at once, done waiting.
    fn hold(
        &mut self,
        app: &AppContext,
        held: Held,
        mut ticket: Ticket,
        wait: PrefixWait,
        started_us: u64,
        out: &mut Actions,
    ) {
        let now_ms = app.now_ms();
        let until_ms = *self.hold_until_ms.get_or_insert(now_ms.saturating_add(MAX_HOLD_MS));
        match app.waiting().hold(self.id).filter(|_| now_ms < until_ms) {
            Some(slot) => self.park(held, ticket, Seat::Hold { _slot: slot, wait }, out),
            None => {
                ticket.request.prefix_wait_over = true;
                self.decide(app, held, ticket, started_us, out)
            }
        }
    }

    /// Whether the request is held for its prefix.
    pub fn holding(&self) -> bool {
        matches!(&self.state, State::Parked(p) if matches!(p.seat, Seat::Hold { .. }))
    }

    /// A parked ticket prepared again from the body Envoy holds (`read` reads it).
    fn resume(
        app: &AppContext,
        held: &Held,
        parked: Ticket,
        read: &mut dyn FnMut(usize) -> Vec<u8>,
    ) -> Result<Ticket, RouteError> {
        let fresh = app.prepare(held.endpoint, read(held.body_size), &|name| held.header(name), false)?;
        Ok(parked.resumed(fresh))
    }

    /// A parked request's turn. A queued one whose wait is over is answered; one whose room may
    /// have freed is prepared again from the body Envoy holds (`read` reads it) and selected again,
    /// bucket-first, leaving the engines of the requests ahead of it: it goes, waits on, or is
    /// answered. A held one is selected again once its engine started on the prefix, or its hold
    /// is over. Until then a turn costs a few lookups and no selection.
    pub fn on_turn(&mut self, app: &AppContext, read: &mut dyn FnMut(usize) -> Vec<u8>, out: &mut Actions) {
        let parked = match mem::take(&mut self.state) {
            State::Parked(parked) => parked,
            other => {
                self.state = other;
                return;
            }
        };
        match &parked.seat {
            Seat::Hold { wait, .. } => {
                let over = self.hold_until_ms.is_some_and(|until| app.now_ms() >= until);
                if !over && !app.prefix_started(&wait.engine, wait.sent_ms) {
                    self.state = State::Parked(parked);
                    return;
                }
                // Its slot is given back: it is held again only if it must wait on.
                let Parked { held, ticket, .. } = *parked;
                let ticket = match Self::resume(app, &held, ticket, read) {
                    Ok(ticket) => ticket,
                    Err(error) => return self.fail(app, &error, out),
                };
                self.decide(app, held, ticket, app.monotonic_us(), out);
                if !self.holding() {
                    let since_ms = self.hold_until_ms.unwrap_or_default().saturating_sub(MAX_HOLD_MS);
                    out.push(Action::Observe(Cow::Borrowed(PREFIX_HOLD_MS), app.now_ms().saturating_sub(since_ms)));
                }
            }
            Seat::Queue(_) => self.queue_turn(app, parked, read, out),
        }
    }

    fn queue_turn(
        &mut self,
        app: &AppContext,
        parked: Box<Parked>,
        read: &mut dyn FnMut(usize) -> Vec<u8>,
        out: &mut Actions,
    ) {
        let Seat::Queue(queued) = &parked.seat else { return };
        if app.waiting().displaced(self.id) {
            let error = displaced(&queued.entrant.model);
            app.count([Counter::QueueRejection(QueueExit::Displaced, Arc::clone(&queued.entrant.class))]);
            drop(parked);
            return self.fail(app, &error, out);
        }
        if app.now_ms() >= queued.deadline_ms {
            let (model, class) = (&queued.entrant.model, Arc::clone(&queued.entrant.class));
            let error = timed_out(model, queued.entrant.max_wait_ms);
            app.count([Counter::QueueRejection(QueueExit::Timeout, class)]);
            // Its place goes with it.
            drop(parked);
            return self.fail(app, &error, out);
        }
        // The other VMs' counts as of at most one sync period ago.
        Self::sync(app, out);
        let reserved = app.waiting().reserved(self.id);
        if !app.capacity(&queued.entrant.engines, &reserved).freed_since(&queued.seen) {
            self.state = State::Parked(parked);
            return;
        }
        let Parked { held, ticket, seat } = *parked;
        let Seat::Queue(mut queued) = seat else { return };
        let ticket = match Self::resume(app, &held, ticket, read) {
            Ok(ticket) => ticket,
            Err(error) => return self.fail(app, &error, out),
        };
        // Room freed on another VM shows in its counts.
        app.exchange_counts_now();
        let started_us = app.monotonic_us();
        let Outcome { verdict, counters } = app.decide(ticket, &reserved, true);
        match verdict {
            // Still no room: it keeps its place, and its refusals are not counted again.
            Verdict::Refused { ticket, .. } | Verdict::Held { ticket, .. } => {
                queued.seen = app.capacity(&queued.entrant.engines, &reserved);
                let seat = Seat::Queue(queued);
                let mut ticket = ticket;
                ticket.park();
                self.state = State::Parked(Box::new(Parked { held, ticket, seat }));
            }
            verdict => {
                let Queued { place, entrant, since_ms, .. } = *queued;
                let dispatched = matches!(verdict, Verdict::Routed(_));
                if dispatched {
                    place.served();
                    let waited = app.now_ms().saturating_sub(since_ms);
                    out.push(Action::Observe(Cow::Owned(queue_wait_ms(&entrant.class)), waited));
                } else {
                    drop(place);
                }
                let selection_us = app.monotonic_us().saturating_sub(started_us);
                out.push(Action::Observe(Cow::Borrowed(SELECTION_US), selection_us));
                self.conclude(app, held, counters, verdict, out);
                if dispatched {
                    app.publish_counts_now();
                }
            }
        }
    }

    fn apply(&mut self, app: &AppContext, held: Held, mut decision: Decision, out: &mut Actions) {
        for (name, value) in mem::take(&mut decision.upstream_headers) {
            out.push(Action::SetRequestHeader(name, value));
        }
        out.push(Action::ClearRouteCache);
        // The headers are still held, so a rewritten body keeps a length: dropping it would send
        // every request chunked.
        let replace_body = |size: usize, body: Arc<Vec<u8>>, len: usize, out: &mut Actions| {
            out.push(Action::SetRequestHeader("content-length".to_string(), len.to_string()));
            out.push(Action::ReplaceRequestBody { size, body });
        };
        let Some(pd) = decision.pd.as_mut() else {
            if let Some(edit) = decision.body.take() {
                replace_body(edit.replaced, Arc::new(edit.head), edit.len, out);
            }
            return self.route(app, Exchange::new(decision), None, out);
        };
        // A header value that is not UTF-8 cannot be put on a callout; it is left out.
        let client =
            held.headers.into_iter().filter_map(|(name, value)| Some((name, String::from_utf8(value).ok()?))).collect();
        let (request, upstream_body) = pd.take_requests(forwarded_headers(client, app.headers().stripped()));
        replace_body(held.body_size, Arc::clone(&upstream_body), upstream_body.len(), out);
        out.push(Action::Dispatch(request));
        self.state = State::DispatchingPrefill(Box::new(Dispatching { exchange: Exchange::new(decision) }));
    }

    /// The request goes to its upstream engine.
    fn route(
        &mut self,
        app: &AppContext,
        mut exchange: Exchange,
        prefill: Option<(u32, Option<InflightGuard>)>,
        out: &mut Actions,
    ) {
        let upstream = Arc::clone(exchange.decision().target.upstream());
        let seat = exchange.take_seat(&upstream.id);
        let decision = exchange.decision();
        let guard = app
            .on_dispatch(&upstream.id, decision.upstream_prefill_tokens(), decision.upstream_times_prefill())
            .with_seat(seat);
        let prefills_a_prompt = decision.prefill_tokens >= PREFILL_QUANTUM_TOKENS;
        app.carry_out(exchange.dispatched(&upstream.id));
        if prefills_a_prompt {
            app.tell_news();
        }
        // The indexers' routed notices: nothing waits for them; their answers are only counted.
        out.extend(exchange.take_notices().into_iter().map(Action::Notify));
        self.state = State::Routed(Box::new(Routed {
            exchange,
            prefill,
            upstream: guard,
            answered: false,
            notices: Vec::new(),
            complete: false,
            timed: false,
        }));
        Self::sync(app, out);
        out.push(Action::Proceed);
    }

    /// The upstream's response headers (`status` as it answered; `end_of_stream` when there is
    /// no body). `upstream_host` reads the `ip:port` Envoy sent the request to; it is asked only
    /// when Envoy may have retried it elsewhere.
    pub fn on_response_headers(
        &mut self,
        app: &AppContext,
        status: Option<u16>,
        end_of_stream: bool,
        upstream_host: &mut dyn FnMut() -> Option<String>,
        out: &mut Actions,
    ) {
        let State::Routed(routed) = &mut self.state else { return out.push(Action::Proceed) };
        if routed.answered {
            return out.push(Action::Proceed);
        }
        routed.complete = end_of_stream;
        routed.timed = matches!(status, Some(200..=299)) && routed.exchange.decision().upstream_times_prefill();
        if end_of_stream {
            routed.upstream.first_byte(false);
        }
        if !routed.exchange.decision().fallbacks.is_empty() {
            if let Some((engine, effects)) = upstream_host().and_then(|host| routed.exchange.retried(&host)) {
                app.carry_out(effects);
                // The slot, and its seat, move to the engine that has the request.
                let decision = routed.exchange.decision();
                let seat = routed.upstream.seat().map(|s| Arc::new(s.moved_to(&Arc::from(engine.id.as_str()))));
                routed.upstream = app
                    .on_dispatch(&engine.id, decision.upstream_prefill_tokens(), decision.upstream_times_prefill())
                    .with_seat(seat);
            }
        }
        if let Some(vm) = &self.vm_header {
            out.push(Action::SetResponseHeader("x-sgl-vm", vm.clone()));
        }
        out.extend(routed.exchange.decision().response_headers().map(|(k, v)| Action::SetResponseHeader(k, v)));
        let (flow, effects) = routed.exchange.on_upstream_headers(status);
        app.carry_out(effects);
        if flow == Flow::Pass {
            out.push(Action::Proceed);
        }
    }

    /// A chunk of the upstream's response body (`end_of_stream` on its last).
    pub fn on_response_body(&mut self, end_of_stream: bool, out: &mut Actions) {
        let held = match &mut self.state {
            State::Routed(routed) if !routed.answered => {
                routed.complete |= end_of_stream;
                routed.upstream.first_byte(routed.timed);
                routed.exchange.on_upstream_body() == Flow::Hold
            }
            _ => false,
        };
        if !held {
            out.push(Action::Proceed);
        }
    }

    /// The aborts of a routed request that did not complete: the upstream engine, and the prefill
    /// engine while its callout is out.
    fn abort(routed: &Routed, out: &mut Actions) {
        let decision = routed.exchange.decision();
        let rid = &*decision.rid;
        let upstream = decision.target.upstream();
        out.push(Action::Detach(abort_request(upstream, rid), decision.target.upstream_stage()));
        let prefill_out = routed.prefill.as_ref().is_some_and(|(_, guard)| guard.is_some());
        if let (true, Target::Pd { prefill, .. }) = (prefill_out, &decision.target) {
            out.push(Action::Detach(abort_request(prefill, rid), Role::Prefill));
        }
    }

    /// How sending an abort of `stage` went: counted sent, or unsent (its engine's cluster is
    /// gone, as after an update that removed it; the engine finishes the request on its own).
    /// Counted at once, not held: the stream is ending, and its configuration's root may go with
    /// it (an update replaced it) before a held count is handed to Envoy.
    pub fn on_detached(&self, stage: Role, result: Result<u32, String>, out: &mut Actions) {
        let counter = match result {
            Ok(_) => Counter::Abort(stage),
            Err(_) => Counter::AbortUnsent(stage),
        };
        out.push(Action::Count(Bumps::from_iter([(counter, 1)])));
    }

    /// The stream ended, however: completed, failed, or the client went away at any step. Each
    /// engine still working on a request that did not complete is told to stop (spec §8).
    pub fn on_end(&mut self, app: &AppContext, out: &mut Actions) {
        match mem::replace(&mut self.state, State::Ended) {
            State::Routed(mut routed) => {
                if !routed.complete {
                    Self::abort(&routed, out);
                }
                app.carry_out(routed.exchange.on_end());
            }
            // The client went away while parked: its seat goes with it, at once.
            State::Parked(parked) => {
                if let Seat::Queue(queued) = &parked.seat {
                    app.count([Counter::QueueRejection(QueueExit::ClientGone, Arc::clone(&queued.entrant.class))]);
                }
            }
            _ => {}
        }
        // Whatever was held (an indexer slot, in-flight slots) is given back by now.
        Self::sync(app, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_and_validate;
    use crate::host::{Host, MemoryHost};
    use crate::testing::test;
    use crate::wiring::factory::filter_handles;
    use serde_json::{json, Value};

    /// Retries off unless the test turns them on: the other tests read the engine's own cluster.
    fn app(mut config: Value) -> AppContext {
        if config.get("retry").is_none() {
            config["retry"] = json!({"attempts": 0});
        }
        let config = parse_and_validate(&config.to_string()).unwrap();
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let (handles, _) = filter_handles(&config, host, 1);
        AppContext::new(config, handles)
    }

    fn engine(id: &str, port: u16, role: &str) -> Value {
        let mut engine = json!({"id": id, "url": format!("http://10.0.0.1:{port}"), "model": "m", "role": role});
        if role == "prefill" {
            engine["bootstrap_port"] = json!(8998);
        }
        engine
    }

    fn plain_app() -> AppContext {
        app(json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}},
        }))
    }

    /// Two router configurations in one VM (one shared-data store), with the same model and the
    /// same worker ids, in different namespaces: neither sees the other's rotation or in-flight
    /// counts; a third in the first's namespace shares its state (spec §10).
    #[test]
    fn two_namespaces_in_one_vm_keep_apart() {
        let memory: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let config = parse_and_validate(
            &json!({
                "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
                "retry": {"attempts": 0},
                "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}},
            })
            .to_string(),
        )
        .unwrap();
        let in_namespace = |ns: &str, vm: u64| {
            let host: Arc<dyn Host> = Arc::new(crate::host::Namespaced::new(Arc::clone(&memory), ns));
            let (handles, _) = filter_handles(&config, host, vm);
            AppContext::new(config.clone(), handles)
        };
        let (a, b, a_again) = (in_namespace("pool-a", 1), in_namespace("pool-b", 2), in_namespace("pool-a", 3));
        let (_on_a, to_a) = send(&a, "/v1/chat/completions", CHAT);
        let (_on_b, to_b) = send(&b, "/v1/chat/completions", CHAT);
        let (_on_a_again, to_a_again) = send(&a_again, "/v1/chat/completions", CHAT);
        assert_eq!(upstream(&to_a), Some("sgl_A"));
        assert_eq!(upstream(&to_b), Some("sgl_A"), "pool-b's rotation is its own");
        assert_eq!(upstream(&to_a_again), Some("sgl_B"), "pool-a's goes on in its other VM");
        let _ = (a.sync_shared_now(), b.sync_shared_now(), a_again.sync_shared_now());
        assert_eq!((inflight(&b, "A"), inflight(&b, "B")), (1, 0), "pool-b counts its one, not pool-a's");
    }

    /// Token-id prompts go to the indexer's `/query`; at most `cap` callouts in flight.
    fn indexed_app(cap: u64) -> AppContext {
        app(json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "prefix_index": {"url": "http://10.0.0.9:9100", "timeout_ms": 50, "max_concurrent": cap},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}},
        }))
    }

    fn pd_app() -> AppContext {
        app(json!({
            "workers": [engine("P", 1, "prefill"), engine("D", 2, "decode")],
            "models": {"m": {"buckets": [{"id": "pd", "groups": {"pd": {
                "prefill": {"policy": {"type": "round_robin"}},
                "decode": {"policy": {"type": "round_robin"}},
            }}}]}},
        }))
    }

    fn headers(method: &str, path: &str) -> Vec<(String, Vec<u8>)> {
        [(":method", method), (":path", path), ("x-sgl-cluster", "spoofed"), ("authorization", "Bearer t")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    const CHAT: &[u8] = br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}"#;
    /// 2,048 token ids, so a match passes the cache-aware minimum.
    fn tokens() -> Vec<u8> {
        json!({"model": "m", "prompt": (0..2048).collect::<Vec<u32>>(), "max_tokens": 4}).to_string().into_bytes()
    }

    /// Actions without the bookkeeping every hook may add (bumps, samples).
    fn visible(out: &mut Actions) -> Vec<Action> {
        out.drain(..).filter(|a| !matches!(a, Action::Count(_) | Action::Observe(..))).collect()
    }

    /// Headers, then the whole body in one callback.
    fn send(app: &AppContext, path: &str, body: &[u8]) -> (RequestLife, Vec<Action>) {
        let mut life = RequestLife::new(None, 1);
        let mut out = Vec::new();
        life.on_request_headers(app, headers("POST", path), false, &mut out);
        assert_eq!(visible(&mut out), [Action::RemoveRequestHeader("x-sgl-cluster".into())]);
        life.on_request_body(app, body.len(), true, &mut |_| body.to_vec(), &mut out);
        let actions = visible(&mut out);
        (life, actions)
    }

    fn upstream(actions: &[Action]) -> Option<&str> {
        actions.iter().find_map(|a| match a {
            Action::SetRequestHeader(name, value) if name != "content-length" => Some(value.as_str()),
            _ => None,
        })
    }

    fn inflight(app: &AppContext, id: &str) -> u64 {
        app.handles().inflight.local_load(id).inflight
    }

    fn reply_status(actions: &[Action]) -> Option<u16> {
        actions.iter().find_map(|a| match a {
            Action::Reply { status, .. } => Some(*status),
            _ => None,
        })
    }

    #[test]
    fn a_plain_request_is_routed_answered_and_released() {
        let app = plain_app();
        let mut life = RequestLife::new(Some("00ff".into()), 1);
        let mut out = Vec::new();
        let mut with_id = headers("POST", "/v1/chat/completions");
        with_id.push(("x-request-id".into(), b"req-1".to_vec()));
        life.on_request_headers(&app, with_id, false, &mut out);
        assert_eq!(visible(&mut out), [Action::RemoveRequestHeader("x-sgl-cluster".into())], "held for the body");
        life.on_request_body(&app, 10, false, &mut |_| unreachable!("not read before its end"), &mut out);
        assert!(visible(&mut out).is_empty(), "buffering");
        life.on_request_body(&app, CHAT.len(), true, &mut |_| CHAT.to_vec(), &mut out);
        assert!(
            out.iter().any(|a| matches!(a, Action::Observe(Cow::Borrowed(SELECTION_US), _))),
            "selection time sampled"
        );
        let actions = visible(&mut out);
        let sent = body_of(&actions, CHAT).unwrap();
        assert!(sent["rid"].as_str().is_some_and(|r| r.starts_with("sgl-")), "the filter's own id, not the header's");
        assert_eq!(sent["max_tokens"].as_u64(), Some(4));
        let [Action::SetRequestHeader(name, cluster), Action::ClearRouteCache, Action::SetRequestHeader(length, n), Action::ReplaceRequestBody { size, body }, Action::Proceed] =
            &actions[..]
        else {
            panic!("{actions:?}")
        };
        assert_eq!((name.as_str(), cluster.as_str(), length.as_str()), ("x-sgl-cluster", "sgl_A", "content-length"));
        let open = CHAT.iter().position(|b| *b == b'{').unwrap() + 1;
        assert_eq!(*size, open, "only the bytes up to the object's start are replaced: the id goes first");
        assert_eq!(n.clone(), (body.len() + CHAT.len() - open).to_string());
        assert_eq!(inflight(&app, "A"), 1);
        life.on_request_body(&app, CHAT.len(), true, &mut |_| unreachable!(), &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed], "routed: the body passes");
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        assert_eq!(
            visible(&mut out),
            [
                Action::SetResponseHeader("x-sgl-vm", "00ff".into()),
                Action::SetResponseHeader("x-sgl-bucket", "all".into()),
                Action::SetResponseHeader("x-sgl-worker", "A".into()),
                Action::Proceed
            ]
        );
        life.on_response_body(false, &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed]);
        life.on_end(&app, &mut out);
        assert_eq!(inflight(&app, "A"), 0, "released at the stream's end");
    }

    /// The client leaves before its body is complete: nothing was chosen, nothing is held.
    #[test]
    fn a_client_gone_while_the_body_buffers_leaves_nothing_behind() {
        let app = plain_app();
        let mut life = RequestLife::default();
        let mut out = Vec::new();
        life.on_request_headers(&app, headers("POST", "/v1/chat/completions"), false, &mut out);
        life.on_request_body(&app, 10, false, &mut |_| unreachable!(), &mut out);
        life.on_end(&app, &mut out);
        out.clear();
        life.on_request_body(&app, 20, true, &mut |_| unreachable!("ended: never read"), &mut out);
        life.on_response_headers(&app, None, false, &mut || None, &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed, Action::Proceed]);
        assert_eq!((inflight(&app, "A"), inflight(&app, "B")), (0, 0));
    }

    /// The session key is read from the headers the request arrived with, whatever their case.
    #[test]
    fn a_session_header_keeps_a_conversation_on_its_engine() {
        let app = app(json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "session_aware"}}}}]}},
        }));
        let turn = |session: &str| {
            let mut life = RequestLife::default();
            let mut out = Vec::new();
            let mut headers = headers("POST", "/v1/chat/completions");
            headers.push(("X-Session-Id".to_string(), session.as_bytes().to_vec()));
            life.on_request_headers(&app, headers, false, &mut out);
            life.on_request_body(&app, CHAT.len(), true, &mut |_| CHAT.to_vec(), &mut out);
            let engine = upstream(&visible(&mut out)).map(str::to_string);
            life.on_end(&app, &mut out);
            engine
        };
        let first = turn("s1");
        assert!(first.is_some());
        assert_eq!(app.handles().affinity.len(), 1, "the key was read, and bound");
        for _ in 0..4 {
            assert_eq!(turn("s1"), first, "bound to its engine");
        }
    }

    #[test]
    fn routes_the_filter_answers_itself_and_what_it_passes_through() {
        let app = plain_app();
        let mut out = Vec::new();
        let mut life = RequestLife::default();
        life.on_request_headers(&app, headers("GET", "/v1/models"), true, &mut out);
        assert_eq!(reply_status(&visible(&mut out)), Some(200));
        let mut life = RequestLife::default();
        life.on_request_headers(&app, headers("GET", "/v1/chat/completions"), true, &mut out);
        let actions = visible(&mut out);
        assert_eq!(reply_status(&actions), Some(405));
        assert!(matches!(&actions[1], Action::Reply { headers, .. } if headers.contains(&("allow", "POST".into()))));
        let mut life = RequestLife::default();
        life.on_request_headers(&app, headers("POST", "/v1/chat/completions"), true, &mut out);
        assert_eq!(reply_status(&visible(&mut out)), Some(400), "a generation request needs a body");
        let mut life = RequestLife::default();
        life.on_request_headers(&app, headers("GET", "/health"), true, &mut out);
        assert_eq!(visible(&mut out)[1..], [Action::ClearRouteCache, Action::Proceed]);
        life.on_request_body(&app, 3, true, &mut |_| unreachable!(), &mut out);
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed, Action::Proceed], "not ours: untouched");
    }

    #[test]
    fn a_bad_or_oversized_body_is_answered_and_nothing_is_held() {
        let app = plain_app();
        let (mut life, actions) = send(&app, "/v1/chat/completions", b"{not json");
        assert_eq!(reply_status(&actions), Some(400));
        let mut out = Vec::new();
        life.on_request_body(&app, 9, true, &mut |_| unreachable!(), &mut out);
        life.on_response_headers(&app, Some(400), false, &mut || None, &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed], "the filter's own reply passes untouched");
        let mut life = RequestLife::default();
        life.on_request_headers(&app, headers("POST", "/v1/chat/completions"), false, &mut out);
        life.on_request_body(&app, crate::filter::errors::MAX_BODY_BYTES + 1, false, &mut |_| unreachable!(), &mut out);
        assert_eq!(reply_status(&visible(&mut out)), Some(413));
        assert_eq!((inflight(&app, "A"), inflight(&app, "B")), (0, 0));
    }

    #[test]
    fn a_selection_error_is_answered_with_its_status() {
        let app = plain_app();
        let body = br#"{"model": "other", "messages": [{"role": "user", "content": "hi"}]}"#;
        let (_, actions) = send(&app, "/v1/chat/completions", body);
        assert_eq!(reply_status(&actions), Some(404));
    }

    fn answer(data: Value) -> Vec<u8> {
        json!({"data": data, "handle": "42"}).to_string().into_bytes()
    }

    /// The body the engine gets: `sent` with its first bytes replaced as the actions say.
    fn body_of(actions: &[Action], sent: &[u8]) -> Option<Value> {
        actions.iter().find_map(|a| match a {
            Action::ReplaceRequestBody { size, body } => {
                serde_json::from_slice(&[body.as_slice(), &sent[*size..]].concat()).ok()
            }
            _ => None,
        })
    }

    /// An engine of two data-parallel ranks whose rank 1 holds the prompt: the body sent to it
    /// names rank 1, plain and in PD (where the decode engine, holding no prefix and with no load
    /// report, is left to balance itself), and the routed notice names the rank too.
    #[test]
    fn the_rank_holding_the_prefix_is_named_in_the_body() {
        let mut a = engine("A", 1, "plain");
        a["dp_size"] = json!(2);
        let app = app(json!({
            "workers": [a, engine("B", 2, "plain")],
            "prefix_index": {"url": "http://10.0.0.9:9100", "timeout_ms": 50},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}},
        }));
        let (mut life, _) = send(&app, "/v1/completions", &tokens());
        let mut out = Vec::new();
        life.on_dispatched(&app, Ok(7), &mut out);
        let body = answer(json!({"A": {"matched_tokens": 2048, "ranks": {"0": 16, "1": 2048}}}));
        life.on_callout_answer(&app, 7, Some(200), &mut || body.clone(), &mut out);
        let actions = visible(&mut out);
        assert_eq!(upstream(&actions), Some("sgl_A"), "{actions:?}");
        assert_eq!(body_of(&actions, &tokens()).unwrap()["routed_dp_rank"], 1);
        let notice = actions.iter().find_map(|a| match a {
            Action::Notify(n) => serde_json::from_slice::<Value>(n.body.as_deref().unwrap()).ok(),
            _ => None,
        });
        assert_eq!(notice.unwrap()["dp_rank"], 1);

        let (mut p, mut d) = (engine("P", 1, "prefill"), engine("D", 2, "decode"));
        p["dp_size"] = json!(2);
        d["dp_size"] = json!(2);
        let app = self::app(json!({
            "workers": [p, d],
            "prefix_index": {"url": "http://10.0.0.9:9100", "timeout_ms": 50},
            "models": {"m": {"buckets": [{"id": "pd", "groups": {"pd": {
                "prefill": {"policy": {"type": "cache_aware", "source": "remote"}},
                "decode": {"policy": {"type": "round_robin"}},
            }}}]}},
        }));
        let (mut life, _) = send(&app, "/v1/completions", &tokens());
        life.on_dispatched(&app, Ok(7), &mut out);
        let body = answer(json!({"P": {"matched_tokens": 2048, "ranks": {"1": 2048}}}));
        life.on_callout_answer(&app, 7, Some(200), &mut || body.clone(), &mut out);
        let actions = visible(&mut out);
        let decode_body = body_of(&actions, &tokens()).unwrap();
        let prefill = actions.iter().find_map(|a| match a {
            Action::Dispatch(r) => serde_json::from_slice::<Value>(r.body.as_deref().unwrap()).ok(),
            _ => None,
        });
        let prefill = prefill.unwrap();
        assert_eq!(prefill["routed_dp_rank"], 1, "{prefill}");
        assert!(decode_body.get("routed_dp_rank").is_none(), "{decode_body}");
        assert_eq!(prefill["bootstrap_room"], decode_body["bootstrap_room"], "one room for both");
    }

    #[test]
    fn waiting_for_the_indexer_is_a_state_its_answer_routes_and_is_noticed() {
        let app = indexed_app(8);
        let (mut life, actions) = send(&app, "/v1/completions", &tokens());
        let [Action::Dispatch(call)] = &actions[..] else { panic!("one callout and a wait: {actions:?}") };
        assert_eq!((call.path.as_str(), call.cluster.as_str()), ("/query", "sgl_indexer"));
        let mut out = Vec::new();
        life.on_dispatched(&app, Ok(7), &mut out);
        assert!(visible(&mut out).is_empty(), "still waiting");
        life.on_request_body(&app, 1, true, &mut |_| unreachable!(), &mut out);
        assert!(visible(&mut out).is_empty(), "held while waiting");
        life.on_callout_answer(&app, 8, Some(200), &mut || unreachable!("not ours"), &mut out);
        assert!(visible(&mut out).is_empty(), "another token is ignored");
        let body = answer(json!({"B": {"matched_tokens": 2048}}));
        life.on_callout_answer(&app, 7, Some(200), &mut || body.clone(), &mut out);
        let actions = visible(&mut out);
        assert_eq!(upstream(&actions), Some("sgl_B"), "the holder: {actions:?}");
        let notice = actions.iter().find_map(|a| match a {
            Action::Notify(n) => Some(n),
            _ => None,
        });
        assert_eq!(notice.map(|n| n.path.as_str()), Some("/v1/prefix/routed"));
        assert_eq!(actions.last(), Some(&Action::Proceed), "resumed");
        assert_eq!(app.handles().inflight.local_load("B").prefilled_total, 0, "all of it cached");
    }

    /// Two replicas: the first refuses the callout, the second is asked within the same budget
    /// and its answer routes; the notice goes to both, and their answers are counted per replica.
    #[test]
    fn a_replica_that_cannot_answer_hands_the_question_to_the_next() {
        let app = app(json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "prefix_index": {"urls": ["http://10.0.0.9:9100", "http://10.0.0.9:9101"], "timeout_ms": 50},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}},
        }));
        let (mut life, actions) = send(&app, "/v1/completions", &tokens());
        let [Action::Dispatch(first)] = &actions[..] else { panic!("{actions:?}") };
        assert_eq!(first.cluster, "sgl_indexer");
        let mut out = Vec::new();
        let mut counted: Vec<String> = Vec::new();
        let keep = |out: &Actions, counted: &mut Vec<String>| {
            for a in out {
                if let Action::Count(bumps) = a {
                    counted.extend(bumps.keys().map(Counter::name));
                }
            }
        };
        life.on_dispatched(&app, Ok(7), &mut out);
        life.on_callout_answer(&app, 7, Some(503), &mut Vec::new, &mut out);
        keep(&out, &mut counted);
        let actions = visible(&mut out);
        let [Action::Dispatch(second)] = &actions[..] else { panic!("asks the next: {actions:?}") };
        assert_eq!(second.cluster, "sgl_indexer_1");
        assert!(second.timeout_ms <= 50);
        life.on_dispatched(&app, Ok(8), &mut out);
        let body = answer(json!({"B": {"matched_tokens": 2048}}));
        life.on_callout_answer(&app, 8, Some(200), &mut || body.clone(), &mut out);
        keep(&out, &mut counted);
        let actions = visible(&mut out);
        assert_eq!(upstream(&actions), Some("sgl_B"), "{actions:?}");
        let notices: Vec<&str> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Notify(n) => Some(n.cluster.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(notices, ["sgl_indexer", "sgl_indexer_1"]);
        life.on_notice_dispatched(&app, "sgl_indexer", Ok(20));
        life.on_notice_dispatched(&app, "sgl_indexer_1", Err("refused".into()));
        life.on_callout_answer(&app, 20, Some(204), &mut Vec::new, &mut out);
        keep(&out, &mut counted);
        counted.extend(app.handles().counters.take(0).into_keys().map(|c| c.name()));
        for name in [
            "sgl_router_indexer_failovers_total.indexer.sgl_indexer",
            "sgl_router_indexer_queries_total.indexer.sgl_indexer_1",
            "sgl_router_indexer_notices_total.indexer.sgl_indexer.result.sent",
            "sgl_router_indexer_notices_total.indexer.sgl_indexer_1.result.failed",
        ] {
            assert!(counted.iter().any(|c| c == name), "{name} in {counted:?}");
        }
    }

    #[test]
    fn an_indexer_that_times_out_or_is_never_reached_leaves_routing_to_load() {
        let app = indexed_app(8);
        let (mut life, _) = send(&app, "/v1/completions", &tokens());
        let mut out = Vec::new();
        life.on_dispatched(&app, Ok(1), &mut out);
        life.on_callout_answer(&app, 1, None, &mut Vec::new, &mut out);
        let actions = visible(&mut out);
        assert!(upstream(&actions).is_some() && actions.last() == Some(&Action::Proceed), "{actions:?}");

        let (mut life, _) = send(&app, "/v1/completions", &tokens());
        life.on_dispatched(&app, Err("no cluster".into()), &mut out);
        let actions = visible(&mut out);
        assert!(upstream(&actions).is_some() && actions.last() == Some(&Action::Proceed), "{actions:?}");
    }

    /// A client that leaves while its request waits gives its indexer slot back at once; a late
    /// answer finds nothing to route.
    #[test]
    fn a_client_gone_while_the_indexer_is_asked_frees_its_slot() {
        let app = indexed_app(1);
        let (mut first, actions) = send(&app, "/v1/completions", &tokens());
        assert!(matches!(actions[..], [Action::Dispatch(_)]));
        let mut out = Vec::new();
        first.on_dispatched(&app, Ok(1), &mut out);
        let (mut second, actions) = send(&app, "/v1/completions", &tokens());
        assert!(upstream(&actions).is_some(), "over the cap: routed on load at once");
        second.on_end(&app, &mut out);
        first.on_end(&app, &mut out);
        assert!(
            matches!(visible(&mut out)[..], [Action::Detach(..)]),
            "the routed one is aborted, the waiting one not"
        );
        first.on_callout_answer(&app, 1, Some(200), &mut || unreachable!(), &mut out);
        assert!(visible(&mut out).is_empty(), "ended: the late answer is ignored");
        let (_, actions) = send(&app, "/v1/completions", &tokens());
        assert!(matches!(actions[..], [Action::Dispatch(_)]), "the slot came back");
    }

    fn pd_send(app: &AppContext) -> (RequestLife, Vec<Action>) {
        let (life, actions) = send(app, "/v1/chat/completions", CHAT);
        assert_eq!(upstream(&actions), Some("sgl_D"));
        (life, actions)
    }

    /// A field no JSON tree holds (`1e400`, which validation skips as an unknown field) reaches
    /// both PD engines as sent, with the fields the filter sets; the bytes are never encoded again.
    #[test]
    fn a_body_no_tree_can_hold_goes_to_both_pd_engines_as_sent() {
        let app = pd_app();
        let body = br#"{"model": "m", "x": 1e400, "rid": null, "messages": [{"role": "user", "content": "hi"}]}"#;
        let (_, actions) = send(&app, "/v1/chat/completions", body);
        let [_, Action::ClearRouteCache, _, Action::ReplaceRequestBody { body: decode, .. }, Action::Dispatch(prefill)] =
            &actions[..]
        else {
            panic!("{actions:?}")
        };
        for sent in [decode.as_slice(), prefill.body.as_deref().map_or(&[][..], Vec::as_slice)] {
            let text = String::from_utf8_lossy(sent);
            assert!(text.contains(r#""x": 1e400, "rid": "sgl-"#), "{text}");
            assert!(text.contains(r#""messages": [{"role": "user", "content": "hi"}]}"#), "{text}");
            for field in ["\"bootstrap_host\":", "\"bootstrap_port\":", "\"bootstrap_room\":"] {
                assert_eq!(text.matches(field).count(), 1, "{field} in {text}");
            }
        }
    }

    #[test]
    fn a_pd_request_rewrites_the_body_dispatches_the_prefill_and_holds_the_decode_answer() {
        let app = pd_app();
        let (mut life, actions) = pd_send(&app);
        let [_, Action::ClearRouteCache, Action::SetRequestHeader(length, n), Action::ReplaceRequestBody { size, body }, Action::Dispatch(prefill)] =
            &actions[..]
        else {
            panic!("{actions:?}")
        };
        assert_eq!((length.as_str(), n.clone(), *size), ("content-length", body.len().to_string(), CHAT.len()));
        assert_eq!(prefill.body.as_ref(), Some(body), "one body for both engines");
        assert_eq!(prefill.cluster, "sgl_P");
        assert!(prefill.headers.contains(&("authorization".into(), "Bearer t".into())), "end-to-end headers go on");
        let rewritten: Value = serde_json::from_slice(body).unwrap();
        assert!(rewritten["bootstrap_room"].is_u64());
        let mut out = Vec::new();
        life.on_dispatched(&app, Ok(5), &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed]);
        assert_eq!((inflight(&app, "P"), inflight(&app, "D")), (1, 1));
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        let actions = visible(&mut out);
        assert!(actions.contains(&Action::SetResponseHeader("x-sgl-prefill-worker", "P".into())));
        assert!(!actions.contains(&Action::Proceed), "held until the prefill answered");
        life.on_response_body(false, &mut out);
        assert!(visible(&mut out).is_empty(), "the body is held too");
        life.on_callout_answer(&app, 5, Some(200), &mut || unreachable!("not read"), &mut out);
        assert_eq!(visible(&mut out), [Action::ResumeResponse]);
        assert_eq!(inflight(&app, "P"), 0, "the prefill slot is given back when it answers");
        life.on_end(&app, &mut out);
        assert_eq!(inflight(&app, "D"), 0);
    }

    #[test]
    fn a_failed_prefill_answers_502_whether_it_fails_to_send_or_answers_badly() {
        let app = pd_app();
        let (mut life, _) = pd_send(&app);
        let mut out = Vec::new();
        life.on_dispatched(&app, Err("unknown cluster".into()), &mut out);
        assert_eq!(reply_status(&visible(&mut out)), Some(502));
        assert_eq!((inflight(&app, "P"), inflight(&app, "D")), (0, 0), "nothing was dispatched");

        let (mut life, _) = pd_send(&app);
        life.on_dispatched(&app, Ok(9), &mut out);
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        out.clear();
        life.on_callout_answer(&app, 9, Some(500), &mut || unreachable!(), &mut out);
        assert_eq!(reply_status(&visible(&mut out)), Some(502));
        life.on_response_headers(&app, Some(502), false, &mut || None, &mut out);
        assert_eq!(visible(&mut out), [Action::Proceed], "the filter's reply is not the engine's");
        life.on_end(&app, &mut out);
        assert_eq!((inflight(&app, "P"), inflight(&app, "D")), (0, 0));
    }

    /// The client goes away while the prefill is out: both slots are given back at the end.
    #[test]
    fn a_client_gone_during_the_prefill_releases_both_engines() {
        let app = pd_app();
        let (mut life, _) = pd_send(&app);
        let mut out = Vec::new();
        life.on_dispatched(&app, Ok(3), &mut out);
        out.clear();
        life.on_end(&app, &mut out);
        assert_eq!((inflight(&app, "P"), inflight(&app, "D")), (0, 0));
        // The glue reports each abort's dispatch: the decode one sent, the prefill one not.
        let mut reported = Vec::new();
        for a in &out {
            if let Action::Detach(_, stage) = a {
                let sent = if *stage == Role::Decode { Ok(9) } else { Err("no cluster".to_string()) };
                life.on_detached(*stage, sent, &mut reported);
            }
        }
        out.extend(reported);
        let mut counted: Vec<String> = app.handles().counters.take(0).into_keys().map(|c| c.name()).collect();
        for a in &out {
            if let Action::Count(bumps) = a {
                counted.extend(bumps.keys().map(Counter::name));
            }
        }
        let aborts = aborts(&mut out);
        assert_eq!(aborts.len(), 2, "decode and the prefill still out: {aborts:?}");
        assert_eq!((aborts[0].0.as_str(), aborts[1].0.as_str()), ("sgl_D", "sgl_P"));
        assert_eq!(aborts[0].1, aborts[1].1, "one id at both engines");
        assert!(aborts[0].1.starts_with("sgl-"), "drawn: the test sends no x-request-id");
        assert!(counted.contains(&"sgl_router_aborts_total.stage.decode".to_string()), "{counted:?}");
        assert!(counted.contains(&"sgl_router_aborts_unsent_total.stage.prefill".to_string()), "{counted:?}");
        assert!(!counted.contains(&"sgl_router_aborts_total.stage.prefill".to_string()), "{counted:?}");
        life.on_callout_answer(&app, 3, Some(200), &mut || unreachable!(), &mut out);
        assert!(visible(&mut out).is_empty());
    }

    /// With retries the request goes to the engines cluster naming its engine and the fallback
    /// the same policy chose; when Envoy answers from the fallback, it has the request's slot,
    /// names it to the client, and the retry is counted.
    #[test]
    fn a_request_names_its_fallback_and_moves_to_it_when_envoy_retried() {
        let app = app(json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain"), engine("C", 3, "plain")],
            "retry": {"attempts": 1},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {"type": "round_robin"}}}}]}},
        }));
        let (mut life, actions) = send(&app, "/v1/chat/completions", CHAT);
        let headers: Vec<(&str, &str)> = actions
            .iter()
            .filter_map(|a| match a {
                Action::SetRequestHeader(k, v) if k != "content-length" => Some((k.as_str(), v.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(
            headers,
            [("x-sgl-cluster", "sgl_engines"), ("x-sgl-endpoint", "10.0.0.1:1,10.0.0.1:2")],
            "A, then the next in the rotation; one fallback, as many as the route retries"
        );
        assert_eq!((inflight(&app, "A"), inflight(&app, "B")), (1, 0));
        let mut out = Vec::new();
        life.on_response_headers(&app, Some(200), false, &mut || Some("10.0.0.1:2".into()), &mut out);
        let mut counted: Vec<String> = Vec::new();
        for a in &out {
            if let Action::Count(bumps) = a {
                counted.extend(bumps.keys().map(Counter::name));
            }
        }
        counted.extend(app.handles().counters.take(0).into_keys().map(|c| c.name()));
        assert!(counted.contains(&"sgl_router_retries_total.stage.plain".to_string()), "{counted:?}");
        assert!(visible(&mut out).contains(&Action::SetResponseHeader("x-sgl-worker", "B".into())));
        assert_eq!((inflight(&app, "A"), inflight(&app, "B")), (0, 1), "the slot moved with the request");
        life.on_end(&app, &mut out);
        let aborted: Vec<String> = aborts(&mut out).into_iter().map(|(cluster, _)| cluster).collect();
        assert_eq!(aborted, ["sgl_B"], "the abort goes where the request is");
        let (_, second) = send(&app, "/v1/chat/completions", CHAT);
        assert!(
            second.contains(&Action::SetRequestHeader("x-sgl-endpoint".into(), "10.0.0.1:2,10.0.0.1:3".into())),
            "the rotation went on from A, not from the fallback: {second:?}"
        );
    }

    /// (cluster, rid) of each abort among `out`.
    fn aborts(out: &mut Actions) -> Vec<(String, String)> {
        visible(out)
            .into_iter()
            .filter_map(|a| match a {
                Action::Detach(r, _) if r.path == "/abort_request" => {
                    let body: Value = serde_json::from_slice(r.body.as_deref()?).ok()?;
                    Some((r.cluster, body["rid"].as_str()?.to_string()))
                }
                _ => None,
            })
            .collect()
    }

    /// A stream that ends after its response completed aborts nothing; one cut before (the
    /// client gone mid-stream) aborts its engine by the id the filter wrote over the client's
    /// `rid`, and once the prefill answered, only the decode engine is told.
    #[test]
    fn only_an_incomplete_stream_is_aborted_by_its_id() {
        let app = plain_app();
        let body = br#"{"model": "m", "rid": "client-7", "messages": [{"role": "user", "content": "hi"}]}"#;
        let (mut life, actions) = send(&app, "/v1/chat/completions", body);
        let rid = body_of(&actions, body).and_then(|b| b["rid"].as_str().map(str::to_string)).unwrap_or_default();
        assert!(rid.starts_with("sgl-"), "the filter's own id, over the client's: {rid}");
        let mut out = Vec::new();
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        life.on_response_body(false, &mut out);
        life.on_response_body(true, &mut out);
        life.on_end(&app, &mut out);
        assert!(aborts(&mut out).is_empty(), "complete");

        let (mut life, _) = send(&app, "/v1/chat/completions", body);
        life.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        life.on_response_body(false, &mut out);
        life.on_end(&app, &mut out);
        let sent = aborts(&mut out);
        assert_eq!(sent.len(), 1);
        assert_ne!(sent[0].1, "client-7", "another request's id is never aborted");
        assert!(sent[0].1.starts_with("sgl-") && sent[0].1 != rid, "each request its own id");

        let pd = pd_app();
        let (mut life, _) = pd_send(&pd);
        life.on_dispatched(&pd, Ok(4), &mut out);
        life.on_callout_answer(&pd, 4, Some(200), &mut || unreachable!(), &mut out);
        life.on_response_headers(&pd, Some(200), false, &mut || None, &mut out);
        life.on_end(&pd, &mut out);
        let sent = aborts(&mut out);
        assert_eq!(sent.iter().map(|(c, _)| c.as_str()).collect::<Vec<_>>(), ["sgl_D"], "the prefill was done");
    }

    /// Two cache-aware engines on `memory`, and the service's prefix log that publishes there.
    fn cached_app(memory: &Arc<MemoryHost>) -> (AppContext, crate::state::prefix::PrefixLog) {
        cached_app_on(memory, 1)
    }

    fn cached_app_on(memory: &Arc<MemoryHost>, vm: u64) -> (AppContext, crate::state::prefix::PrefixLog) {
        use crate::state::prefix::{Budgets, PrefixLog};
        let config = json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "retry": {"attempts": 0},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {
                "type": "cache_aware", "hold_for_prefix": true}}}}]}},
        });
        let config = parse_and_validate(&config.to_string()).unwrap();
        let (handles, _) = filter_handles(&config, Arc::clone(memory) as Arc<dyn Host>, vm);
        let log = PrefixLog::new(Budgets([("m".to_string(), 1 << 20)].into_iter().collect()));
        log.publish_start(memory.as_ref()).unwrap();
        (AppContext::new(config, handles), log)
    }

    /// A streamed chat whose system prompt is `system` (past the cache-aware minimum when 6 KB).
    fn streamed(system: &str) -> Vec<u8> {
        let messages = [json!({"role": "system", "content": system}), json!({"role": "user", "content": "hi"})];
        json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 4}).to_string().into_bytes()
    }

    fn send_body(app: &AppContext, id: u32, body: &[u8]) -> (RequestLife, Vec<Action>) {
        let mut life = RequestLife::new(None, id);
        let mut out = Vec::new();
        life.on_request_headers(app, headers("POST", "/v1/chat/completions"), false, &mut out);
        out.clear();
        life.on_request_body(app, body.len(), true, &mut |_| body.to_vec(), &mut out);
        let actions = visible(&mut out);
        (life, actions)
    }

    /// Two filter VMs serving on one host, at 1,000 ms.
    fn two_serving_vms(memory: &Arc<MemoryHost>) -> (AppContext, AppContext) {
        memory.set_now_ms(1_000);
        let ((vm1, _), (vm2, _)) = (cached_app_on(memory, 1), cached_app_on(memory, 2));
        for vm in [1, 2] {
            crate::state::vm_registry::heartbeat(memory.as_ref(), vm, memory.now_ms(), true).unwrap();
        }
        (vm1, vm2)
    }

    /// The requests in flight `app` sees on both engines, its own and the other VMs' as last read.
    fn inflight_seen(app: &AppContext) -> u64 {
        ["A", "B"].iter().map(|w| app.handles().inflight.local_load(w).inflight).sum()
    }

    /// With several worker threads, a dispatch is told the other VMs at the sending VM's next
    /// request event past the sync period; one that sends an engine a prompt to prefill, at once,
    /// but at most once a millisecond.
    #[test]
    fn a_dispatch_sending_a_prompt_to_prefill_is_told_the_other_vms_and_the_service_at_once() {
        use crate::state::load_monitor::SYNC_MS;
        let memory = Arc::new(MemoryHost::default());
        let (vm1, vm2) = two_serving_vms(&memory);
        let seen_by_vm2 = || inflight_seen(&vm2);
        let queued = || memory.drain(crate::state::keys::PREFIX_QUEUE).len();
        let (_first, _) = send_body(&vm1, 1, &streamed("hi"));
        assert_eq!(queued(), 1, "nothing was sent before: at once");
        memory.advance_ms(1);
        let (_prompt, _) = send_body(&vm1, 2, &streamed(&"a long shared system prompt ".repeat(220)));
        assert_eq!(queued(), 1, "a prompt to prefill: at once");
        let (_next, _) = send_body(&vm1, 3, &streamed(&"another long system prompt ".repeat(220)));
        assert_eq!(queued(), 0, "a second one within the millisecond waits");
        memory.advance_ms(1);
        let (_turn, _) = send_body(&vm1, 4, &streamed("hello"));
        assert_eq!(queued(), 0, "a few tokens to prefill: at the next event past the period");
        let _ = vm2.sync_shared();
        assert_eq!(seen_by_vm2(), 2, "the first prompt's dispatch with the one before it, not yet the rest");
        let (_last, _) = send_body(&vm1, 5, &streamed(&"a third long system prompt ".repeat(220)));
        assert_eq!(queued(), 1, "a millisecond later: every event held so far");
        memory.advance_ms(SYNC_MS);
        let _ = vm2.sync_shared();
        assert_eq!(seen_by_vm2(), 5);
    }

    /// A request's arrival hands over what its VM owes the others once a period has passed; the
    /// dispatch that follows it in the same millisecond is news all the same.
    #[test]
    fn a_prompt_to_prefill_is_told_at_once_though_its_arrival_just_handed_over_the_rest() {
        use crate::state::load_monitor::SYNC_MS;
        let memory = Arc::new(MemoryHost::default());
        let (vm1, vm2) = two_serving_vms(&memory);
        let seen_by_vm2 = || inflight_seen(&vm2);
        let queued = || memory.drain(crate::state::keys::PREFIX_QUEUE).len();
        let (_first, _) = send_body(&vm1, 1, &streamed("hi"));
        memory.advance_ms(1);
        let (_turn, _) = send_body(&vm1, 2, &streamed("hello"));
        assert_eq!(queued(), 1, "the first at once, the turn held for the period");
        memory.advance_ms(SYNC_MS);
        let (_prompt, _) = send_body(&vm1, 3, &streamed(&"a long shared system prompt ".repeat(220)));
        assert_eq!(queued(), 2, "the turn's event as the prompt arrived, the prompt's after its dispatch");
        let _ = vm2.sync_shared();
        assert_eq!(seen_by_vm2(), 3, "the prompt's dispatch with the two before it");
    }

    /// Work ahead at one engine, unanswered since 1,000 ms; then a system prompt the router sent
    /// there at 1,010 ms. The app, the work ahead, the engine's cluster and a sibling's body.
    fn prefix_behind_work(memory: &Arc<MemoryHost>) -> (AppContext, RequestLife, String, Vec<u8>) {
        use crate::state::prefix::{PrefixEvent, Tier};
        memory.set_now_ms(1_000);
        let (app, mut log) = cached_app(memory);
        let (ahead, actions) = send_body(&app, 1, &streamed("an earlier conversation"));
        let cluster = upstream(&actions).unwrap().to_string();
        let sibling = streamed(&"a long shared system prompt ".repeat(220));
        let text = app.prepare(Endpoint::Chat, sibling.clone(), &|_| None, true).unwrap().request.prompt_text;
        let event = PrefixEvent::Stored {
            model: "m".into(),
            worker: cluster.trim_start_matches("sgl_").into(),
            text: text.as_deref().unwrap().to_string(),
            tier: Tier::Gpu,
            sent_ms: 1_010,
        };
        memory.advance_ms(10);
        log.append(memory.as_ref(), vec![event]).unwrap();
        (app, ahead, cluster, sibling)
    }

    /// SGLang matches its cache when it schedules a request: a sibling sent while the prefix's
    /// first dispatch still waits behind other work would be batched with it and prefill it again.
    #[test]
    fn a_hit_waits_until_its_engine_started_on_the_prefix_then_goes_there() {
        let memory = Arc::new(MemoryHost::default());
        let (app, mut ahead, cluster, sibling) = prefix_behind_work(&memory);
        memory.advance_ms(5);

        let (mut life, actions) = send_body(&app, 2, &sibling);
        assert_eq!(actions, [Action::Park], "held, not sent");
        assert!(life.holding());
        let mut out = Vec::new();
        life.on_turn(&app, &mut |_| sibling.clone(), &mut out);
        assert!(visible(&mut out).is_empty() && life.holding(), "A has not started on it yet");

        ahead.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        ahead.on_response_body(false, &mut out);
        out.clear();
        life.on_turn(&app, &mut |_| sibling.clone(), &mut out);
        let actions = visible(&mut out);
        assert_eq!((upstream(&actions), actions.last()), (Some(cluster.as_str()), Some(&Action::Proceed)));
        assert!(!life.holding());
        assert_eq!(app.waiting().held_count(), 0);
    }

    /// A thousand requests held for one prefix cost a lookup each while its engine has not started
    /// on it: no body is read and nothing is selected. Once it started, each is selected once.
    #[test]
    fn a_thousand_held_requests_are_selected_again_only_once_their_engine_started() {
        let memory = Arc::new(MemoryHost::default());
        let (app, mut ahead, cluster, sibling) = prefix_behind_work(&memory);
        memory.advance_ms(5);
        let mut lives: Vec<RequestLife> = (0..1000)
            .map(|i| {
                let (life, actions) = send_body(&app, 10 + i, &sibling);
                assert_eq!(actions, [Action::Park]);
                life
            })
            .collect();
        let mut reads = 0;
        let mut read = |_| {
            reads += 1;
            sibling.clone()
        };
        let mut out = Vec::new();
        for _ in 0..100 {
            memory.advance_ms(2);
            lives.iter_mut().for_each(|life| life.on_turn(&app, &mut read, &mut out));
        }
        assert!(visible(&mut out).is_empty());
        ahead.on_response_headers(&app, Some(200), false, &mut || None, &mut out);
        ahead.on_response_body(false, &mut out);
        out.clear();
        let mut routed = 0;
        for life in &mut lives {
            life.on_turn(&app, &mut read, &mut out);
            routed += usize::from(upstream(&visible(&mut out)) == Some(cluster.as_str()));
        }
        assert_eq!((reads, routed, app.waiting().held_count()), (1000, 1000, 0));
    }

    /// An engine that never answers the work ahead holds nothing back for long, and a client that
    /// leaves frees its place. Done waiting, the request goes to the other engine: sent where its
    /// prefix has not started, on an engine not seen not to batch, it would prefill it again there.
    #[test]
    fn a_hold_ends_after_its_longest_wait_or_with_its_client() {
        let memory = Arc::new(MemoryHost::default());
        let (app, _ahead, cluster, sibling) = prefix_behind_work(&memory);
        let (mut gone, actions) = send_body(&app, 2, &sibling);
        assert_eq!(actions, [Action::Park]);
        let (mut life, actions) = send_body(&app, 3, &sibling);
        assert_eq!((actions, app.waiting().held_count()), (vec![Action::Park], 2));
        let mut out = Vec::new();
        gone.on_end(&app, &mut out);
        assert_eq!(app.waiting().held_count(), 1, "its client left");

        memory.advance_ms(MAX_HOLD_MS - 1);
        life.on_turn(&app, &mut |_| sibling.clone(), &mut out);
        assert!(life.holding());
        memory.advance_ms(1);
        life.on_turn(&app, &mut |_| sibling.clone(), &mut out);
        let actions = visible(&mut out);
        assert_eq!(actions.last(), Some(&Action::Proceed), "goes regardless");
        assert!(upstream(&actions).is_some_and(|other| other != cluster), "{actions:?}");
        assert_eq!(app.waiting().held_count(), 0);
    }

    /// Two engines that take one request at a time each, no queue, on `memory` as VM `vm`.
    fn capped_app(memory: &Arc<MemoryHost>, vm: u64) -> AppContext {
        let config = json!({
            "workers": [engine("A", 1, "plain"), engine("B", 2, "plain")],
            "retry": {"attempts": 0},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {
                "type": "round_robin", "admission": {"max_inflight_requests": 1}}}}}]}},
        });
        let config = parse_and_validate(&config.to_string()).unwrap();
        let (handles, _) = filter_handles(&config, Arc::clone(memory) as Arc<dyn Host>, vm);
        AppContext::new(config, handles)
    }

    /// Two VMs deciding before either hears of the other's dispatches (within one exchange
    /// period): the cap holds all the same, since each dispatch took a seat.
    #[test]
    fn a_cap_of_one_holds_across_vms_that_have_not_exchanged_counts() {
        let memory = Arc::new(MemoryHost::default());
        memory.set_now_ms(1_000);
        let (vm1, vm2) = (capped_app(&memory, 1), capped_app(&memory, 2));
        let (first, a1) = send_as(&vm1, 1, &[]);
        let (second, a2) = send_as(&vm2, 2, &[]);
        let (_, a3) = send_as(&vm2, 3, &[]);
        let (_, a4) = send_as(&vm1, 4, &[]);
        let (u1, u2) = (upstream(&a1).map(str::to_string), upstream(&a2).map(str::to_string));
        assert!(u1.is_some() && u2.is_some() && u1 != u2, "one request per engine: {a1:?} {a2:?}");
        assert_eq!((reply_status(&a3), reply_status(&a4)), (Some(503), Some(503)), "both engines are full");
        drop(first);
        // Its VM tells the others its count fell (the seat went back as the stream ended).
        memory.advance_ms(crate::state::load_monitor::SYNC_MS);
        let _ = vm1.sync_shared_now();
        // Round robin takes the engine its cursor names or none: within a turn of the rotation
        // the freed engine is taken again.
        let routed: Vec<_> = (5..7).map(|id| send_as(&vm2, id, &[])).collect();
        let to: Vec<Option<String>> = routed.iter().map(|(_, a)| upstream(a).map(str::to_string)).collect();
        assert!(to.contains(&u1) && to.iter().filter(|u| u.is_some()).count() == 1, "{to:?}");
        drop(second);
    }

    /// One engine that takes one request at a time, and a queue; `memory` is the VMs' host.
    fn queued_app(memory: &Arc<MemoryHost>, vm: u64, max_requests: u32) -> AppContext {
        let config = json!({
            "workers": [engine("A", 1, "plain")],
            "retry": {"attempts": 0},
            "queue": {"max_requests": max_requests, "max_wait_ms": 1000,
                "classes": {"standard": {}, "interactive": {"priority": 10}, "batch": {"priority": -10}}},
            "models": {"m": {"buckets": [{"id": "all", "groups": {"plain": {"policy": {
                "type": "round_robin", "admission": {"max_inflight_requests": 1}}}}}]}},
        });
        let config = parse_and_validate(&config.to_string()).unwrap();
        let host: Arc<dyn Host> = Arc::clone(memory) as Arc<dyn Host>;
        let (handles, _) = filter_handles(&config, host, vm);
        AppContext::new(config, handles)
    }

    /// A request with `headers` (name, value) as stream `id`: its life and the body's actions.
    fn send_as(app: &AppContext, id: u32, extra: &[(&str, &str)]) -> (RequestLife, Vec<Action>) {
        send_with(app, id, extra, CHAT)
    }

    fn send_with(app: &AppContext, id: u32, extra: &[(&str, &str)], body: &[u8]) -> (RequestLife, Vec<Action>) {
        let mut life = RequestLife::new(None, id);
        let mut out = Vec::new();
        let mut h = headers("POST", "/v1/chat/completions");
        h.extend(extra.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())));
        life.on_request_headers(app, h, false, &mut out);
        out.clear();
        life.on_request_body(app, body.len(), true, &mut |_| body.to_vec(), &mut out);
        (life, out)
    }

    type Answer = (u16, Value, Vec<(&'static str, String)>);

    fn reply_of(actions: &[Action]) -> Option<Answer> {
        actions.iter().find_map(|a| match a {
            Action::Reply { status, body, headers } => {
                Some((*status, serde_json::from_slice(body).unwrap(), headers.clone()))
            }
            _ => None,
        })
    }

    /// The body is read again from Envoy's buffer when the request is tried: it keeps no copy.
    #[test]
    fn a_refused_request_waits_without_its_body_and_goes_to_the_engine_that_frees() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 8);
        let (mut first, out) = send_as(&app, 1, &[]);
        assert!(out.contains(&Action::Proceed));
        let (mut second, mut out) = send_as(&app, 2, &[]);
        assert_eq!(visible(&mut out), [Action::Park], "no answer: it waits");
        assert!(app.waiting().holds(2));
        let State::Parked(queued) = &second.state else { panic!("{:?}", second.state) };
        assert!(queued.ticket.body.is_none() && queued.ticket.request.prompt_text.is_none());
        assert_eq!(app.waiting().depth("m"), (1, CHAT.len() as u64));
        assert_eq!(app.waiting().turns(), [2]);
        let mut reads = 0;
        let mut read = |_| {
            reads += 1;
            CHAT.to_vec()
        };
        for _ in 0..100 {
            second.on_turn(&app, &mut read, &mut out);
        }
        assert!(visible(&mut out).is_empty(), "still full: it keeps waiting");
        let mut end = Vec::new();
        first.on_end(&app, &mut end);
        memory.advance_ms(30);
        second.on_turn(&app, &mut read, &mut out);
        assert_eq!(reads, 1, "selected again only once room freed, its body read from Envoy's buffer");
        assert_eq!(upstream(&out), Some("sgl_A"));
        assert!(out.contains(&Action::Proceed));
        let waited = out.iter().find_map(|a| match a {
            Action::Observe(name, ms) if name.starts_with("sgl_router_queue_wait_ms") => Some((name.to_string(), *ms)),
            _ => None,
        });
        assert_eq!(waited, Some(("sgl_router_queue_wait_ms.class.standard".to_string(), 30)));
        assert!(!app.waiting().holds(2) && app.waiting().depth("m") == (0, 0));
    }

    #[test]
    fn a_wait_that_runs_out_is_a_429_queue_timeout_with_retry_after() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 8);
        let (_first, _) = send_as(&app, 1, &[]);
        let (mut second, mut out) = send_as(&app, 2, &[("x-sgl-class", "interactive")]);
        out.clear();
        memory.advance_ms(1000);
        assert_eq!(app.waiting().turns(), [2]);
        second.on_turn(&app, &mut |_| CHAT.to_vec(), &mut out);
        let (status, body, headers) = reply_of(&out).unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (429, Some("queue_timeout")));
        assert!(headers.contains(&("retry-after", "1".to_string())));
        assert_eq!(app.waiting().depth("m"), (0, 0));
        let counted = app.sync_shared_now();
        assert_eq!(counted.get(&Counter::QueueRejection(QueueExit::Timeout, "interactive".into())), Some(&1));
    }

    #[test]
    fn a_full_queue_is_a_429_queue_full_and_a_client_that_leaves_frees_its_place() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 1);
        let (_first, _) = send_as(&app, 1, &[]);
        let (mut second, _) = send_as(&app, 2, &[("x-sgl-class", "no-such-class")]);
        let (_third, out) = send_as(&app, 3, &[]);
        let (status, body, headers) = reply_of(&out).unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (429, Some("queue_full")));
        assert!(headers.contains(&("retry-after", "1".to_string())));
        let mut out = Vec::new();
        second.on_end(&app, &mut out);
        assert!(!app.waiting().holds(2) && app.waiting().depth("m") == (0, 0));
        let counted = app.sync_shared_now();
        let standard = || Arc::<str>::from("standard");
        assert_eq!(counted.get(&Counter::QueueRejection(QueueExit::ClientGone, standard())), Some(&1));
        assert_eq!(counted.get(&Counter::QueueRejection(QueueExit::Full, standard())), Some(&1));
        // Gone, it is never dispatched.
        second.on_turn(&app, &mut |_| CHAT.to_vec(), &mut out);
        assert!(visible(&mut out).is_empty());
    }

    #[test]
    fn an_arrival_on_another_vm_waits_behind_and_the_higher_class_goes_first() {
        let memory = Arc::new(MemoryHost::default());
        let (vm1, vm2) = (queued_app(&memory, 1, 8), queued_app(&memory, 2, 8));
        // VMs see each other's counts as of their last exchange: each exchanges here at once.
        let exchange = || {
            memory.advance_ms(10);
            for vm in [1, 2] {
                crate::state::vm_registry::heartbeat(memory.as_ref(), vm, memory.now_ms(), true).unwrap();
            }
            let _ = (vm1.sync_shared_now(), vm2.sync_shared_now());
        };
        exchange();
        let (mut first, _) = send_as(&vm1, 1, &[]);
        exchange();
        let (mut low, _) = send_as(&vm1, 2, &[("x-sgl-class", "standard")]);
        let (mut high, _) = send_as(&vm2, 2, &[("x-sgl-class", "interactive")]);
        assert!(vm2.waiting().holds(2) && vm1.waiting().depth("m").0 == 2);
        let mut out = Vec::new();
        first.on_end(&vm1, &mut out);
        exchange();
        // Room: an arrival on VM 2 does not take it from those waiting.
        let (_late, mut out) = send_as(&vm2, 3, &[("x-sgl-class", "batch")]);
        assert_eq!(visible(&mut out), [Action::Park]);
        // One engine: only the first of those waiting for it is tried, the high one, on VM 2.
        assert_eq!(vm2.waiting().turns(), [2]);
        assert!(vm1.waiting().turns().is_empty());
        high.on_turn(&vm2, &mut |_| CHAT.to_vec(), &mut out);
        assert_eq!(upstream(&out), Some("sgl_A"));
        exchange();
        let mut out = Vec::new();
        assert_eq!(vm1.waiting().turns(), [2]);
        low.on_turn(&vm1, &mut |_| CHAT.to_vec(), &mut out);
        assert!(visible(&mut out).is_empty() && vm1.waiting().holds(2), "full again: the low one waits on");
    }

    /// A short bucket of two engines and a long one of one. A long request waits for the long
    /// engine; a short request that arrives after it goes at once to a short engine with room,
    /// and a short one that finds the short engines full waits, and is not held behind the long
    /// one when a short engine frees.
    #[test]
    fn a_request_waits_only_behind_requests_that_compete_for_its_engines() {
        let memory = Arc::new(MemoryHost::default());
        let config = json!({
            "workers": [engine("S1", 1, "plain"), engine("S2", 2, "plain"), engine("L", 3, "plain")],
            "retry": {"attempts": 0},
            "load": {"source": "none"},
            "queue": {"max_requests": 8, "max_wait_ms": 1000},
            "models": {"m": {"buckets": [
                {"id": "short", "limits": {"max": 100}, "groups": {"plain": {"worker_ids": ["S1", "S2"],
                    "policy": {"type": "load_based", "admission": {"max_inflight_requests": 1}}}}},
                {"id": "long", "groups": {"plain": {"worker_ids": ["L"],
                    "policy": {"type": "round_robin", "admission": {"max_inflight_requests": 1}}}}}]}},
        });
        let config = parse_and_validate(&config.to_string()).unwrap();
        let (handles, _) = filter_handles(&config, Arc::clone(&memory) as Arc<dyn Host>, 1);
        let app = AppContext::new(config, handles);
        let long = format!(
            r#"{{"model": "m", "messages": [{{"role": "user", "content": "{}"}}], "max_tokens": 4}}"#,
            "x".repeat(800)
        );
        let (_l1, out) = send_with(&app, 1, &[], long.as_bytes());
        assert_eq!(upstream(&out), Some("sgl_L"));
        let (mut l2, mut out) = send_with(&app, 2, &[], long.as_bytes());
        assert_eq!(visible(&mut out), [Action::Park], "the long engine is busy");
        let (mut s1, out) = send_as(&app, 3, &[]);
        assert_eq!(upstream(&out), Some("sgl_S1"), "a short engine with room: at once");
        let (_s2, out) = send_as(&app, 4, &[]);
        assert_eq!(upstream(&out), Some("sgl_S2"));
        let (mut s3, mut out) = send_as(&app, 5, &[]);
        assert_eq!(
            visible(&mut out),
            [Action::Park],
            "both short engines busy, and the long one is the long request's"
        );
        assert_eq!(app.waiting().turns(), [2, 5], "each may be tried: the short one on the short engines");
        s1.on_end(&app, &mut out);
        out.clear();
        s3.on_turn(&app, &mut |_| CHAT.to_vec(), &mut out);
        assert_eq!(upstream(&out), Some("sgl_S1"), "passes the long request still waiting");
        l2.on_turn(&app, &mut |_| long.as_bytes().to_vec(), &mut out);
        assert!(app.waiting().holds(2), "the long one still waits for its engine");
    }

    /// Each time the engine frees, the next of those waiting goes: none is left behind.
    #[test]
    fn four_waiting_on_one_engine_are_served_in_turn() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 8);
        let (mut running, _) = send_as(&app, 1, &[]);
        let mut waiting: Vec<RequestLife> = (2..6).map(|id| send_as(&app, id, &[]).0).collect();
        let mut served = 0;
        for _ in 0..8 {
            let mut out = Vec::new();
            running.on_end(&app, &mut out);
            memory.advance_ms(10);
            let mut next = None;
            for _ in 0..8 {
                let turns = app.waiting().turns();
                if turns.is_empty() {
                    break;
                }
                for id in turns {
                    let life = &mut waiting[(id - 2) as usize];
                    let mut out = Vec::new();
                    life.on_turn(&app, &mut |_| CHAT.to_vec(), &mut out);
                    if out.contains(&Action::Proceed) {
                        served += 1;
                        next = Some(id);
                    }
                }
            }
            match next {
                Some(id) => running = std::mem::take(&mut waiting[(id - 2) as usize]),
                None => break,
            }
        }
        assert_eq!((served, app.waiting().depth("m")), (4, (0, 0)));
    }

    /// A full queue of batch requests gives its last place to an interactive arrival; the batch
    /// request that lost it is answered 429 on its next turn, and counted as displaced.
    #[test]
    fn an_interactive_arrival_takes_the_last_place_of_a_full_queue_of_batch_requests() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 2);
        let (_first, _) = send_as(&app, 1, &[]);
        let (_b1, _) = send_as(&app, 2, &[("x-sgl-class", "batch")]);
        let (mut b2, _) = send_as(&app, 3, &[("x-sgl-class", "batch")]);
        let (_late, out) = send_as(&app, 4, &[("x-sgl-class", "batch")]);
        assert_eq!(reply_of(&out).map(|(status, _, _)| status), Some(429), "the same class: full");
        let (_interactive, mut out) = send_as(&app, 5, &[("x-sgl-class", "interactive")]);
        assert_eq!(visible(&mut out), [Action::Park], "it waits, first in line");
        assert!(app.waiting().turns().contains(&3), "the displaced one is woken");
        let mut out = Vec::new();
        b2.on_turn(&app, &mut |_| CHAT.to_vec(), &mut out);
        let (status, body, _) = reply_of(&out).unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (429, Some("queue_full")), "{body}");
        assert_eq!(app.waiting().depth("m").0, 2);
        let counted = app.sync_shared_now();
        assert_eq!(counted.get(&Counter::QueueRejection(QueueExit::Displaced, "batch".into())), Some(&1));
    }

    /// The shared queue that cannot be written is a 503, never a way around it.
    #[test]
    fn a_queue_that_cannot_be_written_is_a_503_not_a_way_past_it() {
        let memory = Arc::new(MemoryHost::default());
        let app = queued_app(&memory, 1, 8);
        let (_first, _) = send_as(&app, 1, &[]);
        memory.contend(Some(&crate::state::keys::waiting_queue("")));
        let (_second, out) = send_as(&app, 2, &[]);
        memory.contend(None);
        let (status, body, _) = reply_of(&out).unwrap();
        assert_eq!((status, body["error"]["type"].as_str()), (503, Some("queue_unavailable")), "{body}");
        let counted = app.sync_shared_now();
        assert_eq!(counted.get(&Counter::QueueRejection(QueueExit::Unavailable, "standard".into())), Some(&1));
    }
}
