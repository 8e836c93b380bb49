//! SGLang's `POST /abort_request` (0.5.23): `{"rid": RID}` stops the request of that id where it
//! is (waiting, prefilling, generating) and frees its slot; a streamed answer ends with
//! `finish_reason: "abort"`. Requests without a `rid` cannot be aborted, as in SGLang.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::Notify;

use crate::engine::Engine;

/// Abort ids remembered for `/sim/state`.
const REMEMBERED: usize = 1024;

/// One request's abort signal.
#[derive(Default)]
pub struct Abort {
    set: AtomicBool,
    notify: Notify,
}

impl Abort {
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Resolves once the request is aborted (never, if it is not).
    pub async fn aborted(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

#[derive(Default)]
pub struct Aborts {
    live: Mutex<HashMap<String, Arc<Abort>>>,
    received: Mutex<VecDeque<String>>,
}

/// A request's registration: it leaves the table when the request is done.
pub struct Registered {
    aborts: Arc<Engine>,
    rid: Option<String>,
    pub abort: Arc<Abort>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(rid) = &self.rid {
            let mut live = self.aborts.aborts.live.lock().unwrap_or_else(|p| p.into_inner());
            if live.get(rid).is_some_and(|a| Arc::ptr_eq(a, &self.abort)) {
                live.remove(rid);
            }
        }
    }
}

impl Aborts {
    /// Registers a request of id `rid`; without one it gets a signal nothing can set.
    pub fn register(engine: &Arc<Engine>, rid: Option<String>) -> Registered {
        let abort = Arc::new(Abort::default());
        if let Some(rid) = &rid {
            engine.aborts.live.lock().unwrap_or_else(|p| p.into_inner()).insert(rid.clone(), Arc::clone(&abort));
        }
        Registered { aborts: Arc::clone(engine), rid, abort }
    }

    fn abort(&self, rid: &str) -> bool {
        {
            let mut received = self.received.lock().unwrap_or_else(|p| p.into_inner());
            if received.len() >= REMEMBERED {
                received.pop_front();
            }
            received.push_back(rid.to_string());
        }
        let found = self.live.lock().unwrap_or_else(|p| p.into_inner()).get(rid).cloned();
        match found {
            Some(abort) => {
                abort.set.store(true, Ordering::SeqCst);
                abort.notify.notify_waiters();
                true
            }
            None => false,
        }
    }

    /// The ids aborts named, oldest first.
    pub fn received(&self) -> Vec<String> {
        self.received.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect()
    }
}

pub async fn abort_request(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let rid = serde_json::from_slice::<Value>(&body).ok().and_then(|v| v.get("rid")?.as_str().map(str::to_string));
    match rid {
        Some(rid) => {
            let found = engine.aborts.abort(&rid);
            if !found {
                eprintln!("sgl-sim {}: abort of {rid}, which is not running here", engine.id);
            }
            StatusCode::OK.into_response()
        }
        None => (StatusCode::BAD_REQUEST, "`rid` (a string) is required").into_response(),
    }
}
