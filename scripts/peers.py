#!/usr/bin/env python3
"""kvmesh against its peers in one run: llama.cpp (llama-cpp-python) and Hugging
Face transformers (PyTorch, CPU, float32), on the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF), the same prompt tokens and the same thread
count for every engine.

Usage: python3 scripts/peers.py [--threads N] [--rounds 3] [--repeats 3] [--decode-tokens 64]
                                [--skip transformers] [--skip llama.cpp] [--skip kvmesh] [--skip multi-turn] [--skip memory]
                                [--mt-conversations 3] [--mt-turns 5] [--mt-answer-tokens 32] [--mt-seed 0]
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
median), then the multi-turn script is played once by llama.cpp and once by
kvmesh. The table holds each engine's median over the rounds; the ratio column
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
  multi-turn       chat with prompt caching (kvmesh and llama.cpp; transformers
                   has no part): TTFT per turn, below
The prompt tokens are the filler text of `kvmesh bench-engine` (cli/src/bench.rs),
tokenized by llama.cpp and repeated to length; the same ids go to every engine.

Multi-turn chat with prompt caching: a conversation script made with
random.Random(--mt-seed) from about 60 plain lowercase English words in
sentences ending with '.', sized with llama.cpp's tokenizer
(Llama.tokenize(text.encode(), add_bos=False), to the target or a token or two
over): a system prompt of about 500 tokens shared by --mt-conversations (3)
conversations of --mt-turns (5) user messages of about 150 tokens each, every
conversation its own messages. Both engines play it the same way: one request
at a time (no queueing), turn by turn across the conversations (for turn t:
for conversation c), each request a streamed, greedy chat completion of the
whole history (system, user 1, assistant 1, ..., user t) with
--mt-answer-tokens (32) tokens, its answer appended as the assistant message;
TTFT is from the request to its first non-empty content. Every round starts
cold (a fresh kvmesh process; a reset llama.cpp context and a new cache;
llama.cpp's model is loaded once, with one short warm-up completion).
  kvmesh: the script goes to a temporary JSON file
          {"system": ..., "users": [[turn 1, ...], ...], "answer_tokens": 32}
          and `kvmesh bench-cache --scenario multi-turn --script FILE --sequential
          --targets on --rounds 1 --json OUT --model GGUF` (RAYON_NUM_THREADS, as below)
          plays it with its prefix cache on; OUT's multi_turn.on.ttft_s[c][t]
          and cached_tokens[c][t] are read back
  llama.cpp: llama-cpp-python's high-level Llama (n_ctx 4096, more if the
          script's longest conversation needs it, n_batch =
          n_ubatch = 512, flash attention as llama.cpp's context default, the
          same threads) with llm.set_cache(llama_cpp.LlamaRAMCache(
          capacity_bytes=2 << 30)), its RAM prompt cache, and
          create_chat_completion(messages, max_tokens, temperature=0.0,
          repeat_penalty=1.0 (plain greedy: the chat handler's default is
          1.1), stream=True) with the GGUF's own chat template
          (SmolLM2's is ChatML, as kvmesh's). How that cache works
          (llama_cpp/llama.py, llama_cache.py of 0.3.36): chat completion renders
          the template, tokenizes and calls create_completion, whose
          _create_completion looks the prompt's tokens up in the cache (the
          stored key with the longest common prefix, a linear scan) and, when
          that prefix is longer than what the live context already holds,
          load_state()s it (the whole llama_state plus the Python logits
          buffer: within the TTFT); Llama.generate then keeps the longest
          common prefix of the context (kv_cache_seq_rm past it) and
          evaluates only the rest. After
          the last chunk the state is saved under prompt + answer tokens
          (save_state(): outside the TTFT, within the request), the oldest
          evicted past 2 GiB. So a conversation's later turn restores its own
          previous state, and a first turn reuses the system prompt from the
          live context. "cached" for llama.cpp is the prefix it kept, read
          from Llama.eval's first call of the request (n_tokens at that call).
The multi-turn table has a row per turn: each engine's TTFT (ms, the median
over the conversations and rounds), its cached prompt tokens (median), and
the median of the rounds' own ratios (each round's TTFT the median over the
conversations).
Threads: llama.cpp n_threads and n_threads_batch, torch.set_num_threads, and
RAYON_NUM_THREADS for kvmesh. KV cache: f16 in llama.cpp (its default) and in
kvmesh (`--kv-cache-dtype auto` with quantized weights); f32 in transformers.

Output: a table (rows: the three measurements; columns: kvmesh, llama.cpp,
transformers, kvmesh/llama.cpp), the multi-turn table under it, the goals
(decode b1 >= 80% of the read bandwidth measured in the same round, and
>= 1.5x llama.cpp's b1 where llama.cpp streams under 53% of it; aggregate @16
>= 4x llama.cpp's b1 rate; prefill >= 2.5x llama.cpp's, and >= 60% of the
path's peak measured in the round (int8 dot product or FMA, the whole
prefill); multi-turn: kvmesh's TTFT at the last turn <= 0.5x
llama.cpp's, both with their prompt caches; kvmesh's peak RSS <= 1.3x the file
plus the KV), the core count and CPU model; --json PATH writes the same (the
multi-turn figures under "multi_turn", peak memory under "memory").
Peak memory: `kvmesh generate` and llama-cpp-python each generate 16 greedy
tokens with a 512-token context in a process of their own; the peak RSS
(the process's VmHWM) against the file size plus that context's f16 KV.
--skip multi-turn / --skip memory leaves that measurement out; --skip kvmesh or
--skip llama.cpp leaves that engine out of it too. A benchmark: it never fails on a number,
only when an engine cannot run.
"""

import argparse
import json
import os
import platform
import random
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
# What llama-cpp-python imports beyond the golden stack: it is installed
# with --no-deps (built here), so these are pinned here.
LLAMA_CPP_DEPS = ["diskcache==5.6.3", "typing-extensions>=4.5"]
PEERS = ("kvmesh", "llama.cpp", "transformers")
# What --skip takes: a peer, or a measurement.
SKIPPABLE = PEERS + ("multi-turn", "memory")

# The filler text of `kvmesh bench-engine` (cli/src/bench.rs `filler`): its
# tokens, repeated to length, are every engine's prompt.
FILLER = (
    "The quick brown fox jumps over the lazy dog while the committee reviews "
    "quarterly results, weather reports and 42 unrelated footnotes. "
)
PROMPT_TOKENS = 512
SHORT_PROMPT_TOKENS = 32
BATCH = 16
# --cpu-kernels, passed to kvmesh as KVMESH_CPU_KERNELS (None: its default).
CPU_KERNELS = None
# --activations, passed to kvmesh as KVMESH_ACTIVATIONS (None: its default).
ACTIVATIONS = None
# A 1-minute load average above this before the run (or above the run's
# own threads after it) means other work shared the cores.
BUSY_LOAD = 0.5

T0 = time.time()


def log(msg):
    """Progress, on a terminal only: a log or a pipe gets the tables (and
    every warning and failure, through warn)."""
    if sys.stderr.isatty():
        warn(msg)


def warn(msg):
    print(f"[peers {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Setup: the venv (system python, standard library only)
# --------------------------------------------------------------------------------------


def requirements():
    """The golden stack's pins plus llama-cpp-python, one spec a line."""
    lines = (GOLDEN_DIR / "requirements.txt").read_text().splitlines()
    specs = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return specs + LLAMA_CPP_DEPS + [LLAMA_CPP_PYTHON]


def llama_cpp_cflags():
    """Extra compiler flags for llama.cpp's build on this CPU. Where the CPU
    has AMX tiles, a native build compiles ggml's AMX matmul, which crashes
    on these machines (a general-protection fault at `ldtilecfg` in
    ggml_backend_amx_mul_mat, on the default model too: llama.cpp requests
    the tile-data permission on the main thread only and its tile
    configuration can be optimised away; a known, open llama.cpp bug). GCC
    keeps an explicit -mno-* over what -march=native implies, so the build
    stays native otherwise (AVX-512, VNNI, BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            has_amx = any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        has_amx = False
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if has_amx else ""


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
    flags = llama_cpp_cflags()
    want = "\n".join(requirements()) + "\n" + (f"CFLAGS={flags}\n" if flags else "")
    if stamp.exists() and stamp.read_text() == want:
        log("packages already installed (stamp matches)")
        return py
    log(
        "installing with pip: " + " ".join(requirements()) + "\n"
        "  llama-cpp-python builds from source (about 5 minutes on 2 cores); "
        "torch is a large download (about 5 GB installed)"
    )
    subprocess.run([str(py), "-m", "pip", "install", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", *requirements()[:-1]], check=True)
    # Built here, never from pip's cache of an earlier build with other flags.
    env = dict(os.environ)
    if flags:
        log(f"llama.cpp is built with {flags} (see llama_cpp_cflags)")
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = (env.get(var, "") + " " + flags).strip()
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-deps", LLAMA_CPP_PYTHON],
        check=True,
        env=env,
    )
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
    if CPU_KERNELS:
        env["KVMESH_CPU_KERNELS"] = CPU_KERNELS
    if ACTIVATIONS:
        env["KVMESH_ACTIVATIONS"] = ACTIVATIONS
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
                 "roofline": v.get("roofline")},
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
# Multi-turn chat with prompt caching: kvmesh's `bench-cache` against
# llama-cpp-python's chat completion with its RAM prompt cache
# --------------------------------------------------------------------------------------

# Plain lowercase English words the conversation texts are made of.
MT_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them would write like so these her"
).split()
MT_SYSTEM_TOKENS = 500
MT_USER_TOKENS = 150
MT_N_CTX = 4096
MT_CACHE_BYTES = 2 << 30
# Tokens the chat template adds around a message (<|im_start|>role\n ... <|im_end|>\n),
# rounded up: for the context size only.
MT_TEMPLATE_TOKENS = 8


class Vocab:
    """llama-cpp-python's Llama with only the vocabulary loaded, to size
    the texts: Llama.tokenize(text.encode(), add_bos=False). (Its context of
    a vocabulary-only model makes llama.cpp warn "n_ctx_seq (512) >
    n_ctx_train (0)": harmless.)"""

    def __init__(self, gguf):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)

    def count(self, text):
        return len(self.llm.tokenize(text.encode(), add_bos=False))

    def close(self):
        self.llm.close()


def mt_text(rng, vocab, target):
    """Words of MT_WORDS in sentences of 6 to 14 words, each ending with '.',
    until the text is `target` tokens or just over (by a token or two).
    Returns the text and its token count."""
    words, left = [], rng.randint(6, 14)
    while True:
        words.append(rng.choice(MT_WORDS))
        left -= 1
        if left == 0:
            words[-1] += "."
            left = rng.randint(6, 14)
        text = " ".join(words) + ("" if words[-1].endswith(".") else ".")
        n = vocab.count(text)
        if n >= target:
            return text, n


def mt_script(gguf, conversations, turns, answer_tokens, seed):
    """The conversation script both engines play: a shared system prompt of
    about MT_SYSTEM_TOKENS tokens and `conversations` lists of `turns` user
    messages of about MT_USER_TOKENS tokens each, from random.Random(seed).
    Returns (the script, as written for `kvmesh bench-cache --script`, and
    its token counts)."""
    rng = random.Random(seed)
    vocab = Vocab(gguf)
    try:
        system, system_n = mt_text(rng, vocab, MT_SYSTEM_TOKENS)
        users, users_n = [], []
        for _ in range(conversations):
            conv = [mt_text(rng, vocab, MT_USER_TOKENS) for _ in range(turns)]
            users.append([text for text, _ in conv])
            users_n.append([n for _, n in conv])
    finally:
        vocab.close()
    if len({conv[0] for conv in users}) != len(users):
        raise RuntimeError("two conversations drew the same first message: choose another --mt-seed")
    script = {"system": system, "users": users, "answer_tokens": answer_tokens}
    return script, {"system_tokens": system_n, "user_tokens": users_n}


def mt_context(counts, answer_tokens):
    """The longest conversation's tokens at its last answer, with room for
    the chat template."""
    return max(
        counts["system_tokens"] + MT_TEMPLATE_TOKENS
        + sum(n + answer_tokens + 2 * MT_TEMPLATE_TOKENS for n in conv)
        for conv in counts["user_tokens"]
    )


def mt_shape(name, v, conversations, turns):
    """Checks that v is a list per conversation of a number per turn."""
    if not (isinstance(v, list) and len(v) == conversations
            and all(isinstance(c, list) and len(c) == turns for c in v)):
        raise RuntimeError(f"{name}: expected {conversations} lists of {turns} values, got {json.dumps(v)[:300]}")
    return v


def run_kvmesh_multi_turn(kvmesh, gguf, threads, script_path, out_path, conversations, turns):
    """One `kvmesh bench-cache --scenario multi-turn --sequential` run of the
    script: per conversation, per turn, the TTFT (s) and the prompt tokens
    served from its prefix cache."""
    cmd = [
        str(kvmesh), "bench-cache", "--scenario", "multi-turn", "--script", str(script_path),
        "--sequential", "--targets", "on", "--rounds", "1", "--json", str(out_path), "--model", str(gguf),
    ]
    log("kvmesh: " + " ".join(cmd[1:]))
    out_path.unlink(missing_ok=True)
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), KVMESH_LOG="warn")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"kvmesh bench-cache failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    if not out_path.exists():
        raise RuntimeError(f"kvmesh bench-cache wrote no {out_path}")
    on = json.loads(out_path.read_text())["multi_turn"]["on"]
    ttft = mt_shape("kvmesh ttft_s", on["ttft_s"], conversations, turns)
    cached = on.get("cached_tokens")
    if cached is not None:
        cached = mt_shape("kvmesh cached_tokens", cached, conversations, turns)
    return {"ttft_s": ttft, "cached_tokens": cached}


class LlamaChat:
    """llama-cpp-python's high-level Llama for the multi-turn measurement:
    its chat completion (the GGUF's own chat template) with its RAM prompt
    cache, a fresh cache every round. The context matches LlamaCpp's:
    n_batch = n_ubatch = 512, f16 KV cache, the threads of the others."""

    def __init__(self, gguf, threads, n_ctx):
        import llama_cpp

        self.llama_cpp = llama_cpp
        # Flash attention as llama.cpp's context default (LlamaCpp's): that
        # is auto, which enables it on the CPU; the high-level Llama takes a
        # bool and would otherwise disable it.
        flash = llama_cpp.llama_context_default_params().flash_attn_type != llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            n_batch=PROMPT_TOKENS, n_ubatch=PROMPT_TOKENS, flash_attn=flash, verbose=False,
        )
        self.info = {"n_ctx": n_ctx, "flash_attn": flash, "chat_format": self.llm.chat_format,
                     "cache": f"LlamaRAMCache(capacity_bytes={MT_CACHE_BYTES})"}
        # What a request reused: Llama.generate evaluates the prompt past
        # the prefix it kept (its live KV cache, or a state the prompt cache
        # restored) with one call of eval, at n_tokens = that prefix.
        self.first_eval = None
        plain_eval = self.llm.eval

        def eval_recording(tokens):
            if self.first_eval is None:
                self.first_eval = (self.llm.n_tokens, len(tokens))
            return plain_eval(tokens)

        self.llm.eval = eval_recording
        # Warm-up: one short completion, then a cleared context.
        for _ in self.llm.create_chat_completion(
                messages=[{"role": "user", "content": "the way."}], max_tokens=2, temperature=0.0, stream=True):
            pass
        self.llm.reset()

    def close(self):
        self.llm.close()

    def request(self, messages, answer_tokens):
        """One streamed, greedy chat completion: (TTFT s, the answer, prompt
        tokens reused, prompt tokens)."""
        self.first_eval = None
        t = time.perf_counter()
        ttft, parts = None, []
        stream = self.llm.create_chat_completion(
            messages=messages, max_tokens=answer_tokens, temperature=0.0, repeat_penalty=1.0, stream=True)
        for chunk in stream:
            content = chunk["choices"][0]["delta"].get("content")
            if content:
                if ttft is None:
                    ttft = time.perf_counter() - t
                parts.append(content)
        if ttft is None:  # an empty answer: the whole request
            ttft = time.perf_counter() - t
            log("llama.cpp: a multi-turn answer came back empty; its TTFT is the whole request")
        reused, fresh = self.first_eval or (None, None)
        return ttft, "".join(parts), reused, None if reused is None else reused + fresh

    def multi_turn(self, script):
        """The script turn by turn (for turn t: for conversation c), each
        request the whole history so far plus user message t, the answer
        appended as the assistant message; a cold context and a fresh
        prompt cache."""
        users = script["users"]
        conversations, turns = len(users), len(users[0])
        self.llm.reset()
        self.llm.set_cache(self.llama_cpp.LlamaRAMCache(capacity_bytes=MT_CACHE_BYTES))
        grid = lambda: [[None] * turns for _ in range(conversations)]
        ttft, cached, prompt = grid(), grid(), grid()
        history = [[{"role": "system", "content": script["system"]}] for _ in range(conversations)]
        try:
            for t in range(turns):
                for c in range(conversations):
                    messages = history[c] + [{"role": "user", "content": users[c][t]}]
                    ttft[c][t], answer, cached[c][t], prompt[c][t] = self.request(messages, script["answer_tokens"])
                    history[c] = messages + [{"role": "assistant", "content": answer}]
        finally:
            self.llm.set_cache(None)  # the round's saved states go
        return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": prompt}


def mt_per_turn(rounds, key, turns, scale=1.0):
    """Per turn, the median over conversations and rounds of `key`
    (None where no round has it)."""
    out = []
    for t in range(turns):
        vals = [r[key][c][t] for r in rounds if r.get(key) for c in range(len(r[key])) if r[key][c][t] is not None]
        out.append(round(statistics.median(vals) * scale, 1) if vals else None)
    return out


def mt_ratios(k_rounds, l_rounds, turns):
    """Per turn, the median of the rounds' own kvmesh/llama.cpp TTFT ratios
    (each round's TTFT: its median over the conversations), and the last
    turn's per-round ratios."""
    def round_turn(r, t):
        return statistics.median(conv[t] for conv in r["ttft_s"])

    per_turn, last = [], []
    for t in range(turns):
        rs = [round_turn(k, t) / round_turn(l, t) for k, l in zip(k_rounds, l_rounds)]
        per_turn.append(round(statistics.median(rs), 3) if rs else None)
        if t == turns - 1:
            last = [round(r, 3) for r in rs]
    return per_turn, last


def mt_report(mt):
    """The "multi_turn" entry of the report from what the rounds gathered."""
    if mt.get("skipped"):
        return {"skipped": mt["skipped"]}
    turns = mt["turns"]
    out = {key: mt[key] for key in ("conversations", "turns", "answer_tokens", "seed", "system_tokens", "user_tokens")}
    for name in ("kvmesh", "llama.cpp"):
        rs = mt["rounds"].get(name)
        if name in mt["errors"]:
            out[name] = {"error": mt["errors"][name]}
        elif not rs:
            out[name] = None
        else:
            out[name] = {
                "ttft_ms": mt_per_turn(rs, "ttft_s", turns, 1000.0),
                "cached_tokens": mt_per_turn(rs, "cached_tokens", turns),
                "rounds": [dict(r, ttft_s=[[round(x, 5) for x in conv] for conv in r["ttft_s"]]) for r in rs],
                "info": mt["info"].get(name),
            }
    k, l = out.get("kvmesh"), out.get("llama.cpp")
    if k and l and "error" not in k and "error" not in l:
        out["ratio"], out["ratio_last_turn_rounds"] = mt_ratios(k["rounds"], l["rounds"], turns)
        out["ratio_last_turn"] = out["ratio"][-1]
    return out


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


MT_GOAL = 0.5


def mt_goal(mt):
    """The multi-turn goal: kvmesh's last-turn TTFT at most MT_GOAL of
    llama.cpp's, the median of the rounds' ratios."""
    turns = (mt or {}).get("turns", "T")
    name = f"multi-turn: kvmesh turn-{turns} TTFT <= {MT_GOAL}x llama.cpp's (both with their prompt caches)"
    if not mt or mt.get("skipped"):
        return {"goal": name, "status": "NOT EVALUATED", "detail": "multi-turn skipped"}
    ratio, per_round = mt.get("ratio_last_turn"), mt.get("ratio_last_turn_rounds") or []
    if ratio is None:
        return {"goal": name, "status": "NOT EVALUATED", "detail": "kvmesh or llama.cpp not measured"}
    met = sum(r <= MT_GOAL for r in per_round)
    return {
        "goal": name,
        "status": "MET" if ratio <= MT_GOAL else "NOT MET",
        "ratio": round(ratio, 2),
        "rounds": [round(r, 2) for r in per_round],
        "detail": f"{ratio:.2f}x, the median of the rounds' ratios of the median TTFT over the conversations "
        f"({', '.join(f'{r:.2f}' for r in per_round)}; {met} of {len(per_round)} at {MT_GOAL}x or less)",
    }


BW_GOAL = 0.8
PEAK_GOAL = 0.6


def bandwidth_goal(res):
    """Decode b1 at BW_GOAL of the read bandwidth measured in the same round
    (the weights a step streams: kvmesh's count of the file's matrices, which
    llama.cpp reads too); where llama.cpp itself streams under BW_GOAL / 1.5
    of it, also 1.5x llama.cpp's rate. Medians over the rounds."""
    far = BW_GOAL / 1.5
    name = f"decode b1 >= {BW_GOAL:.0%} of the measured read bandwidth (and >= 1.5x llama.cpp where it streams under {far:.0%})"
    k, l = res.get("kvmesh") or {}, res.get("llama.cpp") or {}
    kr, lr = k.get("rounds") or [], l.get("rounds") or []
    ours, theirs, ratios = [], [], []
    for i, a in enumerate(kr):
        rf = a.get("roofline") or {}
        if not a.get("decode_b1") or not rf.get("read_gbps") or not rf.get("weight_bytes"):
            continue
        gb = rf["weight_bytes"] / 1e9
        ours.append(a["decode_b1"] * gb / rf["read_gbps"])
        if i < len(lr) and lr[i].get("decode_b1"):
            theirs.append(lr[i]["decode_b1"] * gb / rf["read_gbps"])
            ratios.append(a["decode_b1"] / lr[i]["decode_b1"])
    if not ours:
        return {"goal": name, "status": "NOT EVALUATED", "detail": "kvmesh's decode b1 or its ceilings not measured"}
    share = statistics.median(ours)
    their = statistics.median(theirs) if theirs else None
    ratio = statistics.median(ratios) if ratios else None
    need_ratio = their is not None and their < far
    met = share >= BW_GOAL and (not need_ratio or ratio >= 1.5)
    detail = (f"{share:.0%} of the read bandwidth, the median of the rounds' shares "
              f"({', '.join(f'{x:.0%}' for x in ours)})")
    if their is not None:
        detail += (f"; llama.cpp streams {their:.0%} ({', '.join(f'{x:.0%}' for x in theirs)}), "
                   f"kvmesh/llama.cpp {ratio:.2f}x" + (" (1.5x needed)" if need_ratio else ""))
    return {"goal": name, "status": "MET" if met else "NOT MET", "share": round(share, 3),
            "rounds": [round(x, 3) for x in ours], "detail": detail}


def peak_goal(res):
    """kvmesh's prefill as a share of its path's peak measured in the same
    round (the int8 dot product's with 8-bit activations, the FMA's with
    f32): the model's multiply-adds over the whole prefill's time, so
    attention, norms and the rest count against it."""
    name = f"prefill >= {PEAK_GOAL:.0%} of the path's peak (the whole prefill)"
    shares = []
    for a in (res.get("kvmesh") or {}).get("rounds") or []:
        rf = a.get("roofline") or {}
        peak = rf.get("int8_peak_gops") or rf.get("fma_peak_gflops")
        if rf.get("prefill_matmul_gflops") and peak:
            shares.append(rf["prefill_matmul_gflops"] / peak)
    if not shares:
        return {"goal": name, "status": "NOT EVALUATED", "detail": "kvmesh's prefill or its ceilings not measured"}
    share = statistics.median(shares)
    return {"goal": name, "status": "MET" if share >= PEAK_GOAL else "NOT MET", "share": round(share, 3),
            "rounds": [round(x, 3) for x in shares],
            "detail": f"{share:.0%}, the median of the rounds' shares ({', '.join(f'{x:.0%}' for x in shares)})"}


def goals(res, mt=None):
    specs = [
        (f"aggregate @{BATCH} >= 4x llama.cpp b1", f"decode_b{BATCH}", "decode_b1", 4.0),
        ("prefill >= 2.5x llama.cpp prefill", "prefill", "prefill", 2.5),
    ]
    out = [bandwidth_goal(res)]
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
    out.append(peak_goal(res))
    out.append(mt_goal(mt))
    return out


def render_multi_turn(mt):
    """The multi-turn table: a row per turn."""
    if not mt or mt.get("skipped"):
        return [f"multi-turn chat: skipped ({(mt or {}).get('skipped', 'not run')})"]
    users = [n for conv in mt["user_tokens"] for n in conv]
    lines = [
        f"multi-turn chat, prompt caches on: {mt['conversations']} conversations x {mt['turns']} turns, "
        f"a shared {mt['system_tokens']}-token system prompt, user messages of {min(users)}-{max(users)} tokens, "
        f"{mt['answer_tokens']}-token greedy answers; sent one at a time, turn by turn across the conversations",
        "TTFT ms, the median over the conversations and rounds; cached: prompt tokens served from the engine's "
        "cache (median); the last column the median of the rounds' own ratios",
        f"{'turn':<6} {'kvmesh':>10} {'cached':>7} {'llama.cpp':>10} {'cached':>7} {'kvmesh/llama.cpp':>17}",
    ]
    k, l = mt.get("kvmesh") or {}, mt.get("llama.cpp") or {}
    ratio = mt.get("ratio") or [None] * mt["turns"]
    cell = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"
    for t in range(mt["turns"]):
        get = lambda e, key: (e.get(key) or [None] * mt["turns"])[t]
        lines.append(
            f"{t + 1:<6} {cell(get(k, 'ttft_ms'), '.1f'):>10} {cell(get(k, 'cached_tokens'), '.0f'):>7} "
            f"{cell(get(l, 'ttft_ms'), '.1f'):>10} {cell(get(l, 'cached_tokens'), '.0f'):>7} "
            f"{cell(ratio[t], '.2f') + ('x' if ratio[t] else ''):>17}"
        )
    lines += [engine_line(f"multi-turn {name}", mt.get(name)) for name in ("kvmesh", "llama.cpp")]
    return lines


def engine_line(label, entry):
    """One engine's line under a table: skipped, the error, or its info."""
    if entry is None:
        return f"{label}: skipped"
    if "error" in entry:
        return f"{label}: not measured: {entry['error']}"
    return f"{label}: {json.dumps(entry['info'])}"


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
    lines += [""] + render_multi_turn(report.get("multi_turn")) + [""]
    lines += render_memory(report.get("memory")) + [""]
    lines += [engine_line(name, res.get(name)) for name in PEERS]
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


def multi_turn_setup(args, skip, gguf, threads):
    """The multi-turn measurement's state: its script (written for kvmesh),
    which engines play it, and what the rounds gather."""
    if "multi-turn" in skip:
        return {"skipped": "--skip multi-turn"}
    engines = [e for e in ("llama.cpp", "kvmesh") if e not in skip]
    if not engines:
        return {"skipped": "both kvmesh and llama.cpp skipped"}
    conversations, turns, answer = args.mt_conversations, args.mt_turns, args.mt_answer_tokens
    try:
        script, counts = mt_script(gguf, conversations, turns, answer, args.mt_seed)
    except Exception as e:
        warn(f"multi-turn failed: no script: {type(e).__name__}: {e}")
        return {"skipped": f"no script: {type(e).__name__}: {e}", "failed": True}
    users = [n for conv in counts["user_tokens"] for n in conv]
    n_ctx = max(MT_N_CTX, -(-mt_context(counts, answer) // 512) * 512)
    if n_ctx > MT_N_CTX:
        log(f"multi-turn: the longest conversation needs more than {MT_N_CTX} tokens: llama.cpp's n_ctx {n_ctx}")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-peers-mt-"))
    (tmp / "script.json").write_text(json.dumps(script) + "\n")
    log(f"multi-turn: {conversations} conversations x {turns} turns, system {counts['system_tokens']} tokens, "
        f"user messages {min(users)}-{max(users)} tokens, {answer}-token answers, script {tmp / 'script.json'}")
    return {
        "engines": engines, "script": script, "dir": tmp, "n_ctx": n_ctx,
        "conversations": conversations, "turns": turns, "answer_tokens": answer, "seed": args.mt_seed,
        "system_tokens": counts["system_tokens"], "user_tokens": counts["user_tokens"],
        "rounds": {e: [] for e in engines}, "errors": {}, "info": {},
    }


def multi_turn_round(mt, chat, kvmesh, gguf, threads):
    """One round of the multi-turn measurement: llama.cpp, then kvmesh,
    each the whole script once; an engine that failed is not tried again."""
    if mt.get("skipped"):
        return
    last = lambda r: statistics.median(conv[-1] for conv in r["ttft_s"]) * 1000
    if chat is not None and "llama.cpp" not in mt["errors"]:
        try:
            mt["rounds"]["llama.cpp"].append(chat.multi_turn(mt["script"]))
            log(f"llama.cpp: multi-turn, turn {mt['turns']} TTFT {last(mt['rounds']['llama.cpp'][-1]):.1f} ms")
        except Exception as e:
            warn(f"llama.cpp multi-turn failed: {type(e).__name__}: {e}")
            mt["errors"]["llama.cpp"] = f"{type(e).__name__}: {e}"
    if "kvmesh" in mt["engines"] and "kvmesh" not in mt["errors"]:
        try:
            mt["rounds"]["kvmesh"].append(run_kvmesh_multi_turn(
                kvmesh, gguf, threads, mt["dir"] / "script.json", mt["dir"] / "kvmesh-out.json",
                mt["conversations"], mt["turns"]))
            mt["info"].setdefault("kvmesh", {"binary": str(kvmesh), "scenario": "multi-turn", "targets": "on",
                                             "sequential": True})
            log(f"kvmesh: multi-turn, turn {mt['turns']} TTFT {last(mt['rounds']['kvmesh'][-1]):.1f} ms")
        except Exception as e:
            warn(f"kvmesh multi-turn failed: {type(e).__name__}: {e}")
            mt["errors"]["kvmesh"] = f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------
# Peak memory: each engine in a process of its own, generating with a 512-token context
# --------------------------------------------------------------------------------------

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
        + (["--cpu-kernels", CPU_KERNELS] if CPU_KERNELS else [])
        + (["--activations", ACTIVATIONS] if ACTIVATIONS else []),
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


def measure(args):
    threads = args.threads or os.cpu_count() or 1
    skip = {s for item in args.skip for s in item.split(",") if s}
    unknown = skip - set(SKIPPABLE)
    if unknown:
        sys.exit(f"--skip: unknown value(s) {sorted(unknown)}; choose from {SKIPPABLE}")
    kvmesh_path = Path(args.kvmesh) if args.kvmesh else REPO_ROOT / "target" / "release" / "kvmesh"
    if "kvmesh" not in skip or not Path(args.gguf).exists():
        kvmesh_path = ensure_kvmesh(kvmesh_path, args.kvmesh is not None)
    gguf = ensure_gguf(Path(args.gguf), kvmesh_path)
    load_at_start = round(os.getloadavg()[0], 2)
    if load_at_start > BUSY_LOAD:
        warn(f"warning: load average {load_at_start} before the run: other work on the machine skews every figure")
    res = {}
    ids = prompt_ids(gguf)
    log(f"prompt: {len(ids)} tokens, the filler's {len(set(ids))} distinct ids repeated")
    if "transformers" not in skip:
        try:
            res["transformers"] = run_transformers(gguf, threads, args.repeats, args.decode_tokens, ids)
        except Exception as e:  # report, and go on with the others
            warn(f"transformers failed: {type(e).__name__}: {e}")
            res["transformers"] = {"error": f"{type(e).__name__}: {e}"}
    mt, chat = multi_turn_setup(args, skip, gguf, threads), None
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
            warn(f"llama.cpp failed: {type(e).__name__}: {e}")
            res["llama.cpp"] = {"error": f"{type(e).__name__}: {e}"}
    if "llama.cpp" in mt.get("engines", ()):
        try:
            chat = LlamaChat(gguf, threads, mt["n_ctx"])
            mt["info"]["llama.cpp"] = chat.info
        except Exception as e:
            warn(f"llama.cpp multi-turn failed: {type(e).__name__}: {e}")
            mt["errors"]["llama.cpp"] = f"{type(e).__name__}: {e}"
    try:
        for r in range(args.rounds):
            log(f"round {r + 1} of {args.rounds}")
            if eng is not None and "llama.cpp" not in res:
                try:
                    rounds["llama.cpp"].append(
                        llama_cpp_round(eng, ids, args.repeats, args.decode_tokens, warm_up=r == 0))
                except Exception as e:
                    warn(f"llama.cpp failed: {type(e).__name__}: {e}")
                    res["llama.cpp"] = {"error": f"{type(e).__name__}: {e}"}
            if "kvmesh" not in skip and "kvmesh" not in res:
                try:
                    rounds["kvmesh"].append(
                        run_kvmesh(kvmesh_path, gguf, threads, args.repeats, args.decode_tokens))
                    log(f"kvmesh: {rounds['kvmesh'][-1]}")
                except Exception as e:
                    warn(f"kvmesh failed: {e}")
                    res["kvmesh"] = {"error": str(e)}
            multi_turn_round(mt, chat, kvmesh_path, gguf, threads)
    finally:
        if eng is not None:
            eng.close()
        if chat is not None:
            chat.close()
        if mt.get("dir"):
            shutil.rmtree(mt["dir"], ignore_errors=True)
    for name, rs in rounds.items():
        if name in res or not rs:
            continue
        res[name] = {key: statistics.median(r[key] for r in rs) for key, _ in ROWS}
        # Each round keeps kvmesh's ceilings measured in it (the goals use
        # the round's own read bandwidth and peak).
        res[name]["rounds"] = [
            dict({key: round(r[key], 1) for key, _ in ROWS},
                 **({"roofline": r["info"]["roofline"]} if (r.get("info") or {}).get("roofline") else {}))
            for r in rs
        ]
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
        "multi_turn": mt_report(mt),
        "memory": measure_memory(gguf, kvmesh_path, threads, skip) if "memory" not in skip else None,
    }
    report["goals"] = goals(res, report["multi_turn"]) + [memory_goal(report["memory"])]
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    # More runnable work than a quiet machine's background: another job
    # shares the cores (our own threads leave the 1-minute average by the end).
    report["busy"] = max(load_at_start, report["load_average_at_end"] - threads) > BUSY_LOAD
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.json}")
    failed = any("error" in r for r in res.values()) or bool(mt.get("errors")) or mt.get("failed", False)
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="threads for every engine (default: the number of cores)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is reported")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each sequence decodes")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds in which llama.cpp and kvmesh take turns (the goals use each round's own ratio)")
    ap.add_argument("--skip", action="append", default=[],
                    help=f"leave out a peer or the multi-turn measurement (repeat or comma list): {', '.join(SKIPPABLE)}")
    ap.add_argument("--mt-conversations", type=int, default=3, help="multi-turn: conversations in the script")
    ap.add_argument("--mt-turns", type=int, default=5, help="multi-turn: user messages per conversation")
    ap.add_argument("--mt-answer-tokens", type=int, default=32, help="multi-turn: tokens each answer generates")
    ap.add_argument("--mt-seed", type=int, default=0, help="multi-turn: the seed of the script's texts")
    ap.add_argument("--kvmesh", default=None, help="the kvmesh binary (default: target/release/kvmesh, built if missing)")
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF), help="the model (default: the cached SmolLM2 Q4_1 GGUF; env KVMESH_GGUF)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("--cpu-kernels", default=None, choices=["auto", "avx512", "avx2", "portable"],
                    help="kvmesh's CPU kernel path (default: its own choice, auto); the report names the one that ran")
    ap.add_argument("--activations", default=None, choices=["f32", "int8"],
                    help="kvmesh's activation class for the quantized matmuls (default: its own); the report names it")
    args = ap.parse_args()
    global CPU_KERNELS, ACTIVATIONS
    CPU_KERNELS = args.cpu_kernels
    ACTIVATIONS = args.activations
    if args.repeats < 1 or args.decode_tokens < 1 or args.rounds < 1:
        sys.exit("--repeats, --decode-tokens and --rounds must be at least 1")
    if args.mt_conversations < 1 or args.mt_turns < 1 or args.mt_answer_tokens < 1:
        sys.exit("--mt-conversations, --mt-turns and --mt-answer-tokens must be at least 1")
    if not in_venv():
        py = ensure_venv()
        log(f"running in the virtual environment: {py}")
        os.execv(str(py), [str(py), str(Path(__file__).resolve()), *sys.argv[1:]])
    sys.exit(measure(args))


if __name__ == "__main__":
    main()
