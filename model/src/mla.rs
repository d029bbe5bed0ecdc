//! Multi-head latent attention at run time (DeepSeek V2/V3): the
//! component that takes the q/k/v projections' slot in a layer whose
//! family caches a latent entry ([`crate::arch::mla`]).
//!
//! # What is cached, and how attention reads it
//! Per token and layer the pool holds one [`KvEntry::Latent`] vector of
//! `kv_lora_rank + qk_rope_dim` values: the normed compressed latent `c`
//! then the roped key `k_pe` that every head shares. transformers expands
//! `c` into per-head keys and values (`kv_b_proj`) and attends over those;
//! here the expansion is folded into the query and the output instead
//! ("absorbed"), so attention reads the latent directly:
//!
//! - a head's key is `[W_UK_h c | k_pe]`, so its score is
//!   `(W_UK_h^T q_nope_h) . c + q_pe_h . k_pe`: the query handed to the
//!   kernel is `[k_b_h q_nope_h | q_pe_h]` (`k_b_h` = `W_UK_h^T`,
//!   `[kv_lora_rank, qk_nope_dim]`) against the stored entry, every head
//!   over the one shared entry (one KV head);
//! - a head's value is `W_UV_h c`, so its output is `W_UV_h (sum_t p_t
//!   c_t)`: the kernel returns the latent-space sum (the entry's leading
//!   `kv_lora_rank` values are the value), and `v_b_h` (`[v_head_dim,
//!   kv_lora_rank]`) maps it out before `o_proj`.
//!
//! Same arithmetic as transformers' up to summation order (the golden
//! tolerance covers it). Cost per token, against the expanded form:
//! attention reads `kv_lora_rank + qk_rope_dim` values per cached position
//! for all heads together instead of `n_heads x (qk_nope + qk_rope +
//! v_head_dim)`, and each query pays two small per-head maps (`n_heads x
//! kv_lora_rank x (qk_nope + v_head_dim)` multiply-adds).

use kvmesh_kernels::norm::rms_norm;
use kvmesh_kernels::rope::{Rope, RopeScaling};

use crate::arch::mla::Mla;
use crate::error::Result;
use crate::linear::Projection;
use crate::weights::{Matrix, MlaQuery, MlaWeights};

/// One layer's latent attention as the pass runs it.
#[derive(Debug)]
pub(crate) struct MlaRt {
    /// The query's first projection (all of it without a low-rank query)
    /// and the KV down-projection, stacked: one pass over the normed input.
    down: Projection,
    /// The low-rank query's norm and up-projection.
    q_up: Option<(Vec<f32>, Projection)>,
    /// RMSNorm of the compressed latent, `[kv_lora_rank]`.
    kv_norm: Vec<f32>,
    /// Per head, `[kv_lora_rank, qk_nope_dim]`: the absorbed key map.
    k_b: Vec<Projection>,
    /// Per head, `[v_head_dim, kv_lora_rank]`: the value map.
    v_b: Vec<Projection>,
    /// Rope over the `qk_rope_dim` values of each head's `q_pe` and of the
    /// shared `k_pe`.
    rope: Rope,
    dims: Mla,
    n_heads: usize,
}

/// Buffers latent attention reuses between passes (the model's
/// workspace keeps one).
#[derive(Debug, Default)]
pub(crate) struct MlaScratch {
    down: Vec<f32>,
    q_low: Vec<f32>,
    q_low_normed: Vec<f32>,
    q: Vec<f32>,
    head_in: Vec<f32>,
    head_out: Vec<f32>,
    pe: Vec<f32>,
}

impl MlaScratch {
    /// Floats held (diagnostics).
    pub(crate) fn floats(&self) -> usize {
        [
            &self.down,
            &self.q_low,
            &self.q_low_normed,
            &self.q,
            &self.head_in,
            &self.head_out,
            &self.pe,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum()
    }
}

impl MlaRt {
    /// The runtime of `w`; `rope` is the model's rope over `qk_rope_dim`
    /// values, in the pairing the family's checkpoints use.
    pub(crate) fn new(w: MlaWeights, dims: Mla, n_heads: usize, rope: Rope) -> Result<Self> {
        let (down, q_up) = match w.q {
            MlaQuery::Direct(q) => (Projection::new(&[&q, &w.kv_a])?, None),
            MlaQuery::LowRank { a, norm, b } => (
                Projection::new(&[&a, &w.kv_a])?,
                Some((norm, Projection::new(&[&b])?)),
            ),
        };
        let per_head = |ms: &[Matrix]| -> Result<Vec<Projection>> {
            ms.iter().map(|m| Projection::new(&[m])).collect()
        };
        Ok(Self {
            down,
            q_up,
            kv_norm: w.kv_a_norm,
            k_b: per_head(&w.k_b)?,
            v_b: per_head(&w.v_b)?,
            rope,
            dims,
            n_heads,
        })
    }

    /// The rope over `dims.qk_rope_dim` values per head, paired as the
    /// family's checkpoints pair them.
    pub(crate) fn rope_of(dims: &Mla, theta: f32, scaling: RopeScaling) -> Rope {
        Rope::partial(
            dims.qk_rope_dim,
            dims.qk_rope_dim,
            theta,
            scaling,
            dims.rope_layout,
        )
    }

    /// Whether any matrix runs through the quantized kernels.
    pub(crate) fn is_quantized(&self) -> bool {
        self.down.is_quantized()
            || self.q_up.as_ref().is_some_and(|(_, p)| p.is_quantized())
            || self
                .k_b
                .iter()
                .chain(&self.v_b)
                .any(Projection::is_quantized)
    }

    /// `(bytes, multiply-adds)` of weights one token reads.
    pub(crate) fn active_per_token(&self) -> (usize, usize) {
        std::iter::once(&self.down)
            .chain(self.q_up.as_ref().map(|(_, p)| p))
            .chain(&self.k_b)
            .chain(&self.v_b)
            .fold((0, 0), |(b, p), pr| {
                (b + pr.weight_bytes(), p + pr.params())
            })
    }

    /// The rows of `xn` (`rows` tokens at `positions`) into `query`
    /// (`[rows][n_heads][kv_lora_rank + qk_rope_dim]`, what the paged
    /// kernel attends with) and `entry` (`[rows][kv_lora_rank +
    /// qk_rope_dim]`, what the pool caches).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn project(
        &self,
        xn: &[f32],
        rows: usize,
        positions: &[usize],
        eps: f32,
        query: &mut Vec<f32>,
        entry: &mut Vec<f32>,
        stacked: &mut Vec<f32>,
        s: &mut MlaScratch,
    ) -> Result<()> {
        let Mla {
            kv_lora_rank: rank,
            qk_nope_dim: nope,
            qk_rope_dim: rope_dim,
            ..
        } = self.dims;
        let (h, e) = (self.n_heads, self.dims.entry_dim());
        let qk = nope + rope_dim;
        // One pass over xn: the query's first part and the latent with
        // its rope key.
        self.down
            .apply_into(xn, rows, &mut [&mut s.q_low, &mut s.down], stacked)?;
        let q: &[f32] = match &self.q_up {
            None => &s.q_low,
            Some((norm, up)) => {
                s.q_low_normed.resize(s.q_low.len(), 0.0);
                rms_norm(&s.q_low, norm, eps, &mut s.q_low_normed);
                up.apply_into(&s.q_low_normed, rows, &mut [&mut s.q], stacked)?;
                &s.q
            }
        };
        debug_assert_eq!(q.len(), rows * h * qk);
        // The entry: the normed latent, then the shared key roped.
        entry.resize(rows * e, 0.0);
        s.pe.resize(rows * rope_dim, 0.0);
        for (t, row) in s.down.chunks_exact(e).enumerate() {
            rms_norm(
                &row[..rank],
                &self.kv_norm,
                eps,
                &mut entry[t * e..t * e + rank],
            );
            s.pe[t * rope_dim..(t + 1) * rope_dim].copy_from_slice(&row[rank..]);
        }
        self.rope.apply(&mut s.pe, positions, 1);
        for (t, pe) in s.pe.chunks_exact(rope_dim).enumerate() {
            entry[t * e + rank..(t + 1) * e].copy_from_slice(pe);
        }
        // The query: each head's q_pe roped, its q_nope through k_b.
        query.resize(rows * h * e, 0.0);
        s.pe.resize(rows * h * rope_dim, 0.0);
        for (i, head) in q.chunks_exact(qk).enumerate() {
            s.pe[i * rope_dim..(i + 1) * rope_dim].copy_from_slice(&head[nope..]);
        }
        self.rope.apply(&mut s.pe, positions, h);
        for (i, pe) in s.pe.chunks_exact(rope_dim).enumerate() {
            query[i * e + rank..(i + 1) * e].copy_from_slice(pe);
        }
        let nopes = Heads {
            stride: qk,
            width: nope,
        };
        let latents = Heads {
            stride: e,
            width: rank,
        };
        let bufs = (&mut s.head_in, &mut s.head_out);
        through_heads(&self.k_b, q, nopes, query, latents, rows, stacked, bufs)?;
        Ok(())
    }

    /// The kernel's output (`[rows][n_heads][kv_lora_rank]`, the latent
    /// sums) into `out` (`[rows][n_heads * v_head_dim]`, `o_proj`'s input).
    pub(crate) fn expand(
        &self,
        latent: &[f32],
        rows: usize,
        out: &mut Vec<f32>,
        stacked: &mut Vec<f32>,
        s: &mut MlaScratch,
    ) -> Result<()> {
        let (h, rank, v) = (self.n_heads, self.dims.kv_lora_rank, self.dims.v_head_dim);
        out.resize(rows * h * v, 0.0);
        let bufs = (&mut s.head_in, &mut s.head_out);
        let (latents, values) = (Heads::packed(rank), Heads::packed(v));
        through_heads(&self.v_b, latent, latents, out, values, rows, stacked, bufs)?;
        Ok(())
    }
}

/// Where each head's values sit in a `[rows][n_heads][stride]` buffer:
/// the first `width` of its `stride`.
#[derive(Clone, Copy)]
struct Heads {
    stride: usize,
    width: usize,
}

impl Heads {
    /// Heads of `width` values each, side by side.
    fn packed(width: usize) -> Self {
        Self {
            stride: width,
            width,
        }
    }
}

/// Each head's `from` values of `src` through its own map (`maps[head]`,
/// `[to.width, from.width]`) into its `to` values of `dst`: the heads'
/// rows gathered into one matrix per head (in `bufs`, reused), so each map
/// reads its weights once per call.
#[allow(clippy::too_many_arguments)]
fn through_heads(
    maps: &[Projection],
    src: &[f32],
    from: Heads,
    dst: &mut [f32],
    to: Heads,
    rows: usize,
    stacked: &mut Vec<f32>,
    bufs: (&mut Vec<f32>, &mut Vec<f32>),
) -> Result<()> {
    let (head_in, head_out) = bufs;
    let h = maps.len();
    for (head, map) in maps.iter().enumerate() {
        head_in.clear();
        for t in 0..rows {
            let at = (t * h + head) * from.stride;
            head_in.extend_from_slice(&src[at..at + from.width]);
        }
        map.apply_into(head_in, rows, &mut [&mut *head_out], stacked)?;
        for (t, o) in head_out.chunks_exact(to.width).enumerate() {
            let at = (t * h + head) * to.stride;
            dst[at..at + to.width].copy_from_slice(o);
        }
    }
    Ok(())
}
