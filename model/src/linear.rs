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
//! A mix (say a K-quant tensor the kernels do not run, dequantized at load,
//! next to Q4_1 ones) runs dense, with the blocks dequantized at build.

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
            .field("quantized", &matches!(self.kind, Kind::Quant(_)))
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
        let kind = match quants.as_deref() {
            Some([one]) => Kind::Quant(Arc::clone(one)),
            Some(q) => {
                let q: Vec<&QMatrix> = q.iter().map(|a| a.as_ref()).collect();
                match QMatrix::stack(&q) {
                    Ok(stacked) => Kind::Quant(Arc::new(stacked)),
                    // Different formats: run them dense.
                    Err(_) => Kind::Dense(dense_all(parts)?),
                }
            }
            None => Kind::Dense(dense_all(parts)?),
        };
        Ok(Self { kind, widths, cols })
    }

    /// Whether this runs the quantized kernels.
    pub(crate) fn is_quantized(&self) -> bool {
        matches!(self.kind, Kind::Quant(_))
    }

    /// `x [rows, cols]` through every matrix: one `[rows, width_i]` output
    /// per matrix, row-major.
    pub(crate) fn apply(&self, x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        match &self.kind {
            Kind::Dense(ws) => ws.iter().map(|w| dense_linear(x, rows, w)).collect(),
            Kind::Quant(w) => {
                let total = w.rows();
                let mut out = vec![0.0f32; rows * total];
                quant::matmul(w, x, rows, &mut out);
                if self.widths.len() == 1 {
                    return Ok(vec![out]);
                }
                let mut parts: Vec<Vec<f32>> = self
                    .widths
                    .iter()
                    .map(|w| Vec::with_capacity(rows * w))
                    .collect();
                for row in out.chunks_exact(total) {
                    let mut at = 0;
                    for (p, &w) in parts.iter_mut().zip(&self.widths) {
                        p.extend_from_slice(&row[at..at + w]);
                        at += w;
                    }
                }
                Ok(parts)
            }
        }
    }

    /// [`Self::apply`] for a single matrix.
    pub(crate) fn apply_one(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        self.apply(x, rows)?
            .pop()
            .ok_or_else(|| compute("projection has no matrix"))
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
