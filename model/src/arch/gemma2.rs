//! Gemma 2: GeGLU with tanh GELU, RMSNorm as `x * (1 + w)` (the GGUF files
//! store `1 + w`), norms before and after attention and the MLP,
//! embeddings times `sqrt(hidden)`, attention scaled by
//! `query_pre_attn_scalar^-0.5`, sliding-window and global layers
//! alternating, soft-capped final logits. Its attention logit soft-capping
//! is not implemented in the paged attention kernels yet: a config that
//! asks for it (every released Gemma 2) is refused at load, never run
//! without it.

use super::{Activation, Family, LayerType, Part};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;

pub(crate) const FAMILY: Family = Family {
    name: "gemma2",
    hf_types: &[("gemma2", "Gemma2ForCausalLM")],
    gguf_arch: "gemma2",
    gguf_qk_permuted: false,
    hf_norm_offset: 1.0,
    fused: false,
    hf: |hf, cfg| {
        gemma_block(hf, cfg)?;
        if let Some(cap) = hf.opt_f32("attn_logit_softcapping")? {
            return Err(hf.invalid(
                "attn_logit_softcapping",
                cap.to_string(),
                "attention logit soft-capping is not implemented".into(),
            ));
        }
        if cfg.layer_types.is_empty() {
            cfg.layer_types = window_pattern(cfg.n_layers, 2);
        }
        Ok(())
    },
    gguf: |g, cfg| {
        if let Some(cap) = g.opt_f32("gemma2.attn_logit_softcapping")? {
            return Err(ModelError::InvalidField {
                path: g.path().to_owned(),
                field: "gemma2.attn_logit_softcapping".into(),
                value: cap.to_string(),
                reason: "attention logit soft-capping is not implemented".into(),
            });
        }
        gemma_gguf_scale(g, cfg)?;
        cfg.block.final_softcap = g.opt_f32("gemma2.final_logit_softcapping")?;
        if cfg.sliding_window.is_some() {
            cfg.layer_types = super::gguf_window_pattern(g, "gemma2", cfg.n_layers)?
                .unwrap_or_else(|| window_pattern(cfg.n_layers, 2));
        }
        Ok(())
    },
    hf_name: gemma_hf_name,
};

/// Layer `i` is global when `(i + 1) % pattern == 0`, else sliding.
pub(crate) fn window_pattern(n_layers: usize, pattern: usize) -> Vec<LayerType> {
    (0..n_layers)
        .map(|i| {
            if pattern > 0 && (i + 1) % pattern == 0 {
                LayerType::Full
            } else {
                LayerType::Sliding
            }
        })
        .collect()
}

/// The switches Gemma 2 and 3 share, from a `config.json`.
pub(crate) fn gemma_block(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    hf.require_activation(Activation::GeluTanh)?;
    hf.refuse_true("attention_bias", "an attention bias")?;
    cfg.block.activation = Activation::GeluTanh;
    cfg.block.sandwich_norms = true;
    cfg.block.embed_scale = Some(embed_scale(cfg.hidden_size));
    let scalar = hf
        .opt_f32("query_pre_attn_scalar")?
        .map_or(cfg.head_dim as f64, f64::from);
    cfg.block.attn_scale = scalar.powf(-0.5) as f32;
    cfg.block.final_softcap = hf.opt_f32("final_logit_softcapping")?;
    Ok(())
}

/// The same from GGUF, where the attention scale is usually not stored:
/// `{arch}.attention.scale` when the file has it, else what llama.cpp
/// uses, `hidden / heads` for the 27B models (whose
/// `query_pre_attn_scalar` is that) and the head size for the others.
pub(crate) fn gemma_gguf_scale(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    cfg.block.activation = Activation::GeluTanh;
    cfg.block.sandwich_norms = true;
    cfg.block.embed_scale = Some(embed_scale(cfg.hidden_size));
    let is_27b = matches!((cfg.n_layers, cfg.hidden_size), (46, 4608) | (62, 5376));
    let scalar = if is_27b {
        (cfg.hidden_size / cfg.n_heads.max(1)) as f64
    } else {
        cfg.head_dim as f64
    };
    cfg.block.attn_scale = match g.opt_f32(&format!("{}.attention.scale", cfg.architecture))? {
        Some(scale) => scale,
        None => scalar.powf(-0.5) as f32,
    };
    Ok(())
}

/// `sqrt(hidden)`, computed in double and rounded to f32 as transformers'
/// `torch.tensor(hidden_size**0.5)` does.
fn embed_scale(hidden: usize) -> f32 {
    (hidden as f64).sqrt() as f32
}

/// Gemma's Hugging Face names: its `post_attention_layernorm` is the norm
/// after attention, and the MLP's input norm is `pre_feedforward_layernorm`.
pub(crate) fn gemma_hf_name(part: Part) -> Option<&'static str> {
    match part {
        Part::MlpNorm => Some("pre_feedforward_layernorm.weight"),
        Part::PostAttnNorm => Some("post_attention_layernorm.weight"),
        Part::PostMlpNorm => Some("post_feedforward_layernorm.weight"),
        _ => None,
    }
}
