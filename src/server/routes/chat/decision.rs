//! From a finished selection to the [`Decision`] the filter carries out: the upstream header, the
//! PD body and prefill callout, the prefix event, the response headers, and the counters.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use super::bucket_loop::{Selection, SelectionFailure};
use super::pd::{bootstrap_body, PdDispatch};
use super::{ChatFacts, Endpoint};
use crate::buckets::BucketPick;
use crate::host::CalloutRequest;
use crate::policies::cache_aware::PrefixMemo;
use crate::policies::{BoxFuture, RandomSource};
use crate::registry::Worker;
use crate::server::metrics::{self, Counter};
use crate::server::upstream::UpstreamHeader;
use crate::server::{ErrorKind, RouteError};
use crate::state::kv_events::remote::IndexerClient;
use crate::state::kv_events::{PrefixEvent, Tier};

/// The engines a request goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Plain(Arc<Worker>),
    Pd { prefill: Arc<Worker>, decode: Arc<Worker> },
}

impl Target {
    /// The engine Envoy's router sends the request to: the plain engine, or the decode engine.
    pub fn upstream(&self) -> &Arc<Worker> {
        match self {
            Target::Plain(w) | Target::Pd { decode: w, .. } => w,
        }
    }

    /// The engine that does the prefill work: the plain engine, or the prefill engine.
    pub fn prefill_work(&self) -> &Arc<Worker> {
        match self {
            Target::Plain(w) | Target::Pd { prefill: w, .. } => w,
        }
    }
}

/// Where the filter sends a request, and what it tells the client about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub bucket_id: Arc<str>,
    pub target: Target,
    /// The upstream header and its value (cluster name or `host:port`, by `upstream.mode`).
    pub upstream_header: (String, String),
    /// PD only: the rewritten body and the prefill callout.
    pub pd: Option<PdDispatch>,
    /// For cache-aware models: the prompt recorded under the chosen plain or prefill engine, sent
    /// to the service once the decision is carried out.
    pub prefix_event: Option<PrefixEvent>,
    /// Fire-and-forget callouts once dispatched: the indexer's routed notice (spec §7).
    pub notices: Vec<CalloutRequest>,
    /// The input tokens the prefill engine does not hold by the request's prefix lookups (all of
    /// them without one): the work its pending-prefill estimate gains.
    pub prefill_tokens: u64,
}

impl Decision {
    /// The headers the filter adds to the response (spec §3), and `x-sgl-vm` when asked for.
    pub fn response_headers(&self, vm: Option<&str>) -> Vec<(&'static str, String)> {
        let mut headers = Vec::with_capacity(4);
        if let Some(vm) = vm {
            headers.push(("x-sgl-vm", vm.to_string()));
        }
        headers.push(("x-sgl-bucket", self.bucket_id.to_string()));
        headers.push(("x-sgl-worker", self.target.upstream().id.clone()));
        if let Target::Pd { prefill, .. } = &self.target {
            headers.push(("x-sgl-prefill-worker", prefill.id.clone()));
        }
        headers
    }
}

/// A finished selection and the counters it bumps.
#[derive(Debug)]
pub struct ChatOutcome {
    pub result: Result<Decision, RouteError>,
    pub counters: Vec<Counter>,
}

/// A selection in progress. Local policies finish on the first poll; a pending one is polled
/// again when the callout it waits for answers.
pub struct PendingChat {
    pub endpoint: Endpoint,
    pub facts: ChatFacts,
    pub(crate) prompt_text: Option<Arc<str>>,
    /// The body as it came, kept only where a PD pick may rewrite it.
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) selection: BoxFuture<'static, Result<Selection, SelectionFailure>>,
    pub(crate) upstream: UpstreamHeader,
    pub(crate) random: Arc<dyn RandomSource>,
    pub(crate) prefill_timeout_ms: u64,
    /// The request's memo, to read the indexer's verdict and handle once selection is done.
    pub(crate) memo: Arc<PrefixMemo>,
    pub(crate) indexer: Option<Arc<IndexerClient>>,
}

impl PendingChat {
    /// Polls the selection. When it is pending, `waiting_on_callouts` says whether any callout it
    /// started is still out: a selection with nothing to wake it can never finish, so it fails.
    pub fn poll(&mut self, waiting_on_callouts: impl FnOnce() -> bool) -> Poll<ChatOutcome> {
        let mut cx = Context::from_waker(Waker::noop());
        let polled = self.selection.as_mut().poll(&mut cx);
        if polled.is_pending() && waiting_on_callouts() {
            return Poll::Pending;
        }
        let verdict = self.memo.indexer_verdict();
        let lookup_counter = verdict.as_ref().map(|(v, _)| Counter::PrefixLookup(v));
        let selection = match polled {
            Poll::Pending => {
                let error =
                    RouteError::new(ErrorKind::InvalidConfiguration, "the selection is waiting, but on no callout");
                let counters = vec![metrics::error_outcome(error.kind)].into_iter().chain(lookup_counter).collect();
                return Poll::Ready(ChatOutcome { counters, result: Err(error) });
            }
            Poll::Ready(Err(failure)) => {
                let counters = metrics::failed(&failure).into_iter().chain(lookup_counter).collect();
                return Poll::Ready(ChatOutcome { counters, result: Err(failure.to_route_error()) });
            }
            Poll::Ready(Ok(selection)) => selection,
        };
        let mut counters = metrics::selected(&selection);
        counters.extend(lookup_counter);
        let (target, pd) = match &selection.pick {
            BucketPick::Plain(p) => (Target::Plain(Arc::clone(&p.worker)), None),
            BucketPick::Pd { prefill, decode } => {
                // Validated as a JSON object already; the rewrite is the one path that needs its tree.
                let body = self.body.take().and_then(|raw| serde_json::from_slice(&raw).ok()).unwrap_or_default();
                let (body, rooms) = bootstrap_body(body, &prefill.worker, self.facts.n, self.random.as_ref());
                let pd = PdDispatch {
                    prefill: Arc::clone(&prefill.worker),
                    path: self.endpoint.path(),
                    body,
                    rooms,
                    prefill_timeout_ms: self.prefill_timeout_ms,
                };
                let target = Target::Pd { prefill: Arc::clone(&prefill.worker), decode: Arc::clone(&decode.worker) };
                (target, Some(pd))
            }
        };
        // Recorded for the engine that does the prefill work, never for a discarded attempt.
        let prefix_event = self.prompt_text.as_ref().map(|text| PrefixEvent::Stored {
            model: self.facts.model.clone(),
            worker: target.prefill_work().id.clone(),
            text: text.to_string(),
            tier: Tier::Gpu,
        });
        // The indexer holds the blocks for the engine that prefills them until its own event says so.
        let notices = match (&self.indexer, verdict) {
            (Some(client), Some((_, Some(handle)))) => vec![client.routed_notice(&handle, &target.prefill_work().id)],
            _ => Vec::new(),
        };
        let prefill_tokens = selection.input_tokens.saturating_sub(self.memo.matched_tokens(&target.prefill_work().id));
        Poll::Ready(ChatOutcome {
            counters,
            result: Ok(Decision {
                prefill_tokens,
                bucket_id: selection.bucket_id,
                upstream_header: self.upstream.for_worker(target.upstream()),
                target,
                pd,
                prefix_event,
                notices,
            }),
        })
    }
}
