#!/usr/bin/env python3
"""What traces cost: two `kvmesh serve` meshes side by side on one machine,
one with tracing off, one exporting every span (sample ratio 1) over
OTLP/gRPC to a real receiver (integration/python/otlp_receiver.py), driven
in turns, one request at a time, so a slow spell of a shared host falls on
both. Decode throughput (completion tokens after the first over the time
after the first) and TTFT, p50 and p90 over every request, and the ratio
on/off.

Usage: bench_tracing.py --kvmesh target/release/kvmesh [--model M.gguf]
                        [--rounds 12] [--max-tokens 64] [--prompt-words 200]
                        [--pythonpath DIRS] [--json out.json]

The receiver needs grpcio and opentelemetry-proto: --pythonpath (default:
the kvmesh cache's copies that integration/tests/tracing.rs installs,
$KVMESH_HOME/python/{grpcio-1.85.1,opentelemetry-proto-1.45.2}). The
meshes listen on free loopback ports and are stopped (SIGTERM, drained)
at the end; the receiver's span count is reported.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_costs import Server  # noqa: E402  (the same streamed client)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("river stone lantern orchard copper meadow harbor thistle quarry violet "
         "ember saddle glacier pepper tundra falcon marble willow cobalt acorn").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """The OTLP receiver as a child; counts the spans it prints."""

    def __init__(self, pythonpath):
        env = dict(os.environ, PYTHONPATH=pythonpath)
        self.p = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "integration/python/otlp_receiver.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        first = self.p.stdout.readline()
        if not first.startswith("listening "):
            raise RuntimeError(f"the receiver did not start: {first!r}")
        self.port = int(first.split()[1])
        self.spans = 0
        threading.Thread(target=self._count, daemon=True).start()

    def _count(self):
        for _ in self.p.stdout:
            self.spans += 1

    def stop(self):
        self.p.stdin.close()
        self.p.wait(timeout=10)


class Mesh:
    """`kvmesh serve` on free ports; `env` adds to the environment."""

    def __init__(self, kvmesh, model, env, name):
        self.name = name
        self.http = free_port()
        args = [kvmesh, "serve", "--http-port", str(self.http), "--grpc-port", str(free_port())]
        if model:
            args += ["--model", model]
        e = dict(os.environ, KVMESH_LOG="warn", **env)
        for k in [k for k in e if k.startswith("OTEL_") and k not in env]:
            del e[k]
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, env=e, text=True)
        deadline = time.time() + 300
        for line in self.p.stdout:
            if "metrics" in line:
                break
            if time.time() > deadline:
                raise RuntimeError(f"{name}: not ready")
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()
        self.srv = Server(f"http://127.0.0.1:{self.http}")

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=60)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvmesh", default=os.path.join(ROOT, "target/release/kvmesh"))
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    home = os.environ.get("KVMESH_HOME", os.path.expanduser("~/.cache/kvmesh"))
    ap.add_argument("--pythonpath", default=os.pathsep.join(
        os.path.join(home, "python", d) for d in ("grpcio-1.85.1", "opentelemetry-proto-1.45.2")))
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    receiver = Receiver(a.pythonpath)
    off = Mesh(a.kvmesh, a.model, {}, "off")
    on = Mesh(a.kvmesh, a.model, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, "on")
    stats = {m.name: {"ttft": [], "tps": []} for m in (off, on)}
    try:
        for m in (off, on):  # warm-up
            m.srv.stream("/v1/completions", {"prompt": "warm up", "max_tokens": 8})
        for rnd in range(a.rounds):
            # A fresh prompt per round (no prefix-cache hits), the same for
            # both; which mesh goes first alternates.
            prompt = " ".join(rng.choice(WORDS) for _ in range(a.prompt_words))
            body = {"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            for m in ((off, on) if rnd % 2 == 0 else (on, off)):
                times, _ = m.srv.stream("/v1/completions", body)
                ts = times.get(0, [])
                if len(ts) < 2:
                    raise RuntimeError(f"{m.name}: {len(ts)} tokens")
                stats[m.name]["ttft"].append(ts[0])
                stats[m.name]["tps"].append((len(ts) - 1) / (ts[-1] - ts[0]))
            print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    finally:
        on.stop()
        off.stop()
        receiver.stop()
    rows = []
    for key, label, scale in (("ttft", "TTFT p50 (ms)", 1e3), ("ttft", "TTFT p90 (ms)", 1e3),
                              ("tps", "decode tok/s p50", 1), ("tps", "decode tok/s p90", 1)):
        p = 50 if "p50" in label else 90
        x, y = scale * pct(stats["off"][key], p), scale * pct(stats["on"][key], p)
        rows.append((label, x, y, y / x))
    # The same per round, paired: the median of each round's on/off ratio.
    paired = {k: statistics.median(b / a for a, b in zip(stats["off"][k], stats["on"][k]))
              for k in ("ttft", "tps")}
    print(f"\n{a.rounds} rounds in turns, max_tokens {a.max_tokens}, ~{a.prompt_words}-word prompts; "
          f"{receiver.spans} spans received from the traced mesh")
    print(f"{'':22}{'off':>12}{'on':>12}{'on/off':>10}")
    for label, x, y, r in rows:
        print(f"{label:22}{x:>12.1f}{y:>12.1f}{r:>10.3f}")
    print(f"{'median paired ratio':22}{'':>12}{'':>12}  TTFT {paired['ttft']:.3f}, decode tok/s {paired['tps']:.3f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": rows, "paired": paired, "spans": receiver.spans}, fh, indent=1)


if __name__ == "__main__":
    main()
