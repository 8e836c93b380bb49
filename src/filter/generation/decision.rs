//! A prepared request ([`Ticket`]) and, from its finished selection, the [`Decision`] the filter
//! carries out: the upstream header, the PD body and prefill callout, the prefix event, the
//! response headers, and the counters.

use std::sync::Arc;

use super::body_edit::{edit_validated, BodyEdit, Member};
use super::bucket_loop::{select, SelectionFailure};
use super::dp_rank::{choose_rank, rank_member};
use super::pd::{bootstrap_members, PdDispatch};
use super::request_id::RequestId;
use super::{Endpoint, RequestFacts};
use crate::buckets::{BucketPick, BucketRequest, BucketResolver};
use crate::filter::indexer::{verdict, IndexerCall, IndexerClient};
use crate::filter::metrics;
use crate::filter::{ErrorKind, RouteError};
use crate::host::CalloutRequest;
use crate::policies::RandomSource;
use crate::protocol::indexer::IndexerAnswer;
use crate::registry::{Engine, LiveEngines, Role};
use crate::state::load_monitor::LoadView;
use crate::state::prefix::{PrefixEvent, Tier};
use crate::state::seats::{SeatBook, Seats};
use crate::wiring::counters::Counter;
use crate::wiring::upstream::UpstreamHeader;

/// The engines a request goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Plain(Arc<Engine>),
    Pd { prefill: Arc<Engine>, decode: Arc<Engine> },
}

impl Target {
    /// The engine Envoy's router sends the request to: the plain engine, or the decode engine.
    pub fn upstream(&self) -> &Arc<Engine> {
        match self {
            Target::Plain(w) | Target::Pd { decode: w, .. } => w,
        }
    }

    /// Envoy sent the request to `engine` instead (a retry).
    pub fn set_upstream(&mut self, engine: Arc<Engine>) {
        match self {
            Target::Plain(w) | Target::Pd { decode: w, .. } => *w = engine,
        }
    }

    /// The engine that does the prefill work: the plain engine, or the prefill engine.
    pub fn prefill_work(&self) -> &Arc<Engine> {
        match self {
            Target::Plain(w) | Target::Pd { prefill: w, .. } => w,
        }
    }

    /// The upstream engine's stage: plain, or decode.
    pub fn upstream_stage(&self) -> Role {
        match self {
            Target::Plain(_) => Role::Plain,
            Target::Pd { .. } => Role::Decode,
        }
    }
}

/// Where the filter sends a request, and what it tells the client about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub bucket_id: Arc<str>,
    pub target: Target,
    /// The headers that route the request: the upstream header (cluster name or `host:port`, by
    /// `upstream.mode`), and with retries the engine's and its fallbacks' addresses.
    pub upstream_headers: Vec<(String, String)>,
    /// The engines Envoy sends the request to, in turn, if the upstream engine refuses it.
    pub fallbacks: Vec<Arc<Engine>>,
    /// PD only: the rewritten body and the prefill callout.
    pub pd: Option<PdDispatch>,
    /// Plain only: the edit that makes the client's body the engine's (its id written, its
    /// data-parallel rank named).
    pub body: Option<BodyEdit>,
    /// The request's id at its engines, which an abort names.
    pub rid: Arc<str>,
    /// For cache-aware models: the prompt recorded under the chosen plain or prefill engine, sent
    /// to the service once the decision is carried out.
    pub prefix_event: Option<PrefixEvent>,
    /// Fire-and-forget callouts once dispatched: the indexer's routed notice (spec §7).
    pub notices: Vec<CalloutRequest>,
    /// The input tokens the prefill engine does not hold by its policy's prefix lookup (all of
    /// them without one): the work its pending-prefill estimate gains.
    pub prefill_tokens: u64,
    /// The client asked for a streamed answer: its first body byte follows the first token.
    pub stream: bool,
    /// A seat at each capped engine named, which its stage takes when dispatched there.
    pub seats: Seats,
}

impl Decision {
    /// The uncached tokens the upstream engine prefills: none when a prefill engine does them.
    pub fn upstream_prefill_tokens(&self) -> u64 {
        match self.target {
            Target::Plain(_) => self.prefill_tokens,
            Target::Pd { .. } => 0,
        }
    }

    /// The upstream's first byte (when it answers 2xx) follows the first token of the engine that
    /// prefilled: a streamed answer of a plain engine. A decode engine's follows another engine's
    /// prefill; a whole answer's follows its decode too.
    pub fn upstream_times_prefill(&self) -> bool {
        self.stream && matches!(self.target, Target::Plain(_))
    }

    /// The headers the filter adds to the response (spec §3).
    pub fn response_headers(&self) -> impl Iterator<Item = (&'static str, String)> + '_ {
        let prefill = match &self.target {
            Target::Pd { prefill, .. } => Some(("x-sgl-prefill-worker", prefill.id.clone())),
            Target::Plain(_) => None,
        };
        [("x-sgl-bucket", self.bucket_id.to_string()), ("x-sgl-worker", self.target.upstream().id.clone())]
            .into_iter()
            .chain(prefill)
    }
}

/// A generation request prepared for selection: its facts, everything selection reads, and what a
/// PD rewrite needs. The indexer's answer, when it is asked, is the last fact to arrive.
#[derive(Debug)]
pub struct Ticket {
    pub endpoint: Endpoint,
    pub facts: RequestFacts,
    pub request: BucketRequest,
    pub(crate) resolver: Arc<BucketResolver>,
    /// The body as it came, for the edits: the request's id, a PD pick's bootstrap fields, a
    /// data-parallel rank. `None` while parked.
    pub(crate) body: Option<Vec<u8>>,
    /// The request's id at its engines.
    pub rid: RequestId,
    /// The indexer's match call, when the request is to ask it.
    pub(crate) indexer_call: Option<IndexerCall>,
}

impl Ticket {
    /// The indexer's match call to make before selection, if any.
    pub fn take_indexer_call(&mut self) -> Option<IndexerCall> {
        self.indexer_call.take()
    }

    /// The indexer's answer becomes a fact of the request: when it counted the input exactly, the
    /// exact length replaces the estimate for bucket resolution (design §2, §6); unavailable keeps
    /// the estimate and leaves cache selection to its load fallback.
    pub fn answered(&mut self, answer: IndexerAnswer) {
        if let Ok(m) = &answer {
            self.request.input_tokens = m.input_tokens;
            self.request.expected_peak_tokens = self.facts.output_budget.map(|b| m.input_tokens.saturating_add(b));
        }
        self.request.indexer = Some(answer);
    }

    /// Drops what Envoy holds anyway (the body) and what is derived from it (the prompt's text and
    /// token ids): a request that waits keeps its facts only, and is prepared again from Envoy's
    /// buffer when it is tried ([`Ticket::resumed`]).
    pub fn park(&mut self) {
        self.body = None;
        self.request.prompt_text = None;
        self.request.token_ids = None;
    }

    /// `fresh`, prepared again from the body, with what this parked ticket learned since it was
    /// first prepared: the indexer's answer, and whether it may still wait for its prefix.
    pub fn resumed(self, mut fresh: Ticket) -> Ticket {
        if let Some(answer) = self.request.indexer {
            fresh.answered(answer);
        }
        fresh.request.prefix_wait_over = self.request.prefix_wait_over;
        fresh
    }

    /// The counter of the indexer's verdict, when it was asked.
    fn lookup_counter(&self) -> Option<Counter> {
        self.request.indexer.as_ref().map(|a| Counter::PrefixLookup(verdict(a)))
    }
}

/// A finished selection: how it ended, and the counters it bumps.
#[derive(Debug)]
pub struct Outcome {
    pub verdict: Verdict,
    pub counters: Vec<Counter>,
}

/// How a selection ended.
#[derive(Debug)]
pub enum Verdict {
    /// A complete decision to carry out.
    Routed(Decision),
    /// Every engine it may take refused it (or, for a request that may wait, none had room): it
    /// may wait for room and be selected again (spec §9); `error` is its answer should it not.
    Refused { ticket: Ticket, error: RouteError },
    /// The engine picked for its cached prefix has not started on the dispatch that sent it
    /// there, and the request may still wait for it ([`BucketRequest::prefix_wait_over`] unset):
    /// it waits at the router and is selected again. Nothing was counted.
    Held { ticket: Ticket, wait: PrefixWait },
    /// Answered with this error.
    Failed(RouteError),
}

/// What a request held for its prefix waits for: `engine` to start on the dispatch that sent it
/// the prefix at `sent_ms`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixWait {
    pub engine: String,
    pub sent_ms: u64,
}

/// What a decision is made with besides the request: the wiring every request shares.
pub struct Wiring<'a> {
    pub live: &'a LiveEngines,
    /// A selection that tried every bucket waits for room, whatever the rejections: `live` leaves
    /// out engines reserved for requests waiting ahead, or the request waits already (spec §9).
    pub exhausted_waits: bool,
    pub upstream: &'a UpstreamHeader,
    pub random: &'a dyn RandomSource,
    pub prefill_timeout_ms: u64,
    pub indexer: Option<&'a IndexerClient>,
    /// Engines' reported load, read only to choose a data-parallel rank.
    pub load: &'a dyn LoadView,
    /// The host clock, for when a prefix was sent.
    pub now_ms: u64,
    /// Seats at the engines of capped groups, exact across VMs.
    pub seats: Option<&'a Arc<SeatBook>>,
}

/// Runs the bucket loop for `ticket` and turns its selection into a [`Decision`].
pub fn decide(mut ticket: Ticket, wiring: &Wiring<'_>) -> Outcome {
    let selection = select(&ticket.resolver, wiring.live, &ticket.request, wiring.seats);
    let lookup_counter = ticket.lookup_counter();
    let selection = match selection {
        Ok(selection) => selection,
        Err(failure) => {
            let counters = metrics::failed(&failure).into_iter().chain(lookup_counter).collect();
            let error = failure.to_route_error();
            let exhausted = matches!(failure, SelectionFailure::Exhausted(_));
            let verdict = if error.kind == ErrorKind::AdmissionRejected || (wiring.exhausted_waits && exhausted) {
                Verdict::Refused { ticket, error }
            } else {
                Verdict::Failed(error)
            };
            return Outcome { verdict, counters };
        }
    };
    // Sent now, it would be scheduled with the dispatch that brings its prefix, and prefill the
    // prefix again: it waits for the engine to start on that one. Nothing was counted yet.
    let (BucketPick::Plain(pick) | BucketPick::Pd { prefill: pick, .. }) = &selection.pick;
    if let (false, Some(sent_ms)) = (ticket.request.prefix_wait_over, pick.prefix_unstarted) {
        let wait = PrefixWait { engine: pick.engine.id.clone(), sent_ms };
        return Outcome { verdict: Verdict::Held { ticket, wait }, counters: Vec::new() };
    }
    let mut counters = metrics::selected(&selection);
    counters.extend(lookup_counter);
    let answered = ticket.request.indexer.as_ref().and_then(|a| a.as_ref().ok());
    // The data-parallel rank of each engine chosen, where it has several (spec §7).
    let hits = answered.map(|m| m.hits.as_slice());
    let mut loads = None;
    let mut rank_of = |engine: &Engine, matched: bool| {
        if engine.dp_size <= 1 {
            return None;
        }
        let ranks = match (matched, hits) {
            (true, Some(hits)) => hits.iter().find(|h| h.engine == engine.id).map(|h| h.ranks.as_slice()),
            _ => None,
        };
        let loads = loads.get_or_insert_with(|| wiring.load.snapshot());
        choose_rank(engine.dp_size, ranks.unwrap_or_default(), loads.get(&engine.id))
    };
    // The client's bytes as validated, with the id written and any PD or rank fields: an edit
    // that cannot be made (only a body validation refused could fail it) is that body's 400.
    let raw = ticket.body.take().unwrap_or_default();
    let edited = |extra: Vec<Member>| {
        let mut members = vec![ticket.rid.member()];
        members.extend(extra);
        edit_validated(&raw, &members).map_err(|e| RouteError::invalid(e.to_string()))
    };
    let built = match &selection.pick {
        BucketPick::Plain(p) => {
            let rank = rank_of(&p.engine, true);
            edited(rank.map(rank_member).into_iter().collect())
                .map(|body| (Target::Plain(Arc::clone(&p.engine)), None, Some(body), rank))
        }
        BucketPick::Pd { prefill, decode } => {
            let prefill_rank = rank_of(&prefill.engine, true);
            // Decode holds no prefix: its own load decides, unless it is the prefill engine.
            let decode_rank =
                if decode.engine.id == prefill.engine.id { prefill_rank } else { rank_of(&decode.engine, false) };
            let (fields, rooms) = bootstrap_members(&prefill.engine, ticket.facts.n, wiring.random);
            let encode = |rank: Option<u32>| {
                let mut members = fields.clone();
                members.extend(rank.map(rank_member));
                edited(members).map(|edit| edit.apply(&raw))
            };
            let bodies = encode(decode_rank).and_then(|body| {
                let prefill_body = if prefill_rank != decode_rank { Some(encode(prefill_rank)?) } else { None };
                Ok((body, prefill_body))
            });
            bodies.map(|(body, prefill_body)| {
                let pd = PdDispatch {
                    prefill: Arc::clone(&prefill.engine),
                    path: ticket.endpoint.path(),
                    body,
                    prefill_body,
                    rooms,
                    prefill_timeout_ms: wiring.prefill_timeout_ms,
                };
                let target = Target::Pd { prefill: Arc::clone(&prefill.engine), decode: Arc::clone(&decode.engine) };
                (target, Some(pd), None, prefill_rank)
            })
        }
    };
    let (target, pd, body, rank) = match built {
        Ok(built) => built,
        Err(error) => return Outcome { verdict: Verdict::Failed(error), counters: Vec::new() },
    };
    // Recorded for the engine that does the prefill work, never for a discarded attempt.
    let prefix_event = ticket.request.prompt_text.as_ref().map(|text| PrefixEvent::Stored {
        model: ticket.facts.model.clone(),
        worker: target.prefill_work().id.clone(),
        text: text.to_string(),
        tier: Tier::Gpu,
        sent_ms: wiring.now_ms,
    });
    // The indexer holds the blocks for the engine that prefills them until its own event says so.
    let handle = answered.and_then(|m| m.handle.as_deref());
    let notices = match (wiring.indexer, handle) {
        (Some(client), Some(handle)) => client.routed_notices(handle, &target.prefill_work().id, rank),
        _ => Vec::new(),
    };
    // Retries go to engines the same group's policy chose, named now: Envoy resends on its own.
    let upstream = target.upstream();
    let fallbacks = if wiring.upstream.retriable(upstream) {
        let eligible = |e: &Engine| wiring.upstream.retriable(e);
        let n = wiring.upstream.retries() as usize;
        selection.bucket.fallbacks(wiring.live, &ticket.request, upstream, n, &eligible)
    } else {
        Vec::new()
    };
    let cached_tokens = match &selection.pick {
        BucketPick::Plain(p) | BucketPick::Pd { prefill: p, .. } => p.cached_tokens,
    };
    Outcome {
        counters,
        verdict: Verdict::Routed(Decision {
            prefill_tokens: selection.input_tokens.saturating_sub(cached_tokens),
            stream: ticket.facts.stream,
            bucket_id: selection.bucket_id,
            upstream_headers: wiring.upstream.for_request(target.upstream(), &fallbacks),
            fallbacks,
            target,
            pd,
            body,
            rid: Arc::clone(&ticket.rid.0),
            prefix_event,
            notices,
            seats: selection.seats,
        }),
    }
}
