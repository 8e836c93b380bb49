#!/usr/bin/env python3
"""A second, independent engine model for the routing benchmarks (issue 12).

It shares no code and no modelling choices with `sgl-sim`, so a routing result that holds on both
is not an artifact of one simulator. What it models, in its own way:

- its own tokenizer: whitespace words, one role marker per message and a generation prompt;
- a prefix cache of 16-token blocks keyed by chained hashes, evicted least recently used once it
  holds more than `--kv-capacity` tokens; a finished request caches its prompt and its answer, as
  a radix cache does, so the next turn of a conversation hits;
- one prefill lane per engine, first come first served, at `--prefill-tps` uncached tokens a
  second plus a fixed launch cost; decode steps of `--step-ms` that slow by `--batch-slowdown`
  per running request; at most `--max-running` requests admitted, the rest wait;
- SGLang's API as the routers call it: `/v1/chat/completions` (streamed or not), `/health`,
  `/get_server_info`, `/get_model_info`, `/v1/models`, and `/v1/loads` with only the basic
  fields an older SGLang reports (no `num_waiting_uncached_tokens`, no prefill counters), so a
  router must estimate prefill work itself. `/sim/state` reports the cache counters the load
  generator reads for the hit rate.

Run: `python engine.py --port 31000 --id E00`. Needs aiohttp (aiohttp sets TCP_NODELAY on accepted
connections, as SGLang's uvicorn does).
"""
import argparse
import asyncio
import collections
import hashlib
import json
import time

from aiohttp import web

BLOCK = 16


def tokens_of(messages):
    out = []
    for m in messages:
        out.append(f"<|{m.get('role', 'user')}|>")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.extend(str(content).split())
    out.append("<|assistant|>")
    return out


def block_keys(tokens):
    keys, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hashlib.blake2b(parent + "\x1f".join(tokens[i:i + BLOCK]).encode(), digest_size=12).digest()
        keys.append(parent)
    return keys


class Engine:
    def __init__(self, a):
        self.a = a
        self.cache = collections.OrderedDict()  # block key -> None, least recent first
        self.running = 0
        self.waiting = 0
        self.slots = asyncio.Semaphore(a.max_running)
        self.lane = asyncio.Lock()  # the one prefill lane
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.trace = open(a.trace, "a", buffering=1) if a.trace else None

    def matched(self, keys):
        n = 0
        for k in keys:
            if k not in self.cache:
                break
            self.cache.move_to_end(k)
            n += 1
        return n * BLOCK

    def store(self, keys):
        for k in keys:
            self.cache[k] = None
            self.cache.move_to_end(k)
        while len(self.cache) * BLOCK > self.a.kv_capacity:
            self.cache.popitem(last=False)

    async def generate(self, messages, max_tokens):
        """Yields the answer's tokens as they are decoded; the first after the prefill."""
        prompt = tokens_of(messages)
        arrived = time.monotonic()
        self.waiting += 1
        await self.slots.acquire()
        self.waiting -= 1
        self.running += 1
        slotted = time.monotonic()
        try:
            async with self.lane:
                laned = time.monotonic()
                keys = block_keys(prompt)
                hit = min(self.matched(keys), len(prompt))
                uncached = len(prompt) - hit
                self.cached_tokens += hit
                self.prompt_tokens += len(prompt)
                await asyncio.sleep(self.a.prefill_launch_ms / 1000 + uncached / self.a.prefill_tps)
                self.store(keys)
            if self.trace:
                # Where each request's time to first token went: slot wait, lane wait, prefill.
                self.trace.write(json.dumps({"engine": self.a.id, "at": round(arrived, 4), "slot_ms": round((slotted - arrived) * 1e3, 1),
                                             "lane_ms": round((laned - slotted) * 1e3, 1),
                                             "prefill_ms": round((time.monotonic() - laned) * 1e3, 1),
                                             "prompt": len(prompt), "hit": hit, "head": prompt[1] if len(prompt) > 1 else ""}) + "\n")
            answer = []
            for i in range(max(1, max_tokens)):
                if i:
                    await asyncio.sleep(self.a.step_ms / 1000 * (1 + self.a.batch_slowdown * self.running))
                answer.append(f"tok{i}")
                yield f"tok{i} ", len(prompt), hit
            self.store(block_keys(prompt + answer))
        finally:
            self.running -= 1
            self.slots.release()


def chunk(model, rid, delta, finish=None, usage=None):
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def usage(prompt, hit, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": hit}}


async def chat(request):
    engine = request.app["engine"]
    try:
        body = await request.json()
        messages = body["messages"]
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": {"message": "bad request", "type": "invalid_request_error"}}, status=400)
    model = body.get("model", engine.a.model)
    max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    rid = f"chatcmpl-{engine.a.id}-{id(request):x}"
    headers = {"x-sim-engine": engine.a.id}
    if not body.get("stream"):
        text, n, prompt, hit = [], 0, 0, 0
        async for piece, prompt, hit in engine.generate(messages, max_tokens):
            text.append(piece)
            n += 1
        return web.json_response({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                                               "finish_reason": "length"}],
                                  "usage": usage(prompt, hit, n)}, headers=headers)
    resp = web.StreamResponse(headers={**headers, "content-type": "text/event-stream", "cache-control": "no-cache"})
    await resp.prepare(request)
    n, prompt, hit = 0, 0, 0
    async for piece, prompt, hit in engine.generate(messages, max_tokens):
        delta = {"role": "assistant", "content": piece} if n == 0 else {"content": piece}
        await resp.write(chunk(model, rid, delta))
        n += 1
    await resp.write(chunk(model, rid, {}, "length", usage(prompt, hit, n)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def routes(a):
    def info(_):
        return web.json_response({"model_path": a.model, "served_model_name": a.model, "tokenizer_path": a.model,
                                  "is_generation": True, "disaggregation_mode": "null", "dp_size": 1, "tp_size": 1,
                                  "max_total_num_tokens": a.kv_capacity, "max_running_requests": a.max_running,
                                  "version": "script-engine"})

    async def health(_):
        return web.Response(text="")

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": a.model, "object": "model", "created": 0, "owned_by": "script-engine"}]})

    async def loads(request):
        e = request.app["engine"]
        return web.json_response({"timestamp_ms": int(time.time() * 1000), "loads": [{
            "dp_rank": 0, "num_running_reqs": e.running, "num_waiting_reqs": e.waiting,
            "num_used_tokens": len(e.cache) * BLOCK, "max_total_num_tokens": a.kv_capacity,
            "max_running_requests": a.max_running}]})

    async def state(request):
        e = request.app["engine"]
        return web.json_response({"id": a.id, "running": e.running, "waiting": e.waiting,
                                  "cache": {"cached_tokens": e.cached_tokens, "prompt_tokens": e.prompt_tokens}})

    async def flush(request):
        request.app["engine"].cache.clear()
        return web.Response(text="")

    return [web.post("/v1/chat/completions", chat), web.get("/health", health), web.get("/health_generate", health),
            web.get("/get_server_info", info), web.get("/server_info", info), web.get("/get_model_info", info),
            web.get("/model_info", info), web.get("/v1/models", models), web.get("/v1/loads", loads),
            web.get("/sim/state", state), web.post("/flush_cache", flush)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--id", default="S0")
    ap.add_argument("--model", default="demo-model")
    ap.add_argument("--prefill-tps", type=float, default=8000.0)
    ap.add_argument("--prefill-launch-ms", type=float, default=2.0)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--batch-slowdown", type=float, default=0.02)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--kv-capacity", type=int, default=60000)
    ap.add_argument("--trace", help="append one JSON line per request: where its time to first token went")
    a = ap.parse_args()

    async def make():
        app = web.Application(client_max_size=64 << 20)
        app["engine"] = Engine(a)
        app.add_routes(routes(a))
        return app

    web.run_app(make(), host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
