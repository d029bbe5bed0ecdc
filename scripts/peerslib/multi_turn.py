"""Multi-turn chat with prompt caching: the script both engines play,
kvmesh's `bench-cache` and llama-cpp-python's chat completion with its RAM
prompt cache, and the per-turn table."""

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from peerslib.common import PROMPT_TOKENS, log, warn


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
