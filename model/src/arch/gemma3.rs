//! Gemma 3 (text): GeGLU with tanh GELU, RMSNorm as `x * (1 + w)` (the
//! GGUF files store `1 + w`), norms before and after attention and the MLP,
//! RMSNorm over each head of q and k, embeddings times `sqrt(hidden)`,
//! attention scaled by `query_pre_attn_scalar^-0.5`, and five sliding-window
//! layers (local rope base 10,000) to each global one (base 1,000,000,
//! with the config's scaling).

use super::gemma2::{gemma_block, gemma_gguf_scale, window_pattern};
use kvmesh_kernels::rope::RopeScaling;

use super::Family;
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;

/// Rope base of the local layers when the config does not say.
const LOCAL_ROPE_THETA: f32 = 10_000.0;

/// One global layer in this many (transformers' `sliding_window_pattern`
/// default, and llama.cpp's fixed pattern for the architecture).
const PATTERN: usize = 6;

pub(crate) const FAMILY: Family = Family {
    name: "gemma3",
    hf_types: &[("gemma3_text", "Gemma3ForCausalLM")],
    gguf_arch: "gemma3",
    gguf_qk_permuted: false,
    hf_norm_offset: 1.0,
    fused: false,
    hf: gemma3_hf,
    gguf: |g, cfg| {
        gemma_gguf_scale(g, cfg)?;
        cfg.block.qk_norm = true;
        if cfg.sliding_window.is_some() {
            cfg.layer_types = super::gguf_window_pattern(g, "gemma3", cfg.n_layers)?
                .unwrap_or_else(|| window_pattern(cfg.n_layers, PATTERN));
        }
        // llama.cpp's fixed local base, unless the file names one.
        cfg.local_rope_theta = Some(
            g.opt_f32("gemma3.rope.freq_base_swa")?
                .unwrap_or(LOCAL_ROPE_THETA),
        );
        cfg.block.final_softcap = g.opt_f32("gemma3.final_logit_softcapping")?;
        Ok(())
    },
    hf_name: |part| super::gemma2::gemma_hf_name(part),
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: false,
};

fn gemma3_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    gemma_block(hf, cfg)?;
    cfg.block.qk_norm = true;
    if cfg.layer_types.is_empty() {
        let pattern = hf.opt_usize("sliding_window_pattern")?.unwrap_or(PATTERN);
        cfg.layer_types = window_pattern(cfg.n_layers, pattern);
    }
    let local = match hf.get("rope_parameters") {
        Some(serde_json::Value::Object(p)) if p.contains_key("sliding_attention") => {
            let (theta, scaling, _) = hf.rope("sliding_attention", false)?;
            if scaling != RopeScaling::None {
                return Err(hf.invalid(
                    "rope_parameters.sliding_attention",
                    format!("{scaling:?}"),
                    "a scaled rope on the local layers is not implemented".into(),
                ));
            }
            theta
        }
        _ => hf
            .opt_f32("rope_local_base_freq")?
            .unwrap_or(LOCAL_ROPE_THETA),
    };
    cfg.local_rope_theta = Some(local);
    Ok(())
}
