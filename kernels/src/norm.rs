//! RMSNorm as Llama-family models define it: `w * x / sqrt(mean(x^2) + eps)`,
//! computed in f32.
//!
//! # Arithmetic (the same on every path, to the bit)
//! - Sum of squares in sixteen lanes: lane `l` accumulates `x[l + 16s]^2`
//!   over `s` in order, each step a fused multiply-add from `+0` (a row
//!   whose length is not a multiple of sixteen ends with a partial group;
//!   the missing values count as zeros, which leave a lane unchanged).
//! - Lanes folded to eight, `m[l] = lane[l] + lane[l + 8]`, then summed as
//!   `((m0 + m4) + (m2 + m6)) + ((m1 + m5) + (m3 + m7))` (the tree of
//!   `simd::hsum`).
//! - `inv = 1 / sqrt(sum / d + eps)`; output `w * (x * inv)`.
//!
//! The portable path does exactly that with arrays, the AVX2 path with two
//! eight-lane registers, the AVX-512 path with one sixteen-lane register,
//! so the three agree to the bit and a row's result does not depend on the
//! batch.
//!
//! # Cost
//! Two passes over the row (sum, scale); a few microseconds per token at
//! hidden size 576, against milliseconds for the matmuls around it.

use crate::cpu::Path;

/// Normalise each row of `x` (rows of `weight.len()` values) into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_with(crate::cpu::path(), x, weight, eps, out);
}

/// [`rms_norm`] on a chosen path (tests, benchmarks); the same bits on
/// every path.
///
/// # Panics
/// If the lengths disagree, or this CPU lacks `path`.
pub fn rms_norm_with(path: Path, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0, "rms_norm of an empty row");
    assert_eq!(
        x.len() % d,
        0,
        "rms_norm input is not a whole number of rows"
    );
    assert_eq!(x.len(), out.len(), "rms_norm output has the wrong length");
    assert!(path.available(), "{path} kernels on a CPU without them");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has the path (asserted); shapes asserted.
        Path::Avx512 => unsafe { crate::elementwise512::rms_norm(x, weight, eps, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::rms_norm(x, weight, eps, out) },
        _ => portable(x, weight, eps, out),
    }
}

/// `1 / sqrt(sum / d + eps)`, shared by every path.
#[inline(always)]
pub(crate) fn inverse_rms(sum: f32, d: usize, eps: f32) -> f32 {
    1.0 / (sum / d as f32 + eps).sqrt()
}

/// The portable path (the reference).
fn portable(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut lane = [0.0f32; 16];
        for group in row.chunks(16) {
            for (l, v) in lane.iter_mut().zip(group) {
                *l = v.mul_add(*v, *l);
            }
        }
        let m: [f32; 8] = std::array::from_fn(|l| lane[l] + lane[l + 8]);
        let sum = ((m[0] + m[4]) + (m[2] + m[6])) + ((m[1] + m[5]) + (m[3] + m[7]));
        let inv = inverse_rms(sum, d, eps);
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Sixteen lanes in two registers (`lo`: lanes 0-7, `hi`: 8-15); the
    /// partial last group through a zero-padded copy.
    ///
    /// # Safety
    /// AVX2 and FMA; shapes as `rms_norm_with` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let d = weight.len();
        let whole = d / 16 * 16;
        let scaled = d / 8 * 8;
        for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let (rp, op, wp) = (row.as_ptr(), o.as_mut_ptr(), weight.as_ptr());
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            // SAFETY (all): j + 16 <= d (or j + 8 <= d below).
            unsafe {
                for j in (0..whole).step_by(16) {
                    let (a, b) = (_mm256_loadu_ps(rp.add(j)), _mm256_loadu_ps(rp.add(j + 8)));
                    lo = _mm256_fmadd_ps(a, a, lo);
                    hi = _mm256_fmadd_ps(b, b, hi);
                }
                if whole < d {
                    let mut buf = [0.0f32; 16];
                    buf[..d - whole].copy_from_slice(&row[whole..]);
                    let (a, b) = (
                        _mm256_loadu_ps(buf.as_ptr()),
                        _mm256_loadu_ps(buf.as_ptr().add(8)),
                    );
                    lo = _mm256_fmadd_ps(a, a, lo);
                    hi = _mm256_fmadd_ps(b, b, hi);
                }
                let sum = crate::simd::hsum(_mm256_add_ps(lo, hi));
                let inv = super::inverse_rms(sum, d, eps);
                let iv = _mm256_set1_ps(inv);
                for j in (0..scaled).step_by(8) {
                    let v = _mm256_mul_ps(_mm256_loadu_ps(rp.add(j)), iv);
                    _mm256_storeu_ps(op.add(j), _mm256_mul_ps(_mm256_loadu_ps(wp.add(j)), v));
                }
                for j in scaled..d {
                    *op.add(j) = *wp.add(j) * (*rp.add(j) * inv);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_weight_gives_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [0.0f32; 8];
        for path in crate::cpu::available_paths() {
            rms_norm_with(path, &x, &[1.0; 4], 0.0, &mut out);
            for row in out.chunks(4) {
                let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
                assert!((ms - 1.0).abs() < 1e-6, "{path}");
            }
            assert!((out[0] - 3.0 / (50.0f32 / 4.0).sqrt()).abs() < 1e-6);
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `path` equals the portable path to the bit on random rows of every
    /// width up to 80 (groups of sixteen and eight, tails) and at 576, in
    /// batches of one to three rows, and each row equals itself alone.
    fn equals_portable(path: Path) {
        let mut s = 0x9e37_79b9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32 - 0.5) * 6.0
        };
        for d in (1..80).chain([576]) {
            let rows = 1 + d % 3;
            let x: Vec<f32> = (0..rows * d).map(|_| next()).collect();
            let w: Vec<f32> = (0..d).map(|_| next()).collect();
            let (mut a, mut b) = (vec![0.0; rows * d], vec![0.0; rows * d]);
            portable(&x, &w, 1e-5, &mut a);
            rms_norm_with(path, &x, &w, 1e-5, &mut b);
            assert_eq!(bits(&a), bits(&b), "{path}, width {d}");
            let mut one = vec![0.0; d];
            rms_norm_with(path, &x[(rows - 1) * d..], &w, 1e-5, &mut one);
            assert_eq!(bits(&one), bits(&b[(rows - 1) * d..]), "{path} alone");
        }
    }

    #[test]
    fn avx2_rms_norm_equals_the_portable_path_to_the_bit() {
        if crate::cpu::require(Path::Avx2) {
            equals_portable(Path::Avx2);
        }
    }

    #[test]
    fn avx512_rms_norm_equals_the_portable_path_to_the_bit() {
        if crate::cpu::require(Path::Avx512) {
            equals_portable(Path::Avx512);
        }
    }
}
