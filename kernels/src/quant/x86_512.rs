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
//! - The fused path builds the same pair vectors in registers
//!   ([`super::x86_512_blocks`]): the legacy formats and MXFP4 straight
//!   from the two rows' block bytes (one 16-byte load per row and block
//!   for Q4_1 and MXFP4, whose codes then take one table lookup), the
//!   K-quants a 32-value group at a time from each row's quants (the AVX2
//!   decoding in one half of a 512-bit register each, interleaved by
//!   eighths), F16 and BF16 by converting eight halves of each row.
//!
//! # Cost
//! Per 64 Q4_1 weights of a decode step about 26 instructions where AVX2
//! takes about 54. On Zen 4 a 512-bit operation occupies both 256-bit
//! halves of a pipe, so the arithmetic throughput is AVX2's; the gain is in
//! front-end and register pressure (32 registers: 4 x 8 output tiles in the
//! panel). A K-quant group costs more (its quants are unpacked per row in
//! 256-bit registers, then paired, and its scales broadcast per group):
//! see the table in [`super`] for every format.
//!
//! Measured before the K-quants (`taskset -c 0 cargo bench --bench
//! quant`, EPYC Zen 4, one core of a shared machine, so +-10%): AVX2's
//! time over this build's, SmolLM2-135M shapes, rows 1 / 2 / 16 / 64 / 512:
//! gate+up Q4_1 [3072x576] 1.19 / 1.56 / 1.14 / 1.10 / 1.06;
//! down Q4_1 [576x1536] 1.18 / 1.19 / 1.34 / 1.28 / 1.34;
//! lm_head Q8_0 [49152x576] (28 MB, bandwidth-bound) 2.05 / 1.22 / 0.96 /
//! 1.04. No shape was reliably slower than AVX2 (the 0.96 is within the
//! noise of repeated runs), so no shape delegates to the AVX2 build.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::scalar::Head;
use super::x86_512_blocks::{chunk2, legacy_pair, legacy_pair_scales, pair_quants};
use super::x86_blocks::{head, is_legacy};
use super::{with_format, QFormat, GROUP};
use crate::simd512::{hsum2, load_both};

/// Dequantize whole blocks of `w` into `out`, values in order, as
/// [`super::x86::dequantize`] (to the bit): blocks two at a time, one per
/// half.
///
/// # Safety
/// AVX-512 F/BW/VL/DQ with AVX2/FMA/F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn dequantize(format: QFormat, w: &[u8], out: &mut [f32]) {
    // SAFETY: the caller has the features.
    with_format!(format, F => unsafe { dequantize_blocks::<F>(w, out) })
}

/// [`dequantize`] for format `F`.
///
/// # Safety
/// As [`dequantize`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn dequantize_blocks<const F: u8>(w: &[u8], out: &mut [f32]) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    let nb = w.len() / bb;
    assert!(w.len() == nb * bb && out.len() >= nb * bv, "whole blocks");
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    for b in (0..nb).step_by(2) {
        // SAFETY: blocks b and (if there) b + 1 lie in `w`, their values
        // in `out` (asserted).
        unsafe {
            let second = b + 1 < nb;
            let (pa, pb) = (wp.add(b * bb), wp.add((b + usize::from(second)) * bb));
            let (mut ha, mut hb) = (Head::ZERO, Head::ZERO);
            head::<F>(pa, &mut ha);
            head::<F>(pb, &mut hb);
            for g in 0..bv / GROUP {
                let q = pair_quants::<F>(pa, pb, g);
                for c in 0..4 {
                    let v = chunk2::<F>(pa, pb, q, &ha, &hb, g, c);
                    let at = op.add(b * bv + GROUP * g + 8 * c);
                    _mm256_storeu_ps(at, _mm512_castps512_ps256(v));
                    if second {
                        _mm256_storeu_ps(at.add(bv), _mm512_extractf32x8_ps::<1>(v));
                    }
                }
            }
        }
    }
}

/// Dequantize `live` rows of `k` values (rows of `w`) into a panel of
/// `prows` rows in the pair-interleaved layout of the module docs; rows
/// from `live` on are zeros.
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
    let rb = format.row_bytes(k);
    assert!(
        prows.is_multiple_of(2)
            && live <= prows
            && w.len() >= live * rb
            && out.len() >= prows * k
            && k.is_multiple_of(format.block_values())
    );
    if live == 0 {
        out[..prows * k].fill(0.0);
        return;
    }
    // SAFETY: the caller has the features; sizes asserted.
    with_format!(format, F => unsafe { pairs::<F>(w, live, prows, k, out) })
}

/// [`dequantize_pairs`] for format `F` (`live >= 1`, sizes checked).
///
/// # Safety
/// As [`dequantize_pairs`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn pairs<const F: u8>(w: &[u8], live: usize, prows: usize, k: usize, out: &mut [f32]) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    let rb = f.row_bytes(k);
    let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
    let row = |r: usize| r.min(live - 1);
    for p in 0..prows / 2 {
        // Rows past the matrix's end (their results are never read) are
        // zeros: the halves of those rows are masked off.
        let keep =
            (if 2 * p < live { 0x00ff } else { 0 }) | (if 2 * p + 1 < live { 0xff00 } else { 0 });
        for b in 0..k / bv {
            // SAFETY: rows below `live` are in `w`; pair p's 2k floats in
            // `out` (asserted by the caller).
            unsafe {
                let pa = wp.add(row(2 * p) * rb + b * bb);
                let pb = wp.add(row(2 * p + 1) * rb + b * bb);
                let (mut ha, mut hb) = (Head::ZERO, Head::ZERO);
                head::<F>(pa, &mut ha);
                head::<F>(pb, &mut hb);
                for g in 0..bv / GROUP {
                    let q = pair_quants::<F>(pa, pb, g);
                    for c in 0..4 {
                        let v = chunk2::<F>(pa, pb, q, &ha, &hb, g, c);
                        let at = op.add(p * 2 * k + 2 * (b * bv + GROUP * g + 8 * c));
                        _mm512_storeu_ps(at, _mm512_maskz_mov_ps(keep, v));
                    }
                }
            }
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
    let ahead = &mut Ahead::new(ahead, tiles);
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
                    ahead.step();
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
    let rb = format.row_bytes(k);
    let n = w.len() / rb;
    assert!(
        w.len() == n * rb
            && x.len() >= rows * k
            && (1..=2).contains(&rows)
            && k.is_multiple_of(format.block_values())
    );
    let (x, w) = (x.as_ptr(), w.as_ptr());
    // SAFETY (all): as asserted; writes by the caller.
    with_format!(format, F => unsafe {
        if rows == 1 {
            fused_rows::<1, F>(x, k, w, rb, n, out, stride)
        } else {
            fused_rows::<2, F>(x, k, w, rb, n, out, stride)
        }
    })
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
unsafe fn fused_rows<const MR: usize, const F: u8>(
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
            let mut rows = [w; 2 * FUSED_PAIRS];
            for (i, p) in rows.iter_mut().enumerate() {
                *p = w.add((r + i) * rb);
            }
            let t = fused_tile::<MR, FUSED_PAIRS, F>(x, k, &rows, rb);
            store(&t, out.add(r), stride, 2 * FUSED_PAIRS);
            r += 2 * FUSED_PAIRS;
        }
        while r < n {
            let b = (r + 1).min(n - 1);
            let t = fused_tile::<MR, 1, F>(x, k, &[w.add(r * rb), w.add(b * rb)], rb);
            store(&t, out.add(r), stride, n - r);
            r += 2;
        }
    }
}

/// Rows ahead the fused path prefetches (many streams at once are more
/// than the hardware prefetcher follows).
const AHEAD: usize = 16;

/// `MR` activation rows against `2 * NP` rows of blocks (`rows[2j]` and
/// `rows[2j + 1]` share pair `j`'s registers), dequantized in registers a
/// group (32 values) at a time.
///
/// # Safety
/// `x` readable for `MR` rows of `k`; each row pointer for `k` values of
/// format `F`; AVX-512.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fused_tile<const MR: usize, const NP: usize, const F: u8>(
    x: *const f32,
    k: usize,
    rows: &[*const u8],
    rb: usize,
) -> [[[f32; 2]; NP]; MR] {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    let groups = bv / GROUP;
    let mut acc = [[_mm512_setzero_ps(); NP]; MR];
    if const { is_legacy(QFormat::of_code(F)) } {
        // SAFETY: by the caller, as below.
        unsafe { fused_legacy::<MR, NP, F>(&mut acc, x, k, rows, rb) };
        return reduce_tile(&acc);
    }
    let (mut ha, mut hb) = ([Head::ZERO; NP], [Head::ZERO; NP]);
    for b in 0..k / bv {
        // SAFETY: block b of each row and values b*bv .. (b+1)*bv of each
        // activation row, by the caller; prefetches are hints (they may
        // point past the matrix and never fault).
        unsafe {
            let (mut pa, mut pb) = ([rows[0]; NP], [rows[0]; NP]);
            for j in 0..NP {
                pa[j] = rows[2 * j].add(b * bb);
                pb[j] = rows[2 * j + 1].add(b * bb);
                head::<F>(pa[j], &mut ha[j]);
                head::<F>(pb[j], &mut hb[j]);
            }
            for g in 0..groups {
                let mut q = [_mm512_setzero_si512(); NP];
                for j in 0..NP {
                    // The same rows' bytes AHEAD rows on (two tiles).
                    let at = AHEAD * rb + g * bb / groups;
                    _mm_prefetch::<_MM_HINT_T0>(pa[j].wrapping_add(at).cast());
                    _mm_prefetch::<_MM_HINT_T0>(pb[j].wrapping_add(at).cast());
                    q[j] = pair_quants::<F>(pa[j], pb[j], g);
                }
                for c in 0..4 {
                    let mut a = [_mm512_setzero_ps(); MR];
                    for (i, a) in a.iter_mut().enumerate() {
                        *a = load_both(x.add(i * k + b * bv + GROUP * g + 8 * c));
                    }
                    for j in 0..NP {
                        let v = chunk2::<F>(pa[j], pb[j], q[j], &ha[j], &hb[j], g, c);
                        for i in 0..MR {
                            acc[i][j] = _mm512_fmadd_ps(a[i], v, acc[i][j]);
                        }
                    }
                }
            }
        }
    }
    reduce_tile(&acc)
}

/// [`fused_tile`]'s accumulation for a legacy format: each pair's blocks
/// decoded straight from their bytes, scales converted once per block pair.
///
/// # Safety
/// As [`fused_tile`].
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fused_legacy<const MR: usize, const NP: usize, const F: u8>(
    acc: &mut [[__m512; NP]; MR],
    x: *const f32,
    k: usize,
    rows: &[*const u8],
    rb: usize,
) {
    let bb = const { QFormat::of_code(F).block_bytes() };
    for b in 0..k / GROUP {
        // SAFETY: block b of each row and values b*32 .. b*32+32 of each
        // activation row, by the caller; prefetches are hints.
        unsafe {
            let mut v = [[_mm512_setzero_ps(); 4]; NP];
            for (j, v) in v.iter_mut().enumerate() {
                let (pa, pb) = (rows[2 * j].add(b * bb), rows[2 * j + 1].add(b * bb));
                _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(AHEAD * rb).cast());
                _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(AHEAD * rb).cast());
                let (d, m) = legacy_pair_scales::<F>(pa, pb);
                *v = legacy_pair::<F>(pa, pb, d, m);
            }
            for c in 0..4 {
                let mut a = [_mm512_setzero_ps(); MR];
                for (i, a) in a.iter_mut().enumerate() {
                    *a = load_both(x.add(i * k + b * GROUP + 8 * c));
                }
                for j in 0..NP {
                    for i in 0..MR {
                        acc[i][j] = _mm512_fmadd_ps(a[i], v[j][c], acc[i][j]);
                    }
                }
            }
        }
    }
}

/// Each accumulator's two chains summed (the module's tree per half).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn reduce_tile<const MR: usize, const NP: usize>(acc: &[[__m512; NP]; MR]) -> [[[f32; 2]; NP]; MR] {
    let mut out = [[[0.0f32; 2]; NP]; MR];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, a) in o.iter_mut().zip(a) {
            *o = hsum2(*a);
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
