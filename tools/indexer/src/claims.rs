//! Claims: matches still being routed. Between a router's match call and its routed notice there
//! is a short window in which the blocks it is about to send belong to no engine; concurrent
//! requests sharing a new prefix would all miss in it and scatter. A router that promises a notice
//! claims what its match left uncovered; a query that would gain enough from that claim waits for
//! the notice (never past the claim's window) and matches again, finding the speculative entries.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Claims open at once per model: each holds the queries sharing its prefix for a moment, so a
/// caller making matches without routing them must not be able to hold everyone.
pub const MAX_CLAIMS_PER_MODEL: usize = 256;

#[derive(Debug)]
struct Claim {
    handle: u64,
    keys: Arc<[u64]>,
    until_ms: u64,
    routed: watch::Sender<bool>,
}

/// What a query does next.
#[derive(Debug)]
pub enum Turn {
    /// A claim would cover more: wait for its notice until `until_ms`, then match again. The
    /// claim is `handle`'s, and shares `shared_blocks` with the query.
    Wait {
        routed: watch::Receiver<bool>,
        until_ms: u64,
        handle: u64,
        shared_blocks: usize,
    },
    Go,
}

#[derive(Debug)]
pub struct Claims {
    window_ms: u64,
    block_tokens: u64,
    /// Per model, the least gain worth waiting for (the smallest `min_hit_tokens` of its remote
    /// cache-aware policies); models without one never claim.
    min_gain: HashMap<String, u64>,
    open: Mutex<HashMap<String, Vec<Claim>>>,
    /// Notices for handles no claim here had, until the window ends: (handle, until).
    routed_recent: Mutex<Vec<(u64, u64)>>,
}

impl Claims {
    pub fn new(window_ms: u64, block_tokens: u32, min_gain: HashMap<String, u64>) -> Self {
        Self {
            window_ms,
            block_tokens: u64::from(block_tokens.max(1)),
            min_gain,
            open: Mutex::default(),
            routed_recent: Mutex::default(),
        }
    }

    /// `best_tokens` is what the index already matched for `keys`. A query waits on the open claim
    /// that shares the most with it if that beats `best_tokens` by the model's gain (when it
    /// `may_wait`); otherwise, when it `claims_as` a handle and leaves that much uncovered, it
    /// opens its own claim. Checking and claiming under one lock puts concurrent queries in order.
    pub fn turn(
        &self,
        model: &str,
        keys: &Arc<[u64]>,
        best_tokens: u64,
        claims_as: Option<u64>,
        may_wait: bool,
        now_ms: u64,
    ) -> Turn {
        let Some(&gain) = self.min_gain.get(model) else { return Turn::Go };
        let Ok(mut open) = self.open.lock() else { return Turn::Go };
        let claims = open.entry(model.to_string()).or_default();
        claims.retain(|c| c.until_ms > now_ms);
        if may_wait {
            let shared = |c: &Claim| c.keys.iter().zip(keys.iter()).take_while(|(a, b)| a == b).count();
            let best_claim = claims.iter().map(|c| (shared(c), c)).max_by_key(|(s, _)| *s);
            if let Some((shared_blocks, claim)) = best_claim {
                if shared_blocks as u64 * self.block_tokens >= best_tokens.saturating_add(gain) {
                    return Turn::Wait {
                        routed: claim.routed.subscribe(),
                        until_ms: claim.until_ms,
                        handle: claim.handle,
                        shared_blocks,
                    };
                }
            }
        }
        let uncovered = (keys.len() as u64 * self.block_tokens).saturating_sub(best_tokens);
        if let Some(handle) = claims_as.filter(|_| uncovered >= gain && claims.len() < MAX_CLAIMS_PER_MODEL) {
            let (routed, _) = watch::channel(false);
            claims.push(Claim { handle, keys: Arc::clone(keys), until_ms: now_ms + self.window_ms, routed });
        }
        Turn::Go
    }

    /// Whether a query of `keys` that already matched `best_tokens` could wait on a claim or
    /// open one: only then is a replica's arbiter asked.
    pub fn could_matter(&self, model: &str, keys: usize, best_tokens: u64) -> bool {
        self.min_gain
            .get(model)
            .is_some_and(|gain| (keys as u64 * self.block_tokens).saturating_sub(best_tokens) >= *gain)
    }

    /// Another replica's claim this one's queries wait on: its notice reaches every replica, and
    /// wakes them here. Opens it unless it is open already.
    pub fn mirror(&self, model: &str, handle: u64, keys: Arc<[u64]>, until_ms: u64) -> watch::Receiver<bool> {
        let already = self.routed_recent.lock().is_ok_and(|r| r.iter().any(|(h, _)| *h == handle));
        let Ok(mut open) = self.open.lock() else { return watch::channel(true).1 };
        let claims = open.entry(model.to_string()).or_default();
        if let Some(claim) = claims.iter().find(|c| c.handle == handle) {
            return claim.routed.subscribe();
        }
        let (routed, receiver) = watch::channel(already);
        if claims.len() < MAX_CLAIMS_PER_MODEL {
            claims.push(Claim { handle, keys, until_ms, routed });
        }
        receiver
    }

    /// The notice for `handle` arrived (its speculative entries are in): wake whoever waits on it.
    /// The claim stays, routed, until its window ends: a replica's query that the arbiter sends to
    /// wait on it may reach the arbiter before that replica heard the notice, and waits for it
    /// there rather than finding nothing. A notice for a claim not (yet) mirrored here is
    /// remembered for as long, so mirroring it later does not wait for a notice already come.
    pub fn routed(&self, handle: u64, now_ms: u64) {
        let Ok(mut open) = self.open.lock() else { return };
        for claims in open.values_mut() {
            if let Some(claim) = claims.iter().find(|c| c.handle == handle) {
                claim.routed.send_replace(true);
                return;
            }
        }
        drop(open);
        if let Ok(mut recent) = self.routed_recent.lock() {
            recent.retain(|(_, until)| *until > now_ms);
            if recent.len() < MAX_CLAIMS_PER_MODEL {
                recent.push((handle, now_ms + self.window_ms));
            }
        }
    }

    /// Claims open and not yet routed, across models (for `/metrics`).
    pub fn open(&self, now_ms: u64) -> usize {
        self.open
            .lock()
            .map(|o| o.values().flatten().filter(|c| c.until_ms > now_ms && !*c.routed.borrow()).count())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims::new(20, 16, HashMap::from([("m".to_string(), 64)]))
    }

    fn keys(range: std::ops::Range<u64>) -> Arc<[u64]> {
        range.collect::<Vec<_>>().into()
    }

    #[test]
    fn a_query_sharing_enough_with_an_open_claim_waits_for_its_notice() {
        let c = claims();
        assert!(matches!(c.turn("m", &keys(0..100), 0, Some(1), true, 1000), Turn::Go));
        // Shares 10 blocks = 160 tokens with claim 1, beyond its own (empty) match by ≥ 64.
        let Turn::Wait { routed, until_ms, handle, shared_blocks } = c.turn("m", &keys(0..10), 0, Some(2), true, 1001)
        else {
            panic!("expected to wait")
        };
        assert_eq!((until_ms, handle, shared_blocks), (1020, 1, 10));
        assert!(!*routed.borrow());
        c.routed(1, 1002);
        assert!(*routed.borrow(), "the notice wakes the waiter");
        assert_eq!(c.open(1002), 0, "a routed claim is no longer open");
        let Turn::Wait { routed, .. } = c.turn("m", &keys(0..10), 0, None, true, 1003) else {
            panic!("a routed claim still answers, within its window")
        };
        assert!(*routed.borrow(), "and a query waiting on it goes on at once");
        c.routed(77, 1003);
        assert!(*c.mirror("m", 77, keys(0..4), 1020).borrow(), "a notice heard before its mirror");
    }

    #[test]
    fn small_gains_claims_past_their_window_and_other_models_do_not_hold_anyone() {
        let c = claims();
        assert!(matches!(c.turn("m", &keys(0..100), 0, Some(1), true, 1000), Turn::Go));
        // Already matched 120 of the 160 shared tokens: a 40-token gain is not worth the wait.
        assert!(matches!(c.turn("m", &keys(0..10), 120, None, true, 1001), Turn::Go));
        // Diverges at the first block: shares nothing.
        assert!(matches!(c.turn("m", &keys(500..510), 0, None, true, 1001), Turn::Go));
        // A model without a remote cache-aware policy never claims or waits.
        assert!(matches!(c.turn("other", &keys(0..100), 0, Some(3), true, 1001), Turn::Go));
        // The window passes without a notice.
        assert!(matches!(c.turn("m", &keys(0..10), 0, None, true, 1020), Turn::Go));
        assert_eq!(c.open(1020), 0);
    }

    #[test]
    fn open_claims_per_model_are_capped() {
        let c = claims();
        for handle in 0..MAX_CLAIMS_PER_MODEL as u64 + 10 {
            let k: Arc<[u64]> = (handle * 1000..handle * 1000 + 100).collect::<Vec<_>>().into();
            assert!(matches!(c.turn("m", &k, 0, Some(handle), false, 1000), Turn::Go));
        }
        assert_eq!(c.open(1000), MAX_CLAIMS_PER_MODEL);
    }

    #[test]
    fn only_a_promised_notice_opens_a_claim_and_only_for_enough_uncovered_tokens() {
        let c = claims();
        // No handle (the caller sends no notice): nothing to wait for later.
        assert!(matches!(c.turn("m", &keys(0..100), 0, None, true, 1000), Turn::Go));
        assert_eq!(c.open(1000), 0);
        // 100 blocks, 1,580 of 1,600 tokens matched: too little left to claim.
        assert!(matches!(c.turn("m", &keys(0..100), 1580, Some(1), true, 1000), Turn::Go));
        assert_eq!(c.open(1000), 0);
        // A query that may not wait (it already waited once) may still claim.
        assert!(matches!(c.turn("m", &keys(0..100), 0, Some(2), false, 1000), Turn::Go));
        assert_eq!(c.open(1000), 1);
    }
}
