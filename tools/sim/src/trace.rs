//! `--trace FILE`: one JSON line per request served, saying where its time to first token went —
//! the wait for a running slot, the wait for the prefill lane, its own prefill — the same fields
//! as `tools/script-engine` and `tools/sched-engine` write, so one reading of the slowest requests
//! serves all three engine models.

use std::fs::File;
use std::io::Write;
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

/// Where one request's time to first token went.
#[derive(Debug, Serialize)]
pub struct Line {
    pub engine: String,
    /// When it arrived, in seconds since the Unix epoch.
    pub at: f64,
    pub slot_ms: f64,
    pub lane_ms: f64,
    pub prefill_ms: f64,
    /// Prompt tokens, and those the cache held.
    pub prompt: u64,
    pub hit: u64,
    /// A token early in the prompt: which shared system prompt it carries.
    pub head: String,
}

/// The marks of one request's way to its first token.
#[derive(Debug, Clone, Copy)]
pub struct Marks {
    pub arrived: Instant,
    pub slotted: Instant,
    pub laned: Instant,
    pub prefilled: Instant,
}

impl Marks {
    fn ms(from: Instant, to: Instant) -> f64 {
        (to.saturating_duration_since(from).as_secs_f64() * 1e4).round() / 10.0
    }
}

/// The trace file, when there is one.
#[derive(Debug, Default)]
pub struct Trace(Option<Mutex<File>>);

impl Trace {
    pub fn open(path: Option<&std::path::Path>) -> std::io::Result<Self> {
        let file = path.map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p)).transpose()?;
        Ok(Self(file.map(Mutex::new)))
    }

    /// Appends the line of a request that arrived at `at_unix_ms`, with its `marks`.
    pub fn write(&self, engine: &str, at_unix_ms: u64, marks: Marks, prompt: u64, hit: u64, head: Option<u64>) {
        let Some(file) = &self.0 else { return };
        let line = Line {
            engine: engine.to_string(),
            at: at_unix_ms as f64 / 1000.0,
            slot_ms: Marks::ms(marks.arrived, marks.slotted),
            lane_ms: Marks::ms(marks.slotted, marks.laned),
            prefill_ms: Marks::ms(marks.laned, marks.prefilled),
            prompt,
            hit,
            head: head.map(|h| h.to_string()).unwrap_or_default(),
        };
        let Ok(mut text) = serde_json::to_string(&line) else { return };
        text.push('\n');
        let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
        // A trace that cannot be written must not fail the request it describes.
        let _ = file.write_all(text.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_line_says_where_the_first_token_waited() {
        let dir = std::env::temp_dir().join(format!("sgl-sim-trace-{}", std::process::id()));
        let trace = Trace::open(Some(&dir)).unwrap();
        let t = Instant::now();
        let marks = Marks {
            arrived: t,
            slotted: t + Duration::from_millis(30),
            laned: t + Duration::from_millis(50),
            prefilled: t + Duration::from_millis(120),
        };
        trace.write("E01", 1_700_000_000_250, marks, 900, 800, Some(42));
        let text = std::fs::read_to_string(&dir).unwrap();
        std::fs::remove_file(&dir).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["engine"], "E01");
        assert_eq!(line["at"], 1_700_000_000.25);
        assert_eq!((line["slot_ms"].as_f64(), line["lane_ms"].as_f64()), (Some(30.0), Some(20.0)));
        assert_eq!(line["prefill_ms"].as_f64(), Some(70.0));
        assert_eq!(
            (line["prompt"].as_u64(), line["hit"].as_u64(), line["head"].as_str()),
            (Some(900), Some(800), Some("42"))
        );
        Trace::default().write("E01", 0, marks, 1, 0, None);
    }
}
