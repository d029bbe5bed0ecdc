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
//! Activations are quantized per row to 8 bits in blocks of 32
//! ([`QuantizedActs`]: a scale `d_a`, 32 `i8`, and `s = d_a * sum(q)`), so a
//! block's dot product is an integer dot product and two multiplies:
//! `Q4_1 . x = d_w d_a sum(q_w q_a) + m_w s` and `Q8_0 . x = d_w d_a sum(q_w q_a)`.
//! This is what llama.cpp does; the result is close to the f32 product but
//! not equal to it (the `--exact` mode keeps f32 weights for that).
//!
//! # Determinism
//! Every output element is computed by the same sequence of floating-point
//! operations whatever the batch size, the position of its row in the batch,
//! or the thread that computes it: integer block sums are exact, and each
//! output accumulates its blocks in block order into the same lanes. So a
//! sequence decodes to the same tokens alone or batched, prompt chunked or
//! whole, and a disaggregated run equals the reference engine token for
//! token. (The AVX2 and scalar paths differ from each other in summation
//! order; one process always uses one of them.)
//!
//! # Cost
//! One pass over the weight bytes per call whatever the batch: each weight
//! block is unpacked once and used for up to [`ROW_GROUP`] activation rows
//! while it is in registers, so at batch 1 the call is bound by memory
//! bandwidth and its cost per row falls as the batch grows. Output rows are
//! split across the rayon pool (every core).
//!
//! # Paths
//! [`Kernel::detect`] picks the AVX2 (with FMA and F16C) path at run time
//! when the CPU has it, else the portable scalar path, which is also the
//! reference the fast path is tested against. Nothing depends on the
//! compile-time target, so one binary runs everywhere.

mod gemm;
#[cfg(target_arch = "x86_64")]
mod gemm_x86;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use rayon::prelude::*;
use thiserror::Error;

/// Values per quantization block (both formats).
pub const BLOCK: usize = 32;

/// Activation rows that share one unpacked weight block.
pub const ROW_GROUP: usize = 4;

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
        if cols % BLOCK != 0 || cols / BLOCK > MAX_BLOCKS {
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

    /// Bytes held (what one call reads).
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    fn row_bytes(&self) -> usize {
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
        Kernel::detect().dequantize(self.format, self.row(r), out);
    }
}

/// Activations quantized to 8 bits per 32-value block, row-major.
#[derive(Clone, Debug, Default)]
pub struct QuantizedActs {
    rows: usize,
    cols: usize,
    /// `rows * cols` quantized values.
    qs: Vec<i8>,
    /// Per block: scale `d_a`.
    d: Vec<f32>,
    /// Per block: `d_a * sum(q)`.
    s: Vec<f32>,
}

impl QuantizedActs {
    /// Quantize `x` (`rows` rows of `cols` values; `cols` a multiple of 32).
    pub fn quantize(x: &[f32], rows: usize, cols: usize) -> Self {
        assert!(
            cols % BLOCK == 0,
            "activation width {cols} is not whole blocks"
        );
        assert_eq!(x.len(), rows * cols, "activation length");
        let blocks = rows * cols / BLOCK;
        let mut acts = Self {
            rows,
            cols,
            qs: vec![0; rows * cols],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
        };
        for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
            let (d, s) = scalar::quantize_block(xs, &mut acts.qs[b * BLOCK..(b + 1) * BLOCK]);
            acts.d[b] = d;
            acts.s[b] = s;
        }
        acts
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }
}

/// One activation row as the inner loops see it.
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl QuantizedActs {
    fn row(&self, t: usize) -> ActRow<'_> {
        let nb = self.blocks_per_row();
        ActRow {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            d: &self.d[t * nb..(t + 1) * nb],
            s: &self.s[t * nb..(t + 1) * nb],
        }
    }
}

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust; the reference.
    Scalar,
    /// AVX2 with FMA and F16C (x86-64).
    Avx2,
}

impl Kernel {
    /// The fastest implementation this CPU runs (checked once per process).
    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if x86::available() {
                return Kernel::Avx2;
            }
            Kernel::Scalar
        })
    }

    /// Name for logs and benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
        }
    }

    /// Dot products of one weight row with every activation row, into
    /// `out[t]`.
    fn row(self, format: QFormat, w: &[u8], acts: &[ActRow<'_>], out: &mut [f32]) {
        match self {
            Self::Scalar => scalar::row(format, w, acts, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only chosen when `x86::available()` saw
            // AVX2, FMA and F16C on this CPU.
            Self::Avx2 => unsafe { x86::row(format, w, acts, out) },
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx2 => scalar::row(format, w, acts, out),
        }
    }
}

/// Activation rows one weight row meets per call (about 40 KiB of 8-bit
/// activations at the widest SmolLM2 row, so they stay in L2).
const ACT_TILE: usize = 64;

/// Weight rows one parallel task computes (a few KiB of blocks, so the
/// rows stay in L1 while every activation row group passes over them).
const ROWS_PER_TASK: usize = 16;

/// Write-only view of the output shared by the tasks; each task writes a
/// disjoint set of columns.
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `matmul`); the pointer outlives
// the parallel section, which ends before `out` is used again.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[t, r] = sum_k x[t, k] * w[r, k]` for every activation row `t` and
/// weight row `r`: `out` is `[acts.rows(), w.rows()]`, row-major.
pub fn matmul(w: &QMatrix, acts: &QuantizedActs, out: &mut [f32]) {
    matmul_with(Kernel::detect(), w, acts, out);
}

/// [`matmul`] with a chosen implementation (tests compare them).
pub fn matmul_with(kernel: Kernel, w: &QMatrix, acts: &QuantizedActs, out: &mut [f32]) {
    assert_eq!(w.cols, acts.cols, "inner dimensions");
    let (t_rows, n) = (acts.rows, w.rows);
    assert_eq!(out.len(), t_rows * n, "output shape");
    let rows: Vec<ActRow<'_>> = (0..t_rows).map(|t| acts.row(t)).collect();
    let ptr = OutPtr(out.as_mut_ptr());
    let task = |task: usize| {
        let ptr = &ptr;
        let r0 = task * ROWS_PER_TASK;
        let r1 = (r0 + ROWS_PER_TASK).min(n);
        let mut col = [0.0f32; ACT_TILE];
        // Activation rows in tiles that stay in cache while this task's
        // weight rows pass over them.
        for (i, tile) in rows.chunks(ACT_TILE).enumerate() {
            for r in r0..r1 {
                let c = &mut col[..tile.len()];
                kernel.row(w.format, w.row(r), tile, c);
                for (j, v) in c.iter().enumerate() {
                    let t = i * ACT_TILE + j;
                    // SAFETY: t < t_rows and r < n, so the index is in
                    // `out`; element (t, r) belongs to this task alone
                    // (tasks own disjoint weight-row ranges).
                    unsafe { *ptr.0.add(t * n + r) = *v };
                }
            }
        }
    };
    let tasks = n.div_ceil(ROWS_PER_TASK);
    // Small calls are not worth waking the pool for.
    if n * w.cols * t_rows < 1 << 15 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// `out[t, r] = sum_k x[t, k] * w[r, k]` with f32 activations
/// (`x` is `[rows, w.cols()]`, `out` is `[rows, w.rows()]`).
pub fn matmul_f32_with(kernel: Kernel, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    gemm::matmul(kernel, w, x, rows, out);
}

#[cfg(test)]
mod tests;
