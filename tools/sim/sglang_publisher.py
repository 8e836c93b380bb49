"""SGLang's own KV-event publisher, driven over stdin (by `sgl-sim --kv-events-sglang`, and by the
indexer's tests).

Loads `sglang/srt/disaggregation/kv_events.py` from the SGLang wheel that `scripts/setup --tests`
unpacks (the module alone: the two helpers it imports from the rest of SGLang are stubbed, since
this publisher never calls them), binds its PUB and replay ROUTER sockets on loopback and prints
`ready`. Each stdin line is a JSON command:
  {"events": [{"type": "BlockStored", ...}, {"type": "BlockRemoved", ...}, {"type": "AllBlocksCleared"}]}
publishes one batch with SGLang's own classes and encoder; {"exit": true} shuts it down.
"""

import importlib.util
import json
import sys
import time
import types


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def main():
    module_path, events_port, replay_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # Optional: the attention-DP rank this publisher speaks for; it offsets both ports by it.
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    for package in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
        stub(package, __path__=[])
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=object)
    spec = importlib.util.spec_from_file_location("sglang.srt.disaggregation.kv_events", module_path)
    kv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv)

    publisher = kv.ZmqEventPublisher(
        attn_dp_rank=rank,
        endpoint=f"tcp://127.0.0.1:{events_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if replay_port else None,
        buffer_steps=10_000,
        topic="kv",
        bind=True,
    )
    kinds = {"BlockStored": kv.BlockStored, "BlockRemoved": kv.BlockRemoved, "AllBlocksCleared": kv.AllBlocksCleared}
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            break
        events = []
        for event in command["events"]:
            kind = kinds[event.pop("type")]
            if kind is kv.BlockStored:
                event.setdefault("parent_block_hash", None)
                event.setdefault("lora_id", None)
            events.append(kind(**event))
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
        print("published", flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
