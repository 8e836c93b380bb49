//! A frame guard between an engine's ZeroMQ sockets and ours. The `zeromq` crate reserves memory
//! for whatever frame length a peer declares, so one bogus header (a 2^40-byte frame) aborts the
//! process before a byte of it arrives. Every engine connection therefore goes through a loopback
//! relay that reads ZMTP 3 framing on the engine's side and cuts the connection when a frame, or a
//! message (the frames of one multipart message together), declares more than the limits below.
//! What passes reaches the ZeroMQ socket byte for byte; our side's bytes go to the engine
//! unchanged. The subscriber reconnects as after any broken connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The largest message an engine may send: a batch of KV events (one SGLang scheduler step) is
/// far below it.
pub const MAX_MESSAGE_BYTES: u64 = 16 << 20;
/// Frames in one message at most: a live batch has 3, a replayed one 4.
pub const MAX_FRAMES: u32 = 16;
/// ZMTP 3's greeting: signature, version, mechanism, as-server, filler.
const GREETING: u64 = 64;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Greeting { left: u64 },
    Header,
    Length { long: bool, more: bool, command: bool, have: u8, value: u64 },
    Body { left: u64, more: bool },
}

/// Why a connection was cut.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("a frame of {0} bytes (at most {MAX_MESSAGE_BYTES})")]
    Frame(u64),
    #[error("a message of more than {MAX_MESSAGE_BYTES} bytes")]
    Message,
    #[error("a message of more than {MAX_FRAMES} frames")]
    Frames,
}

/// Follows ZMTP 3 framing over a byte stream, checking every declared length before the bytes it
/// announces arrive.
#[derive(Debug, Clone)]
pub struct FrameGuard {
    state: State,
    message_bytes: u64,
    frames: u32,
}

impl Default for FrameGuard {
    fn default() -> Self {
        Self { state: State::Greeting { left: GREETING }, message_bytes: 0, frames: 0 }
    }
}

impl FrameGuard {
    /// Reads `bytes`, the next part of the stream.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), Violation> {
        while !bytes.is_empty() {
            match self.state {
                State::Greeting { left } | State::Body { left, .. } => {
                    let take = left.min(bytes.len() as u64);
                    bytes = &bytes[take as usize..];
                    let left = left - take;
                    self.state = match self.state {
                        State::Greeting { .. } if left == 0 => State::Header,
                        State::Greeting { .. } => State::Greeting { left },
                        State::Body { .. } if left == 0 => State::Header,
                        State::Body { more, .. } => State::Body { left, more },
                        other => other,
                    };
                }
                State::Header => {
                    let flags = bytes[0];
                    bytes = &bytes[1..];
                    self.state = State::Length {
                        long: flags & 0b010 != 0,
                        more: flags & 0b001 != 0,
                        command: flags & 0b100 != 0,
                        have: 0,
                        value: 0,
                    };
                }
                State::Length { long, more, command, have, value } => {
                    let value = value << 8 | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    let have = have + 1;
                    if have < if long { 8 } else { 1 } {
                        self.state = State::Length { long, more, command, have, value };
                        continue;
                    }
                    self.frame(value, more && !command)?;
                    self.state = if value == 0 { State::Header } else { State::Body { left: value, more } };
                }
            }
        }
        Ok(())
    }

    /// A frame of `len` bytes begins; `more` when the message goes on after it.
    fn frame(&mut self, len: u64, more: bool) -> Result<(), Violation> {
        if len > MAX_MESSAGE_BYTES {
            return Err(Violation::Frame(len));
        }
        self.message_bytes = self.message_bytes.saturating_add(len);
        self.frames += 1;
        if self.message_bytes > MAX_MESSAGE_BYTES {
            return Err(Violation::Message);
        }
        if self.frames > MAX_FRAMES {
            return Err(Violation::Frames);
        }
        if !more {
            self.message_bytes = 0;
            self.frames = 0;
        }
        Ok(())
    }
}

/// A loopback listener whose every connection is relayed to `upstream` (`host:port`) through a
/// [`FrameGuard`]. Returns the `tcp://127.0.0.1:PORT` endpoint our socket connects to instead.
/// `connections` counts the connections made to the engine: a new one after the first means the
/// engine may have restarted, which its sequence numbers alone cannot always tell.
pub async fn start(
    upstream: String,
    violations: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
) -> std::io::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("tcp://{}", listener.local_addr()?);
    tokio::spawn(async move {
        loop {
            let Ok((ours, _)) = listener.accept().await else { continue };
            let (upstream, violations, connections) =
                (upstream.clone(), Arc::clone(&violations), Arc::clone(&connections));
            tokio::spawn(async move {
                let engine = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&upstream)).await {
                    Ok(Ok(engine)) => engine,
                    // Dropping ours: the socket sees a broken connection and retries.
                    _ => return,
                };
                connections.fetch_add(1, Ordering::Relaxed);
                if let Err(v) = pipe(ours, engine).await {
                    violations.fetch_add(1, Ordering::Relaxed);
                    eprintln!("sgl-indexer: engine {upstream} cut off: {v}");
                }
            });
        }
    });
    Ok(endpoint)
}

/// Copies both ways until either side closes; the engine's bytes are checked first.
async fn pipe(ours: TcpStream, engine: TcpStream) -> Result<(), Violation> {
    let _ = ours.set_nodelay(true);
    let _ = engine.set_nodelay(true);
    let (mut ours_read, mut ours_write) = ours.into_split();
    let (mut engine_read, mut engine_write) = engine.into_split();
    let upstream = async move {
        let _ = tokio::io::copy(&mut ours_read, &mut engine_write).await;
        let _ = engine_write.shutdown().await;
    };
    let downstream = async move {
        let mut guard = FrameGuard::default();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match engine_read.read(&mut buf).await {
                Ok(0) | Err(_) => return Ok(()),
                Ok(n) => n,
            };
            guard.feed(&buf[..n])?;
            if ours_write.write_all(&buf[..n]).await.is_err() {
                return Ok(());
            }
        }
    };
    tokio::select! {
        () = upstream => Ok(()),
        result = downstream => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting() -> Vec<u8> {
        let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 1];
        g.extend(b"NULL");
        g.resize(64, 0);
        g
    }

    fn frame(body: &[u8], more: bool) -> Vec<u8> {
        let mut out = Vec::new();
        if body.len() > 255 {
            out.push(0b010 | u8::from(more));
            out.extend((body.len() as u64).to_be_bytes());
        } else {
            out.push(u8::from(more));
            out.push(body.len() as u8);
        }
        out.extend(body);
        out
    }

    #[test]
    fn a_live_stream_passes_in_any_split() {
        let mut stream = greeting();
        stream.extend([0b100, 5]);
        stream.extend(b"READY");
        for _ in 0..3 {
            stream.extend(frame(b"topic", true));
            stream.extend(frame(&7u64.to_be_bytes(), true));
            stream.extend(frame(&vec![9; 70_000], false));
        }
        for chunk in [1, 7, 64, 1000, stream.len()] {
            let mut guard = FrameGuard::default();
            for part in stream.chunks(chunk) {
                guard.feed(part).unwrap();
            }
            assert_eq!(guard.state, State::Header, "ends between frames");
        }
    }

    /// The header that once aborted the indexer: it is refused before anything is reserved.
    #[test]
    fn a_bogus_frame_length_is_refused_from_its_header() {
        let mut guard = FrameGuard::default();
        guard.feed(&greeting()).unwrap();
        let mut header = vec![0b010];
        header.extend((1u64 << 40).to_be_bytes());
        assert_eq!(guard.feed(&header), Err(Violation::Frame(1 << 40)));
        let mut at_limit = FrameGuard::default();
        at_limit.feed(&greeting()).unwrap();
        let mut header = vec![0b010];
        header.extend(MAX_MESSAGE_BYTES.to_be_bytes());
        assert_eq!(at_limit.feed(&header), Ok(()), "exactly the limit passes");
    }

    #[test]
    fn messages_are_bounded_in_bytes_and_frames() {
        let mut guard = FrameGuard::default();
        guard.feed(&greeting()).unwrap();
        let half = vec![0u8; (MAX_MESSAGE_BYTES / 2) as usize];
        guard.feed(&frame(&half, true)).unwrap();
        guard.feed(&frame(&half, true)).unwrap();
        assert_eq!(guard.feed(&frame(b"x", false)), Err(Violation::Message));
        let mut guard = FrameGuard::default();
        guard.feed(&greeting()).unwrap();
        for _ in 0..MAX_FRAMES - 1 {
            guard.feed(&frame(b"", true)).unwrap();
        }
        guard.feed(&frame(b"", false)).unwrap();
        for _ in 0..MAX_FRAMES {
            guard.feed(&frame(b"", true)).unwrap();
        }
        assert_eq!(guard.feed(&frame(b"", false)), Err(Violation::Frames));
    }
}
