"""The tiny family models (make_families.py) written as GGUF files by the
`gguf` package, the way llama.cpp's converter lays them out: its tensor
names, its metadata keys under the architecture's prefix, q/k rows permuted
for interleaved rope (the `llama` architecture only: Mistral checkpoints
convert to it), Gemma's norms stored as `1 + w`, Phi-3's fused q/k/v and
gate/up kept fused, a tied embedding without `output.weight`, the tiny
Llama's byte-level BPE vocabulary (`tokenizer.ggml.pre` = smollm).

Written per family: F32 (the same weights as the safetensors: greedy must
equal transformers' golden data) and Q8_0 (llama-yarn: F32 only); for qwen3
also F16, BF16, Q4_0, Q4_1, Q5_0 and Q5_1. Rope scaling is written as the
converter writes it (YaRN: `rope.scaling.type`, `.factor`,
`.original_context_length`, and the `yarn_*` keys the config has), Gemma 2's
caps as `attn_logit_softcapping` and `final_logit_softcapping`, without a
window pattern (llama.cpp fixes Gemma 2's at every other layer). (The tiny models are 64 wide: K-quants need 256-wide
rows, so they are tested on the real Gemma 3 GGUF and in the kernels.)
Matrices are quantized, vectors stay F32, as llama.cpp does. Mixtures of
experts (mixtral as the `llama` architecture, `qwen2moe`, `qwen3moe`,
`glm4moe`, `gpt-oss`) get llama.cpp's `expert_*` keys and their experts
stacked into one `ffn_{gate,up,down}_exps` tensor per role (gpt-oss's fused
gate/up split into two, with `.bias` stacks that stay F32 as llama.cpp
quantizes `.weight` tensors only); the router stays F32. Their
quantized files get golden data of their own (`tiny-<family>-<type>.json`,
transformers on the dequantized weights): routing follows the weights.

DeepSeek V2 and V3 (`deepseek2`) get llama.cpp's latent-attention keys
(`attention.q_lora_rank`, `.kv_lora_rank`, `rope.dimension_count` the rope
part, `rope.scaling.yarn_log_multiplier` = 0.1 `mscale_all_dim`) and
routing keys (`expert_shared_count`, `leading_dense_block_count`,
`expert_weights_scale`, `expert_weights_norm` where true,
`expert_gating_func` 1 or 2, `expert_group_count`/`_used_count`). V3 is
written as llama.cpp's current converter does (`kv_b_proj` split per head
into `attn_k_b`, key rows transposed, and `attn_v_b`; `key_length_mla`,
`value_length_mla`, one KV head), V2 as the older one did (one
`attn_kv_b`, per-head key and value lengths): both loader paths run. A
tensor whose rows do not split into the type's blocks (`attn_k_b`, 16
wide) falls back to F16 as the converter does.

gpt-oss is also written as its MXFP4 release converts (`MXFP4`: the
expert stacks in MXFP4, gguf-py's quantizer; every other matrix in BF16),
with golden data on those weights, and again with each layer's expert gate
and up fused into one `ffn_gate_up_exps` stack (`MXFP4-fused`: the layout
llama.cpp's converter writes for Qwen3-Next, Qwen3.5 MoE, Gemma 4 and
others; it must load equal to the unfused file).

Outputs (committed): model/tests/data/gguf/tiny-<family>-<type>.gguf, and
tiny-qwen3-IQ4_NL.gguf: Q8_0 with one tensor in IQ4_NL, a type kvmesh does
not run (the loader must refuse it, naming the tensor and the type).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import safetensors.numpy

import gguf
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_golden as mg  # noqa: E402

DATA = mg.REPO_ROOT / "model" / "tests" / "data"
TYPES = {
    "F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0,
    "Q5_1": Q.Q5_1, "MXFP4": Q.MXFP4,
}
PER_FAMILY = {
    "qwen2": ["F32", "Q8_0"],
    "qwen3": ["F32", "Q8_0", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1"],
    "gemma3": ["F32", "Q8_0"],
    "phi3": ["F32", "Q8_0"],
    "mistral": ["F32", "Q8_0"],
    "gemma2": ["F32", "Q8_0"],
    "llama-yarn": ["F32"],
    "mixtral": ["F32", "Q8_0", "Q4_0"],
    "qwen2_moe": ["F32", "Q8_0", "Q4_0"],
    "qwen3_moe": ["F32", "Q8_0", "Q4_0"],
    "glm4_moe": ["F32", "Q8_0", "Q4_0"],
    "gpt_oss": ["F32", "Q8_0", "MXFP4"],
    "deepseek_v2": ["F32", "Q8_0", "Q4_0"],
    "deepseek_v3": ["F32", "Q8_0", "Q4_0"],
}
# Quantized files whose golden data transformers computes on the file's own
# dequantized weights (`tiny-<family>-<type>.json`): a mixture's routing
# follows the weights, so the f32 reference cannot stand in for them.
DEQUANTIZED_GOLDEN = [
    (f, t)
    for f in ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v2", "deepseek_v3")
    for t in ("Q8_0", "Q4_0")
] + [
    ("gpt_oss", "Q8_0"),
    ("gpt_oss", "MXFP4"),
]
# family -> GGUF architecture
ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mistral": "llama",
    "gemma2": "gemma2",
    "llama-yarn": "llama",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "glm4_moe": "glm4moe",
    "gpt_oss": "gpt-oss",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# Latent attention's key/value maps as llama.cpp's current converter writes
# them: `kv_b_proj` split per head into `attn_k_b` (the key rows,
# transposed) and `attn_v_b`, with the `_mla` head-size keys. The other
# DeepSeek family is written as the older converter did (one `attn_kv_b`,
# the per-head sizes under the plain keys), so both loader paths run.
SPLIT_KV_B = ("deepseek_v3",)
# An expert's Hugging Face projection -> its GGUF stacked tensor (llama.cpp
# stores one [experts, rows, cols] tensor per role).
EXPERT_NAMES = {
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
GEMMA = ("gemma2", "gemma3")

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.router": "ffn_gate_inp",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}


def layer_name(family, rest):
    """HF `self_attn.q_proj.weight` -> GGUF `attn_q.weight` for this family."""
    base, _, kind = rest.rpartition(".")
    if rest == "mlp.gate.e_score_correction_bias":
        return "exp_probs_b.bias"
    if rest == "self_attn.sinks":
        # The converter appends `.weight` to gpt-oss's suffix-less sinks.
        return "attn_sinks.weight"
    if base == "post_attention_layernorm":
        # llama.cpp's GLM-4.5 names its pre-MLP norm this way too.
        base_out = "post_attention_norm" if family in GEMMA + ("glm4_moe", "gpt_oss") else "ffn_norm"
    elif base == "pre_feedforward_layernorm":
        base_out = "ffn_norm"
    elif base == "post_feedforward_layernorm":
        base_out = "post_ffw_norm"
    else:
        base_out = LAYER_NAMES[base]
    return f"{base_out}.{kind}"


def permute(w, n_head):
    """llama.cpp's q/k permutation for interleaved rope (rows, or a bias)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def tokenizer_metadata(w, src):
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    for i, t in specials.items():
        tokens[i] = t
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    w.add_chat_template(cfg["chat_template"])
    return len(tokens)


def convert(family, type_name, odd_tensor=None, fuse_gate_up=False):
    src = DATA / f"tiny-{family}"
    cfg = json.loads((src / "config.json").read_text())
    arch = ARCH[family]
    suffix = "IQ4_NL" if odd_tensor else type_name + ("-fused" if fuse_gate_up else "")
    out = DATA / "gguf" / f"tiny-{family}-{suffix}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{family}")
    n_layers, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["head_dim"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    # GLM-4.5 files carry a multi-token-prediction block after the
    # decoder's (`nextn_predict_layers`), which generation must skip: the
    # tiny model's is a copy of its last layer scaled by 3.
    nextn = 1 if family == "glm4_moe" else 0
    w.add_block_count(n_layers + nextn)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    if family in DEEPSEEK:
        deepseek_attention_metadata(w, cfg, split=family in SPLIT_KV_B)
    else:
        w.add_head_count_kv(n_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        rope_params = cfg.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(head_dim * rope_params.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    theta = (rope.get("full_attention") or rope).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    layer_types = cfg.get("layer_types")
    if cfg.get("sliding_window") and (family != "qwen2" or cfg.get("use_sliding_window")):
        w.add_sliding_window(cfg["sliding_window"])
        # llama.cpp fixes Gemma 2's and gpt-oss's patterns (every other
        # layer) and its converter writes none for them.
        if layer_types and len(set(layer_types)) > 1 and family not in ("gemma2", "gpt_oss"):
            w.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])
    if rope.get("rope_type") == "yarn":
        # As llama.cpp's converter: the optional keys only where the config
        # has them.
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if family in DEEPSEEK and rope.get("mscale_all_dim"):
            # The converter's deepseek2 convention (llama.cpp divides it
            # back by 0.1 on loading).
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if family == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
        w.add_float32("gemma2.attention.scale", float(np.float32(cfg["query_pre_attn_scalar"] ** -0.5)))
    if family == "gemma3":
        local = (rope.get("sliding_attention") or {}).get("rope_theta")
        assert local is not None
        w.add_float32("gemma3.rope.freq_base_swa", local)
        # llama.cpp derives the scale from the model size; the tiny model's
        # query_pre_attn_scalar is not its head size, so it is written.
        w.add_float32("gemma3.attention.scale", float(np.float32(cfg["query_pre_attn_scalar"] ** -0.5)))
    if "num_local_experts" in cfg or "num_experts" in cfg or "n_routed_experts" in cfg:
        w.add_expert_count(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if family == "glm4_moe":
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
            w.add_nextn_predict_layers(nextn)
        if family in DEEPSEEK:
            # As the converter writes a real DeepSeek config: the weights'
            # norm only where true, the gating from `scoring_func` (V2's
            # softmax, V3's sigmoid), the groups from n_group/topk_group.
            w.add_expert_shared_count(cfg["n_shared_experts"])
            w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
            if cfg["norm_topk_prob"]:
                w.add_expert_weights_norm(True)
            w.add_expert_gating_func(
                gguf.ExpertGatingFuncType.SIGMOID if family == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX
            )
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
        if family == "gpt_oss":
            # The converter's key (the experts' width is intermediate_size);
            # llama.cpp fixes the gating (softmax over the chosen) and the
            # SwiGLU's alpha and limit (1.702, 7): the limit here is the
            # tiny model's, in keys kvmesh reads where a file has them.
            w.add_expert_feed_forward_length(cfg["intermediate_size"])
            w.add_float32("gpt-oss.swiglu_alpha", cfg["swiglu_alpha"])
            w.add_float32("gpt-oss.swiglu_limit", cfg["swiglu_limit"])
    vocab = tokenizer_metadata(w, src)
    w.add_vocab_size(vocab)

    qtype = TYPES[type_name]
    tensors = stack_experts(split_fused_experts(safetensors.numpy.load_file(str(src / "model.safetensors"))))
    if family in SPLIT_KV_B:
        tensors = split_kv_b(tensors, cfg)
    if fuse_gate_up:
        tensors = fuse_gate_up_stacks(tensors)
    if nextn:
        last = f"model.layers.{n_layers - 1}."
        for name in [n for n in tensors if n.startswith(last)]:
            tensors[f"model.layers.{n_layers}." + name[len(last):]] = tensors[name] * 3.0
    for name in sorted(tensors):
        t = tensors[name].astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            prefix = "model.layers."
            assert name.startswith(prefix), name
            i, rest = name[len(prefix):].split(".", 1)
            gname = f"blk.{i}.{rest}" if rest.startswith(("ffn_", "attn_k_b", "attn_v_b")) else f"blk.{i}.{layer_name(family, rest)}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                t = permute(t, n_head)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                t = permute(t, n_kv)
        if family in GEMMA and name.endswith("norm.weight"):
            t = t + 1.0
        if gname == odd_tensor:
            # A type kvmesh does not run (IQ4_NL: 18 bytes per 32 values),
            # with arbitrary block bytes: loading must refuse it by name.
            rows, cols = t.shape
            raw = np.random.default_rng(7).integers(0, 256, size=(rows, cols // 32 * 18), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=Q.IQ4_NL)
        elif t.ndim >= 2 and qtype != Q.F32 and not quantize_kept_f32(gname):
            data, ttype = quantize(t, tensor_type(gname, qtype))
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=ttype)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mg.log(f"wrote {out.relative_to(mg.REPO_ROOT)} ({out.stat().st_size} bytes)")


def deepseek_attention_metadata(w, cfg, split):
    """Latent attention's keys as llama.cpp's converter writes them: the
    current one (`split`) gives the cache entry's sizes under the plain
    key/value lengths, the per-head ones under the `_mla` keys, and one KV
    head; the older one the per-head sizes under the plain keys and
    num_key_value_heads (equal to the head count)."""
    rank, nope, rope, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split:
        w.add_head_count_kv(1)
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_rope_dimension_count(rope)


def split_kv_b(tensors, cfg):
    """Each layer's `kv_b_proj` [n_heads * (nope + v), rank] as llama.cpp's
    current converter splits it: per head, the key rows transposed into
    `attn_k_b` [n_heads, rank, nope] and the value rows into `attn_v_b`
    [n_heads, v, rank], under their GGUF names after `model.layers.{i}.`."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {}
    for name, t in tensors.items():
        if not name.endswith("self_attn.kv_b_proj.weight"):
            out[name] = t
            continue
        layer = name[: -len("self_attn.kv_b_proj.weight")]
        kv_b = t.reshape(heads, nope + v, t.shape[-1])
        out[f"{layer}attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
        out[f"{layer}attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:, :])
    return out


def quantize(t, ttype):
    """`(blocks, type)`: `t` in `ttype`, or in F16 where its rows do not
    split into whole blocks (DeepSeek's `attn_k_b`, rows of qk_nope = 16
    values), as llama.cpp's converter falls back."""
    try:
        return gguf.quants.quantize(t, ttype), ttype
    except gguf.QuantError:
        return gguf.quants.quantize(t, Q.F16), Q.F16


def split_fused_experts(tensors):
    """gpt-oss's fused experts as llama.cpp's converter splits them:
    `gate_up_proj` [experts, hidden, 2 ff] (gate and up in alternating
    columns) into gate and up `[experts, ff, hidden]`, `down_proj`
    [experts, ff, hidden] transposed, the biases split the same way; under
    their GGUF names after `model.layers.{i}.`."""
    out = {}
    for name, t in tensors.items():
        layer, _, rest = name.partition(".mlp.experts.")
        if not rest:
            out[name] = t
        elif rest == "gate_up_proj":
            out[f"{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(t[:, :, ::2].transpose(0, 2, 1))
            out[f"{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(t[:, :, 1::2].transpose(0, 2, 1))
        elif rest == "gate_up_proj_bias":
            out[f"{layer}.ffn_gate_exps.bias"] = np.ascontiguousarray(t[:, ::2])
            out[f"{layer}.ffn_up_exps.bias"] = np.ascontiguousarray(t[:, 1::2])
        elif rest == "down_proj":
            out[f"{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(t.transpose(0, 2, 1))
        elif rest == "down_proj_bias":
            out[f"{layer}.ffn_down_exps.bias"] = t
        else:
            out[name] = t
    return out


def stack_experts(tensors):
    """Each layer's per-expert projections (`...experts.{j}.w1.weight`)
    stacked into llama.cpp's one tensor per role, `[experts, rows, cols]`,
    under its GGUF name after `model.layers.{i}.`."""
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            layer, j, proj = parts[2], int(parts[at + 1]), parts[at + 2]
            experts.setdefault((layer, EXPERT_NAMES[proj]), {})[j] = t
        else:
            out[name] = t
    for (layer, gname), by_j in experts.items():
        assert sorted(by_j) == list(range(len(by_j))), (layer, gname)
        out[f"model.layers.{layer}.{gname}.weight"] = np.stack([by_j[j] for j in range(len(by_j))])
    return out


def tensor_type(gname, qtype):
    """A quantized matrix's type: MXFP4 files hold the experts in MXFP4 and
    every other matrix in BF16, as llama.cpp's converter writes gpt-oss's
    MXFP4 release (its experts' blocks repacked, the rest in the default
    output type, bf16 for a bf16 checkpoint); other types are whole-file."""
    if qtype != Q.MXFP4:
        return qtype
    return Q.MXFP4 if "_exps." in gname else Q.BF16


def fuse_gate_up_stacks(tensors):
    """Each layer's `ffn_gate_exps` and `ffn_up_exps` (and their `.bias`
    stacks) as one `ffn_gate_up_exps` stack, expert j's gate rows then its
    up rows (`[experts, 2 ff, hidden]`, llama.cpp's fused layout, whose
    graph takes an expert's first ff outputs as the gate): a variant file
    that must load equal to the unfused one."""
    out = dict(tensors)
    for name in [n for n in tensors if ".ffn_gate_exps." in n]:
        up = name.replace(".ffn_gate_exps.", ".ffn_up_exps.")
        fused = np.concatenate([out.pop(name), out.pop(up)], axis=1)
        out[name.replace(".ffn_gate_exps.", ".ffn_gate_up_exps.")] = np.ascontiguousarray(fused)
    return out


def quantize_kept_f32(gname):
    """llama.cpp's quantizer keeps the expert router (`ffn_gate_inp`) in
    f32, and the shared expert's one-row gate is a vector to it; it
    quantizes only `.weight` tensors (gpt-oss's `[experts, ff]` bias
    stacks stay f32)."""
    return ".ffn_gate_inp" in gname or not gname.endswith(".weight")


def dequantized_golden(family, type_name):
    """transformers on the quantized file's own weights: every tensor the
    converter quantizes, quantized and dequantized by gguf-py, saved as a
    safetensors model beside the f32 one's config and tokenizer, loaded
    back, and run through the golden computation."""
    import shutil
    import tempfile

    import make_families as mf
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    src = DATA / f"tiny-{family}"
    qtype = TYPES[type_name]
    tensors = safetensors.numpy.load_file(str(src / "model.safetensors"))

    def rounded(t, expert=False):
        q, ttype = quantize(t.astype(np.float32), tensor_type("_exps." if expert else "", qtype))
        return gguf.quants.dequantize(q, ttype).reshape(t.shape).astype(np.float32)

    cfg = json.loads((src / "config.json").read_text())

    out = {}
    for name, t in tensors.items():
        router = name.endswith(
            ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")
        )
        if name.endswith("mlp.experts.gate_up_proj"):
            # gpt-oss: quantized as the GGUF holds it, gate and up apart,
            # each row a `hidden` vector (the fused tensor's columns).
            t = t.astype(np.float32).copy()
            for k in (0, 1):
                part = np.ascontiguousarray(t[:, :, k::2].transpose(0, 2, 1))
                t[:, :, k::2] = rounded(part, expert=True).transpose(0, 2, 1)
        elif name.endswith("mlp.experts.down_proj"):
            t = rounded(np.ascontiguousarray(t.transpose(0, 2, 1)), expert=True).transpose(0, 2, 1)
        elif name.endswith("self_attn.kv_b_proj.weight") and family in SPLIT_KV_B:
            # Rounded as the file holds it: the key rows transposed per
            # head, the value rows as they are.
            parts = split_kv_b({"self_attn.kv_b_proj.weight": t}, cfg)
            k = rounded(parts["attn_k_b.weight"]).transpose(0, 2, 1)
            v = rounded(parts["attn_v_b.weight"])
            t = np.concatenate([k, v], axis=1).reshape(t.shape)
        elif t.ndim >= 2 and not router and not name.endswith("_bias"):
            t = rounded(t)
        out[name] = np.ascontiguousarray(t)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for p in src.iterdir():
            if p.name != "model.safetensors":
                shutil.copy(p, tmp / p.name)
        safetensors.numpy.save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32, attn_implementation=mg.ATTN_IMPL).eval()
        tok = PreTrainedTokenizerFast.from_pretrained(str(tmp))
        name = f"tiny-{family}-{type_name}"
        source = (
            f"Generated by scripts/golden/make_family_ggufs.py: model/tests/data/tiny-{family} with every tensor "
            f"the converter quantizes quantized to {type_name}"
            + (" (the experts; the other matrices BF16)" if qtype == Q.MXFP4 else "")
            + " and dequantized by gguf-py, run by transformers "
            f"{mf.transformers.__version__} {type(model).__name__}"
        )
        g = mg.build_golden(name, source, tok, model, mg.LONG_TEXT_TINY, smollm=False, extra={"family": family, "gguf_type": type_name})
    mg.write_json(DATA / "golden" / f"{name}.json", g)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(PER_FAMILY), action="append", help="these families only")
    args = ap.parse_args()
    for family in args.only or PER_FAMILY:
        for t in PER_FAMILY[family]:
            convert(family, t)
    if not args.only or "qwen3" in args.only:
        convert("qwen3", "Q8_0", odd_tensor="blk.1.attn_v.weight")
    if not args.only or "gpt_oss" in args.only:
        convert("gpt_oss", "MXFP4", fuse_gate_up=True)
    for family, t in DEQUANTIZED_GOLDEN:
        if not args.only or family in args.only:
            dequantized_golden(family, t)


if __name__ == "__main__":
    main()
