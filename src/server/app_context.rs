//! Wiring shared by both roots: the validated configuration, the registry, the policy instances
//! and the state readers, and the one entry point that turns a chat body into a decision.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::config::{Role, RouterConfig, UpstreamMode};
use crate::host::Host;
use crate::policies::{PickError, PickRequest, Policy, RoundRobinPolicy, SharedCursor};
use crate::registry::{Worker, WorkerRegistry};
use crate::server::routes::chat::{self, ChatFacts};
use crate::server::{ErrorKind, RouteError};
use crate::state::health::HealthTable;
use crate::state::keys;
use crate::state::shared::VersionedReader;

/// Where the filter sends a request, and what it tells the client about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub worker: Arc<Worker>,
    /// The upstream header and its value (cluster name or `host:port`, by `upstream.mode`).
    pub upstream_header: (String, String),
}

pub struct AppContext {
    config: RouterConfig,
    registry: WorkerRegistry,
    host: Arc<dyn Host>,
    /// One rotation per model until the bucket core lands (issue 2/5).
    policies: HashMap<String, RoundRobinPolicy>,
    health: VersionedReader<HealthTable>,
}

impl AppContext {
    pub fn new(config: RouterConfig, host: Arc<dyn Host>) -> Self {
        let registry = WorkerRegistry::from_config(&config);
        let policies = config
            .models
            .keys()
            .map(|model| {
                let cursor = SharedCursor::new(Arc::clone(&host), model);
                (model.clone(), RoundRobinPolicy::new(Box::new(cursor)))
            })
            .collect();
        Self {
            config,
            registry,
            host,
            policies,
            health: VersionedReader::new(keys::HEALTH_TABLE),
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn registry(&self) -> &WorkerRegistry {
        &self.registry
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
        let configured = self.config.upstream.header_name().to_string();
        if !headers.contains(&configured) {
            headers.push(configured);
        }
        headers
    }

    /// Routes one buffered chat body.
    pub fn route_chat(&mut self, body: &[u8]) -> Result<Decision, RouteError> {
        let facts = chat::prepare(body, self.config.tokens.bytes_per_token)?;
        if !self.config.models.contains_key(&facts.model) {
            return Err(RouteError::new(
                ErrorKind::ModelNotFound,
                format!("model `{}` is not served by this router", facts.model),
            ));
        }
        let worker = self.pick_plain(&facts)?;
        let header = self.config.upstream.header_name().to_string();
        let value = match self.config.upstream.mode {
            UpstreamMode::ClusterHeader => worker.cluster.clone(),
            UpstreamMode::OriginalDst => worker.address.host_port(),
        };
        Ok(Decision {
            worker,
            upstream_header: (header, value),
        })
    }

    fn pick_plain(&mut self, facts: &ChatFacts) -> Result<Arc<Worker>, RouteError> {
        let unhealthy: Vec<String> = self
            .health
            .current(self.host.as_ref())
            .map(|t| t.unhealthy.clone())
            .unwrap_or_default();
        let candidates: Vec<Arc<Worker>> = self
            .registry
            .all()
            .iter()
            .filter(|w| w.model == facts.model && w.role == Role::Plain)
            .filter(|w| !unhealthy.contains(&w.id))
            .cloned()
            .collect();
        let policy = self.policies.get(&facts.model).ok_or_else(|| {
            RouteError::new(ErrorKind::InvalidConfiguration, "no policy for this model")
        })?;
        let request = PickRequest {
            model: &facts.model,
            stage: Role::Plain,
            bucket_id: "",
            input_tokens: facts.input_tokens,
            expected_peak_tokens: facts.expected_peak_tokens,
            session_key: None,
            routing_key: None,
        };
        match poll_ready(policy.pick(&candidates, &request)) {
            Some(Ok(pick)) => Ok(pick.worker),
            Some(Err(PickError::NoCandidates)) | None => Err(RouteError::new(
                ErrorKind::NoCandidates,
                format!("no healthy plain engine serves model `{}`", facts.model),
            )),
            Some(Err(PickError::InvalidConfiguration(m))) => {
                Err(RouteError::new(ErrorKind::InvalidConfiguration, m))
            }
        }
    }
}

/// Polls a future once; local policies are always ready.
fn poll_ready<T>(mut future: crate::policies::BoxFuture<'_, T>) -> Option<T> {
    let mut cx = Context::from_waker(Waker::noop());
    match future.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}
