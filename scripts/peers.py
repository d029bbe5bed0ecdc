#!/usr/bin/env python3
"""kvmesh against its peers in one run: llama.cpp (llama-cpp-python) and Hugging
Face transformers (PyTorch, CPU, float32), on the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF), the same prompt tokens and the same thread
count for every engine.

Usage: python3 scripts/peers.py [--threads N] [--rounds 3] [--repeats 3] [--decode-tokens 64]
                                [--skip transformers] [--skip llama.cpp] [--skip kvmesh]
                                [--kvmesh target/release/kvmesh] [--gguf PATH] [--json PATH]

Setup (automatic): a virtual environment outside the repository
($KVMESH_PEERS_VENV, default ~/.cache/kvmesh/peers-venv) with the golden stack's
pins (scripts/golden/requirements.txt: torch, transformers, gguf, numpy, ...)
plus llama-cpp-python, installed with pip on first use and reused afterwards (a
stamp in the venv records what was installed). llama-cpp-python builds from
source (about 5 minutes on 2 cores; pip pulls cmake and ninja itself); PyPI's
torch is the CUDA build (about 5 GB installed), which runs on the CPU. The
script then re-runs itself with the venv's python. The GGUF is
~/.cache/kvmesh/SmolLM2-135M-Instruct.Q4_1.gguf (or $KVMESH_GGUF / --gguf);
when it is missing, `kvmesh fetch-model` fetches it. A missing
target/release/kvmesh is built with `cargo build --release -p kvmesh-cli`.

Rounds: transformers is measured once first; then llama.cpp and kvmesh take
turns for --rounds rounds, so that a slow spell of a shared host falls on both.
In a round each measurement is the median of --repeats runs (llama.cpp: after
one warm-up run in the first round; kvmesh: `bench-engine --repeats`, its own
median). The table holds each engine's median over the rounds; the ratio column
and the goals use the median of the rounds' own kvmesh/llama.cpp ratios, and
the goals list every round's ratio.

Measurements:
  prefill@512      one 512-token prompt to its last logits, tokens/s
                   llama.cpp: one llama_batch of 512 tokens (n_batch = n_ubatch = 512)
                   transformers: one forward of 512 tokens, no_grad, last logits only
                   kvmesh: `kvmesh bench-engine` (its own timing)
  decode b1        greedy, --decode-tokens tokens after a 32-token prompt, one
                   sequence, tokens/s excluding the prompt
  decode @16       16 sequences with the same 32-token prompt, one batched step
                   per token (llama.cpp: a llama_batch of 16 tokens with 16 sequence
                   ids, n_seq_max 16; transformers: a [16, 1] forward with
                   past_key_values), aggregate generated tokens/s
The prompt tokens are the filler text of `kvmesh bench-engine` (cli/src/bench.rs),
tokenized by llama.cpp and repeated to length; the same ids go to every engine.
Threads: llama.cpp n_threads and n_threads_batch, torch.set_num_threads, and
RAYON_NUM_THREADS for kvmesh. KV cache: f16 in llama.cpp (its default) and in
kvmesh (`--kv-cache-dtype auto` with quantized weights); f32 in transformers.

Output: a table (rows: the three measurements; columns: kvmesh, llama.cpp,
transformers, kvmesh/llama.cpp), the goals (decode b1 >= 1.5x llama.cpp's b1;
aggregate @16 >= 4x llama.cpp's b1 rate; prefill >= 2x llama.cpp's), the core
count and CPU model; --json PATH writes the same. A benchmark: it never fails on
a number, only when an engine cannot run.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO_ROOT / "scripts" / "golden"
VENV = Path(os.environ.get("KVMESH_PEERS_VENV", str(Path.home() / ".cache" / "kvmesh" / "peers-venv")))
DEFAULT_GGUF = Path(
    os.environ.get("KVMESH_GGUF", str(Path.home() / ".cache" / "kvmesh" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
)
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
PEERS = ("kvmesh", "llama.cpp", "transformers")

# The filler text of `kvmesh bench-engine` (cli/src/bench.rs `filler`): its
# tokens, repeated to length, are every engine's prompt.
FILLER = (
    "The quick brown fox jumps over the lazy dog while the committee reviews "
    "quarterly results, weather reports and 42 unrelated footnotes. "
)
PROMPT_TOKENS = 512
SHORT_PROMPT_TOKENS = 32
BATCH = 16
# A 1-minute load average above this before the run (or above the run's
# own threads after it) means other work shared the cores.
BUSY_LOAD = 0.5

T0 = time.time()


def log(msg):
    print(f"[peers {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Setup: the venv (system python, standard library only)
# --------------------------------------------------------------------------------------


def requirements():
    """The golden stack's pins plus llama-cpp-python, one spec a line."""
    lines = (GOLDEN_DIR / "requirements.txt").read_text().splitlines()
    specs = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return specs + [LLAMA_CPP_PYTHON]


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    """Create or reuse the venv, install what is missing, return its python."""
    if VENV.resolve().is_relative_to(REPO_ROOT):
        sys.exit(f"refusing to put the venv inside the repository: {VENV}")
    py = VENV / "bin" / "python"
    if py.exists():
        log(f"reusing the virtual environment {VENV}")
    else:
        log(f"creating a virtual environment {VENV}")
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    stamp = VENV / "kvmesh-peers-requirements.txt"
    want = "\n".join(requirements()) + "\n"
    if stamp.exists() and stamp.read_text() == want:
        log("packages already installed (stamp matches)")
        return py
    log(
        "installing with pip: " + " ".join(requirements()) + "\n"
        "  llama-cpp-python builds from source (about 5 minutes on 2 cores); "
        "torch is a large download (about 5 GB installed)"
    )
    subprocess.run([str(py), "-m", "pip", "install", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", *requirements()], check=True)
    stamp.write_text(want)
    log("packages installed")
    return py


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def median_of(run, repeats):
    """One warm-up call of `run`, then the median of `repeats` calls."""
    run()
    return statistics.median(run() for _ in range(repeats))


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
        "info": {"mode": v.get("mode"), "kv_dtype": v.get("kv_dtype"), "threads": v.get("threads"), "binary": str(kvmesh)},
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


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------

ROWS = [
    ("prefill", f"prefill@{PROMPT_TOKENS} tok/s"),
    ("decode_b1", "decode b1 tok/s"),
    (f"decode_b{BATCH}", f"aggregate decode @{BATCH} tok/s"),
]


def paired_ratio(res, ours, theirs):
    """kvmesh's `ours` over llama.cpp's `theirs`: the median of the rounds'
    own ratios, and those ratios (None when either was not measured)."""
    k, l = res.get("kvmesh") or {}, res.get("llama.cpp") or {}
    kr, lr = k.get("rounds") or [], l.get("rounds") or []
    per_round = [a[ours] / b[theirs] for a, b in zip(kr, lr) if a.get(ours) and b.get(theirs)]
    if not per_round:
        return None, []
    return statistics.median(per_round), per_round


def goals(res):
    specs = [
        ("decode b1 >= 1.5x llama.cpp b1", "decode_b1", "decode_b1", 1.5),
        (f"aggregate @{BATCH} >= 4x llama.cpp b1", f"decode_b{BATCH}", "decode_b1", 4.0),
        ("prefill >= 2x llama.cpp prefill", "prefill", "prefill", 2.0),
    ]
    out = []
    for name, ours, theirs, factor in specs:
        ratio, per_round = paired_ratio(res, ours, theirs)
        if ratio is None:
            out.append({"goal": name, "status": "NOT EVALUATED", "detail": "kvmesh or llama.cpp not measured"})
            continue
        met = sum(r >= factor for r in per_round)
        out.append({
            "goal": name,
            "status": "MET" if ratio >= factor else "NOT MET",
            "ratio": round(ratio, 2),
            "rounds": [round(r, 2) for r in per_round],
            "detail": f"{ratio:.2f}x, the median of the rounds' ratios "
            f"({', '.join(f'{r:.2f}' for r in per_round)}; {met} of {len(per_round)} at {factor}x or more)",
        })
    return out


def render(report):
    res = report["results"]
    cell = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"
    lines = [
        f"kvmesh vs peers: {report['model']}, {report['threads']} threads, "
        f"{report['cores']} cores ({report['cpu']}; {' '.join(report['cpu_flags']) or 'no AVX2'})",
        f"llama.cpp and kvmesh alternate over {report['rounds']} rounds, each value the median of "
        f"{report['repeats']} runs (a warm-up first); the table holds the medians over the rounds, the last "
        "column the median of the rounds' own ratios",
        f"decode: {report['decode_tokens']} tokens after a {SHORT_PROMPT_TOKENS}-token prompt; "
        f"load average {report['load_average_at_start']} at the start",
        "",
        f"{'':<30} {'kvmesh':>10} {'llama.cpp':>10} {'transformers':>13} {'kvmesh/llama.cpp':>17}",
    ]
    for key, label in ROWS:
        k = (res.get("kvmesh") or {}).get(key)
        l = (res.get("llama.cpp") or {}).get(key)
        t = (res.get("transformers") or {}).get(key)
        paired, _ = paired_ratio(res, key, key)
        ratio = f"{paired:.2f}x" if paired else "-"
        lines.append(f"{label:<30} {cell(k):>10} {cell(l):>10} {cell(t):>13} {ratio:>17}")
    for name in PEERS:
        r = res.get(name)
        if r is None:
            lines.append(f"{name}: skipped")
        elif "error" in r:
            lines.append(f"{name}: not measured: {r['error']}")
        else:
            lines.append(f"{name}: {json.dumps(r['info'])}")
    lines += ["", "goals:"]
    for g in report["goals"]:
        lines.append(f"  {g['status']:<13} {g['goal']}: {g['detail']}")
    if report["busy"]:
        lines.append(
            f"  (the machine was busy: load average {report['load_average_at_start']} at the start, "
            f"{report['load_average_at_end']} at the end; the engines suffer unequally from sharing the "
            "cores (llama.cpp's OpenMP threads most), so these verdicts are not reliable: rerun on a quiet machine)"
        )
    return "\n".join(lines)


def measure(args):
    threads = args.threads or os.cpu_count() or 1
    skip = {s for item in args.skip for s in item.split(",") if s}
    unknown = skip - set(PEERS)
    if unknown:
        sys.exit(f"--skip: unknown peer(s) {sorted(unknown)}; choose from {PEERS}")
    kvmesh_path = Path(args.kvmesh) if args.kvmesh else REPO_ROOT / "target" / "release" / "kvmesh"
    if "kvmesh" not in skip or not Path(args.gguf).exists():
        kvmesh_path = ensure_kvmesh(kvmesh_path, args.kvmesh is not None)
    gguf = ensure_gguf(Path(args.gguf), kvmesh_path)
    load_at_start = round(os.getloadavg()[0], 2)
    if load_at_start > BUSY_LOAD:
        log(f"warning: load average {load_at_start} before the run: other work on the machine skews every figure")
    res = {}
    ids = prompt_ids(gguf)
    log(f"prompt: {len(ids)} tokens, the filler's {len(set(ids))} distinct ids repeated")
    if "transformers" not in skip:
        try:
            res["transformers"] = run_transformers(gguf, threads, args.repeats, args.decode_tokens, ids)
        except Exception as e:  # report, and go on with the others
            log(f"transformers failed: {type(e).__name__}: {e}")
            res["transformers"] = {"error": f"{type(e).__name__}: {e}"}
    # llama.cpp and kvmesh take turns, round by round, so a slow spell of
    # the shared host falls on both; the goals use each round's own ratio.
    rounds = {"llama.cpp": [], "kvmesh": []}
    eng = None
    if "llama.cpp" not in skip:
        try:
            import llama_cpp

            log(f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, {threads} threads")
            eng = LlamaCpp(gguf, threads)
        except Exception as e:
            log(f"llama.cpp failed: {type(e).__name__}: {e}")
            res["llama.cpp"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        for r in range(args.rounds):
            log(f"round {r + 1} of {args.rounds}")
            if eng is not None and "llama.cpp" not in res:
                try:
                    rounds["llama.cpp"].append(
                        llama_cpp_round(eng, ids, args.repeats, args.decode_tokens, warm_up=r == 0))
                except Exception as e:
                    log(f"llama.cpp failed: {type(e).__name__}: {e}")
                    res["llama.cpp"] = {"error": f"{type(e).__name__}: {e}"}
            if "kvmesh" not in skip and "kvmesh" not in res:
                try:
                    rounds["kvmesh"].append(
                        run_kvmesh(kvmesh_path, gguf, threads, args.repeats, args.decode_tokens))
                    log(f"kvmesh: {rounds['kvmesh'][-1]}")
                except Exception as e:
                    log(f"kvmesh failed: {e}")
                    res["kvmesh"] = {"error": str(e)}
    finally:
        if eng is not None:
            eng.close()
    for name, rs in rounds.items():
        if name in res or not rs:
            continue
        res[name] = {key: statistics.median(r[key] for r in rs) for key, _ in ROWS}
        res[name]["rounds"] = [{key: round(r[key], 1) for key, _ in ROWS} for r in rs]
        res[name]["info"] = rs[0].get("info") or llama_cpp_info()
    for r in res.values():
        for key, _ in ROWS:
            if isinstance(r.get(key), float):
                r[key] = round(r[key], 1)
    report = {
        "model": gguf.name,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "load_average_at_start": load_at_start,
        "threads": threads,
        "prompt_tokens": PROMPT_TOKENS,
        "short_prompt_tokens": SHORT_PROMPT_TOKENS,
        "decode_tokens": args.decode_tokens,
        "batch": BATCH,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "results": res,
        "goals": goals(res),
    }
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    # More runnable work than a quiet machine's background: another job
    # shares the cores (our own threads leave the 1-minute average by the end).
    report["busy"] = max(load_at_start, report["load_average_at_end"] - threads) > BUSY_LOAD
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 1 if any("error" in r for r in res.values()) else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="threads for every engine (default: the number of cores)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is reported")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each sequence decodes")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds in which llama.cpp and kvmesh take turns (the goals use each round's own ratio)")
    ap.add_argument("--skip", action="append", default=[], help=f"leave out a peer (repeat or comma list): {', '.join(PEERS)}")
    ap.add_argument("--kvmesh", default=None, help="the kvmesh binary (default: target/release/kvmesh, built if missing)")
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the model (default: the cached SmolLM2 Q4_1 GGUF; env KVMESH_GGUF)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    args = ap.parse_args()
    if args.repeats < 1 or args.decode_tokens < 1 or args.rounds < 1:
        sys.exit("--repeats, --decode-tokens and --rounds must be at least 1")
    if not in_venv():
        py = ensure_venv()
        log(f"running in the virtual environment: {py}")
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])
    sys.exit(measure(args))


if __name__ == "__main__":
    main()
