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
only when an engine cannot run. The report calls the machine busy (its verdicts
unreliable) when the load average before the run, or after it less the run's
threads, is above 0.5, when the hypervisor gave other tenants more than 5% of
the run's CPU time (steal, from /proc/stat; the report gives the share), or
when a ceiling kvmesh measured (read bandwidth, peak) moved more than 1.2x
between rounds: another tenant of a shared host, which a virtual machine's load
average does not show.

Code: scripts/peerslib/ (common, engines, multi_turn, memory, report).
"""


import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

from peerslib.common import (
    BATCH, BUSY_LOAD, BUSY_STEAL, DEFAULT_GGUF, KVMESH_OPTIONS, PROMPT_TOKENS, REPO_ROOT, SHORT_PROMPT_TOKENS,
    SKIPPABLE, cpu_flags, cpu_model, cpu_times, ensure_venv, in_venv, log, stolen, warn,
)
from peerslib.engines import (
    LlamaCpp, ensure_gguf, ensure_kvmesh, llama_cpp_info, llama_cpp_round, prompt_ids, run_kvmesh,
    run_transformers,
)
from peerslib.memory import measure_memory, memory_goal
from peerslib.multi_turn import LlamaChat, mt_report, multi_turn_round, multi_turn_setup
from peerslib.report import CEILING_SPREAD, ROWS, ceiling_spread, goals, render




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
    times_at_start = cpu_times()
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
        # the round's own read bandwidth and peak) and the CPU share the
        # hypervisor took during it.
        res[name]["rounds"] = [round_entry(r) for r in rs]
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
    # A ceiling that moved between rounds: another tenant of the host, which
    # a virtual machine's load average does not count.
    report["ceiling_spread"] = ceiling_spread(res)
    # The CPU time the hypervisor gave other tenants: the direct measure.
    report["steal_share"] = stolen(times_at_start, cpu_times())
    report["busy"] = (max(load_at_start, report["load_average_at_end"] - threads) > BUSY_LOAD
                      or (report["ceiling_spread"] or 1.0) > CEILING_SPREAD
                      or (report["steal_share"] or 0.0) > BUSY_STEAL)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {args.json}")
    failed = any("error" in r for r in res.values()) or bool(mt.get("errors")) or mt.get("failed", False)
    return 1 if failed else 0


def round_entry(r):
    """One engine's round as the report keeps it: its rows, and kvmesh's
    ceilings and steal share measured in it."""
    info = r.get("info") or {}
    entry = {key: round(r[key], 1) for key, _ in ROWS}
    entry.update({k: info[k] for k in ("roofline", "steal_share") if info.get(k) is not None})
    return entry


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
    KVMESH_OPTIONS.update(cpu_kernels=args.cpu_kernels, activations=args.activations)
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
