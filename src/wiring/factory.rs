//! The wiring's factory: what a validated configuration describes, built. The registry's workers,
//! each model's resolver (buckets, their groups, one policy instance per role group wired to the
//! state handles it reads, design §6), and the small parameter types the state monitors take.
//! Configuration is a leaf; this is the one place that turns it into working parts.

use std::collections::HashMap;
use std::sync::Arc;

use crate::buckets::{Bucket, BucketGroups, BucketResolver, EngineGroup};
use crate::config::{
    AdmissionLimits, CacheSourceKind, CircuitBreakerConfig, GroupConfig, GroupsConfig, HealthConfig, LoadSource,
    ModelConfig, PolicyConfig, RouterConfig, StickyFallback,
};
use crate::host::Host;
use crate::policies::admission::AdmissionGate;
use crate::policies::cache_aware::{CacheAwarePolicy, CacheSource, LocalCacheSource, RemoteCacheSource};
use crate::policies::{
    LoadBasedPolicy, Policy, PowerOfTwoPolicy, RandomPolicy, RandomSource, RoundRobinPolicy, SeededRandom,
    SessionAwarePolicy, SharedCursor, StickyPolicy,
};
use crate::registry::{AllAvailable, Engine, EngineAddress, EngineRegistry, Role, DEFAULT_BOOTSTRAP_PORT};
use crate::state::affinity_store::AffinityStore;
use crate::state::breaker::BreakerSettings;
use crate::state::health::HealthThresholds;
use crate::state::load_monitor::{InflightTable, LoadView, ReportEndpoint, SharedInflight, SharedLoadView, SYNC_MS};
use crate::state::prefix::{Budgets, PrefixOutbox, PrefixReplica};
use crate::state::seats::SeatBook;
use crate::state::vm_registry::Solitude;
use crate::wiring::counters::HeldCounters;

/// The application's shared state, handed to every policy that needs part of it.
#[derive(Debug, Clone)]
pub struct StateHandles {
    /// Backs per-instance policy state (round-robin cursors) with shared data.
    pub host: Arc<dyn Host>,
    pub load: Arc<dyn LoadView>,
    pub inflight: Arc<dyn InflightTable>,
    pub random: Arc<dyn RandomSource>,
    /// Session and routing-key bindings.
    pub affinity: Arc<AffinityStore>,
    /// The prefix index `source: local` cache-aware policies read.
    pub prefixes: Arc<dyn CacheSource>,
    /// The indexer's per-request answer, which `source: remote` policies read.
    pub remote_prefixes: Arc<dyn CacheSource>,
    /// How often the request path looks for a new version of a published table (0: every read).
    pub tables_recheck_ms: u64,
    /// This VM's prefix events, held for the service.
    pub outbox: Arc<PrefixOutbox>,
    /// This VM's counter bumps, held for Envoy's stats.
    pub counters: Arc<HeldCounters>,
    /// Whether this VM is the only filter VM, as its heartbeats find (round-robin cursors read it).
    pub solitude: Arc<Solitude>,
    /// This VM's identity in shared state (its in-flight share, its places in waiting queues).
    pub vm: u64,
    /// Seats at the engines of groups that cap their requests in flight.
    pub seats: Arc<SeatBook>,
}

/// A filter VM's handles over `host`: shared-data views of what the service publishes, this VM's
/// in-flight shares (`vm` names them), and its own prefix replica, returned also on its own because
/// the glue keeps it current between requests.
pub fn filter_handles(config: &RouterConfig, host: Arc<dyn Host>, vm: u64) -> (StateHandles, Arc<LocalCacheSource>) {
    let inflight: Arc<dyn InflightTable> =
        Arc::new(SharedInflight::new(Arc::clone(&host), vm, config.workers.iter().map(|w| w.id.as_str())));
    let prefixes = Arc::new(LocalCacheSource::new(
        Arc::clone(&host),
        PrefixReplica::new(prefix_budgets(config)),
        config.tokens.bytes_per_token,
        Arc::clone(&inflight),
        SYNC_MS,
    ));
    let handles = StateHandles {
        load: Arc::new(SharedLoadView::new(Arc::clone(&host), config.load.stale_after_ms, SYNC_MS)),
        inflight,
        random: Arc::new(SeededRandom::from_host(host.as_ref())),
        affinity: Arc::new(AffinityStore::new(Arc::clone(&host))),
        prefixes: Arc::clone(&prefixes) as Arc<dyn CacheSource>,
        remote_prefixes: Arc::new(RemoteCacheSource),
        // As often as in-flight counts are exchanged: tables are as fresh as the counts beside them.
        tables_recheck_ms: SYNC_MS,
        outbox: Arc::new(PrefixOutbox::new(Arc::clone(&host), SYNC_MS)),
        solitude: Arc::default(),
        counters: Arc::new(HeldCounters::new(SYNC_MS)),
        seats: SeatBook::new(Arc::clone(&host), vm),
        host,
        vm,
    };
    (handles, prefixes)
}

pub type Resolvers = HashMap<String, Arc<BucketResolver>>;

/// The registry's workers, from a validated configuration. A worker whose URL does not parse was
/// already refused by validation, so it is skipped here rather than failing twice.
pub fn workers(config: &RouterConfig) -> Vec<Engine> {
    let shared = config.upstream.shared_cluster();
    let header: Arc<str> = Arc::from(config.upstream.header_name());
    config
        .workers
        .iter()
        .filter_map(|w| {
            let address = EngineAddress::parse(&w.url).ok()?;
            let override_host = shared.and_then(|_| Some((Arc::clone(&header), address.socket()?.to_string())));
            Some(Engine {
                id: w.id.clone(),
                model: w.model.clone(),
                role: w.role,
                cluster: shared.map_or_else(|| w.cluster_name(), str::to_string),
                override_host,
                address,
                bootstrap_port: (w.role == Role::Prefill).then(|| w.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT)),
                dp_size: w.dp_size,
                draining: w.drain,
            })
        })
        .collect()
}

/// The registry as the service sees it: every configured worker, none taken out.
pub fn registry(config: &RouterConfig) -> EngineRegistry {
    EngineRegistry::new(workers(config), Arc::new(AllAvailable))
}

pub fn health_thresholds(config: &HealthConfig) -> HealthThresholds {
    HealthThresholds {
        interval_ms: config.interval_ms,
        failure_threshold: config.failure_threshold,
        success_threshold: config.success_threshold,
    }
}

pub fn breaker_settings(config: &CircuitBreakerConfig) -> BreakerSettings {
    BreakerSettings { failure_threshold: config.failure_threshold, cooldown_ms: config.cooldown_ms }
}

/// The endpoint `load.source` reads; `None` polls nothing.
pub fn report_endpoint(source: LoadSource) -> Option<ReportEndpoint> {
    match source {
        LoadSource::SglangLoads => Some(ReportEndpoint::V1Loads),
        LoadSource::SglangGetLoad => Some(ReportEndpoint::GetLoad),
        LoadSource::Prometheus => Some(ReportEndpoint::Prometheus),
        LoadSource::None => None,
    }
}

/// Every model's resolver: its buckets, their groups, one policy instance per role group.
pub fn build_resolvers(config: &RouterConfig, handles: &StateHandles) -> Resolvers {
    let mut resolvers = HashMap::new();
    for (model, model_config) in &config.models {
        let buckets = model_config
            .buckets
            .iter()
            .map(|b| {
                let group = |g: &GroupConfig, stage: Role| {
                    let site = GroupSite {
                        stage,
                        instance: format!("{model}/{}/{}", b.id, stage.as_str()),
                        model: model_config,
                        bytes_per_token: config.tokens.bytes_per_token,
                        prefill_tokens_per_ms: config.load.prefill_tokens_per_s / 1000.0,
                    };
                    build_group(&site, g, handles)
                };
                let groups = match &b.groups {
                    GroupsConfig::Plain(g) => BucketGroups::Plain(group(g, Role::Plain)),
                    GroupsConfig::Pd(pd) => BucketGroups::Pd {
                        prefill: group(&pd.prefill, Role::Prefill),
                        decode: group(&pd.decode, Role::Decode),
                    },
                };
                Bucket {
                    id: Arc::from(b.id.as_str()),
                    rank: b.rank,
                    min_input: b.limits.min,
                    max_input: b.limits.max,
                    max_context: b.max_context_tokens,
                    groups,
                }
            })
            .collect();
        resolvers.insert(model.clone(), Arc::new(BucketResolver::new(buckets)));
    }
    resolvers
}

/// Where a group sits: its stage, policy instance name and model.
struct GroupSite<'a> {
    stage: Role,
    instance: String,
    model: &'a ModelConfig,
    bytes_per_token: u64,
    prefill_tokens_per_ms: f64,
}

fn build_group(site: &GroupSite<'_>, group: &GroupConfig, handles: &StateHandles) -> EngineGroup {
    let policy = build_policy(site, &group.policy, handles);
    let group_of = match &group.worker_ids {
        None => EngineGroup::new(site.stage, policy),
        Some(ids) => EngineGroup::with_members(site.stage, ids.iter().cloned(), policy),
    };
    group_of.with_seats(group.policy.admission().max_inflight_requests)
}

/// A binding is refreshed at most every tenth of its idle timeout (between 0.1 s and 10 s).
fn touch_resolution(idle_ms: u64) -> u64 {
    (idle_ms / 10).clamp(100, 10_000)
}

/// The same fallback policy with default admission: the owner checks what it returns.
fn fallback_policy(kind: StickyFallback, instance: &str, handles: &StateHandles) -> Box<dyn Policy> {
    let gate = AdmissionGate {
        admission: Arc::new(AdmissionLimits::default()),
        load: Arc::clone(&handles.load),
        inflight: Arc::clone(&handles.inflight),
    };
    match kind {
        StickyFallback::RoundRobin => Box::new(RoundRobinPolicy::new(
            Box::new(SharedCursor::new(
                Arc::clone(&handles.host),
                &format!("{instance}/fallback"),
                Arc::clone(&handles.solitude),
            )),
            gate,
        )),
        StickyFallback::Random => Box::new(RandomPolicy::new(Arc::clone(&handles.random), gate)),
        StickyFallback::PowerOfTwo => Box::new(PowerOfTwoPolicy::new(Arc::clone(&handles.random), gate)),
        StickyFallback::LoadBased => Box::new(LoadBasedPolicy::new(gate)),
    }
}

/// One logical policy instance per role group; `site.instance` names its shared state.
fn build_policy(site: &GroupSite<'_>, config: &PolicyConfig, handles: &StateHandles) -> Arc<dyn Policy> {
    let (instance, model) = (site.instance.as_str(), site.model);
    let gate = AdmissionGate {
        admission: Arc::new(*config.admission()),
        load: Arc::clone(&handles.load),
        inflight: Arc::clone(&handles.inflight),
    };
    match config {
        PolicyConfig::RoundRobin(_) => Arc::new(RoundRobinPolicy::new(
            Box::new(SharedCursor::new(Arc::clone(&handles.host), instance, Arc::clone(&handles.solitude))),
            gate,
        )),
        PolicyConfig::Random(_) => Arc::new(RandomPolicy::new(Arc::clone(&handles.random), gate)),
        PolicyConfig::PowerOfTwo(_) => Arc::new(PowerOfTwoPolicy::new(Arc::clone(&handles.random), gate)),
        PolicyConfig::LoadBased(_) => Arc::new(LoadBasedPolicy::new(gate)),
        PolicyConfig::SessionAware(_) => Arc::new(SessionAwarePolicy::session_aware(
            Arc::clone(&handles.affinity),
            gate,
            Arc::clone(&handles.random),
            touch_resolution(model.session_idle_ms),
        )),
        PolicyConfig::Sticky(c) => Arc::new(StickyPolicy::sticky(
            Arc::clone(&handles.affinity),
            gate,
            fallback_policy(c.fallback, instance, handles),
            touch_resolution(model.sticky_idle_ms),
        )),
        PolicyConfig::CacheAware(c) => Arc::new(CacheAwarePolicy::new(
            (**c).clone(),
            Arc::clone(match c.source {
                CacheSourceKind::Local => &handles.prefixes,
                CacheSourceKind::Remote => &handles.remote_prefixes,
            }),
            gate,
            Arc::clone(&handles.random),
            site.bytes_per_token,
            site.prefill_tokens_per_ms,
        )),
    }
}

/// Each model's prefix-tree budget in bytes: the largest `max_tree_tokens` of its `source: local`
/// cache-aware groups, in the estimator's bytes. Models without one keep no tree (a remote
/// source needs none).
pub fn prefix_budgets(config: &RouterConfig) -> Budgets {
    let mut budgets = HashMap::new();
    for (name, model) in &config.models {
        for c in model.cache_aware_policies().filter(|c| c.source == CacheSourceKind::Local) {
            let bytes = c.max_tree_tokens.saturating_mul(config.tokens.bytes_per_token);
            let entry = budgets.entry(name.clone()).or_insert(0u64);
            *entry = (*entry).max(bytes);
        }
    }
    Budgets(budgets)
}
