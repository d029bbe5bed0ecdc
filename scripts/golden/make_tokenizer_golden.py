#!/usr/bin/env python3
"""Golden tokenizer data for kvmesh-tokenizer's GGUF vocabularies.

transformers' own GGUF loading, `AutoTokenizer.from_pretrained(dir,
gguf_file=name)`, is the reference: for every vocabulary below this records
the ids it gives for a fixed list of texts (with and without special tokens),
and for a few conversations the chat template's rendering and its ids.

Vocabularies:

- Four small vocabulary-only GGUF files (metadata, no tensors) that this
  script writes, with vocabularies trained here by the `tokenizers` library
  on the fixed corpus below: `spm-llama.gguf` (SentencePiece-style, Llama 2 /
  Mistral layout: scores, 256 byte-fallback tokens, control and user-defined
  tokens), `spm-phi3.gguf` (the same pieces, Phi-3 layout and architecture),
  `bpe-qwen2.gguf` (byte-level BPE, pre-tokenizer `qwen2`, Qwen 2.5's chat
  template) and `bpe-llama3.gguf` (byte-level BPE, `llama-bpe`, Llama 3's
  template). They are committed with the golden JSON, so the Rust tests need
  no Python.
- Variants of those files that differ in one key (`tokenizer.ggml.pre`,
  `tokenizer.ggml.add_space_prefix`); only the key is recorded, the Rust test
  writes the variant itself.
- The real Gemma 3 270M GGUF (`--gemma`, default
  `$KVMESH_HOME/gemma-3-270m-q4_k_m.gguf`), with Gemma 3's published chat
  template (the file carries none).
- The real Qwen2.5-Coder 0.5B Instruct GGUF (`--qwen`, default
  `$KVMESH_HOME/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`) with its own chat
  template, tools included.

Where kvmesh deliberately follows the model's original tokenizer (and
llama.cpp) instead of transformers' GGUF converter, the expected ids come
from transformers' tokenizer with that one component changed, and the
golden file keeps transformers' ids beside them (`transformers_ids`) with
the reason. See scripts/golden/README.md.

Deterministic: the same inputs give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import gguf  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Regex, models, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tokenizer" / "tests" / "data"

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------
# Corpus the small vocabularies are trained on: prose, code, numbers, several
# scripts and emoji, so the test texts below meet multi-character tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "It's a truth universally acknowledged that they'll say what they've seen.",
    "Hello world! Hello there, how are you doing today? I'm fine, thanks.",
    "Tokenizers split text into pieces; the pieces become numbers for the model.",
    "A mesh of inference nodes serves the model: prefill, decode and a router.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl Display for Error {\n\tfn fmt(&self, f: &mut Formatter) -> Result {\n\t\twrite!(f, \"error\")\n\t}\n}\n",
    '{"name": "kvmesh", "version": "0.1.0", "tags": ["llm", "inference"], "ok": true}',
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 2024 3.14159 2,718,281 1e-5 0xFF",
    "Call 555-0100 before 10:30 on 2024-02-29; the total is $1,234.56 (15% off).",
    "今天天气很好。我们去公园散步吧！中文的分词需要很多字符。",
    "日本語のテキストもあります。こんにちは、世界。",
    "한국어 문장도 있습니다. 안녕하세요!",
    "Привет, мир! Как дела? Всё хорошо.",
    "Γειά σου Κόσμε. Ελληνικά γράμματα.",
    "مرحبا بالعالم. هذا نص عربي قصير.",
    "Café, naïve, résumé, façade, Zürich, São Paulo, Ångström.",
    "Emoji: 😀 😂 🦀 🚀 ❤️ 👍🏽 👩‍💻 🇫🇷 ✨",
    "    indented with spaces\n\tindented with a tab\n\n\nblank lines above\r\n",
    "Mixed-case WORDS and CamelCaseIdentifiers and snake_case_names.",
    "URLs like https://example.com/path?query=1&x=y#frag are common.",
]

# Texts every vocabulary is checked on (with and without special tokens).
TEXTS = [
    "",
    "Hello world",
    "hello world",
    " leading space",
    "  two leading spaces",
    "\tleading tab",
    "trailing spaces   ",
    "multiple   spaces\tand\t\ttabs\n\nand newlines\r\nend",
    "\n\n\n",
    "    ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet x: u64 = 1_000_000;\n\tprintln!(\"{x}\");\n}",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": "text"}}',
    "12345678901234567890",
    "3.14159 and 2,718,281 and 1e-5",
    "Version 1.2.3-rc4 released on 2024-02-29 at 10:30",
    "你好，世界！今天天气很好。",
    "こんにちは世界",
    "안녕하세요",
    "I ❤️ 🦀 and 👩‍👩‍👧‍👦!",
    "Привет, мир! Γειά σου Κόσμε. مرحبا",
    "café naïve résumé Zürich",
    "I'm sure it's 'quoted' and they'll've",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "unknown chars: \u0000\u0001 bell\u0007 \u00a0nbsp\u2003em \U0001f9ec",
    "x\u200by zero width",
    "x  42 and   7 items, 1234567 total",
    "the tokenizer of kvmesh",
]

# ---------------------------------------------------------------------------
# Chat templates (each the model's published template, as data).

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello! How are you?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3? Answer in 中文 please 🙂"},
    ],
    "padded_content": [
        {"role": "user", "content": "  padded content with\ttabs \n"},
        {"role": "assistant", "content": "\nok\n\n"},
        {"role": "user", "content": "code:\n```py\nprint('hi')\n```"},
    ],
}
# Templates that only accept user/assistant turns.
USER_ASSISTANT_ONLY = {"padded_content", "single_user"}


# ---------------------------------------------------------------------------
# Vocabulary construction.


def train_spm_pieces(vocab_size: int) -> tuple[list[str], list[str]]:
    """(merged pieces in merge order, single characters) of a BPE trained on
    the corpus with SentencePiece's whitespace handling (Metaspace)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, min_frequency=2)
    tok.train_from_iterator(CORPUS * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else "".join(m.split(" ")) for m in model["merges"]]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    singles = [t for t, _ in by_id if len(t) == 1]
    return merged, singles


def spm_vocab(extra: list[tuple[str, int]]) -> tuple[list[str], list[float], list[int]]:
    """Llama 2's layout: <unk>, <s>, </s>, the 256 byte tokens, pieces by
    falling score, then `extra` (text, type). Scores: merged pieces -k, then
    single characters below them; every 7th merged piece ties with the one
    before it so that the merge order's tie-breaking is exercised."""
    merged, singles = train_spm_pieces(900)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    score = 0.0
    for k, piece in enumerate(merged):
        if piece in seen:
            continue
        if k % 7 != 6:
            score = -float(k)
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(score)
        seen.add(piece)
    base = -float(len(merged))
    for j, ch in enumerate(singles):
        if ch in seen:
            continue
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(base - j)
        seen.add(ch)
    for text, ty in extra:
        tokens.append(text)
        types.append(ty)
        scores.append(0.0)
    return tokens, scores, types


def train_byte_level(split_regex: str, vocab_size: int, extra_words: list[str]) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges "a b") of a byte-level BPE trained on the
    corpus with `split_regex` before the byte-level mapping."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    # Whole words no merge sequence builds (Llama 3's tokenizer keeps such
    # words whole: `ignore_merges`).
    tokens += [w for w in extra_words if w not in tokens]
    return tokens, merges


QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def write_gguf(path: Path, arch: str, kv: dict) -> None:
    """A metadata-only GGUF file: the architecture's hyperparameters (tiny,
    so transformers can build a config) and the tokenizer keys in `kv`."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model(kv["model"])
    if "pre" in kv:
        w.add_tokenizer_pre(kv["pre"])
    w.add_token_list(kv["tokens"])
    if "scores" in kv:
        w.add_token_scores(kv["scores"])
    w.add_token_types(kv["types"])
    if "merges" in kv:
        w.add_token_merges(kv["merges"])
    for key, add in [
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("unk", w.add_unk_token_id),
        ("pad", w.add_pad_token_id),
        ("eot", w.add_eot_token_id),
    ]:
        if key in kv:
            add(kv["tokens"].index(kv[key]))
    for key, add in [
        ("add_bos", w.add_add_bos_token),
        ("add_eos", w.add_add_eos_token),
        ("add_space_prefix", w.add_add_space_prefix),
    ]:
        if key in kv:
            add(kv[key])
    if "chat_template" in kv:
        w.add_chat_template(kv["chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_vocabs() -> dict[str, tuple[str, dict]]:
    """name -> (architecture, tokenizer keys) of the committed small files."""
    llama_spm = spm_vocab([("[INST]", CONTROL), ("[/INST]", CONTROL), ("<think>", USER_DEFINED), ("</think>", USER_DEFINED)])
    phi3_spm = spm_vocab(
        [
            ("<|endoftext|>", CONTROL),
            ("<|assistant|>", CONTROL),
            ("<|system|>", CONTROL),
            ("<|end|>", CONTROL),
            ("<|user|>", CONTROL),
            ("<|placeholder1|>", USER_DEFINED),
        ]
    )
    q_tokens, q_merges = train_byte_level(QWEN2_SPLIT, 256 + 1200, [])
    q_specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                  ("<tool_call>", USER_DEFINED), ("</tool_call>", USER_DEFINED)]
    l_tokens, l_merges = train_byte_level(LLAMA3_SPLIT, 256 + 1200, ["Ġkvmesh", "Ġtokenizer"])
    l_specials = [("<|begin_of_text|>", CONTROL), ("<|end_of_text|>", CONTROL),
                  ("<|start_header_id|>", CONTROL), ("<|end_header_id|>", CONTROL),
                  ("<|eot_id|>", CONTROL), ("<|reserved_special_token_0|>", CONTROL)]

    def bpe(tokens, merges, specials):
        return {
            "model": "gpt2",
            "tokens": tokens + [t for t, _ in specials],
            "types": [NORMAL] * len(tokens) + [ty for _, ty in specials],
            "merges": merges,
        }

    return {
        "spm-llama": (
            "llama",
            {
                "model": "llama",
                "tokens": llama_spm[0],
                "scores": llama_spm[1],
                "types": llama_spm[2],
                "bos": "<s>",
                "eos": "</s>",
                "unk": "<unk>",
                # add_bos_token and add_space_prefix absent: both default to true.
                "chat_template": MISTRAL_TEMPLATE,
            },
        ),
        "spm-phi3": (
            "phi3",
            {
                "model": "llama",
                "tokens": phi3_spm[0],
                "scores": phi3_spm[1],
                "types": phi3_spm[2],
                "bos": "<s>",
                "eos": "<|endoftext|>",
                "eot": "<|end|>",
                "unk": "<unk>",
                "pad": "<|endoftext|>",
                # Not Phi-3's own values: chosen so the fixtures cover a file
                # that says no BOS and adds EOS.
                "add_bos": False,
                "add_eos": True,
                "add_space_prefix": True,
                "chat_template": PHI3_TEMPLATE,
            },
        ),
        "bpe-qwen2": (
            "qwen2",
            dict(
                bpe(q_tokens, q_merges, q_specials),
                pre="qwen2",
                bos="<|endoftext|>",
                eos="<|im_end|>",
                pad="<|endoftext|>",
                add_bos=False,
                chat_template=QWEN25_TEMPLATE,
            ),
        ),
        "bpe-llama3": (
            "llama",
            dict(
                bpe(l_tokens, l_merges, l_specials),
                pre="llama-bpe",
                bos="<|begin_of_text|>",
                eos="<|end_of_text|>",
                eot="<|eot_id|>",
                add_bos=True,
                chat_template=LLAMA3_TEMPLATE,
            ),
        ),
    }


# Pre-tokenizer names checked on the Llama 3 vocabulary besides its own (it
# has multi-digit tokens and whole words no merge builds, so the digit split
# and the whole-word lookup show): name -> what kvmesh follows where
# transformers' converter differs.
PRE_VARIANTS = {
    # transformers and llama.cpp agree.
    "qwen2": None,
    "deepseek-r1-qwen": None,
    "qwen35": None,
    "gpt2": None,
    "default": None,
    "mpt": None,
    "olmo": None,
    "gpt-4o": None,
    "llama4": None,
    "dbrx": None,
    # Digits one by one, then GPT-2's split (llama.cpp, and these models'
    # tokenizer.json): transformers' converter drops the digit split.
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    # Llama 3's split with whole-word lookup first (llama.cpp, and Llama 3's
    # and Mistral's tokenizer.json): transformers' converter drops it.
    "llama3": "ignore_merges",
    "tekken": "ignore_merges",
}

DIFFERENCE_REASONS = {
    "digits": "the model's own tokenizer.json and llama.cpp split digits one by one before the "
    "byte-level regex (Sequence[Digits(individual_digits), ByteLevel]); transformers' GGUF "
    "converter leaves the digit split out",
    "ignore_merges": "the model's own tokenizer.json and llama.cpp look a whole pre-tokenized word up "
    "in the vocabulary before merging (ignore_merges); transformers' GGUF converter does not",
    "no_space_prefix": "the file says tokenizer.ggml.add_space_prefix = false, which llama.cpp honours "
    "(no leading U+2581); transformers' GGUF converter ignores the key and always prepends one",
}


def explicit(backend: tokenizers.Tokenizer, change: str | None) -> tokenizers.Tokenizer:
    """transformers' backend tokenizer with the one component kvmesh takes
    from the model's original tokenizer instead (`change`), else itself."""
    if change is None:
        return backend
    j = json.loads(backend.to_str())
    if change == "digits":
        j["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                j["pre_tokenizer"],
            ],
        }
    elif change == "ignore_merges":
        j["model"]["ignore_merges"] = True
    elif change == "no_space_prefix":
        assert j["pre_tokenizer"]["type"] == "Metaspace", j["pre_tokenizer"]
        j["pre_tokenizer"]["prepend_scheme"] = "never"
        j["decoder"]["decoders"] = [d for d in j["decoder"]["decoders"] if d["type"] != "Strip"]
    else:
        raise ValueError(change)
    return tokenizers.Tokenizer.from_str(json.dumps(j))


def load(dir_: Path, name: str):
    return AutoTokenizer.from_pretrained(str(dir_), gguf_file=name)


def cases(tok, change: str | None, texts: list[str], with_special: bool) -> tuple[list[dict], int]:
    """Per text: the expected ids (and with special tokens), transformers'
    where they differ, and the decoding. Returns (cases, differing count)."""
    backend = explicit(tok.backend_tokenizer, change)
    out, differing = [], 0
    for text in texts:
        want_plain = backend.encode(text, add_special_tokens=False).ids
        hf_plain = tok(text, add_special_tokens=False)["input_ids"]
        case = {"text": text, "ids_no_special": want_plain}
        if with_special:
            want = backend.encode(text).ids
            hf = tok(text)["input_ids"]
            case["ids"] = want
            case["decoded"] = tok.decode(want)
            if hf != want:
                case["transformers_ids"] = hf
        if hf_plain != want_plain:
            case["transformers_ids_no_special"] = hf_plain
        if ("transformers_ids" in case) or ("transformers_ids_no_special" in case):
            differing += 1
        out.append(case)
    return out, differing


def chat(tok, template: str | None, names: list[str], tools: bool) -> list[dict]:
    out = []
    for name in names:
        messages = CONVERSATIONS[name]
        for gen in (True, False):
            rendered = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, chat_template=template
            )
            out.append(
                {
                    "conversation": name,
                    "messages": messages,
                    "add_generation_prompt": gen,
                    "rendered": rendered,
                    "ids": tok(rendered, add_special_tokens=False)["input_ids"],
                }
            )
    if tools:
        rendered = tok.apply_chat_template(
            TOOLS_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True, chat_template=template
        )
        out.append(
            {
                "conversation": "tools",
                "messages": TOOLS_CONVERSATION,
                "tools": TOOLS,
                "add_generation_prompt": True,
                "rendered": rendered,
                "ids": tok(rendered, add_special_tokens=False)["input_ids"],
            }
        )
    return out


# In the order a client writes them (the OpenAI documentation's): kvmesh
# keeps the client's key order, as transformers does, so a definition renders
# byte for byte as it would there.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOLS_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


def fnv1a64(merges: list) -> str:
    """FNV-1a (64-bit) over the merges as "a b\\n" lines, in order."""
    h = 0xCBF29CE484222325
    for a, b in merges:
        for byte in f"{a} {b}\n".encode():
            h ^= byte
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def versions() -> dict:
    return {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "python": sys.version.split()[0],
    }


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def write_json(path: Path, value: dict) -> None:
    """One key per line at the top; lists of objects one object per line
    (each on one line), so a change shows as the cases it touches."""

    def compact(v) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))

    def field(v, indent: str) -> str:
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            inner = ",\n".join(indent + "  " + dict_lines(x, indent + "  ") for x in v)
            return "[\n" + inner + "\n" + indent + "]"
        return compact(v)

    def dict_lines(d: dict, indent: str) -> str:
        if not any(isinstance(v, list) and v and all(isinstance(x, dict) for x in v) for v in d.values()):
            return compact(d)
        items = ",\n".join(f"{indent}  {json.dumps(k)}: {field(v, indent + '  ')}" for k, v in d.items())
        return "{\n" + items + "\n" + indent + "}"

    path.write_text(dict_lines(value, "") + "\n", encoding="utf-8")


def golden_small(out: Path) -> None:
    gguf_dir = out / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    golden_dir = out / "golden"
    golden_dir.mkdir(parents=True, exist_ok=True)
    specs = small_vocabs()
    templates_reading_tools = {"bpe-qwen2"}
    conversations = {
        "spm-llama": ["single_user", "padded_content"],
        "spm-phi3": list(CONVERSATIONS),
        "bpe-qwen2": list(CONVERSATIONS),
        "bpe-llama3": list(CONVERSATIONS),
    }
    for name, (arch, kv) in specs.items():
        path = gguf_dir / f"{name}.gguf"
        write_gguf(path, arch, kv)
        tok = load(gguf_dir, path.name)
        base_change = "ignore_merges" if name == "bpe-llama3" else None
        base, differing = cases(tok, base_change, TEXTS + SPECIAL_TEXTS[name], True)
        golden = {
            "vocab": name,
            "gguf": f"gguf/{path.name}",
            "versions": versions(),
            "follows": base_change,
            "reason": DIFFERENCE_REASONS.get(base_change),
            "differing_from_transformers": differing,
            "cases": base,
            "chat": chat(tok, None, conversations[name], name in templates_reading_tools),
            "variants": [],
        }
        variants = []
        if name == "bpe-llama3":
            variants = [({"tokenizer.ggml.pre": pre}, change) for pre, change in PRE_VARIANTS.items()]
        elif name == "spm-llama":
            variants = [({"tokenizer.ggml.add_space_prefix": False}, "no_space_prefix")]
        for keys, change in variants:
            with tempfile.TemporaryDirectory() as tmp:
                vkv = dict(kv)
                for key, value in keys.items():
                    vkv[key.removeprefix("tokenizer.ggml.")] = value
                write_gguf(Path(tmp) / "v.gguf", arch, vkv)
                vtok = load(Path(tmp), "v.gguf")
                vcases, vdiff = cases(vtok, change, TEXTS, False)
            golden["variants"].append(
                {
                    "set": keys,
                    "follows": change,
                    "reason": DIFFERENCE_REASONS.get(change),
                    "differing_from_transformers": vdiff,
                    "cases": vcases,
                }
            )
        write_json(golden_dir / f"{name}.json", golden)
        print(f"{name}: {path.stat().st_size} bytes, {len(base)} texts ({differing} differ from transformers), "
              f"{len(golden['variants'])} variants", file=sys.stderr)


# Texts with each vocabulary's own special tokens inline.
SPECIAL_TEXTS = {
    "spm-llama": [
        "[INST] What is this? [/INST] It is a test.</s>",
        "text<think>reasoning</think> answer",
        "</s><unk> and <s> in the middle",
        "[INST]no spaces[/INST]",
        # Begins with BOS: transformers adds a second, kvmesh does not.
        "<s>[INST] hi [/INST]",
    ],
    "spm-phi3": [
        "<|user|>\nHi there<|end|>\n<|assistant|>\n",
        "<|system|>sys<|end|><|placeholder1|> x",
        " <|user|> spaced <|end|> ",
        # Ends with EOS: transformers adds a second, kvmesh does not.
        "bye<|endoftext|>",
    ],
    "bpe-qwen2": [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<tool_call>\n{\"name\": \"f\"}\n</tool_call><|endoftext|>",
        "a<|im_end|>b",
    ],
    "bpe-llama3": [
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
        "about kvmesh and the tokenizer here",
        "<|reserved_special_token_0|><|end_of_text|>",
    ],
    "gemma3": [
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
        "text <bos> and <eos> and <pad> inline",
        "<start_of_image> and <unused0>",
        "[multimodal] tag",
    ],
}


def golden_real(
    path: Path, out: Path, vocab: str, name: str, specials: list[str], template: str | None, tools: bool
) -> None:
    """A real GGUF as transformers converts it (golden/NAME.json): its
    texts, merges and conversations, through `template` (None: the file's
    own)."""
    tok = load(path.parent, path.name)
    base, differing = cases(tok, None, TEXTS + specials, True)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    golden = {
        "vocab": vocab,
        "gguf": path.name,
        "gguf_sha256": _sha256(path),
        "versions": versions(),
        "follows": None,
        "reason": None,
        "differing_from_transformers": differing,
        "merges_count": len(merges),
        "merges_fnv1a64": fnv1a64(merges),
        "chat_template": template,
        "cases": base,
        "chat": chat(tok, template, list(CONVERSATIONS), tools),
        "variants": [],
    }
    write_json(out / "golden" / f"{name}.json", golden)
    print(f"{vocab}: {len(base)} texts ({differing} differ from transformers)", file=sys.stderr)


def golden_gemma(path: Path, out: Path) -> None:
    """The real Gemma 3 270M GGUF with Gemma 3's published template (the
    file has none)."""
    golden_real(path, out, "gemma3", "gemma3-270m", SPECIAL_TEXTS["gemma3"], GEMMA3_TEMPLATE, False)


def golden_qwen(path: Path, out: Path) -> None:
    """The real Qwen2.5-Coder 0.5B Instruct GGUF with its own chat template
    (tools included)."""
    golden_real(path, out, "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b", SPECIAL_TEXTS["bpe-qwen2"], None, True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    home = Path(os.environ.get("KVMESH_HOME") or Path.home() / ".cache" / "kvmesh")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA, help="output folder (default: %(default)s)")
    parser.add_argument("--gemma", type=Path, default=home / "gemma-3-270m-q4_k_m.gguf")
    parser.add_argument("--qwen", type=Path, default=home / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--only", choices=["small", "gemma", "qwen"], help="make only one part")
    args = parser.parse_args()
    if args.only in (None, "small"):
        golden_small(args.out)
    for part, path, make in [("gemma", args.gemma, golden_gemma), ("qwen", args.qwen, golden_qwen)]:
        if args.only in (None, part):
            if not path.is_file():
                sys.exit(f"{path} is not there (pass --{part}, or --only small)")
            make(path, args.out)


if __name__ == "__main__":
    main()
