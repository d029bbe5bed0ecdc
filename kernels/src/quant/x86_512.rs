//! AVX-512 (F/BW/VL/DQ) build of [`super::gemm`], chosen at run time:
//! the panel dequantization, the register tiles, and the fused path for one
//! or two activation rows. Same arithmetic, to the bit, as the AVX2 and
//! portable paths (see [`super::gemm`]).
//!
//! # Two chains per register
//! An output's eight-lane chain is the AVX2 one; a 512-bit register holds
//! two of them, weight rows `2p` and `2p + 1` in its low and high halves,
//! against the same eight activations in both halves
//! (`vbroadcastf32x8`). Each half is reduced by the AVX2 tree. So every
//! output sees the operations of the portable path, in its order.
//!
//! - Panels are dequantized pair-interleaved: pair `p`'s eight-value chunk
//!   `c` is sixteen floats, row `2p`'s values `8c .. 8c + 8` then row
//!   `2p + 1`'s, so one aligned load feeds both rows.
//! - The fused path builds the same pair vectors in registers from the two
//!   rows' block bytes (one 16-byte load per row and block for Q4_1).
//!
//! # Cost
//! Per 64 weights of a decode step about 26 instructions where AVX2 takes
//! about 54 for the same weights. On Zen 4 a 512-bit operation occupies
//! both 256-bit halves of a pipe, so the arithmetic throughput is AVX2's;
//! the gain is in front-end and register pressure (32 registers: 4 x 8
//! output tiles in the panel).
//!
//! Measured (`taskset -c 0 cargo bench --bench quant`, EPYC Zen 4, one
//! core of a shared machine, so +-10%): AVX2's time over this build's,
//! SmolLM2-135M shapes, rows 1 / 2 / 16 / 64 / 512:
//! gate+up Q4_1 [3072x576] 1.19 / 1.56 / 1.14 / 1.10 / 1.06;
//! down Q4_1 [576x1536] 1.18 / 1.19 / 1.34 / 1.28 / 1.34;
//! lm_head Q8_0 [49152x576] (28 MB, bandwidth-bound) 2.05 / 1.22 / 0.96 /
//! 1.04. No shape was reliably slower than AVX2 (the 0.96 is within the
//! noise of repeated runs), so no shape delegates to the AVX2 build.

use std::arch::x86_64::*;

use super::{QFormat, BLOCK};
use crate::simd512::{hsum2, load_both};

/// Dequantize whole blocks of `w` into `out` (32 values per block), rows
/// contiguous, as [`super::x86::dequantize`] (to the bit).
///
/// # Safety
/// AVX-512 F/BW/VL/DQ with AVX2/FMA/F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn dequantize(format: QFormat, w: &[u8], out: &mut [f32]) {
    let bb = format.block_bytes();
    let nb = w.len() / bb;
    assert!(
        w.len() == nb * bb && out.len() >= nb * BLOCK,
        "whole blocks"
    );
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in 0..nb {
        // SAFETY: block b's bytes lie in `w` and its 32 outputs in `out`.
        unsafe {
            let [lo, hi] = match format {
                QFormat::Q4_1 => block::<true>(wp.add(b * bb)),
                QFormat::Q8_0 => block::<false>(wp.add(b * bb)),
            };
            _mm512_storeu_ps(op.add(b * BLOCK), lo);
            _mm512_storeu_ps(op.add(b * BLOCK + 16), hi);
        }
    }
}

/// Dequantize `live` rows of `k` values (rows of `w`, `rb` bytes each) into
/// a panel of `prows` rows in the pair-interleaved layout of the module
/// docs; rows from `live` on are zeros.
///
/// # Safety
/// AVX-512 as [`dequantize`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn dequantize_pairs(
    format: QFormat,
    w: &[u8],
    live: usize,
    prows: usize,
    k: usize,
    out: &mut [f32],
) {
    let bb = format.block_bytes();
    let rb = k / BLOCK * bb;
    assert!(
        prows.is_multiple_of(2)
            && live <= prows
            && w.len() >= live * rb
            && out.len() >= prows * k
            && k.is_multiple_of(BLOCK)
    );
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let zero = [_mm512_setzero_ps(); 2];
    for p in 0..prows / 2 {
        for b in 0..k / BLOCK {
            // SAFETY: rows below `live` are in `w`; pair p's 2k floats in
            // `out` (asserted).
            unsafe {
                let row = |r: usize| r.min(live.saturating_sub(1));
                let (a, c) = if live == 0 {
                    (zero, zero)
                } else if format == QFormat::Q4_1 {
                    (
                        block::<true>(wp.add(row(2 * p) * rb + b * bb)),
                        block::<true>(wp.add(row(2 * p + 1) * rb + b * bb)),
                    )
                } else {
                    (
                        block::<false>(wp.add(row(2 * p) * rb + b * bb)),
                        block::<false>(wp.add(row(2 * p + 1) * rb + b * bb)),
                    )
                };
                // Rows past the matrix's end (their results are never
                // read) are zeros.
                let a = if 2 * p < live { a } else { zero };
                let c = if 2 * p + 1 < live { c } else { zero };
                let o = op.add(p * 2 * k + b * 2 * BLOCK);
                // [a chunk q, c chunk q] for q = 0..4: 128-bit lanes 0-1 of
                // a register are its chunk 0 (or 2), lanes 2-3 chunk 1 (3).
                _mm512_storeu_ps(o, _mm512_shuffle_f32x4::<0x44>(a[0], c[0]));
                _mm512_storeu_ps(o.add(16), _mm512_shuffle_f32x4::<0xee>(a[0], c[0]));
                _mm512_storeu_ps(o.add(32), _mm512_shuffle_f32x4::<0x44>(a[1], c[1]));
                _mm512_storeu_ps(o.add(48), _mm512_shuffle_f32x4::<0xee>(a[1], c[1]));
            }
        }
    }
}

/// Sixteen Q4_1 quants (as i32) dequantized: `fma(q, d, m)`. (Helpers,
/// not array `map` closures, which were not reliably inlined into the
/// AVX-512 context.)
#[inline]
#[target_feature(enable = "avx512f")]
fn q4(q: __m512i, d: __m512, m: __m512) -> __m512 {
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m)
}

/// Sixteen Q8_0 quants (bytes) dequantized: `q * d`.
#[inline]
#[target_feature(enable = "avx512f")]
fn q8(q: __m128i, d: __m512) -> __m512 {
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d)
}

/// One block's 32 values in two registers, values 0-15 and 16-31.
///
/// # Safety
/// `p` points at a whole block; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn block<const Q4: bool>(p: *const u8) -> [__m512; 2] {
    // SAFETY: by the caller.
    unsafe {
        let s = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
        let d = _mm512_broadcastss_ps(s);
        if Q4 {
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(s));
            let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4).cast()));
            [
                q4(_mm512_and_si512(q, _mm512_set1_epi32(0x0f)), d, m),
                q4(_mm512_srli_epi32::<4>(q), d, m),
            ]
        } else {
            [
                q8(_mm_loadu_si128(p.add(2).cast()), d),
                q8(_mm_loadu_si128(p.add(18).cast()), d),
            ]
        }
    }
}

/// `MR` activation rows (stride `xs`) against `NP` row pairs of a
/// pair-interleaved panel (`2k` floats per pair): `out[i][2j + h]`.
///
/// # Safety
/// `x` readable for `MR` rows, `w` for `NP` pairs; `k` a multiple of 8.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tile<const MR: usize, const NP: usize>(
    x: *const f32,
    xs: usize,
    w: *const f32,
    k: usize,
) -> [[[f32; 2]; NP]; MR] {
    let mut acc = [[_mm512_setzero_ps(); NP]; MR];
    let mut kk = 0;
    while kk < k {
        // SAFETY: kk + 8 <= k, inside every row (the caller).
        unsafe {
            let mut a = [_mm512_setzero_ps(); MR];
            for (i, a) in a.iter_mut().enumerate() {
                *a = load_both(x.add(i * xs + kk));
            }
            for j in 0..NP {
                let b = _mm512_loadu_ps(w.add(j * 2 * k + 2 * kk));
                for i in 0..MR {
                    acc[i][j] = _mm512_fmadd_ps(a[i], b, acc[i][j]);
                }
            }
        }
        kk += 8;
    }
    let mut out = [[[0.0f32; 2]; NP]; MR];
    for i in 0..MR {
        for j in 0..NP {
            out[i][j] = hsum2(acc[i][j]);
        }
    }
    out
}

/// Activation rows per chunk of the panel loop (as the AVX2 build).
const T_CHUNK: usize = 24;

/// Activation rows per register tile.
const MR: usize = 4;

/// Row pairs per register tile: [`MR`] x 4 pairs are sixteen accumulators
/// (eight weight rows), plus four activation registers and the panel's.
const NP: usize = 4;

/// Every row of `x` against the `prows` rows of a pair-interleaved `panel`
/// (`prows` a multiple of `2 * NP`); writes `out[t * stride + j]` for
/// `j < live`.
///
/// # Safety
/// AVX-512; `out` valid for those writes.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn panel(
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
    assert!(
        k.is_multiple_of(8)
            && prows.is_multiple_of(2 * NP)
            && x.len() >= rows * k
            && panel.len() >= prows * k
    );
    let (xp, wp) = (x.as_ptr(), panel.as_ptr());
    let tiles = rows.div_ceil(T_CHUNK) * (prows / (2 * NP)) * T_CHUNK.min(rows).div_ceil(MR);
    let mut ahead = ahead.chunks(64);
    let per_tile = ahead.len().div_ceil(tiles.max(1));
    let mut hint = || {
        for line in ahead.by_ref().take(per_tile) {
            // A hint: it never faults.
            _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
        }
    };
    // SAFETY (all): activation rows t .. t + m <= rows and pairs
    // j / 2 .. j / 2 + NP <= prows / 2, checked above; writes by the caller.
    unsafe {
        for c in (0..rows).step_by(T_CHUNK) {
            let end = (c + T_CHUNK).min(rows);
            for j in (0..prows).step_by(2 * NP) {
                let live = live.saturating_sub(j);
                let w = wp.add(j * k);
                let mut t = c;
                while t < end {
                    hint();
                    let (x, o) = (xp.add(t * k), out.add(t * stride + j));
                    match end - t {
                        1 => store(&tile::<1, NP>(x, k, w, k), o, stride, live),
                        2 => store(&tile::<2, NP>(x, k, w, k), o, stride, live),
                        3 => store(&tile::<3, NP>(x, k, w, k), o, stride, live),
                        _ => store(&tile::<MR, NP>(x, k, w, k), o, stride, live),
                    }
                    t += MR.min(end - t);
                }
            }
        }
    }
}

/// Up to two activation rows against whole rows of blocks `w`,
/// dequantizing in registers; `out[t * stride + r]` for every row `r` of
/// `w`. The same arithmetic as [`super::x86::fused`].
///
/// # Safety
/// AVX-512; `out` valid for those writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn fused(
    format: QFormat,
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[u8],
    out: *mut f32,
    stride: usize,
) {
    let rb = k / BLOCK * format.block_bytes();
    let n = w.len() / rb;
    assert!(
        w.len() == n * rb
            && x.len() >= rows * k
            && (1..=2).contains(&rows)
            && k.is_multiple_of(BLOCK)
    );
    let (x, w) = (x.as_ptr(), w.as_ptr());
    // SAFETY (all): as asserted; writes by the caller.
    unsafe {
        match (format, rows) {
            (QFormat::Q4_1, 1) => fused_rows::<1, true>(x, k, w, rb, n, out, stride),
            (QFormat::Q8_0, 1) => fused_rows::<1, false>(x, k, w, rb, n, out, stride),
            (QFormat::Q4_1, _) => fused_rows::<2, true>(x, k, w, rb, n, out, stride),
            (QFormat::Q8_0, _) => fused_rows::<2, false>(x, k, w, rb, n, out, stride),
        }
    }
}

/// Weight row pairs per fused tile (eight rows: as many streams as the
/// AVX2 build's prefetch distance covers).
const FUSED_PAIRS: usize = 4;

/// [`fused`] for `MR` activation rows: eight weight rows at a time, then
/// pairs, then a lone last row (paired with itself; its high half is
/// dropped).
///
/// # Safety
/// As [`fused`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fused_rows<const MR: usize, const Q4: bool>(
    x: *const f32,
    k: usize,
    w: *const u8,
    rb: usize,
    n: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut r = 0;
    // SAFETY (all): rows r .. r + 2 * pairs <= n (or the last row), by the
    // caller.
    unsafe {
        while r + 2 * FUSED_PAIRS <= n {
            let rows: [*const u8; 2 * FUSED_PAIRS] = std::array::from_fn(|i| w.add((r + i) * rb));
            let t = fused_tile::<MR, FUSED_PAIRS, Q4>(x, k, &rows, rb);
            store(&t, out.add(r), stride, 2 * FUSED_PAIRS);
            r += 2 * FUSED_PAIRS;
        }
        while r < n {
            let b = (r + 1).min(n - 1);
            let t = fused_tile::<MR, 1, Q4>(x, k, &[w.add(r * rb), w.add(b * rb)], rb);
            store(&t, out.add(r), stride, n - r);
            r += 2;
        }
    }
}

/// Rows ahead the fused path prefetches (many streams at once are more
/// than the hardware prefetcher follows).
const AHEAD: usize = 16;

/// Permutation indices that spread lanes 0 and 2 (or 1 and 3) of a
/// converted scale vector over the low and high halves.
const D_IDX: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2];
const M_IDX: [i32; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3];

/// `MR` activation rows against `2 * NP` rows of blocks (`rows[2j]` and
/// `rows[2j + 1]` share pair `j`'s registers), dequantized in registers.
///
/// # Safety
/// `x` readable for `MR` rows of `k`; each row pointer for `k / 32`
/// blocks; AVX-512.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fused_tile<const MR: usize, const NP: usize, const Q4: bool>(
    x: *const f32,
    k: usize,
    rows: &[*const u8],
    rb: usize,
) -> [[[f32; 2]; NP]; MR] {
    let bb = if Q4 { 20 } else { 34 };
    // SAFETY: constant arrays of sixteen lanes.
    let (di, mi) = unsafe {
        (
            _mm512_loadu_si512(D_IDX.as_ptr().cast()),
            _mm512_loadu_si512(M_IDX.as_ptr().cast()),
        )
    };
    let mut acc = [[_mm512_setzero_ps(); NP]; MR];
    for b in 0..k / BLOCK {
        // SAFETY: block b of each row and values b*32 .. b*32+32 of each
        // activation row, by the caller; prefetches are hints (they may
        // point past the matrix and never fault).
        unsafe {
            let mut v = [[_mm512_setzero_ps(); 4]; NP];
            for (j, v) in v.iter_mut().enumerate() {
                let (pa, pb) = (rows[2 * j].add(b * bb), rows[2 * j + 1].add(b * bb));
                // The same rows AHEAD rows on (two tiles).
                _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(AHEAD * rb).cast());
                _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(AHEAD * rb).cast());
                // [d_a, m_a, d_b, m_b] (Q8_0: [d_a, q, d_b, q]).
                let s = _mm_cvtph_ps(_mm_unpacklo_epi32(
                    _mm_cvtsi32_si128(pa.cast::<i32>().read_unaligned()),
                    _mm_cvtsi32_si128(pb.cast::<i32>().read_unaligned()),
                ));
                let s = _mm512_castps128_ps512(s);
                let d = _mm512_permutexvar_ps(di, s);
                *v = if Q4 {
                    let m = _mm512_permutexvar_ps(mi, s);
                    let (qa, qb) = (
                        _mm_loadu_si128(pa.add(4).cast()),
                        _mm_loadu_si128(pb.add(4).cast()),
                    );
                    // Bytes 0-7 of each row hold values 0-7 (low nibbles)
                    // and 16-23 (high); bytes 8-15 values 8-15 and 24-31.
                    let lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
                    let hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(qa, qb));
                    let mask = _mm512_set1_epi32(0x0f);
                    [
                        q4(_mm512_and_si512(lo, mask), d, m),
                        q4(_mm512_and_si512(hi, mask), d, m),
                        q4(_mm512_srli_epi32::<4>(lo), d, m),
                        q4(_mm512_srli_epi32::<4>(hi), d, m),
                    ]
                } else {
                    let (a0, b0) = (
                        _mm_loadu_si128(pa.add(2).cast()),
                        _mm_loadu_si128(pb.add(2).cast()),
                    );
                    let (a1, b1) = (
                        _mm_loadu_si128(pa.add(18).cast()),
                        _mm_loadu_si128(pb.add(18).cast()),
                    );
                    [
                        q8(_mm_unpacklo_epi64(a0, b0), d),
                        q8(_mm_unpackhi_epi64(a0, b0), d),
                        q8(_mm_unpacklo_epi64(a1, b1), d),
                        q8(_mm_unpackhi_epi64(a1, b1), d),
                    ]
                };
            }
            for q in 0..4 {
                let mut a = [_mm512_setzero_ps(); MR];
                for (i, a) in a.iter_mut().enumerate() {
                    *a = load_both(x.add(i * k + b * BLOCK + 8 * q));
                }
                for j in 0..NP {
                    for i in 0..MR {
                        acc[i][j] = _mm512_fmadd_ps(a[i], v[j][q], acc[i][j]);
                    }
                }
            }
        }
    }
    let mut out = [[[0.0f32; 2]; NP]; MR];
    for i in 0..MR {
        for j in 0..NP {
            out[i][j] = hsum2(acc[i][j]);
        }
    }
    out
}

/// Write the first `live` columns of a tile of row pairs.
///
/// # Safety
/// `out` valid for `MR` rows of stride `stride` and `min(2 * NP, live)`
/// columns.
#[inline]
unsafe fn store<const MR: usize, const NP: usize>(
    r: &[[[f32; 2]; NP]; MR],
    out: *mut f32,
    stride: usize,
    live: usize,
) {
    for (i, row) in r.iter().enumerate() {
        for (j, v) in row.iter().flatten().enumerate().take(live) {
            // SAFETY: by the caller.
            unsafe { *out.add(i * stride + j) = *v };
        }
    }
}
