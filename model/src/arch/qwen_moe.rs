//! Qwen2-MoE and Qwen3-MoE: the Qwen2 and Qwen3 blocks with a mixture of
//! experts in the MLP slot of their sparse layers ([`super::moe`]).
//! Qwen2-MoE adds a shared expert behind a sigmoid gate and does not
//! renormalise the chosen experts' weights; Qwen3-MoE has no shared expert
//! and renormalises.

use super::moe::{self, HfKeys};
use super::qwen2::qwen_layer_types;
use super::{llama::every_layer_window, Activation, Family};

pub(crate) const QWEN2_MOE: Family = Family {
    name: "qwen2_moe",
    hf_types: &[("qwen2_moe", "Qwen2MoeForCausalLM")],
    gguf_arch: "qwen2moe",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        hf.require_activation(Activation::Silu)?;
        cfg.attention_bias = hf.opt_bool("qkv_bias")?.unwrap_or(true);
        qwen_layer_types(hf, cfg)?;
        moe::from_hf(
            hf,
            cfg,
            &HfKeys {
                experts: &["num_experts", "num_local_experts"],
                expert_ff: Some("moe_intermediate_size"),
                shared_ff: Some("shared_expert_intermediate_size"),
                norm_default: false,
                shared_count: None,
                first_dense: None,
                sigmoid: false,
            },
        )
    },
    gguf: |g, cfg| {
        cfg.attention_bias = true;
        every_layer_window(g, cfg)?;
        moe::from_gguf(g, cfg, false)
    },
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
};

pub(crate) const QWEN3_MOE: Family = Family {
    name: "qwen3_moe",
    hf_types: &[("qwen3_moe", "Qwen3MoeForCausalLM")],
    gguf_arch: "qwen3moe",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        hf.require_activation(Activation::Silu)?;
        hf.refuse_true("attention_bias", "an output-projection bias")?;
        cfg.block.qk_norm = true;
        qwen_layer_types(hf, cfg)?;
        moe::from_hf(
            hf,
            cfg,
            &HfKeys {
                experts: &["num_experts", "num_local_experts"],
                expert_ff: Some("moe_intermediate_size"),
                shared_ff: None,
                norm_default: true,
                shared_count: None,
                first_dense: None,
                sigmoid: false,
            },
        )
    },
    gguf: |g, cfg| {
        cfg.block.qk_norm = true;
        every_layer_window(g, cfg)?;
        moe::from_gguf(g, cfg, true)
    },
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
};
