//! The singleton service's glue: dispatches the polls the core's tick asks for, hands their answers
//! back, drains the prefix queue into the core, and exports the gauges the core computes.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

use super::host::{dispatch, ProxyHost};
use super::stats::Stats;
use crate::config::RouterConfig;
use crate::host::{in_namespace, Host, Namespaced};
use crate::service::{FollowingService, PollKind};
use crate::state::keys;

pub struct Service {
    core: FollowingService,
    /// Each poll out, with the worker list it was sent for.
    pending: HashMap<u32, (PollKind, u32)>,
    prefix_queue: Option<u32>,
    stats: Rc<Stats>,
}

impl Service {
    /// `own`: the service's bootstrap configuration and its text, if it has one.
    /// `singleton`: the bootstrap service (else a filter VM that holds the service lease).
    pub fn new(own: Option<(RouterConfig, String)>, stats: Rc<Stats>, namespace: &str, singleton: bool) -> Self {
        let prefix_queue = match hostcalls::register_shared_queue(&in_namespace(namespace, keys::PREFIX_QUEUE)) {
            Ok(id) => Some(id),
            Err(status) => {
                log::warn!("prefix queue not registered: {status:?}");
                None
            }
        };
        Self {
            core: FollowingService::new(own, Arc::new(Namespaced::new(Arc::new(ProxyHost), namespace)), singleton),
            pending: HashMap::new(),
            prefix_queue,
            stats,
        }
    }

    /// The period the service's work wants its root to tick at (a followed configuration may
    /// check more often or less).
    pub fn tick_period_ms(&self) -> u64 {
        self.core.tick_period_ms()
    }

    pub fn on_tick(&mut self) {
        let now = ProxyHost.now_ms();
        let plan = self.core.tick(now);
        for poll in plan.polls {
            match dispatch(&poll.request) {
                Ok(token) => {
                    self.pending.insert(token, (poll.kind, poll.generation));
                }
                Err(e) => {
                    log::warn!("poll {} of {} not dispatched: {e}", poll.request.path, poll.request.cluster);
                    self.core.not_dispatched(poll.kind, now);
                }
            }
        }
        for (name, value) in &plan.gauges {
            self.stats.gauge(name, *value);
        }
    }

    pub fn on_http_call_response(&mut self, token: u32, body_size: usize) {
        let Some((kind, generation)) = self.pending.remove(&token) else {
            return;
        };
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
            .and_then(|s| s.parse().ok());
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten();
        self.core.on_poll_answer(kind, generation, status, body.as_deref().unwrap_or_default(), ProxyHost.now_ms());
    }

    /// Drains the prefix events the filters sent.
    pub fn on_queue_ready(&mut self, queue_id: u32) {
        if Some(queue_id) != self.prefix_queue {
            return;
        }
        let messages = std::iter::from_fn(|| hostcalls::dequeue_shared_queue(queue_id).ok().flatten());
        self.core.on_prefix_messages(messages.collect::<Vec<_>>());
    }
}
