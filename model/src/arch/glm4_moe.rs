//! GLM-4.5 (`glm4_moe`): q/k/v biases, an optional RMSNorm per head on q
//! and k, rope on the leading `partial_rotary_factor` of each head (half),
//! and from layer `first_k_dense_replace` on a mixture of experts scored by
//! sigmoid with a correction bias, chosen within groups, scaled by
//! `routed_scaling_factor`, beside `n_shared_experts` ungated shared
//! experts ([`super::moe`]). Its GGUF files (`glm4moe`) name the pre-MLP
//! norm `post_attention_norm` and append the multi-token-prediction layers
//! (`nextn_predict_layers`) after the decoder's, which generation skips.

use super::moe::{self, HfKeys};
use super::{Activation, Family, Part};

pub(crate) const FAMILY: Family = Family {
    name: "glm4_moe",
    hf_types: &[("glm4_moe", "Glm4MoeForCausalLM")],
    gguf_arch: "glm4moe",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        hf.require_activation(Activation::Silu)?;
        // GLM's `attention_bias` biases q, k and v only.
        cfg.attention_bias = hf.opt_bool("attention_bias")?.unwrap_or(false);
        cfg.block.qk_norm = hf.opt_bool("use_qk_norm")?.unwrap_or(false);
        moe::from_hf(
            hf,
            cfg,
            &HfKeys {
                experts: &["n_routed_experts"],
                expert_ff: Some("moe_intermediate_size"),
                shared_ff: None,
                norm_default: true,
                shared_count: Some("n_shared_experts"),
                first_dense: Some("first_k_dense_replace"),
                sigmoid: true,
            },
        )
    },
    gguf: |g, cfg| {
        cfg.attention_bias = g.has_tensor("blk.0.attn_q.bias");
        cfg.block.qk_norm = g.has_tensor("blk.0.attn_q_norm.weight");
        moe::from_gguf(g, cfg, true)
    },
    hf_name: |part| match part {
        Part::SharedGate => Some("mlp.shared_experts.gate_proj.weight"),
        Part::SharedUp => Some("mlp.shared_experts.up_proj.weight"),
        Part::SharedDown => Some("mlp.shared_experts.down_proj.weight"),
        _ => None,
    },
    gguf_name: |part| match part {
        Part::MlpNorm => Some("post_attention_norm.weight"),
        _ => None,
    },
    partial_rotary: true,
    hf_fused_experts: false,
    latent_attention: false,
};
