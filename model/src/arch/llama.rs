//! Llama (2, 3.x), Mistral and Mixtral: the base block ([`Block::llama`]);
//! Mistral attends a sliding window on every layer when its config gives
//! one; Mixtral is Mistral with experts ([`super::moe`]).

use super::{Activation, Family, LayerType, Part};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;

/// Llama 2 and 3.x.
pub(crate) const LLAMA: Family = Family {
    name: "llama",
    hf_types: &[("llama", "LlamaForCausalLM")],
    gguf_arch: "llama",
    gguf_qk_permuted: true,
    hf_norm_offset: 0.0,
    fused: false,
    hf: llama_hf,
    gguf: llama_gguf,
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

/// Mistral (GGUF files of Mistral models say `llama`).
pub(crate) const MISTRAL: Family = Family {
    name: "mistral",
    hf_types: &[("mistral", "MistralForCausalLM")],
    gguf_arch: "mistral",
    gguf_qk_permuted: true,
    hf_norm_offset: 0.0,
    fused: false,
    hf: mistral_hf,
    gguf: every_layer_window,
    hf_name: |_| None,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

/// SiLU, no MLP bias, no attention bias (Llama's `attention_bias` also
/// biases o_proj, which the block has no slot for).
pub(crate) fn plain_llama_block(hf: &HfConfig<'_>) -> Result<()> {
    hf.require_activation(Activation::Silu)?;
    hf.refuse_true("mlp_bias", "an MLP bias")?;
    hf.refuse_true("attention_bias", "an output-projection bias")
}

fn llama_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    plain_llama_block(hf)?;
    // Llama has no sliding window, whatever else the file carries.
    cfg.layer_types = vec![LayerType::Full; cfg.n_layers];
    Ok(())
}

fn mistral_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    plain_llama_block(hf)?;
    if cfg.layer_types.is_empty() && cfg.sliding_window.is_some() {
        cfg.layer_types = vec![LayerType::Sliding; cfg.n_layers];
    }
    Ok(())
}

/// GGUF: `{arch}.attention.sliding_window`, when present, applies to the
/// layers `{arch}.attention.sliding_window_pattern` names, or to every
/// layer.
pub(crate) fn every_layer_window(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    if cfg.sliding_window.is_some() {
        cfg.layer_types = super::gguf_window_pattern(g, &cfg.architecture, cfg.n_layers)?
            .unwrap_or_else(|| vec![LayerType::Sliding; cfg.n_layers]);
    }
    Ok(())
}

/// Mixtral: the Mistral block with a mixture of experts in every layer's
/// MLP slot (top-k renormalised). Its GGUF files say `llama`: the Llama
/// family reads their `llama.expert_*` keys.
pub(crate) const MIXTRAL: Family = Family {
    name: "mixtral",
    hf_types: &[("mixtral", "MixtralForCausalLM")],
    gguf_arch: "llama",
    gguf_qk_permuted: true,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| {
        mistral_hf(hf, cfg)?;
        super::moe::from_hf(
            hf,
            cfg,
            &super::moe::HfKeys {
                experts: &["num_local_experts"],
                expert_ff: None,
                shared_ff: None,
                norm_default: true,
                shared_count: None,
                first_dense: None,
                sigmoid: false,
            },
        )
    },
    gguf: llama_gguf,
    hf_name: |part| match part {
        Part::Router => Some("block_sparse_moe.gate.weight"),
        Part::ExpertGate => Some("block_sparse_moe.experts.{j}.w1.weight"),
        Part::ExpertUp => Some("block_sparse_moe.experts.{j}.w3.weight"),
        Part::ExpertDown => Some("block_sparse_moe.experts.{j}.w2.weight"),
        _ => None,
    },
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

/// GGUF `llama` (Llama, Mistral, and Mixtral's experts, renormalised as
/// llama.cpp does for the architecture).
fn llama_gguf(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    every_layer_window(g, cfg)?;
    super::moe::from_gguf(g, cfg, true)
}
