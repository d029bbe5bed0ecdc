#!/usr/bin/env python3
"""Generate kvmesh's reference ("golden") data with Hugging Face transformers.

Outputs (relative to the repository root, overridable with --data-dir):

  model/tests/data/tiny-llama/                 a tiny random Llama HF model directory
  model/tests/data/golden/tiny-llama.json      golden tokenizer / chat / greedy data
  model/tests/data/golden/smollm2-135m-instruct-q4_1.json

The SmolLM2 reference is the GGUF dequantized to float32 and loaded as a
LlamaForCausalLM (eager attention, float32, CPU). The ~540 MB float32 HF
directory is written to a temporary directory outside the repository and
deleted afterwards (keep it with --keep-hf-dir).

Everything is deterministic: fixed seeds, fixed corpus, greedy decoding.
CI does not run this script; its outputs are committed. See README.md.
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gguf
import safetensors
import safetensors.torch
import tokenizers
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GGUF = Path(
    os.environ.get(
        "KVMESH_GGUF",
        str(Path.home() / ".cache" / "kvmesh" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
)

N_NEW_TOKENS = 32
TOP_K = 8
ATTN_IMPL = "eager"
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32(x):
    """Shortest decimal that round-trips the float32 value x (for config fields)."""
    return float(str(np.float32(x)))


def versions():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": _dist_version("gguf"),
        "tokenizers": tokenizers.__version__,
        "safetensors": _dist_version("safetensors"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _dist_version(name):
    from importlib.metadata import version

    return version(name)


# --------------------------------------------------------------------------------------
# JSON output: indented objects, scalar-only lists on one line, floats via repr(float).
# --------------------------------------------------------------------------------------


def _is_flat(v):
    return isinstance(v, list) and all(
        not isinstance(x, (dict, list)) or (isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x))
        for x in v
    )


def to_json(v, indent=0):
    pad = " " * indent
    if isinstance(v, dict):
        if not v:
            return "{}"
        items = [f'{pad} {json.dumps(k, ensure_ascii=False)}: {to_json(x, indent + 1)}' for k, x in v.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(v, list):
        if _is_flat(v):
            return json.dumps(v, ensure_ascii=False, allow_nan=False)
        items = [pad + " " + to_json(x, indent + 1) for x in v]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    if isinstance(v, float):
        assert math.isfinite(v), v
    return json.dumps(v, ensure_ascii=False, allow_nan=False)


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = to_json(obj) + "\n"
    assert json.loads(text) == obj  # round trip (floats included)
    path.write_text(text, encoding="utf-8")
    log(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path} ({path.stat().st_size} bytes)")


# --------------------------------------------------------------------------------------
# Shared test inputs
# --------------------------------------------------------------------------------------

TOKENIZE_TEXTS = [
    "",
    " ",
    "\n\n",
    "Hello world",
    "The capital of France is",
    "12345 and 3.14159",
    "héllo wörld 世界 🙂",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>",
    "a<|im_end|>b<|im_start|>",
    "<|im_start|",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    spaces\tand\ttabs\t\tend",
    "   \n  \n\t\n",
    "line one\r\nline two\r\n",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    "Don't stop-believing! It's 2024... isn't it? (Yes/no); 50% off: $9.99.",
    "https://example.com/path?q=1&r=two#frag",
    "ÅÄÖ åäö ñ ç ß Ωmega ДОБРЫЙ день",
    "emoji 👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "日本語のテキストと中文文本",
    "1000000 0.5 -42 1e10 007",
    # Whitespace runs before a digit: the individual-digits split changes how the run
    # is grouped ("a  1" -> a, ĠĠ, 1). transformers' GGUF converter omits that split.
    "a  1",
    "x   42",
    "\t\t7",
    "\n\n3",
    "1  2  3",
    "n = \n  12",
]

EXTRA_TOKENIZE_SMOLLM = [
    "<filename>main.py<file_sep>import os<|endoftext|>",
    "<jupyter_code>x = 1<jupyter_output>",
]

CHAT_CASES = [
    # (messages, add_generation_prompt)
    ([{"role": "user", "content": "Hi there!"}], True),
    ([{"role": "user", "content": "Hi there!"}], False),
    (
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "List three primary colors."},
        ],
        True,
    ),
    (
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "List three primary colors."},
        ],
        False,
    ),
    (
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        True,
    ),
    (
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Good morning!"},
            {"role": "assistant", "content": "Bonjour !"},
            {"role": "user", "content": "How are you?"},
            {"role": "assistant", "content": "Très bien, merci."},
        ],
        False,
    ),
    ([{"role": "user", "content": "Unicode: héllo 世界 🙂\nand a second line\twith a tab."}], True),
]

LONG_TEXT_SMOLLM = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined several existing technologies into a practical system for "
    "producing books. Movable metal type, oil-based ink, and a screw press adapted from those used "
    "to make wine allowed printers to produce pages far more quickly than scribes could copy them "
    "by hand. Within fifty years, presses were operating in more than two hundred cities across "
    "Europe, and millions of volumes had been printed. The consequences were profound: literacy "
    "spread, scholars could compare identical copies of texts, and new ideas travelled faster than "
    "ever before. Religious reformers, scientists, and merchants all used the new medium to reach "
    "wider audiences. Historians still debate how much of the scientific revolution can be credited "
    "to print, but few doubt that it changed how knowledge was stored, shared, and challenged. "
    "Printing also helped to standardise spelling and grammar in many European languages. "
    "In summary, the most important effect of the printing press was"
)

LONG_TEXT_TINY = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. "
    "Every morning he rowed out before the sun was up, and every evening he came home with a basket "
    "of fish, a few shells, and a story to tell. One day in 1969 he found a bottle"
)


def greedy_prompts(long_text, smollm):
    """List of (kind, payload): ("text", str) or ("chat", messages)."""
    p = [
        ("text", "The capital of France is"),
        ("text", "In 1969, 2 astronauts flew 384400 km; 12 + 30 = "),
        ("text", "Le café est très bon, et le thé aussi. Über alles: 世界 🙂 means"),
        ("text", long_text),
        ("text", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        ("chat", [{"role": "user", "content": "What is the capital of France?"}]),
        (
            "chat",
            [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "List three primary colors."},
            ],
        ),
        (
            "chat",
            [
                {"role": "user", "content": "What is 17 * 23?"},
                {"role": "assistant", "content": "17 * 23 = 391."},
                {"role": "user", "content": "And what is 391 + 9?"},
            ],
        ),
        ("chat", [{"role": "user", "content": "Write a haiku about the sea."}]),
    ]
    return p


# --------------------------------------------------------------------------------------
# Golden computation (shared by both models)
# --------------------------------------------------------------------------------------


def encode(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


def render_chat(tok, messages, add_generation_prompt):
    out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(out, str), type(out)
    return out


def _cache_kwarg(model):
    # transformers >= 5.2x renamed `past_key_values` to `cache`.
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


@torch.no_grad()
def greedy(model, prompt_ids):
    """32 greedy tokens with KV cache; raw float32 logits, no logits processors, no EOS stop."""
    kw = _cache_kwarg(model)
    x = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=True)
    past = _cache_of(out)
    logits = out.logits[0, -1].float()
    tokens, steps, all_logits = [], [], []
    for i in range(N_NEW_TOKENS):
        all_logits.append(logits.clone())
        top = torch.topk(logits, TOP_K)
        vals = top.values.tolist()
        idx = top.indices.tolist()
        nt = int(torch.argmax(logits))
        assert logits[nt] == vals[0]
        tokens.append(nt)
        steps.append(
            {
                "top": [[int(j), float(v)] for j, v in zip(idx, vals)],
                "gap": float(np.float32(vals[0]) - np.float32(vals[1])),
            }
        )
        if i + 1 < N_NEW_TOKENS:
            out = model(input_ids=torch.tensor([[nt]]), use_cache=True, **{kw: past})
            past = _cache_of(out)
            logits = out.logits[0, -1].float()
    # Cross-check the cached path against one uncached forward over prompt + tokens[:-1].
    full = model(input_ids=torch.tensor([prompt_ids + tokens[:-1]]), use_cache=False).logits[0].float()
    n = len(prompt_ids)
    ref = full[n - 1 : n - 1 + N_NEW_TOKENS]
    diff = float((ref - torch.stack(all_logits)).abs().max())
    mismatches = int((ref.argmax(-1) != torch.tensor(tokens)).sum())
    return tokens, steps, diff, mismatches


def build_golden(name, source, tok, model, long_text, smollm, extra_tokenize=(), extra=None):
    g = {
        "model": name,
        "source": source,
        "versions": versions(),
        "dtype": "float32",
        "attn_implementation": ATTN_IMPL,
        "eos_token_id": int(tok.convert_tokens_to_ids(tok.eos_token)),
        "add_bos": False,
        "n_new_tokens": N_NEW_TOKENS,
        "top_k": TOP_K,
    }
    if extra:
        g.update(extra)

    log(f"{name}: tokenize cases")
    g["tokenize"] = []
    for text in list(TOKENIZE_TEXTS) + list(extra_tokenize):
        ids = encode(tok, text)
        g["tokenize"].append({"text": text, "ids": ids, "pieces": tok.convert_ids_to_tokens(ids)})

    log(f"{name}: chat cases")
    g["chat"] = []
    for messages, agp in CHAT_CASES:
        rendered = render_chat(tok, messages, agp)
        g["chat"].append(
            {"messages": messages, "add_generation_prompt": agp, "rendered": rendered, "ids": encode(tok, rendered)}
        )

    g["greedy"] = []
    gaps = []
    max_cache_diff = 0.0
    argmax_mismatches = 0
    for kind, payload in greedy_prompts(long_text, smollm):
        if kind == "chat":
            prompt = render_chat(tok, payload, True)
        else:
            prompt = payload
        prompt_ids = encode(tok, prompt)
        t = time.time()
        tokens, steps, diff, mismatches = greedy(model, prompt_ids)
        if mismatches:
            log(f"WARNING: {name}: cached and uncached argmax differ at {mismatches} steps for {prompt!r}")
        argmax_mismatches += mismatches
        max_cache_diff = max(max_cache_diff, diff)
        gaps += [s["gap"] for s in steps]
        entry = {"prompt": prompt, "chat": kind == "chat"}
        if kind == "chat":
            entry["messages"] = payload
        entry.update(
            {
                "prompt_ids": prompt_ids,
                "tokens": tokens,
                "text": tok.decode(tokens),
                "steps": steps,
            }
        )
        g["greedy"].append(entry)
        log(
            f"{name}: greedy {len(prompt_ids):3d} prompt tokens in {time.time() - t:5.1f}s, "
            f"min gap {min(s['gap'] for s in steps):.4f}: {tok.decode(tokens)[:70]!r}"
        )

    gaps = np.array(gaps)
    g["stats"] = {
        "greedy_steps": int(gaps.size),
        "frac_gap_ge_0.01": float(np.mean(gaps >= 0.01)),
        "frac_gap_ge_0.05": float(np.mean(gaps >= 0.05)),
        "min_gap": float(gaps.min()),
        "median_gap": float(np.median(gaps)),
        "kv_cache_vs_full_forward_max_abs_logit_diff": max_cache_diff,
        "kv_cache_vs_full_forward_argmax_mismatches": argmax_mismatches,
    }
    log(f"{name}: stats {g['stats']}")
    return g


# --------------------------------------------------------------------------------------
# (a) Tiny model
# --------------------------------------------------------------------------------------

TINY_SEED = 9  # chosen among seeds 1..12 as the one with the largest minimum top-2 gap
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Weight init std per tensor kind. Random std-0.02 init gives near-uniform logits
# (top-2 gaps < 0.01); these scales give peaky but non-degenerate greedy output.
TINY_INIT_STD = {
    "embed": 0.5,
    "lm_head": 1.0,
    "qk": 0.3,
    "vo": 0.25,
    "mlp": 0.15,
    "norm_jitter": 0.1,  # norm weights = 1 + norm_jitter * N(0, 1)
}
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
}

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning he rowed out before the sun was up, and every evening he came home with a basket of fish, a few shells, and a story to tell.
The capital of France is Paris. The capital of Italy is Rome, and the capital of Japan is Tokyo. Berlin, Madrid, London and Vienna are also large European cities.
In 1969, two astronauts walked on the Moon. The mission lasted 8 days, 3 hours and 18 minutes; the rocket was about 110 meters tall and weighed 2,970 tonnes at launch.
Water boils at 100 degrees Celsius (212 degrees Fahrenheit) at sea level. Pi is roughly 3.14159, and the square root of 2 is about 1.41421.
"Where are you going?" she asked. "To the market," he said, "and then to the library, if it's still open." They laughed; it was 5:30 p.m. on a Tuesday.
Please reply to hello@example.com or visit https://www.example.org/docs/index.html for more information. Call 555-0123 between 9:00 and 17:00.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
Machine learning models learn patterns from data. A language model predicts the next token given the previous tokens, one step at a time.
The weather today is sunny with a light breeze; tomorrow it will be cloudy, and on Friday we expect rain. Temperatures range from 12 to 24 degrees.
Shopping list: 3 apples, 2 loaves of bread, 1 litre of milk, 12 eggs, cheese, tea, and coffee. Total: $27.45!
Questions? Answers! Lists, commas, semicolons; colons: dashes - and -- more dashes... brackets [like this], braces {like that}, and <angle brackets>.
The café served crème brûlée and a naïve little tarte; the señor ordered jalapeño soup. Über alles, the résumé was très bien. 世界 means world. 🙂
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers. How much wood would a woodchuck chuck if a woodchuck could chuck wood?
The library has 4,096 books, 512 maps, and 256 old newspapers. Its hours are Monday to Saturday, from 8 in the morning until 8 in the evening.
Good morning! How are you today? I am fine, thank you. What would you like to do this afternoon? Let us go for a walk in the park and then have some tea.
A system message tells the assistant how to behave. The user asks a question, and the assistant answers it as clearly and helpfully as it can.
Mathematics: 2 + 2 = 4, 7 * 6 = 42, 10 / 4 = 2.5, and 2 ** 10 = 1024. Prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31.
The river flows from the mountains to the ocean, passing forests, farms, and towns. Children play on its banks in the summer and skate on its ice in the winter.
Rust is a systems programming language. Python is popular for data science. The compiler checks the types, and the tests check the behaviour.
Every good story has a beginning, a middle, and an end. The hero leaves home, faces a challenge, learns something important, and returns changed.
"""


def smollm_style_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def train_tiny_tokenizer(vocab_size):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = smollm_style_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in TINY_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS.split("\n"), trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, t in enumerate(TINY_SPECIALS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tiny_init_weights(model):
    g = torch.Generator().manual_seed(TINY_SEED)
    s = TINY_INIT_STD
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if n.endswith("norm.weight"):
                p.copy_(1.0 + s["norm_jitter"] * r)
            elif "embed_tokens" in n:
                p.copy_(s["embed"] * r)
            elif n.startswith("lm_head"):
                p.copy_(s["lm_head"] * r)
            elif "q_proj" in n or "k_proj" in n:
                p.copy_(s["qk"] * r)
            elif "v_proj" in n or "o_proj" in n:
                p.copy_(s["vo"] * r)
            elif "mlp" in n:
                p.copy_(s["mlp"] * r)
            else:
                raise AssertionError(f"unexpected parameter {n}")


def make_tiny(data_dir):
    out = data_dir / "tiny-llama"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log(f"tiny: training byte-level BPE (vocab {TINY_CONFIG['vocab_size']})")
    tok = train_tiny_tokenizer(TINY_CONFIG["vocab_size"])
    tok.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, t in enumerate(TINY_SPECIALS)
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special_map = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")

    cfg_json = dict(TINY_CONFIG)
    cfg_json["transformers_version"] = transformers.__version__
    # transformers >= 5 reads/writes RoPE settings as "rope_parameters"; keep the classic
    # "rope_theta" + "rope_scaling" keys too so either kind of reader finds them.
    cfg_json["rope_parameters"] = dict(TINY_CONFIG["rope_scaling"], rope_theta=TINY_CONFIG["rope_theta"])
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    log("tiny: initialising weights")
    torch.manual_seed(TINY_SEED)
    cfg = LlamaConfig.from_pretrained(str(out))
    model = LlamaForCausalLM(cfg)
    tiny_init_weights(model)
    sd = {k: v.detach().contiguous().clone() for k, v in sorted(model.state_dict().items())}
    safetensors.torch.save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)

    # Reload everything from disk: the golden data comes from the files as committed.
    cfg2 = LlamaConfig.from_pretrained(str(out))
    rp = cfg2.rope_parameters
    assert rp["rope_type"] == "llama3" and rp["factor"] == 4.0 and rp["rope_theta"] == 10000.0, rp
    assert rp["original_max_position_embeddings"] == 64 and rp["high_freq_factor"] == 4.0, rp
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation=ATTN_IMPL).eval()
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert set(model.state_dict()) == set(sd)
    assert model.config._attn_implementation == ATTN_IMPL
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    for text in TOKENIZE_TEXTS + TINY_CORPUS.split("\n"):
        assert encode(hf_tok, text) == tok.encode(text).ids, text
    assert hf_tok.eos_token_id == 2

    n_params = sum(p.numel() for p in model.parameters())
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(out.iterdir())}
    source = (
        "Generated by scripts/golden/make_golden.py: random Llama weights (torch.Generator seed "
        f"{TINY_SEED}, init std {TINY_INIT_STD}), byte-level BPE trained on the script's corpus; "
        "loaded back from model/tests/data/tiny-llama with LlamaForCausalLM.from_pretrained"
    )
    g = build_golden(
        "tiny-llama",
        source,
        hf_tok,
        model,
        LONG_TEXT_TINY,
        smollm=False,
        extra={"n_params": n_params, "files": files},
    )
    return g


# --------------------------------------------------------------------------------------
# (b) SmolLM2 from GGUF
# --------------------------------------------------------------------------------------

GGUF_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute(w, n_head):
    """Undo llama.cpp's convert_hf_to_gguf Q/K permute (interleaved -> rotate-half RoPE order)."""
    rows, hidden = w.shape
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, hidden).swapaxes(1, 2).reshape(rows, hidden)


def gguf_field(reader, name):
    return reader.fields[name].contents()


def gguf_to_hf(gguf_path, hf_dir):
    reader = gguf.GGUFReader(str(gguf_path))
    arch = gguf_field(reader, "general.architecture")
    assert arch == "llama", arch
    n_head = int(gguf_field(reader, "llama.attention.head_count"))
    n_kv = int(gguf_field(reader, "llama.attention.head_count_kv"))
    hidden = int(gguf_field(reader, "llama.embedding_length"))
    n_layer = int(gguf_field(reader, "llama.block_count"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    head_dim = hidden // n_head
    assert int(gguf_field(reader, "llama.rope.dimension_count")) == head_dim
    assert "llama.rope.scaling.type" not in reader.fields
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(gguf_field(reader, "llama.context_length")),
        rms_norm_eps=f32(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=f32(gguf_field(reader, "llama.rope.freq_base")),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=int(gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=int(gguf_field(reader, "tokenizer.ggml.padding_token_id")),
    )
    assert cfg.vocab_size == int(gguf_field(reader, "llama.vocab_size"))
    assert cfg.tie_word_embeddings
    sd = {}
    qtypes = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))  # GGUF dims are innermost-first
        arr = np.array(arr.reshape(shape), dtype=np.float32, order="C", copy=True)
        qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in GGUF_TO_HF and parts[3] == "weight":
            name = f"model.layers.{int(parts[1])}.{GGUF_TO_HF[parts[2]]}.weight"
            if parts[2] == "attn_q":
                arr = unpermute(arr, n_head)
            elif parts[2] == "attn_k":
                arr = unpermute(arr, n_kv)
        else:
            raise AssertionError(f"unmapped GGUF tensor {t.name}")
        assert name not in sd, name
        sd[name] = torch.from_numpy(arr)
    expected = 2 + 9 * n_layer
    assert len(sd) == expected, (len(sd), expected)
    hf_dir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(hf_dir))
    safetensors.torch.save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return reader, cfg, qtypes


def build_smollm_tokenizer(reader):
    tokens = [str(t) for t in gguf_field(reader, "tokenizer.ggml.tokens")]
    merges = [str(m) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    types = [int(t) for t in gguf_field(reader, "tokenizer.ggml.token_type")]
    assert gguf_field(reader, "tokenizer.ggml.model") == "gpt2"
    assert gguf_field(reader, "tokenizer.ggml.pre") == "smollm"
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens)
    merge_pairs = []
    for m in merges:
        a, b = m.split(" ")
        merge_pairs.append((a, b))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.pre_tokenizer = smollm_style_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, ty in enumerate(types) if ty == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for s in specials:
        assert tok.token_to_id(s) == vocab[s]
    eos = tokens[int(gguf_field(reader, "tokenizer.ggml.eos_token_id"))]
    bos = tokens[int(gguf_field(reader, "tokenizer.ggml.bos_token_id"))]
    unk = tokens[int(gguf_field(reader, "tokenizer.ggml.unknown_token_id"))]
    pad = tokens[int(gguf_field(reader, "tokenizer.ggml.padding_token_id"))]
    assert not gguf_field(reader, "tokenizer.ggml.add_bos_token")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )
    hf.chat_template = str(gguf_field(reader, "tokenizer.chat_template"))
    return hf, specials, len(merges)


def crosscheck_gguf_converter(gguf_path, explicit_tok, texts):
    """Compare explicit tokenizer with transformers' own GGUF tokenizer conversion."""
    result = {"method": "AutoTokenizer.from_pretrained(dir, gguf_file=...)", "agree": [], "disagree": []}
    try:
        conv = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # record, do not fail the whole run
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"smollm2: transformers GGUF tokenizer conversion failed: {result['error']}")
        return result
    result["class"] = type(conv).__name__
    backend = json.loads(conv.backend_tokenizer.to_str())
    result["converter_pre_tokenizer"] = backend.get("pre_tokenizer")
    result["converter_model_options"] = {
        k: v for k, v in backend["model"].items() if k not in ("vocab", "merges")
    }
    result["converter_n_added_special"] = sum(1 for t in backend.get("added_tokens", []) if t.get("special"))
    result["default_encode_adds"] = [
        i for i in conv.encode("Hi", add_special_tokens=True) if i not in conv.encode("Hi", add_special_tokens=False)
    ]
    for text in texts:
        a = encode(explicit_tok, text)
        b = encode(conv, text)
        if a == b:
            result["agree"].append(text)
        else:
            result["disagree"].append({"text": text, "explicit": a, "converter": b})
    try:
        msgs = CHAT_CASES[0][0]
        same_tpl = render_chat(conv, msgs, True) == render_chat(explicit_tok, msgs, True)
        result["chat_template_renders_same"] = same_tpl
    except Exception as e:
        result["chat_template_renders_same"] = f"error: {type(e).__name__}: {e}"
    log(
        f"smollm2: converter agrees on {len(result['agree'])}/{len(texts)} strings; "
        f"disagreements: {[d['text'] for d in result['disagree']]}"
    )
    return result


def make_smollm(gguf_path, keep_hf_dir, workdir):
    log(f"smollm2: hashing {gguf_path}")
    digest = sha256_file(gguf_path)
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-smollm2-hf-", dir=workdir))
    try:
        log(f"smollm2: dequantizing GGUF to float32 HF directory {tmp} (not in the repository)")
        reader, cfg, qtypes = gguf_to_hf(gguf_path, tmp)
        log("smollm2: loading LlamaForCausalLM (float32, eager)")
        model = LlamaForCausalLM.from_pretrained(str(tmp), dtype=torch.float32, attn_implementation=ATTN_IMPL).eval()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
        assert model.config._attn_implementation == ATTN_IMPL
        tok, specials, n_merges = build_smollm_tokenizer(reader)

        ids = encode(tok, "The capital of France is")
        assert ids == [504, 3575, 282, 4649, 314], ids

        texts = list(TOKENIZE_TEXTS) + EXTRA_TOKENIZE_SMOLLM
        texts += [render_chat(tok, m, a) for m, a in CHAT_CASES]
        texts += [render_chat(tok, p, True) if k == "chat" else p for k, p in greedy_prompts(LONG_TEXT_SMOLLM, True)]
        texts += [line for line in TINY_CORPUS.split("\n") if line]
        cross = crosscheck_gguf_converter(gguf_path, tok, texts)

        source = (
            f"GGUF file {gguf_path.name} (sha256 {digest}, tensor types {qtypes}) dequantized to float32 with "
            "gguf.quants.dequantize, GGUF dims reversed, llama.cpp Q/K permutation undone, saved as a temporary "
            "HF directory and loaded with LlamaForCausalLM.from_pretrained (float32, CPU, eval, eager attention, "
            "tied embeddings). Tokenizer built explicitly with the tokenizers library from tokenizer.ggml.tokens/"
            "merges (byte-level BPE, Digits(individual_digits) + ByteLevel pre-tokenizer, token_type 3 as special "
            "added tokens, no BOS) and the GGUF chat template"
        )
        extra = {
            "gguf_sha256": digest,
            "config": {
                k: getattr(cfg, k)
                for k in [
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "max_position_embeddings",
                    "rms_norm_eps",
                    "tie_word_embeddings",
                ]
            },
            "rope_theta": cfg.rope_parameters["rope_theta"],
            "special_tokens": specials,
            "n_merges": n_merges,
            "tokenizer_crosscheck": cross,
        }
        g = build_golden(
            "SmolLM2-135M-Instruct.Q4_1",
            source,
            tok,
            model,
            LONG_TEXT_SMOLLM,
            smollm=True,
            extra_tokenize=EXTRA_TOKENIZE_SMOLLM,
            extra=extra,
        )
        france = g["greedy"][0]
        assert france["prompt"] == "The capital of France is"
        if "Paris" not in france["text"]:
            log(f"WARNING: SmolLM2 continuation does not mention Paris: {france['text']!r}")
        return g
    finally:
        if keep_hf_dir:
            log(f"smollm2: kept HF directory {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="SmolLM2-135M-Instruct Q4_1 GGUF (env KVMESH_GGUF)")
    ap.add_argument("--data-dir", type=Path, default=REPO_ROOT / "model" / "tests" / "data")
    ap.add_argument("--only", choices=["tiny", "smollm2"], help="generate only one model's data")
    ap.add_argument("--keep-hf-dir", action="store_true", help="keep the temporary float32 SmolLM2 HF directory")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: reproducible reductions, and avoids OpenMP stalls on busy machines)",
    )
    ap.add_argument("--workdir", default=None, help="parent of the temporary HF directory (default: system temp)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    log(f"versions: {versions()}; torch threads {torch.get_num_threads()}")
    golden_dir = args.data_dir / "golden"
    if args.only in (None, "tiny"):
        write_json(golden_dir / "tiny-llama.json", make_tiny(args.data_dir))
    if args.only in (None, "smollm2"):
        if not args.gguf.exists():
            sys.exit(f"GGUF not found: {args.gguf} (set --gguf or KVMESH_GGUF)")
        write_json(golden_dir / "smollm2-135m-instruct-q4_1.json", make_smollm(args.gguf, args.keep_hf_dir, args.workdir))
    log("done")


if __name__ == "__main__":
    main()
