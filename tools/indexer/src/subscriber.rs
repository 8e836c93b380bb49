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
use crate::state::{App, Warmth};

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
    /// engine no longer has. A peer's snapshot older than the engine's replay buffer is one.
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
    /// Apply the batch numbered `seq`; `replayed` when it came from the replay endpoint.
    Apply {
        seq: u64,
        batch: EventBatch,
        replayed: bool,
    },
    Drop(Dropped),
    /// Ask the replay endpoint for batches from `from` on — those before `until`, or, without
    /// one, everything it holds (a warm start); live batches are held until it answers.
    Repair {
        from: u64,
        until: Option<u64>,
    },
}

/// One rank's sequence: applies batches in order, asks for repairs of gaps, warms up from the
/// engine's replay at every (re)subscription and holds what comes live meanwhile. Pure, so every
/// path is tested without sockets.
#[derive(Debug)]
pub struct Sequencer {
    next: Option<u64>,
    can_replay: bool,
    repairing: Option<(u64, Option<u64>)>,
    held: std::collections::VecDeque<(u64, EventBatch)>,
    /// The batches the last replay brought (`from..next`): their live copies may still arrive
    /// (a publisher sends a batch live before its replay buffer has it, and our subscription may
    /// read it after the replay answered), and are not news — until the first batch past them.
    replayed: Option<(u64, u64)>,
}

impl Sequencer {
    pub fn new(can_replay: bool) -> Self {
        Self::resuming(can_replay, None)
    }

    /// A rank whose entries a peer's snapshot brought, current to `next - 1`.
    pub fn resuming(can_replay: bool, next: Option<u64>) -> Self {
        Self { next, can_replay, repairing: None, held: Default::default(), replayed: None }
    }

    /// Whether a repair is out.
    pub fn repairing(&self) -> bool {
        self.repairing.is_some()
    }

    /// The subscription reached the engine for the first time: ask its replay endpoint for
    /// everything it holds past what the rank already has, without waiting for a live event (an
    /// idle engine may publish none for a long time).
    pub fn subscribed(&mut self) -> Vec<Step> {
        self.warm(self.next.unwrap_or(0))
    }

    /// The engine connection was made again (see [`Dropped::Reconnected`]): what the rank held is
    /// dropped, and it warms up from the engine's replay as on a first subscription.
    pub fn reconnected(&mut self) -> Vec<Step> {
        self.next = None;
        self.repairing = None;
        self.held.clear();
        self.replayed = None;
        let mut steps = vec![Step::Drop(Dropped::Reconnected)];
        steps.extend(self.warm(0));
        steps
    }

    fn warm(&mut self, from: u64) -> Vec<Step> {
        if !self.can_replay || self.repairing.is_some() {
            return Vec::new();
        }
        self.repairing = Some((from, None));
        vec![Step::Repair { from, until: None }]
    }

    /// A live batch arrived.
    pub fn live(&mut self, seq: u64, batch: EventBatch) -> Vec<Step> {
        if self.repairing.is_some() {
            if self.held.len() < MAX_HELD_BATCHES {
                self.held.push_back((seq, batch));
                return Vec::new();
            }
            self.repairing = None;
            self.held.clear();
            self.next = Some(seq.wrapping_add(1));
            return vec![Step::Drop(Dropped::Overflow), Step::Apply { seq, batch, replayed: false }];
        }
        match self.replayed {
            Some((from, next)) if seq >= from && seq < next => return Vec::new(),
            Some(_) => self.replayed = None,
            None => {}
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
        steps.push(Step::Apply { seq, batch, replayed: false });
        steps
    }

    fn start_repair(&mut self, from: u64, until: u64, batch: EventBatch) -> Vec<Step> {
        self.repairing = Some((from, Some(until)));
        self.held.push_back((until, batch));
        self.next = Some(until.wrapping_add(1));
        vec![Step::Repair { from, until: Some(until) }]
    }

    /// The replay answered (`None`: it failed or timed out): the repaired batches, then what was
    /// held, in order.
    pub fn replayed(&mut self, batches: Option<Vec<(u64, EventBatch)>>) -> Vec<Step> {
        let Some((from, until)) = self.repairing.take() else { return Vec::new() };
        let window = batches.as_ref().and_then(|b| Some((b.first()?.0, b.last()?.0.wrapping_add(1))));
        let apply = |b: Vec<(u64, EventBatch)>| {
            b.into_iter().map(|(seq, batch)| Step::Apply { seq, batch, replayed: true }).collect::<Vec<_>>()
        };
        let mut steps = Vec::new();
        match (until, batches) {
            (Some(until), b) => {
                match b {
                    // Joining late, whatever the buffer still has is better than nothing: what it
                    // lost are stores we never heard of, not removals.
                    Some(b) if from == 0 && b.iter().all(|(s, _)| *s < until) => steps.extend(apply(b)),
                    Some(b)
                        if b.len() as u64 == until - from && b.iter().zip(from..).all(|((s, _), want)| *s == want) =>
                    {
                        steps.extend(apply(b))
                    }
                    _ => steps.push(Step::Drop(Dropped::Unrepaired)),
                }
                let held = std::mem::take(&mut self.held);
                self.next = held.front().map(|(s, _)| *s);
                self.replayed = window;
                for (seq, batch) in held {
                    steps.extend(self.live(seq, batch));
                }
            }
            (None, answer) => {
                let resuming = from > 0;
                let failed = answer.is_none();
                let all = answer.unwrap_or_default();
                let (first, last) = (all.first().map(|(s, _)| *s), all.last().map(|(s, _)| *s));
                let fresh = if !resuming {
                    true
                } else if failed {
                    // Nothing says what was missed since the snapshot.
                    steps.push(Step::Drop(Dropped::Unrepaired));
                    true
                } else if last.is_none_or(|l| l < from - 1) {
                    // A publisher's buffer empties only when it restarts; one whose sequence is
                    // behind ours restarted too.
                    steps.push(Step::Drop(Dropped::Restart));
                    true
                } else if first.is_some_and(|f| f > from) {
                    // The buffer no longer reaches back to the batch after ours: a gap.
                    steps.push(Step::Drop(Dropped::Unrepaired));
                    true
                } else {
                    false
                };
                // After a drop the rank starts empty: whatever the buffer holds is better than
                // nothing (what it lost are stores never heard of, not removals).
                let keep: Vec<_> = if fresh { all } else { all.into_iter().filter(|(s, _)| *s >= from).collect() };
                self.next = last.map(|l| l.wrapping_add(1));
                steps.extend(apply(keep));
                self.replayed = window;
                // What came live meanwhile and the replay already brought is not news.
                let next = self.next;
                let held: Vec<_> =
                    std::mem::take(&mut self.held).into_iter().filter(|(s, _)| next.is_none_or(|n| *s >= n)).collect();
                for (seq, batch) in held {
                    steps.extend(self.live(seq, batch));
                }
            }
        }
        steps
    }
}

/// A replay under way: the batches it brought, or `None` when it failed or timed out.
type Replay = std::pin::Pin<Box<dyn std::future::Future<Output = Option<Vec<(u64, EventBatch)>>> + Send>>;

/// How often the subscriber looks for a new engine connection when nothing arrives: an idle
/// engine's reconnection is noticed within it, and its replay asked for at once.
const CONNECTION_CHECK: Duration = Duration::from_millis(50);

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
    // A rank a peer's snapshot brought resumes after the batch it is current to.
    let mut sequencer = Sequencer::resuming(replay.is_some(), app.resume_point(&sub.worker, sub.rank));
    let mut seen_connections = 0;
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
        }
        let mut repair: Option<Replay> = None;
        let mut check = tokio::time::interval(CONNECTION_CHECK);
        loop {
            // The socket is drained while a repair is out, so neither it nor the engine's
            // high-water mark fills behind a slow replay.
            let event = tokio::select! {
                message = socket.recv() => Event::Message(message),
                replayed = async {
                    match repair.as_mut() {
                        Some(f) => f.await,
                        None => std::future::pending().await,
                    }
                } => Event::Replayed(replayed),
                _ = check.tick() => Event::Check,
            };
            // Every new connection to the engine (its publisher may have restarted) starts the
            // rank over from the engine's replay; the first one warms it up.
            let mut steps = Vec::new();
            let now = connections.load(Ordering::Relaxed);
            if now != seen_connections {
                steps = if seen_connections == 0 { sequencer.subscribed() } else { sequencer.reconnected() };
                seen_connections = now;
                if steps.iter().any(|s| matches!(s, Step::Repair { .. })) {
                    repair = None;
                }
            }
            match event {
                Event::Check => {}
                Event::Message(Ok(message)) => match decode_frames(&message.into_vec()) {
                    Ok((seq, batch)) => steps.extend(sequencer.live(seq, batch)),
                    Err(e) => {
                        app.stats.malformed(1);
                        eprintln!("sgl-indexer: {} rank {}: malformed event frames dropped: {e}", sub.worker, sub.rank);
                    }
                },
                Event::Message(Err(e)) => {
                    eprintln!("sgl-indexer: {} rank {}: subscription broke: {e}", sub.worker, sub.rank);
                    break;
                }
                Event::Replayed(replayed) => {
                    repair = None;
                    if let Some(batches) = &replayed {
                        app.stats.replayed(batches.len() as u64);
                    }
                    steps.extend(sequencer.replayed(replayed));
                }
            }
            for step in steps {
                match step {
                    Step::Apply { seq, batch, replayed } => {
                        let source = if replayed { Warmth::Replay } else { Warmth::Live };
                        app.apply(&sub.worker, sub.rank, seq, &batch, source);
                    }
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
                        if from > 0 && until.is_some() {
                            app.stats.gaps(1);
                        }
                        let endpoint = replay.clone().unwrap_or_default();
                        // A warm start takes the whole buffer: the sequencer reads a restart or a
                        // gap since a peer's snapshot from what precedes `from`.
                        let from = if until.is_some() { from } else { 0 };
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

/// What woke a subscription up.
enum Event {
    Message(Result<ZmqMessage, zeromq::ZmqError>),
    Replayed(Option<Vec<(u64, EventBatch)>>),
    Check,
}

/// Asks a replay ROUTER for the batches from `from` on; keeps those before `until` (all of them
/// without one, for a warm start). SGLang answers each batch as `["", topic, seq, payload]` after
/// the DEALER strips the identity, vLLM as `["", seq, payload]`; both end with seq -1. Bounded in
/// messages and bytes.
async fn fetch_replay(endpoint: String, from: u64, until: Option<u64>) -> Option<Vec<(u64, EventBatch)>> {
    let until = until.unwrap_or(u64::MAX);
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
        steps.iter().filter_map(|s| if let Step::Apply { batch, .. } = s { Some(batch.ts) } else { None }).collect()
    }

    fn repair(from: u64, until: Option<u64>) -> Step {
        Step::Repair { from, until }
    }

    #[test]
    fn a_gap_is_repaired_before_what_came_live_after_it() {
        let mut s = Sequencer::new(true);
        assert_eq!(applied(&s.live(0, b(0.0))), [0.0]);
        assert_eq!(s.live(3, b(3.0)), [repair(1, Some(3))]);
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
        assert_eq!(s.live(5, b(5.0)), [repair(0, Some(5))]);
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
    /// connection the rank starts over from the engine's replay, asked at once.
    #[test]
    fn a_new_connection_drops_the_rank_and_starts_over_from_replay() {
        let mut s = Sequencer::new(true);
        s.live(0, b(0.0));
        s.live(1, b(1.0));
        assert_eq!(s.reconnected(), [Step::Drop(Dropped::Reconnected), repair(0, None)]);
        assert!(s.live(5, b(5.0)).is_empty(), "held behind the warm replay");
        assert_eq!(applied(&s.replayed(Some(vec![(3, b(3.0)), (4, b(4.0)), (5, b(5.0))]))), [3.0, 4.0, 5.0]);
        assert_eq!(applied(&s.live(6, b(6.0))), [6.0], "and then goes on as usual");
    }

    /// An idle engine publishes nothing: at subscription its replay buffer is asked at once.
    #[test]
    fn a_first_subscription_warms_up_from_the_whole_replay_buffer() {
        let mut s = Sequencer::new(true);
        assert_eq!(s.subscribed(), [repair(0, None)]);
        let steps = s.replayed(Some(vec![(0, b(0.0)), (1, b(1.0))]));
        assert_eq!(applied(&steps), [0.0, 1.0]);
        assert!(steps.iter().all(|s| matches!(s, Step::Apply { replayed: true, .. })));
        assert_eq!(applied(&s.live(2, b(2.0))), [2.0]);
        let mut quiet = Sequencer::new(true);
        quiet.subscribed();
        assert!(quiet.replayed(Some(vec![])).is_empty(), "nothing published yet");
        assert_eq!(applied(&quiet.live(0, b(0.0))), [0.0]);
        assert!(Sequencer::new(false).subscribed().is_empty(), "no replay endpoint: live only");
    }

    /// A publisher sends a batch live before its replay buffer holds it, and the subscription may
    /// read that live copy only after the replay (which had it) answered: not a restart.
    #[test]
    fn a_live_copy_of_a_replayed_batch_is_not_news() {
        let mut s = Sequencer::new(true);
        s.subscribed();
        assert_eq!(applied(&s.replayed(Some(vec![(0, b(0.0)), (1, b(1.0)), (2, b(2.0))]))), [0.0, 1.0, 2.0]);
        assert!(s.live(2, b(2.0)).is_empty(), "its live copy, late");
        assert_eq!(applied(&s.live(3, b(3.0))), [3.0]);
        assert_eq!(s.live(1, b(1.0))[0], Step::Drop(Dropped::Restart), "past the window a step back is a restart");
    }

    /// A peer's snapshot current to batch 4: the replay repairs from 5, or the rank is dropped
    /// when the buffer no longer reaches back to it, or when the publisher restarted since.
    #[test]
    fn resuming_from_a_snapshot_repairs_from_its_sequence_or_drops_the_rank() {
        let mut s = Sequencer::resuming(true, Some(5));
        assert_eq!(s.subscribed(), [repair(5, None)]);
        assert!(s.live(7, b(7.0)).is_empty());
        let steps = s.replayed(Some(vec![(3, b(3.0)), (4, b(4.0)), (5, b(5.0)), (6, b(6.0))]));
        assert_eq!(applied(&steps), [5.0, 6.0, 7.0], "only what the snapshot lacked, then what was held");
        assert!(!steps.iter().any(|s| matches!(s, Step::Drop(_))));

        let mut idle = Sequencer::resuming(true, Some(5));
        idle.subscribed();
        assert!(idle.replayed(Some(vec![(3, b(3.0)), (4, b(4.0))])).is_empty(), "nothing new: the view stands");
        assert_eq!(applied(&idle.live(5, b(5.0))), [5.0]);

        let mut old = Sequencer::resuming(true, Some(5));
        old.subscribed();
        let steps = old.replayed(Some(vec![(8, b(8.0)), (9, b(9.0))]));
        assert_eq!(steps[0], Step::Drop(Dropped::Unrepaired), "batches 5 to 7 are gone from the buffer");
        assert_eq!(applied(&steps), [8.0, 9.0], "then the rank starts over from what the buffer has");

        for buffer in [vec![], vec![(0, b(0.0)), (1, b(1.0))]] {
            let mut restarted = Sequencer::resuming(true, Some(5));
            restarted.subscribed();
            let steps = restarted.replayed(Some(buffer.clone()));
            assert_eq!(steps[0], Step::Drop(Dropped::Restart), "{buffer:?}");
            assert_eq!(applied(&steps).len(), buffer.len());
        }
        let mut unanswered = Sequencer::resuming(true, Some(5));
        unanswered.subscribed();
        assert_eq!(unanswered.replayed(None), [Step::Drop(Dropped::Unrepaired)]);

        let mut no_replay = Sequencer::resuming(false, Some(5));
        assert!(no_replay.subscribed().is_empty(), "without replay the snapshot stands");
        assert_eq!(applied(&no_replay.live(5, b(5.0))), [5.0]);
        assert_eq!(no_replay.live(9, b(9.0))[0], Step::Drop(Dropped::Unrepaired));
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
        assert_eq!(
            steps,
            [Step::Drop(Dropped::Overflow), Step::Apply { seq: at_bound, batch: b(9.0), replayed: false }]
        );
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
