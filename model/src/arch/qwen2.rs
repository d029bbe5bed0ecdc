//! Qwen2 / Qwen2.5: the Llama block with biases on q, k and v; sliding
//! windows (rare) from layer `max_window_layers` on.

use super::llama::every_layer_window;
use super::{Activation, Family, LayerType};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;

pub(crate) const FAMILY: Family = Family {
    name: "qwen2",
    hf_types: &[("qwen2", "Qwen2ForCausalLM")],
    gguf_arch: "qwen2",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        hf.require_activation(Activation::Silu)?;
        cfg.attention_bias = true;
        qwen_layer_types(hf, cfg)
    },
    gguf: |g, cfg| {
        cfg.attention_bias = true;
        every_layer_window(g, cfg)
    },
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

/// Without `layer_types`: a window only when `use_sliding_window`, and
/// then on the layers from `max_window_layers` on (transformers' rule).
pub(crate) fn qwen_layer_types(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    if !cfg.layer_types.is_empty() {
        return Ok(());
    }
    let windowed = hf.opt_bool("use_sliding_window")? == Some(true) && cfg.sliding_window.is_some();
    let from = hf.opt_usize("max_window_layers")?.unwrap_or(0);
    cfg.layer_types = (0..cfg.n_layers)
        .map(|i| {
            if windowed && i >= from {
                LayerType::Sliding
            } else {
                LayerType::Full
            }
        })
        .collect();
    Ok(())
}
