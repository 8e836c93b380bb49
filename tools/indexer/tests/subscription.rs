//! The indexer as a process against a publisher speaking SGLang's wire format over real ZeroMQ
//! sockets (PUB for events, ROUTER for replay): late joining, gap repair, publisher restart,
//! removal and clearing, and both query endpoints.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::VecDeque;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rmpv::Value as V;
use serde_json::{json, Value};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizer")
}

struct Indexer(Child, u16);

impl Drop for Indexer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Indexer {
    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.1)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
        let mut r =
            agent.post(&self.url(path)).header("content-type", "application/json").send(body.to_string()).unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    fn matched(&self, tokens: &[u32]) -> u64 {
        let (status, v) = self.post("/query", &json!({"model": "m", "token_ids": tokens}));
        assert_eq!(status, 200, "{v}");
        v["data"]["A"]["matched_tokens"].as_u64().unwrap_or(0)
    }
}

fn start_indexer(events: u16, replay: u16) -> Indexer {
    let dir = std::env::temp_dir().join(format!("sgl-indexer-test-{}-{events}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tok = assets();
    let config = json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m",
                     "kv_events": format!("tcp://127.0.0.1:{events}"),
                     "kv_events_replay": format!("tcp://127.0.0.1:{replay}")}],
        "prefix_index": {"url": "http://127.0.0.1:9", "block_tokens": 4},
        "models": {"m": {"tokenizer": tok.join("tokenizer.json"), "chat_template": tok.join("tokenizer_config.json"),
                         "buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}
    });
    let indexer = spawn_indexer(&dir, &config, &[]);
    wait("the indexer's health", || ureq::get(&indexer.url("/health")).call().is_ok_and(|r| r.status() == 200));
    indexer
}

/// Starts the indexer on `config` with `args`; returns once it serves `/metrics`.
fn spawn_indexer(dir: &Path, config: &Value, args: &[&str]) -> Indexer {
    spawn_indexer_on(free_port(), dir, config, args)
}

fn spawn_indexer_on(port: u16, dir: &Path, config: &Value, args: &[&str]) -> Indexer {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("router.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_sgl-indexer"))
        .args(["--config", path.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let indexer = Indexer(child, port);
    wait("the indexer's metrics", || ureq::get(&indexer.url("/metrics")).call().is_ok());
    indexer
}

impl Indexer {
    fn metrics(&self) -> String {
        ureq::get(&self.url("/metrics")).call().unwrap().body_mut().read_to_string().unwrap()
    }

    fn alive(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }
}

fn wait(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

fn pack(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// One BlockStored per page of one token, SGLang's default page size, chained by parent hash.
fn stored_pages(first_hash: i64, parent: Option<i64>, tokens: &[u32]) -> Vec<V> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let hash = first_hash + i as i64;
            let parent = if i == 0 { parent.map(V::from).unwrap_or(V::Nil) } else { V::from(hash - 1) };
            V::Map(vec![
                (V::from("type"), V::from("BlockStored")),
                (V::from("block_hashes"), V::Array(vec![V::from(hash)])),
                (V::from("parent_block_hash"), parent),
                (V::from("token_ids"), V::Array(vec![V::from(*t)])),
                (V::from("block_size"), V::from(1)),
            ])
        })
        .collect()
}

fn batch(events: Vec<V>) -> Vec<u8> {
    pack(&V::Array(vec![V::from(0.5), V::Array(events), V::from(0)]))
}

/// Past batches by sequence number, as the publisher's replay buffer keeps them.
type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// How a replay ROUTER frames each batch it sends back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplayForm {
    /// `[id, "", topic, seq, payload]`, the end `[id, "", "", -1, ""]` (SGLang 0.5.23).
    Sglang,
    /// `[id, "", seq, payload]`, the end `[id, "", -1, ""]` (vLLM).
    Vllm,
}

/// A publisher as SGLang runs it: PUB for live batches, ROUTER answering replay requests from a
/// buffer of past batches.
struct Publisher {
    rt: tokio::runtime::Runtime,
    socket: PubSocket,
    buffer: ReplayBuffer,
}

impl Publisher {
    fn start(events: u16, replay: u16) -> Self {
        Self::start_as(events, replay, ReplayForm::Sglang)
    }

    fn start_as(events: u16, replay: u16, form: ReplayForm) -> Self {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let buffer: ReplayBuffer = Arc::default();
        let socket = rt.block_on(async {
            let mut s = PubSocket::new();
            s.bind(&format!("tcp://127.0.0.1:{events}")).await.unwrap();
            s
        });
        let replay_buffer = Arc::clone(&buffer);
        rt.spawn(async move {
            let mut router = RouterSocket::new();
            router.bind(&format!("tcp://127.0.0.1:{replay}")).await.unwrap();
            while let Ok(request) = router.recv().await {
                let frames = request.into_vec();
                let (id, start) = (frames[0].clone(), u64::from_be_bytes(frames[2][..8].try_into().unwrap()));
                let past: Vec<(u64, Vec<u8>)> =
                    replay_buffer.lock().unwrap().iter().filter(|(s, _)| *s >= start).cloned().collect();
                let frames = |topic: &'static [u8], seq: Bytes, payload: Bytes| {
                    let mut m = vec![id.clone(), Bytes::new()];
                    if form == ReplayForm::Sglang {
                        m.push(Bytes::from_static(topic));
                    }
                    m.extend([seq, payload]);
                    ZmqMessage::try_from(m).unwrap()
                };
                for (seq, payload) in past {
                    let m = frames(b"kv", Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload));
                    router.send(m).await.unwrap();
                }
                let end = frames(b"", Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new());
                router.send(end).await.unwrap();
            }
        });
        Self { rt, socket, buffer }
    }

    /// Publishes batch `seq` live (and keeps it for replay) unless `live` is false: then only the
    /// replay buffer has it, as for a batch the subscriber missed.
    fn publish(&mut self, seq: u64, payload: Vec<u8>, live: bool) {
        self.buffer.lock().unwrap().push_back((seq, payload.clone()));
        if live {
            let m = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
            self.rt.block_on(self.socket.send(ZmqMessage::try_from(m).unwrap())).unwrap();
        }
    }

    fn restart(&mut self) {
        self.buffer.lock().unwrap().clear();
    }
}

#[test]
fn events_reach_the_index_through_late_join_gap_repair_and_restart() {
    through_late_join_gap_repair_and_restart(ReplayForm::Sglang);
}

/// vLLM's replay has no topic frame.
#[test]
fn vllm_replay_repairs_gaps_too() {
    through_late_join_gap_repair_and_restart(ReplayForm::Vllm);
}

fn through_late_join_gap_repair_and_restart(form: ReplayForm) {
    let (events, replay) = (free_port(), free_port());
    let mut publisher = Publisher::start_as(events, replay, form);
    // Batch 0 goes out before the indexer exists: only replay can bring it.
    let first: Vec<u32> = (1..=8).collect();
    publisher.publish(0, batch(stored_pages(100, None, &first)), true);
    let indexer = start_indexer(events, replay);
    let mut seq = 1;
    // Live batches until the subscription is through (ZeroMQ's slow joiner); each is harmless.
    wait("the first live batch", || {
        publisher.publish(seq, batch(vec![]), true);
        seq += 1;
        indexer.matched(&first) == 8
    });
    // A gap: batch `seq` is missed live, batch `seq + 1` arrives; the replay repairs it.
    let second: Vec<u32> = (1..=12).collect();
    publisher.publish(seq, batch(stored_pages(108, Some(107), &second[8..])), false);
    publisher.publish(seq + 1, batch(vec![]), true);
    wait("the gap repaired from replay", || indexer.matched(&second) == 12);
    // Removing the page that completed the third block drops exactly that block.
    let removed = V::Map(vec![
        (V::from("type"), V::from("BlockRemoved")),
        (V::from("block_hashes"), V::Array(vec![V::from(111)])),
    ]);
    publisher.publish(seq + 2, batch(vec![removed]), true);
    wait("the removal", || indexer.matched(&second) == 8);
    // The publisher restarts: its sequence starts again at 0 and what it said before is void.
    publisher.restart();
    let third: Vec<u32> = (50..58).collect();
    publisher.publish(0, batch(stored_pages(1, None, &third)), true);
    wait("the restart to clear the old entries", || indexer.matched(&third) == 8 && indexer.matched(&first) == 0);
    // AllBlocksCleared forgets the rank.
    publisher.publish(1, batch(vec![V::Map(vec![(V::from("type"), V::from("AllBlocksCleared"))])]), true);
    wait("the clear", || indexer.matched(&third) == 0);
    let metrics = ureq::get(&indexer.url("/metrics")).call().unwrap().body_mut().read_to_string().unwrap();
    for counter in
        ["sgl_indexer_gaps_total 1", "sgl_indexer_publisher_restarts_total 1", "sgl_indexer_unrepaired_gaps_total 0"]
    {
        assert!(metrics.contains(counter), "{counter} in:\n{metrics}");
    }
}

#[test]
fn a_chat_body_is_tokenized_as_the_engine_does_and_matched() {
    let (events, replay) = (free_port(), free_port());
    let mut publisher = Publisher::start(events, replay);
    let indexer = start_indexer(events, replay);
    let chat = json!({"model": "m", "messages": [{"role": "system", "content": "the router explains the cache ".repeat(20)},
                                                 {"role": "user", "content": "what is a bucket"}]});
    let (status, first) = indexer.post("/v1/prefix/match", &chat);
    assert_eq!(status, 200, "{first}");
    let input = first["input_tokens"].as_u64().unwrap();
    assert!(input > 100, "{first}");
    assert_eq!(first["data"], json!({}), "nothing is cached yet");
    // The engine stores the prompt it was sent: the same tokens the indexer computed.
    let tok = sgl_indexer::tokenize::ModelTokenizer::load(
        &assets().join("tokenizer.json"),
        &assets().join("tokenizer_config.json"),
    )
    .unwrap();
    let tokens = tok.tokenize_chat(&chat).unwrap();
    assert_eq!(tokens.len() as u64, input);
    let mut seq = 0;
    wait("the stored prompt", || {
        publisher.publish(seq, batch(if seq == 0 { stored_pages(1, None, &tokens) } else { vec![] }), true);
        seq += 1;
        indexer.post("/v1/prefix/match", &chat).1["data"]["A"]["matched_tokens"].as_u64() == Some(input / 4 * 4)
    });
    let (_, v) = indexer.post("/v1/prefix/match", &chat);
    assert_eq!(v["data"]["A"]["GPU"], json!(input / 4 * 4));
    // A salted request meets nothing stored without its salt.
    let mut salted = chat.clone();
    salted["cache_salt"] = json!("tenant-b");
    assert_eq!(indexer.post("/v1/prefix/match", &salted).1["data"], json!({}));
    // Malformed queries are 400s, unknown models 404s.
    assert_eq!(indexer.post("/query", &json!({"token_ids": "nope"})).0, 400);
    assert_eq!(indexer.post("/query", &json!({"model": "zz", "token_ids": []})).0, 404);
    assert_eq!(indexer.post("/v1/prefix/match", &json!({"messages": []})).0, 400);
}

/// An "engine" that greets like ZeroMQ and then declares a 2^40-byte frame: the `zeromq` crate
/// reserved that much at once and the process aborted. The relay cuts it off; the indexer lives.
#[test]
fn an_engine_declaring_a_huge_frame_is_cut_off_and_the_indexer_lives() {
    let engine = TcpListener::bind("127.0.0.1:0").unwrap();
    let events = engine.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for conn in engine.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 3, 1];
            greeting.extend(b"NULL");
            greeting.resize(64, 0);
            let mut header = vec![0b010];
            header.extend((1u64 << 40).to_be_bytes());
            let _ = conn.write_all(&greeting);
            let _ = conn.write_all(&header);
            let mut sink = [0u8; 1024];
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = conn.read(&mut sink);
        }
    });
    let dir = std::env::temp_dir().join(format!("sgl-indexer-oversized-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m", "kv_events": format!("tcp://127.0.0.1:{events}")}],
        "prefix_index": {"url": "http://127.0.0.1:9", "block_tokens": 4},
        "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}
    });
    let mut indexer = spawn_indexer(&dir, &config, &[]);
    wait("the oversized frame to be refused", || {
        let line =
            indexer.metrics().lines().find_map(|l| l.strip_prefix("sgl_indexer_oversized_total ")?.parse::<u64>().ok());
        line.is_some_and(|n| n >= 1)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(indexer.alive(), "the indexer survived");
    assert_eq!(indexer.post("/query", &json!({"model": "m", "token_ids": [1, 2, 3, 4]})).0, 200);
}

/// SGLang's own `ZmqEventPublisher` (from its wheel, `scripts/setup --tests`), run by
/// `sglang_publisher.py` and fed batches over stdin.
struct SglangPublisher {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl SglangPublisher {
    fn start(events: u16, replay: u16) -> Self {
        use std::io::BufRead;
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let module = root.join(".tools/sglang/sglang/srt/disaggregation/kv_events.py");
        let python = root.join(".venv/bin/python");
        assert!(module.exists() && python.exists(), "run scripts/setup --tests: it unpacks SGLang's publisher");
        let mut child = Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../sim/sglang_publisher.py"))
            .args([module.to_str().unwrap(), &events.to_string(), &replay.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        Self { child, stdin, stdout }
    }

    fn publish(&mut self, events: Value) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{}", json!({"events": events})).unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "published");
    }
}

impl Drop for SglangPublisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Pages of one token as SGLang publishes them (page size 1), chained by parent hash.
fn sglang_pages(first_hash: i64, parent: Option<i64>, tokens: &[u32]) -> Vec<Value> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let hash = first_hash + i as i64;
            let parent = if i == 0 { parent } else { Some(hash - 1) };
            json!({"type": "BlockStored", "block_hashes": [hash], "parent_block_hash": parent,
                   "token_ids": [t], "block_size": 1})
        })
        .collect()
}

/// Interop with the real thing: a late join repaired from SGLang's replay ROUTER (which answers
/// with a topic frame), live stores and removals in its encoding, and a restarted publisher.
#[test]
fn sglangs_own_publisher_late_join_replay_removal_and_restart() {
    let (events, replay) = (free_port(), free_port());
    let mut publisher = SglangPublisher::start(events, replay);
    let first: Vec<u32> = (1..=8).collect();
    publisher.publish(json!(sglang_pages(-7_000_000_000_000, None, &first)));
    let indexer = start_indexer(events, replay);
    wait("the batch published before the indexer existed, by replay", || {
        publisher.publish(json!([]));
        indexer.matched(&first) == 8
    });
    // The page that completed the second block of 4 tokens.
    publisher.publish(json!([{"type": "BlockRemoved", "block_hashes": [-7_000_000_000_000i64 + 7]}]));
    wait("the removal", || indexer.matched(&first) == 4);
    drop(publisher);
    let mut restarted = SglangPublisher::start(events, replay);
    let second: Vec<u32> = (50..58).collect();
    wait("the restarted publisher's first batch", || {
        restarted.publish(json!(sglang_pages(1, None, &second)));
        indexer.matched(&second) == 8
    });
    assert_eq!(indexer.matched(&first), 0, "what the old publisher said is void");
    let metrics = indexer.metrics();
    for counter in ["sgl_indexer_unrepaired_gaps_total 0", "sgl_indexer_malformed_total 0"] {
        assert!(metrics.contains(counter), "{counter} in:\n{metrics}");
    }
    let replayed =
        metrics.lines().find_map(|l| l.strip_prefix("sgl_indexer_replayed_batches_total ")?.parse::<u64>().ok());
    assert!(replayed.is_some_and(|n| n >= 1), "{metrics}");
}

/// The indexer's configuration for one engine on SGLang's publisher; without `replay` the
/// indexer knows no replay endpoint for it.
fn sglang_config(events: u16, replay: Option<u16>) -> Value {
    let mut worker = json!({"id": "A", "url": "http://127.0.0.1:1", "model": "m",
                            "kv_events": format!("tcp://127.0.0.1:{events}")});
    if let Some(replay) = replay {
        worker["kv_events_replay"] = json!(format!("tcp://127.0.0.1:{replay}"));
    }
    json!({
        "workers": [worker],
        "prefix_index": {"url": "http://127.0.0.1:9", "block_tokens": 4},
        "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}
    })
}

fn within(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while started.elapsed() < limit {
        if ok() {
            return started.elapsed();
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("{what}: not within {limit:?}");
}

fn warm_from(indexer: &Indexer) -> Option<String> {
    let metrics = indexer.metrics();
    let line = metrics.lines().find(|l| l.starts_with("sgl_indexer_rank_warm{worker=\"A\",rank=\"0\""))?;
    Some(line.split("from=\"").nth(1)?.split('"').next()?.to_string())
}

/// An engine that published a prefix and went quiet is not invisible to an indexer started
/// after it: one that knows the engine's replay endpoint asks it at subscription; one that does
/// not, started with `--peer`, loads a running indexer's view. SGLang's own publisher throughout.
#[test]
fn a_quiet_engines_prefix_is_known_at_once_from_its_replay_or_from_a_peer() {
    let (events, replay) = (free_port(), free_port());
    let mut publisher = SglangPublisher::start(events, replay);
    let dir = std::env::temp_dir().join(format!("sgl-indexer-warm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let first = spawn_indexer(&dir.join("first"), &sglang_config(events, Some(replay)), &[]);
    let prefix: Vec<u32> = (200..232).collect();
    wait("the first indexer's subscription", || {
        publisher.publish(json!([]));
        warm_from(&first).is_some() || first.metrics().contains("sgl_indexer_batches_total 1")
    });
    publisher.publish(json!(sglang_pages(-9_000_000_000_000, None, &prefix)));
    wait("the prefix in the first indexer", || first.matched(&prefix) == 32);
    drop(first);

    // The engine is quiet from here on: nothing is published again.
    let restarted = spawn_indexer(&dir.join("restarted"), &sglang_config(events, Some(replay)), &[]);
    let took =
        within("the restarted indexer knows the prefix", Duration::from_secs(3), || restarted.matched(&prefix) == 32);
    assert_eq!(warm_from(&restarted).as_deref(), Some("replay"), "{took:?}");

    let cold = spawn_indexer(&dir.join("cold"), &sglang_config(events, None), &[]);
    let peer_url = format!("http://127.0.0.1:{}", restarted.1);
    let warm = spawn_indexer(&dir.join("peer"), &sglang_config(events, None), &["--peer", &peer_url]);
    within("the peer-started indexer knows the prefix", Duration::from_secs(3), || warm.matched(&prefix) == 32);
    assert_eq!(warm_from(&warm).as_deref(), Some("peer"));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cold.matched(&prefix), 0, "the premise: without replay or a peer the quiet engine stays invisible");

    // The engine speaks again: the peer-started replica goes on from the peer's sequence.
    let more: Vec<u32> = (232..236).collect();
    publisher.publish(json!(sglang_pages(-9_000_000_000_000 + 32, Some(-9_000_000_000_000 + 31), &more)));
    let longer: Vec<u32> = (200..236).collect();
    wait("the next live batch on the peer-started replica", || warm.matched(&longer) == 36);
    assert!(warm.metrics().contains("sgl_indexer_unrepaired_gaps_total 0"));
}

fn post_with(indexer: &Indexer, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut request = agent.post(&indexer.url(path)).header("content-type", "application/json");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let mut r = request.send(body.to_string()).unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// Two replicas agree a claim: a query reaching the second opens it at the first (the arbiter),
/// a concurrent query sharing the prefix on the first waits on it, and the routed notice — sent
/// to both, as the filter sends it — wakes it with the claim's engine matched, on both.
#[test]
fn replicas_agree_claims_and_routed_notices_land_everywhere() {
    let (a_port, b_port) = (free_port(), free_port());
    let config = json!({
        "workers": [{"id": "A", "url": "http://127.0.0.1:1", "model": "m"},
                    {"id": "B", "url": "http://127.0.0.1:2", "model": "m"}],
        "prefix_index": {"urls": [format!("http://127.0.0.1:{a_port}"), format!("http://127.0.0.1:{b_port}")],
                         "block_tokens": 4, "timeout_ms": 400},
        "models": {"m": {"buckets": [{"id": "b", "groups": {"plain": {"policy": {"type": "cache_aware", "source": "remote"}}}}]}}
    });
    let dir = std::env::temp_dir().join(format!("sgl-indexer-replicas-{}", std::process::id()));
    let a = spawn_indexer_on(a_port, &dir.join("a"), &config, &[]);
    let b = spawn_indexer_on(b_port, &dir.join("b"), &config, &[]);
    // Each order: the claim opened through the arbiter and waited on at it, then opened at the
    // arbiter and waited on at the other replica (which mirrors it until the notice arrives).
    for (round, (first_at, second_at)) in [(&b, &a), (&a, &b)].into_iter().enumerate() {
        let start = 5000 + 10_000 * round as u32;
        let prefix: Vec<u32> = (start..start + 2048).collect();
        let notify = [("x-sgl-routed-notice", "1")];
        let query = json!({"model": "m", "token_ids": prefix});
        let (status, first) = post_with(first_at, "/query", &query, &notify);
        assert_eq!(status, 200, "{first}");
        assert!(first["data"].as_object().unwrap().is_empty(), "a new prefix: {first}");
        let handle = first["handle"].as_str().unwrap().to_string();
        // The second query reaches the other replica while the first is being routed.
        let waiting = std::thread::spawn({
            let url = second_at.url("/query");
            let query = query.clone();
            move || {
                let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
                let started = Instant::now();
                let mut r = agent
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-sgl-routed-notice", "1")
                    .send(query.to_string())
                    .unwrap();
                let v: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
                (v, started.elapsed())
            }
        });
        std::thread::sleep(Duration::from_millis(60));
        let notice = json!({"handle": handle, "worker": "B"});
        for replica in [&a, &b] {
            let status = post_with(replica, "/v1/prefix/routed", &notice, &[]).0;
            assert!(status == 204 || status == 202, "round {round}: applied, or held for the handle ({status})");
        }
        let (second, waited) = waiting.join().unwrap();
        assert_eq!(second["data"]["B"]["matched_tokens"], 2048, "round {round}, the claim's engine: {second}");
        assert!(waited >= Duration::from_millis(50), "round {round}: it waited for the notice: {waited:?}");
        for replica in [&a, &b] {
            let (_, v) = post_with(replica, "/query", &json!({"model": "m", "token_ids": prefix}), &[]);
            assert_eq!(v["data"]["B"]["matched_tokens"], 2048, "round {round}: {v}");
        }
    }
    for replica in [&a, &b] {
        assert!(replica.metrics().contains("sgl_indexer_claim_waits_total 1"), "{}", replica.metrics());
    }
}
