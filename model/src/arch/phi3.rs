//! Phi-3: the Llama block with q/k/v fused into one tensor and gate/up
//! into another (split at load: the forward pass stacks them anyway); a
//! sliding window on every layer when the config gives one.

use super::llama::{every_layer_window, plain_llama_block};
use super::{Family, LayerType, Part};

pub(crate) const FAMILY: Family = Family {
    name: "phi3",
    hf_types: &[("phi3", "Phi3ForCausalLM")],
    gguf_arch: "phi3",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: true,
    hf: |hf, cfg| {
        // (A partial rotary factor is refused for every family where the
        // rope is read.)
        plain_llama_block(hf)?;
        if cfg.layer_types.is_empty() && cfg.sliding_window.is_some() {
            cfg.layer_types = vec![LayerType::Sliding; cfg.n_layers];
        }
        Ok(())
    },
    gguf: |g, cfg| {
        if g.has_tensor("rope_factors_long.weight") {
            return Err(crate::error::ModelError::UnsupportedArchitecture {
                path: g.path().to_owned(),
                architecture: "phi3 with LongRoPE factors (the 128k variants)".into(),
            });
        }
        every_layer_window(g, cfg)
    },
    hf_name: |part| match part {
        Part::Qkv => Some("self_attn.qkv_proj.weight"),
        Part::GateUp => Some("mlp.gate_up_proj.weight"),
        _ => None,
    },
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};
