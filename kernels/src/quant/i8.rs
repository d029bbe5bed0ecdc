//! The 8-bit-activation numerics class: activations quantized to int8 per
//! 32 values, multiplied with the weights' integer quants in integers, the
//! integer sums scaled in f32.
//!
//! # Arithmetic (every path, to the bit)
//! **Activations.** Row `t` of `x` is cut into groups of 32 values. A
//! group's scale is `d = amax / 127` (`amax` its largest magnitude) and its
//! quants `q_i = round_even(x_i * (127 / amax))`, in `[-127, 127]`; an
//! all-zero group, or one so small that `127 / amax` overflows, has
//! `d = 0`, `q = 0`. Per sub-block of 16 or 32 values
//! (the weight format's [`QFormat::sub_block`]) `B = sum q_i` (an integer)
//! and `XB = d * B` (one f32 rounding). This is done once per call
//! ([`Acts::quantize`]), by the path's group quantizer: portable, AVX2 or
//! AVX-512, each giving the portable one's bits.
//!
//! **Weights.** A weight is `w = q * s + o` with GGUF's signed integer quant
//! `q` and the sub-block's scale `s` and offset `o` exactly as
//! [`super::scalar::head`] and [`super::scalar::quants`] define them (`o`
//! only in the formats with an offset).
//!
//! **Dot product.** Output `(t, r)` keeps eight f32 lanes, zero at first.
//! Sub-block `k` of the row (in order) goes to lane `k % 8`:
//! `P_k = sum q_i x_i` over its 16 or 32 values, an exact integer, then
//! `lane = fma(float(P_k), s_k * d, lane)` and, with an offset,
//! `lane = fma(o_k, XB_k, lane)`. The lanes are summed as the f32 class
//! sums its lanes (`((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`).
//! Nothing depends on the batch, a row's place in it, the thread or the
//! path; an integer sum has one value whatever order a path adds in.
//!
//! # No overflow, no saturation
//! `|x_i| <= 127`. The largest `|q|` is 128 (Q8_0), so a sub-block's
//! `|P_k| <= 32 * 128 * 127 < 2^19`: exact in i32 and in f32. The x86 paths
//! multiply unsigned by signed bytes (`vpmaddubsw`, which saturates pairs to
//! i16, or VNNI's `vpdpbusd`, which does not): they take the quants plus a
//! bias making them unsigned (Q4_0 +8, Q5_0 +16, Q3_K +4, Q6_K +32, MXFP4
//! +16; at most 63, so a pair is at most `2 * 63 * 127 < 2^15`) and
//! subtract `bias * B` after the integer sum, or for Q8_0 `|q|` against `x`
//! with `q`'s sign (a pair at most `2 * 128 * 127 = 32512 < 2^15`; the
//! VNNI one-row kernel biases it by 128: `i8_x86_row::row_bias`). The
//! AVX2 kernels add as many pairs in i16 before widening them as fit
//! ([`pairs_in_i16`]): `G` pairs with `G * 2 * m * 127 < 2^15` for the
//! format's largest byte `m` ([`max_byte`]), a power of two. The panel
//! takes up to a sub-block's columns (the one-row kernel up to four
//! groups):
//! eight for the 4-bit formats (`8 * 2 * 15 * 127 = 30480`), four for
//! the 5-bit ones and MXFP4 (`4 * 2 * 31 * 127 = 31496`), Q2_K and Q3_K
//! (a 16-value sub-block's four), two for Q6_K (`2 * 2 * 63 * 127 =
//! 32004`); Q8_0's it widens one at a time.
//!
//! MXFP4's quants are its table values (`[-12, 12]`, exact in a signed
//! byte), biased to `[4, 28]` (16, a power of two as every bias here, so
//! the one-row kernel subtracts `B << 4`): a pair is at most
//! `2 * 28 * 127 = 7112`, its `|P_k| <= 32 * 12 * 127 < 2^14`. Its scale
//! `s_k = 2^(e - 128)` times `d` is one f32 multiplication, as for every
//! format (exact unless it leaves the normal range).
//!
//! F16 and BF16 weights are not quantized formats: in this class they run
//! the f32 class's kernels.
//!
//! # Cost
//! Quantizing the activations reads each once (rows x cols, beside rows x
//! cols x n multiply-adds). One or two activation rows: on x86 each
//! weight row is dotted straight from its blocks, a group decoded in a
//! register and multiplied at once ([`super::i8_x86_row`]; the portable
//! path unpacks a row into a buffer first). From
//! three rows the x86 panels decode a task's weight rows straight from
//! their blocks into an interleaved panel, once per call (or per share of
//! the rows, see [`task_shape`]), and every activation row passes over it.

use rayon::prelude::*;

use super::lines::Lines;
use super::{scalar, QFormat, QMatrix, GROUP};
use crate::cpu::Path;

/// Lanes of a dot product (sub-block `k` goes to lane `k % LANES`).
pub(super) const LANES: usize = 8;

/// How the x86 paths feed a format's quants to an unsigned-by-signed
/// byte product: `Some(bias)` adds `bias`, a power of two or zero (quants
/// then in `0..=63`), `None` (Q8_0) takes magnitudes and moves the sign to
/// the activation.
pub(super) const fn bias(f: QFormat) -> Option<u8> {
    match f {
        QFormat::Q4_0 => Some(8),
        QFormat::Q5_0 => Some(16),
        QFormat::Q3_K => Some(4),
        QFormat::Q6_K => Some(32),
        QFormat::MXFP4 => Some(16),
        QFormat::Q8_0 => None,
        _ => Some(0),
    }
}

/// The largest unsigned byte the x86 paths multiply for `f`: its largest
/// quant plus [`bias`] (Q8_0: the largest magnitude, 128, by the sign
/// trick). F16 and BF16 are not multiplied as bytes.
pub(super) const fn max_byte(f: QFormat) -> i32 {
    match f {
        QFormat::Q2_K => 3,
        QFormat::Q3_K => 7,
        QFormat::Q4_0 | QFormat::Q4_1 | QFormat::Q4_K => 15,
        QFormat::MXFP4 => 28,
        QFormat::Q5_0 | QFormat::Q5_1 | QFormat::Q5_K => 31,
        QFormat::Q6_K => 63,
        QFormat::Q8_0 => 128,
        QFormat::F16 | QFormat::BF16 => 0,
    }
}

/// How many of `f`'s `vpmaddubsw` pair sums (each at most `2 * m * 127`
/// in magnitude, `m` its [`max_byte`]) the AVX2 kernels add in i16 before
/// widening: the largest power of two up to `most` whose sum stays below
/// `2^15` (at least one).
pub(super) const fn pairs_in_i16(f: QFormat, most: usize) -> usize {
    let pair = 2 * max_byte(f) as usize * 127;
    let mut g = most;
    while g > 1 && g * pair >= 1 << 15 {
        g /= 2;
    }
    g
}

/// `n` rounded up to whole lanes.
pub(super) const fn padded(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

/// Activation rows quantized as the module says, each row's arrays padded
/// with zeros to whole lanes of sub-blocks (so a path may take eight
/// sub-blocks at a time: zeros leave a lane as it was).
#[derive(Default)]
pub(super) struct Acts {
    cols: usize,
    /// Quants, `stride8` per row (zeros past `cols`; a row starts on a
    /// cache line).
    pub q: Lines<i8>,
    /// Per group of 32, `n32` per row: scale, quant sum, scale times sum.
    pub d32: Vec<f32>,
    pub b32: Vec<i32>,
    pub xb32: Vec<f32>,
    /// The same per 16 values (`d16` repeats the group's scale).
    pub d16: Vec<f32>,
    pub b16: Vec<i32>,
    pub xb16: Vec<f32>,
    /// `q` with each chunk's groups in pairs for the one-row kernel,
    /// where a call takes it on a paired format (`super::i8_x86_pairs`);
    /// empty otherwise.
    pub pairs: Lines<i8>,
}

impl Acts {
    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Groups of 32 per row, padded.
    pub fn n32(&self) -> usize {
        padded(self.cols / GROUP)
    }

    /// Sub-blocks of 16 per row, padded.
    pub fn n16(&self) -> usize {
        padded(self.cols / 16)
    }

    /// Quant bytes per row.
    pub fn stride8(&self) -> usize {
        self.n32() * GROUP
    }

    /// Quantize `rows` rows of `cols` values (a multiple of 32), reusing
    /// the buffers.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert!(cols.is_multiple_of(GROUP) && x.len() == rows * cols);
        self.cols = cols;
        let (n32, n16, s8) = (self.n32(), self.n16(), self.stride8());
        // Resized, not cleared: each row's view writes all of its part,
        // padding included (zeroing the buffers first was a memset of the
        // whole activation quants per call).
        self.d32.resize(rows * n32, 0.0);
        self.xb32.resize(rows * n32, 0.0);
        self.b32.resize(rows * n32, 0);
        self.d16.resize(rows * n16, 0.0);
        self.xb16.resize(rows * n16, 0.0);
        self.b16.resize(rows * n16, 0);
        self.q.resize(rows * s8);
        let views = self
            .q
            .par_chunks_mut(s8)
            .zip(self.d32.par_chunks_mut(n32))
            .zip(self.b32.par_chunks_mut(n32))
            .zip(self.xb32.par_chunks_mut(n32))
            .zip(self.d16.par_chunks_mut(n16))
            .zip(self.b16.par_chunks_mut(n16))
            .zip(self.xb16.par_chunks_mut(n16))
            .zip(x.par_chunks_exact(cols))
            .map(
                |(((((((q, d32), b32), xb32), d16), b16), xb16), x)| RowView {
                    x,
                    q,
                    d32,
                    b32,
                    xb32,
                    d16,
                    b16,
                    xb16,
                },
            );
        // Small calls stay on this thread (one piece); large ones split
        // into pieces of at least 64 Ki values.
        let per = if rows * cols >= 1 << 16 {
            (1usize << 16).div_ceil(cols)
        } else {
            rows.max(1)
        };
        let group = group_fn();
        views.with_min_len(per).for_each(|v| v.quantize(group));
    }
}

/// One row's input and its parts of [`Acts`].
struct RowView<'a> {
    x: &'a [f32],
    q: &'a mut [i8],
    d32: &'a mut [f32],
    b32: &'a mut [i32],
    xb32: &'a mut [f32],
    d16: &'a mut [f32],
    b16: &'a mut [i32],
    xb16: &'a mut [f32],
}

impl RowView<'_> {
    fn quantize(self, group: GroupFn) {
        let groups = self.x.len() / GROUP;
        self.q[groups * GROUP..].fill(0);
        for v in [&mut *self.d32, &mut *self.xb32] {
            v[groups..].fill(0.0);
        }
        self.b32[groups..].fill(0);
        for v in [&mut *self.d16, &mut *self.xb16] {
            v[2 * groups..].fill(0.0);
        }
        self.b16[2 * groups..].fill(0);
        for (g, xs) in self.x.chunks_exact(GROUP).enumerate() {
            let qs: &mut [i8; GROUP] = (&mut self.q[g * GROUP..(g + 1) * GROUP])
                .try_into()
                .expect("one group");
            let (d, lo, hi) = group(xs.try_into().expect("one group"), qs);
            self.d32[g] = d;
            self.b32[g] = lo + hi;
            self.xb32[g] = d * (lo + hi) as f32;
            for (h, b) in [lo, hi].into_iter().enumerate() {
                self.d16[2 * g + h] = d;
                self.b16[2 * g + h] = b;
                self.xb16[2 * g + h] = d * b as f32;
            }
        }
    }
}

/// One group's quantization: its scale and the sums of its two halves'
/// quants.
type GroupFn = fn(&[f32; GROUP], &mut [i8; GROUP]) -> (f32, i32, i32);

/// The group quantizer of this process's path: every one gives
/// [`quantize_group`]'s bits (`tests::int8::group_quantizers_agree_to_the_bit`).
fn group_fn() -> GroupFn {
    #[cfg(target_arch = "x86_64")]
    match crate::cpu::path() {
        Path::Avx512 => {
            return |x, q| {
                // SAFETY: the AVX-512 path runs only where the CPU has
                // AVX-512 F and BW (`Path::available`).
                unsafe { super::i8_x86_512::quantize_group(x, q) }
            };
        }
        Path::Avx2 => {
            return |x, q| {
                // SAFETY: the AVX2 path runs only where the CPU has AVX2.
                unsafe { super::i8_x86::quantize_group(x, q) }
            };
        }
        Path::Portable => {}
    }
    quantize_group_sums
}

/// [`quantize_group`] and its halves' sums (the portable group quantizer).
pub(super) fn quantize_group_sums(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> (f32, i32, i32) {
    let d = quantize_group(x, q);
    let half = |h: usize| -> i32 { q[16 * h..16 * (h + 1)].iter().map(|&v| i32::from(v)).sum() };
    (d, half(0), half(1))
}

/// What every group quantizer does once it has the group's largest
/// magnitude: `Ok(127 / amax)`, or `Err(scale)` with `q` zeroed for a
/// group that quantizes to zeros (all zero: scale 0; a non-finite value:
/// NaN, as the f32 class would carry one on; so small that the inverse
/// overflows: 0).
#[inline]
pub(super) fn inverse_scale(amax: f32, q: &mut [i8; GROUP]) -> Result<f32, f32> {
    if amax == 0.0 || !amax.is_finite() {
        q.fill(0);
        return Err(if amax == 0.0 { 0.0 } else { f32::NAN });
    }
    let id = 127.0 / amax;
    if !id.is_finite() {
        q.fill(0);
        return Err(0.0);
    }
    Ok(id)
}

/// One group's quants into `q`; returns its scale. Written so that it
/// vectorizes without target features: rounding to nearest even by adding
/// and subtracting 1.5 * 2^23 (exact for `|v| < 2^22`; here `|v| <= 127`).
#[inline]
fn quantize_group(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let id = match inverse_scale(amax, q) {
        Ok(id) => id,
        Err(d) => return d,
    };
    const ROUND: f32 = 12_582_912.0;
    for (q, &v) in q.iter_mut().zip(x) {
        let r = (v * id + ROUND) - ROUND;
        *q = r as i8;
    }
    amax / 127.0
}

/// One weight row unpacked for the dot products: quant bytes (biased to
/// unsigned, or Q8_0's signed bytes) and per-sub-block scales and offsets,
/// each padded with zeros to whole lanes of sub-blocks.
#[derive(Default)]
pub(super) struct Row {
    pub u: Vec<u8>,
    pub s: Vec<f32>,
    pub o: Vec<f32>,
}

impl Row {
    /// Sized for rows of `cols` values of `format` (zeros).
    pub fn shape(&mut self, format: QFormat, cols: usize) {
        let subs = padded(cols / format.sub_block());
        let bytes = padded(cols / GROUP) * GROUP;
        self.u.clear();
        self.u.resize(bytes, 0);
        self.s.clear();
        self.s.resize(subs, 0.0);
        self.o.clear();
        self.o.resize(subs, 0.0);
    }

    /// The portable unpacking of one row of blocks.
    fn unpack(&mut self, format: QFormat, blocks: &[u8]) {
        let (bb, bv, sub) = (
            format.block_bytes(),
            format.block_values(),
            format.sub_block(),
        );
        let bias = bias(format).map_or(0, i32::from);
        for (b, blk) in blocks.chunks_exact(bb).enumerate() {
            let h = scalar::head(format, blk);
            let subs = bv / sub;
            self.s[b * subs..(b + 1) * subs].copy_from_slice(&h.s[..subs]);
            self.o[b * subs..(b + 1) * subs].copy_from_slice(&h.o[..subs]);
            for g in 0..bv / GROUP {
                let at = b * bv + g * GROUP;
                for (u, q) in self.u[at..at + GROUP]
                    .iter_mut()
                    .zip(scalar::quants(format, blk, g))
                {
                    *u = (i32::from(q) + bias) as u8;
                }
            }
        }
    }
}

/// One output on the portable path: the module's arithmetic, plainly.
fn dot(format: QFormat, w: &Row, a: &Acts, t: usize) -> f32 {
    let sub = format.sub_block();
    let n = a.cols / sub;
    let signed = bias(format).is_none();
    let bias = bias(format).map_or(0, i32::from);
    let xq = &a.q[t * a.stride8()..];
    let (d, xb) = if sub == 16 {
        (&a.d16[t * a.n16()..], &a.xb16[t * a.n16()..])
    } else {
        (&a.d32[t * a.n32()..], &a.xb32[t * a.n32()..])
    };
    let mut l = [0.0f32; LANES];
    for k in 0..n {
        let p: i32 = (k * sub..(k + 1) * sub)
            .map(|i| {
                let q = if signed {
                    i32::from(w.u[i] as i8)
                } else {
                    i32::from(w.u[i]) - bias
                };
                q * i32::from(xq[i])
            })
            .sum();
        let lane = &mut l[k % LANES];
        *lane = (p as f32).mul_add(w.s[k] * d[k], *lane);
        if format.has_offset() {
            *lane = w.o[k].mul_add(xb[k], *lane);
        }
    }
    super::gemm::reduce(l)
}

thread_local! {
    /// The calling thread's quantized activations, reused across calls.
    static ACTS: std::cell::RefCell<Acts> = std::cell::RefCell::default();
    /// Each thread's unpacked weight row.
    static ROW: std::cell::RefCell<Row> = std::cell::RefCell::default();
    /// Each thread's panel for the AVX-512 VNNI kernel.
    #[cfg(target_arch = "x86_64")]
    static PANEL_512: std::cell::RefCell<super::i8_x86_512::Panel> =
        std::cell::RefCell::default();
    /// The same for the AVX2 and AVX-VNNI kernel.
    #[cfg(target_arch = "x86_64")]
    static PANEL_256: std::cell::RefCell<super::i8_x86_256::Panel> =
        std::cell::RefCell::default();
}

/// Activation rows from which a task fills an interleaved panel (every
/// x86 dot product, every format): below, the one-row kernel costs less.
#[cfg(target_arch = "x86_64")]
pub(super) const PANEL_FROM: usize = 3;

/// Activation rows per task: their quants (at most 64 x 32 KiB) stay in L2
/// while a panel's rows pass over them.
const ROW_BLOCK: usize = 64;

/// Weight rows per task of the one-row kernel.
const PANEL: usize = 16;

/// Which kernel [`matmul_dot`]'s tasks run (decided once per call).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tiles {
    /// The AVX-512 VNNI panel ([`super::i8_x86_512`]).
    #[cfg(target_arch = "x86_64")]
    Panel512,
    /// The AVX2 / AVX-VNNI panel ([`super::i8_x86_256`]).
    #[cfg(target_arch = "x86_64")]
    Panel256,
    /// One unpacked weight row at a time, dotted with each activation row.
    OneRow,
}

/// The kernel, weight rows and activation rows per task of
/// [`matmul_dot`].
///
/// The panel kernels run their tiles lane by lane, so a tile keeps its few
/// activation rows in L1 whatever the row count: a task fills its panel
/// once and runs every row against it, unless the matrix has too few
/// panels to give each thread about four tasks, when the rows are split.
/// The one-row kernel re-reads a block's activations per weight row and
/// keeps [`ROW_BLOCK`] rows, which stay in L2.
fn task_shape(kernel: Dot, rows: usize, n: usize) -> (Tiles, usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if rows >= PANEL_FROM {
        let panel = if kernel == Dot::Avx512Vnni {
            Some((Tiles::Panel512, super::i8_x86_512::ROWS))
        } else {
            super::i8_x86_256::takes(kernel).then_some((Tiles::Panel256, super::i8_x86_256::ROWS))
        };
        if let Some((tiles, prows)) = panel {
            let want = 4 * rayon::current_num_threads();
            let splits = want.div_ceil(n.div_ceil(prows)).max(1);
            return (tiles, prows, rows.div_ceil(splits).max(PANEL_FROM));
        }
    }
    let _ = kernel;
    (Tiles::OneRow, PANEL, ROW_BLOCK.min(rows))
}

/// Write-only view of the output shared by the tasks.
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `matmul`); the pointer outlives
// the parallel section, which ends before `out` is used again.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Which integer dot product a path multiplies with: each computes the
/// same integers, so the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// Plain Rust (the reference).
    Portable,
    /// AVX2 `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// AVX-VNNI `vpdpbusd` (VEX, 256-bit).
    AvxVnni,
    /// AVX-512 VNNI `vpdpbusd` (256-bit, AVX-512 VL).
    Avx512Vnni,
}

impl Dot {
    /// The fastest this CPU has under `path`: the AVX-512 path takes
    /// AVX-512 VNNI, else AVX-VNNI, else AVX2; the AVX2 path AVX-VNNI if
    /// present, else AVX2.
    pub fn of(path: Path) -> Dot {
        let order: &[Dot] = match path {
            Path::Portable => &[],
            Path::Avx2 => &[Dot::AvxVnni, Dot::Avx2],
            Path::Avx512 => &[Dot::Avx512Vnni, Dot::AvxVnni, Dot::Avx2],
        };
        order
            .iter()
            .copied()
            .find(|d| d.available())
            .unwrap_or(Dot::Portable)
    }

    /// Whether this CPU has it.
    pub fn available(self) -> bool {
        match self {
            Dot::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Dot::Avx2 => Path::Avx2.available(),
            #[cfg(target_arch = "x86_64")]
            Dot::AvxVnni => Path::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Dot::Avx512Vnni => {
                Path::Avx512.available()
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Name for benchmark output.
    pub const fn name(self) -> &'static str {
        match self {
            Dot::Portable => "portable",
            Dot::Avx2 => "avx2",
            Dot::AvxVnni => "avx-vnni",
            Dot::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// `out[t, r] = sum_k x[t, k] * w[r, k]` in this class (F16 and BF16 in the
/// f32 class's kernels on `path`). Shapes as [`super::matmul`].
pub(super) fn matmul(path: Path, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    if !w.format.is_quantized() {
        return super::gemm::matmul(path, w, x, rows, out);
    }
    matmul_dot(Dot::of(path), w, x, rows, out);
}

/// [`matmul`] with a chosen integer dot product (quantized formats only).
pub(super) fn matmul_dot(kernel: Dot, w: &QMatrix, x: &[f32], rows: usize, out: &mut [f32]) {
    matmul_each_dot(kernel, &[w], x, rows, &mut [out]);
}

/// `x` through each of `ws` (equal widths, quantized formats) into
/// `outs[i]`, with the activations quantized once: each output has the
/// bits [`matmul_dot`] gives it alone (the quantization is a function of
/// `x` only).
pub(super) fn matmul_each_dot<W: AsRef<QMatrix>>(
    kernel: Dot,
    ws: &[W],
    x: &[f32],
    rows: usize,
    outs: &mut [&mut [f32]],
) {
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    assert!(
        kernel.available(),
        "{} dot products on a CPU without them",
        kernel.name()
    );
    let Some(k) = ws.first().map(|w| w.as_ref().cols) else {
        return;
    };
    for (w, out) in ws.iter().map(AsRef::as_ref).zip(outs.iter()) {
        assert!(w.format.is_quantized(), "{} is not quantized", w.format);
        assert_eq!(w.cols, k, "matrices of one input width");
        assert_eq!(out.len(), rows * w.rows, "output shape");
    }
    assert_eq!(x.len(), rows * k, "activation shape");
    if rows == 0 {
        return;
    }
    // Taken out of the thread's slot, not borrowed across the parallel
    // section: a thread waiting in it may run another call's task (rayon
    // steals work), which then finds the slot empty and allocates.
    let mut acts = ACTS.take();
    acts.quantize(x, rows, k);
    #[cfg(target_arch = "x86_64")]
    super::i8_x86_pairs::prepare(
        &mut acts,
        kernel,
        ws.iter().map(|w| w.as_ref().format),
        rows,
    );
    for (w, out) in ws.iter().zip(outs.iter_mut()) {
        run(kernel, w.as_ref(), &acts, rows, out);
    }
    ACTS.set(acts);
}

/// `acts` (`rows` quantized rows) through `w` into `out`.
fn run(kernel: Dot, w: &QMatrix, acts: &Acts, rows: usize, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    if n == 0 {
        return;
    }
    let rb = w.row_bytes();
    let ptr = OutPtr(out.as_mut_ptr());
    let (tiles, prows, block) = task_shape(kernel, rows, n);
    let panels = n.div_ceil(prows);
    let task = |i: usize| {
        let ptr = &ptr;
        let (t0, r0) = ((i / panels) * block, (i % panels) * prows);
        let (nt, nr) = (block.min(rows - t0), prows.min(n - r0));
        // A last block of fewer than PANEL_FROM rows takes the one-row
        // kernel (the same bits).
        let tiles = if nt >= PANEL_FROM {
            tiles
        } else {
            Tiles::OneRow
        };
        #[cfg(target_arch = "x86_64")]
        let blocks = &w.data[r0 * rb..(r0 + nr) * rb];
        #[cfg(target_arch = "x86_64")]
        let next = super::gemm::next_panel(w, i % panels, prows);
        match tiles {
            #[cfg(target_arch = "x86_64")]
            Tiles::Panel512 => {
                return PANEL_512.with_borrow_mut(|panel| {
                    // SAFETY: `matmul_each_dot` asserted the features; the
                    // task owns rows t0 .. t0 + nt of columns
                    // r0 .. r0 + nr of `out`.
                    unsafe {
                        panel.fill_blocks(w.format, blocks, nr, k);
                        panel.run(w.format, acts, t0, nt, nr, ptr.0.add(r0), n, next);
                    }
                });
            }
            #[cfg(target_arch = "x86_64")]
            Tiles::Panel256 => {
                return PANEL_256.with_borrow_mut(|panel| {
                    // SAFETY: as above.
                    unsafe {
                        panel.fill_blocks(w.format, blocks, nr, k);
                        panel.run(kernel, w.format, acts, t0, nt, nr, ptr.0.add(r0), n, next);
                    }
                });
            }
            Tiles::OneRow => {}
        }
        #[cfg(target_arch = "x86_64")]
        if kernel != Dot::Portable {
            let task = super::i8_x86_row::RowTask {
                blocks,
                nr,
                k,
                acts,
                t0,
                nt,
                // SAFETY: column r0 of the output (below its end).
                out: unsafe { ptr.0.add(r0) },
                n,
            };
            // SAFETY: `matmul_each_dot` asserted the features; the task
            // owns rows t0 .. t0 + nt of columns r0 .. r0 + nr of `out`.
            return unsafe { super::i8_x86_row::rows(kernel, w.format, &task) };
        }
        ROW.with_borrow_mut(|row| {
            row.shape(w.format, k);
            for r in r0..r0 + nr {
                row.unpack(w.format, &w.data[r * rb..(r + 1) * rb]);
                for t in t0..t0 + nt {
                    let v = dot(w.format, row, acts, t);
                    // SAFETY: (t, r) is inside `out` and this task's
                    // alone (tasks are disjoint blocks of rows and
                    // columns).
                    unsafe { *ptr.0.add(t * n + r) = v };
                }
            }
        });
    };
    let tasks = rows.div_ceil(block) * panels;
    if n * k * rows < 1 << 15 {
        (0..tasks).for_each(task);
    } else {
        crate::tasks::each(tasks, task);
    }
}
