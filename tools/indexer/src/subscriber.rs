//! One ZeroMQ SUB subscription per engine rank (spec §7): rank r of a worker publishes on the
//! configured port + r, as SGLang offsets it. Sequence numbers are checked: a gap is repaired from
//! the engine's replay endpoint when one is configured (and the rank's entries are dropped when it
//! cannot be, since a missed removal would leave a block the engine no longer has); a sequence
//! going backwards means the publisher restarted, and the rank's entries are dropped before its new
//! events apply. A subscriber that joins late asks the replay endpoint for what it missed.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sgl_envoy_router::config::RouterConfig;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::events::{decode_batch, decode_frames, decode_seq, EventBatch};
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

/// Where this rank's sequence stands.
#[derive(Debug, Default)]
struct Cursor {
    next: Option<u64>,
}

/// Runs one subscription forever, reconnecting with backoff.
pub async fn run(sub: Subscription, app: Arc<App>) {
    let mut backoff = BACKOFF_MIN;
    let mut first_connection = true;
    loop {
        let mut socket = SubSocket::new();
        let connected = match socket.connect(&sub.endpoint).await {
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
        let mut cursor = Cursor::default();
        loop {
            let message = match socket.recv().await {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("sgl-indexer: {} rank {}: subscription broke: {e}", sub.worker, sub.rank);
                    break;
                }
            };
            let frames = message.into_vec();
            match decode_frames(&frames) {
                Ok((seq, batch)) => receive(&sub, &app, &mut cursor, seq, batch).await,
                Err(e) => {
                    app.stats.malformed(1);
                    eprintln!("sgl-indexer: {} rank {}: malformed event frames dropped: {e}", sub.worker, sub.rank);
                }
            }
        }
    }
}

async fn receive(sub: &Subscription, app: &App, cursor: &mut Cursor, seq: u64, batch: EventBatch) {
    match cursor.next {
        Some(next) if seq < next => {
            // The publisher restarted (its sequence starts again at 0): what it said before is void.
            app.stats.restarts(1);
            app.clear(&sub.worker, Some(sub.rank));
        }
        Some(next) if seq > next => {
            app.stats.gaps(1);
            repair(sub, app, next, seq).await;
        }
        None if seq > 0 && sub.replay.is_some() => {
            // Joined late (or ZeroMQ's slow joiner lost the first batches): fetch the history.
            repair(sub, app, 0, seq).await;
        }
        _ => {}
    }
    app.apply(&sub.worker, sub.rank, &batch);
    cursor.next = Some(seq.wrapping_add(1));
}

/// Replays batches `from..until` from the engine's replay endpoint; when that is impossible, drops
/// the rank's entries rather than keep a view with holes.
async fn repair(sub: &Subscription, app: &App, from: u64, until: u64) {
    let replayed = match &sub.replay {
        Some(endpoint) => tokio::time::timeout(REPLAY_TIMEOUT, replay(endpoint, from, until)).await.ok().flatten(),
        None => None,
    };
    match replayed {
        Some(batches) if batches.first().map(|(s, _)| *s) == Some(from) || (from == 0 && !batches.is_empty()) => {
            app.stats.replayed(batches.len() as u64);
            for (_, batch) in batches {
                app.apply(&sub.worker, sub.rank, &batch);
            }
        }
        Some(batches) if from == 0 && batches.is_empty() => {}
        _ => {
            app.stats.unrepaired(1);
            eprintln!(
                "sgl-indexer: {} rank {}: batches {from}..{until} missed and not replayable; its entries are dropped",
                sub.worker, sub.rank
            );
            app.clear(&sub.worker, Some(sub.rank));
        }
    }
}

/// Asks a replay ROUTER for the batches from `from` on; keeps those before `until`.
async fn replay(endpoint: &str, from: u64, until: u64) -> Option<Vec<(u64, EventBatch)>> {
    let mut socket = DealerSocket::new();
    socket.connect(endpoint).await.ok()?;
    let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]).ok()?;
    socket.send(request).await.ok()?;
    let mut out = Vec::new();
    loop {
        let frames = socket.recv().await.ok()?.into_vec();
        // [empty delimiter, seq, payload]; seq -1 ends the replay.
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] => (decode_seq(seq).ok()?, payload),
            [seq, payload] => (decode_seq(seq).ok()?, payload),
            _ => return None,
        };
        if seq == u64::MAX {
            return Some(out);
        }
        if seq >= from && seq < until {
            out.push((seq, decode_batch(payload).ok()?));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
