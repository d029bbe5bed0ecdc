//! Quantized matrix multiplication over GGUF block formats, used as they are
//! stored in the file (no dequantizing at load).
//!
//! # Formats
//! Weights are rows of 32-value blocks, exactly the GGUF bytes:
//! - [`QFormat::Q4_1`]: 20 bytes per block, `d: f16, m: f16, qs: [u8; 16]`;
//!   value `i` is `fma(q_i, d, m)`, with `q_i` the low nibble of `qs[i]` for
//!   `i < 16` and the high nibble of `qs[i - 16]` otherwise.
//! - [`QFormat::Q8_0`]: 34 bytes per block, `d: f16, qs: [i8; 32]`; value
//!   `i` is `qs[i] * d`.
//!
//! Activations stay f32. A call dequantizes each weight once, in
//! registers or into a small panel buffer, and multiplies in f32 with fused
//! multiply-adds (see [`gemm`] for the order of operations). So the
//! product differs from the `--exact` f32 weights only by the weights'
//! quantization, and not by the activations' as llama.cpp's 8-bit-activation
//! kernels do.
//!
//! # Determinism
//! Every output element is computed by the same sequence of floating-point
//! operations whatever the batch size, the position of its row in the batch,
//! the register tile, the thread, or the path (AVX-512, AVX2 or portable): a
//! sequence decodes to the same tokens alone or batched, prompt chunked or
//! whole, and a disaggregated run equals the reference engine token for
//! token.
//!
//! # Cost
//! - One or two activation rows (a decode step of one or two sequences):
//!   each weight block is dequantized in registers and used at once, so the
//!   call is bound by reading the weight bytes (memory bandwidth).
//! - More rows: each task dequantizes a panel of 16 (from 48 rows, 64)
//!   weight rows into an L1/L2-resident f32 buffer once, then every
//!   activation row passes over it in 3 x 4 register tiles, twelve
//!   independent multiply-add chains, bound by the FMA units.
//!
//! Output rows are split across the rayon pool (every core).
//!
//! # Paths
//! [`crate::cpu::path`] (the process's path, chosen once) picks AVX-512
//! (`x86_512`), AVX2 with FMA and F16C (`x86`), or the portable path
//! (`f32::mul_add`), which is also the reference the fast paths are tested
//! against, to the bit. Nothing depends on the compile-time target, so one
//! binary runs everywhere. [`matmul_with`] runs a chosen path (tests,
//! benchmarks).

mod gemm;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

use thiserror::Error;

pub use crate::cpu::Path;

/// Values per quantization block (both formats).
pub const BLOCK: usize = 32;

/// Widest inner dimension the kernels take (blocks per row), so a row's
/// scales fit a stack buffer: 32,768 columns, beyond any Llama-family
/// hidden or intermediate size.
pub const MAX_BLOCKS: usize = 1024;

/// A GGUF block format the kernels run directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QFormat {
    /// 4-bit with a per-block scale and minimum.
    Q4_1,
    /// 8-bit with a per-block scale.
    Q8_0,
}

impl QFormat {
    /// Bytes per 32-value block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// The format's name as GGUF tools write it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }
}

/// Why a quantized matrix could not be built.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum QuantError {
    /// The inner dimension is not a whole number of blocks, or too wide.
    #[error(
        "{cols} columns: not a multiple of the {BLOCK}-value block, or over {} blocks",
        MAX_BLOCKS
    )]
    Columns {
        /// The inner dimension.
        cols: usize,
    },
    /// The byte count does not match the shape.
    #[error("{format} matrix [{rows}, {cols}] needs {expected} bytes, got {got}")]
    Length {
        /// Format name.
        format: &'static str,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Matrices joined by rows must agree in format and columns.
    #[error("cannot stack a {a} matrix of {a_cols} columns with a {b} matrix of {b_cols}")]
    Stack {
        /// First format.
        a: &'static str,
        /// Its columns.
        a_cols: usize,
        /// Second format.
        b: &'static str,
        /// Its columns.
        b_cols: usize,
    },
}

/// A `[rows, cols]` weight matrix of GGUF blocks, row-major: row `r` is
/// `cols / 32` consecutive blocks.
#[derive(Clone)]
pub struct QMatrix {
    format: QFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl QMatrix {
    /// Wrap GGUF bytes of a `[rows, cols]` matrix (checked lengths).
    pub fn from_bytes(
        format: QFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, QuantError> {
        if !cols.is_multiple_of(BLOCK) || cols / BLOCK > MAX_BLOCKS {
            return Err(QuantError::Columns { cols });
        }
        let expected = rows
            .checked_mul(cols / BLOCK)
            .and_then(|b| b.checked_mul(format.block_bytes()));
        if expected != Some(data.len()) {
            return Err(QuantError::Length {
                format: format.name(),
                rows,
                cols,
                expected: expected.unwrap_or(usize::MAX),
                got: data.len(),
            });
        }
        Ok(Self {
            format,
            rows,
            cols,
            data,
        })
    }

    /// Block format.
    pub fn format(&self) -> QFormat {
        self.format
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGUF blocks as stored, row-major (what a device copy uploads).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Bytes held (what one call reads).
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one row of blocks.
    pub(super) fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    /// The blocks of row `r`.
    fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// Reorder rows: row `i` of the result is row `order[i]` of `self`
    /// (used to undo llama.cpp's Q/K row permutation at load; whole rows
    /// move, blocks are not touched). `order` must be a permutation.
    pub fn permute_rows(&self, order: &[usize]) -> Self {
        assert_eq!(order.len(), self.rows, "a permutation of every row");
        let mut data = Vec::with_capacity(self.data.len());
        for &r in order {
            data.extend_from_slice(self.row(r));
        }
        Self {
            data,
            ..self.clone()
        }
    }

    /// Stack matrices of one format and width by rows (Q, K and V as one
    /// projection: one pass, one activation quantization, one dispatch).
    pub fn stack(parts: &[&QMatrix]) -> Result<Self, QuantError> {
        let Some(first) = parts.first() else {
            return Err(QuantError::Length {
                format: "stack",
                rows: 0,
                cols: 0,
                expected: 1,
                got: 0,
            });
        };
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        let mut rows = 0;
        for p in parts {
            if p.format != first.format || p.cols != first.cols {
                return Err(QuantError::Stack {
                    a: first.format.name(),
                    a_cols: first.cols,
                    b: p.format.name(),
                    b_cols: p.cols,
                });
            }
            data.extend_from_slice(&p.data);
            rows += p.rows;
        }
        Ok(Self {
            format: first.format,
            rows,
            cols: first.cols,
            data,
        })
    }

    /// Dequantize row `r` into `out` (`cols` values): embedding lookups,
    /// and the exact reference in tests.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "one row of output");
        crate::cpu::path().dequantize(self.format, self.row(r), out);
    }
}

/// Which implementation runs: the crate-wide [`Path`] (kept under this
/// name for callers of the quantized kernels; `Kernel::detect()` is the
/// best path of this CPU, [`crate::cpu::path`] the one in use).
pub use crate::cpu::Path as Kernel;

/// `out[t, r] = sum_k x[t, k] * w[r, k]` for every activation row `t` and
/// weight row `r`: `x` is `[rows, w.cols()]` and `out` `[rows, w.rows()]`,
/// both row-major.
///
/// # Panics
/// If the slice lengths disagree with the shapes (a caller bug).
pub fn matmul(w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    matmul_with(crate::cpu::path(), w, x, rows, out);
}

/// [`matmul`] with a chosen path (tests and benchmarks compare them).
///
/// # Panics
/// If this CPU lacks `kernel` ([`Path::available`]).
pub fn matmul_with(kernel: Path, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    gemm::matmul(kernel, w, x, rows, out);
}

#[cfg(test)]
mod tests;
