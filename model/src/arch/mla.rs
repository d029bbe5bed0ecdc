//! Multi-head latent attention (MLA: DeepSeek V2 and V3), as a description
//! the forward pass reads ([`crate::config::ModelConfig::mla`]).
//!
//! # The computation (transformers' `DeepseekV2Attention` and
//! `DeepseekV3Attention`)
//! Per token `x` (the normed residual, `[hidden]`):
//! - query: `q = W_q x` ([`Mla::q_lora_rank`] `None`), or
//!   `q = W_qb rms_norm(W_qa x)` (the low-rank query); each of the
//!   `n_heads` heads is `[nope | rope]`, `qk_nope_dim + qk_rope_dim` wide;
//! - latent: `W_kva x` is `[latent | rope key]`, `kv_lora_rank +
//!   qk_rope_dim` wide; the latent is RMS-normed (`kv_a_layernorm`); the
//!   rope key is one head shared by every query head;
//! - rope rotates the query heads' rope parts and the rope key, pairing
//!   dimensions as [`Mla::rope_layout`] says;
//! - keys and values: `W_kvb latent` gives each head `[k_nope | v]`
//!   (`qk_nope_dim + v_head_dim`); head `h`'s key is `[k_nope_h | rope
//!   key]`;
//! - attention per head, softmax scale [`crate::arch::Block::attn_scale`]
//!   (`(qk_nope_dim + qk_rope_dim)^-0.5`, times YaRN's `mscale^2` where the
//!   configuration asks for it), then `o_proj` over the heads' values
//!   (`n_heads * v_head_dim` wide).
//!
//! # What the cache holds
//! Keys and values are linear in the normed latent, so a cache need only
//! hold, per token and layer, the normed latent and the rotated rope key:
//! [`Mla::entry_dim`] values, one entry shared by every head (the
//! configuration's `n_kv_heads` is 1). The nope part of the score is
//! `q_nope_h . (K_h latent) = (K_h^T q_nope_h) . latent` ("absorbing" the
//! key expansion into the query), and a head's output is `V_h (sum_t p_t
//! latent_t)`; `crate::weights::MlaWeights` holds `K_h^T` and `V_h` per
//! head for that.
//!
//! # Rope pairing
//! DeepSeek rotates interleaved pairs `(2i, 2i + 1)` with frequency `i`:
//! V2's `apply_rotary_emb` views a head's rope part as complex numbers
//! `x[2i] + j x[2i+1]`; V3's `apply_rotary_pos_emb_interleave` (when
//! `rope_interleave`, its default) rotates the same pairs and writes the
//! result de-interleaved (`[x0', x2', ... | x1', x3', ...]`). The order
//! of the rotated dimensions matters only through `q . k`, which one
//! permutation of both leaves unchanged, so both are
//! [`RopeLayout::Interleaved`]. V3 with `rope_interleave: false` rotates
//! halves ([`RopeLayout::RotateHalf`]). llama.cpp runs `deepseek2` with
//! its "normal" (adjacent-pair) rope on unpermuted weights: interleaved
//! too.

use kvmesh_kernels::rope::RopeLayout;

use crate::error::{ModelError, Result};

/// A model's latent attention (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mla {
    /// Rank of the low-rank query (`q_a_proj`, `q_a_layernorm`,
    /// `q_b_proj`); `None`: one full-rank `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the latent the cache holds.
    pub kv_lora_rank: usize,
    /// Each query and key head's dimensions without rope.
    pub qk_nope_dim: usize,
    /// Each query head's rotated dimensions, and the shared rope key's;
    /// even.
    pub qk_rope_dim: usize,
    /// Each head's value width.
    pub v_head_dim: usize,
    /// How the rope dimensions pair (see the module docs).
    pub rope_layout: RopeLayout,
}

/// Wider than any released model's latent or head by far (DeepSeek V3:
/// a 512-wide latent, 1536-wide query rank); a larger value means a
/// corrupt file.
const MAX_DIM: usize = 1 << 16;

impl Mla {
    /// Values per token per layer the KV cache holds: the latent and the
    /// rope key.
    pub fn entry_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_dim
    }

    /// Width of each query head (`nope + rope`), and of each key head
    /// once expanded.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_dim + self.qk_rope_dim
    }

    /// The shape invariants the weights and the forward pass rely on;
    /// `names` are the source format's fields, cited in errors.
    pub(crate) fn validate(&self, path: &std::path::Path, names: &MlaFieldNames) -> Result<()> {
        let invalid = |field: &str, value: usize, reason: &str| ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value: value.to_string(),
            reason: reason.to_owned(),
        };
        let sizes = [
            (names.kv_lora_rank, self.kv_lora_rank),
            (names.qk_nope_dim, self.qk_nope_dim),
            (names.qk_rope_dim, self.qk_rope_dim),
            (names.v_head_dim, self.v_head_dim),
        ];
        for (field, v) in sizes
            .into_iter()
            .chain(self.q_lora_rank.map(|r| (names.q_lora_rank, r)))
        {
            if v == 0 {
                return Err(invalid(field, v, "must be positive"));
            }
            if v > MAX_DIM {
                return Err(invalid(
                    field,
                    v,
                    &format!("more than {MAX_DIM}; the file is likely corrupt"),
                ));
            }
        }
        if !self.qk_rope_dim.is_multiple_of(2) {
            return Err(invalid(
                names.qk_rope_dim,
                self.qk_rope_dim,
                "must be even (rope rotates pairs)",
            ));
        }
        Ok(())
    }
}

/// The fields [`Mla::validate`] cites, per source format.
pub(crate) struct MlaFieldNames {
    pub q_lora_rank: &'static str,
    pub kv_lora_rank: &'static str,
    pub qk_nope_dim: &'static str,
    pub qk_rope_dim: &'static str,
    pub v_head_dim: &'static str,
}

impl MlaFieldNames {
    /// A Hugging Face `config.json`'s keys.
    pub(crate) const HF: Self = Self {
        q_lora_rank: "q_lora_rank",
        kv_lora_rank: "kv_lora_rank",
        qk_nope_dim: "qk_nope_head_dim",
        qk_rope_dim: "qk_rope_head_dim",
        v_head_dim: "v_head_dim",
    };

    /// llama.cpp's `deepseek2` keys (the nope width is derived from the
    /// key length).
    pub(crate) const GGUF: Self = Self {
        q_lora_rank: "deepseek2.attention.q_lora_rank",
        kv_lora_rank: "deepseek2.attention.kv_lora_rank",
        qk_nope_dim: "deepseek2.attention.key_length_mla",
        qk_rope_dim: "deepseek2.rope.dimension_count",
        v_head_dim: "deepseek2.attention.value_length_mla",
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mla() -> Mla {
        Mla {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_dim: 128,
            qk_rope_dim: 64,
            v_head_dim: 128,
            rope_layout: RopeLayout::Interleaved,
        }
    }

    #[test]
    fn the_cache_entry_is_the_latent_and_the_rope_key() {
        let m = mla();
        assert_eq!(m.entry_dim(), 576);
        assert_eq!(m.qk_head_dim(), 192);
        assert!(m
            .validate(std::path::Path::new("c"), &MlaFieldNames::HF)
            .is_ok());
    }

    #[test]
    fn zero_sizes_and_an_odd_rope_are_refused_by_field() {
        let path = std::path::Path::new("/m/config.json");
        let cases = [
            (
                Mla {
                    kv_lora_rank: 0,
                    ..mla()
                },
                "kv_lora_rank",
            ),
            (
                Mla {
                    q_lora_rank: Some(0),
                    ..mla()
                },
                "q_lora_rank",
            ),
            (
                Mla {
                    qk_rope_dim: 63,
                    ..mla()
                },
                "qk_rope_head_dim",
            ),
            (
                Mla {
                    v_head_dim: MAX_DIM + 1,
                    ..mla()
                },
                "v_head_dim",
            ),
        ];
        for (m, field) in cases {
            match m.validate(path, &MlaFieldNames::HF) {
                Err(ModelError::InvalidField { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }
}
