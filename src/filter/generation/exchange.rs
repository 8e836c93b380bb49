//! One routed chat request after its decision, until its stream ends: which dispatches still owe a
//! result, when the decode response may pass (via [`PdExchange`]), under which engine the prompt's
//! prefix is recorded (spec §3), and the request's one outcome. The filter reports each event and
//! carries out the [`Effects`] it gets back.

use std::sync::Arc;

use super::pd::{Flow, PdExchange, PrefillDone};
use super::Decision;
use crate::host::CalloutRequest;
use crate::registry::Engine;
use crate::state::prefix::PrefixEvent;
use crate::state::seats::Seat;
use crate::wiring::counters::Counter;
use crate::wiring::upstream::UpstreamAnswer;

/// What the filter (through `AppContext::carry_out`) does after an event.
#[derive(Debug, Default, PartialEq)]
pub struct Effects {
    /// Dispatch results for the circuit breaker.
    pub results: Vec<(String, UpstreamAnswer)>,
    /// Dispatches whose stream ended without a result: a probe among them is given back.
    pub abandoned: Vec<String>,
    /// The prompt's prefix: recorded under the engine that prefills it as the request goes there
    /// (the next request sharing it must know at once, not a first token later), and taken back
    /// when that engine fails it or Envoy retries it elsewhere.
    pub prefix_events: Vec<PrefixEvent>,
    /// Counters to bump, the request's one outcome among them.
    pub counters: Vec<Counter>,
}

#[derive(Debug)]
pub struct Exchange {
    decision: Decision,
    pd: Option<PdExchange>,
    /// The decision's prefix event, as recorded for the engine it names.
    prefix_event: Option<PrefixEvent>,
    /// The engine the prefix is recorded under now.
    recorded_for: Option<String>,
    /// Workers dispatched to whose result is not recorded yet.
    unanswered: Vec<String>,
    /// PD only: the outcome is known once the prefill answered (or the decode failed first).
    outcome_pending: bool,
}

impl Exchange {
    /// A plain decision's outcome was counted with its selection; a PD decision's waits.
    pub fn new(mut decision: Decision) -> Self {
        let prefix_event = decision.prefix_event.take();
        let pd = decision.pd.as_ref().map(|pd| PdExchange::new(std::sync::Arc::clone(&pd.prefill)));
        Self { outcome_pending: pd.is_some(), decision, pd, prefix_event, recorded_for: None, unanswered: Vec::new() }
    }

    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The seat the decision holds at `engine`, for the stage dispatched there to keep.
    pub fn take_seat(&mut self, engine: &str) -> Option<Arc<Seat>> {
        self.decision.seats.take(engine)
    }

    /// The fire-and-forget callouts to send once dispatched (each is sent once).
    pub fn take_notices(&mut self) -> Vec<CalloutRequest> {
        std::mem::take(&mut self.decision.notices)
    }

    /// A request or callout went to `worker`: the engine that prefills the prompt has its prefix.
    pub fn dispatched(&mut self, worker: &str) -> Effects {
        self.unanswered.push(worker.to_string());
        let mut effects = Effects::default();
        if *worker == self.decision.target.prefill_work().id {
            self.record(&mut effects);
        }
        effects
    }

    /// Records the prefix under the engine that prefills the prompt, taking it back from the one it
    /// was recorded under before (an engine Envoy's retry replaced).
    fn record(&mut self, effects: &mut Effects) {
        let worker = self.decision.target.prefill_work().id.clone();
        if self.recorded_for.as_ref() == Some(&worker) {
            return;
        }
        self.unrecord(effects);
        if let Some(event) = self.prefix_event.as_ref().and_then(|e| Self::under(e, &worker, true)) {
            effects.prefix_events.push(event);
            self.recorded_for = Some(worker);
        }
    }

    /// The engine the prefix was recorded under failed the request: it does not hold it.
    fn unrecord(&mut self, effects: &mut Effects) {
        if let Some(worker) = self.recorded_for.take() {
            effects.prefix_events.extend(self.prefix_event.as_ref().and_then(|e| Self::under(e, &worker, false)));
        }
    }

    /// The decision's prefix event stored (or removed) under `worker`.
    fn under(event: &PrefixEvent, worker: &str, stored: bool) -> Option<PrefixEvent> {
        let PrefixEvent::Stored { model, text, tier, sent_ms, .. } = event else { return None };
        let (model, worker, text) = (model.clone(), worker.to_string(), text.clone());
        Some(if stored {
            PrefixEvent::Stored { model, worker, text, tier: *tier, sent_ms: *sent_ms }
        } else {
            PrefixEvent::Removed { model, worker, text }
        })
    }

    fn answered(&mut self, worker: &str, answer: UpstreamAnswer, effects: &mut Effects) {
        if let Some(i) = self.unanswered.iter().position(|w| w == worker) {
            self.unanswered.swap_remove(i);
            effects.results.push((worker.to_string(), answer));
        }
    }

    fn outcome(&mut self, name: &'static str, effects: &mut Effects) {
        if std::mem::take(&mut self.outcome_pending) {
            effects.counters.push(Counter::Outcome(name));
        }
    }

    /// The engine that answered, when Envoy retried the request on one of the decision's
    /// fallbacks (`answered_by` is the upstream host's `ip:port`): it becomes the upstream engine,
    /// and each engine tried before it refused the request, which its breaker hears.
    pub fn retried(&mut self, answered_by: &str) -> Option<(Arc<Engine>, Effects)> {
        let position = self.decision.fallbacks.iter().position(|f| f.address.socket() == Some(answered_by))?;
        let fallback = Arc::clone(&self.decision.fallbacks[position]);
        let mut effects = Effects::default();
        let refused: Vec<Arc<Engine>> = std::iter::once(Arc::clone(self.decision.target.upstream()))
            .chain(self.decision.fallbacks[..position].iter().cloned())
            .collect();
        let stage = self.decision.target.upstream_stage();
        // The first refusal answers the upstream stage; the others go to their breakers.
        let (first, others) = refused.split_first()?;
        self.answered(&first.id, UpstreamAnswer::Failed, &mut effects);
        effects.results.extend(others.iter().map(|e| (e.id.clone(), UpstreamAnswer::Failed)));
        effects.counters.extend(refused.iter().map(|_| Counter::Retry(stage)));
        self.decision.target.set_upstream(Arc::clone(&fallback));
        let moved = self.dispatched(&fallback.id);
        effects.prefix_events.extend(moved.prefix_events);
        Some((fallback, effects))
    }

    /// The upstream (plain or decode) engine's response headers arrived.
    pub fn on_upstream_headers(&mut self, status: Option<u16>) -> (Flow, Effects) {
        let mut effects = Effects::default();
        let answer = UpstreamAnswer::from_status(status);
        let upstream = self.decision.target.upstream().id.clone();
        self.answered(&upstream, answer, &mut effects);
        let flow = match self.pd.as_mut() {
            Some(pd) => {
                let flow = pd.on_decode_headers(status);
                if flow == Flow::Pass && !answer.succeeded() {
                    // The decode engine's own error went to the client; the request was routed.
                    self.outcome("routed", &mut effects);
                }
                flow
            }
            None => {
                if !answer.succeeded() {
                    self.unrecord(&mut effects);
                }
                Flow::Pass
            }
        };
        (flow, effects)
    }

    /// A chunk of the upstream response body arrived.
    pub fn on_upstream_body(&self) -> Flow {
        self.pd.as_ref().map_or(Flow::Pass, PdExchange::on_decode_body)
    }

    /// The PD prefill callout answered (`None`: timeout or connection failure).
    pub fn on_prefill_done(&mut self, status: Option<u16>) -> (PrefillDone, Effects) {
        let mut effects = Effects::default();
        let Some(pd) = self.pd.as_mut() else {
            return (PrefillDone::Nothing, effects);
        };
        let prefill = pd.prefill().id.clone();
        let done = pd.on_prefill_done(status);
        let answer = UpstreamAnswer::from_status(status);
        self.answered(&prefill, answer, &mut effects);
        if !answer.succeeded() {
            self.unrecord(&mut effects);
        }
        match &done {
            PrefillDone::Fail(e) => self.outcome(e.kind.type_name(), &mut effects),
            PrefillDone::Resume | PrefillDone::Nothing => self.outcome("routed", &mut effects),
        }
        (done, effects)
    }

    /// The stream ended, however: completed, reset, or the client went away.
    pub fn on_end(&mut self) -> Effects {
        let mut effects = Effects { abandoned: std::mem::take(&mut self.unanswered), ..Effects::default() };
        // A PD request whose client left before the prefill answered was still routed.
        self.outcome("routed", &mut effects);
        effects
    }
}

#[cfg(test)]
mod tests {
    use crate::state::seats::Seats;
    use crate::testing::test;
    use std::sync::Arc;

    use super::*;
    use crate::filter::generation::pd::PdDispatch;
    use crate::filter::generation::Target;
    use crate::filter::ErrorKind;
    use crate::registry::{EngineAddress, Role};
    use crate::state::prefix::Tier;
    use crate::testing::{worker, worker_with};

    fn event(worker: &str) -> PrefixEvent {
        PrefixEvent::Stored { model: "m".into(), worker: worker.into(), text: "hi".into(), tier: Tier::Gpu, sent_ms: 0 }
    }

    fn removed(worker: &str) -> PrefixEvent {
        PrefixEvent::Removed { model: "m".into(), worker: worker.into(), text: "hi".into() }
    }

    fn plain_with(fallbacks: Vec<Arc<Engine>>) -> Exchange {
        Exchange::new(Decision {
            bucket_id: "b".into(),
            target: Target::Plain(worker("A")),
            upstream_headers: vec![("x-sgl-cluster".into(), "sgl_A".into())],
            fallbacks,
            pd: None,
            body: None,
            rid: "r".into(),
            prefix_event: Some(event("A")),
            notices: vec![],
            prefill_tokens: 0,
            stream: false,
            seats: Seats::default(),
        })
    }

    fn plain() -> Exchange {
        let mut x = plain_with(vec![]);
        assert_eq!(x.dispatched("A").prefix_events, [event("A")], "recorded as the request goes");
        x
    }

    fn pd() -> Exchange {
        let (p, d) = (worker_with("P", Role::Prefill, "m"), worker_with("D", Role::Decode, "m"));
        let mut x = Exchange::new(Decision {
            bucket_id: "b".into(),
            target: Target::Pd { prefill: Arc::clone(&p), decode: d },
            upstream_headers: vec![("x-sgl-cluster".into(), "sgl_D".into())],
            fallbacks: vec![],
            pd: Some(PdDispatch {
                prefill: p,
                path: "/generate",
                body: vec![],
                prefill_body: None,
                rooms: vec![1],
                prefill_timeout_ms: 1,
            }),
            body: None,
            rid: "r".into(),
            prefix_event: Some(event("P")),
            notices: vec![],
            prefill_tokens: 0,
            stream: false,
            seats: Seats::default(),
        });
        assert_eq!(x.dispatched("P").prefix_events, [event("P")]);
        assert_eq!(x.dispatched("D").prefix_events, [], "the decode engine does not prefill");
        x
    }

    #[test]
    fn a_plain_prefix_recorded_at_dispatch_is_taken_back_when_the_engine_fails_it() {
        let mut failed = plain();
        let (_, effects) = failed.on_upstream_headers(Some(503));
        assert_eq!(effects.prefix_events, [removed("A")]);
        assert_eq!(effects.results, [("A".to_string(), UpstreamAnswer::Failed)]);
        assert!(effects.counters.is_empty(), "a plain outcome was counted with its selection");
        let mut ok = plain();
        assert_eq!(ok.on_upstream_headers(Some(200)).1.prefix_events, []);
        assert_eq!(ok.on_end().prefix_events, [], "recorded once");
    }

    #[test]
    fn a_prefix_moves_with_the_request_envoy_retried_elsewhere() {
        let b = Arc::new(Engine { address: EngineAddress::new("127.0.0.1", 2), ..(*worker("B")).clone() });
        let mut x = plain_with(vec![b]);
        x.dispatched("A");
        let (engine, effects) = x.retried("127.0.0.1:2").unwrap();
        assert_eq!(engine.id, "B");
        assert_eq!(effects.prefix_events, [removed("A"), event("B")]);
        assert_eq!(x.on_upstream_headers(Some(200)).1.prefix_events, []);
    }

    #[test]
    fn a_pd_prefix_stays_when_the_prefill_succeeds_and_is_taken_back_when_it_fails() {
        let mut x = pd();
        let (flow, effects) = x.on_upstream_headers(Some(200));
        assert_eq!((flow, effects.prefix_events), (Flow::Hold, vec![]));
        let (done, effects) = x.on_prefill_done(Some(200));
        assert_eq!(done, PrefillDone::Resume);
        assert_eq!(effects.prefix_events, []);
        assert_eq!(effects.counters, [Counter::Outcome("routed")]);

        let mut y = pd();
        let (done, effects) = y.on_prefill_done(Some(500));
        assert!(matches!(done, PrefillDone::Fail(ref e) if e.kind == ErrorKind::PrefillFailed));
        assert_eq!(effects.prefix_events, [removed("P")]);
        assert_eq!(effects.counters, [Counter::Outcome("PrefillFailed")], "one outcome, not routed as well");
        assert!(y.on_end().counters.is_empty(), "and never a second one");
    }

    #[test]
    fn a_decode_failing_first_is_routed_once() {
        let mut x = pd();
        let (flow, effects) = x.on_upstream_headers(Some(503));
        assert_eq!((flow, effects.counters.clone()), (Flow::Pass, vec![Counter::Outcome("routed")]));
        let (done, effects) = x.on_prefill_done(Some(200));
        assert_eq!(done, PrefillDone::Nothing);
        assert!(effects.counters.is_empty());
    }

    #[test]
    fn dispatches_without_a_result_are_abandoned_at_the_end() {
        let mut x = pd();
        x.on_upstream_headers(Some(200));
        let effects = x.on_end();
        assert_eq!(effects.abandoned, ["P"], "the prefill never answered; the decode did");
        assert_eq!(effects.counters, [Counter::Outcome("routed")], "the client left before the prefill answered");
        let mut y = plain();
        assert_eq!(y.on_end().abandoned, ["A"], "the client left before response headers");
    }
}
