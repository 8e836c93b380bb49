//! The request streams: multi-turn sessions over shared system prompts (like inference-perf's
//! shared_prefix, with each turn extending its history), a short/long mix, and a fixed body.

use std::collections::HashSet;

use rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde_json::{json, Value};

use crate::measure::Sample;
use crate::{Args, Kind};

/// Turns before a session starts over (keeps prompts bounded on long runs).
const TURNS_PER_SESSION: usize = 6;

#[derive(Debug, Clone)]
pub struct Request {
    pub body: Value,
    pub headers: Vec<(String, String)>,
    /// `high` for the requests marked interactive (`--high-fraction`), else `low` (batch).
    pub class: &'static str,
    session: Option<usize>,
}

struct Session {
    id: String,
    group: usize,
    history: Vec<Value>,
    turns: usize,
    generation: usize,
}

pub struct Workload {
    kind: Kind,
    model: String,
    left: usize,
    sessions: Vec<Session>,
    busy: HashSet<usize>,
    system_prompts: Vec<String>,
    question_tokens: usize,
    output_tokens: u64,
    long_fraction: f64,
    short_tokens: usize,
    long_tokens: usize,
    body_bytes: usize,
    high_fraction: f64,
    rng: Xoshiro256PlusPlus,
    sent: u64,
}

/// Deterministic text of about `tokens` tokens (4 bytes each) that differs by `seed`.
fn text(seed: u64, tokens: usize) -> String {
    let mut out = String::with_capacity(tokens * 4 + 16);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while out.len() < tokens * 4 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(&format!("w{:x} ", x % 0xffff));
    }
    out.truncate(tokens * 4);
    out
}

impl Workload {
    pub fn new(args: &Args) -> Self {
        let sessions = (0..args.groups * args.sessions_per_group)
            .map(|i| Session {
                id: format!("s{i}"),
                group: i % args.groups.max(1),
                history: Vec::new(),
                turns: 0,
                generation: 0,
            })
            .collect();
        Self {
            kind: args.workload,
            model: args.model.clone(),
            left: args.requests,
            sessions,
            busy: HashSet::new(),
            system_prompts: (0..args.groups.max(1)).map(|g| text(1_000 + g as u64, args.system_tokens)).collect(),
            question_tokens: args.question_tokens,
            output_tokens: args.output_tokens,
            long_fraction: args.long_fraction,
            short_tokens: args.short_tokens,
            long_tokens: args.long_tokens,
            body_bytes: args.body_bytes,
            high_fraction: args.high_fraction,
            rng: Xoshiro256PlusPlus::seed_from_u64(args.seed),
            sent: 0,
        }
    }

    fn chat(&self, messages: Vec<Value>) -> Value {
        json!({"model": self.model, "messages": messages, "max_tokens": self.output_tokens})
    }

    /// The next request. With `--high-fraction`, evenly spaced ones of every `1 / high_fraction`
    /// are interactive and the others batch, each named in this router's class header and in
    /// SMG's priority header (`x-sgl-class: interactive | batch`, `x-smg-priority: interactive |
    /// bulk`).
    pub fn next(&mut self) -> Option<Request> {
        let mut request = self.next_body()?;
        if self.high_fraction > 0.0 {
            let n = self.sent as f64;
            let high = (n * self.high_fraction).floor() != ((n - 1.0) * self.high_fraction).floor();
            let (class, ours, smg) =
                if high { ("high", "interactive", "interactive") } else { ("low", "batch", "bulk") };
            request.class = class;
            request.headers.push(("x-sgl-class".into(), ours.into()));
            request.headers.push(("x-smg-priority".into(), smg.into()));
        }
        Some(request)
    }

    fn next_body(&mut self) -> Option<Request> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        self.sent += 1;
        let seed = self.sent;
        Some(match self.kind {
            Kind::Fixed => {
                let content = "x".repeat(self.body_bytes.saturating_sub(120).max(1));
                Request {
                    body: self.chat(vec![json!({"role": "user", "content": content})]),
                    headers: vec![],
                    class: "low",
                    session: None,
                }
            }
            Kind::MixedLength => {
                let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                let tokens = if u < self.long_fraction { self.long_tokens } else { self.short_tokens };
                Request {
                    body: self.chat(vec![json!({"role": "user", "content": text(seed, tokens)})]),
                    headers: vec![],
                    class: "low",
                    session: None,
                }
            }
            Kind::SharedPrefix => {
                // A random session without a request in flight (a session's turns are sequential),
                // so arrival order cannot line sessions up with any router's rotation.
                let n = self.sessions.len().max(1);
                let start = (self.rng.next_u64() % n as u64) as usize;
                let index = (0..n).map(|k| (start + k) % n).find(|i| !self.busy.contains(i)).unwrap_or(start);
                self.busy.insert(index);
                let question = json!({"role": "user", "content": text(seed * 7919, self.question_tokens)});
                let system = self.system_prompts.get(self.sessions[index].group).cloned().unwrap_or_default();
                let s = &mut self.sessions[index];
                if s.turns >= TURNS_PER_SESSION {
                    s.history.clear();
                    s.turns = 0;
                    s.generation += 1;
                }
                let mut messages = vec![json!({"role": "system", "content": system})];
                messages.extend(s.history.iter().cloned());
                messages.push(question.clone());
                s.history.push(question);
                s.turns += 1;
                let session_id = format!("{}-{}", s.id, s.generation);
                Request {
                    body: self.chat(messages),
                    headers: vec![("x-session-id".into(), session_id)],
                    class: "low",
                    session: Some(index),
                }
            }
        })
    }

    /// A finished turn joins its session's history, so the next turn extends it.
    pub fn finished(&mut self, request: &Request, sample: &Sample) {
        if let Some(index) = request.session {
            self.busy.remove(&index);
            if let Some(s) = self.sessions.get_mut(index) {
                let answer: String = (0..sample.chunks.max(1)).map(|i| format!("tok{i} ")).collect();
                s.history.push(json!({"role": "assistant", "content": answer}));
            }
        }
    }
}
