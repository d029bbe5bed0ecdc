//! Qwen3: the Llama block with an RMSNorm over each head of q and k (after
//! the projection, before rope); no biases; `head_dim` given explicitly.

use super::qwen2::qwen_layer_types;
use super::{llama::every_layer_window, Activation, Family};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;

pub(crate) const FAMILY: Family = Family {
    name: "qwen3",
    hf_types: &[("qwen3", "Qwen3ForCausalLM")],
    gguf_arch: "qwen3",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: qwen3_hf,
    gguf: qwen3_gguf,
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

/// The Qwen3 block from `config.json` (Qwen3-MoE's too).
pub(crate) fn qwen3_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    hf.require_activation(Activation::Silu)?;
    // Qwen3's `attention_bias` biases o_proj too.
    hf.refuse_true("attention_bias", "an output-projection bias")?;
    cfg.block.qk_norm = true;
    qwen_layer_types(hf, cfg)
}

/// The Qwen3 block from GGUF metadata (Qwen3-MoE's too).
pub(crate) fn qwen3_gguf(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    cfg.block.qk_norm = true;
    every_layer_window(g, cfg)
}
