//! The x86 one- and two-row kernel of [`super::i8`] (batch-1 decode's
//! matmuls): each weight row dotted straight from its blocks. A group's
//! quants are decoded in a register by the f32 class's block decoding
//! ([`super::x86_blocks`]: the same integer quants, the same scales to
//! the bit), biased to unsigned bytes and multiplied at once with AVX2
//! `vpmaddubsw`/`vpmaddwd`, AVX-VNNI or AVX-512 VNNI `vpdpbusd`; nothing
//! is unpacked to memory. Every integer sum is exact (see [`super::i8`]
//! for the bounds), so the three give the portable path's bits.
//!
//! A group's 32 byte products come as eight i32 lanes (lane `j`: values
//! `4j .. 4j + 4`; with AVX2, sixteen i16 lanes of two until they must be
//! widened: [`i16_levels`]). Eight sub-blocks' lanes are summed into one
//! vector of eight sums by unpacks and adds (no horizontal adds), which
//! then is scaled and added to the eight f32 lanes of the output at once.
//! The eight sub-blocks' scales come from one block head (K-quants, its
//! six-bit scales unpacked inline) or, for eight legacy blocks, their f16
//! heads packed by scalar loads and shifts ([`halves8`]). Eight weight
//! rows' f32 lanes are summed together ([`hsum8`], each row by `hsum`'s
//! order) and stored as one vector: alone, a 576-wide row's own reduction
//! had been about a tenth of its time. Q4_0 and Q4_1 take two groups a
//! vector of products ([`super::i8_x86_pairs`]): half the reduction.
//!
//! # Cost
//! Per group of 32 weights: the format's decoding (Q4_1: a 16-byte
//! broadcast load, a shift and a mask), one byte product per activation
//! row (AVX2: one `vpmaddubsw`, and a quarter of a `vpmaddwd` for the 4-
//! and 5-bit formats), and an eighth of the lane reduction. Two activation
//! rows share the decoding. Batch 1 from memory on an AVX2-only Zen 3
//! (`QUANT_BENCH_TABLE=stream`, 2 threads): 74-89% of the read bandwidth
//! for the 4- and 5-bit formats, Q8_0 at it (docs/performance.md).
//!
//! Measured (`QUANT_BENCH_TABLE=int8 QUANT_BENCH_ROWS=1 cargo bench -p
//! kvmesh-kernels --bench quant`, 2 threads, a shared Xeon with AVX-512
//! VNNI; one row of `[2048x8192]`): Q4_1 0.45 ms, 23 GB/s of blocks, where
//! unpacking each row into a buffer first took 1.49 ms and the f32 class
//! takes 0.79; Q4_K 0.49 (f32 class 1.01), Q6_K 0.61 (1.14). With AVX2's
//! `vpmaddubsw` (`QUANT_BENCH_PATH=avx2 QUANT_BENCH_DOT=avx2`) every format
//! is 1.45-2.15x as fast as the AVX2 f32 class.

use std::arch::x86_64::*;

use super::i8::{bias, pairs_in_i16, Acts, Dot};
use super::i8_x86::{f16_head, halves8};
use super::i8_x86_pairs::{paired_in, prepared, Pairs};
use super::scalar::Head;
use super::x86_512_blocks::quants512;
use super::x86_blocks::{head, quants};
use super::{code, with_format, QFormat, GROUP};
use crate::simd::{hsum, hsum8};

/// Bytes ahead of the blocks being read that are prefetched: weights
/// stream from memory (or L3) at batch 1, and one sequential stream per
/// core is not enough to keep the loads in flight.
const PREFETCH: usize = 8192;

/// One task of the kernel: weight rows `blocks` (`nr` rows of `k` values)
/// against activation rows `t0 .. t0 + nt` of `acts`, output `(t, r)`
/// written at `out + t * n + r`.
pub(super) struct RowTask<'a> {
    pub blocks: &'a [u8],
    pub nr: usize,
    pub k: usize,
    pub acts: &'a Acts,
    pub t0: usize,
    pub nt: usize,
    pub out: *mut f32,
    pub n: usize,
}

/// Run `task` on rows of `format` with `dot`'s products.
///
/// # Safety
/// `dot`'s features ([`Dot::available`]), not the portable one; `acts`
/// quantized for rows of `task.k` values; the task's outputs writable and
/// written by nothing else meanwhile.
pub(super) unsafe fn rows(dot: Dot, format: QFormat, task: &RowTask) {
    debug_assert!(dot != Dot::Portable && dot.available());
    // SAFETY (all): by the caller.
    with_format!(format, F => unsafe {
        match dot {
            Dot::Avx512Vnni => rows_vnni512::<F>(task),
            Dot::AvxVnni => rows_avxvnni::<F>(task),
            _ => rows_avx2::<F>(task),
        }
    })
}

/// A group's byte products: unsigned weight bytes by signed activations.
pub(super) trait Bytes {
    /// Whether [`Self::pairs`] gives AVX2's `vpmaddubsw` sums of two
    /// products in sixteen i16 lanes, which [`Self::widen`] adds in pairs
    /// to i32; otherwise both give eight i32 lanes of four products.
    const I16: bool;

    /// # Safety
    /// The implementation's features.
    unsafe fn pairs(u: __m256i, x: __m256i) -> __m256i;

    /// # Safety
    /// The implementation's features.
    unsafe fn widen(v: __m256i) -> __m256i;

    /// `acc` plus [`Self::pairs`] of `u` and `x`, in the lanes
    /// [`Self::pairs`] gives.
    ///
    /// # Safety
    /// The implementation's features.
    unsafe fn accumulate(acc: __m256i, u: __m256i, x: __m256i) -> __m256i;

    /// Group `g`'s quants of the block at `p`, biased to unsigned bytes
    /// by `add` (the format's [`bias`]): [`quants`] plus `add`, the same
    /// bytes.
    ///
    /// # Safety
    /// `p` points at a whole block, `g` below its groups; the
    /// implementation's features and AVX2/FMA/F16C.
    #[inline(always)]
    unsafe fn biased<const F: u8>(p: *const u8, g: usize, add: __m256i) -> __m256i {
        // SAFETY: by the caller.
        unsafe { _mm256_add_epi8(quants::<F>(p, g), add) }
    }
}

struct Avx2;
impl Bytes for Avx2 {
    const I16: bool = true;

    #[inline(always)]
    unsafe fn pairs(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 (the caller). No pair saturates (module bounds).
        unsafe { _mm256_maddubs_epi16(u, x) }
    }

    #[inline(always)]
    unsafe fn widen(v: __m256i) -> __m256i {
        // SAFETY: AVX2 (the caller).
        unsafe { _mm256_madd_epi16(v, _mm256_set1_epi16(1)) }
    }

    /// In i16: a lane then holds two pair sums ([`paired_in`] bounds it).
    #[inline(always)]
    unsafe fn accumulate(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 (the caller).
        unsafe { _mm256_add_epi16(acc, Self::pairs(u, x)) }
    }
}

struct AvxVnni;
impl Bytes for AvxVnni {
    const I16: bool = false;

    #[inline(always)]
    unsafe fn pairs(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-VNNI (the caller).
        unsafe { _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x) }
    }

    #[inline(always)]
    unsafe fn accumulate(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-VNNI (the caller).
        unsafe { _mm256_dpbusd_avx_epi32(acc, u, x) }
    }

    #[inline(always)]
    unsafe fn widen(v: __m256i) -> __m256i {
        v
    }
}

struct Avx512Vnni;
impl Bytes for Avx512Vnni {
    const I16: bool = false;

    #[inline(always)]
    unsafe fn pairs(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI + VL (the caller).
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x) }
    }

    #[inline(always)]
    unsafe fn accumulate(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI + VL (the caller).
        unsafe { _mm256_dpbusd_epi32(acc, u, x) }
    }

    #[inline(always)]
    unsafe fn widen(v: __m256i) -> __m256i {
        v
    }

    /// Q5_0's and Q5_1's fifth bits as an AVX-512 BW byte mask
    /// ([`quants512`]: one masked add where AVX2 spreads and tests the 32
    /// bits in five instructions), the same bytes. One thread, one row
    /// in cache (`QUANT_BENCH_TABLE=int8 QUANT_BENCH_ROWS=1`, `[3072x576]`,
    /// best of five): Q5_0 0.89x the time, Q5_1 0.87x; streamed at two
    /// threads 1.15x the rate (docs/performance.md). The K-quants' bit
    /// planes by masks (Q5_K, Q3_K) were slower here (Q5_K 1.36-1.58x at
    /// `[2048x8192]`), so they keep the AVX2 decoding.
    #[inline(always)]
    unsafe fn biased<const F: u8>(p: *const u8, g: usize, add: __m256i) -> __m256i {
        // SAFETY: AVX-512 F/BW/VL/DQ and AVX2 (the caller).
        unsafe {
            let q = if F == code::Q5_0 || F == code::Q5_1 {
                quants512::<F>(p, g)
            } else {
                quants::<F>(p, g)
            };
            _mm256_add_epi8(q, add)
        }
    }
}

/// How many of [`sum4`]'s two levels of adds an AVX2 kernel does on
/// `vpmaddubsw`'s i16 sums before widening them (then one `vpmaddwd` for
/// four groups instead of one each): after level `l` a lane holds `2^l`
/// of them ([`pairs_in_i16`]). Two for the 4- and 5-bit formats, MXFP4,
/// Q2_K and Q3_K (`4 * 2 * 31 * 127 = 31496`), one for Q6_K (`2 * 2 * 63
/// * 127 = 32004`), none for Q8_0 (its sign trick's pairs reach 32512).
const fn i16_levels(f: QFormat) -> u32 {
    pairs_in_i16(f, 4).trailing_zeros()
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_avx2<const F: u8>(task: &RowTask) {
    // SAFETY: by the caller.
    unsafe { rows_body::<Avx2, F>(task) }
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn rows_avxvnni<const F: u8>(task: &RowTask) {
    // SAFETY: by the caller.
    unsafe { rows_body::<AvxVnni, F>(task) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512f,avx512bw,avx512vl,avx512dq")]
unsafe fn rows_vnni512<const F: u8>(task: &RowTask) {
    // SAFETY: by the caller.
    unsafe { rows_body::<Avx512Vnni, F>(task) }
}

/// The task's weight rows, in pairs of groups where the format and the
/// activations have them ([`super::i8_x86_pairs`]).
#[inline(always)]
unsafe fn rows_body<B: Bytes, const F: u8>(task: &RowTask) {
    let pairs = const { paired_in(QFormat::of_code(F), B::I16) };
    // SAFETY: by the caller.
    unsafe {
        if pairs && prepared(task.acts, task.t0 + task.nt) {
            rows_of::<B, F, true>(task)
        } else {
            rows_of::<B, F, false>(task)
        }
    }
}

/// The task's weight rows in order, each against its activation rows two
/// at a time (then one); groups in pairs where `P`.
#[inline(always)]
unsafe fn rows_of<B: Bytes, const F: u8, const P: bool>(task: &RowTask) {
    let rb = const { QFormat::of_code(F) }.row_bytes(task.k);
    assert!(task.blocks.len() >= task.nr * rb && task.acts.cols() == task.k);
    assert!(
        (task.t0 + task.nt) * task.acts.stride8() <= task.acts.q.len(),
        "activation rows past the quantized ones"
    );
    let end = task.t0 + task.nt;
    // SAFETY (all): rows r .. r + 8 (or r) lie in `blocks` (asserted);
    // the outputs are the task's (the caller); where `P`, the pairs cover
    // the rows (the caller).
    unsafe {
        let row = |r: usize| task.blocks.as_ptr().add(r * rb);
        let at = |t: usize, r: usize| task.out.add(t * task.n + r);
        // Eight weight rows at a time, their lanes reduced together
        // ([`hsum8`]) and stored as one vector per activation row.
        let mut r = 0;
        while r + 8 <= task.nr {
            let mut t = task.t0;
            while t + 2 <= end {
                eight_rows::<B, F, 2, P>(row(r), rb, task.acts, t, at(t, r), task.n);
                t += 2;
            }
            if t < end {
                eight_rows::<B, F, 1, P>(row(r), rb, task.acts, t, at(t, r), task.n);
            }
            r += 8;
        }
        for r in r..task.nr {
            let mut t = task.t0;
            while t + 2 <= end {
                let [a, b] = dot_blocks::<B, F, 2, P>(row(r), task.acts, t);
                (*at(t, r), *at(t + 1, r)) = (hsum(a), hsum(b));
                t += 2;
            }
            if t < end {
                *at(t, r) = hsum(dot_blocks::<B, F, 1, P>(row(r), task.acts, t)[0]);
            }
        }
    }
}

/// Eight weight rows (`rb` bytes apart, from `p`) against activation rows
/// `t .. t + T`: activation row `t + i`'s eight outputs stored at
/// `out + i * n`, their lanes summed together by [`hsum8`].
///
/// # Safety
/// As [`dot_blocks`] for each of the eight rows; those outputs writable.
#[inline(always)]
unsafe fn eight_rows<B: Bytes, const F: u8, const T: usize, const P: bool>(
    p: *const u8,
    rb: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    n: usize,
) {
    // SAFETY (all): by the caller. Loops, not `array::from_fn`: its
    // closure would not have the caller's target features.
    unsafe {
        let mut l = [[_mm256_setzero_ps(); 8]; T];
        for j in 0..8 {
            let d = dot_blocks::<B, F, T, P>(p.add(j * rb), a, t);
            for (row, d) in l.iter_mut().zip(d) {
                row[j] = d;
            }
        }
        for (i, row) in l.into_iter().enumerate() {
            _mm256_storeu_ps(out.add(i * n), hsum8(row));
        }
    }
}

/// The bias of `f`'s quants in this kernel: [`bias`], but Q8_0's signed
/// bytes plus 128 where the products are VNNI's (not `i16`): its i32 lanes
/// do not saturate (a group's `32 * 255 * 127 < 2^21`, less `128 * B`:
/// exact), and one add replaces the sign trick's two instructions.
const fn row_bias(f: QFormat, i16: bool) -> Option<u8> {
    match (f, i16) {
        (QFormat::Q8_0, false) => Some(128),
        _ => bias(f),
    }
}

/// Group `g`'s weight bytes `w` (biased quants, or Q8_0's signed ones)
/// and activations `x` as the unsigned and signed bytes [`Bytes`]
/// multiplies: for unbiased Q8_0 its magnitudes against sign-moved
/// activations.
#[inline(always)]
unsafe fn operands<B: Bytes, const F: u8>(w: __m256i, x: __m256i) -> (__m256i, __m256i) {
    // SAFETY: AVX2 (every caller).
    unsafe {
        if const { row_bias(QFormat::of_code(F), B::I16).is_none() } {
            (_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
        } else {
            (w, x)
        }
    }
}

/// Four groups' products summed per half: `[s0 s1 s2 s3 | s0' s1' s2'
/// s3']`, `s_i` the sum of group `i`'s values 0-15 and `s_i'` of 16-31,
/// from `p[i]` as [`Bytes::pairs`] gives them. An integer sum has one
/// value in any order; the first [`i16_levels`] levels add i16 lanes.
#[inline(always)]
pub(super) unsafe fn sum4<B: Bytes, const F: u8>(p: [__m256i; 4]) -> __m256i {
    let levels = const {
        if B::I16 {
            i16_levels(QFormat::of_code(F))
        } else {
            0
        }
    };
    // SAFETY (all): AVX2 and the features of `B` (every caller).
    // Methods and plain calls, not closures: a closure may stay out of
    // line without the caller's target features.
    unsafe {
        let mut p = p;
        if levels == 0 {
            for v in &mut p {
                *v = B::widen(*v);
            }
        }
        let t0 = level1::<B>(p[0], p[1], levels);
        let t1 = level1::<B>(p[2], p[3], levels);
        let (lo, hi) = (_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
        if levels == 2 {
            B::widen(_mm256_add_epi16(lo, hi))
        } else {
            _mm256_add_epi32(lo, hi)
        }
    }
}

/// [`sum4`]'s first level: `[a0 b0 a1 b1]` per half, `a0` the sum of
/// `a`'s lanes 0 and 2 (as i32, or as two i16 while `levels > 1`).
#[inline(always)]
unsafe fn level1<B: Bytes>(a: __m256i, b: __m256i, levels: u32) -> __m256i {
    // SAFETY (all): AVX2 and the features of `B` (the caller).
    unsafe {
        let (lo, hi) = (_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
        match levels {
            0 => _mm256_add_epi32(lo, hi),
            1 => B::widen(_mm256_add_epi16(lo, hi)),
            _ => _mm256_add_epi16(lo, hi),
        }
    }
}

/// The scales and offsets of legacy blocks (one sub-block each)
/// `i .. i + 8` of the row at `p`, as [`head`] gives them; blocks from
/// `live` on give zeros. The f16 heads are read with scalar loads and
/// packed four to a word on the integer pipes, which a vector kernel
/// leaves idle (eight lane inserts cost a 32-value group's work; a
/// `vpgatherdd` is slow on AMD's cores: docs/performance.md).
///
/// # Safety
/// Blocks `i .. i + live` lie in the row; AVX2/FMA/F16C.
#[inline(always)]
unsafe fn legacy_scales<const F: u8>(p: *const u8, i: usize, live: usize) -> (__m256, __m256) {
    let bb = const { QFormat::of_code(F).block_bytes() };
    let f16_head = const { f16_head(QFormat::of_code(F)) };
    let offset = const { QFormat::of_code(F).has_offset() };
    // SAFETY (all): by the caller.
    unsafe {
        let p = p.add(i * bb);
        if f16_head {
            // Each block's first two bytes: its f16 scale, then (Q4_1,
            // Q5_1) its f16 offset.
            let o = if offset {
                halves8(p.add(2), bb, live)
            } else {
                _mm256_setzero_ps()
            };
            return (halves8(p, bb, live), o);
        }
        let (mut s, mut o) = ([0.0f32; 8], [0.0f32; 8]);
        let mut h = Head::ZERO;
        for j in 0..live {
            head::<F>(p.add(j * bb), &mut h);
            (s[j], o[j]) = (h.s[0], h.o[0]);
        }
        (_mm256_loadu_ps(s.as_ptr()), _mm256_loadu_ps(o.as_ptr()))
    }
}

/// One weight row of blocks against `T` activation rows: what every
/// group's products need.
struct Groups<const T: usize> {
    /// The row's blocks.
    p: *const u8,
    /// Each activation row's quants.
    x: [*const i8; T],
    /// The row's groups (zeros from here on: a 576-wide row is 18 groups,
    /// padded to 24).
    real: usize,
    /// The format's bias, in every byte.
    add: __m256i,
}

impl<const T: usize> Groups<T> {
    /// Group `g`'s products with each activation row, as
    /// [`Bytes::pairs`] gives them; zeros from group `real` on where
    /// `CHECK` (a chunk at the row's end; the others are all real).
    /// Methods, not closures: a closure called from several places may
    /// stay out of line, without its caller's target features, and then
    /// none of its intrinsics inline.
    ///
    /// # Safety
    /// Groups below `real` lie in the row and in each activation row, and
    /// so does `g` unless `CHECK`; the features of `B` and AVX2/FMA/F16C.
    #[inline(always)]
    unsafe fn one<B: Bytes, const F: u8, const CHECK: bool>(&self, g: usize) -> [__m256i; T] {
        let (bb, bv) = const {
            let f = QFormat::of_code(F);
            (f.block_bytes(), f.block_values())
        };
        // SAFETY (all): by the caller.
        unsafe {
            let mut v = [_mm256_setzero_si256(); T];
            if !CHECK || g < self.real {
                let w = B::biased::<F>(self.p.add(g * GROUP / bv * bb), g % (bv / GROUP), self.add);
                for (v, x) in v.iter_mut().zip(self.x) {
                    let (u, x) = operands::<B, F>(w, _mm256_loadu_si256(x.add(g * GROUP).cast()));
                    *v = B::pairs(u, x);
                }
            }
            v
        }
    }

    /// Groups `g .. g + 4`'s products with each activation row, summed
    /// per half by [`sum4`].
    ///
    /// # Safety
    /// As [`Self::one`].
    #[inline(always)]
    unsafe fn four<B: Bytes, const F: u8>(&self, g: usize) -> [__m256i; T] {
        // SAFETY: by the caller.
        unsafe {
            if g + 4 <= self.real {
                self.four_of::<B, F, false>(g)
            } else if g < self.real {
                self.four_of::<B, F, true>(g)
            } else {
                // Padding only (a 640-wide row's last four of 24 groups).
                [_mm256_setzero_si256(); T]
            }
        }
    }

    /// [`Self::four`], groups checked against `real` where `CHECK`.
    ///
    /// # Safety
    /// As [`Self::one`].
    #[inline(always)]
    unsafe fn four_of<B: Bytes, const F: u8, const CHECK: bool>(&self, g: usize) -> [__m256i; T] {
        // SAFETY: by the caller.
        unsafe {
            let q = [
                self.one::<B, F, CHECK>(g),
                self.one::<B, F, CHECK>(g + 1),
                self.one::<B, F, CHECK>(g + 2),
                self.one::<B, F, CHECK>(g + 3),
            ];
            let mut out = [_mm256_setzero_si256(); T];
            for (i, v) in out.iter_mut().enumerate() {
                *v = sum4::<B, F>([q[0][i], q[1][i], q[2][i], q[3][i]]);
            }
            out
        }
    }
}

/// Activation rows `t .. t + T` against the row of blocks at `p`: the
/// module's arithmetic, the weights' groups decoded in registers; each
/// row's eight f32 lanes, which [`hsum`] (or [`hsum8`]) sums to the dot.
///
/// # Safety
/// The row at `p` holds `a.cols()` values of format `F`; rows
/// `t .. t + T` of `a` exist (and their pairs where `P`); the features
/// of `B` and AVX2/FMA/F16C.
#[inline(always)]
unsafe fn dot_blocks<B: Bytes, const F: u8, const T: usize, const P: bool>(
    p: *const u8,
    a: &Acts,
    t: usize,
) -> [__m256; T] {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    // A legacy block is one group and one sub-block; a K-quant block is
    // eight groups and one or two chunks of eight sub-blocks.
    const { assert!(matches!(QFormat::of_code(F).block_values(), GROUP | 256)) };
    let chunks_per_block =
        const { QFormat::of_code(F).block_values() / QFormat::of_code(F).sub_block() / 8 };
    let shift = const {
        match row_bias(QFormat::of_code(F), B::I16) {
            Some(b) if b > 0 => b.trailing_zeros() as i32,
            _ => -1,
        }
    };
    let sub16 = const { QFormat::of_code(F).sub_block() == 16 };
    // SAFETY (all): `a`'s rows are padded with zeros to whole lanes of
    // sub-blocks (`Acts::quantize`), which the loop takes; the row's
    // groups and blocks past its end are not read; the features by the
    // caller.
    unsafe {
        let n = if sub16 { a.n16() } else { a.n32() };
        let row = |i: usize| (t + i) * n;
        let (d, bs, xb): ([*const f32; T], [*const i32; T], [*const f32; T]) = if sub16 {
            (
                std::array::from_fn(|i| a.d16.as_ptr().add(row(i))),
                std::array::from_fn(|i| a.b16.as_ptr().add(row(i))),
                std::array::from_fn(|i| a.xb16.as_ptr().add(row(i))),
            )
        } else {
            (
                std::array::from_fn(|i| a.d32.as_ptr().add(row(i))),
                std::array::from_fn(|i| a.b32.as_ptr().add(row(i))),
                std::array::from_fn(|i| a.xb32.as_ptr().add(row(i))),
            )
        };
        let real = a.cols() / GROUP;
        let groups = Groups::<T> {
            p,
            x: std::array::from_fn(|i| a.q.as_ptr().add((t + i) * a.stride8())),
            real,
            add: _mm256_set1_epi8(row_bias(f, B::I16).unwrap_or(0) as i8),
        };
        let pairs = Pairs::<T>::new(p, a, t);
        let mut h = Head::ZERO;
        let mut l = [_mm256_setzero_ps(); T];
        for m in 0..n / 8 {
            // This chunk's bytes, and the scales of its eight sub-blocks.
            let (from, bytes) = if bv == GROUP {
                (8 * m * bb, 8 * bb)
            } else {
                (m * bb / chunks_per_block, bb / chunks_per_block)
            };
            for off in (0..bytes).step_by(64) {
                // A hint only: it may point past the matrix and never faults.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(from + off + PREFETCH).cast());
            }
            let (s, o) = if bv == GROUP {
                legacy_scales::<F>(p, 8 * m, real.saturating_sub(8 * m).min(8))
            } else {
                if m % chunks_per_block == 0 {
                    head::<F>(p.add(m / chunks_per_block * bb), &mut h);
                }
                let at = 8 * (m % chunks_per_block);
                (
                    _mm256_loadu_ps(h.s.as_ptr().add(at)),
                    _mm256_loadu_ps(h.o.as_ptr().add(at)),
                )
            };
            let sums = if P {
                // Eight groups' sums in order already.
                pairs.chunk::<B, F>(m)
            } else if sub16 {
                let mut sums = groups.four::<B, F>(4 * m);
                for v in &mut sums {
                    // Sub-blocks in order: 2g, 2g + 1, 2g + 2, ...
                    *v = _mm256_permutevar8x32_epi32(*v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                }
                sums
            } else {
                let (lo, hi) = (groups.four::<B, F>(8 * m), groups.four::<B, F>(8 * m + 4));
                let mut sums = lo;
                for (v, r1) in sums.iter_mut().zip(hi) {
                    *v = _mm256_add_epi32(
                        _mm256_permute2x128_si256::<0x20>(*v, r1),
                        _mm256_permute2x128_si256::<0x31>(*v, r1),
                    );
                }
                sums
            };
            for i in 0..T {
                let mut q = sums[i];
                if shift >= 0 {
                    let b = _mm256_loadu_si256(bs[i].add(8 * m).cast());
                    q = _mm256_sub_epi32(q, _mm256_sll_epi32(b, _mm_cvtsi32_si128(shift)));
                }
                let scale = _mm256_mul_ps(s, _mm256_loadu_ps(d[i].add(8 * m)));
                l[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, l[i]);
                if f.has_offset() {
                    l[i] = _mm256_fmadd_ps(o, _mm256_loadu_ps(xb[i].add(8 * m)), l[i]);
                }
            }
        }
        l
    }
}
