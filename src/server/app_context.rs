//! Wiring shared by both roots: the validated configuration, the registry, each model's resolver
//! and the state readers; and the entry point that turns a chat body into a pending selection.

use std::collections::HashSet;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::buckets::{BucketPick, BucketRequest, LiveWorkers};
use crate::config::factory::{build_resolvers, prefix_budgets, Resolvers, StateHandles};
use crate::config::{ConfigErrors, RouterConfig, UpstreamMode};
use crate::state::kv_events::{PrefixEvent, Tier};
use serde_json::{Map, Value};

use crate::policies::{BoxFuture, RandomSource};
use crate::registry::{Worker, WorkerRegistry};
use crate::server::metrics;
use crate::server::routes::chat::pd::{bootstrap_body, PdDispatch};
use crate::server::routes::chat::{self, ChatFacts, Selection, SelectionFailure};
use crate::server::{ErrorKind, RouteError};
use crate::state::breaker::CircuitBreakers;
use crate::state::health::HealthTable;
use crate::state::keys;
use crate::state::shared::VersionedReader;

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
}

/// Where the filter sends a request, and what it tells the client about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub bucket_id: String,
    pub target: Target,
    /// The upstream header and its value (cluster name or `host:port`, by `upstream.mode`).
    pub upstream_header: (String, String),
    /// PD only: the rewritten body and the prefill callout.
    pub pd: Option<PdDispatch>,
    /// For cache-aware models: the prompt recorded under the chosen plain or prefill engine, sent
    /// to the service once the decision is carried out.
    pub prefix_event: Option<PrefixEvent>,
}

/// A finished selection and the counters it bumps.
#[derive(Debug)]
pub struct ChatOutcome {
    pub result: Result<Decision, RouteError>,
    pub counters: Vec<String>,
}

/// How a decision reaches Envoy's router filter.
#[derive(Debug, Clone)]
struct Upstream {
    mode: UpstreamMode,
    header: String,
}

impl Upstream {
    fn header_for(&self, worker: &Worker) -> (String, String) {
        let value = match self.mode {
            UpstreamMode::ClusterHeader => worker.cluster.clone(),
            UpstreamMode::OriginalDst => worker.address.host_port(),
        };
        (self.header.clone(), value)
    }
}

/// A selection in progress. Local policies finish on the first poll; a pending one is polled
/// again when the callout it waits for answers.
pub struct PendingChat {
    pub facts: ChatFacts,
    prompt_text: Option<Arc<str>>,
    body: Option<Map<String, Value>>,
    selection: BoxFuture<'static, Result<Selection, SelectionFailure>>,
    upstream: Upstream,
    random: Arc<dyn RandomSource>,
    prefill_timeout_ms: u64,
}

impl PendingChat {
    pub fn poll(&mut self) -> Poll<ChatOutcome> {
        let mut cx = Context::from_waker(Waker::noop());
        let selection = match self.selection.as_mut().poll(&mut cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(failure)) => {
                return Poll::Ready(ChatOutcome {
                    counters: metrics::failed(&failure),
                    result: Err(failure.to_route_error()),
                })
            }
            Poll::Ready(Ok(selection)) => selection,
        };
        let counters = metrics::selected(&selection);
        let (target, pd) = match &selection.pick {
            BucketPick::Plain(p) => (Target::Plain(Arc::clone(&p.worker)), None),
            BucketPick::Pd { prefill, decode } => {
                let body = self.body.take().unwrap_or_default();
                let (body, rooms) = bootstrap_body(body, &prefill.worker, self.facts.n, self.random.as_ref());
                let pd = PdDispatch {
                    prefill: Arc::clone(&prefill.worker),
                    body,
                    rooms,
                    prefill_timeout_ms: self.prefill_timeout_ms,
                };
                let target = Target::Pd { prefill: Arc::clone(&prefill.worker), decode: Arc::clone(&decode.worker) };
                (target, Some(pd))
            }
        };
        // Recorded for the engine that does the prefill work, never for a discarded attempt.
        let prefix_event = self.prompt_text.as_ref().map(|text| {
            let worker = match &target {
                Target::Plain(w) | Target::Pd { prefill: w, .. } => w.id.clone(),
            };
            PrefixEvent::Stored { model: self.facts.model.clone(), worker, text: text.to_string(), tier: Tier::Gpu }
        });
        Poll::Ready(ChatOutcome {
            counters,
            result: Ok(Decision {
                bucket_id: selection.bucket_id,
                upstream_header: self.upstream.header_for(target.upstream()),
                target,
                pd,
                prefix_event,
            }),
        })
    }
}

pub struct AppContext {
    config: Arc<RouterConfig>,
    workers: Arc<[Arc<Worker>]>,
    resolvers: Resolvers,
    handles: StateHandles,
    health: VersionedReader<HealthTable>,
    unhealthy: Arc<HashSet<String>>,
    breakers: Option<CircuitBreakers>,
    upstream: Upstream,
    /// Models with a cache-aware group: their prompts feed the prefix index.
    prefix_models: HashSet<String>,
    routing_headers: Vec<String>,
    key_headers: Vec<String>,
}

/// Headers a client may never set: the filter's own and every upstream-selection header.
fn routing_headers(upstream_header: &str) -> Vec<String> {
    let mut headers: Vec<String> = [
        "x-sgl-cluster",
        "x-gateway-destination-endpoint",
        "x-sgl-bucket",
        "x-sgl-worker",
        "x-sgl-prefill-worker",
        "x-sgl-vm",
    ]
    .iter()
    .map(|h| h.to_string())
    .collect();
    if !headers.iter().any(|h| h == upstream_header) {
        headers.push(upstream_header.to_string());
    }
    headers
}

impl AppContext {
    /// Builds every policy instance; a configuration the factory cannot build fails here, at
    /// startup, never at request time.
    pub fn new(config: RouterConfig, handles: StateHandles) -> Result<Self, ConfigErrors> {
        let resolvers = build_resolvers(&config, &handles)?;
        let prefix_models = prefix_budgets(&config).0.into_keys().collect();
        let mut key_headers: Vec<String> =
            config.models.values().flat_map(|m| [m.session_id_header.clone(), m.routing_key_header.clone()]).collect();
        key_headers.sort();
        key_headers.dedup();
        let workers: Arc<[Arc<Worker>]> = WorkerRegistry::from_config(&config).all().to_vec().into();
        let upstream_header_name = config.upstream.header_name().to_string();
        let upstream = Upstream { mode: config.upstream.mode, header: config.upstream.header_name().to_string() };
        let breakers = config.circuit_breaker.clone().map(|c| CircuitBreakers::new(Arc::clone(&handles.host), c));
        Ok(Self {
            config: Arc::new(config),
            workers,
            resolvers,
            handles,
            health: VersionedReader::new(keys::HEALTH_TABLE),
            unhealthy: Arc::default(),
            breakers,
            upstream,
            prefix_models,
            routing_headers: routing_headers(&upstream_header_name),
            key_headers,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn handles(&self) -> &StateHandles {
        &self.handles
    }

    /// Headers a client may never set: the filter's own and every upstream-selection header.
    pub fn routing_headers(&self) -> &[String] {
        &self.routing_headers
    }

    /// Every model's session and routing-key header names: read while request headers are readable.
    pub fn key_headers(&self) -> &[String] {
        &self.key_headers
    }

    /// The workers a request may use now: not unhealthy, breaker not open. The health table is
    /// decoded again only when it moved.
    fn live_workers(&mut self) -> LiveWorkers {
        if self.health.refresh(self.handles.host.as_ref()) {
            if let Some(table) = self.health.value() {
                self.unhealthy = Arc::new(table.unhealthy.iter().cloned().collect());
            }
        }
        let open = self.breakers.as_ref().map(CircuitBreakers::unavailable).unwrap_or_default();
        let unavailable = if open.is_empty() {
            Arc::clone(&self.unhealthy)
        } else {
            Arc::new(self.unhealthy.iter().cloned().chain(open).collect())
        };
        LiveWorkers::new(Arc::clone(&self.workers), unavailable)
    }

    /// A request (or prefill callout) was sent to `worker`.
    pub fn on_dispatch(&self, worker: &str) {
        if let Some(b) = &self.breakers {
            b.on_dispatch(worker);
        }
    }

    /// A dispatch to `worker` finished; `ok` is false for a connect error, a timeout or a 5xx.
    pub fn on_dispatch_result(&self, worker: &str, ok: bool) {
        if let Some(b) = &self.breakers {
            b.record(worker, ok);
        }
    }

    /// Prepares a buffered chat body and starts its bucket loop. `header` reads a request header.
    pub fn begin_chat(
        &mut self,
        body: &[u8],
        header: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PendingChat, RouteError> {
        let (facts, parsed) = chat::prepare_with_body(body, self.config.tokens.bytes_per_token)?;
        let (Some(model), Some(resolver)) = (self.config.models.get(&facts.model), self.resolvers.get(&facts.model))
        else {
            return Err(RouteError::new(
                ErrorKind::ModelNotFound,
                format!("model `{}` is not served by this router", facts.model),
            ));
        };
        let key = |name: &str| header(name).filter(|v| !v.is_empty());
        let request = BucketRequest {
            model: facts.model.clone(),
            input_tokens: facts.input_tokens,
            expected_peak_tokens: facts.expected_peak_tokens,
            token_ids: None,
            prompt_text: self.prefix_models.contains(&facts.model).then(|| Arc::from(chat::prompt_text(&parsed))),
            prefix_memo: Arc::default(),
            session_key: key(&model.session_id_header),
            routing_key: key(&model.routing_key_header),
        };
        let resolver = Arc::clone(resolver);
        let live = self.live_workers();
        let prompt_text = request.prompt_text.clone();
        Ok(PendingChat {
            facts,
            prompt_text,
            body: Some(parsed),
            selection: chat::select(resolver, live, request),
            upstream: self.upstream.clone(),
            random: Arc::clone(&self.handles.random),
            prefill_timeout_ms: self.config.pd.prefill_timeout_ms,
        })
    }
}
