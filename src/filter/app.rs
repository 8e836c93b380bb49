//! What a filter VM's requests share: the validated configuration, the registry, each model's
//! resolver and the state handles; `prepare` (a body to a [`Ticket`]) and `decide` (a ticket to a
//! decision), which a request's life calls; and the hooks that tell shared state what was
//! dispatched and how it went.

use std::collections::HashSet;
use std::sync::Arc;

use super::generation::request_id::RequestId;
use super::generation::{self, Effects, Endpoint, Outcome, Prepared, Ticket, Wiring};
use super::headers::ProtectedHeaders;
use super::indexer::IndexerClient;
use super::queue::{Capacity, EngineRoom, WaitingRoom};
use super::{ErrorKind, RouteError};
use crate::buckets::BucketRequest;
use crate::config::RouterConfig;
use crate::policies::pressure::{pending_prefill, prefill_rate, slot_wait_ms};
use crate::registry::{Availability, EngineRegistry, EngineSet};
use crate::state::availability::SharedAvailability;
use crate::state::breaker::CircuitBreakers;
use crate::state::health;
use crate::state::load_monitor::{InflightGuard, PrefillWork};
use crate::wiring::counters::{Bumps, Counter};
use crate::wiring::factory::{self, build_resolvers, prefix_budgets, Resolvers, StateHandles};
use crate::wiring::upstream::UpstreamHeader;

pub struct AppContext {
    config: Arc<RouterConfig>,
    registry: EngineRegistry,
    availability: Arc<SharedAvailability>,
    resolvers: Resolvers,
    handles: StateHandles,
    breakers: Option<CircuitBreakers>,
    upstream: UpstreamHeader,
    /// Models with a cache-aware group: their prompts feed the prefix index.
    prefix_models: HashSet<String>,
    /// Shared with each request's filter context, which reads it while calling the host.
    headers: Arc<ProtectedHeaders>,
    /// The indexer, when `prefix_index` is configured; asked only for models with a tokenizer.
    indexer: Option<Arc<IndexerClient>>,
    /// The model `/generate` serves ([`RouterConfig::generate_model`]).
    generate_model: Option<String>,
    /// This VM's parked requests: waiting for room (spec §9), or held for their prefix.
    waiting: Arc<WaitingRoom>,
    /// Whether anything reads the engine model (pending prefill, learned speed): a policy that
    /// weighs it, or a queue. Where nothing does, a dispatch is counted and nothing more.
    engine_model: bool,
}

impl AppContext {
    /// Builds every policy instance once, at startup; requests only use them.
    pub fn new(config: RouterConfig, handles: StateHandles) -> Self {
        let resolvers = build_resolvers(&config, &handles);
        let prefix_models = prefix_budgets(&config).0.into_keys().collect();
        let breakers = config
            .circuit_breaker
            .as_ref()
            .map(|c| CircuitBreakers::new(Arc::clone(&handles.host), factory::breaker_settings(c)));
        let workers = factory::workers(&config);
        let ids = workers.iter().map(|w| w.id.clone()).collect();
        let availability = Arc::new(SharedAvailability::new(
            Arc::clone(&handles.host),
            breakers.clone(),
            ids,
            handles.tables_recheck_ms,
            health::stale_after_ms(config.health.interval_ms),
        ));
        for w in workers.iter().filter(|w| w.draining) {
            log::info!("worker {} is draining: it takes no new request, and completes those in flight", w.id);
        }
        let registry = EngineRegistry::new(workers, Arc::clone(&availability) as Arc<dyn Availability>);
        let upstream = UpstreamHeader::new(&config.upstream, config.retry_attempts());
        let indexer = IndexerClient::from_config(&config).map(Arc::new);
        let generate_model = config.generate_model().map(str::to_string);
        Self {
            engine_model: config.reads_engine_model(),
            waiting: Arc::new(WaitingRoom::new(Arc::clone(&handles.host), handles.vm)),
            generate_model,
            indexer,
            headers: Arc::new(ProtectedHeaders::new(upstream.name())),
            config: Arc::new(config),
            registry,
            availability,
            resolvers,
            handles,
            breakers,
            upstream,
            prefix_models,
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    pub fn handles(&self) -> &StateHandles {
        &self.handles
    }

    pub fn waiting(&self) -> &Arc<WaitingRoom> {
        &self.waiting
    }

    /// Milliseconds of wall-clock time, as every VM reads it.
    pub fn now_ms(&self) -> u64 {
        self.handles.host.now_ms()
    }

    /// Configured workers the service does not monitor, and so routes nothing to.
    pub fn unmonitored_workers(&self) -> usize {
        self.availability.unmonitored()
    }

    /// Configured workers that are draining (`drain: true`): they take no new request.
    pub fn draining_workers(&self) -> usize {
        self.registry.all().iter().filter(|w| w.draining).count()
    }

    /// Whether the service's health table has gone stale (health reads as unknown).
    pub fn health_stale(&self) -> bool {
        self.availability.health_stale()
    }

    pub fn headers(&self) -> &Arc<ProtectedHeaders> {
        &self.headers
    }

    /// A request (or prefill callout) bringing `prefill_tokens` uncached tokens was sent to
    /// `worker`: the breaker hears of it, and the returned guard holds its in-flight slot and its
    /// share of the engine's pending prefill until the stage ends. `timed`: its first byte will
    /// follow its first token ([`InflightGuard::acquire`]).
    pub fn on_dispatch(&self, worker: &str, prefill_tokens: u64, timed: bool) -> InflightGuard {
        if let Some(b) = &self.breakers {
            b.on_dispatch(worker);
        }
        let prior = self.config.load.prefill_tokens_per_s / 1000.0;
        if !self.engine_model {
            let work = PrefillWork { tokens: prefill_tokens, tokens_per_ms: prior, ahead: 0, slot_wait_ms: 0 };
            return InflightGuard::acquire(Arc::clone(&self.handles.inflight), worker, work, prior, false);
        }
        let snapshot = self.handles.load.snapshot();
        let (load, local) = (snapshot.get(worker), self.handles.inflight.local_load(worker));
        // The rate the engine's prefill lane drains at: an engine sent work and not yet timed
        // drains at the slowest timed one's (`Prior::of`), or a slow engine's lane empties on
        // paper before its first byte.
        let fleet = self.handles.inflight.prior(prior);
        let prior = fleet.of(&local);
        let work = PrefillWork {
            tokens: prefill_tokens,
            tokens_per_ms: prefill_rate(load, &fleet.judged(local), prior),
            ahead: pending_prefill(load, &local),
            slot_wait_ms: slot_wait_ms(load, &local) as u64,
        };
        InflightGuard::acquire(Arc::clone(&self.handles.inflight), worker, work, prior, timed)
    }

    /// Whether `engine` started on the dispatch that sent it a prefix at `sent_ms`: no work sent
    /// to it before then is still unanswered (the rule `cache_aware` holds a request by).
    pub fn prefix_started(&self, engine: &str, sent_ms: u64) -> bool {
        let inflight = &self.handles.inflight;
        let local = inflight.local_load(engine);
        local.unanswered.is_none_or(|oldest| inflight.now_ms().saturating_sub(oldest.ms) >= sent_ms)
    }

    /// Carries out what an exchange event asked for that shared state must hear: dispatch results
    /// and abandoned probes to the breaker, the prefix event to the outbox, the counters to be held.
    pub fn carry_out(&self, effects: Effects) {
        if let Some(b) = &self.breakers {
            for (worker, answer) in &effects.results {
                b.record(worker, answer.engine_ok());
            }
            for worker in &effects.abandoned {
                b.abandon(worker);
            }
        }
        for event in &effects.prefix_events {
            self.handles.outbox.push(event);
        }
        self.count(effects.counters);
    }

    /// Counters for Envoy's stats, held until the next sync hands them to the glue.
    pub fn count(&self, counters: impl IntoIterator<Item = Counter>) {
        self.handles.counters.hold(counters);
    }

    /// Exchanges with the other VMs what is due on the request path: in-flight counts and the
    /// prefix events held for the service. A VM with nothing in flight sends at once. Returns the
    /// counter bumps due for Envoy's stats, on the same rule.
    #[must_use = "the counter bumps are the glue's to make"]
    pub fn sync_shared(&self) -> Bumps {
        self.handles.inflight.sync_if_due();
        let idle = self.handles.inflight.idle();
        self.handles.outbox.send_if_due(idle);
        self.hold_stale_health_reads();
        self.handles.counters.take_if_due(idle, self.handles.host.now_ms())
    }

    /// Exchanges everything now (the heartbeat): what a VM did just before it went quiet.
    #[must_use = "the counter bumps are the glue's to make"]
    pub fn sync_shared_now(&self) -> Bumps {
        self.handles.inflight.sync();
        self.handles.outbox.send();
        self.hold_stale_health_reads();
        self.handles.counters.take(self.handles.host.now_ms())
    }

    /// Exchanges in-flight counts with the other VMs now, whatever is due: a decision that
    /// relies on the caps (a model with a queue) is made on the freshest counts.
    pub fn exchange_counts_now(&self) {
        self.handles.inflight.sync();
    }

    /// Tells the other VMs this VM's dispatch at once, so two VMs seldom fill one slot twice.
    pub fn publish_counts_now(&self) {
        self.handles.inflight.publish_now();
    }

    /// Tells the other VMs and the service of a dispatch that sent an engine a prompt to prefill
    /// (its in-flight counts and its prefix) at once, but not twice within
    /// [`NEWS_MS`](crate::state::schedule::NEWS_MS). Held to the next request event past the
    /// period, as cheaper news is, it left the engine looking idle and the prompt unheld to the
    /// other VMs for tens of milliseconds, in which they sent that engine more new prompts and the
    /// prompt's siblings elsewhere to be prefilled again. Told on every such dispatch, a stream of
    /// distinct prompts woke the service once per request.
    pub fn tell_news(&self) {
        if !self.engine_model {
            return;
        }
        self.handles.inflight.publish_news();
        self.handles.outbox.send_news();
    }

    fn hold_stale_health_reads(&self) {
        let stale = self.availability.take_stale_reads();
        if stale > 0 {
            self.handles.counters.hold_n(Counter::HealthTableStale, stale);
        }
    }

    /// Prepares a buffered body of a generation endpoint for selection. `header` reads a request
    /// header. The ticket names the indexer's match call when the request is to ask it first
    /// (`ask` — a request prepared again after a wait asked already), and keeps the body for its
    /// rewrites.
    pub fn prepare(
        &self,
        endpoint: Endpoint,
        body: Vec<u8>,
        header: &dyn Fn(&str) -> Option<String>,
        ask: bool,
    ) -> Result<Ticket, RouteError> {
        let bytes_per_token = self.config.tokens.bytes_per_token;
        // The model is known only once the body is read: the text is built when any model records
        // prompts, and kept for those that do.
        let Prepared { facts, prompts, prompt_text } = generation::prepare_endpoint(
            endpoint,
            &body,
            bytes_per_token,
            self.generate_model.as_deref(),
            !self.prefix_models.is_empty(),
        )?;
        let (Some(model), Some(resolver)) = (self.config.models.get(&facts.model), self.resolvers.get(&facts.model))
        else {
            return Err(RouteError::new(
                ErrorKind::ModelNotFound,
                format!("model `{}` is not served by this router", facts.model),
            ));
        };
        let key = |name: &str| header(name).filter(|v| !v.is_empty());
        let prompt_text: Option<Arc<str>> =
            prompt_text.filter(|_| self.prefix_models.contains(&facts.model)).map(Arc::from);
        // One callout: a request's own token ids go to `/query` (ours or Dynamo's); a chat body to
        // ours, which tokenizes it with the model's template. Other prompts use the estimate.
        let call =
            self.indexer.as_ref().filter(|_| ask).and_then(|client| match (endpoint, prompts.single_token_ids()) {
                (_, Some(ids)) => Some(client.match_tokens(&facts.model, ids)),
                (Endpoint::Chat, None) if client.tokenizes_chat() && model.tokenizer.is_some() => {
                    Some(client.match_chat(&body))
                }
                _ => None,
            });
        // A call that could not be made is an answer already: unavailable.
        let (indexer_call, indexer) = match call {
            Some(Ok(call)) => (Some(call), None),
            Some(Err(why)) => (None, Some(Err(why))),
            None => (None, None),
        };
        let request = BucketRequest {
            model: facts.model.clone(),
            input_tokens: facts.input_tokens,
            expected_peak_tokens: facts.expected_peak_tokens,
            token_ids: prompts.single_token_ids().map(<[u32]>::to_vec),
            prompt_text,
            indexer,
            session_key: key(&model.session_id_header),
            routing_key: key(&model.routing_key_header),
            prefix_wait_over: false,
        };
        let rid = RequestId::draw(self.handles.random.as_ref());
        Ok(Ticket { endpoint, facts, request, resolver: Arc::clone(resolver), body: Some(body), rid, indexer_call })
    }

    /// Selects engines for a prepared request and makes its decision, leaving the `reserved`
    /// engines to the requests waiting ahead of it (spec §9). A request that `waits` already is
    /// refused, to wait on, when no engine had room, whatever the reason (health may come back).
    pub fn decide(&self, ticket: Ticket, reserved: &EngineSet, waits: bool) -> Outcome {
        let live = self.registry.live().without(reserved);
        let wiring = Wiring {
            exhausted_waits: waits || !reserved.is_empty(),
            live: &live,
            upstream: &self.upstream,
            random: self.handles.random.as_ref(),
            prefill_timeout_ms: self.config.pd.prefill_timeout_ms,
            indexer: self.indexer.as_deref(),
            load: self.handles.load.as_ref(),
            now_ms: self.now_ms(),
            seats: Some(&self.handles.seats),
        };
        generation::decide(ticket, &wiring)
    }

    /// The engines a prepared request could use: every live engine of its compatible buckets'
    /// groups, what it competes for when it waits.
    pub fn engines_of(&self, ticket: &Ticket) -> EngineSet {
        let live = self.registry.live();
        let request = &ticket.request;
        let buckets = ticket.resolver.resolve(request.input_tokens, request.expected_peak_tokens).unwrap_or_default();
        let mut set = EngineSet::default();
        for group in buckets.iter().flat_map(|b| b.groups()) {
            set.union(&live.places(group.candidates(&live, &request.model).iter()));
        }
        set
    }

    /// What the `engines` of a waiting request not `reserved` for those ahead of it look like now
    /// ([`Capacity`]): what tells it whether to try again.
    pub fn capacity(&self, engines: &EngineSet, reserved: &EngineSet) -> Capacity {
        let live = self.registry.live();
        let engines = (self.registry.all().iter().enumerate())
            .filter(|(i, _)| engines.contains(*i) && !reserved.contains(*i))
            .map(|(place, e)| EngineRoom {
                place,
                inflight: self.handles.inflight.inflight(&e.id),
                in_service: live.in_service(e),
            })
            .collect();
        Capacity { engines, load: self.handles.load.snapshot(), reserved: *reserved }
    }

    /// The indexer replica whose cluster is `cluster`, for its counters.
    pub fn indexer_replica(&self, cluster: &str) -> Option<Arc<str>> {
        self.indexer.as_ref()?.replica_of(cluster)
    }

    /// Microseconds on the host's monotonic clock.
    pub fn monotonic_us(&self) -> u64 {
        self.handles.host.monotonic_us()
    }

    /// The `x-sgl-vm` value for `vm`, when the configuration asks responses to carry it.
    pub fn vm_header(&self, vm: u64) -> Option<String> {
        self.config.debug.vm_header.then(|| format!("{vm:016x}"))
    }
}
