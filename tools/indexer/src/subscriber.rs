//! One ZeroMQ SUB subscription per engine rank (spec §7): rank r of a worker publishes on the
//! configured port + r, as SGLang offsets it. Sequence numbers are checked: a gap is repaired from
//! the engine's replay endpoint when one is configured (and the rank's entries are dropped when it
//! cannot be, since a missed removal would leave a block the engine no longer has); a sequence
//! going backwards means the publisher restarted, and the rank's entries are dropped before its new
//! events apply. A subscriber that joins late asks the replay endpoint for what it missed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sgl_envoy_router::config::RouterConfig;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::events::{decode_batch, decode_frames, replay_frames, EventBatch};
use crate::relay;
use crate::state::App;

/// What a replay answer may take before the gap counts as unrepairable.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Reconnection backoff bounds.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub worker: String,
    pub rank: u32,
    pub endpoint: String,
    pub replay: Option<String>,
}

/// `tcp://host:port` with the port offset by `rank`.
fn offset(endpoint: &str, rank: u32) -> String {
    match endpoint.rsplit_once(':').and_then(|(base, port)| Some((base, port.parse::<u32>().ok()?))) {
        Some((base, port)) => format!("{base}:{}", port + rank),
        None => endpoint.to_string(),
    }
}

/// Every rank of every worker that publishes events.
pub fn subscriptions(config: &RouterConfig) -> Vec<Subscription> {
    config
        .workers
        .iter()
        .filter_map(|w| Some((w, w.kv_events.as_ref()?)))
        .flat_map(|(w, endpoint)| {
            (0..w.dp_size.max(1)).map(move |rank| Subscription {
                worker: w.id.clone(),
                rank,
                endpoint: offset(endpoint, rank),
                replay: w.kv_events_replay.as_ref().map(|r| offset(r, rank)),
            })
        })
        .collect()
}

/// Live batches a rank holds while a repair is out; past it the repair is given up and the rank's
/// entries dropped, so a slow replay cannot make the subscriber hold memory without end.
pub const MAX_HELD_BATCHES: usize = 4096;
/// Batches one repair may ask for (SGLang keeps 10,000 by default): a larger gap drops the rank.
pub const MAX_REPLAY_BATCHES: u64 = 10_000;
/// Payload bytes one replay may bring in all.
pub const MAX_REPLAY_BYTES: usize = 64 << 20;
/// Messages one replay may answer with (its buffer past `until` comes too, and is skipped).
const MAX_REPLAY_MESSAGES: u64 = 2 * MAX_REPLAY_BATCHES;

/// Why a rank's entries were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The publisher's sequence went back: it restarted, and what it said before is void.
    Restart,
    /// Batches were missed and could not be replayed: a missed removal would leave a block the
    /// engine no longer has.
    Unrepaired,
    /// A repair took so long that the live batches held behind it reached their bound.
    Overflow,
    /// The connection to the engine was made anew: a restarted publisher's sequence may already
    /// be past ours, so only its replay from 0 is trusted.
    Reconnected,
}

/// What the subscriber does next for one rank.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Apply(EventBatch),
    Drop(Dropped),
    /// Ask the replay endpoint for batches `from..until`; live batches are held until it answers.
    Repair {
        from: u64,
        until: u64,
    },
}

/// One rank's sequence: applies batches in order, asks for repairs of gaps and holds what comes
/// live meanwhile. Pure, so every path is tested without sockets.
#[derive(Debug)]
pub struct Sequencer {
    next: Option<u64>,
    can_replay: bool,
    repairing: Option<(u64, u64)>,
    held: std::collections::VecDeque<(u64, EventBatch)>,
    reconnected: bool,
}

impl Sequencer {
    pub fn new(can_replay: bool) -> Self {
        Self { next: None, can_replay, repairing: None, held: Default::default(), reconnected: false }
    }

    /// Whether a repair is out.
    pub fn repairing(&self) -> bool {
        self.repairing.is_some()
    }

    /// The engine connection was made again (see [`Dropped::Reconnected`]): what the rank held is
    /// dropped with the next batch, which starts over as a late join.
    pub fn reconnected(&mut self) {
        self.next = None;
        self.repairing = None;
        self.held.clear();
        self.reconnected = true;
    }

    /// A live batch arrived.
    pub fn live(&mut self, seq: u64, batch: EventBatch) -> Vec<Step> {
        if std::mem::take(&mut self.reconnected) {
            let mut steps = vec![Step::Drop(Dropped::Reconnected)];
            steps.extend(self.live(seq, batch));
            return steps;
        }
        if self.repairing.is_some() {
            if self.held.len() < MAX_HELD_BATCHES {
                self.held.push_back((seq, batch));
                return Vec::new();
            }
            self.repairing = None;
            self.held.clear();
            self.next = Some(seq.wrapping_add(1));
            return vec![Step::Drop(Dropped::Overflow), Step::Apply(batch)];
        }
        let mut steps = Vec::new();
        match self.next {
            Some(next) if seq < next => steps.push(Step::Drop(Dropped::Restart)),
            Some(next) if seq > next => {
                if self.can_replay && seq - next <= MAX_REPLAY_BATCHES {
                    return self.start_repair(next, seq, batch);
                }
                steps.push(Step::Drop(Dropped::Unrepaired));
            }
            // Joined late (or ZeroMQ's slow joiner lost the first batches): fetch the history.
            None if seq > 0 && self.can_replay => return self.start_repair(0, seq, batch),
            _ => {}
        }
        self.next = Some(seq.wrapping_add(1));
        steps.push(Step::Apply(batch));
        steps
    }

    fn start_repair(&mut self, from: u64, until: u64, batch: EventBatch) -> Vec<Step> {
        self.repairing = Some((from, until));
        self.held.push_back((until, batch));
        self.next = Some(until.wrapping_add(1));
        vec![Step::Repair { from, until }]
    }

    /// The replay answered (`None`: it failed or timed out): the repaired batches, then what was
    /// held, in order.
    pub fn replayed(&mut self, batches: Option<Vec<(u64, EventBatch)>>) -> Vec<Step> {
        let Some((from, until)) = self.repairing.take() else { return Vec::new() };
        let mut steps = Vec::new();
        match batches {
            // Joining late, whatever the buffer still has is better than nothing: what it lost
            // are stores we never heard of, not removals.
            Some(b) if from == 0 && b.iter().all(|(s, _)| *s < until) => {
                steps.extend(b.into_iter().map(|(_, batch)| Step::Apply(batch)));
            }
            Some(b) if b.len() as u64 == until - from && b.iter().zip(from..).all(|((s, _), want)| *s == want) => {
                steps.extend(b.into_iter().map(|(_, batch)| Step::Apply(batch)));
            }
            _ => steps.push(Step::Drop(Dropped::Unrepaired)),
        }
        let held = std::mem::take(&mut self.held);
        self.next = held.front().map(|(s, _)| *s);
        for (seq, batch) in held {
            steps.extend(self.live(seq, batch));
        }
        steps
    }
}

/// A replay under way: the batches it brought, or `None` when it failed or timed out.
type Replay = std::pin::Pin<Box<dyn std::future::Future<Output = Option<Vec<(u64, EventBatch)>>> + Send>>;

/// Runs one subscription forever, reconnecting with backoff.
pub async fn run(sub: Subscription, app: Arc<App>) {
    let mut backoff = BACKOFF_MIN;
    let mut first_connection = true;
    let connections = Arc::new(AtomicU64::new(0));
    let relayed = |endpoint: &str, connections: Arc<AtomicU64>| {
        let upstream = endpoint.trim_start_matches("tcp://").to_string();
        relay::start(upstream, Arc::clone(&app.stats.oversized), connections)
    };
    let (events, replay) = loop {
        let events = relayed(&sub.endpoint, Arc::clone(&connections)).await;
        let replay = match &sub.replay {
            Some(r) => relayed(r, Arc::default()).await.map(Some),
            None => Ok(None),
        };
        match (events, replay) {
            (Ok(e), Ok(r)) => break (e, r),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("sgl-indexer: {} rank {}: no loopback relay: {e}", sub.worker, sub.rank);
                tokio::time::sleep(BACKOFF_MAX).await;
            }
        }
    };
    let mut sequencer = Sequencer::new(replay.is_some());
    loop {
        let mut socket = SubSocket::new();
        let connected = match socket.connect(&events).await {
            Ok(()) => socket.subscribe("").await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = connected {
            eprintln!("sgl-indexer: {} rank {}: cannot subscribe to {}: {e}", sub.worker, sub.rank, sub.endpoint);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            continue;
        }
        backoff = BACKOFF_MIN;
        if first_connection {
            app.stats.subscribed(1);
            first_connection = false;
        } else {
            sequencer.reconnected();
        }
        let mut seen_connections = connections.load(Ordering::Relaxed);
        let mut repair: Option<Replay> = None;
        loop {
            // The socket is drained while a repair is out, so neither it nor the engine's
            // high-water mark fills behind a slow replay.
            let event = tokio::select! {
                message = socket.recv() => Ok(message),
                replayed = async {
                    match repair.as_mut() {
                        Some(f) => f.await,
                        None => std::future::pending().await,
                    }
                } => Err(replayed),
            };
            let steps = match event {
                Ok(Ok(message)) => {
                    let now = connections.load(Ordering::Relaxed);
                    if now != seen_connections {
                        seen_connections = now;
                        sequencer.reconnected();
                    }
                    match decode_frames(&message.into_vec()) {
                        Ok((seq, batch)) => sequencer.live(seq, batch),
                        Err(e) => {
                            app.stats.malformed(1);
                            eprintln!(
                                "sgl-indexer: {} rank {}: malformed event frames dropped: {e}",
                                sub.worker, sub.rank
                            );
                            continue;
                        }
                    }
                }
                Ok(Err(e)) => {
                    eprintln!("sgl-indexer: {} rank {}: subscription broke: {e}", sub.worker, sub.rank);
                    break;
                }
                Err(replayed) => {
                    repair = None;
                    if let Some(batches) = &replayed {
                        app.stats.replayed(batches.len() as u64);
                    }
                    sequencer.replayed(replayed)
                }
            };
            for step in steps {
                match step {
                    Step::Apply(batch) => app.apply(&sub.worker, sub.rank, &batch),
                    Step::Drop(why) => {
                        match why {
                            Dropped::Restart => app.stats.restarts(1),
                            Dropped::Unrepaired => {
                                app.stats.unrepaired(1);
                                eprintln!(
                                    "sgl-indexer: {} rank {}: batches missed and not replayable; its entries are dropped",
                                    sub.worker, sub.rank
                                );
                            }
                            Dropped::Overflow => app.stats.repair_overflows(1),
                            Dropped::Reconnected => app.stats.reconnects(1),
                        }
                        app.clear(&sub.worker, Some(sub.rank));
                    }
                    Step::Repair { from, until } => {
                        if from > 0 {
                            app.stats.gaps(1);
                        }
                        let endpoint = replay.clone().unwrap_or_default();
                        repair = Some(Box::pin(async move {
                            tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, from, until))
                                .await
                                .ok()
                                .flatten()
                        }));
                    }
                }
            }
        }
    }
}

/// Asks a replay ROUTER for the batches from `from` on; keeps those before `until`. SGLang answers
/// each batch as `["", topic, seq, payload]` after the DEALER strips the identity, vLLM as
/// `["", seq, payload]`; both end with seq -1. Bounded in messages and bytes.
async fn fetch_replay(endpoint: String, from: u64, until: u64) -> Option<Vec<(u64, EventBatch)>> {
    let mut socket = DealerSocket::new();
    socket.connect(&endpoint).await.ok()?;
    let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]).ok()?;
    socket.send(request).await.ok()?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for _ in 0..MAX_REPLAY_MESSAGES {
        let frames = socket.recv().await.ok()?.into_vec();
        let (seq, payload) = replay_frames(&frames).ok()?;
        if seq == u64::MAX {
            return Some(out);
        }
        if seq >= from && seq < until {
            bytes = bytes.saturating_add(payload.len());
            if bytes > MAX_REPLAY_BYTES {
                return None;
            }
            out.push((seq, decode_batch(payload).ok()?));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(tag: f64) -> EventBatch {
        EventBatch { ts: tag, events: vec![], dp_rank: None }
    }

    fn applied(steps: &[Step]) -> Vec<f64> {
        steps.iter().filter_map(|s| if let Step::Apply(b) = s { Some(b.ts) } else { None }).collect()
    }

    #[test]
    fn a_gap_is_repaired_before_what_came_live_after_it() {
        let mut s = Sequencer::new(true);
        assert_eq!(applied(&s.live(0, b(0.0))), [0.0]);
        assert_eq!(s.live(3, b(3.0)), [Step::Repair { from: 1, until: 3 }]);
        assert!(s.live(4, b(4.0)).is_empty(), "held while the repair is out");
        let steps = s.replayed(Some(vec![(1, b(1.0)), (2, b(2.0))]));
        assert_eq!(applied(&steps), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(applied(&s.live(5, b(5.0))), [5.0]);
    }

    #[test]
    fn a_replay_that_does_not_cover_the_gap_drops_the_rank_and_goes_on() {
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        s.live(3, b(3.0));
        let steps = s.replayed(Some(vec![(2, b(2.0))]));
        assert_eq!(steps[0], Step::Drop(Dropped::Unrepaired));
        assert_eq!(applied(&steps), [3.0]);
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        s.live(2, b(2.0));
        assert_eq!(s.replayed(None)[0], Step::Drop(Dropped::Unrepaired), "no answer in time");
    }

    #[test]
    fn a_late_join_takes_what_the_buffer_still_has() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.live(5, b(5.0)), [Step::Repair { from: 0, until: 5 }]);
        assert_eq!(applied(&s.replayed(Some(vec![(3, b(3.0)), (4, b(4.0))]))), [3.0, 4.0, 5.0]);
    }

    #[test]
    fn without_replay_gaps_drop_the_rank_and_restarts_always_do() {
        let mut s = Sequencer::new(false);
        assert_eq!(applied(&s.live(4, b(4.0))), [4.0], "a late join without replay starts where it is");
        assert_eq!(s.live(6, b(6.0))[0], Step::Drop(Dropped::Unrepaired));
        assert_eq!(s.live(0, b(0.0))[0], Step::Drop(Dropped::Restart));
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        assert_eq!(s.live(MAX_REPLAY_BATCHES + 2, b(1.0))[0], Step::Drop(Dropped::Unrepaired), "too large to ask");
    }

    /// A restarted publisher may be past our sequence by the time we reconnect: after a new
    /// connection the rank starts over from the engine's replay.
    #[test]
    fn a_new_connection_drops_the_rank_and_starts_over_from_replay() {
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        s.live(1, b(1.0));
        s.reconnected();
        assert_eq!(s.live(5, b(5.0)), [Step::Drop(Dropped::Reconnected), Step::Repair { from: 0, until: 5 }]);
        assert_eq!(applied(&s.replayed(Some(vec![(4, b(4.0))]))), [4.0, 5.0]);
        assert_eq!(applied(&s.live(6, b(6.0))), [6.0], "and then goes on as usual");
    }

    /// A replay that never answers cannot make the rank hold live batches without end.
    #[test]
    fn live_batches_held_behind_a_repair_are_bounded() {
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        s.live(2, b(2.0));
        for seq in 3..2 + MAX_HELD_BATCHES as u64 {
            assert!(s.live(seq, b(0.0)).is_empty());
        }
        let at_bound = 2 + MAX_HELD_BATCHES as u64;
        let steps = s.live(at_bound, b(9.0));
        assert_eq!(steps, [Step::Drop(Dropped::Overflow), Step::Apply(b(9.0))]);
        assert!(!s.repairing());
        assert!(s.replayed(Some(vec![(1, b(1.0))])).is_empty(), "a late answer is ignored");
        assert_eq!(applied(&s.live(at_bound + 1, b(10.0))), [10.0]);
    }

    #[test]
    fn every_rank_gets_its_offset_ports() {
        let config = sgl_envoy_router::config::parse_and_validate(
            r#"{"workers": [
                {"id": "A", "url": "http://127.0.0.1:1", "model": "m", "dp_size": 2,
                 "kv_events": "tcp://10.0.0.1:5557", "kv_events_replay": "tcp://10.0.0.1:5600"},
                {"id": "B", "url": "http://127.0.0.1:2", "model": "m"}],
                "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "random"}}}}]}}}"#,
        )
        .unwrap();
        let subs = subscriptions(&config);
        assert_eq!(subs.len(), 2, "B publishes nothing");
        assert_eq!(
            (subs[1].endpoint.as_str(), subs[1].replay.as_deref()),
            ("tcp://10.0.0.1:5558", Some("tcp://10.0.0.1:5601"))
        );
        assert_eq!(subs[0].rank, 0);
    }
}
