//! x86-64 vector helpers shared by the kernels' AVX2 builds.

use std::arch::x86_64::*;

/// The eight lanes of `v` summed as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
/// (l3 + l7))`: always this order, so a result does not depend on which
/// caller or tile produced the lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// `e^x` for x <= 0 (and moderately above): Cody-Waite reduction by ln 2,
/// a degree-6 polynomial, and the exponent added as an integer. About 2 ulp;
/// inputs below -87.3 give about 1e-38 instead of 0.
/// [`crate::activation::exp`] is the same arithmetic on one value, to the bit.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp(x: __m256) -> __m256 {
    use crate::activation::exp_consts::{LN2, MAX, MIN, POLY};
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(MIN)), _mm256_set1_ps(MAX));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2[0]), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2[1]), r);
    let mut y = _mm256_set1_ps(POLY[0]);
    for &c in &POLY[1..] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}
