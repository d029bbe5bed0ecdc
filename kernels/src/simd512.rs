//! x86-64 helpers shared by the kernels' AVX-512 builds.
//!
//! The AVX-512 builds keep the AVX2 builds' arithmetic: where a result is
//! one eight-lane chain, a 512-bit register holds two independent chains
//! (two weight rows, two keys), one per 256-bit half, each half doing
//! exactly the AVX2 chain and reduced by the same tree ([`hsum2`]).

use std::arch::x86_64::*;

use crate::simd::hsum;

/// The two 256-bit halves of `v`, each summed as [`crate::simd::hsum`]
/// sums eight lanes: `[low half, high half]`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2")]
pub(crate) fn hsum2(v: __m512) -> [f32; 2] {
    [
        hsum(_mm512_castps512_ps256(v)),
        hsum(_mm512_extractf32x8_ps::<1>(v)),
    ]
}

/// Eight f32 from `p` in both halves.
///
/// # Safety
/// `p` readable for eight values.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
pub(crate) unsafe fn load_both(p: *const f32) -> __m512 {
    // SAFETY: by the caller.
    _mm512_broadcast_f32x8(unsafe { _mm256_loadu_ps(p) })
}

/// `e^x` sixteen at a time: [`crate::simd::exp`]'s operations lane by lane,
/// so each lane is that function's (and [`crate::activation::exp`]'s)
/// result to the bit.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp(x: __m512) -> __m512 {
    use crate::activation::exp_consts::{LN2, MAX, MIN, POLY};
    // max then min with the constant second: a NaN becomes MIN, as in the
    // AVX2 build (`vmaxps` returns its second operand on a NaN).
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(MIN)), _mm512_set1_ps(MAX));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2[0]), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2[1]), r);
    let mut y = _mm512_set1_ps(POLY[0]);
    for &c in &POLY[1..] {
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        y,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// As `paged::convert::narrow` (AVX2) sixteen at a time: clamped to
/// +-65504 with the value as the second operand of min and max (a NaN
/// passes through), rounded to nearest even. Whole groups of sixteen;
/// returns the values converted.
///
/// # Safety
/// `dst.len() >= src.len()`.
#[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
pub(crate) unsafe fn narrow(src: &[f32], dst: &mut [half::f16]) -> usize {
    let n = src.len() / 16 * 16;
    let (hi, lo) = (_mm512_set1_ps(65504.0), _mm512_set1_ps(-65504.0));
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 <= n, within both slices.
        unsafe {
            let x = _mm512_loadu_ps(src.as_ptr().add(i));
            let x = _mm512_max_ps(lo, _mm512_min_ps(hi, x));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    n
}

/// Exact widening, sixteen at a time; returns the values converted.
///
/// # Safety
/// `dst.len() >= src.len()`.
#[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
pub(crate) unsafe fn widen(src: &[half::f16], dst: &mut [f32]) -> usize {
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        // SAFETY: i + 16 <= n, within both slices.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    n
}
