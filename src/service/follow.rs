//! The service as Envoy runs it: a [`ServiceCore`] on the newest filter configuration announced
//! (spec §8). The service's own bootstrap configuration is optional: when present it is followed
//! until a filter announces one; when empty the service waits for the first announcement.

use std::sync::Arc;

use super::{PollKind, ServiceCore, TickPlan, TICK_MS};
use crate::config::{self, RouterConfig, ServiceMode};
use crate::host::Host;
use crate::state::filter_config::AnnouncedReader;
use crate::state::lease::{self, Claimant};
use crate::state::vm_registry::HEARTBEAT_MS;

pub struct FollowingService {
    host: Arc<dyn Host>,
    announced: AnnouncedReader,
    /// The configuration text the core runs on.
    followed: Option<String>,
    core: Option<ServiceCore>,
    /// The bootstrap singleton's id at the service lease; `None` for a filter VM elected to run
    /// the service (its filter root claims the lease).
    singleton: Option<u64>,
    /// The singleton's last turn at the lease, and whether it held it then.
    lease_turn: (u64, bool),
}

impl FollowingService {
    /// `own` is the service's bootstrap configuration with its text, if it has one; `singleton`
    /// whether this is the bootstrap service (else a filter VM that holds the lease runs it).
    pub fn new(own: Option<(RouterConfig, String)>, host: Arc<dyn Host>, singleton: bool) -> Self {
        let (core, followed) = match own {
            Some((config, text)) => (Some(ServiceCore::new(config, Arc::clone(&host))), Some(text)),
            None => (None, None),
        };
        let singleton = singleton.then(|| host.random_u64());
        let mut service =
            Self { host, announced: AnnouncedReader::default(), followed, core, singleton, lease_turn: (0, false) };
        service.follow();
        service
    }

    /// Whether the singleton does the work now: it holds the lease (it always takes it), unless
    /// the configuration it follows leaves the work to the filter VMs (`service.mode: embedded`).
    /// Asked once per heartbeat.
    fn works(&mut self, now: u64) -> bool {
        let Some(me) = self.singleton else { return true };
        let (at, working) = self.lease_turn;
        if at != 0 && now.saturating_sub(at) < HEARTBEAT_MS {
            return working;
        }
        let embedded = self.core.as_ref().is_some_and(|c| c.config().service.mode == ServiceMode::Embedded);
        let working = !embedded
            && lease::claim(self.host.as_ref(), me, Claimant::Singleton, now).unwrap_or_else(|e| {
                log::warn!("service lease not claimed: {e}");
                true
            });
        if working != self.lease_turn.1 || at == 0 {
            log::info!(
                "the bootstrap service {} the service's work",
                if working { "does" } else { "leaves the filter VMs" }
            );
        }
        self.lease_turn = (now.max(1), working);
        working
    }

    /// Takes up a configuration announced since the last look. One that does not validate (it
    /// did in the filter that announced it, so only a different build could send it) is logged
    /// and left: the service keeps what it follows.
    fn follow(&mut self) {
        let Some(text) = self.announced.take_new(self.host.as_ref()) else { return };
        if self.followed.as_deref() == Some(text.as_str()) {
            return;
        }
        let config = match config::parse_and_validate(&text) {
            Ok(config) => config,
            Err(errors) => {
                for e in &errors.0 {
                    log::error!("announced filter configuration not followed: {e}");
                }
                return;
            }
        };
        match self.core.as_mut() {
            Some(core) => core.reconfigure(config),
            None => {
                log::info!("following the filter configuration: {} workers", config.workers.len());
                self.core = Some(ServiceCore::new(config, Arc::clone(&self.host)));
            }
        }
        self.followed = Some(text);
    }

    pub fn tick_period_ms(&self) -> u64 {
        self.core.as_ref().map_or(TICK_MS, ServiceCore::tick_period_ms)
    }

    /// Follows the newest configuration, then everything due at `now` when this service does the
    /// work.
    pub fn tick(&mut self, now: u64) -> TickPlan {
        self.follow();
        if !self.works(now) {
            return TickPlan::default();
        }
        self.core.as_mut().map(|core| core.tick(now)).unwrap_or_default()
    }

    pub fn not_dispatched(&mut self, kind: PollKind, now: u64) {
        if let Some(core) = self.core.as_mut() {
            core.not_dispatched(kind, now);
        }
    }

    pub fn on_poll_answer(&mut self, kind: PollKind, generation: u32, status: Option<u16>, body: &[u8], now: u64) {
        if let Some(core) = self.core.as_mut() {
            core.on_poll_answer(kind, generation, status, body, now);
        }
    }

    /// The filters' prefix events; before any configuration there is no index to apply them to.
    pub fn on_prefix_messages(&mut self, messages: impl IntoIterator<Item = Vec<u8>>) {
        match self.core.as_mut() {
            Some(core) => core.on_prefix_messages(messages),
            None => log::warn!("prefix events dropped: no filter configuration announced yet"),
        }
    }
}
