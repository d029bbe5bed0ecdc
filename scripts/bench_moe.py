#!/usr/bin/env python3
"""What a mixture of experts costs per token against the dense model of the
same active size, side by side in one run (issue 38, item 5).

Two random-weight GGUF files in one block format (Q4_0 by default), written
once into the cache (`$KVMESH_HOME/bench-moe`, default
~/.cache/kvmesh/bench-moe) with the `gguf` package:

  moe    qwen3moe: E experts of width F, top-k K (renormalised)
  dense  qwen3:    one MLP of width K x F (the same multiply-adds per token)

Same hidden size, layers, heads and vocabulary (the tiny Llama's 512
tokens, so the vocabulary projection is negligible and the MLPs dominate).
Then `kvmesh bench-engine --json` on each, alternating, for --rounds
rounds: prefill tok/s, decode tok/s at batch 1 and aggregate at batch 16,
and the ratio moe/dense of each (medians over rounds).

What to expect: at batch 1 a token reads K experts, the dense model's MLP
bytes, so the ratio is near 1 plus the router. At batch 16 the 16 x K
(row, expert) pairs are grouped by expert: each chosen expert's weights
are read once per step and multiply all of its rows together, so the
multiply-adds equal the dense model's while the bytes read grow to the
experts actually chosen (up to E/K times the dense MLP's).

Usage: python3 scripts/bench_moe.py [--rounds 3] [--type Q4_0] [--hidden 1024]
         [--layers 8] [--experts 8] [--top-k 2] [--expert-ff 1024]
         [--kvmesh target/release/kvmesh] [--json out.json]
Needs numpy and gguf (the golden venv has both: scripts/golden/run.sh).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts" / "golden"))
import make_family_ggufs as fg  # noqa: E402


def log(msg):
    print(f"[bench_moe] {msg}", file=sys.stderr, flush=True)


def write_model(path, arch, a, qtype, seed):
    """A random-weight GGUF of `arch` (`qwen3moe` or `qwen3`) in `qtype`:
    matrices uniform in +-1/sqrt(cols), norms 1, the router f32."""
    rng = np.random.default_rng(seed)
    h, heads, kv, hd = a.hidden, a.hidden // 64, max(1, a.hidden // 256), 64
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(a.layers)
    dense_ff = a.top_k * a.expert_ff
    w.add_feed_forward_length(dense_ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    if arch == "qwen3moe":
        w.add_expert_count(a.experts)
        w.add_expert_used_count(a.top_k)
        w.add_expert_feed_forward_length(a.expert_ff)
    vocab = fg.tokenizer_metadata(w, fg.DATA / "tiny-llama")
    w.add_vocab_size(vocab)

    def matrix(*shape, quantize=True):
        t = (rng.uniform(-1, 1, size=shape) / np.sqrt(shape[-1])).astype(np.float32)
        if not quantize:
            return t, None
        q = gguf.quants.quantize(t, qtype)
        return q, qtype

    def add(name, t):
        data, ty = t
        if ty is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=ty)

    add("token_embd.weight", matrix(vocab, h))
    add("output.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(a.layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", np.ones(h, np.float32))
        for n in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + n + ".weight", np.ones(hd, np.float32))
        add(p + "attn_q.weight", matrix(heads * hd, h))
        add(p + "attn_k.weight", matrix(kv * hd, h))
        add(p + "attn_v.weight", matrix(kv * hd, h))
        add(p + "attn_output.weight", matrix(h, heads * hd))
        if arch == "qwen3moe":
            add(p + "ffn_gate_inp.weight", matrix(a.experts, h, quantize=False))
            add(p + "ffn_gate_exps.weight", matrix(a.experts, a.expert_ff, h))
            add(p + "ffn_up_exps.weight", matrix(a.experts, a.expert_ff, h))
            add(p + "ffn_down_exps.weight", matrix(a.experts, h, a.expert_ff))
        else:
            add(p + "ffn_gate.weight", matrix(dense_ff, h))
            add(p + "ffn_up.weight", matrix(dense_ff, h))
            add(p + "ffn_down.weight", matrix(h, dense_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bench(kvmesh, model, args):
    cmd = [
        str(kvmesh), "bench-engine", "--model", str(model), "--json",
        "--prompt-tokens", str(args.prompt_tokens), "--batch", "1,16",
        "--decode-tokens", str(args.decode_tokens), "--repeats", "2",
    ]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    r = json.loads(out.strip().splitlines()[-1])
    decode = {d["batch"]: d["tokens_per_s"] for d in r["decode"]}
    return {"prefill": r["prefill_tokens_per_s"], "b1": decode[1], "b16": decode[16],
            "weight_bytes": r["roofline"]["weight_bytes"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q8_0"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ff", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kvmesh", default=str(REPO_ROOT / "target" / "release" / "kvmesh"))
    ap.add_argument("--json")
    a = ap.parse_args()
    kvmesh = Path(a.kvmesh)
    if not kvmesh.exists():
        log(f"{kvmesh} missing: cargo build --release -p kvmesh-cli (a few minutes)")
        subprocess.run(["cargo", "build", "--release", "-p", "kvmesh-cli"], cwd=REPO_ROOT, check=True)
    cache = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh")) / "bench-moe"
    cache.mkdir(parents=True, exist_ok=True)
    shape = f"h{a.hidden}-l{a.layers}-e{a.experts}-k{a.top_k}-f{a.expert_ff}-{a.type}"
    models = {"moe": cache / f"moe-{shape}.gguf", "dense": cache / f"dense-{shape}.gguf"}
    qtype = getattr(Q, a.type)
    for kind, path in models.items():
        if not path.exists():
            log(f"writing {path} (random weights, once)")
            write_model(path, "qwen3moe" if kind == "moe" else "qwen3", a, qtype, seed=38)
    runs = {k: [] for k in models}
    for r in range(a.rounds):
        for kind, path in models.items():
            res = bench(kvmesh, path, a)
            log(f"round {r + 1} {kind}: {res}")
            runs[kind].append(res)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("prefill", "b1", "b16")} for k, v in runs.items()}
    wb = {k: runs[k][0]["weight_bytes"] for k in runs}
    print(f"{'tok/s (median of ' + str(a.rounds) + ')':<28} {'moe':>10} {'dense':>10} {'moe/dense':>10}")
    for m, label in (("prefill", f"prefill@{a.prompt_tokens}"), ("b1", "decode b1"), ("b16", "aggregate @16")):
        print(f"{label:<28} {med['moe'][m]:>10.1f} {med['dense'][m]:>10.1f} {med['moe'][m] / med['dense'][m]:>9.2f}x")
    print(f"{'weight bytes per token':<28} {wb['moe']:>10} {wb['dense']:>10} {wb['moe'] / wb['dense']:>9.2f}x")
    print(f"shape {shape}; {a.threads} threads; {kvmesh}")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": shape, "median": med, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
