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
//!   rows' quants: each row's 32 quants of a group (the AVX2 decoding,
//!   [`super::x86_blocks::quants`]) in one half of a 512-bit register,
//!   interleaved by eighths, so eight values of each row widen and scale
//!   in one instruction each.
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

use super::scalar::Head;
use super::x86_blocks::{field, head, load16, nibbles16, qh, quants, sub};
use super::{code, with_format, QFormat, GROUP};
use crate::simd512::{hsum2, load_both};

/// Group `g`'s quants of two blocks: 128-bit lane `c` holds row `a`'s
/// bytes `8c .. 8c + 8` then row `b`'s.
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F`; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn pair_quants<const F: u8>(a: *const u8, b: *const u8, g: usize) -> __m512i {
    if !const { QFormat::of_code(F).is_quantized() } {
        return _mm512_setzero_si512();
    }
    // SAFETY: by the caller.
    let (qa, qb) = unsafe { (quants512::<F>(a, g), quants512::<F>(b, g)) };
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
    _mm512_permutexvar_epi64(_mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0), v)
}

/// [`quants`] with AVX-512's byte masks where a format has a bit plane
/// (the fifth bit of Q5_0, Q5_1 and Q5_K, Q3_K's high bit): one test and
/// one masked add instead of AVX2's shuffles and compares. The same
/// integers.
///
/// # Safety
/// As [`quants`]; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn quants512<const F: u8>(p: *const u8, g: usize) -> __m256i {
    let sixteen = _mm256_set1_epi8(16);
    // SAFETY (all): offsets inside the block, by the format's layout.
    unsafe {
        match F {
            code::Q5_0 | code::Q5_1 => {
                let (qh_at, qs_at) = if F == code::Q5_0 { (2, 6) } else { (4, 8) };
                let low = nibbles16(load16(p.add(qs_at)));
                let k = _cvtu32_mask32(qh(p.add(qh_at)));
                let q = _mm256_mask_add_epi8(low, k, low, sixteen);
                if F == code::Q5_0 {
                    sub(q, 16)
                } else {
                    q
                }
            }
            code::Q3_K => {
                // Minus 4 where the high bit is clear.
                let low = field(p.add(32 + 32 * (g / 4)), 2 * (g % 4), 3);
                let plane = _mm256_loadu_si256(p.cast());
                let clear = _mm256_testn_epi8_mask(plane, _mm256_set1_epi8((1u8 << g) as i8));
                _mm256_mask_sub_epi8(low, clear, low, _mm256_set1_epi8(4))
            }
            code::Q5_K => {
                let low = field(p.add(48 + 32 * (g / 2)), 4 * (g % 2), 0x0f);
                let plane = _mm256_loadu_si256(p.add(16).cast());
                let set = _mm256_test_epi8_mask(plane, _mm256_set1_epi8((1u8 << g) as i8));
                _mm256_mask_add_epi8(low, set, low, sixteen)
            }
            _ => quants::<F>(p, g),
        }
    }
}

/// `x` in the low half and `y` in the high half of every lane pair.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn both(x: f32, y: f32) -> __m512 {
    _mm512_insertf32x8::<1>(_mm512_set1_ps(x), _mm256_set1_ps(y))
}

/// Values `8c .. 8c + 8` of group `g` of blocks `a` (low half) and `b`
/// (high half): each half [`super::x86_blocks::chunk`]'s operations, so
/// its bits. `q` is the group's [`pair_quants`], `ha`, `hb` the blocks'
/// heads.
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F`, `g` below their groups,
/// `c < 4`; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn chunk2<const F: u8>(
    a: *const u8,
    b: *const u8,
    q: __m512i,
    ha: &Head,
    hb: &Head,
    g: usize,
    c: usize,
) -> __m512 {
    let f = const { QFormat::of_code(F) };
    if !f.is_quantized() {
        // SAFETY: eight halves of each 32-value block.
        let raw = unsafe { _mm256_set_m128i(load16(b.add(16 * c)), load16(a.add(16 * c))) };
        return if F == code::F16 {
            _mm512_cvtph_ps(raw)
        } else {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        };
    }
    let e = match c {
        0 => _mm512_castsi512_si128(q),
        1 => _mm512_extracti32x4_epi32::<1>(q),
        2 => _mm512_extracti32x4_epi32::<2>(q),
        _ => _mm512_extracti32x4_epi32::<3>(q),
    };
    let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e));
    let i = (GROUP * g + 8 * c) / f.sub_block();
    let s = both(ha.s[i], hb.s[i]);
    if f.has_offset() {
        _mm512_fmadd_ps(v, s, both(ha.o[i], hb.o[i]))
    } else {
        _mm512_mul_ps(v, s)
    }
}

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
