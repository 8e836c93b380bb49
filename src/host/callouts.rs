//! HTTP callouts a policy can await (a remote prefix indexer, for instance). The host dispatches
//! the request and hands back a future; the glue completes it when the host delivers the answer
//! to the HTTP context that made the call, then polls the pending selection again. Every callout
//! has a timeout, so every future finishes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use super::HostError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutRequest {
    pub cluster: String,
    pub method: String,
    pub path: String,
    pub authority: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalloutResponse {
    /// `None` when the callout failed or timed out.
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

type Slot = Arc<Mutex<Option<CalloutResponse>>>;
type Slots = Arc<Mutex<HashMap<u32, Slot>>>;

/// Resolves once the host delivered the callout's answer. Dropped unanswered (the stream that
/// waited on it was reset), it takes its entry off the board: an entry nobody waits for would stay
/// there for the life of the VM, and every poll scans the board.
#[derive(Debug)]
pub struct CalloutFuture {
    slot: Slot,
    token: u32,
    board: Weak<Mutex<HashMap<u32, Slot>>>,
}

impl Future for CalloutFuture {
    type Output = CalloutResponse;

    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<CalloutResponse> {
        match self.slot.lock().ok().and_then(|mut s| s.take()) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

impl Drop for CalloutFuture {
    fn drop(&mut self) {
        if let Some(slots) = self.board.upgrade() {
            if let Ok(mut slots) = slots.lock() {
                slots.remove(&self.token);
            }
        }
    }
}

/// The outstanding callouts of one VM, by host token.
#[derive(Debug, Default)]
pub struct CalloutBoard {
    slots: Slots,
}

impl CalloutBoard {
    pub fn register(&self, token: u32) -> CalloutFuture {
        let slot = Slot::default();
        if let Ok(mut slots) = self.slots.lock() {
            slots.insert(token, Arc::clone(&slot));
        }
        CalloutFuture { slot, token, board: Arc::downgrade(&self.slots) }
    }

    /// Delivers an answer; `false` when the token is not a policy's callout.
    pub fn complete(&self, token: u32, response: CalloutResponse) -> bool {
        let slot = self.slots.lock().ok().and_then(|mut s| s.remove(&token));
        match slot {
            Some(slot) => {
                if let Ok(mut s) = slot.lock() {
                    *s = Some(response);
                }
                true
            }
            None => false,
        }
    }

    pub fn is_outstanding(&self, token: u32) -> bool {
        self.slots.lock().map(|s| s.contains_key(&token)).unwrap_or(false)
    }

    pub fn tokens(&self) -> Vec<u32> {
        self.slots.lock().map(|s| s.keys().copied().collect()).unwrap_or_default()
    }
}

/// How a policy makes a callout.
pub trait Callouts: Send + Sync + std::fmt::Debug {
    fn dispatch(&self, request: CalloutRequest) -> Result<CalloutFuture, HostError>;
    /// The board the glue completes.
    fn board(&self) -> &CalloutBoard;
}

/// Records requests and hands out tokens; a test completes them through the board.
#[derive(Debug, Default)]
pub struct MemoryCallouts {
    board: CalloutBoard,
    pub sent: Mutex<Vec<(u32, CalloutRequest)>>,
}

impl Callouts for MemoryCallouts {
    fn dispatch(&self, request: CalloutRequest) -> Result<CalloutFuture, HostError> {
        let mut sent = self.sent.lock().map_err(|_| HostError::Failed("poisoned".into()))?;
        let token = u32::try_from(sent.len()).unwrap_or(u32::MAX).saturating_add(1);
        sent.push((token, request));
        Ok(self.board.register(token))
    }

    fn board(&self) -> &CalloutBoard {
        &self.board
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::test;

    fn request() -> CalloutRequest {
        CalloutRequest {
            cluster: "idx".into(),
            method: "POST".into(),
            path: "/match".into(),
            authority: "idx".into(),
            headers: vec![],
            body: None,
            timeout_ms: 100,
        }
    }

    fn poll<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        Pin::new(f).poll(&mut Context::from_waker(std::task::Waker::noop()))
    }

    #[test]
    fn a_callout_future_resolves_when_its_answer_is_delivered() {
        let callouts = MemoryCallouts::default();
        let request = request();
        let mut future = callouts.dispatch(request).unwrap();
        assert!(poll(&mut future).is_pending());
        assert!(callouts.board().is_outstanding(1));
        assert!(!callouts.board().complete(99, CalloutResponse { status: None, body: vec![] }));
        assert!(callouts.board().complete(1, CalloutResponse { status: Some(200), body: b"ok".to_vec() }));
        assert_eq!(poll(&mut future), Poll::Ready(CalloutResponse { status: Some(200), body: b"ok".to_vec() }));
        assert!(!callouts.board().is_outstanding(1));
    }

    /// A stream reset while its selection waited on the indexer drops the selection, and with it
    /// the future: its board entry goes too.
    #[test]
    fn a_callout_dropped_unanswered_leaves_the_board() {
        let callouts = MemoryCallouts::default();
        let request = request();
        let kept = callouts.dispatch(request.clone()).unwrap();
        for _ in 0..100 {
            drop(callouts.dispatch(request.clone()).unwrap());
        }
        assert_eq!(callouts.board().tokens(), [1], "only the callout still awaited");
        drop(kept);
        assert!(callouts.board().tokens().is_empty());
        assert!(!callouts.board().complete(1, CalloutResponse { status: Some(200), body: vec![] }));
    }
}
