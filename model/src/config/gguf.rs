//! [`ModelConfig`] from GGUF metadata: the keys every family shares
//! (`{arch}.embedding_length` and so on), then the family's hook.

use kvmesh_kernels::rope::{yarn_attention_factor, RopeScaling, Yarn};

use super::{FieldNames, ModelConfig};
use crate::arch::{Block, Family, LayerType};
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;

/// Tensor in which llama.cpp's converter stores Llama 3.1-style RoPE
/// scaling as one divisor per rotated pair, instead of metadata.
const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

impl ModelConfig {
    /// Read the configuration from GGUF metadata. `tie_word_embeddings` is
    /// the absence of an `output.weight` tensor, as llama.cpp decides it.
    pub(crate) fn from_gguf(g: &mut GgufFile) -> Result<Self> {
        let arch = g
            .opt_str("general.architecture")?
            .ok_or_else(|| g.missing_field("general.architecture"))?
            .to_owned();
        let family = Family::by_gguf(&arch).ok_or_else(|| ModelError::UnsupportedArchitecture {
            path: g.path().to_owned(),
            architecture: arch.clone(),
        })?;
        let key = |k: &str| format!("{arch}.{k}");
        let n_heads = g.req_usize(&key("attention.head_count"))?;
        let hidden_size = g.req_usize(&key("embedding_length"))?;
        let head_dim = match g.opt_usize(&key("attention.key_length"))? {
            Some(d) => d,
            None if n_heads > 0 && hidden_size % n_heads == 0 => hidden_size / n_heads,
            None => {
                return Err(g
                    .invalid_field(
                        &key("attention.head_count"),
                        n_heads.to_string(),
                        format!(
                            "must divide {} ({hidden_size}) when {} is absent",
                            key("embedding_length"),
                            key("attention.key_length")
                        ),
                    )
                    .into())
            }
        };
        // Latent attention's heads and cache entry are the family's to read.
        if let Some(v) = g
            .opt_usize(&key("attention.value_length"))?
            .filter(|&v| v != head_dim && !family.latent_attention)
        {
            return Err(g
                .invalid_field(
                    &key("attention.value_length"),
                    v.to_string(),
                    format!("must equal the key length ({head_dim})"),
                )
                .into());
        }
        let rotary_dim = match g.opt_usize(&key("rope.dimension_count"))? {
            Some(r) if r != head_dim && !family.partial_rotary && !family.latent_attention => {
                return Err(g.invalid_field(
                    &key("rope.dimension_count"),
                    r.to_string(),
                    format!("partial rotary embeddings are not implemented for {arch}: must equal the head size ({head_dim})"),
                ).into());
            }
            Some(r) => r,
            None => head_dim,
        };
        let vocab_size = match g.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => g
                .array_len("tokenizer.ggml.tokens")
                .ok_or_else(|| g.missing_field(&key("vocab_size")))?,
        };
        let rope_theta = g.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        // llama.cpp counts the multi-token-prediction layers (GLM-4.5's
        // `nextn_predict_layers`) in the blocks, after the decoder's;
        // generation runs the decoder's only.
        let blocks = g.req_usize(&key("block_count"))?;
        let nextn = g.opt_usize(&key("nextn_predict_layers"))?.unwrap_or(0);
        let n_layers = blocks.checked_sub(nextn).ok_or_else(|| {
            g.invalid_field(
                &key("nextn_predict_layers"),
                nextn.to_string(),
                format!("more than the {blocks} blocks"),
            )
        })?;
        super::check_layer_count(g.path(), &key("block_count"), n_layers)?;

        let mut config = ModelConfig {
            architecture: arch.clone(),
            family: family.name,
            block: Block::llama(head_dim),
            layer_types: vec![LayerType::Full; n_layers],
            local_rope_theta: None,
            vocab_size,
            hidden_size,
            intermediate_size: g.req_usize(&key("feed_forward_length"))?,
            n_layers,
            n_heads,
            n_kv_heads: g
                .opt_usize(&key("attention.head_count_kv"))?
                .unwrap_or(n_heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: g
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
                .ok_or_else(|| g.missing_field(&key("attention.layer_norm_rms_epsilon")))?,
            rope_theta,
            rope_scaling: rope_scaling(g, &arch, head_dim, rope_theta)?,
            max_position_embeddings: kvmesh_tokenizer::info::gguf_context_length(g, &arch)?,
            tie_word_embeddings: !g.has_tensor("output.weight"),
            attention_bias: false,
            sliding_window: g.opt_usize(&key("attention.sliding_window"))?,
            bos_token_id: g.opt_u32("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: kvmesh_tokenizer::info::gguf_eos_token_ids(g)?,
            moe: None,
            mla: None,
        };
        (family.gguf)(g, &mut config)?;
        crate::arch::moe::refuse_unread_experts(g, &config)?;
        if !config.layer_types.contains(&LayerType::Sliding) {
            config.sliding_window = None;
        }
        config.validate(g.path(), &FieldNames::gguf(&arch))?;
        Ok(config)
    }
}

/// `{arch}.rope.scaling.type` none, linear or yarn, or a
/// `rope_freqs.weight` tensor that matches a Llama 3 scaling.
fn rope_scaling(g: &mut GgufFile, arch: &str, head_dim: usize, theta: f32) -> Result<RopeScaling> {
    let key = |k: &str| format!("{arch}.{k}");
    let scaling = match g.opt_str(&key("rope.scaling.type"))? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => match g.opt_f32(&key("rope.scaling.factor"))? {
            Some(factor) if factor.is_finite() && factor > 0.0 => RopeScaling::Linear { factor },
            Some(factor) => {
                return Err(g.invalid_field(&key("rope.scaling.factor"), factor.to_string(), "must be positive").into())
            }
            None => return Err(g.missing_field(&key("rope.scaling.factor")).into()),
        },
        Some("yarn") => RopeScaling::Yarn(yarn(g, arch)?),
        Some(other) => {
            return Err(g.invalid_field(
                &key("rope.scaling.type"),
                format!("{other:?}"),
                format!("{other} RoPE scaling is not implemented (supported: none, linear, yarn; Llama 3 scaling comes as rope_freqs.weight)"),
            ).into())
        }
    };
    if !g.has_tensor(ROPE_FREQS_TENSOR) {
        return Ok(scaling);
    }
    if scaling != RopeScaling::None {
        return Err(g
            .invalid_field(
                &key("rope.scaling.type"),
                format!(
                    "{:?}",
                    g.opt_str(&key("rope.scaling.type"))?.unwrap_or_default()
                ),
                "cannot be combined with a rope_freqs.weight tensor",
            )
            .into());
    }
    if !head_dim.is_multiple_of(2) || head_dim == 0 {
        // validate() reports the head size itself.
        return Ok(scaling);
    }
    let divisors = g.tensor_f32(ROPE_FREQS_TENSOR, &[head_dim / 2])?;
    let divisors = divisors.to_vec1::<f32>().map_err(|e| {
        ModelError::malformed(g.path(), format!("tensor `{ROPE_FREQS_TENSOR}`: {e}"))
    })?;
    let original = g
        .opt_usize(&key("rope.scaling.original_context_length"))?
        .unwrap_or(LLAMA3_ORIGINAL_CONTEXT);
    match llama3_from_divisors(&divisors, head_dim, theta, original) {
        Some(scaling) => Ok(scaling),
        None => Err(ModelError::UnsupportedArchitecture {
            path: g.path().to_owned(),
            architecture: format!("{arch} with per-pair RoPE divisors ({ROPE_FREQS_TENSOR}) that match no Llama 3 scaling"),
        }),
    }
}

/// YaRN from the keys llama.cpp's converter writes: `factor` (required),
/// `original_context_length` (else the context length, as llama.cpp
/// defaults it), `yarn_beta_fast` and `yarn_beta_slow` (32 and 1).
///
/// The magnitude cos and sin are multiplied by: `yarn_attn_factor` where
/// present (the converter copies transformers' `attention_factor` there),
/// else what llama.cpp computes, `0.1 ln(factor) + 1` (with a
/// `yarn_log_multiplier`, DeepSeek's `mscale_all_dim`, the ratio
/// transformers takes for `mscale` 1 and that); times `attn_factor`, which
/// llama.cpp multiplies in. `yarn_ext_factor` other than 1 (negative:
/// unset) changes YaRN's ramp in a way transformers has no parameter for:
/// refused by name.
fn yarn(g: &GgufFile, arch: &str) -> Result<Yarn> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let positive = |k: &str| -> Result<Option<f32>> {
        match g.opt_f32(&key(k))? {
            Some(x) if !(x.is_finite() && x > 0.0) => Err(g
                .invalid_field(&key(k), x.to_string(), "must be positive")
                .into()),
            x => Ok(x),
        }
    };
    let factor = f64::from(positive("factor")?.ok_or_else(|| g.missing_field(&key("factor")))?);
    let original = match g.opt_usize(&key("original_context_length"))? {
        Some(0) => {
            return Err(g
                .invalid_field(&key("original_context_length"), "0", "must be positive")
                .into())
        }
        Some(n) => n,
        None => kvmesh_tokenizer::info::gguf_context_length(g, arch)?,
    };
    if let Some(ext) = g
        .opt_f32(&key("yarn_ext_factor"))?
        .filter(|&e| e >= 0.0 && e != 1.0)
    {
        return Err(g
            .invalid_field(
                &key("yarn_ext_factor"),
                ext.to_string(),
                "a YaRN ramp mixed by other than 1 is not implemented",
            )
            .into());
    }
    let log_mul = g
        .opt_f32(&key("yarn_log_multiplier"))?
        .filter(|&m| m != 0.0)
        .map(f64::from);
    let magnitude = match positive("yarn_attn_factor")? {
        Some(a) => a,
        None => yarn_attention_factor(factor, log_mul.map(|_| 1.0), log_mul),
    };
    Ok(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: f64::from(positive("yarn_beta_fast")?.unwrap_or(32.0)),
        beta_slow: f64::from(positive("yarn_beta_slow")?.unwrap_or(1.0)),
        // ggml rounds the ramp's bounds outward, always.
        truncate: true,
        attention_factor: magnitude * positive("attn_factor")?.unwrap_or(1.0),
    })
}

/// Context length before scaling of every Llama 3.x release.
const LLAMA3_ORIGINAL_CONTEXT: usize = 8192;

/// Recover a [`RopeScaling::Llama3`] from llama.cpp's per-pair divisors.
///
/// The converter drops the scaling's parameters and keeps only
/// `inv_freq_unscaled / inv_freq_scaled` per pair. Every Llama 3.x release
/// uses `low_freq_factor` 1 and `high_freq_factor` 4 and the largest divisor
/// is `factor`; the candidate is accepted only if it reproduces every
/// divisor, so a file with other factors is refused rather than run wrong.
pub(crate) fn llama3_from_divisors(
    divisors: &[f32],
    head_dim: usize,
    theta: f32,
    original: usize,
) -> Option<RopeScaling> {
    let factor = divisors.iter().copied().fold(f32::NAN, f32::max);
    if !(factor.is_finite() && factor >= 1.0) || divisors.len() != head_dim / 2 {
        return None;
    }
    let candidate = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    };
    let expected = llama3_divisors(head_dim, theta, candidate)?;
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 * b.abs().max(1.0);
    divisors
        .iter()
        .zip(&expected)
        .all(|(&a, &b)| close(a, b))
        .then_some(candidate)
}

/// Per-pair divisors of a Llama 3 scaling, as llama.cpp's converter
/// computes them (the same formula as `kvmesh_kernels::rope::Rope::new`).
fn llama3_divisors(head_dim: usize, theta: f32, scaling: RopeScaling) -> Option<Vec<f32>> {
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = scaling
    else {
        return None;
    };
    let old = original_max_position_embeddings as f32;
    let low_wavelen = old / low_freq_factor;
    let high_wavelen = old / high_freq_factor;
    Some(
        (0..head_dim / 2)
            .map(|i| {
                let inv_freq = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
                let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
                if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_is_recovered_from_its_divisors_and_others_are_refused() {
        let scaling = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let divisors = llama3_divisors(64, 500_000.0, scaling).unwrap_or_default();
        assert!(divisors.contains(&1.0) && divisors.contains(&32.0));
        assert!(
            divisors.iter().any(|&d| d > 1.0 && d < 32.0),
            "a blended band exists"
        );
        assert_eq!(
            llama3_from_divisors(&divisors, 64, 500_000.0, 8192),
            Some(scaling)
        );

        // Same largest divisor but a different high_freq_factor: refused.
        let other = RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 2.0,
            original_max_position_embeddings: 8192,
        };
        let other_divisors = llama3_divisors(64, 500_000.0, other).unwrap_or_default();
        assert_eq!(
            llama3_from_divisors(&other_divisors, 64, 500_000.0, 8192),
            None
        );
        assert_eq!(
            llama3_from_divisors(&[f32::NAN; 32], 64, 500_000.0, 8192),
            None
        );
        assert_eq!(
            llama3_from_divisors(&divisors[..10], 64, 500_000.0, 8192),
            None
        );
    }
}
