#!/usr/bin/env python3
"""TTFT and decode speed of a running kvmesh mesh against the single-process
reference engine (`kvmesh generate`), on the same prompts, in one run.

Usage: scripts/bench_mesh.py [--url http://127.0.0.1:8080] [--kvmesh target/release/kvmesh]
                             [--model PATH] [--max-tokens 64] [--repeat 3]

Standard library only. For each prompt (greedy, streamed): the mesh's time to
the first text chunk and its tokens/s after it, measured by this client; the
reference's, measured inside `kvmesh generate` (model load excluded). Prints a
table and the mesh/reference ratios (medians over --repeat runs); also checks
that both produced the same text.
"""

import argparse
import http.client
import json
import re
import statistics
import subprocess
import time
import urllib.parse

from bench_costs import sse_events

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "Write a haiku about the sea.",
    "Explain in one paragraph what a KV cache is in a transformer.",
    "List three colours:",
    "def fibonacci(n):",
]


def mesh_run(url, prompt, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    text, first, tokens = "", None, 0
    for ev in sse_events(resp):
        piece = ev["choices"][0].get("text") or ""
        if piece and first is None:
            first = time.perf_counter()
        text += piece
        if "usage" in ev:
            tokens = ev["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    tps = (tokens - 1) / (end - first) if end > first and tokens > 1 else 0.0
    return (first - start) * 1e3, tps, text


def reference_run(kvmesh, model, prompt, max_tokens):
    cmd = [kvmesh, "generate", "--prompt", prompt, "--max-tokens", str(max_tokens), "--temperature", "0"]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, env={"KVMESH_LOG": "info", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    ttft = float(re.search(r"ttft_ms=\"?([0-9.]+)", out.stderr).group(1))
    tps = float(re.search(r"decode_tokens_per_s=\"?([0-9.]+)", out.stderr).group(1))
    return ttft, tps, out.stdout[:-1] if out.stdout.endswith("\n") else out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--kvmesh", default="target/release/kvmesh")
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows = []
    print(f"{'prompt':<42} {'ref TTFT ms':>11} {'mesh TTFT ms':>12} {'ref tok/s':>9} {'mesh tok/s':>10}  same")
    for p in PROMPTS:
        ref = [reference_run(a.kvmesh, a.model, p, a.max_tokens) for _ in range(a.repeat)]
        mesh = [mesh_run(a.url, p, a.max_tokens) for _ in range(a.repeat)]
        r_ttft, r_tps = statistics.median(x[0] for x in ref), statistics.median(x[1] for x in ref)
        m_ttft, m_tps = statistics.median(x[0] for x in mesh), statistics.median(x[1] for x in mesh)
        same = ref[0][2] == mesh[0][2]
        rows.append((r_ttft, m_ttft, r_tps, m_tps))
        print(f"{p[:42]:<42} {r_ttft:>11.1f} {m_ttft:>12.1f} {r_tps:>9.1f} {m_tps:>10.1f}  {same}")
    r_ttft = statistics.median(r[0] for r in rows)
    m_ttft = statistics.median(r[1] for r in rows)
    r_tps = statistics.median(r[2] for r in rows)
    m_tps = statistics.median(r[3] for r in rows)
    print(f"median: TTFT reference {r_ttft:.1f} ms, mesh {m_ttft:.1f} ms (mesh/ref {m_ttft / r_ttft:.2f}x); "
          f"decode reference {r_tps:.1f} tok/s, mesh {m_tps:.1f} tok/s (mesh/ref {m_tps / r_tps:.2f}x)")


if __name__ == "__main__":
    main()
