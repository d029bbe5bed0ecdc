//! AVX-512 build of attention: the register tiles of [`super::tiled`]
//! (head sizes a multiple of 32) and the vector primitives of the generic
//! block (other head sizes), with the AVX2 builds' arithmetic, so the same
//! bits (see `tiled.rs` for the order of operations).
//!
//! - Scores: a register holds keys `p` and `p + 1` in its halves (the AVX2
//!   eight-lane chain each) against one query's eight values broadcast to
//!   both (`vbroadcastf32x8`); six queries x four keys per tile, half the
//!   AVX2 build's instructions for the same chains, each half reduced by
//!   the AVX2 build's tree.
//! - Outputs: every output element is its own chain, so sixteen of them
//!   fill a register: six queries x 32 values per tile (twelve
//!   accumulators), weights broadcast, V rows loaded (or widened from f16)
//!   sixteen at a time.
//! - Softmax is the AVX2 build's (its cost is one polynomial per score).
//!
//! # Cost
//! On Zen 4 a 512-bit operation occupies both halves of a 256-bit pipe,
//! so the gain over AVX2 is in instructions issued, not in arithmetic
//! throughput. Measured (`taskset -c 0 cargo bench --bench paths`, EPYC
//! Zen 4, one core of a shared machine; 9 heads / 3 KV heads / 64): AVX2's
//! time over this build's, prefill of 512 tokens 1.06 (f32 pool) and 1.07
//! (f16), a decode step at position 1023 1.06 (f32) and 1.11 (f16).

use std::arch::x86_64::*;

use super::tiled::{self, reduce4, Elem, Tiles, MAX_SQ};
use super::BlockArgs;
use crate::simd512::load_both;

/// One KV head's attention for `queries` (vector, position) into `outs`.
///
/// # Safety
/// AVX-512 F/DQ with the AVX2 set; `tiled::supports(head_dim)`.
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn attend_block(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    let f16 = args
        .1
        .iter()
        .flatten()
        .any(|s| s.k.dtype() == crate::KvDtype::F16);
    // SAFETY: by the caller.
    unsafe {
        if f16 {
            tiled::attend_typed::<half::f16, Avx512Tiles>(queries, outs, args)
        } else {
            tiled::attend_typed::<f32, Avx512Tiles>(queries, outs, args)
        }
    }
}

/// The AVX-512 tiles.
pub(super) struct Avx512Tiles;

impl Tiles for Avx512Tiles {
    const SQ: usize = MAX_SQ;
    const WQ: usize = MAX_SQ;

    #[inline(always)]
    unsafe fn scores<E: Elem>(
        q: &[*const f32],
        k: &[*const E; 4],
        hd: usize,
    ) -> [[f32; 4]; MAX_SQ] {
        // SAFETY: by the caller.
        unsafe {
            match q.len() {
                6 => pad(scores::<6, E>(q, k, hd)),
                5 => pad(scores::<5, E>(q, k, hd)),
                4 => pad(scores::<4, E>(q, k, hd)),
                3 => pad(scores::<3, E>(q, k, hd)),
                2 => pad(scores::<2, E>(q, k, hd)),
                _ => pad(scores::<1, E>(q, k, hd)),
            }
        }
    }

    #[inline(always)]
    unsafe fn weighted<E: Elem>(
        out: &[*mut f32],
        w: &[Vec<f32>],
        off: &[usize],
        d: usize,
        vr: &[*const E],
    ) {
        // SAFETY: by the caller.
        unsafe {
            match out.len() {
                6 => weighted::<6, E>(out, w, off, d, vr),
                5 => weighted::<5, E>(out, w, off, d, vr),
                4 => weighted::<4, E>(out, w, off, d, vr),
                3 => weighted::<3, E>(out, w, off, d, vr),
                2 => weighted::<2, E>(out, w, off, d, vr),
                _ => weighted::<1, E>(out, w, off, d, vr),
            }
        }
    }

    #[inline(always)]
    unsafe fn axpy1<E: Elem>(w: f32, v: *const E, out: *mut f32, hd: usize) {
        // SAFETY: by the caller.
        unsafe { axpy1(w, v, out, hd) }
    }
}

fn pad<const MR: usize>(s: [[f32; 4]; MR]) -> [[f32; 4]; MAX_SQ] {
    let mut out = [[0.0; 4]; MAX_SQ];
    out[..MR].copy_from_slice(&s);
    out
}

/// `MR` queries against four key rows (keys 0-1 and 2-3 in the halves of
/// two registers): the scores before scaling, as `tiled::scores`.
///
/// # Safety
/// Every pointer readable for `hd` values (a multiple of 8); AVX-512.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")]
unsafe fn scores<const MR: usize, E: Elem>(
    q: &[*const f32],
    k: &[*const E; 4],
    hd: usize,
) -> [[f32; 4]; MR] {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let mut d = 0;
    while d < hd {
        // SAFETY: d + 8 <= hd.
        unsafe {
            // (Written out: as an array `map` closure this was not inlined
            // and the build ran at half AVX2's speed.)
            let kv = [
                _mm512_insertf32x8::<1>(
                    _mm512_castps256_ps512(E::load8(k[0].add(d))),
                    E::load8(k[1].add(d)),
                ),
                _mm512_insertf32x8::<1>(
                    _mm512_castps256_ps512(E::load8(k[2].add(d))),
                    E::load8(k[3].add(d)),
                ),
            ];
            for i in 0..MR {
                let qv = load_both(q[i].add(d));
                acc[i][0] = _mm512_fmadd_ps(qv, kv[0], acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(qv, kv[1], acc[i][1]);
            }
        }
        d += 8;
    }
    let mut out = [[0.0; 4]; MR];
    for i in 0..MR {
        let [a, b] = acc[i];
        out[i] = reduce4([
            _mm512_castps512_ps256(a),
            _mm512_extractf32x8_ps::<1>(a),
            _mm512_castps512_ps256(b),
            _mm512_extractf32x8_ps::<1>(b),
        ]);
    }
    out
}

/// `out += w * v` for one query and one value row, sixteen at a time.
///
/// # Safety
/// Both pointers valid for `hd` values (a multiple of 16); AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")]
unsafe fn axpy1<E: Elem>(w: f32, v: *const E, out: *mut f32, hd: usize) {
    let wv = _mm512_set1_ps(w);
    let mut d = 0;
    while d < hd {
        // SAFETY: d + 16 <= hd.
        unsafe {
            let o = out.add(d);
            _mm512_storeu_ps(
                o,
                _mm512_fmadd_ps(wv, E::load16(v.add(d)), _mm512_loadu_ps(o)),
            );
        }
        d += 16;
    }
}

/// Values `d .. d + 32` of `MR` queries' outputs over the value rows `vr`
/// (query `i`'s weight for `vr[n]` is `w[i][off[i] + n]`), accumulators in
/// registers, as `tiled::weighted`.
///
/// # Safety
/// Output pointers valid for `d + 32` values, rows for `d + 32`; AVX-512.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")]
unsafe fn weighted<const MR: usize, E: Elem>(
    out: &[*mut f32],
    w: &[Vec<f32>],
    off: &[usize],
    d: usize,
    vr: &[*const E],
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let ws: [&[f32]; MR] = std::array::from_fn(|i| &w[i][off[i]..off[i] + vr.len()]);
    // SAFETY: by the caller.
    unsafe {
        for i in 0..MR {
            for j in 0..2 {
                acc[i][j] = _mm512_loadu_ps(out[i].add(d + 16 * j));
            }
        }
        for (n, &v) in vr.iter().enumerate() {
            let v = v.add(d);
            let vj = [E::load16(v), E::load16(v.add(16))];
            for i in 0..MR {
                let wv = _mm512_set1_ps(*ws[i].get_unchecked(n));
                acc[i][0] = _mm512_fmadd_ps(wv, vj[0], acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(wv, vj[1], acc[i][1]);
            }
        }
        for i in 0..MR {
            for j in 0..2 {
                _mm512_storeu_ps(out[i].add(d + 16 * j), acc[i][j]);
            }
        }
    }
}

/// The generic block's primitives on AVX-512 (head sizes the tiles do not
/// take); only instantiated inside `attend_block_avx512`, which runs only
/// where the CPU has AVX-512.
pub(crate) struct Avx512;

impl super::Lanes for Avx512 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: see the type's comment.
        unsafe { dot(a, b) }
    }

    #[inline(always)]
    fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
        // SAFETY: see the type's comment.
        unsafe { axpy(w, x, out) }
    }
}

/// The AVX2 build's dot: its two eight-lane accumulators (values `i .. i +
/// 8` and `i + 8 .. i + 16` of each group of sixteen) are the halves of
/// one register, summed as that build sums them; the tail one by one.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut s = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n, within both slices.
        unsafe {
            s = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
                s,
            );
        }
        i += 16;
    }
    let halves = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps::<1>(s));
    let mut sum = crate::simd::hsum(halves);
    for j in i..n {
        sum += a[j] * b[j];
    }
    sum
}

/// The AVX2 build's axpy: a fused multiply-add for every element of a
/// whole group of eight (sixteen at a time, then eight), the rest
/// unfused one by one.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let mut i = 0;
    // SAFETY (all): i + 16 (or i + 8) <= n, within both slices.
    unsafe {
        let wv = _mm512_set1_ps(w);
        while i + 16 <= n {
            let o = out.as_mut_ptr().add(i);
            let r = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(o));
            _mm512_storeu_ps(o, r);
            i += 16;
        }
        if i + 8 <= n {
            let o = out.as_mut_ptr().add(i);
            let r = _mm256_fmadd_ps(
                _mm256_set1_ps(w),
                _mm256_loadu_ps(x.as_ptr().add(i)),
                _mm256_loadu_ps(o),
            );
            _mm256_storeu_ps(o, r);
            i += 8;
        }
    }
    for j in i..n {
        out[j] += w * x[j];
    }
}
