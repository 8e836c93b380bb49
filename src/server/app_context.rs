//! Wiring shared by both roots: the validated configuration, the registry, each model's resolver
//! and the state readers; and the entry point that turns a chat body into a pending selection.

use std::collections::HashSet;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::buckets::{BucketPick, BucketRequest, LiveWorkers};
use crate::config::factory::{build_resolvers, Resolvers, StateHandles};
use crate::config::{ConfigErrors, RouterConfig, UpstreamMode};
use crate::policies::BoxFuture;
use crate::registry::{Worker, WorkerRegistry};
use crate::server::routes::chat::{self, ChatFacts, Selection, SelectionFailure};
use crate::server::{ErrorKind, RouteError};
use crate::state::health::HealthTable;
use crate::state::keys;
use crate::state::shared::VersionedReader;

/// The engines a request goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Plain(Arc<Worker>),
    Pd {
        prefill: Arc<Worker>,
        decode: Arc<Worker>,
    },
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
    pub selection: Selection,
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
    selection: BoxFuture<'static, Result<Selection, SelectionFailure>>,
    upstream: Upstream,
}

impl PendingChat {
    pub fn poll(&mut self) -> Poll<Result<Decision, RouteError>> {
        let mut cx = Context::from_waker(Waker::noop());
        match self.selection.as_mut().poll(&mut cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(failure)) => Poll::Ready(Err(failure.to_route_error())),
            Poll::Ready(Ok(selection)) => {
                let target = match &selection.pick {
                    BucketPick::Plain(p) => Target::Plain(Arc::clone(&p.worker)),
                    BucketPick::Pd { prefill, decode } => Target::Pd {
                        prefill: Arc::clone(&prefill.worker),
                        decode: Arc::clone(&decode.worker),
                    },
                };
                Poll::Ready(Ok(Decision {
                    bucket_id: selection.bucket_id.clone(),
                    upstream_header: self.upstream.header_for(target.upstream()),
                    target,
                    selection,
                }))
            }
        }
    }
}

pub struct AppContext {
    config: Arc<RouterConfig>,
    workers: Arc<[Arc<Worker>]>,
    resolvers: Resolvers,
    handles: StateHandles,
    health: VersionedReader<HealthTable>,
    unavailable: Arc<HashSet<String>>,
    upstream: Upstream,
}

impl AppContext {
    /// Builds every policy instance; a configuration the factory cannot build fails here, at
    /// startup, never at request time.
    pub fn new(config: RouterConfig, handles: StateHandles) -> Result<Self, ConfigErrors> {
        let resolvers = build_resolvers(&config, &handles)?;
        let workers: Arc<[Arc<Worker>]> =
            WorkerRegistry::from_config(&config).all().to_vec().into();
        let upstream = Upstream {
            mode: config.upstream.mode,
            header: config.upstream.header_name().to_string(),
        };
        Ok(Self {
            config: Arc::new(config),
            workers,
            resolvers,
            handles,
            health: VersionedReader::new(keys::HEALTH_TABLE),
            unavailable: Arc::default(),
            upstream,
        })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn handles(&self) -> &StateHandles {
        &self.handles
    }

    /// Headers a client may never set: the filter's own and every upstream-selection header.
    pub fn routing_headers(&self) -> Vec<String> {
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
        if !headers.iter().any(|h| h == &self.upstream.header) {
            headers.push(self.upstream.header.clone());
        }
        headers
    }

    /// The workers a request may use now; the health table is decoded again only when it moved.
    fn live_workers(&mut self) -> LiveWorkers {
        if self.health.refresh(self.handles.host.as_ref()) {
            if let Some(table) = self.health.value() {
                self.unavailable = Arc::new(table.unhealthy.iter().cloned().collect());
            }
        }
        LiveWorkers::new(Arc::clone(&self.workers), Arc::clone(&self.unavailable))
    }

    /// Prepares a buffered chat body and starts its bucket loop. `header` reads a request header.
    pub fn begin_chat(
        &mut self,
        body: &[u8],
        header: &dyn Fn(&str) -> Option<String>,
    ) -> Result<PendingChat, RouteError> {
        let facts = chat::prepare(body, self.config.tokens.bytes_per_token)?;
        let (Some(model), Some(resolver)) = (
            self.config.models.get(&facts.model),
            self.resolvers.get(&facts.model),
        ) else {
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
            session_key: key(&model.session_id_header),
            routing_key: key(&model.routing_key_header),
        };
        let resolver = Arc::clone(resolver);
        let live = self.live_workers();
        Ok(PendingChat {
            facts,
            selection: chat::select(resolver, live, request),
            upstream: self.upstream.clone(),
        })
    }
}
