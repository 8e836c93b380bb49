//! Builds each model's resolver from a validated configuration: buckets, their groups, and one
//! policy instance per role group wired to the state handles it reads (design §6).

use std::collections::HashMap;
use std::sync::Arc;

use super::{
    ConfigError, ConfigErrors, GroupConfig, GroupsConfig, PolicyConfig, Role, RouterConfig,
};
use crate::buckets::{Bucket, BucketGroups, BucketResolver, EngineGroup};
use crate::host::Host;
use crate::policies::admission::AdmissionGate;
use crate::policies::{
    LeastLoadPolicy, Policy, PowerOfTwoPolicy, RandomPolicy, RandomSource, RoundRobinPolicy,
    SharedCursor,
};
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
}

pub type Resolvers = HashMap<String, Arc<BucketResolver>>;

pub fn build_resolvers(
    config: &RouterConfig,
    handles: &StateHandles,
) -> Result<Resolvers, ConfigErrors> {
    let mut errors = Vec::new();
    let mut resolvers = HashMap::new();
    for (model, model_config) in &config.models {
        let mut buckets = Vec::new();
        for (i, b) in model_config.buckets.iter().enumerate() {
            let path = format!("models.{model}.buckets[{i}].groups");
            let instance = |stage: Role| format!("{model}/{}/{}", b.id, stage.as_str());
            let groups = match &b.groups {
                GroupsConfig::Plain(g) => build_group(
                    &format!("{path}.plain"),
                    g,
                    Role::Plain,
                    &instance(Role::Plain),
                    handles,
                )
                .map(BucketGroups::Plain),
                GroupsConfig::Pd(pd) => {
                    let prefill = build_group(
                        &format!("{path}.pd.prefill"),
                        &pd.prefill,
                        Role::Prefill,
                        &instance(Role::Prefill),
                        handles,
                    );
                    let decode = build_group(
                        &format!("{path}.pd.decode"),
                        &pd.decode,
                        Role::Decode,
                        &instance(Role::Decode),
                        handles,
                    );
                    match (prefill, decode) {
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

fn build_group(
    path: &str,
    group: &GroupConfig,
    stage: Role,
    instance: &str,
    handles: &StateHandles,
) -> Result<EngineGroup, ConfigError> {
    let policy = build_policy(&format!("{path}.policy"), &group.policy, instance, handles)?;
    Ok(match &group.worker_ids {
        None => EngineGroup::new(stage, policy),
        Some(ids) => EngineGroup::with_members(stage, ids.iter().cloned(), policy),
    })
}

/// One logical policy instance per role group; `instance` names its shared state.
pub fn build_policy(
    path: &str,
    config: &PolicyConfig,
    instance: &str,
    handles: &StateHandles,
) -> Result<Arc<dyn Policy>, ConfigError> {
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
        PolicyConfig::SessionAware(_) | PolicyConfig::Sticky(_) | PolicyConfig::CacheAware(_) => {
            return Err(ConfigError::new(
                format!("{path}.type"),
                format!(
                    "`{}` needs the shared affinity and prefix state, which this build does not have yet; use round_robin, random, power_of_two or load_based",
                    config.name()
                ),
            ))
        }
    })
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
        host,
    };
    build_resolvers(config, &handles).map(|_| ())
}
