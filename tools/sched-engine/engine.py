#!/usr/bin/env python3
"""A third engine model for the routing benchmarks (issue 29), written from SGLang's documented
scheduler rather than from `sgl-sim` or `tools/script-engine`, with which it shares no code.

What it models, after SGLang's scheduler (`python/sglang/srt/managers/scheduler.py` and its docs):

- one event loop per engine; each turn runs either a prefill batch or one decode step, prefill
  first: while requests wait and can be admitted, decode waits;
- a prefill batch admits waiting requests first come first served (`--schedule-policy fcfs`, or
  `lpm`: longest cached prefix first) while running slots (`--max-running`, many), the batch's
  token budget (`--max-prefill-tokens`) and free KV (`--kv-capacity`, unreferenced cache evicted
  least recently used) allow; a prompt longer than what is left of the chunk budget
  (`--chunked-prefill-size`) is prefilled a chunk per turn, first in the next batch;
- the prefix cache is a radix tree over tokens matched when a request is scheduled, not when it
  arrives; a prefilled prompt is inserted at once, its answer when the request finishes;
- a prefill batch takes `--prefill-launch-ms` plus its uncached tokens at `--prefill-tps`; a decode
  step takes `--step-ms` plus `--step-per-request-ms` for each running request; the first token
  comes out of the prefill;
- the tokenizer: words and punctuation, with a chat template's role markers;
- SGLang's API as routers call it, with only the basic `/v1/loads` fields (running, waiting, KV
  use and capacity, slots): no prefill counters and no uncached-token queue. Streamed responses
  send their headers at once, as SGLang's StreamingResponse does; the first body chunk follows the
  first token. `/sim/state` serves the cache counters the load generator reads.

Run: `python engine.py --port 31000 --id E00 --prefill-tps 8000`. Needs aiohttp. `--trace FILE`
appends one JSON line per request: where its time to first token went.
"""
import argparse
import asyncio
import heapq
import itertools
import json
import re
import time

from aiohttp import web

WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(messages):
    out = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        out += ["<|im_start|>", str(m.get("role", "user"))] + WORD.findall(str(content)) + ["<|im_end|>"]
    return out + ["<|im_start|>", "assistant"]


class Node:
    __slots__ = ("key", "children", "parent", "lock", "used")

    def __init__(self, key, parent):
        self.key, self.children, self.parent, self.lock, self.used = key, {}, parent, 0, 0.0


class RadixCache:
    """Tokens by prefix; a node's tokens stay while a running request locks it."""

    def __init__(self):
        self.root = Node((), None)
        self.size = 0

    def match(self, tokens):
        """The longest cached prefix: its length and the deepest node, split at the match."""
        node, n, now = self.root, 0, time.monotonic()
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = 0
            while k < len(child.key) and n + k < len(tokens) and child.key[k] == tokens[n + k]:
                k += 1
            if k < len(child.key):
                child = self._split(child, k)
            child.used = now
            node, n = child, n + k
        return n, node

    def _split(self, child, k):
        head = Node(child.key[:k], child.parent)
        head.lock, head.used = child.lock, child.used
        child.parent.children[child.key[0]] = head
        child.key, child.parent = child.key[k:], head
        head.children[child.key[0]] = child
        return head

    def insert(self, tokens):
        n, node = self.match(tokens)
        if n < len(tokens):
            leaf = Node(tuple(tokens[n:]), node)
            leaf.used = time.monotonic()
            node.children[leaf.key[0]] = leaf
            self.size += len(leaf.key)
            node = leaf
        return node

    def lock(self, node, delta):
        while node is not None and node.parent is not None:
            node.lock += delta
            node = node.parent

    def evictable(self):
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None and node.lock == 0:
                total += len(node.key)
        return total

    def evict(self, tokens):
        """Frees at least `tokens` from unlocked leaves, least recently used first."""
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None and not node.children and node.lock == 0:
                leaves.append((node.used, id(node), node))
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[node.key[0]]
            freed += len(node.key)
            self.size -= len(node.key)
            if parent.parent is not None and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        return freed


class Request:
    ids = itertools.count()

    def __init__(self, tokens, max_tokens):
        self.id = next(Request.ids)
        self.tokens, self.max_tokens = tokens, max(1, max_tokens)
        self.out = asyncio.Queue()
        self.arrived = time.monotonic()
        self.scheduled = None
        self.hit = 0
        self.done = 0  # prompt tokens prefilled (cached ones count as done at scheduling)
        self.generated = 0
        self.node = None
        self.aborted = False


class Engine:
    def __init__(self, a):
        self.a = a
        self.cache = RadixCache()
        self.waiting = []
        self.running = []
        self.chunked = None
        self.wake = asyncio.Event()
        self.cached_tokens = self.prompt_tokens = 0
        self.trace = open(a.trace, "a", buffering=1) if a.trace else None

    def submit(self, req):
        self.waiting.append(req)
        self.wake.set()

    def used(self):
        """KV in use: the cache, plus what running requests hold outside it (their answers)."""
        return self.cache.size + sum(r.generated for r in self.running)

    def admit(self, req, budget):
        """Schedules `req` if its uncached prompt and answer fit in free or evictable KV."""
        hit, node = self.cache.match(req.tokens)
        hit = min(hit, len(req.tokens) - 1)  # the last prompt token is always computed
        need = len(req.tokens) - hit + req.max_tokens
        free = self.a.kv_capacity - self.used()
        if need > free and need > free + self.cache.evictable():
            return False
        if need > free:
            self.cache.evict(need - free)
        req.scheduled, req.hit, req.done, req.node = time.monotonic(), hit, hit, node
        self.cache.lock(node, 1)
        self.cached_tokens += hit
        self.prompt_tokens += len(req.tokens)
        return True

    def prefill_batch(self):
        """This turn's prefill work: (request, tokens) pairs, the chunked request first."""
        chunk = self.a.chunked_prefill_size
        budget = self.a.max_prefill_tokens
        batch = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            take = min(len(req.tokens) - req.done, chunk, budget)
            batch.append((req, take))
            chunk, budget = chunk - take, budget - take
            if req.done + take < len(req.tokens):
                self.chunked = req
                return batch
        self.waiting = [r for r in self.waiting if not r.aborted]
        if self.a.schedule_policy == "lpm" and len(self.waiting) <= 128:
            self.waiting.sort(key=lambda r: -self.cache.match(r.tokens)[0])
        while self.waiting and chunk > 0 and budget > 0 and len(self.running) + len(batch) < self.a.max_running:
            req = self.waiting[0]
            if not self.admit(req, budget):
                break
            self.waiting.pop(0)
            left = len(req.tokens) - req.done
            take = min(left, chunk, budget)
            batch.append((req, take))
            chunk, budget = chunk - take, budget - take
            if take < left:
                self.chunked = req
                break
        return batch

    async def run(self):
        while True:
            if not self.waiting and not self.running and self.chunked is None:
                self.wake.clear()
                await self.wake.wait()
            batch = self.prefill_batch()
            if batch:
                tokens = sum(t for _, t in batch)
                await asyncio.sleep(self.a.prefill_launch_ms / 1000 + tokens / self.a.prefill_tps)
                for req, take in batch:
                    req.done += take
                    if req.done >= len(req.tokens):
                        self.first_token(req)
            elif self.running:
                await asyncio.sleep((self.a.step_ms + self.a.step_per_request_ms * len(self.running)) / 1000)
                for req in list(self.running):
                    self.emit(req)
            else:
                await asyncio.sleep(0.001)  # waiting, but nothing fits: KV frees only as requests end

    def first_token(self, req):
        node = self.cache.insert(req.tokens)
        self.cache.lock(req.node, -1)
        self.cache.lock(node, 1)
        req.node = node
        self.running.append(req)
        if self.trace:
            now = time.monotonic()
            self.trace.write(json.dumps({"engine": self.a.id, "at": round(req.arrived, 4),
                                         "queue_ms": round((req.scheduled - req.arrived) * 1e3, 1),
                                         "prefill_ms": round((now - req.scheduled) * 1e3, 1),
                                         "prompt": len(req.tokens), "hit": req.hit, "running": len(self.running),
                                         "waiting": len(self.waiting), "head": req.tokens[3] if len(req.tokens) > 3 else ""}) + "\n")
        self.emit(req)

    def emit(self, req):
        if req.aborted:
            return self.finish(req)
        req.generated += 1
        req.out.put_nowait(f"t{req.generated} ")
        if req.generated >= req.max_tokens:
            self.finish(req)

    def finish(self, req):
        self.running.remove(req)
        self.cache.lock(req.node, -1)
        self.cache.insert(req.tokens + [f"t{i}" for i in range(1, req.generated + 1)])
        req.out.put_nowait(None)


def chunk(model, rid, delta, finish=None, usage=None):
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


async def chat(request):
    engine = request.app["engine"]
    try:
        body = await request.json()
        tokens = tokenize(body["messages"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return web.json_response({"error": {"message": "bad request", "type": "invalid_request_error"}}, status=400)
    model = body.get("model", engine.a.model)
    req = Request(tokens, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
    rid = f"chatcmpl-{engine.a.id}-{req.id}"
    engine.submit(req)
    resp = None
    try:
        if body.get("stream"):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-sim-engine": engine.a.id})
            await resp.prepare(request)
        pieces = []
        while (piece := await req.out.get()) is not None:
            if resp is not None:
                delta = {"role": "assistant", "content": piece} if not pieces else {"content": piece}
                await resp.write(chunk(model, rid, delta))
            pieces.append(piece)
        use = {"prompt_tokens": len(tokens), "completion_tokens": len(pieces), "total_tokens": len(tokens) + len(pieces),
               "prompt_tokens_details": {"cached_tokens": req.hit}}
        if resp is None:
            return web.json_response({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)},
                                                   "finish_reason": "length"}], "usage": use},
                                     headers={"x-sim-engine": engine.a.id})
        await resp.write(chunk(model, rid, {}, "length", use))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        req.aborted = True  # the client went away: the scheduler drops it at its next turn
        raise


def routes(a):
    def info(_):
        return web.json_response({"model_path": a.model, "served_model_name": a.model, "tokenizer_path": a.model,
                                  "is_generation": True, "disaggregation_mode": "null", "dp_size": 1, "tp_size": 1,
                                  "max_total_num_tokens": a.kv_capacity, "max_running_requests": a.max_running,
                                  "chunked_prefill_size": a.chunked_prefill_size, "version": "sched-engine"})

    async def health(_):
        return web.Response(text="")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": a.model, "object": "model", "created": 0, "owned_by": "sched-engine"}]})

    async def loads(request):
        e = request.app["engine"]
        return web.json_response({"timestamp_ms": int(time.time() * 1000), "loads": [{
            "dp_rank": 0, "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.waiting) + (e.chunked is not None),
            "num_used_tokens": e.used(), "max_total_num_tokens": a.kv_capacity, "max_running_requests": a.max_running}]})

    async def state(request):
        e = request.app["engine"]
        return web.json_response({"id": a.id, "running": len(e.running), "waiting": len(e.waiting),
                                  "cache": {"cached_tokens": e.cached_tokens, "prompt_tokens": e.prompt_tokens}})

    async def flush(request):
        e = request.app["engine"]
        if e.running or e.waiting:
            return web.Response(status=400, text="requests are running")
        e.cache = RadixCache()
        return web.Response(text="")

    return [web.post("/v1/chat/completions", chat), web.get("/health", health), web.get("/health_generate", health),
            web.get("/get_server_info", info), web.get("/server_info", info), web.get("/get_model_info", info),
            web.get("/model_info", info), web.get("/v1/models", models), web.get("/v1/loads", loads),
            web.get("/sim/state", state), web.post("/flush_cache", flush)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--id", default="Q0")
    ap.add_argument("--model", default="demo-model")
    ap.add_argument("--prefill-tps", type=float, default=8000.0, help="uncached prompt tokens prefilled a second")
    ap.add_argument("--prefill-launch-ms", type=float, default=3.0)
    ap.add_argument("--step-ms", type=float, default=12.0, help="a decode step's fixed cost")
    ap.add_argument("--step-per-request-ms", type=float, default=0.12, help="a decode step's cost per running request")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--chunked-prefill-size", type=int, default=4096)
    ap.add_argument("--kv-capacity", type=int, default=120000)
    ap.add_argument("--schedule-policy", choices=["fcfs", "lpm"], default="fcfs")
    ap.add_argument("--trace", help="append one JSON line per request: where its time to first token went")
    a = ap.parse_args()

    async def make():
        app = web.Application(client_max_size=64 << 20)
        engine = Engine(a)
        app["engine"] = engine

        async def loop(app):
            task = asyncio.create_task(engine.run())
            yield
            task.cancel()

        app.cleanup_ctx.append(loop)
        app.add_routes(routes(a))
        return app

    web.run_app(make(), host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
