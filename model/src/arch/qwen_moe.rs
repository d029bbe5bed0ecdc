//! Qwen2-MoE and Qwen3-MoE: the Qwen2 and Qwen3 blocks with a mixture of
//! experts in the MLP slot of their sparse layers ([`super::moe`]).
//! Qwen2-MoE adds a shared expert behind a sigmoid gate and does not
//! renormalise the chosen experts' weights; Qwen3-MoE has no shared expert
//! and renormalises.

use super::moe::{self, HfKeys};
use super::qwen2::qwen_layer_types;
use super::qwen3::{qwen3_gguf, qwen3_hf};
use super::{llama::every_layer_window, Activation, Family};

/// How both Qwen mixtures state their experts; Qwen2-MoE adds its gated
/// shared expert and does not renormalise.
const fn qwen_keys(shared_ff: Option<&'static str>, norm_default: bool) -> HfKeys {
    HfKeys {
        experts: &["num_experts", "num_local_experts"],
        expert_ff: Some("moe_intermediate_size"),
        shared_ff,
        norm_default,
        shared_count: None,
        first_dense: None,
        sigmoid: false,
    }
}

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
            &qwen_keys(Some("shared_expert_intermediate_size"), false),
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
    hf_fused_experts: false,
    latent_attention: false,
};

pub(crate) const QWEN3_MOE: Family = Family {
    name: "qwen3_moe",
    hf_types: &[("qwen3_moe", "Qwen3MoeForCausalLM")],
    gguf_arch: "qwen3moe",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        qwen3_hf(hf, cfg)?;
        moe::from_hf(hf, cfg, &qwen_keys(None, true))
    },
    gguf: |g, cfg| {
        qwen3_gguf(g, cfg)?;
        moe::from_gguf(g, cfg, true)
    },
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};
