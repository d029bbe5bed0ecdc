"""The three engines, each measured its own way: kvmesh's `bench-engine`,
llama.cpp through llama-cpp-python's low-level API, and transformers in
float32 on the CPU."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peerslib.common import (
    BATCH, DEFAULT_GGUF, FILLER, GOLDEN_DIR, KVMESH_OPTIONS, PROMPT_TOKENS, REPO_ROOT,
    SHORT_PROMPT_TOKENS, log, median_of,
)


# --------------------------------------------------------------------------------------
# kvmesh: its own benchmark
# --------------------------------------------------------------------------------------


def ensure_kvmesh(path, explicit):
    if path.exists():
        return path
    if explicit:
        sys.exit(f"--kvmesh {path} does not exist")
    log("target/release/kvmesh missing: cargo build --release -p kvmesh-cli (a few minutes)")
    subprocess.run(["cargo", "build", "--release", "-p", "kvmesh-cli"], cwd=REPO_ROOT, check=True)
    return path


def ensure_gguf(gguf, kvmesh):
    if gguf.exists():
        return gguf
    if gguf != DEFAULT_GGUF:
        sys.exit(f"GGUF not found: {gguf}")
    log(f"{gguf} missing: {kvmesh} fetch-model")
    subprocess.run([str(kvmesh), "fetch-model"], check=True)
    if not gguf.exists():
        sys.exit(f"`kvmesh fetch-model` did not produce {gguf} (is $KVMESH_HOME set elsewhere?)")
    return gguf


def run_kvmesh(kvmesh, gguf, threads, repeats, decode_tokens):
    cmd = [
        str(kvmesh), "bench-engine", "--model", str(gguf),
        "--prompt-tokens", str(PROMPT_TOKENS), "--batch", f"1,{BATCH}",
        "--decode-tokens", str(decode_tokens), "--repeats", str(repeats), "--json",
    ]
    log("kvmesh: " + " ".join(cmd[1:]))
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), KVMESH_LOG="warn")
    if KVMESH_OPTIONS["cpu_kernels"]:
        env["KVMESH_CPU_KERNELS"] = KVMESH_OPTIONS["cpu_kernels"]
    if KVMESH_OPTIONS["activations"]:
        env["KVMESH_ACTIVATIONS"] = KVMESH_OPTIONS["activations"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"kvmesh bench-engine failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("{")][-1]
    v = json.loads(line)
    decode = {d["batch"]: d["tokens_per_s"] for d in v["decode"]}
    return {
        "prefill": v["prefill_tokens_per_s"],
        "decode_b1": decode.get(1),
        f"decode_b{BATCH}": decode.get(BATCH),
        "info": {"mode": v.get("mode"), "cpu_kernels": v.get("cpu_kernels"),
                 "activations": v.get("activations"), "kv_dtype": v.get("kv_dtype"),
                 "threads": v.get("threads"), "binary": str(kvmesh),
                 # The machine's ceilings measured by bench-engine in the same run: batch-1
                 # weight streaming against the read bandwidth, prefill against the FMA peak.
                 "roofline": v.get("roofline"),
                 # The CPU share the hypervisor took during this run (steal).
                 "steal_share": v.get("steal_share")},
    }


# --------------------------------------------------------------------------------------
# llama.cpp through llama-cpp-python's low-level API
# --------------------------------------------------------------------------------------


def prompt_ids(gguf):
    """The filler's token ids by llama.cpp's tokenizer (add_special false,
    parse_special true: as kvmesh encodes a prompt), repeated to 512."""
    import llama_cpp as L
    import llama_cpp._logger

    llama_cpp._logger.set_verbose(False)  # llama.cpp's load messages; errors still show
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(gguf).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load the vocabulary of {gguf}")
    try:
        raw = FILLER.encode()
        buf = (L.llama_token * (len(raw) + 16))()
        n = L.llama_tokenize(L.llama_model_get_vocab(model), raw, len(raw), buf, len(buf), False, True)
        if n <= 0:
            raise RuntimeError(f"llama_tokenize returned {n}")
        unit = list(buf[:n])
    finally:
        L.llama_model_free(model)
    return (unit * (PROMPT_TOKENS // len(unit) + 1))[:PROMPT_TOKENS]


class LlamaCpp:
    """One model and one context of n_seq_max 16; every measurement clears
    the KV cache first and feeds token ids through llama_batch."""

    def __init__(self, gguf, threads):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        # Each of the 16 sequences gets n_ctx / n_seq_max cells (the KV
        # cache is split per sequence unless kv_unified): 512 each, so
        # sequence 0 holds the 512-token prompt.
        cp.n_ctx = BATCH * PROMPT_TOKENS
        cp.n_batch = PROMPT_TOKENS
        cp.n_ubatch = PROMPT_TOKENS
        cp.n_seq_max = BATCH
        cp.n_threads = threads
        cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(PROMPT_TOKENS, 0, BATCH)

    def close(self):
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def clear(self):
        L = self.L
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        else:
            L.llama_kv_self_clear(self.ctx)

    def decode(self, entries):
        """entries: (token, pos, seq, want_logits); one llama_decode."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i):
        import numpy as np

        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def prefill(self, ids):
        self.clear()
        t = time.perf_counter()
        self.decode([(tok, p, 0, p == len(ids) - 1) for p, tok in enumerate(ids)])
        # Logits are read so the whole computation is in the time.
        self.argmax(len(ids) - 1)
        return len(ids) / (time.perf_counter() - t)

    def decode_rate(self, prompt, n_seq, n_new):
        """Aggregate greedy tokens/s of n_seq sequences decoding n_new tokens
        each, one llama_decode per step, after their prompts."""
        self.clear()
        for s in range(n_seq):
            self.decode([(tok, p, s, p == len(prompt) - 1) for p, tok in enumerate(prompt)])
        nxt = [self.argmax(len(prompt) - 1)] * n_seq
        t = time.perf_counter()
        for step in range(n_new):
            self.decode([(nxt[s], len(prompt) + step, s, True) for s in range(n_seq)])
            nxt = [self.argmax(s) for s in range(n_seq)]
        return n_seq * n_new / (time.perf_counter() - t)


def llama_cpp_round(eng, ids, repeats, decode_tokens, warm_up):
    """One round of the three measurements on a loaded engine: each the
    median of `repeats` runs (after one warm-up run when `warm_up`)."""
    runs = (lambda run: median_of(run, repeats)) if warm_up else (
        lambda run: statistics.median(run() for _ in range(repeats)))
    short = ids[:SHORT_PROMPT_TOKENS]
    prefill = runs(lambda: eng.prefill(ids))
    b1 = runs(lambda: eng.decode_rate(short, 1, decode_tokens))
    b16 = runs(lambda: eng.decode_rate(short, BATCH, decode_tokens))
    log(f"llama.cpp: prefill {prefill:.1f}, decode b1 {b1:.1f}, decode @{BATCH} {b16:.1f} tokens/s")
    return {"prefill": prefill, "decode_b1": b1, f"decode_b{BATCH}": b16}


def llama_cpp_info():
    import llama_cpp

    return {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}



# --------------------------------------------------------------------------------------
# transformers, float32 on the CPU, the model from the GGUF as make_golden.py makes it
# --------------------------------------------------------------------------------------


def run_transformers(gguf, threads, repeats, decode_tokens, ids):
    import torch
    import transformers
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(GOLDEN_DIR))
    import make_golden  # the GGUF -> Hugging Face conversion of the golden files

    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-peers-hf-"))
    try:
        log(f"transformers: dequantizing the GGUF into {tmp} (make_golden.gguf_to_hf)")
        make_golden.gguf_to_hf(gguf, tmp)
        model = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    attn = model.config._attn_implementation
    prompt = torch.tensor([ids], dtype=torch.long)
    short = prompt[:, :SHORT_PROMPT_TOKENS]

    def prefill():
        with torch.no_grad():
            t = time.perf_counter()
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            return PROMPT_TOKENS / (time.perf_counter() - t)

    # The KV cache's keyword and attribute: `cache` in transformers >= 5.2x,
    # `past_key_values` before (make_golden.py handles both).
    kw = make_golden._cache_kwarg(model)

    def decode_rate(n_seq):
        with torch.no_grad():
            x = short.expand(n_seq, -1).contiguous()
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)
            past, nxt = make_golden._cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{kw: past})
                past, nxt = make_golden._cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
            return n_seq * decode_tokens / (time.perf_counter() - t)

    p = median_of(prefill, repeats)
    log(f"transformers: prefill {p:.1f} tokens/s")
    b1 = median_of(lambda: decode_rate(1), repeats)
    log(f"transformers: decode b1 {b1:.1f} tokens/s")
    b16 = median_of(lambda: decode_rate(BATCH), repeats)
    log(f"transformers: decode @{BATCH} {b16:.1f} tokens/s")
    info = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32", "attn": attn}
    return {"prefill": p, "decode_b1": b1, f"decode_b{BATCH}": b16, "info": info}
