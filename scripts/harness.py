"""Shared by scripts/bench and scripts/soak: start and stop processes (simulated engines, Envoy
with the filter), wait for them, read Envoy's Prometheus stats. Every process lives in one scratch
directory whose logs outlive the run."""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
VENV = ROOT / ".venv"
# $ENVOY, else func-e's Envoy when func-e is on PATH, else the pinned wheel's (scripts/envoy).
ENVOY = ROOT / "scripts" / "envoy"
PY = VENV / "bin" / "python"
SGLANG_ROUTER = "sglang-router==0.3.2"
RUN = Path(tempfile.mkdtemp(prefix=f"sgl-{Path(sys.argv[0]).name}-"))
PROCS = []


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n, first=20000, last=32000):
    """The first port of `n` consecutive ports free right now (for endpoints numbered base + i),
    below the kernel's ephemeral range: a subscriber retrying its connections to those endpoints
    before they are bound takes ephemeral source ports, which could be the very ports to bind."""
    def free(port):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    for base in range(first, last - n, n):
        if all(free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def free_ports(n):
    """`n` distinct ports free right now (held open together, so none is handed out twice)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start(name, cmd, env=None):
    out = open(RUN / f"{name}.log", "w")
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=RUN)
    PROCS.append(p)
    return p


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
        if p in PROCS:
            PROCS.remove(p)


def descendants(pid):
    """`pid` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def cpu_seconds(proc):
    """User + system CPU time of a started process and everything under it (the Envoy behind
    scripts/envoy's wrappers), in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in descendants(proc.pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / ticks


def wait_http(url, timeout=60, ok=(200,)):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up; logs in {RUN}")


def bin_(name):
    return str(TARGET / "release" / name)


def sims(n, base_args, trace=None):
    """`n` sgl-sim engines; `trace` a directory for each engine's per-request trace."""
    ports = [free_port() for _ in range(n)]
    extra = lambda i: ["--trace", str(trace / f"E{i:02d}.jsonl")] if trace else []
    procs = [start(f"sim{i}", [bin_("sgl-sim"), "--id", f"E{i:02d}", "--port", str(p), *base_args, *extra(i)]) for i, p in enumerate(ports)]
    for p in ports:
        wait_http(f"http://127.0.0.1:{p}/health")
    return ports, procs


def envoy_with_filter(name, cfg, wasm=None, concurrency=2):
    """Envoy with the filter on `cfg`; `wasm` another build of the module (the default: this tree's)."""
    port, admin = free_port(), free_port()
    path = RUN / f"{name}.router.json"
    path.write_text(json.dumps(cfg))
    yaml = subprocess.run([bin_("sgl-envoy-router"), "render", str(path), "--wasm", str(wasm or TARGET / "wasm32-wasip1/release/sgl_envoy_router.wasm"),
                           "--listen", f"127.0.0.1:{port}", "--admin", str(admin)], capture_output=True, text=True, check=True).stdout
    if wasm:
        # An older build refuses the fields it predates, and `render` names the namespace.
        yaml = yaml.replace('"namespace":"sgl_router",', "")
    (RUN / f"{name}.envoy.yaml").write_text(yaml)
    p = start(name, [str(ENVOY), "-c", str(RUN / f"{name}.envoy.yaml"), "--concurrency", str(concurrency), "--disable-hot-restart", "-l", "warning"])
    wait_http(f"http://127.0.0.1:{admin}/ready")
    time.sleep(1.5)  # the service's first load and health data
    p.admin_port = admin
    return port, [p]



def metric(admin_port, prefix):
    """Every Prometheus sample of Envoy's admin whose line starts with `prefix`, as {line: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats/prometheus", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out
