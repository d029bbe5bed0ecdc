//! AVX-512 builds of the element-wise kernels: SwiGLU
//! ([`crate::activation::swiglu`]), GeGLU ([`crate::activation::geglu_tanh`])
//! and RMSNorm ([`crate::norm::rms_norm`]).
//! Each does its module's operations in its module's order, so each equals
//! the portable path to the bit (see those modules).
//!
//! # Cost
//! Measured (`taskset -c 0 cargo bench --bench paths`, EPYC Zen 4): AVX2's
//! time over this build's, SwiGLU [64 x 1536] 2.10 (the polynomial is
//! sixteen lanes per instruction), RMSNorm [64 x 576] 1.00 (a few
//! microseconds either way; bound by its two passes). The f16 conversions
//! (`simd512::narrow`, `widen`): 1.60 narrowing, 0.95 widening (both a few
//! microseconds per 64Ki values).

use std::arch::x86_64::*;

/// SwiGLU sixteen columns at a time, then the AVX2 build (eight, then the
/// portable tail).
///
/// # Safety
/// AVX-512 F with the AVX2 set; shapes as `swiglu` asserts.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
pub(crate) unsafe fn swiglu(gate_up: &[f32], width: usize, out: &mut [f32]) {
    let whole = width / 16 * 16;
    let (one, sign) = (_mm512_set1_ps(1.0), _mm512_set1_ps(-0.0));
    for (gu, o) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (g, u) = gu.split_at(width);
        for j in (0..whole).step_by(16) {
            // SAFETY: j + 16 <= width, inside each of the three rows.
            unsafe {
                let gv = _mm512_loadu_ps(g.as_ptr().add(j));
                let e = crate::simd512::exp(_mm512_xor_ps(gv, sign));
                let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
                let r = _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(j)));
                _mm512_storeu_ps(o.as_mut_ptr().add(j), r);
            }
        }
    }
    // SAFETY: AVX-512 implies AVX2 and FMA here (the caller).
    unsafe { crate::activation::x86::swiglu(gate_up, width, out, whole) };
}

/// GeGLU sixteen columns at a time, then the AVX2 build (eight, then the
/// portable tail): [`crate::activation::geglu_tanh`]'s operations in its
/// order.
///
/// # Safety
/// AVX-512 F with the AVX2 set; shapes as `geglu_tanh` asserts.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
pub(crate) unsafe fn geglu_tanh(gate_up: &[f32], width: usize, out: &mut [f32]) {
    use crate::activation::{GELU_BETA, GELU_KAPPA};
    let whole = width / 16 * 16;
    let c = |v: f32| _mm512_set1_ps(v);
    let (beta, kappa, one, two, half) = (c(GELU_BETA), c(GELU_KAPPA), c(1.0), c(2.0), c(0.5));
    for (gu, o) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (g, u) = gu.split_at(width);
        for j in (0..whole).step_by(16) {
            // SAFETY: j + 16 <= width, inside each of the three rows.
            unsafe {
                let gv = _mm512_loadu_ps(g.as_ptr().add(j));
                let cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(kappa, gv), gv), gv);
                let inner = _mm512_mul_ps(beta, _mm512_add_ps(gv, cube));
                let e = crate::simd512::exp(_mm512_mul_ps(two, inner));
                let tanh = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
                let r = _mm512_mul_ps(
                    _mm512_mul_ps(_mm512_mul_ps(half, gv), _mm512_add_ps(one, tanh)),
                    _mm512_loadu_ps(u.as_ptr().add(j)),
                );
                _mm512_storeu_ps(o.as_mut_ptr().add(j), r);
            }
        }
    }
    // SAFETY: AVX-512 implies AVX2 and FMA here (the caller).
    unsafe { crate::activation::x86::geglu_tanh(gate_up, width, out, whole) };
}

/// RMSNorm of each row: the sixteen lanes of the sum of squares in one
/// register (lane `l` takes values `l, l + 16, ...`; the last partial group
/// through a masked load, whose zeros leave the lanes unchanged), then the
/// module's reduction, then `w * (v * inv)` sixteen at a time.
///
/// # Safety
/// AVX-512 F/DQ with the AVX2 set; shapes as `rms_norm` asserts.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
pub(crate) unsafe fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let whole = d / 16 * 16;
    let tail: __mmask16 = ((1u32 << (d - whole)) - 1) as u16;
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let (rp, op, wp) = (row.as_ptr(), o.as_mut_ptr(), weight.as_ptr());
        let mut acc = _mm512_setzero_ps();
        // SAFETY (all): j + 16 <= d, or the masked lanes below d.
        unsafe {
            for j in (0..whole).step_by(16) {
                let v = _mm512_loadu_ps(rp.add(j));
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            if tail != 0 {
                let v = _mm512_maskz_loadu_ps(tail, rp.add(whole));
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            let eight = _mm256_add_ps(
                _mm512_castps512_ps256(acc),
                _mm512_extractf32x8_ps::<1>(acc),
            );
            let inv = crate::norm::inverse_rms(crate::simd::hsum(eight), d, eps);
            let iv = _mm512_set1_ps(inv);
            for j in (0..whole).step_by(16) {
                let v = _mm512_mul_ps(_mm512_loadu_ps(rp.add(j)), iv);
                _mm512_storeu_ps(op.add(j), _mm512_mul_ps(_mm512_loadu_ps(wp.add(j)), v));
            }
            if tail != 0 {
                let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, rp.add(whole)), iv);
                let r = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, wp.add(whole)), v);
                _mm512_mask_storeu_ps(op.add(whole), tail, r);
            }
        }
    }
}
