//! AVX-512 build of attention: the register tiles of [`super::tiled`]
//! (head sizes a multiple of 32) and the vector primitives of the generic
//! block (other head sizes), with the AVX2 builds' arithmetic, so the same
//! bits (see `tiled.rs` for the order of operations).
//!
//! - Scores: a register holds keys `p` and `p + 1` in its halves (the AVX2
//!   eight-lane chain each) against one query's eight values broadcast to
//!   both (`vbroadcastf32x8`); six queries x four keys per tile, half the
//!   AVX2 build's instructions for the same chains, reduced by the AVX2
//!   build's tree sixteen scores at a time (`pairs`: pairwise sums across
//!   registers, as `vhaddps` makes them on eight lanes).
//! - Outputs: every output element is its own chain, so sixteen of them
//!   fill a register: six queries x 32 values per tile (twelve
//!   accumulators), weights broadcast, V rows loaded (or widened from f16)
//!   sixteen at a time.
//! - Softmax is the AVX2 build's, its polynomial sixteen scores at a time
//!   (`exp_sum16`: each half goes to the eight-lane sums in position
//!   order). With the reduction: 0.96x the time of a 512-token prompt's
//!   attention (`RAYON_NUM_THREADS=1 PATHS_BENCH="attention prefill"`, ten
//!   rounds alternated, medians; f32 and f16 pools alike).
//!
//! # Cost
//! On Zen 4 a 512-bit operation occupies both halves of a 256-bit pipe,
//! so the gain over AVX2 is in instructions issued, not in arithmetic
//! throughput. Measured (`taskset -c 0 cargo bench --bench paths`, EPYC
//! Zen 4, one core of a shared machine; 9 heads / 3 KV heads / 64): AVX2's
//! time over this build's, prefill of 512 tokens 1.06 (f32 pool) and 1.07
//! (f16), a decode step at position 1023 1.06 (f32) and 1.11 (f16).

use std::arch::x86_64::*;

use super::tiled::{self, Elem, Tiles, MAX_SQ};
use super::BlockArgs;
use crate::simd512::{exp, load_both};

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

    #[inline(always)]
    unsafe fn exp_sum(body: &mut [f32], max: __m256, sum: __m256) -> __m256 {
        // SAFETY: by the caller.
        unsafe { exp_sum16(body, max, sum) }
    }

    #[inline(always)]
    unsafe fn widen<E: Elem>(r: *const E, dst: *mut f32, hd: usize) {
        for d in (0..hd).step_by(16) {
            // SAFETY: by the caller.
            unsafe { _mm512_storeu_ps(dst.add(d), E::load16(r.add(d))) };
        }
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
    // The AVX2 build's tree, `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
    // l7))` per score, sixteen scores at a time: a pairwise step on each
    // query's two registers, one on two queries' results, then the halves
    // (lanes 0-3 and 4-7) added; a permutation puts each query's four
    // scores in order: four queries' sixteen scores in 21 vector
    // operations, where `reduce4` (about 14 a query) took about 56.
    // SAFETY (`pairs`): this build has AVX-512.
    let h: [__m512; MR] = std::array::from_fn(|i| unsafe { pairs(acc[i][0], acc[i][1]) });
    let mut out = [[0.0f32; 4]; MR];
    // Lane 4i + j of `s` below holds (query, key): (0, 0), (0, 2), (1, 0),
    // (1, 2), then (0, 1), (0, 3), (1, 1), (1, 3), then queries 2 and 3 as
    // 0 and 1: these indices put them in (query, key) order.
    let order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    let mut i = 0;
    while i < MR {
        let at = |q: usize| h[q.min(MR - 1)];
        // SAFETY: as above.
        let g = unsafe { [pairs(at(i), at(i + 1)), pairs(at(i + 2), at(i + 3))] };
        let s = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(g[0], g[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(g[0], g[1]),
        );
        let live = 4 * (MR - i).min(4);
        // SAFETY: queries i .. i + live / 4 of `out`, four floats each.
        unsafe {
            _mm512_mask_storeu_ps(
                out.as_mut_ptr().cast::<f32>().add(4 * i),
                ((1u32 << live) - 1) as __mmask16,
                _mm512_permutexvar_ps(order, s),
            );
        }
        i += 4;
    }
    out
}

/// Per 128-bit lane `a0 + a1, a2 + a3, b0 + b1, b2 + b3`: `vhaddps`'s
/// sums, on sixteen lanes.
///
/// # Safety
/// AVX-512 F (inlined into the build's functions, which enable it).
#[inline(always)]
unsafe fn pairs(a: __m512, b: __m512) -> __m512 {
    // SAFETY: by the caller.
    unsafe {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
            _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
        )
    }
}

/// `Tiles::exp_sum` sixteen scores at a time: `simd512::exp` is the
/// eight-lane `exp` lane by lane, and positions `16n + l` then `16n + 8 +
/// l` go to lane `l`'s sum in that order, as eight at a time add them.
///
/// # Safety
/// AVX-512 F with AVX2.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
unsafe fn exp_sum16(body: &mut [f32], max: __m256, mut sum: __m256) -> __m256 {
    let mx = _mm512_broadcast_f32x8(max);
    let mut sixteens = body.chunks_exact_mut(16);
    for c in &mut sixteens {
        // SAFETY: a chunk of sixteen floats.
        unsafe {
            let e = exp(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mx));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
            sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps::<1>(e));
        }
    }
    // SAFETY: as `exp_sum8` needs (a whole group of eight or none).
    unsafe { tiled::exp_sum8(sixteens.into_remainder(), max, sum) }
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
