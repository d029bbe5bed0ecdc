//! f32 activations against quantized weights: each task dequantizes a
//! panel of weight rows into an f32 buffer once, then every activation row
//! passes over it in small register tiles.
//!
//! # Arithmetic (the same on every path, to the bit)
//! - A weight is dequantized to f32 by [`super::scalar`]'s operations
//!   (`q * s`, or `fma(q, s, o)` in the formats with an offset; an exact
//!   conversion for F16 and BF16), as
//!   [`super::QMatrix::dequantize_row`] computes it, on every path.
//! - Output `(t, r)` keeps eight lanes; lane `j` accumulates
//!   `x[t, k] * w[r, k]` for `k = j, j + 8, j + 16, ...` in order, each step a
//!   fused multiply-add. The lanes are then summed as
//!   `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
//!
//! Nothing in that depends on the batch, on a row's place in it, on the tile
//! shape or on the thread, so a sequence computes the same bits alone,
//! batched, chunked or whole; and the AVX-512, AVX2 and portable paths
//! agree to the bit (AVX-512 keeps two of these eight-lane chains in one
//! register, one per half: see `x86_512`) (the portable one uses `f32::mul_add`, which is a single
//! instruction where the target has FMA and a correctly rounded library
//! call where it has not).
//!
//! # Cost
//! From three activation rows on, the dequantization is paid once per call
//! per weight (under one instruction per weight), then `rows` multiply-adds
//! per weight run from L1/L2 at the FMA units' rate. One or two rows take
//! the fused path instead (dequantized in registers, never stored), bound by
//! reading the weight bytes.

use super::{scalar, QFormat, QMatrix};
#[cfg(target_arch = "x86_64")]
use super::{x86, x86_512};
use crate::cpu::Path;

/// Weight rows per task (and per dequantized panel) for small batches; a
/// multiple of the register tiles' 4 and 8.
const PANEL: usize = 16;

/// Weight rows per panel from [`WIDE_ROWS`] activation rows on: the panel
/// (at most 64 x 1536 f32, 384 KiB) stays in L2 while the activations
/// stream past it, a quarter as often as with 16-row panels.
const WIDE_PANEL: usize = 64;

/// Activation rows from which [`WIDE_PANEL`] is used.
const WIDE_ROWS: usize = 48;

/// Eight-lane reduction in the fixed order of the module docs.
#[inline]
pub(super) fn reduce(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Write-only view of the output shared by the tasks; each task writes the
/// columns of its own weight rows.
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `matmul`); the pointer outlives
// the parallel section, which ends before `out` is used again.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

thread_local! {
    /// One dequantized panel per thread, reused across calls.
    static PANEL_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[t, r] = sum_k x[t, k] * w[r, k]`: `x` is `[rows, w.cols()]` and
/// `out` `[rows, w.rows()]`, both row-major.
///
/// Many rows (a long prompt chunk) go in blocks whose activations stay in
/// L2 while every panel passes over them; each panel is dequantized once
/// per block, a small cost beside the block's multiply-adds. All (block,
/// panel) pairs are one parallel section, so the cores stay evenly loaded
/// however few panels a matrix has (576 rows are only nine wide panels).
pub(super) fn matmul(kernel: Path, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), rows * k, "activation shape");
    assert_eq!(out.len(), rows * n, "output shape");
    if rows == 0 || n == 0 {
        return;
    }
    let block = rows.min((ROW_BLOCK_BYTES / (4 * k.max(1))).max(WIDE_ROWS));
    let rb = w.row_bytes();
    let ptr = OutPtr(out.as_mut_ptr());
    let prows = if block >= WIDE_ROWS {
        WIDE_PANEL
    } else {
        PANEL
    };
    let panels = n.div_ceil(prows);
    // Task `i`: rows of block `i / panels` against panel `i % panels`, so a
    // thread's consecutive tasks share their activations.
    let task = |i: usize| {
        let ptr = &ptr;
        let (t0, r0) = ((i / panels) * block, (i % panels) * prows);
        let (nt, nr) = (block.min(rows - t0), prows.min(n - r0));
        let xs = &x[t0 * k..(t0 + nt) * k];
        let bytes = &w.data[r0 * rb..(r0 + nr) * rb];
        // SAFETY (both): the kernel writes (t0 + t, r0 + j) for t < nt,
        // j < nr: inside `out`, and owned by this task alone (tasks are
        // disjoint blocks of rows and columns).
        let at = unsafe { ptr.0.add(t0 * n + r0) };
        if kernel.fuses(nt) {
            unsafe { kernel.fused(w.format, xs, nt, k, bytes, at, n) };
            return;
        }
        PANEL_BUF.with_borrow_mut(|buf| {
            buf.resize(prows * k, 0.0);
            kernel.fill_panel(w.format, bytes, nr, prows, k, buf);
            // The next panel's weights come from memory while this one's
            // multiply-adds run, a few cache lines per register tile (a
            // thread's tasks are mostly consecutive panels; another
            // thread's find them in L3).
            let ahead = next_panel(w, i % panels, prows);
            unsafe { kernel.panel(xs, nt, k, buf, prows, nr, at, n, ahead) };
        });
    };
    let tasks = rows.div_ceil(block) * panels;
    // Small calls are not worth waking the pool for.
    if n * k * rows < 1 << 15 {
        (0..tasks).for_each(task);
    } else {
        crate::tasks::each(tasks, task);
    }
}

/// The bytes of panel `p + 1` of `w` (panels of `prows` rows), empty
/// after the last: what panel `p`'s multiply prefetches in either class
/// (`super::ahead`), the panel its thread most likely fills next.
pub(super) fn next_panel(w: &QMatrix, p: usize, prows: usize) -> &[u8] {
    let rb = w.row_bytes();
    let end = |panel: usize| (panel * prows).min(w.rows) * rb;
    &w.data[end(p + 1)..end(p + 2)]
}

/// Activation bytes per row block of [`matmul`] (half of a 512 KiB L2).
const ROW_BLOCK_BYTES: usize = 256 << 10;

impl Path {
    /// Dequantize whole blocks into `out`, rows contiguous.
    ///
    /// # Panics
    /// If the path is not [`Path::available`] on this CPU (so the SIMD
    /// builds below only run where their features are).
    pub(super) fn dequantize(self, format: QFormat, w: &[u8], out: &mut [f32]) {
        assert!(
            self.available(),
            "{} kernels on a CPU without them",
            self.name()
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has the features (asserted).
            Self::Avx2 => unsafe { x86::dequantize(format, w, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Self::Avx512 => unsafe { x86_512::dequantize(format, w, out) },
            _ => scalar::dequantize_row(format, w, out),
        }
    }

    /// Dequantize `live` rows (`w`) into a panel of `prows` rows in this
    /// path's layout (the AVX-512 one pair-interleaves rows); rows past
    /// the matrix's end are zeros, whose results nobody reads.
    fn fill_panel(
        self,
        format: QFormat,
        w: &[u8],
        live: usize,
        prows: usize,
        k: usize,
        buf: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if self == Self::Avx512 {
            assert!(self.available(), "avx512 kernels on a CPU without them");
            // SAFETY: the CPU has the features (asserted).
            unsafe { x86_512::dequantize_pairs(format, w, live, prows, k, buf) };
            return;
        }
        self.dequantize(format, w, &mut buf[..live * k]);
        buf[live * k..prows * k].fill(0.0);
    }

    /// Every row of `x` against the `PANEL` rows of `panel`; writes
    /// `out[t * stride + j]` for `j < live`.
    ///
    /// # Safety
    /// `out` must be valid for those writes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn panel(
        self,
        x: &[f32],
        rows: usize,
        k: usize,
        panel: &[f32],
        prows: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        ahead: &[u8],
    ) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the panel was filled by `fill_panel`, which checked
            // the features; `out` by the caller.
            Self::Avx2 => unsafe { x86::panel(x, rows, k, panel, prows, live, out, stride, ahead) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (pair-interleaved panel).
            Self::Avx512 => unsafe {
                x86_512::panel(x, rows, k, panel, prows, live, out, stride, ahead)
            },
            _ => {
                let _ = ahead; // no prefetch hints on the portable path
                for t in 0..rows {
                    let xt = &x[t * k..(t + 1) * k];
                    for j in 0..live {
                        let v = dot(xt, &panel[j * k..(j + 1) * k]);
                        // SAFETY: by the caller.
                        unsafe { *out.add(t * stride + j) = v };
                    }
                }
            }
        }
    }
}

impl Path {
    /// Whether `rows` activation rows take the fused path.
    fn fuses(self, rows: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self != Self::Portable {
            return rows <= x86::FUSED_ROWS;
        }
        let _ = rows;
        false
    }

    /// # Safety
    /// Only when [`Self::fuses`]; `out` valid for `rows` rows of `stride`
    /// and the rows of `w`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn fused(
        self,
        format: QFormat,
        x: &[f32],
        rows: usize,
        k: usize,
        w: &[u8],
        out: *mut f32,
        stride: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            assert!(
                self.available(),
                "{} kernels on a CPU without them",
                self.name()
            );
            // SAFETY: `fuses` is only true for the SIMD paths, whose
            // features the CPU has (asserted); `out` by the caller.
            unsafe {
                if self == Self::Avx512 {
                    x86_512::fused(format, x, rows, k, w, out, stride)
                } else {
                    x86::fused(format, x, rows, k, w, out, stride)
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!(
            "no fused path off x86-64: {format:?} {rows} {k} {} {out:?} {stride}",
            w.len()
        )
    }
}

/// One output on the portable path, in the module's order.
pub(super) fn dot(x: &[f32], w: &[f32]) -> f32 {
    let mut l = [0.0f32; 8];
    for (xs, ws) in x.chunks_exact(8).zip(w.chunks_exact(8)) {
        for q in 0..8 {
            l[q] = xs[q].mul_add(ws[q], l[q]);
        }
    }
    reduce(l)
}
