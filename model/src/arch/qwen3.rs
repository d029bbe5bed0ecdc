//! Qwen3: the Llama block with an RMSNorm over each head of q and k (after
//! the projection, before rope); no biases; `head_dim` given explicitly.

use super::qwen2::qwen_layer_types;
use super::{llama::every_layer_window, Activation, Family};

pub(crate) const FAMILY: Family = Family {
    name: "qwen3",
    hf_types: &[("qwen3", "Qwen3ForCausalLM")],
    gguf_arch: "qwen3",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        hf.require_activation(Activation::Silu)?;
        // Qwen3's `attention_bias` biases o_proj too.
        hf.refuse_true("attention_bias", "an output-projection bias")?;
        cfg.block.qk_norm = true;
        qwen_layer_types(hf, cfg)
    },
    gguf: |g, cfg| {
        cfg.block.qk_norm = true;
        every_layer_window(g, cfg)
    },
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
};
