"""Peak memory: each engine in a process of its own, generating with a
512-token context, against the file plus that context's KV."""

import subprocess
import sys
import time
from pathlib import Path

from peerslib.common import FILLER, KVMESH_OPTIONS, log


MEM_CONTEXT = 512
MEM_TOKENS = 16

LLAMA_CPP_MEM_SCRIPT = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=int(sys.argv[2]),
                      n_threads=int(sys.argv[3]), verbose=False)
llm(sys.argv[4], max_tokens=int(sys.argv[5]), temperature=0)
"""


def kv_bytes(gguf, tokens):
    """f16 K and V for `tokens` positions in every layer, from the file's
    header (what both engines allocate for that context)."""
    from gguf import GGUFReader

    r = GGUFReader(str(gguf))

    def field(name):
        f = r.fields.get(name)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    layers = int(field(f"{arch}.block_count"))
    heads = field(f"{arch}.attention.head_count")
    kv = field(f"{arch}.attention.head_count_kv") or heads
    kv = max(kv) if isinstance(kv, list) else int(kv)
    head_dim = field(f"{arch}.attention.key_length") or int(field(f"{arch}.embedding_length")) // int(heads)
    return 2 * layers * kv * int(head_dim) * 2 * tokens


def peak_rss_mb(cmd):
    """Run `cmd` to its end; its peak resident set in MB: the kernel's
    high-water mark of the process's own memory (VmHWM), read every 5 ms
    until it exits. (getrusage's ru_maxrss would not do: Linux carries a
    forked parent's resident set over exec into it, here this script's.)"""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status = Path(f"/proc/{p.pid}/status")
    peak_kib = 0
    while p.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak_kib = max(peak_kib, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}")
    return peak_kib * 1024 / 1e6


def measure_memory(gguf, kvmesh, threads, skip):
    """Peak RSS of a short greedy generation with a 512-token context, each
    engine in its own process, against the file plus that context's KV."""
    out = {"context": MEM_CONTEXT, "file_mb": round(gguf.stat().st_size / 1e6, 1),
           "kv_mb": round(kv_bytes(gguf, MEM_CONTEXT) / 1e6, 1)}
    prompt = FILLER[:200]
    runs = {
        "kvmesh": [str(kvmesh), "generate", "--model", str(gguf), "--prompt", prompt, "--max-tokens", str(MEM_TOKENS),
                   "--temperature", "0", "--kv-pool-tokens", str(MEM_CONTEXT)]
        + (["--cpu-kernels", KVMESH_OPTIONS["cpu_kernels"]] if KVMESH_OPTIONS["cpu_kernels"] else [])
        + (["--activations", KVMESH_OPTIONS["activations"]] if KVMESH_OPTIONS["activations"] else []),
        "llama.cpp": [sys.executable, "-c", LLAMA_CPP_MEM_SCRIPT, str(gguf), str(MEM_CONTEXT), str(threads), prompt,
                      str(MEM_TOKENS)],
    }
    base = out["file_mb"] + out["kv_mb"]
    for name, cmd in runs.items():
        if name in skip:
            continue
        try:
            mb = peak_rss_mb(cmd)
            out[name] = {"peak_rss_mb": round(mb, 1), "of_file_and_kv": round(mb / base, 3)}
            log(f"{name}: peak RSS {mb:.1f} MB ({mb / base:.2f}x the file plus the KV)")
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def render_memory(mem):
    if not mem:
        return []
    line = (f"peak RSS, a {mem['context']}-token context, {MEM_TOKENS} greedy tokens, each engine in its own process "
            f"(file {mem['file_mb']} MB, f16 KV {mem['kv_mb']} MB):")
    cells = []
    for name in ("kvmesh", "llama.cpp"):
        r = mem.get(name)
        if r and "peak_rss_mb" in r:
            cells.append(f"{name} {r['peak_rss_mb']} MB ({r['of_file_and_kv']:.2f}x file+KV)")
        elif r:
            cells.append(f"{name} failed: {r['error']}")
    return [line, "  " + "; ".join(cells)]


def memory_goal(mem):
    r = (mem or {}).get("kvmesh") or {}
    goal = "kvmesh peak RSS <= 1.3x (file + KV)"
    if "of_file_and_kv" not in r:
        return {"goal": goal, "status": "NOT EVALUATED", "detail": "not measured"}
    x = r["of_file_and_kv"]
    return {"goal": goal, "status": "MET" if x <= 1.3 else "NOT MET", "ratio": x,
            "detail": f"{x:.2f}x ({r['peak_rss_mb']} MB against {mem['file_mb']} + {mem['kv_mb']} MB)"}
