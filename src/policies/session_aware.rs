//! Session affinity (design §5): a session's requests reuse its admitted engine; new or keyless
//! sessions go through power-of-two.

use std::sync::Arc;

use super::admission::AdmissionGate;
use super::binding::BindingPolicy;
use super::{PowerOfTwoPolicy, RandomSource};
use crate::config::AdmissionLimits;
use crate::state::affinity_store::{AffinityStore, BindingKind};

/// `session_aware` is the binding walk over session ids, with power-of-two for new sessions.
pub type SessionAwarePolicy = BindingPolicy;

impl BindingPolicy {
    pub fn session_aware(
        store: Arc<AffinityStore>,
        gate: AdmissionGate,
        random: Arc<dyn RandomSource>,
        touch_resolution_ms: u64,
    ) -> Self {
        let fallback_gate = AdmissionGate { admission: Arc::new(AdmissionLimits::default()), ..gate.clone() };
        BindingPolicy {
            kind: BindingKind::Session,
            store,
            gate,
            fallback: Box::new(PowerOfTwoPolicy::new(random, fallback_gate)),
            touch_resolution_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{Host, MemoryHost};
    use crate::policies::{Limit, Pick, PickError, PickReason, PickRequest, Policy, Rejection, SeededRandom};
    use crate::registry::Engine;
    use crate::registry::Role;
    use crate::state::affinity_store::{Bound, Scope};
    use crate::testing::test;
    use crate::testing::*;

    struct Fixture {
        state: State,
        store: Arc<AffinityStore>,
    }

    fn fixture() -> Fixture {
        let host: Arc<dyn Host> = Arc::new(MemoryHost::default());
        Fixture { state: State::new(), store: Arc::new(AffinityStore::new(host)) }
    }

    impl Fixture {
        fn policy(&self, limits: AdmissionLimits) -> SessionAwarePolicy {
            SessionAwarePolicy::session_aware(
                Arc::clone(&self.store),
                self.state.gate(limits),
                Arc::new(SeededRandom::new(5)),
                1000,
            )
        }
    }

    fn with_session(key: &'static str) -> PickRequest<'static> {
        PickRequest { session_key: Some(key), ..request(Role::Plain) }
    }

    fn scope(key: &str) -> Scope<'_> {
        Scope { kind: BindingKind::Session, model: "m", bucket: "b", stage: Role::Plain, key }
    }

    #[test]
    fn a_missing_or_empty_key_never_creates_a_binding() {
        let f = fixture();
        let p = f.policy(AdmissionLimits::default());
        let ws = workers(&["A", "B"]);
        assert_eq!(p.pick(&ws, &request(Role::Plain)).unwrap().reason, PickReason::NoKey);
        assert_eq!(p.pick(&ws, &with_session("")).unwrap().reason, PickReason::NoKey);
        assert!(f.store.is_empty());
    }

    #[test]
    fn a_new_session_is_bound_after_admission_and_then_reused_regardless_of_pressure() {
        let f = fixture();
        let p = f.policy(AdmissionLimits::default());
        let ws = workers(&["A", "B"]);
        let first = p.pick(&ws, &with_session("s1")).unwrap();
        assert_eq!(first.reason, PickReason::NewBinding);
        let bound = first.engine.id.clone();
        assert_eq!(f.store.get(&scope("s1")), Some(bound.clone()));
        // The bound engine is now far busier; the session stays.
        f.state.loads(&[(&bound, native_load(50, 50))]);
        for _ in 0..5 {
            let again = p.pick(&ws, &with_session("s1")).unwrap();
            assert_eq!((again.engine.id.clone(), again.reason), (bound.clone(), PickReason::BoundReuse));
        }
    }

    #[test]
    fn a_rejected_bound_engine_ends_the_attempt_and_keeps_the_binding() {
        let f = fixture();
        f.store.bind(&scope("s1"), "A", None).unwrap();
        f.state.inflight.set("A", 4);
        let p = f.policy(AdmissionLimits { max_inflight_requests: Some(4), ..Default::default() });
        let err = p.pick(&workers(&["A", "B"]), &with_session("s1")).unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "A".into(), limit: Limit::MaxInflightRequests })
        );
        assert_eq!(f.store.get(&scope("s1")).as_deref(), Some("A"), "no other engine, binding kept");
    }

    #[test]
    fn a_binding_outside_the_candidates_cannot_win_and_is_replaced() {
        let f = fixture();
        f.store.bind(&scope("s1"), "Z", None).unwrap();
        let p = f.policy(AdmissionLimits::default());
        let pick = p.pick(&workers(&["A"]), &with_session("s1")).unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("A", PickReason::NewBinding));
        assert_eq!(f.store.get(&scope("s1")).as_deref(), Some("A"));
    }

    #[test]
    fn no_binding_is_created_when_the_fallbacks_engine_is_rejected() {
        let f = fixture();
        let p = f.policy(AdmissionLimits { max_inflight_requests: Some(0), ..Default::default() });
        assert!(matches!(p.pick(&workers(&["A"]), &with_session("s1")), Err(PickError::AdmissionRejected(_))));
        assert!(f.store.is_empty());
    }

    /// A fallback that lets another VM bind the key first, between our read and our write.
    #[derive(Debug)]
    struct RacingFallback {
        store: Arc<AffinityStore>,
        winner: &'static str,
    }

    impl Policy for RacingFallback {
        fn pick(&self, engines: &[Arc<Engine>], r: &PickRequest<'_>) -> Result<Pick, PickError> {
            let scope = Scope {
                kind: BindingKind::Session,
                model: r.model,
                bucket: r.bucket_id,
                stage: r.stage,
                key: r.session_key.unwrap_or_default(),
            };
            assert_eq!(self.store.bind(&scope, self.winner, None).unwrap(), Bound::Ours, "the other VM binds first");
            let ours = engines.iter().find(|w| w.id != self.winner).cloned().unwrap();
            Ok(Pick::new(ours, PickReason::Random))
        }
    }

    fn racing(f: &Fixture, limits: AdmissionLimits) -> SessionAwarePolicy {
        let fallback = RacingFallback { store: Arc::clone(&f.store), winner: "B" };
        BindingPolicy {
            kind: BindingKind::Session,
            store: Arc::clone(&f.store),
            gate: f.state.gate(limits),
            fallback: Box::new(fallback),
            touch_resolution_ms: 1000,
        }
    }

    #[test]
    fn concurrent_first_assignments_converge_on_one_binding_which_is_checked() {
        let f = fixture();
        let pick = racing(&f, AdmissionLimits::default()).pick(&workers(&["A", "B"]), &with_session("s1")).unwrap();
        assert_eq!((pick.engine.id.as_str(), pick.reason), ("B", PickReason::BoundReuse), "we use the winner's engine");
        assert_eq!(f.store.get(&scope("s1")).as_deref(), Some("B"));
    }

    #[test]
    fn a_concurrent_winner_that_fails_admission_is_not_used() {
        let f = fixture();
        f.state.inflight.set("B", 1);
        let err = racing(&f, AdmissionLimits { max_inflight_requests: Some(1), ..Default::default() })
            .pick(&workers(&["A", "B"]), &with_session("s1"))
            .unwrap_err();
        assert_eq!(
            err,
            PickError::AdmissionRejected(Rejection { engine: "B".into(), limit: Limit::MaxInflightRequests })
        );
        assert_eq!(f.store.get(&scope("s1")).as_deref(), Some("B"), "the winner's binding stands");
    }

    #[test]
    fn the_nested_fallback_runs_with_default_admission_and_the_owner_checks_its_engine() {
        let f = fixture();
        // Power-of-two with default admission would happily return A; the owner's cap rejects it.
        f.state.loads(&[("A", native_load(9, 0))]);
        let p = f.policy(AdmissionLimits { max_running_requests: Some(9), ..Default::default() });
        let err = p.pick(&workers(&["A"]), &with_session("s1")).unwrap_err();
        assert!(matches!(err, PickError::AdmissionRejected(Rejection { limit: Limit::MaxRunningRequests, .. })));
    }
}
