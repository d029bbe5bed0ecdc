//! The MLP's gated activation, SwiGLU: `silu(gate) * up`, with
//! `silu(g) = g / (1 + e^-g)`.
//!
//! # Arithmetic (the same on every path, to the bit)
//! `e^x` is one polynomial ([`exp`]; its AVX2 build is `simd::exp`, its
//! AVX-512 build `simd512::exp`), then `g / (1 + e) * u` in that order.
//! The AVX2 path computes eight values at once with the same operations,
//! the AVX-512 path sixteen (then eight, then one by one), so a row's
//! result does not depend on the path, its place in the batch, or the
//! batch.
//!
//! # Cost
//! About 20 vector operations per eight values (the polynomial), where the
//! C library's `expf` took 2% of a prompt's time on its own; reads the
//! projection's stacked `[gate | up]` rows in place (no split copy).

/// The constants of `e^x` ([`exp`] and its AVX2 build `simd::exp`, one
/// definition so the two stay the same arithmetic).
pub(crate) mod exp_consts {
    /// Inputs are clamped to `[MIN, MAX]` (the result stays a normal float).
    pub(crate) const MIN: f32 = -87.3;
    /// See [`MIN`].
    pub(crate) const MAX: f32 = 88.3;
    /// `ln 2` in two parts, high then low (Cody-Waite reduction).
    pub(crate) const LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];
    /// The polynomial's coefficients, highest degree first (Horner).
    pub(crate) const POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
}

/// `e^x` as `simd::exp` computes it, on one value: clamp to
/// `[-87.3, 88.3]`, `n = round(x * log2 e)` (ties to even), `r = x - n ln 2`
/// in two steps, a degree-6 polynomial in `r`, times `2^n`. About 2 ulp.
pub fn exp(x: f32) -> f32 {
    use exp_consts::{LN2, MAX, MIN, POLY};
    // Not `clamp`: a NaN becomes MIN here, as `_mm256_max_ps` makes it.
    #[allow(clippy::manual_clamp)]
    let x = x.max(MIN).min(MAX);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2[0], x);
    let r = (-n).mul_add(LN2[1], r);
    let y = POLY[1..].iter().fold(POLY[0], |y, &c| y.mul_add(r, c));
    let y = y.mul_add(r * r, r + 1.0);
    // n is in [-126, 128]: the biased exponent n + 127 fits the field.
    let e = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * e
}

/// `out[t][j] = gelu_tanh(gate_up[t][j]) * gate_up[t][width + j]` (GeGLU,
/// Gemma's MLP), with PyTorch's tanh approximation
/// `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))` and
/// `tanh(y) = 1 - 2 / (e^(2y) + 1)` through [`exp`]. One implementation on
/// every path (so every path computes the same bits); about 1e-7 from
/// PyTorch's `tanh` in absolute terms.
///
/// # Panics
/// As [`swiglu`].
pub fn geglu_tanh(gate_up: &[f32], width: usize, out: &mut [f32]) {
    geglu_tanh_with(crate::cpu::path(), gate_up, width, out);
}

/// [`geglu_tanh`] on a chosen path (tests, benchmarks); the same bits on
/// every path: the AVX2 and AVX-512 builds do the portable operations
/// in their order, eight or sixteen columns at a time.
///
/// # Panics
/// As [`swiglu`], and if this CPU lacks `path`.
pub fn geglu_tanh_with(path: crate::cpu::Path, gate_up: &[f32], width: usize, out: &mut [f32]) {
    assert!(width > 0, "geglu width");
    assert_eq!(out.len() % width, 0, "geglu output rows");
    assert_eq!(gate_up.len(), 2 * out.len(), "geglu input rows");
    assert!(path.available(), "{path} kernels on a CPU without them");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 (asserted); shapes asserted.
        crate::cpu::Path::Avx512 => unsafe {
            crate::elementwise512::geglu_tanh(gate_up, width, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (asserted).
        crate::cpu::Path::Avx2 => unsafe { x86::geglu_tanh(gate_up, width, out, 0) },
        _ => geglu_portable(gate_up, width, out, 0),
    }
}

/// `sqrt(2 / pi)`, as PyTorch's `M_SQRT2 * M_2_SQRTPI * 0.5`.
pub(crate) const GELU_BETA: f32 = 0.797_884_6;
/// The cubic term's coefficient of the tanh approximation.
pub(crate) const GELU_KAPPA: f32 = 0.044_715;

/// One GeGLU output: `inner = beta * (g + ((kappa * g) * g) * g)`,
/// `tanh = 1 - 2 / (e^(2 inner) + 1)`, `((0.5 g) (1 + tanh)) u`, each
/// operation rounded once, in that order.
#[inline]
fn gelu_tanh_times(g: f32, u: f32) -> f32 {
    let inner = GELU_BETA * (g + GELU_KAPPA * g * g * g);
    let tanh = 1.0 - 2.0 / (exp(2.0 * inner) + 1.0);
    0.5 * g * (1.0 + tanh) * u
}

/// The portable [`geglu_tanh`] from column `from` of every row on (the
/// SIMD builds' tail, and the whole of it elsewhere).
pub(crate) fn geglu_portable(gate_up: &[f32], width: usize, out: &mut [f32], from: usize) {
    for (row, o) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = row.split_at(width);
        for j in from..width {
            o[j] = gelu_tanh_times(gate[j], up[j]);
        }
    }
}

/// gpt-oss's clamped SwiGLU over stacked `[gate | up]` rows (`2 * width`
/// each): `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
/// `out = g * sigmoid(alpha g) * (u + 1)`, with
/// `sigmoid(y) = 1 / (1 + e^-y)` through [`exp`] (transformers'
/// `GptOssExperts._apply_gate`; the `+ 1` on up is part of the model). One
/// scalar implementation on every path, so every path computes the same
/// bits; a NaN gate or up stays NaN.
///
/// # Panics
/// As [`swiglu`].
pub fn swiglu_oai(gate_up: &[f32], width: usize, alpha: f32, limit: f32, out: &mut [f32]) {
    assert!(width > 0, "swiglu_oai width");
    assert_eq!(out.len() % width, 0, "swiglu_oai output rows");
    assert_eq!(gate_up.len(), 2 * out.len(), "swiglu_oai input rows");
    for (row, o) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = row.split_at(width);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            // Comparisons rather than `min`/`clamp`: NaN passes through as
            // in PyTorch, and a bad limit cannot panic.
            let g = if g > limit { limit } else { g };
            let u = if u > limit {
                limit
            } else if u < -limit {
                -limit
            } else {
                u
            };
            let glu = g / (1.0 + exp(-(g * alpha)));
            *o = (u + 1.0) * glu;
        }
    }
}

/// `out[t][j] = silu(gate_up[t][j]) * gate_up[t][width + j]`: each row of
/// `gate_up` is a row of gate values then a row of up values (`2 * width`),
/// as a stacked gate/up projection writes them.
///
/// # Panics
/// If `gate_up` is not `out.len() / width` rows of `2 * width` (a caller
/// bug, not input).
pub fn swiglu(gate_up: &[f32], width: usize, out: &mut [f32]) {
    swiglu_with(crate::cpu::path(), gate_up, width, out);
}

/// [`swiglu`] on a chosen path (tests, benchmarks); the same bits on every
/// path.
///
/// # Panics
/// As [`swiglu`], and if this CPU lacks `path`.
pub fn swiglu_with(path: crate::cpu::Path, gate_up: &[f32], width: usize, out: &mut [f32]) {
    assert!(width > 0, "swiglu width");
    assert_eq!(out.len() % width, 0, "swiglu output rows");
    assert_eq!(gate_up.len(), 2 * out.len(), "swiglu input rows");
    assert!(path.available(), "{path} kernels on a CPU without them");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 (asserted); shapes asserted.
        crate::cpu::Path::Avx512 => unsafe { crate::elementwise512::swiglu(gate_up, width, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX2 and FMA (asserted).
        crate::cpu::Path::Avx2 => unsafe { x86::swiglu(gate_up, width, out, 0) },
        _ => portable(gate_up, width, out, 0),
    }
}

/// The portable path from column `from` of every row on (the SIMD paths'
/// tail, and the whole of it elsewhere).
pub(crate) fn portable(gate_up: &[f32], width: usize, out: &mut [f32], from: usize) {
    for (gu, o) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (g, u) = gu.split_at(width);
        for j in from..width {
            o[j] = g[j] / (1.0 + exp(-g[j])) * u[j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// [`super::swiglu`] from column `from` of every row on, eight columns
    /// at a time, the last few by the portable path.
    ///
    /// # Safety
    /// AVX2 and FMA; shapes as [`super::swiglu`] asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu(gate_up: &[f32], width: usize, out: &mut [f32], from: usize) {
        let whole = from + (width - from) / 8 * 8;
        let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        for (gu, o) in gate_up
            .chunks_exact(2 * width)
            .zip(out.chunks_exact_mut(width))
        {
            let (g, u) = gu.split_at(width);
            for j in (from..whole).step_by(8) {
                // SAFETY: j + 8 <= width, inside each of the three rows.
                unsafe {
                    let gv = _mm256_loadu_ps(g.as_ptr().add(j));
                    let e = crate::simd::exp(_mm256_xor_ps(gv, sign));
                    let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
                    let r = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(j)));
                    _mm256_storeu_ps(o.as_mut_ptr().add(j), r);
                }
            }
        }
        super::portable(gate_up, width, out, whole);
    }

    /// [`super::geglu_tanh`] from column `from` of every row on, eight
    /// columns at a time, the last few by the portable path.
    ///
    /// # Safety
    /// AVX2 and FMA; shapes as [`super::geglu_tanh`] asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn geglu_tanh(gate_up: &[f32], width: usize, out: &mut [f32], from: usize) {
        let whole = from + (width - from) / 8 * 8;
        let c = |v: f32| _mm256_set1_ps(v);
        let (beta, kappa, one, two, half) = (
            c(super::GELU_BETA),
            c(super::GELU_KAPPA),
            c(1.0),
            c(2.0),
            c(0.5),
        );
        for (gu, o) in gate_up
            .chunks_exact(2 * width)
            .zip(out.chunks_exact_mut(width))
        {
            let (g, u) = gu.split_at(width);
            for j in (from..whole).step_by(8) {
                // SAFETY: j + 8 <= width, inside each of the three rows.
                unsafe {
                    let gv = _mm256_loadu_ps(g.as_ptr().add(j));
                    let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(kappa, gv), gv), gv);
                    let inner = _mm256_mul_ps(beta, _mm256_add_ps(gv, cube));
                    let e = crate::simd::exp(_mm256_mul_ps(two, inner));
                    let tanh = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
                    let r = _mm256_mul_ps(
                        _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, tanh)),
                        _mm256_loadu_ps(u.as_ptr().add(j)),
                    );
                    _mm256_storeu_ps(o.as_mut_ptr().add(j), r);
                }
            }
        }
        super::geglu_portable(gate_up, width, out, whole);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The AVX-512 build equals the portable one to the bit on random
    /// rows of every width up to 70 (groups of sixteen, of eight, tails),
    /// extreme inputs (clamped exponent, NaN) included.
    #[test]
    fn avx512_swiglu_equals_the_portable_path_to_the_bit() {
        if !crate::cpu::require(crate::cpu::Path::Avx512) {
            return;
        }
        let mut s = 0x2545_f491u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        for width in 1..70 {
            let rows = 1 + width % 3;
            let mut gate_up: Vec<f32> = (0..rows * 2 * width)
                .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 40.0)
                .collect();
            gate_up[0] = if width % 2 == 0 { 200.0 } else { -200.0 };
            if width > 5 {
                gate_up[3] = f32::NAN;
            }
            let (mut a, mut b) = (vec![0.0; rows * width], vec![0.0; rows * width]);
            portable(&gate_up, width, &mut a, 0);
            swiglu_with(crate::cpu::Path::Avx512, &gate_up, width, &mut b);
            assert_eq!(bits(&a), bits(&b), "width {width}");
        }
    }

    /// GeGLU's AVX2 and AVX-512 builds equal the portable one to the bit
    /// (every width up to 70, extreme and NaN inputs), and the portable
    /// one is PyTorch's tanh approximation.
    #[test]
    fn geglu_builds_equal_the_portable_path_to_the_bit() {
        let mut s = 0x9e37_79b9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        let paths: Vec<_> = [crate::cpu::Path::Avx512, crate::cpu::Path::Avx2]
            .into_iter()
            .filter(|p| p.available())
            .collect();
        for width in 1..70 {
            let rows = 1 + width % 3;
            let mut gate_up: Vec<f32> = (0..rows * 2 * width)
                .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * 24.0)
                .collect();
            gate_up[0] = if width % 2 == 0 { 90.0 } else { -90.0 };
            if width > 5 {
                gate_up[3] = f32::NAN;
            }
            let mut want = vec![0.0; rows * width];
            geglu_portable(&gate_up, width, &mut want, 0);
            for &p in &paths {
                let mut got = vec![0.0; rows * width];
                geglu_tanh_with(p, &gate_up, width, &mut got);
                assert_eq!(bits(&want), bits(&got), "{p} width {width}");
            }
        }
        let (g, u) = (0.7f32, 1.5f32);
        let torch = 0.5 * g * (1.0 + (GELU_BETA * (g + GELU_KAPPA * g.powi(3))).tanh()) * u;
        assert!((gelu_tanh_times(g, u) - torch).abs() < 1e-6);
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_the_library() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (ours, libm) = (exp(x), x.exp());
            let ulp = (libm.to_bits() as i64 - ours.to_bits() as i64).abs();
            assert!(ulp <= 3, "exp({x}) = {ours}, library {libm}: {ulp} ulp");
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-200.0) < 1e-37 && exp(-200.0) >= 0.0);
        assert!(exp(200.0).is_finite());
    }

    /// The AVX2 path (where this CPU has it) equals the portable one to the
    /// bit, tail columns included, and both are SwiGLU.
    /// The clamp bites above `limit` on the gate and on both sides of up;
    /// inside it the function is `g sigmoid(alpha g) (u + 1)`.
    #[test]
    fn swiglu_oai_clamps_then_gates() {
        let (alpha, limit) = (1.702f32, 1.5f32);
        let gate = [0.5f32, 3.0, -4.0, 1.0, f32::NAN];
        let up = [0.25f32, 0.5, 2.0, -9.0, 0.0];
        let gu: Vec<f32> = gate.iter().chain(&up).copied().collect();
        let mut out = [0.0f32; 5];
        super::swiglu_oai(&gu, 5, alpha, limit, &mut out);
        let want = |g: f32, u: f32| {
            let g = g.min(limit) as f64;
            let u = u.clamp(-limit, limit) as f64;
            g / (1.0 + (-(g * alpha as f64)).exp()) * (u + 1.0)
        };
        for j in 0..4 {
            let w = want(gate[j], up[j]);
            assert!(
                ((out[j] as f64) - w).abs() < 1e-6 * w.abs().max(1.0),
                "{j}: {} vs {w}",
                out[j]
            );
        }
        assert!(out[4].is_nan());
        // Unclamped, the second value would be 3 sigmoid(5.1) 1.5, not
        // 1.5 sigmoid(2.55) 1.5.
        let unclamped = 3.0 / (1.0 + (-3.0f32 * alpha).exp()) * 1.5;
        assert!((out[1] - unclamped).abs() > 1.0);
    }

    #[test]
    fn swiglu_matches_the_definition_and_the_portable_path() {
        let (rows, width) = (3, 37);
        let gate_up: Vec<f32> = (0..rows * 2 * width)
            .map(|i| ((i * 7919 % 211) as f32 - 105.0) / 9.0)
            .collect();
        let mut slow = vec![0.0f32; rows * width];
        portable(&gate_up, width, &mut slow, 0);
        let mut fast = vec![0.0f32; rows * width];
        for path in crate::cpu::available_paths() {
            swiglu_with(path, &gate_up, width, &mut fast);
            assert_eq!(bits(&fast), bits(&slow), "{path}");
        }
        for t in 0..rows {
            for j in 0..width {
                let (g, u) = (
                    gate_up[t * 2 * width + j],
                    gate_up[t * 2 * width + width + j],
                );
                let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
                let got = fast[t * width + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "row {t} col {j}: {got} vs {want}"
                );
            }
        }
    }
}
