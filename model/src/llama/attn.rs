//! A layer's attention projections around the one paged attention call:
//! grouped-query (q/k/v with their biases and head norms, rope) or latent
//! ([`crate::mla`]). Both hand the kernel a query per head and the pool an
//! entry per token; latent attention's kernel output is still in the
//! latent space and is mapped out before `o_proj`.

use kvmesh_kernels::rope::Rope;

use super::ops::{add_bias, head_norm};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::linear::Projection;
use crate::mla::{MlaRt, MlaScratch};
use crate::weights::AttnWeights;

/// Grouped-query attention's projections.
#[derive(Debug)]
pub(super) struct GqaRt {
    qkv: Projection,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

/// A layer's attention projections as the pass runs them.
#[derive(Debug)]
pub(super) enum AttnRt {
    Gqa(GqaRt),
    Latent(Box<MlaRt>),
}

/// The buffers one layer's attention projections fill: the kernel's query
/// `q`, the pool's entries `k` and `v` (`v` empty for latent entries).
pub(super) struct Projected<'a> {
    pub(super) q: &'a mut Vec<f32>,
    pub(super) k: &'a mut Vec<f32>,
    pub(super) v: &'a mut Vec<f32>,
}

impl AttnRt {
    pub(super) fn new(w: AttnWeights, cfg: &ModelConfig) -> Result<Self> {
        Ok(match w {
            AttnWeights::Gqa(a) => Self::Gqa(GqaRt {
                qkv: Projection::new(&[&a.wq, &a.wk, &a.wv])?,
                bq: a.bq,
                bk: a.bk,
                bv: a.bv,
                q_norm: a.q_norm,
                k_norm: a.k_norm,
            }),
            AttnWeights::Latent(m) => {
                let dims = cfg
                    .mla
                    .clone()
                    .ok_or_else(|| crate::error::ModelError::Compute {
                        detail: "latent attention weights for a configuration without it".into(),
                    })?;
                let rope = MlaRt::rope_of(&dims, cfg.rope_theta, cfg.rope_scaling);
                Self::Latent(Box::new(MlaRt::new(*m, dims, cfg.n_heads, rope)?))
            }
        })
    }

    pub(super) fn is_quantized(&self) -> bool {
        match self {
            Self::Gqa(g) => g.qkv.is_quantized(),
            Self::Latent(m) => m.is_quantized(),
        }
    }

    /// `(bytes, multiply-adds)` of weights one token reads.
    pub(super) fn active_per_token(&self) -> (usize, usize) {
        match self {
            Self::Gqa(g) => (g.qkv.weight_bytes(), g.qkv.params()),
            Self::Latent(m) => m.active_per_token(),
        }
    }

    /// The rows of `xn` (`positions`) into the kernel's query and the
    /// pool's entries; `rope` is the layer's (grouped-query attention; a
    /// latent layer has its own over the rope part). `stacked` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn project(
        &self,
        cfg: &ModelConfig,
        rope: &Rope,
        xn: &[f32],
        positions: &[usize],
        out: Projected<'_>,
        stacked: &mut Vec<f32>,
        mla: &mut MlaScratch,
    ) -> Result<()> {
        let rows = positions.len();
        let eps = cfg.rms_norm_eps;
        let Projected { q, k, v } = out;
        match self {
            Self::Gqa(g) => {
                g.qkv
                    .apply_into(xn, rows, &mut [&mut *q, &mut *k, &mut *v], stacked)?;
                add_bias(q, g.bq.as_ref());
                add_bias(k, g.bk.as_ref());
                add_bias(v, g.bv.as_ref());
                head_norm(q, g.q_norm.as_deref(), eps, stacked);
                head_norm(k, g.k_norm.as_deref(), eps, stacked);
                rope.apply(q, positions, cfg.n_heads);
                rope.apply(k, positions, cfg.n_kv_heads);
            }
            Self::Latent(m) => {
                v.clear();
                m.project(xn, rows, positions, eps, q, k, stacked, mla)?;
            }
        }
        Ok(())
    }

    /// The kernel's output as `o_proj` takes it: `attn` as it is, or for
    /// latent attention each head's latent sum mapped out into `buf`.
    pub(super) fn o_input<'a>(
        &self,
        attn: &'a [f32],
        rows: usize,
        buf: &'a mut Vec<f32>,
        stacked: &mut Vec<f32>,
        mla: &mut MlaScratch,
    ) -> Result<&'a [f32]> {
        match self {
            Self::Gqa(_) => Ok(attn),
            Self::Latent(m) => {
                m.expand(attn, rows, buf, stacked, mla)?;
                Ok(buf)
            }
        }
    }
}
