//! Routing-key affinity (design §5): a routing key's requests reuse its admitted engine; new or
//! missing keys go through the configured fallback (round_robin by default).

use std::sync::Arc;

use super::binding::BindingPolicy;
use super::Policy;
use crate::policies::admission::AdmissionGate;
use crate::state::affinity_store::{AffinityStore, BindingKind};

/// `sticky` is the binding walk over routing keys.
pub type StickyPolicy = BindingPolicy;

impl BindingPolicy {
    /// `fallback` is built with default admission; this policy checks what it returns.
    pub fn sticky(
        store: Arc<AffinityStore>,
        gate: AdmissionGate,
        fallback: Box<dyn Policy>,
        touch_resolution_ms: u64,
    ) -> Self {
        BindingPolicy { kind: BindingKind::Sticky, store, gate, fallback, touch_resolution_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdmissionLimits;
    use crate::host::{Host, MemoryHost};
    use crate::policies::{MemoryCursor, PickReason, PickRequest, RoundRobinPolicy};
    use crate::registry::Role;
    use crate::testing::test;
    use crate::testing::*;

    fn sticky(state: &State, store: &Arc<AffinityStore>, limits: AdmissionLimits) -> StickyPolicy {
        let fallback = RoundRobinPolicy::new(Box::new(MemoryCursor::default()), state.gate(AdmissionLimits::default()));
        StickyPolicy::sticky(Arc::clone(store), state.gate(limits), Box::new(fallback), 1000)
    }

    fn keyed(key: &'static str) -> PickRequest<'static> {
        PickRequest { routing_key: Some(key), ..request(Role::Plain) }
    }

    #[test]
    fn new_keys_go_through_the_fallback_and_then_stick() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let store = Arc::new(AffinityStore::new(host));
        let state = State::new();
        let p = sticky(&state, &store, AdmissionLimits::default());
        let ws = workers(&["A", "B"]);
        let k1 = p.pick(&ws, &keyed("k1")).unwrap();
        let k2 = p.pick(&ws, &keyed("k2")).unwrap();
        assert_eq!((k1.engine.id.as_str(), k2.engine.id.as_str()), ("A", "B"), "round-robin fallback for new keys");
        for _ in 0..3 {
            assert_eq!(p.pick(&ws, &keyed("k1")).unwrap().engine.id, "A");
            assert_eq!(p.pick(&ws, &keyed("k2")).unwrap().engine.id, "B");
        }
    }

    #[test]
    fn a_session_header_is_not_a_routing_key() {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        let store = Arc::new(AffinityStore::new(host));
        let state = State::new();
        let p = sticky(&state, &store, AdmissionLimits::default());
        let r = PickRequest { session_key: Some("s"), ..request(Role::Plain) };
        assert_eq!(p.pick(&workers(&["A"]), &r).unwrap().reason, PickReason::NoKey);
        assert!(store.is_empty());
    }
}
