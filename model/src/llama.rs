//! The Llama-family forward pass over the paged, ownership-checked KV pool.
//!
//! One call runs a batch of sequence chunks together: all their tokens go
//! through each projection as one matrix (so a batched decode step reads
//! every weight once), while attention runs per sequence through
//! [`kvmesh_kernels::paged_attention`], which checks I1 and I2 on every page
//! it reads. A guard violation fails only the sequence it happened in: its
//! rows are zeroed from then on and its result is the error, the other
//! sequences of the batch complete normally.
//!
//! Exact mode: weights are f32 (dequantized at load), activations f32, the
//! same arithmetic as the Hugging Face reference up to summation order.
//!
//! Cost per call with `T` tokens in the batch: one `[T, hidden] x [hidden, out]`
//! matmul per projection, attention linear in each sequence's context, and the
//! vocabulary projection only for the rows whose logits were asked for.

use candle_core::{DType, Device, Tensor};
use kvmesh_kernels::norm::rms_norm;
use kvmesh_kernels::rope::{Rope, RopeLayout};
use kvmesh_kernels::{paged_attention, AttentionShape, KvGeometry};
use kvmesh_kvxfer::{PoolConfig, Reservation};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::weights::Weights;

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prompt chunk that is not the last).
    None,
    /// The last token's logits.
    Last,
    /// Every token's logits (scoring, tests).
    All,
}

/// One sequence's share of a batched forward call: `tokens` at positions
/// `start_pos..start_pos + tokens.len()`, whose K/V are written into `kv`.
#[derive(Debug)]
pub struct SeqChunk<'a> {
    /// Token ids to run.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; every earlier position must already be in `kv`.
    pub start_pos: usize,
    /// The sequence's pages.
    pub kv: &'a mut Reservation,
    /// Which logits to return.
    pub logits: LogitsWanted,
}

/// A chunk's outcome: its logits rows (`vocab_size` each), or why it failed.
pub type ChunkResult = Result<Vec<Vec<f32>>>;

/// A loaded Llama-family model ready to run.
pub struct Llama {
    cfg: ModelConfig,
    w: Weights,
    rope: Rope,
    shape: AttentionShape,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn compute(e: candle_core::Error) -> ModelError {
    ModelError::Compute {
        detail: e.to_string(),
    }
}

/// `x [rows, in] @ w[out, in]^T` as a flat row-major vector.
fn linear(x: &[f32], rows: usize, w: &Tensor) -> Result<Vec<f32>> {
    let (_, inner) = w.dims2().map_err(compute)?;
    let xt = Tensor::from_slice(x, (rows, inner), &Device::Cpu).map_err(compute)?;
    xt.matmul(&w.t().map_err(compute)?)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(compute)
}

fn add_bias(x: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

impl Llama {
    /// Build the runtime from loaded weights (exact mode: f32 throughout).
    pub fn new(cfg: ModelConfig, w: Weights) -> Self {
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            RopeLayout::RotateHalf,
        );
        let shape = AttentionShape {
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            window: cfg.sliding_window,
        };
        Self {
            cfg,
            w,
            rope,
            shape,
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The KV page shape this model needs.
    pub fn kv_geometry(&self, page_size: usize) -> KvGeometry {
        KvGeometry {
            page_size,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// A pool configuration for `kv_pool_tokens` token slots of this model.
    pub fn pool_config(&self, kv_pool_tokens: usize, page_size: usize) -> PoolConfig {
        PoolConfig::for_tokens(
            kv_pool_tokens,
            page_size,
            self.cfg.n_layers,
            self.cfg.n_kv_heads,
            self.cfg.head_dim,
        )
    }

    /// KV bytes one token occupies across all layers (f32 K and V).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.cfg.n_layers * 2 * self.cfg.n_kv_heads * self.cfg.head_dim * std::mem::size_of::<f32>()
    }

    /// Run a batch of chunks. The outer `Err` is a failure of the whole call
    /// (bad input that names no single sequence, or a compute error); a guard
    /// violation or a KV write error fails only its own chunk.
    pub fn forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Vec<ChunkResult>> {
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let (q_dim, kv_dim) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(batch.len());
        for chunk in batch.iter() {
            if let Some(&bad) = chunk.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::InvalidField {
                    path: "<request>".into(),
                    field: "token id".into(),
                    value: bad.to_string(),
                    reason: format!("the vocabulary has {} tokens", cfg.vocab_size),
                });
            }
            spans.push(ids.len()..ids.len() + chunk.tokens.len());
            ids.extend_from_slice(chunk.tokens);
        }
        let rows = ids.len();
        let mut failed: Vec<Option<ModelError>> = batch.iter().map(|_| None).collect();
        if rows == 0 {
            return Ok(batch.iter().map(|_| Ok(Vec::new())).collect());
        }
        let positions: Vec<usize> = batch
            .iter()
            .flat_map(|c| c.start_pos..c.start_pos + c.tokens.len())
            .collect();

        let id_tensor = Tensor::from_slice(&ids, rows, &Device::Cpu).map_err(compute)?;
        let mut x = self
            .w
            .embed
            .index_select(&id_tensor, 0)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(compute)?;
        let mut xn = vec![0.0f32; x.len()];
        let mut attn = vec![0.0f32; rows * q_dim];

        for (layer, lw) in self.w.layers.iter().enumerate() {
            rms_norm(&x, &lw.attn_norm, cfg.rms_norm_eps, &mut xn);
            let mut q = linear(&xn, rows, &lw.wq)?;
            let mut k = linear(&xn, rows, &lw.wk)?;
            let mut v = linear(&xn, rows, &lw.wv)?;
            add_bias(&mut q, lw.bq.as_ref());
            add_bias(&mut k, lw.bk.as_ref());
            add_bias(&mut v, lw.bv.as_ref());
            self.rope.apply(&mut q, &positions, cfg.n_heads);
            self.rope.apply(&mut k, &positions, cfg.n_kv_heads);

            for (i, chunk) in batch.iter_mut().enumerate() {
                let span = spans[i].clone();
                let out = &mut attn[span.start * q_dim..span.end * q_dim];
                if failed[i].is_some() {
                    out.fill(0.0);
                    continue;
                }
                let (ks, vs) = (
                    &k[span.start * kv_dim..span.end * kv_dim],
                    &v[span.start * kv_dim..span.end * kv_dim],
                );
                if let Err(e) = chunk.kv.write(layer, chunk.start_pos, ks, vs) {
                    failed[i] = Some(e.into());
                    out.fill(0.0);
                    continue;
                }
                let table = chunk.kv.table().to_vec();
                let reader = chunk.kv.reader();
                let qs = &q[span.start * q_dim..span.end * q_dim];
                if let Err(e) = paged_attention(
                    &reader,
                    &table,
                    layer,
                    &self.shape,
                    qs,
                    &positions[span.clone()],
                    out,
                ) {
                    failed[i] = Some(e.into());
                    out.fill(0.0);
                }
            }

            let o = linear(&attn, rows, &lw.wo)?;
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);

            rms_norm(&x, &lw.mlp_norm, cfg.rms_norm_eps, &mut xn);
            let xt = Tensor::from_slice(&xn, (rows, hidden), &Device::Cpu).map_err(compute)?;
            let gate = xt
                .matmul(&lw.w_gate.t().map_err(compute)?)
                .map_err(compute)?;
            let up = xt.matmul(&lw.w_up.t().map_err(compute)?).map_err(compute)?;
            let h = (gate.silu().map_err(compute)? * up).map_err(compute)?;
            let down = h
                .matmul(&lw.w_down.t().map_err(compute)?)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(compute)?;
            x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
        }

        // Final norm and vocabulary projection only for the rows asked for.
        let mut want = Vec::new();
        for (i, chunk) in batch.iter().enumerate() {
            let span = spans[i].clone();
            if failed[i].is_some() || span.is_empty() {
                continue;
            }
            match chunk.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => want.push(span.end - 1),
                LogitsWanted::All => want.extend(span),
            }
        }
        let mut logits_rows: Vec<Vec<f32>> = Vec::new();
        if !want.is_empty() {
            let mut sel = Vec::with_capacity(want.len() * hidden);
            for &r in &want {
                sel.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            let mut seln = vec![0.0f32; sel.len()];
            rms_norm(&sel, &self.w.final_norm, cfg.rms_norm_eps, &mut seln);
            let flat = linear(&seln, want.len(), &self.w.lm_head)?;
            logits_rows = flat
                .chunks_exact(cfg.vocab_size)
                .map(<[f32]>::to_vec)
                .collect();
        }
        let mut rows_iter = want.iter().copied().zip(logits_rows);
        let mut results = Vec::with_capacity(batch.len());
        for (i, chunk) in batch.iter().enumerate() {
            if let Some(e) = failed[i].take() {
                results.push(Err(e));
                continue;
            }
            let span = spans[i].clone();
            let n = match chunk.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => usize::from(!span.is_empty()),
                LogitsWanted::All => span.len(),
            };
            let mut mine = Vec::with_capacity(n);
            for _ in 0..n {
                if let Some((_, row)) = rows_iter.next() {
                    mine.push(row);
                }
            }
            results.push(Ok(mine));
        }
        Ok(results)
    }
}
