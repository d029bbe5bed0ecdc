//! Gemma 2: GeGLU with tanh GELU, RMSNorm as `x * (1 + w)` (the GGUF files
//! store `1 + w`), norms before and after attention and the MLP,
//! embeddings times `sqrt(hidden)`, attention scaled by
//! `query_pre_attn_scalar^-0.5` and its scores soft-capped
//! (`attn_logit_softcapping`), sliding-window and global layers
//! alternating (layer 0 sliding), soft-capped final logits, one rope base.
//!
//! Where a file leaves a key out, the defaults of the reference that reads
//! that format apply: transformers' `Gemma2Config` for `config.json` (an
//! explicit `null` turns a cap off there), llama.cpp's for GGUF.

use super::{Activation, Family, LayerType, Part};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;

/// Attention logit cap, final logit cap and window when the file has none
/// (transformers' `Gemma2Config` and llama.cpp agree on these).
const DEFAULT_ATTN_SOFTCAP: f32 = 50.0;
const DEFAULT_FINAL_SOFTCAP: f32 = 30.0;
const DEFAULT_WINDOW: usize = 4096;

pub(crate) const FAMILY: Family = Family {
    name: "gemma2",
    hf_types: &[("gemma2", "Gemma2ForCausalLM")],
    gguf_arch: "gemma2",
    gguf_qk_permuted: false,
    hf_norm_offset: 1.0,
    fused: false,
    hf: |hf, cfg| {
        gemma_block(hf, cfg)?;
        cfg.block.attn_softcap =
            hf.opt_f32_or("attn_logit_softcapping", Some(DEFAULT_ATTN_SOFTCAP))?;
        cfg.block.final_softcap =
            hf.opt_f32_or("final_logit_softcapping", Some(DEFAULT_FINAL_SOFTCAP))?;
        if hf.get("sliding_window").is_none() {
            cfg.sliding_window = Some(DEFAULT_WINDOW);
        }
        if cfg.layer_types.is_empty() {
            cfg.layer_types = window_pattern(cfg.n_layers, 2);
        }
        Ok(())
    },
    gguf: |g, cfg| {
        gemma_gguf_scale(g, cfg)?;
        cfg.block.attn_softcap = Some(
            g.opt_f32("gemma2.attn_logit_softcapping")?
                .unwrap_or(DEFAULT_ATTN_SOFTCAP),
        );
        cfg.block.final_softcap = Some(
            g.opt_f32("gemma2.final_logit_softcapping")?
                .unwrap_or(DEFAULT_FINAL_SOFTCAP),
        );
        cfg.sliding_window.get_or_insert(DEFAULT_WINDOW);
        cfg.layer_types = super::gguf_window_pattern(g, "gemma2", cfg.n_layers)?
            .unwrap_or_else(|| window_pattern(cfg.n_layers, 2));
        Ok(())
    },
    hf_name: gemma_hf_name,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
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

/// `query_pre_attn_scalar` when a Gemma 2 or 3 `config.json` has none.
const DEFAULT_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
/// `head_dim` when a Gemma 2 or 3 `config.json` has none (transformers'
/// configs default it to 256 whatever the hidden size and head count; the
/// weights' shapes are checked against it at load).
const DEFAULT_HEAD_DIM: usize = 256;

/// The switches Gemma 2 and 3 share, from a `config.json`.
pub(crate) fn gemma_block(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    hf.require_activation(Activation::GeluTanh)?;
    hf.refuse_true("attention_bias", "an attention bias")?;
    hf.refuse_true(
        "use_bidirectional_attention",
        "bidirectional attention (embedding Gemma)",
    )?;
    if hf.opt_usize("head_dim")?.is_none() {
        cfg.head_dim = DEFAULT_HEAD_DIM;
    }
    cfg.block.activation = Activation::GeluTanh;
    cfg.block.sandwich_norms = true;
    cfg.block.embed_scale = Some(embed_scale(cfg.hidden_size));
    // transformers' Gemma 2 and 3 configs default the scalar to 256 (their
    // default head size), whatever the head size.
    let scalar = hf
        .opt_f32("query_pre_attn_scalar")?
        .map_or(DEFAULT_QUERY_PRE_ATTN_SCALAR, f64::from);
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
