//! AVX2 + FMA + F16C build of [`super::gemm`], chosen at run time: the
//! panel dequantization, the register tiles, and the fused path for one or
//! two activation rows. Same arithmetic, to the bit, as the portable path
//! (see that module). Blocks are decoded by [`super::x86_blocks`]: in the
//! fused path Q4_0, Q4_1 and Q8_0 eight values at a time straight from the
//! block bytes with the scales in registers, MXFP4 a block at a time with
//! its scale in a register and its codes looked up in one `vpshufb`, every
//! other format a 32-value group at a time.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::scalar::{self, Head};
use super::x86_blocks::{chunk, eighth, head, is_direct, legacy_chunk, legacy_scales, quants};
use super::{code, with_format, QFormat, GROUP};
use crate::simd::hsum;

/// Dequantize whole blocks of `w` into `out`, values in order.
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize(format: QFormat, w: &[u8], out: &mut [f32]) {
    // SAFETY: the caller has the features.
    with_format!(format, F => unsafe { super::x86_blocks::dequantize::<F>(w, out) })
}

/// `MR` activation rows against `NR` panel rows, `k` values each:
/// `out[i][j]`, in the module's order.
///
/// # Safety
/// `x` readable for `MR` rows of stride `xs`, `w` for `NR` rows of `k`;
/// `k` a multiple of 8; AVX2/FMA.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const MR: usize, const NR: usize>(
    x: *const f32,
    xs: usize,
    w: *const f32,
    k: usize,
) -> [[f32; NR]; MR] {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    let mut kk = 0;
    while kk < k {
        // SAFETY: kk + 8 <= k, inside every row (the caller).
        unsafe {
            let mut a = [_mm256_setzero_ps(); MR];
            for (i, a) in a.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(x.add(i * xs + kk));
            }
            for j in 0..NR {
                let b = _mm256_loadu_ps(w.add(j * k + kk));
                for i in 0..MR {
                    acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
                }
            }
        }
        kk += 8;
    }
    let mut out = [[0.0f32; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            out[i][j] = hsum(acc[i][j]);
        }
    }
    out
}

/// Activation rows per chunk of the panel loop: a chunk (at most 24 x
/// 1536 f32, 144 KiB) stays in L2 while each 4-row slice of the panel (in
/// L1) passes over it.
const T_CHUNK: usize = 24;

/// Panel rows per register tile ([`tile`] is 3 x 4: twelve accumulators,
/// three activation vectors and one panel vector in the sixteen
/// registers). A lone last activation row takes twice as many panel rows,
/// so eight multiply-add chains are in flight.
pub(super) const TILE_ROWS: usize = 4;

/// Every row of `x` against the `prows` rows of `panel` (a multiple of
/// `2 * TILE_ROWS`); writes `out[t * stride + j]` for `j < live`.
///
/// # Safety
/// AVX2/FMA/F16C; `out` valid for those writes.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
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
            && prows.is_multiple_of(2 * TILE_ROWS)
            && x.len() >= rows * k
            && panel.len() >= prows * k
    );
    let (xp, wp) = (x.as_ptr(), panel.as_ptr());
    // `ahead` (the next panel's bytes) is hinted into L2 a few lines before
    // each register tile, so its memory traffic overlaps the multiply-adds.
    let tiles = rows.div_ceil(T_CHUNK) * (prows / TILE_ROWS) * T_CHUNK.min(rows).div_ceil(3);
    let ahead = &mut Ahead::new(ahead, tiles);
    // SAFETY (all): activation rows t .. t + MR <= rows and panel rows
    // j .. j + TILE_ROWS <= prows, checked above; writes by the caller.
    unsafe {
        for c in (0..rows).step_by(T_CHUNK) {
            let end = (c + T_CHUNK).min(rows);
            for j in (0..prows).step_by(TILE_ROWS) {
                let live = live.saturating_sub(j);
                let w = wp.add(j * k);
                let mut t = c;
                while t + 3 <= end {
                    ahead.step();
                    let r = tile::<3, TILE_ROWS>(xp.add(t * k), k, w, k);
                    store(&r, out.add(t * stride + j), stride, live);
                    t += 3;
                }
                if end - t == 2 {
                    ahead.step();
                    let r = tile::<2, TILE_ROWS>(xp.add(t * k), k, w, k);
                    store(&r, out.add(t * stride + j), stride, live);
                }
            }
            if (end - c) % 3 == 1 {
                let t = end - 1;
                for j in (0..prows).step_by(2 * TILE_ROWS) {
                    let r = tile::<1, { 2 * TILE_ROWS }>(xp.add(t * k), k, wp.add(j * k), k);
                    store(&r, out.add(t * stride + j), stride, live.saturating_sub(j));
                }
            }
        }
    }
}

/// Activation rows the fused path takes (no panel buffer): below this the
/// dequantization is redone per row pair but never stored.
pub(super) const FUSED_ROWS: usize = 2;

/// Up to [`FUSED_ROWS`] activation rows against whole rows of blocks `w`,
/// dequantizing in registers; `out[t * stride + r]` for every row `r` of `w`.
/// The same arithmetic as [`dequantize`] then [`tile`].
///
/// # Safety
/// AVX2/FMA/F16C; `out` valid for those writes.
#[target_feature(enable = "avx2,fma,f16c")]
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
            && (1..=FUSED_ROWS).contains(&rows)
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

/// [`fused`] for `MR` activation rows: weight rows by fours, the last few
/// one at a time.
///
/// # Safety
/// `x` readable for `MR` rows of `k`, `w` for `n` rows of `rb` bytes; `out`
/// valid for `MR` rows of stride `stride` and `n` columns; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
    // SAFETY (all): rows r .. r + 4 <= n (or r < n), by the caller.
    unsafe {
        while r + 4 <= n {
            let t = fused_tile::<MR, 4, F>(x, k, w.add(r * rb), rb);
            store(&t, out.add(r), stride, 4);
            r += 4;
        }
        while r < n {
            let t = fused_tile::<MR, 1, F>(x, k, w.add(r * rb), rb);
            store(&t, out.add(r), stride, 1);
            r += 1;
        }
    }
}

/// Rows ahead the fused path prefetches (many streams at once are more
/// than the hardware prefetcher follows).
const AHEAD: usize = 8;

/// `MR` activation rows against `NR` rows of blocks (`rb` bytes apart),
/// dequantized in registers a group (32 values) at a time. Each step feeds
/// every output's chain once, so `MR * NR` independent multiply-adds are
/// in flight.
///
/// # Safety
/// `x` readable for `MR` rows of `k`; `w` for `NR` rows of `k` values of
/// format `F`; AVX2/FMA/F16C.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused_tile<const MR: usize, const NR: usize, const F: u8>(
    x: *const f32,
    k: usize,
    w: *const u8,
    rb: usize,
) -> [[f32; NR]; MR] {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    let groups = bv / GROUP;
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    if const { is_direct(QFormat::of_code(F)) } {
        // SAFETY: by the caller, as below.
        unsafe { fused_legacy::<MR, NR, F>(&mut acc, x, k, w, rb) };
        return reduce_tile(&acc);
    }
    if F == code::MXFP4 {
        // SAFETY: by the caller, as below.
        unsafe { fused_mxfp4::<MR, NR>(&mut acc, x, k, w, rb) };
        return reduce_tile(&acc);
    }
    let mut heads = [Head::ZERO; NR];
    for b in 0..k / bv {
        // SAFETY: block b of each row, and values b*bv .. (b+1)*bv of each
        // activation row, by the caller. The prefetch is only a hint (it
        // may point past the matrix; it never faults).
        unsafe {
            let mut p = [w; NR];
            for j in 0..NR {
                p[j] = w.add(j * rb + b * bb);
                head::<F>(p[j], &mut heads[j]);
            }
            for g in 0..groups {
                let mut q = [_mm256_setzero_si256(); NR];
                for j in 0..NR {
                    // The next rows' same bytes, a few tiles ahead.
                    let ahead = p[j].wrapping_add(AHEAD * rb + g * bb / groups);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    q[j] = quants::<F>(p[j], g);
                }
                for c in 0..4 {
                    let mut a = [_mm256_setzero_ps(); MR];
                    for (i, a) in a.iter_mut().enumerate() {
                        *a = _mm256_loadu_ps(x.add(i * k + b * bv + GROUP * g + 8 * c));
                    }
                    for j in 0..NR {
                        let v = chunk::<F>(p[j], q[j], &heads[j], g, c);
                        for i in 0..MR {
                            acc[i][j] = _mm256_fmadd_ps(a[i], v, acc[i][j]);
                        }
                    }
                }
            }
        }
    }
    reduce_tile(&acc)
}

/// [`fused_tile`]'s accumulation for Q4_0, Q4_1 and Q8_0: each block's
/// scales once per row, each eight values straight from its bytes.
///
/// # Safety
/// As [`fused_tile`].
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused_legacy<const MR: usize, const NR: usize, const F: u8>(
    acc: &mut [[__m256; NR]; MR],
    x: *const f32,
    k: usize,
    w: *const u8,
    rb: usize,
) {
    let bb = const { QFormat::of_code(F).block_bytes() };
    for b in 0..k / GROUP {
        // SAFETY: block b of each row, and values b*32 .. b*32+32 of each
        // activation row, by the caller; the prefetch is a hint.
        unsafe {
            let mut sc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); NR];
            for (j, sc) in sc.iter_mut().enumerate() {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((j + AHEAD) * rb + b * bb).cast());
                *sc = legacy_scales(w.add(j * rb + b * bb));
            }
            for c in 0..4 {
                let mut a = [_mm256_setzero_ps(); MR];
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(x.add(i * k + b * GROUP + 8 * c));
                }
                for (j, &(d, m)) in sc.iter().enumerate() {
                    let v = legacy_chunk::<F>(w.add(j * rb + b * bb), c, d, m);
                    for i in 0..MR {
                        acc[i][j] = _mm256_fmadd_ps(a[i], v, acc[i][j]);
                    }
                }
            }
        }
    }
}

/// [`fused_tile`]'s accumulation for MXFP4: each block's scale converted
/// once per row into a register (no [`Head`]), its codes to quants by one
/// table lookup, each eight values widened and scaled: [`chunk`]'s
/// integers and operations (`float(q) * s`), so its bits.
///
/// # Safety
/// As [`fused_tile`].
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused_mxfp4<const MR: usize, const NR: usize>(
    acc: &mut [[__m256; NR]; MR],
    x: *const f32,
    k: usize,
    w: *const u8,
    rb: usize,
) {
    const F: u8 = code::MXFP4;
    let bb = const { QFormat::of_code(F).block_bytes() };
    for b in 0..k / GROUP {
        // SAFETY: block b of each row, and values b*32 .. b*32+32 of each
        // activation row, by the caller; the prefetch is a hint.
        unsafe {
            let mut s = [_mm256_setzero_ps(); NR];
            let mut q = [_mm256_setzero_si256(); NR];
            for j in 0..NR {
                let p = w.add(j * rb + b * bb);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD * rb).cast());
                s[j] = _mm256_set1_ps(scalar::E8M0_HALF[usize::from(*p)]);
                q[j] = quants::<F>(p, 0);
            }
            for c in 0..4 {
                let mut a = [_mm256_setzero_ps(); MR];
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(x.add(i * k + b * GROUP + 8 * c));
                }
                for j in 0..NR {
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eighth(q[j], c)));
                    let v = _mm256_mul_ps(v, s[j]);
                    for i in 0..MR {
                        acc[i][j] = _mm256_fmadd_ps(a[i], v, acc[i][j]);
                    }
                }
            }
        }
    }
}

/// Each accumulator's eight lanes summed (the module's tree).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_tile<const MR: usize, const NR: usize>(acc: &[[__m256; NR]; MR]) -> [[f32; NR]; MR] {
    let mut out = [[0.0f32; NR]; MR];
    for (o, a) in out.iter_mut().zip(acc) {
        for (o, a) in o.iter_mut().zip(a) {
            *o = hsum(*a);
        }
    }
    out
}

/// Write the first `live` columns of a tile.
///
/// # Safety
/// `out` valid for `MR` rows of stride `stride` and `min(NR, live)` columns.
#[inline]
unsafe fn store<const MR: usize, const NR: usize>(
    r: &[[f32; NR]; MR],
    out: *mut f32,
    stride: usize,
    live: usize,
) {
    for (i, row) in r.iter().enumerate() {
        for (j, v) in row.iter().enumerate().take(live) {
            // SAFETY: by the caller.
            unsafe { *out.add(i * stride + j) = *v };
        }
    }
}
