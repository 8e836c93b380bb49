//! A filter VM's prefix events on their way to the service. Every queue message wakes the service
//! on Envoy's main thread, and one message per routed request kept that thread busy at saturation
//! (docs/results/history.md, the hot path's third round). So a busy VM holds its events and sends them as one message at most every
//! period; a VM with nothing else in flight sends at once, so a conversation's next turn never
//! waits on a batch. The bound, stated: an event reaches the service queue when its VM next syncs
//! (a request arriving, dispatched or ending) at least one period after the last message, when the
//! VM's last request in flight ends, or on the VM's heartbeat (within a second), whichever is first;
//! and after a dispatch that sends an engine a prompt to prefill, at once unless such news went less
//! than [`NEWS_MS`](crate::state::schedule::NEWS_MS) ago ([`PrefixOutbox::send_news`]): that
//! prefix decides where the other VMs send the prompt's siblings.

use std::sync::{Arc, Mutex};

use super::events::PrefixEvent;
use super::wire;
use crate::host::Host;
use crate::state::keys;
use crate::state::schedule::Batched;

pub struct PrefixOutbox {
    host: Arc<dyn Host>,
    /// Encoded events, back to back: one queue message.
    held: Mutex<Batched<Vec<u8>>>,
}

impl PrefixOutbox {
    pub fn new(host: Arc<dyn Host>, period_ms: u64) -> Self {
        Self { host, held: Mutex::new(Batched::every(period_ms)) }
    }

    pub fn push(&self, event: &PrefixEvent) {
        let encoded = wire::encode(event);
        match (encoded, self.held.lock()) {
            (Ok(bytes), Ok(mut held)) => held.held_mut().extend_from_slice(&bytes),
            (Err(e), _) => log::warn!("prefix event not kept for the service: {e}"),
            (_, Err(_)) => log::warn!("prefix event not kept for the service: outbox lock poisoned"),
        }
    }

    /// Sends what is held if a period passed since the last message, or at once when `idle`.
    pub fn send_if_due(&self, idle: bool) {
        self.send_when(|held, now| held.take_if_due(idle, now));
    }

    /// Sends what is held unless news went less than
    /// [`NEWS_MS`](crate::state::schedule::NEWS_MS) ago ([`Batched::take_news`]).
    pub fn send_news(&self) {
        self.send_when(|held, now| held.take_news(now));
    }

    /// Sends what is held.
    pub fn send(&self) {
        self.send_when(|held, now| held.take(now));
    }

    fn send_when(&self, take: impl FnOnce(&mut Batched<Vec<u8>>, u64) -> Option<Vec<u8>>) {
        let now = self.host.now_ms();
        let Some(bytes) = self.held.lock().ok().and_then(|mut held| take(&mut held, now)) else {
            return;
        };
        // A queue that is not there yet (the service not started) loses these events; the index
        // is a hint, and the next requests record their prefixes again.
        if let Err(e) = self.host.enqueue(keys::PREFIX_QUEUE, &bytes) {
            log::warn!("prefix events not sent to the service: {e}");
        }
    }
}

impl std::fmt::Debug for PrefixOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixOutbox").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::state::prefix::Tier;
    use crate::testing::test;

    fn stored(text: &str) -> PrefixEvent {
        PrefixEvent::Stored { model: "m".into(), worker: "A".into(), text: text.into(), tier: Tier::Gpu, sent_ms: 0 }
    }

    fn sent(host: &MemoryHost) -> Vec<Vec<PrefixEvent>> {
        host.drain(keys::PREFIX_QUEUE).iter().map(|m| wire::decode_each(m).unwrap()).collect()
    }

    #[test]
    fn a_busy_vm_sends_its_events_as_one_message_per_period() {
        let host = Arc::new(MemoryHost::default());
        let outbox = PrefixOutbox::new(Arc::clone(&host) as Arc<dyn Host>, 5);
        outbox.push(&stored("a"));
        outbox.send_if_due(false);
        assert_eq!(sent(&host), [vec![stored("a")]], "the first event goes at once");
        outbox.push(&stored("b"));
        outbox.push(&stored("c"));
        host.advance_ms(4);
        outbox.send_if_due(false);
        assert!(sent(&host).is_empty(), "held within the period");
        host.advance_ms(1);
        outbox.send_if_due(false);
        assert_eq!(sent(&host), [vec![stored("b"), stored("c")]]);
    }

    #[test]
    fn an_idle_vm_sends_at_once_and_nothing_is_sent_for_nothing() {
        let host = Arc::new(MemoryHost::default());
        let outbox = PrefixOutbox::new(Arc::clone(&host) as Arc<dyn Host>, 5);
        outbox.push(&stored("a"));
        outbox.send();
        outbox.push(&stored("b"));
        outbox.send_if_due(true);
        outbox.send_if_due(true);
        outbox.send();
        assert_eq!(sent(&host), [vec![stored("a")], vec![stored("b")]]);
    }
}
