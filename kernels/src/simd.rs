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

/// Eight vectors' [`hsum`]s as one vector (lane `r`: `v[r]`'s), each by
/// `hsum`'s order to the bit: the halves added (`l_i + l_{i+4}`), then
/// the pairs two apart, then the last two, eight rows per instruction
/// instead of one (a short row's own reduction had been about a tenth of
/// the int8 one-row kernel).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum8(v: [__m256; 8]) -> __m256 {
    // Helpers, not closures: a closure may stay out of line without the
    // caller's target features.
    let lo = pairs(halves(v[0], v[1]), halves(v[2], v[3]));
    let hi = pairs(halves(v[4], v[5]), halves(v[6], v[7]));
    // [r0 r2 r4 r6 | r1 r3 r5 r7], each (e0 + e2) + (e1 + e3).
    let s = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi),
        _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi),
    );
    _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// [`hsum8`]'s first step: `[e(a) | e(b)]`, `e(x) = [x0 + x4, x1 + x5,
/// x2 + x6, x3 + x7]`.
#[inline]
#[target_feature(enable = "avx2")]
fn halves(a: __m256, b: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(a, b),
        _mm256_permute2f128_ps::<0x31>(a, b),
    )
}

/// [`hsum8`]'s second step, per 128-bit half of `[e(a) | e(b)]` and
/// `[e(c) | e(d)]`: `[e0 + e2, e1 + e3]` of `a`, then of `c` (high half:
/// `b`, then `d`).
#[inline]
#[target_feature(enable = "avx2")]
fn pairs(x: __m256, y: __m256) -> __m256 {
    _mm256_add_ps(
        _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
        _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_sums_are_hsums_to_the_bit() {
        if !crate::cpu::require(crate::cpu::Path::Avx2) {
            return;
        }
        // Magnitudes far apart, so that any other order of the adds
        // rounds differently.
        let mut rng = crate::test_rng::Rng(0x9e37_79b9);
        let mut next = || rng.unit() * [1e-4f32, 1.0, 3e3, 7e6][(rng.next() & 3) as usize];
        for _ in 0..200 {
            let rows: [[f32; 8]; 8] = std::array::from_fn(|_| std::array::from_fn(|_| next()));
            // SAFETY: AVX2 checked above.
            unsafe {
                let v = rows.map(|r| _mm256_loadu_ps(r.as_ptr()));
                let mut got = [0.0f32; 8];
                _mm256_storeu_ps(got.as_mut_ptr(), hsum8(v));
                for (r, g) in got.iter().enumerate() {
                    assert_eq!(g.to_bits(), hsum(v[r]).to_bits(), "row {r}");
                }
            }
        }
    }
}
