//! Builds each model's resolver from a validated configuration: buckets, their groups, and one
//! policy instance per role group wired to the state handles it reads (design §6).

use std::collections::HashMap;
use std::sync::Arc;

use super::{
    AdmissionLimits, ConfigError, ConfigErrors, GroupConfig, GroupsConfig, ModelConfig, PolicyConfig, Role,
    RouterConfig, StickyFallback,
};
use crate::buckets::{Bucket, BucketGroups, BucketResolver, EngineGroup};
use crate::host::Host;
use crate::policies::admission::AdmissionGate;
use crate::policies::cache_aware::{CacheAwarePolicy, CacheSource, LocalCacheSource};
use crate::policies::{
    LeastLoadPolicy, Policy, PowerOfTwoPolicy, RandomPolicy, RandomSource, RoundRobinPolicy, SessionAwarePolicy,
    SharedCursor, StickyPolicy,
};
use crate::state::affinity_store::AffinityStore;
use crate::state::kv_events::{Budgets, PrefixReplica};
use crate::state::load_monitor::{InflightTable, LoadView};

/// The application's shared state, handed to every policy that needs part of it.
#[derive(Debug, Clone)]
pub struct StateHandles {
    /// Backs per-instance policy state (round-robin cursors) with shared data.
    pub host: Arc<dyn Host>,
    pub load: Arc<dyn LoadView>,
    pub inflight: Arc<dyn InflightTable>,
    pub random: Arc<dyn RandomSource>,
    /// For policies that await a remote answer.
    pub callouts: Arc<dyn crate::host::Callouts>,
    /// Session and routing-key bindings.
    pub affinity: Arc<AffinityStore>,
    /// The prefix index cache-aware policies read.
    pub prefixes: Arc<dyn CacheSource>,
}

pub type Resolvers = HashMap<String, Arc<BucketResolver>>;

pub fn build_resolvers(config: &RouterConfig, handles: &StateHandles) -> Result<Resolvers, ConfigErrors> {
    let mut errors = Vec::new();
    let mut resolvers = HashMap::new();
    for (model, model_config) in &config.models {
        let mut buckets = Vec::new();
        for (i, b) in model_config.buckets.iter().enumerate() {
            let group = |part: &str, g: &GroupConfig, stage: Role| {
                let site = GroupSite {
                    path: format!("models.{model}.buckets[{i}].groups.{part}"),
                    stage,
                    instance: format!("{model}/{}/{}", b.id, stage.as_str()),
                    model: model_config,
                    bytes_per_token: config.tokens.bytes_per_token,
                };
                build_group(&site, g, handles)
            };
            let groups = match &b.groups {
                GroupsConfig::Plain(g) => group("plain", g, Role::Plain).map(BucketGroups::Plain),
                GroupsConfig::Pd(pd) => {
                    match (
                        group("pd.prefill", &pd.prefill, Role::Prefill),
                        group("pd.decode", &pd.decode, Role::Decode),
                    ) {
                        (Ok(prefill), Ok(decode)) => Ok(BucketGroups::Pd { prefill, decode }),
                        (Err(p), Err(d)) => {
                            errors.push(p);
                            Err(d)
                        }
                        (Err(e), _) | (_, Err(e)) => Err(e),
                    }
                }
            };
            match groups {
                Ok(groups) => buckets.push(Bucket {
                    id: b.id.clone(),
                    rank: b.rank,
                    min_input: b.limits.min,
                    max_input: b.limits.max,
                    max_context: b.max_context_tokens,
                    groups,
                }),
                Err(e) => errors.push(e),
            }
        }
        resolvers.insert(model.clone(), Arc::new(BucketResolver::new(buckets)));
    }
    if errors.is_empty() {
        Ok(resolvers)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Where a group sits: its field path, stage, policy instance name and model.
pub struct GroupSite<'a> {
    pub path: String,
    pub stage: Role,
    pub instance: String,
    pub model: &'a ModelConfig,
    pub bytes_per_token: u64,
}

fn build_group(site: &GroupSite<'_>, group: &GroupConfig, handles: &StateHandles) -> Result<EngineGroup, ConfigError> {
    let policy = build_policy(site, &group.policy, handles)?;
    Ok(match &group.worker_ids {
        None => EngineGroup::new(site.stage, policy),
        Some(ids) => EngineGroup::with_members(site.stage, ids.iter().cloned(), policy),
    })
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
            Box::new(SharedCursor::new(Arc::clone(&handles.host), &format!("{instance}/fallback"))),
            gate,
        )),
        StickyFallback::Random => Box::new(RandomPolicy::new(Arc::clone(&handles.random), gate)),
        StickyFallback::PowerOfTwo => Box::new(PowerOfTwoPolicy::new(Arc::clone(&handles.random), gate)),
        StickyFallback::LoadBased => Box::new(LeastLoadPolicy::new(gate)),
    }
}

/// One logical policy instance per role group; `site.instance` names its shared state.
pub fn build_policy(
    site: &GroupSite<'_>,
    config: &PolicyConfig,
    handles: &StateHandles,
) -> Result<Arc<dyn Policy>, ConfigError> {
    let (instance, model) = (site.instance.as_str(), site.model);
    let gate = AdmissionGate {
        admission: Arc::new(*config.admission()),
        load: Arc::clone(&handles.load),
        inflight: Arc::clone(&handles.inflight),
    };
    Ok(match config {
        PolicyConfig::RoundRobin(_) => {
            Arc::new(RoundRobinPolicy::new(Box::new(SharedCursor::new(Arc::clone(&handles.host), instance)), gate))
        }
        PolicyConfig::Random(_) => Arc::new(RandomPolicy::new(Arc::clone(&handles.random), gate)),
        PolicyConfig::PowerOfTwo(_) => Arc::new(PowerOfTwoPolicy::new(Arc::clone(&handles.random), gate)),
        PolicyConfig::LoadBased(_) => Arc::new(LeastLoadPolicy::new(gate)),
        PolicyConfig::SessionAware(_) => Arc::new(SessionAwarePolicy::new(
            Arc::clone(&handles.affinity),
            gate,
            Arc::clone(&handles.random),
            touch_resolution(model.session_idle_ms),
        )),
        PolicyConfig::Sticky(c) => Arc::new(StickyPolicy::new(
            Arc::clone(&handles.affinity),
            gate,
            fallback_policy(c.fallback, instance, handles),
            touch_resolution(model.sticky_idle_ms),
        )),
        PolicyConfig::CacheAware(c) => Arc::new(CacheAwarePolicy::new(
            (**c).clone(),
            Arc::clone(&handles.prefixes),
            gate,
            Arc::clone(&handles.random),
            site.bytes_per_token,
        )),
    })
}

/// Each model's prefix-tree budget in bytes: the largest `max_tree_tokens` of its cache-aware
/// groups, in the estimator's bytes. Models without a cache-aware group keep no tree.
pub fn prefix_budgets(config: &RouterConfig) -> Budgets {
    let mut budgets = HashMap::new();
    for (name, model) in &config.models {
        for b in &model.buckets {
            let groups: Vec<&GroupConfig> = match &b.groups {
                GroupsConfig::Plain(g) => vec![g],
                GroupsConfig::Pd(pd) => vec![&pd.prefill, &pd.decode],
            };
            for g in groups {
                if let PolicyConfig::CacheAware(c) = &g.policy {
                    let bytes = c.max_tree_tokens.saturating_mul(config.tokens.bytes_per_token);
                    let entry = budgets.entry(name.clone()).or_insert(0u64);
                    *entry = (*entry).max(bytes);
                }
            }
        }
    }
    Budgets(budgets)
}

/// Everything the filter checks at `on_configure`: validation, then building every policy
/// instance against in-memory state. The CLI's `validate` runs exactly this.
pub fn check(config: &RouterConfig) -> Result<(), ConfigErrors> {
    let host: Arc<dyn Host> = Arc::new(crate::host::MemoryHost::default());
    let handles = StateHandles {
        load: Arc::new(crate::state::load_monitor::StaticLoad::default()),
        inflight: Arc::new(crate::state::load_monitor::MemoryInflight::default()),
        random: Arc::new(crate::policies::SeededRandom::new(0)),
        callouts: Arc::new(crate::host::MemoryCallouts::default()),
        affinity: Arc::new(AffinityStore::new(Arc::clone(&host))),
        prefixes: Arc::new(LocalCacheSource::new(Arc::clone(&host), PrefixReplica::new(prefix_budgets(config)))),
        host,
    };
    build_resolvers(config, &handles).map(|_| ())
}
