//! The binding walk shared by session-aware and sticky selection (design §5): reuse an admitted
//! binding; otherwise run the fallback, check its engine, and bind it. A missing or empty key never
//! creates a binding; a rejected bound engine ends the attempt without rewriting the binding.

use std::sync::Arc;

use super::admission::AdmissionGate;
use super::{Pick, PickError, PickReason, PickRequest, Policy};
use crate::registry::Engine;
use crate::state::affinity_store::{AffinityStore, BindingKind, Bound, Scope};

/// How many times a concurrent binding may change under us before the attempt gives up.
const BIND_ATTEMPTS: usize = 4;

/// `session_aware` and `sticky` (constructed in their own files): one policy, keyed differently.
#[derive(Debug)]
pub struct BindingPolicy {
    pub kind: BindingKind,
    pub store: Arc<AffinityStore>,
    pub gate: AdmissionGate,
    /// Runs with default admission; the owner checks what it returns.
    pub fallback: Box<dyn Policy>,
    /// A used binding is refreshed at most this often.
    pub touch_resolution_ms: u64,
}

impl Policy for BindingPolicy {
    fn pick(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        self.walk(engines, request)
    }

    /// The fallback policy's choice, admitted; the binding stays where it is (its engine's health
    /// and breaker move it if it stays down).
    fn fallback(&self, engines: &[Arc<Engine>], failed: &Engine, request: &PickRequest<'_>) -> Option<Arc<Engine>> {
        let engine = self.fallback.fallback(engines, failed, request)?;
        self.gate.check(&engine).is_ok().then_some(engine)
    }
}

impl BindingPolicy {
    fn walk(&self, engines: &[Arc<Engine>], request: &PickRequest<'_>) -> Result<Pick, PickError> {
        let key = match self.kind {
            BindingKind::Session => request.session_key,
            BindingKind::Sticky => request.routing_key,
        }
        .filter(|k| !k.is_empty());
        let Some(key) = key else {
            let pick = self.fallback.pick(engines, request)?;
            self.gate.check(&pick.engine)?;
            return Ok(Pick { reason: PickReason::NoKey, ..pick });
        };
        let scope =
            Scope { kind: self.kind, model: request.model, bucket: request.bucket_id, stage: request.stage, key };
        for _ in 0..BIND_ATTEMPTS {
            let bound = self.store.get(&scope);
            if let Some(worker) = bound.as_deref().and_then(|id| engines.iter().find(|w| w.id == id)) {
                // Reused regardless of pressure when admitted; a rejection is final for this attempt.
                self.gate.check(worker)?;
                self.store.touch(&scope, self.touch_resolution_ms);
                return Ok(Pick::new(Arc::clone(worker), PickReason::BoundReuse));
            }
            // New key, or bound outside this group's candidates: choose, check, then bind.
            let pick = self.fallback.pick(engines, request)?;
            self.gate.check(&pick.engine)?;
            match self.store.bind(&scope, &pick.engine.id, bound.as_deref()) {
                Ok(Bound::Ours) => return Ok(Pick { reason: PickReason::NewBinding, ..pick }),
                // A concurrent first assignment won; the next round checks that engine.
                Ok(Bound::Theirs(_)) => continue,
                Err(e) => {
                    log::warn!("binding for {key} not stored: {e}");
                    return Ok(Pick { reason: PickReason::NewBinding, ..pick });
                }
            }
        }
        Err(PickError::no_candidates(format!("the binding for `{key}` kept changing under concurrent updates")))
    }
}
