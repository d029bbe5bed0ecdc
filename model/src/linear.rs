//! [`Projection`]: one or more weight matrices applied to the same input,
//! the way the forward pass needs them (Q, K and V from one normed input;
//! gate and up from another).
//!
//! - Dense (exact mode): one candle f32 matmul per matrix, as before.
//! - Quantized: the matrices' blocks are stacked by rows at build time, so a
//!   call quantizes the input once and makes one pass over all the weights
//!   (one dispatch to the thread pool instead of three). Each output element
//!   is independent of the batch (see `kvmesh_kernels::quant`).
//!
//! Matrices of different block formats (a Q4_K_M file's Q4_K q/k next to
//! its Q6_K v) stay in their own blocks: one pass each over the input
//! quantized once (`quant::matmul_each`), their rows interleaved into the
//! stacked layout afterwards where a caller wants it. A mix of f32 and blocks
//! (an f32 tensor beside quantized ones) runs dense, with the blocks
//! dequantized at build.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kvmesh_kernels::quant::{self, QMatrix};

use crate::error::{ModelError, Result};
use crate::weights::Matrix;

fn compute(e: impl std::fmt::Display) -> ModelError {
    ModelError::Compute {
        detail: e.to_string(),
    }
}

enum Kind {
    Dense(Vec<Tensor>),
    Quant(Arc<QMatrix>),
    /// Parts whose formats differ, each run on its own.
    QuantParts(Vec<Arc<QMatrix>>),
}

/// Matrices sharing an input, with their output widths.
pub(crate) struct Projection {
    kind: Kind,
    widths: Vec<usize>,
    cols: usize,
}

impl std::fmt::Debug for Projection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projection")
            .field("quantized", &self.is_quantized())
            .field("widths", &self.widths)
            .field("cols", &self.cols)
            .finish()
    }
}

impl Projection {
    /// Build from matrices of equal input width.
    pub(crate) fn new(parts: &[&Matrix]) -> Result<Self> {
        let widths = parts.iter().map(|m| m.shape().0).collect();
        let cols = parts.first().map_or(0, |m| m.shape().1);
        let quants: Option<Vec<&Arc<QMatrix>>> = parts
            .iter()
            .map(|m| match m {
                Matrix::Quant(q) => Some(q),
                Matrix::Dense(_) => None,
            })
            .collect();
        // Quantized blocks are streamed every step: each projection's in
        // huge pages (`kvmesh_kernels::huge`), a copy of the loaded ones.
        let kind = match quants.as_deref() {
            Some([one]) => Kind::Quant(Arc::new(one.in_huge_pages())),
            Some(arcs) => {
                let q: Vec<&QMatrix> = arcs.iter().map(|a| a.as_ref()).collect();
                match QMatrix::stack_in_huge_pages(&q) {
                    Ok(stacked) => Kind::Quant(Arc::new(stacked)),
                    // Different formats: each in its own blocks.
                    Err(_) => {
                        Kind::QuantParts(arcs.iter().map(|a| Arc::new(a.in_huge_pages())).collect())
                    }
                }
            }
            None => Kind::Dense(dense_all(parts)?),
        };
        Ok(Self { kind, widths, cols })
    }

    /// Bytes of weights one call reads (the blocks as stored, or f32).
    pub(crate) fn weight_bytes(&self) -> usize {
        match &self.kind {
            Kind::Quant(w) => w.byte_len(),
            Kind::QuantParts(ws) => ws.iter().map(|w| w.byte_len()).sum(),
            Kind::Dense(_) => self.params() * 4,
        }
    }

    /// Weights (multiply-adds per input row).
    pub(crate) fn params(&self) -> usize {
        self.widths.iter().sum::<usize>() * self.cols
    }

    /// The one quantized matrix this runs, if it is one.
    pub(crate) fn quant_matrix(&self) -> Option<&Arc<QMatrix>> {
        match &self.kind {
            Kind::Quant(w) => Some(w),
            _ => None,
        }
    }

    /// Whether this runs the quantized kernels.
    pub(crate) fn is_quantized(&self) -> bool {
        matches!(self.kind, Kind::Quant(_) | Kind::QuantParts(_))
    }

    /// `x [rows, cols]` through every matrix into `outs[i]` (`[rows,
    /// width_i]`, row-major), reusing their allocations; `stacked` is
    /// scratch for a quantized projection of several matrices. Nothing is
    /// allocated once the buffers have grown to the batch: a fresh
    /// multi-megabyte buffer per call costs a page fault per 4 KiB, which on
    /// a virtual machine took as long as the multiply-adds of a prompt's
    /// MLP.
    pub(crate) fn apply_into(
        &self,
        x: &[f32],
        rows: usize,
        outs: &mut [&mut Vec<f32>],
        stacked: &mut Vec<f32>,
    ) -> Result<()> {
        if outs.len() != self.widths.len() {
            return Err(compute(format!(
                "{} outputs for a projection of {} matrices",
                outs.len(),
                self.widths.len()
            )));
        }
        match &self.kind {
            Kind::Dense(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    **out = dense_linear(x, rows, w)?;
                }
            }
            Kind::QuantParts(ws) => {
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    out.resize(rows * w.rows(), 0.0);
                }
                let mut views: Vec<&mut [f32]> =
                    outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                quant::matmul_each(ws, x, rows, &mut views);
            }
            Kind::Quant(w) => {
                let total = w.rows();
                if let [out] = outs {
                    return self.apply_stacked(x, rows, out);
                }
                self.apply_stacked(x, rows, stacked)?;
                for (out, &width) in outs.iter_mut().zip(&self.widths) {
                    out.clear();
                    out.reserve(rows * width);
                }
                for row in stacked.chunks_exact(total) {
                    let mut at = 0;
                    for (out, &width) in outs.iter_mut().zip(&self.widths) {
                        out.extend_from_slice(&row[at..at + width]);
                        at += width;
                    }
                }
            }
        }
        Ok(())
    }

    /// Every part's output side by side in one buffer: row `t` of `out` is
    /// part 0's row `t`, then part 1's, and so on (the layout a stacked
    /// quantized matrix produces directly, with no split copy).
    pub(crate) fn apply_stacked(&self, x: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<()> {
        match &self.kind {
            Kind::Quant(w) => {
                out.resize(rows * w.rows(), 0.0);
                quant::matmul(w, x, rows, out);
            }
            Kind::QuantParts(ws) => {
                let mut outs: Vec<Vec<f32>> =
                    ws.iter().map(|w| vec![0.0; rows * w.rows()]).collect();
                let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
                quant::matmul_each(ws, x, rows, &mut views);
                interleave(&outs, &self.widths, rows, out);
            }
            Kind::Dense(ws) => {
                let parts = ws
                    .iter()
                    .map(|w| dense_linear(x, rows, w))
                    .collect::<Result<Vec<_>>>()?;
                out.clear();
                for t in 0..rows {
                    for (part, &width) in parts.iter().zip(&self.widths) {
                        out.extend_from_slice(&part[t * width..(t + 1) * width]);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The LM head's projection and the embedding to look rows up in: a tied
/// head (the embedding's storage) keeps one copy of its blocks, the
/// projection's in huge pages, for both; an untied one leaves the
/// embedding as loaded.
pub(crate) fn head_and_embedding(head: &Matrix, embed: Matrix) -> Result<(Projection, Matrix)> {
    let projection = Projection::new(&[head])?;
    let embed = match projection.quant_matrix() {
        Some(blocks) if embed.same_storage(head) => Matrix::Quant(Arc::clone(blocks)),
        _ => embed,
    };
    Ok((projection, embed))
}

/// Row `t` of `out` is part 0's row `t`, then part 1's, and so on.
fn interleave(parts: &[Vec<f32>], widths: &[usize], rows: usize, out: &mut Vec<f32>) {
    out.clear();
    for t in 0..rows {
        for (part, &width) in parts.iter().zip(widths) {
            out.extend_from_slice(&part[t * width..(t + 1) * width]);
        }
    }
}

fn dense_all(parts: &[&Matrix]) -> Result<Vec<Tensor>> {
    parts
        .iter()
        .map(|m| m.to_dense().map_err(compute))
        .collect()
}

/// `x [rows, in] @ w[out, in]^T` as a flat row-major vector (f32, candle).
fn dense_linear(x: &[f32], rows: usize, w: &Tensor) -> Result<Vec<f32>> {
    let (_, inner) = w.dims2().map_err(compute)?;
    let xt = Tensor::from_slice(x, (rows, inner), &Device::Cpu).map_err(compute)?;
    xt.matmul(&w.t().map_err(compute)?)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(compute)
}
