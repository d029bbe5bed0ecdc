//! A layer's attention projections: grouped-query ([`GqaWeights`]) or
//! latent ([`MlaWeights`]), one enum so that a layer holds exactly one
//! kind's tensors.

use super::Matrix;

/// What a layer's attention reads its queries, keys and values from (its
/// output projection is [`super::LayerWeights::wo`] either way).
#[derive(Clone, Debug)]
pub enum AttnWeights {
    /// q, k and v projections (every family but DeepSeek's).
    Gqa(GqaWeights),
    /// Multi-head latent attention ([`crate::arch::mla`]).
    Latent(Box<MlaWeights>),
}

/// Grouped-query attention's projections.
#[derive(Clone, Debug)]
pub struct GqaWeights {
    /// Query projection, `[n_heads * head_dim, hidden]`.
    pub wq: Matrix,
    /// Key projection, `[n_kv_heads * head_dim, hidden]`.
    pub wk: Matrix,
    /// Value projection, `[n_kv_heads * head_dim, hidden]`.
    pub wv: Matrix,
    /// Query bias (when `attention_bias`), `[n_heads * head_dim]`.
    pub bq: Option<Vec<f32>>,
    /// Key bias (when `attention_bias`), `[n_kv_heads * head_dim]`.
    pub bk: Option<Vec<f32>>,
    /// Value bias (when `attention_bias`), `[n_kv_heads * head_dim]`.
    pub bv: Option<Vec<f32>>,
    /// RMSNorm weight of each query head (Qwen3, Gemma 3), `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    /// RMSNorm weight of each key head, `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
}

/// Latent attention's projections, shaped for a cache of latent entries
/// ([`crate::arch::mla`]'s "What the cache holds"). Sizes: `nope`, `rope`,
/// `v` per head, `kv_rank` the latent's width, `q_rank` the low-rank
/// query's.
///
/// `k_b` and `v_b` come from Hugging Face's `kv_b_proj`
/// (`[n_heads * (nope + v), kv_rank]`: each head's `nope` key rows, then
/// its `v` value rows), from GGUF's `attn_kv_b` (the same), or from GGUF's
/// per-head `attn_k_b`/`attn_v_b` stacks. `v_b[h]` is a range of whole
/// rows, so a quantized matrix keeps its blocks. `k_b[h]` from `kv_b_proj`
/// is a transpose, which blocks along rows cannot express: f32
/// (dequantized in the quantized mode; `nope x kv_rank` values per head,
/// 64K for DeepSeek V3's 128 x 512). From `attn_k_b` it is whole rows of
/// the stack and keeps its blocks, but where rows of `nope` values are
/// too narrow for the kernels' 32-value panels (an F16 stack of a small
/// model), read as f32.
#[derive(Clone, Debug)]
pub struct MlaWeights {
    /// The query, `n_heads * (nope + rope)` values per token, each head
    /// `[nope | rope]`.
    pub q: MlaQuery,
    /// `[kv_rank + rope, hidden]`: rows `0..kv_rank` give the latent,
    /// the next `rope` the rope key shared by every head.
    pub kv_a: Matrix,
    /// RMSNorm weight of the latent, `[kv_rank]`.
    pub kv_a_norm: Vec<f32>,
    /// Per head `[kv_rank, nope]`: the key expansion absorbed into the
    /// query, `q_latent[h] = k_b[h] q_nope[h]`, so that `q_latent[h] .
    /// latent` is the nope part of the score.
    pub k_b: Vec<Matrix>,
    /// Per head `[v, kv_rank]`: head `h`'s output is `v_b[h]` times its
    /// attention-weighted sum of latents.
    pub v_b: Vec<Matrix>,
}

/// Latent attention's query projection.
#[derive(Clone, Debug)]
pub enum MlaQuery {
    /// `q_proj`, `[n_heads * (nope + rope), hidden]` (DeepSeek-V2-Lite, a
    /// `q_lora_rank` of null).
    Direct(Matrix),
    /// `q = b rms_norm(a x)`.
    LowRank {
        /// `q_a_proj`, `[q_rank, hidden]`.
        a: Matrix,
        /// `q_a_layernorm`, `[q_rank]`.
        norm: Vec<f32>,
        /// `q_b_proj`, `[n_heads * (nope + rope), q_rank]`.
        b: Matrix,
    },
}

impl AttnWeights {
    /// Every matrix: q, k, v; or the query's, `kv_a`, then each head's
    /// `k_b`, then each head's `v_b`.
    pub fn matrices(&self) -> Vec<&Matrix> {
        match self {
            Self::Gqa(g) => vec![&g.wq, &g.wk, &g.wv],
            Self::Latent(m) => {
                let mut out = match &m.q {
                    MlaQuery::Direct(q) => vec![q],
                    MlaQuery::LowRank { a, b, .. } => vec![a, b],
                };
                out.push(&m.kv_a);
                out.extend(m.k_b.iter().chain(&m.v_b));
                out
            }
        }
    }

    /// Every vector: the biases and head norms there are; or the low-rank
    /// query's norm and the latent's.
    pub fn vectors(&self) -> Vec<&Vec<f32>> {
        match self {
            Self::Gqa(g) => [&g.bq, &g.bk, &g.bv, &g.q_norm, &g.k_norm]
                .into_iter()
                .flatten()
                .collect(),
            Self::Latent(m) => match &m.q {
                MlaQuery::Direct(_) => vec![&m.kv_a_norm],
                MlaQuery::LowRank { norm, .. } => vec![norm, &m.kv_a_norm],
            },
        }
    }

    /// The grouped-query projections, for a layer that has them.
    pub fn gqa(&self) -> Option<&GqaWeights> {
        match self {
            Self::Gqa(g) => Some(g),
            Self::Latent(_) => None,
        }
    }

    /// The latent projections, for a layer that has them.
    pub fn latent(&self) -> Option<&MlaWeights> {
        match self {
            Self::Gqa(_) => None,
            Self::Latent(m) => Some(m),
        }
    }
}
