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
