//! Serde types of the router configuration (spec §2). Defaults are the spec's; every struct rejects
//! unknown fields so a typo fails at startup instead of being ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::registry::Role;

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// The configuration's place in the order of its versions (spec §8): the service follows the
    /// announced configuration of the highest generation, so a VM reloaded on an older one never
    /// takes it back. `render` and `update` write it; 0 (absent) is unordered: the last announced
    /// is followed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    /// The prefix of every shared-data key and queue this configuration's filter and service use
    /// (spec §10); absent: Envoy's `plugin_name` of the plugin that reads it. Two configurations in
    /// one Envoy with different namespaces never see each other's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Who does the service's work (spec §10).
    #[serde(default, skip_serializing_if = "ServiceConfig::is_default")]
    pub service: ServiceConfig,
    pub workers: Vec<WorkerConfig>,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    #[serde(default)]
    pub load: LoadConfig,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreakerConfig>,
    #[serde(default)]
    pub pd: PdConfig,
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
    #[serde(default)]
    pub tokens: TokensConfig,
    #[serde(default = "defaults::affinity_sweep_ms")]
    pub affinity_sweep_ms: u64,
    #[serde(default)]
    pub debug: DebugConfig,
    /// Retry on another engine (spec §8). Written out only when set, so a configuration rendered
    /// with the default still loads in a build that predates it.
    #[serde(default, skip_serializing_if = "RetryConfig::is_default")]
    pub retry: RetryConfig,
    /// The precise prefix index (spec §7); absent = byte estimate and the in-proxy tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_index: Option<PrefixIndexConfig>,
    /// Flow control (spec §9) for every model without its own; absent = 503 when all are full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueConfig>,
    pub models: BTreeMap<String, ModelConfig>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Who does the service's work: health checks, load polls, the prefix and affinity tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    #[serde(default)]
    pub mode: ServiceMode,
}

impl ServiceConfig {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceMode {
    /// A filter VM elected through a lease, stepping aside while a singleton lives.
    #[default]
    Auto,
    /// The bootstrap service only: filter VMs never take the work.
    Singleton,
    /// A filter VM elected through a lease; a singleton, if one runs, stays idle.
    Embedded,
}

/// The longest namespace: it prefixes every shared-data key.
pub const MAX_NAMESPACE_BYTES: usize = 64;

/// The most requests one model's queue may hold: every VM reads the whole queue on its turns.
pub const MAX_QUEUE_REQUESTS: u32 = 4_096;
/// The longest a request may wait in the queue.
pub const MAX_QUEUE_WAIT_MS: u64 = 600_000;

/// Flow control (spec §9): a request every engine's admission refused waits for capacity.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    /// Waiting requests per model, across every worker thread; beyond: 429 `queue_full`.
    #[serde(default = "defaults::queue_max_requests")]
    pub max_requests: u32,
    /// The wait of a class that names none; beyond: 429 `queue_timeout`.
    #[serde(default = "defaults::queue_max_wait_ms")]
    pub max_wait_ms: u64,
    /// Names the request's class; absent or unknown: `default_class`. Set it at a trusted hop.
    #[serde(default = "defaults::class_header")]
    pub class_header: String,
    #[serde(default = "defaults::default_class")]
    pub default_class: String,
    /// The operator's classes; absent: one, `standard`, at priority 0.
    #[serde(default = "defaults::classes")]
    pub classes: BTreeMap<String, QueueClass>,
    /// Fair share by work between this header's values, within a class. Set it at a trusted hop.
    #[serde(default = "defaults::tenant_header")]
    pub tenant_header: String,
    /// Waiting requests per tenant value; beyond: 429 `queue_full`.
    #[serde(default = "defaults::queue_max_per_tenant")]
    pub max_per_tenant: u32,
}

/// The most classes one queue may name: each is a stats label and a clock in the shared queue.
pub const MAX_QUEUE_CLASSES: usize = 16;
/// Class priorities lie within ±this.
pub const MAX_CLASS_PRIORITY: i32 = 100;

/// One class of requests (spec §9): higher priority goes first; its own longest wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueueClass {
    #[serde(default)]
    pub priority: i32,
    /// Default: the queue's `max_wait_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<u64>,
}

impl QueueConfig {
    /// The class named `name` (a header's value), else the default class: its name and settings.
    pub fn class(&self, name: Option<&str>) -> (&str, QueueClass) {
        let named = name.and_then(|n| self.classes.get_key_value(n));
        let (name, class) = named
            .or_else(|| self.classes.get_key_value(self.default_class.as_str()))
            .map(|(k, c)| (k.as_str(), *c))
            .unwrap_or((self.default_class.as_str(), QueueClass::default()));
        (name, class)
    }

    /// How long a request of `class` may wait.
    pub fn max_wait_ms(&self, class: &QueueClass) -> u64 {
        class.max_wait_ms.unwrap_or(self.max_wait_ms)
    }
}

/// The most retries a request may get: each is one more engine the pick names in advance.
pub const MAX_RETRY_ATTEMPTS: u32 = 4;

/// Retry on another engine (spec §8): a request whose engine refuses the connection or resets
/// before any response header goes to another engine the same policy chose without the failed one.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Default 1 with `upstream.mode: cluster_header`; retries need it (override-host routing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

impl RetryConfig {
    pub fn is_default(&self) -> bool {
        self.attempts.is_none()
    }
}

impl RouterConfig {
    /// How many other engines a request may be sent to after a refused connection.
    pub fn retry_attempts(&self) -> u32 {
        let default = match self.upstream.mode {
            UpstreamMode::ClusterHeader | UpstreamMode::OverrideHost => 1,
            UpstreamMode::OriginalDst => 0,
        };
        self.retry.attempts.unwrap_or(default)
    }

    /// The queue of `model`'s requests, if it has one (its own wins over the top level).
    pub fn queue_for(&self, model: &str) -> Option<&QueueConfig> {
        self.models.get(model).and_then(|m| m.queue.as_ref()).or(self.queue.as_ref())
    }

    /// Whether anything reads the engine model (pending prefill, learned speed): a group's policy
    /// that weighs it ([`PolicyConfig::reads_engine_model`]), or a queue.
    pub fn reads_engine_model(&self) -> bool {
        self.models.keys().any(|m| self.queue_for(m).is_some())
            || self.models.values().flat_map(ModelConfig::policies).any(PolicyConfig::reads_engine_model)
    }

    /// The model SGLang's `POST /generate` (which names none) serves: the only one when there is
    /// one, else the one marked `serve_generate` (spec §3).
    pub fn generate_model(&self) -> Option<&str> {
        let mut models = self.models.iter();
        match (models.next(), models.next()) {
            (Some((name, _)), None) => Some(name),
            _ => self.models.iter().find(|(_, m)| m.serve_generate).map(|(name, _)| name.as_str()),
        }
    }
}

/// Where the indexer is and how long the filter waits for it (spec §7).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixIndexConfig {
    /// The first indexer's Envoy cluster; the i-th of several is `<cluster>_<i>` (`render` emits
    /// one per URL).
    #[serde(default = "defaults::indexer_cluster")]
    pub cluster: String,
    /// One indexer: the one-element form of `urls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Several indexers, each subscribed to every engine: the filter asks them in turn within
    /// `timeout_ms` and sends its routed notices to all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    /// A slower answer counts as unavailable.
    #[serde(default = "defaults::indexer_timeout_ms")]
    pub timeout_ms: u64,
    /// Callouts in flight per Envoy; beyond it a request does not wait, it is unavailable.
    #[serde(default = "defaults::indexer_max_concurrent")]
    pub max_concurrent: u64,
    /// The indexer's key granularity in tokens.
    #[serde(default = "defaults::block_tokens")]
    pub block_tokens: u64,
    /// The header carrying `token` on the filter's routed notices (the indexer's only write path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Which indexer answers: `sgl` (ours: chat bodies and token ids) or `dynamo` (Dynamo's
    /// standalone KV indexer: token ids only, engines named by integer worker ids).
    #[serde(default, skip_serializing_if = "IndexerApi::is_sgl")]
    pub api: IndexerApi,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexerApi {
    #[default]
    Sgl,
    Dynamo,
}

/// One indexer replica as the filter reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexerEndpoint {
    pub cluster: String,
    pub url: String,
}

impl PrefixIndexConfig {
    /// Every configured indexer in the order the filter tries them: `url`, or each of `urls`;
    /// the first takes `cluster`, the i-th `<cluster>_<i>`.
    pub fn endpoints(&self) -> Vec<IndexerEndpoint> {
        self.url
            .iter()
            .chain(&self.urls)
            .enumerate()
            .map(|(i, url)| IndexerEndpoint {
                cluster: if i == 0 { self.cluster.clone() } else { format!("{}_{i}", self.cluster) },
                url: url.clone(),
            })
            .collect()
    }
}

impl IndexerApi {
    pub fn is_sgl(&self) -> bool {
        *self == IndexerApi::Sgl
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub id: String,
    pub url: String,
    pub model: String,
    #[serde(default = "defaults::role")]
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    #[serde(default = "defaults::dp_size")]
    pub dp_size: u32,
    /// The engine's KV-event ZeroMQ PUB endpoint (`tcp://HOST:PORT`); rank r publishes on PORT + r.
    /// Only the indexer reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The engine's replay ROUTER endpoint, for repairing gaps in the event sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<String>,
    /// Draining (spec §8): no new request goes to the worker; those in flight complete.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
}

impl WorkerConfig {
    /// The Envoy cluster of this worker: configured, else `sgl_<id>`.
    pub fn cluster_name(&self) -> String {
        self.cluster.clone().unwrap_or_else(|| format!("sgl_{}", self.id))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamMode {
    #[default]
    ClusterHeader,
    OriginalDst,
    /// One cluster for every engine, whatever builds it (a mesh's EDS included), whose
    /// override-host load-balancing policy reads `header` (spec §10).
    OverrideHost,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    #[serde(default)]
    pub mode: UpstreamMode,
    /// Defaults by mode: `x-sgl-cluster`, else `x-gateway-destination-endpoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `override_host` only: the engines' cluster, which the filter's callouts to engines use
    /// and `render` routes to; default `sgl_engines`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

/// The cluster of every engine in `override_host` mode when `upstream.cluster` names none.
pub const DEFAULT_ENGINES_CLUSTER: &str = "sgl_engines";

impl UpstreamConfig {
    pub fn header_name(&self) -> &str {
        match (&self.header, self.mode) {
            (Some(h), _) => h,
            (None, UpstreamMode::ClusterHeader) => "x-sgl-cluster",
            (None, UpstreamMode::OriginalDst | UpstreamMode::OverrideHost) => "x-gateway-destination-endpoint",
        }
    }

    /// `override_host`: the one cluster every engine is reached through.
    pub fn shared_cluster(&self) -> Option<&str> {
        (self.mode == UpstreamMode::OverrideHost).then(|| self.cluster.as_deref().unwrap_or(DEFAULT_ENGINES_CLUSTER))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSource {
    #[default]
    SglangLoads,
    SglangGetLoad,
    Prometheus,
    None,
}

impl LoadSource {
    pub fn as_str(self) -> &'static str {
        match self {
            LoadSource::SglangLoads => "sglang_loads",
            LoadSource::SglangGetLoad => "sglang_get_load",
            LoadSource::Prometheus => "prometheus",
            LoadSource::None => "none",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    #[serde(default)]
    pub source: LoadSource,
    #[serde(default = "defaults::load_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "defaults::load_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "defaults::stale_after_ms")]
    pub stale_after_ms: u64,
    /// The prefill throughput the router's pending-prefill estimate assumes for an engine that
    /// does not report its prefill counters (tokens per second of one engine).
    #[serde(default = "defaults::prefill_tokens_per_s", skip_serializing_if = "defaults::is_prefill_tokens_per_s")]
    pub prefill_tokens_per_s: f64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            source: LoadSource::default(),
            interval_ms: defaults::load_interval_ms(),
            timeout_ms: defaults::load_timeout_ms(),
            stale_after_ms: defaults::stale_after_ms(),
            prefill_tokens_per_s: defaults::prefill_tokens_per_s(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    #[serde(default = "defaults::health_path")]
    pub path: String,
    #[serde(default = "defaults::health_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "defaults::health_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "defaults::failure_threshold")]
    pub failure_threshold: u32,
    #[serde(default = "defaults::success_threshold")]
    pub success_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            path: defaults::health_path(),
            interval_ms: defaults::health_interval_ms(),
            timeout_ms: defaults::health_timeout_ms(),
            failure_threshold: defaults::failure_threshold(),
            success_threshold: defaults::success_threshold(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakerConfig {
    #[serde(default = "defaults::breaker_failure_threshold")]
    pub failure_threshold: u32,
    #[serde(default = "defaults::breaker_cooldown_ms")]
    pub cooldown_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PdConfig {
    #[serde(default = "defaults::prefill_timeout_ms")]
    pub prefill_timeout_ms: u64,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self { prefill_timeout_ms: defaults::prefill_timeout_ms() }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsConfig {
    #[serde(default)]
    pub request_ms: u64,
    #[serde(default = "defaults::stream_idle_ms")]
    pub stream_idle_ms: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self { request_ms: 0, stream_idle_ms: defaults::stream_idle_ms() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenEstimator {
    #[default]
    Bytes,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TokensConfig {
    #[serde(default)]
    pub estimator: TokenEstimator,
    #[serde(default = "defaults::bytes_per_token")]
    pub bytes_per_token: u64,
}

impl Default for TokensConfig {
    fn default() -> Self {
        Self { estimator: TokenEstimator::Bytes, bytes_per_token: defaults::bytes_per_token() }
    }
}

/// Diagnostics an operator turns on deliberately; all off by default.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DebugConfig {
    /// Adds `x-sgl-vm` (which worker VM decided) to responses.
    #[serde(default)]
    pub vm_header: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(default = "defaults::session_id_header")]
    pub session_id_header: String,
    #[serde(default = "defaults::routing_key_header")]
    pub routing_key_header: String,
    #[serde(default = "defaults::idle_ms")]
    pub session_idle_ms: u64,
    #[serde(default = "defaults::idle_ms")]
    pub sticky_idle_ms: u64,
    /// A Hugging Face `tokenizer.json`; only the indexer reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// A Jinja chat template file, or a `tokenizer_config.json` with a `chat_template`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// SGLang's `POST /generate` names no model: with several models, the one that sets this
    /// serves it (see [`RouterConfig::generate_model`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub serve_generate: bool,
    /// This model's flow control; it wins over the top-level `queue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueConfig>,
    pub buckets: Vec<BucketConfig>,
}

impl ModelConfig {
    /// Every group's policy of this model, in every bucket and role.
    pub fn policies(&self) -> impl Iterator<Item = &PolicyConfig> {
        self.buckets
            .iter()
            .flat_map(|b| match &b.groups {
                GroupsConfig::Plain(g) => vec![g],
                GroupsConfig::Pd(pd) => vec![&pd.prefill, &pd.decode],
            })
            .map(|g| &g.policy)
    }

    /// Every `cache_aware` policy of this model, in every bucket and role.
    pub fn cache_aware_policies(&self) -> impl Iterator<Item = &CacheAwareConfig> {
        self.policies().filter_map(|p| match p {
            PolicyConfig::CacheAware(c) => Some(c.as_ref()),
            _ => None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BucketConfig {
    pub id: String,
    #[serde(default)]
    pub rank: i64,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context_tokens: Option<u64>,
    pub groups: GroupsConfig,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    #[serde(default)]
    pub min: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
}

/// Exactly one plain group, or a prefill and a decode group: a partial or mixed bucket cannot be
/// written down.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum GroupsConfig {
    Plain(GroupConfig),
    Pd(PdGroupsConfig),
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PdGroupsConfig {
    pub prefill: GroupConfig,
    pub decode: GroupConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// `None` = every healthy engine of the model and role; `[]` = none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_ids: Option<Vec<String>>,
    pub policy: PolicyConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PolicyConfig {
    RoundRobin(BasicPolicyConfig),
    Random(BasicPolicyConfig),
    PowerOfTwo(BasicPolicyConfig),
    LoadBased(BasicPolicyConfig),
    SessionAware(BasicPolicyConfig),
    Sticky(StickyPolicyConfig),
    CacheAware(Box<CacheAwareConfig>),
}

impl PolicyConfig {
    /// Whether the policy (or the fallback inside it) weighs an engine's pending prefill and
    /// learned speed: where none does, a dispatch keeps no timing and estimates nothing.
    pub fn reads_engine_model(&self) -> bool {
        match self {
            PolicyConfig::RoundRobin(_) | PolicyConfig::Random(_) => false,
            PolicyConfig::Sticky(s) => matches!(s.fallback, StickyFallback::PowerOfTwo | StickyFallback::LoadBased),
            PolicyConfig::PowerOfTwo(_)
            | PolicyConfig::LoadBased(_)
            | PolicyConfig::SessionAware(_)
            | PolicyConfig::CacheAware(_) => true,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin(_) => "round_robin",
            PolicyConfig::Random(_) => "random",
            PolicyConfig::PowerOfTwo(_) => "power_of_two",
            PolicyConfig::LoadBased(_) => "load_based",
            PolicyConfig::SessionAware(_) => "session_aware",
            PolicyConfig::Sticky(_) => "sticky",
            PolicyConfig::CacheAware(_) => "cache_aware",
        }
    }

    pub fn admission(&self) -> &AdmissionLimits {
        match self {
            PolicyConfig::RoundRobin(c)
            | PolicyConfig::Random(c)
            | PolicyConfig::PowerOfTwo(c)
            | PolicyConfig::LoadBased(c)
            | PolicyConfig::SessionAware(c) => &c.admission,
            PolicyConfig::Sticky(c) => &c.admission,
            PolicyConfig::CacheAware(c) => &c.admission,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BasicPolicyConfig {
    #[serde(default)]
    pub admission: AdmissionLimits,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StickyPolicyConfig {
    #[serde(default)]
    pub admission: AdmissionLimits,
    #[serde(default)]
    pub fallback: StickyFallback,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StickyFallback {
    #[default]
    RoundRobin,
    Random,
    PowerOfTwo,
    LoadBased,
}

/// Absolute per-engine caps (design §4). Unset = not checked; the default admits everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running_requests: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting_requests: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kv_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_prefill_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_inflight_requests: Option<u64>,
}

/// Where a cache-aware policy learns what engines hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheSourceKind {
    #[default]
    Local,
    Remote,
}

/// Cache-aware knobs kept by design §7, with its defaults.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CacheAwareConfig {
    #[serde(default)]
    pub admission: AdmissionLimits,
    /// `local`: the in-proxy tree of past decisions; `remote`: the indexer's precise view.
    #[serde(default)]
    pub source: CacheSourceKind,
    /// Minimum matched prefix, in tokens, for a hit to count.
    #[serde(default = "defaults::min_hit_tokens")]
    pub min_hit_tokens: u64,
    /// Optional gate on matched / input tokens, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_hit_ratio: Option<f64>,
    /// Candidate bounds over prefix holders: at least `min`, `ratio` of the group, at most `max`.
    #[serde(default = "defaults::min_candidates")]
    pub min_candidates: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_candidates: Option<usize>,
    /// A holder with a shorter match wins only when it saves more than this many uncached tokens.
    #[serde(default = "defaults::switch_margin_tokens")]
    pub switch_margin_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pressure_guard: Option<PressureGuard>,
    /// Soft queue gate: engines with more waiting requests are avoided while others exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_queue_limit: Option<u64>,
    /// When every candidate is past the soft gate, the engine with the longest match is kept if its
    /// match covers at least this fraction of the input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturation_floor: Option<f64>,
    #[serde(default = "defaults::min_load_choices")]
    pub min_load_choices: usize,
    /// Budget of the prefix index, in tokens, per model.
    #[serde(default = "defaults::max_tree_tokens")]
    pub max_tree_tokens: u64,
    /// Whether a request whose cached prefix the router sent its engine behind work still unanswered
    /// there waits at the router (at most 1 s) until the engine has answered that work.
    #[serde(default, skip_serializing_if = "HoldForPrefix::is_auto")]
    pub hold_for_prefix: HoldForPrefix,
}

/// When a hit waits for its engine to start on its prefix. Engines that admit every waiting request
/// into one prefill batch and match their cache when they schedule (SGLang's `fcfs`) prefill the
/// prefix again for a request batched with the one that brings it; an engine that prefills one
/// request at a time in arrival order serves it the prefix anyway, and holding it only loses it
/// its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldForPrefix {
    /// On engines whose first bytes showed them batching their prefill.
    #[default]
    Auto,
    Always,
    Never,
}

impl HoldForPrefix {
    fn is_auto(&self) -> bool {
        *self == HoldForPrefix::Auto
    }
}

/// `auto`, `always` or `never`; `true` and `false` are `always` and `never`.
impl<'de> Deserialize<'de> for HoldForPrefix {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Mode;
        impl serde::de::Visitor<'_> for Mode {
            type Value = HoldForPrefix;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("`auto`, `always`, `never`, or a boolean")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<HoldForPrefix, E> {
                Ok(if v { HoldForPrefix::Always } else { HoldForPrefix::Never })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HoldForPrefix, E> {
                match v {
                    "auto" => Ok(HoldForPrefix::Auto),
                    "always" => Ok(HoldForPrefix::Always),
                    "never" => Ok(HoldForPrefix::Never),
                    other => Err(E::unknown_variant(other, &["auto", "always", "never"])),
                }
            }
        }
        deserializer.deserialize_any(Mode)
    }
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            admission: AdmissionLimits::default(),
            source: CacheSourceKind::Local,
            min_hit_tokens: defaults::min_hit_tokens(),
            min_hit_ratio: None,
            min_candidates: defaults::min_candidates(),
            candidate_ratio: None,
            max_candidates: None,
            switch_margin_tokens: defaults::switch_margin_tokens(),
            pressure_guard: None,
            worker_queue_limit: None,
            saturation_floor: None,
            min_load_choices: defaults::min_load_choices(),
            hold_for_prefix: HoldForPrefix::Auto,
            max_tree_tokens: defaults::max_tree_tokens(),
        }
    }
}

/// A prefix holder under more pressure than the least-loaded candidate by these margins loses
/// its preference.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PressureGuard {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_extra_waiting_requests: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_extra_running_requests: Option<u64>,
}

pub(crate) mod defaults {
    use super::Role;

    pub fn queue_max_requests() -> u32 {
        256
    }

    pub fn queue_max_wait_ms() -> u64 {
        5_000
    }

    pub fn class_header() -> String {
        "x-sgl-class".to_string()
    }

    pub fn default_class() -> String {
        "standard".to_string()
    }

    pub fn classes() -> std::collections::BTreeMap<String, super::QueueClass> {
        [(default_class(), super::QueueClass::default())].into_iter().collect()
    }

    pub fn queue_max_per_tenant() -> u32 {
        64
    }

    pub fn tenant_header() -> String {
        "x-sgl-tenant".to_string()
    }

    pub fn role() -> Role {
        Role::Plain
    }
    pub fn dp_size() -> u32 {
        1
    }
    pub fn indexer_cluster() -> String {
        "sgl_indexer".to_string()
    }
    pub fn indexer_timeout_ms() -> u64 {
        50
    }
    pub fn indexer_max_concurrent() -> u64 {
        64
    }
    pub fn block_tokens() -> u64 {
        16
    }
    pub fn load_interval_ms() -> u64 {
        250
    }
    pub fn load_timeout_ms() -> u64 {
        200
    }
    pub fn stale_after_ms() -> u64 {
        2000
    }
    /// A mid-size model's prefill on one current GPU is of this order (tens of thousands of tokens
    /// a second); only the ratio between engines matters when they all assume it.
    pub fn prefill_tokens_per_s() -> f64 {
        20_000.0
    }
    pub fn is_prefill_tokens_per_s(rate: &f64) -> bool {
        *rate == prefill_tokens_per_s()
    }
    pub fn health_path() -> String {
        "/health".to_string()
    }
    pub fn health_interval_ms() -> u64 {
        2000
    }
    pub fn health_timeout_ms() -> u64 {
        1000
    }
    pub fn failure_threshold() -> u32 {
        3
    }
    pub fn success_threshold() -> u32 {
        2
    }
    pub fn breaker_failure_threshold() -> u32 {
        5
    }
    pub fn breaker_cooldown_ms() -> u64 {
        30_000
    }
    pub fn prefill_timeout_ms() -> u64 {
        300_000
    }
    pub fn stream_idle_ms() -> u64 {
        300_000
    }
    pub fn bytes_per_token() -> u64 {
        4
    }
    pub fn affinity_sweep_ms() -> u64 {
        60_000
    }
    pub fn session_id_header() -> String {
        "x-session-id".to_string()
    }
    pub fn routing_key_header() -> String {
        "x-sgl-routing-key".to_string()
    }
    pub fn idle_ms() -> u64 {
        600_000
    }
    pub fn min_hit_tokens() -> u64 {
        1024
    }
    pub fn min_candidates() -> usize {
        2
    }
    pub fn switch_margin_tokens() -> u64 {
        0
    }
    pub fn min_load_choices() -> usize {
        2
    }
    /// Sized for a sidecar: 2M tokens of distinct prefix per model covers the KV caches of a few
    /// engines (a 70–80 GB engine holds a few hundred thousand tokens), and every VM holds a copy
    /// of the tree (the service's, one per Envoy worker thread, the main thread's): what a copy
    /// costs is measured in docs/configuration.md, "Memory".
    pub fn max_tree_tokens() -> u64 {
        1 << 21
    }
}
