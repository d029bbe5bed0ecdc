//! AVX2 + FMA + F16C dot products (x86-64), chosen at run time.
//!
//! Per weight block: the 32 quantized weights are unpacked once into a
//! 256-bit register (Q4_1: nibbles to bytes; Q8_0: absolute values, with the
//! signs moved onto the activations), then for each of up to four
//! activation rows one `vpmaddubsw` + `vpmaddwd` gives eight exact 32-bit
//! partial sums, converted and fused-multiply-added with the block's scale
//! product into that row's eight-lane accumulator. The lanes are summed
//! once per output, always in the same order.

use std::arch::x86_64::*;

use super::{ActRow, QFormat, BLOCK, MAX_BLOCKS};

/// Whether this CPU runs this path.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Dot products of one weight row with every row of `acts`, into `out[t]`.
///
/// The activation rows go by fours through one unpacked weight block; the
/// Q4_1 minimum term is one short vector dot per output at the end.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C ([`available`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row(format: QFormat, w: &[u8], acts: &[ActRow<'_>], out: &mut [f32]) {
    let bb = format.block_bytes();
    let nb = w.len() / bb;
    // The loads below read exactly these ranges; check them once per row.
    assert!(nb <= MAX_BLOCKS && w.len() == nb * bb, "weight row");
    assert!(out.len() == acts.len(), "one output per activation row");
    for a in acts {
        assert!(a.qs.len() >= nb * BLOCK && a.d.len() >= nb && a.s.len() >= nb);
    }
    // Q4_1: the row's minimums as f32, once, for the minimum term below.
    let mut mins = [std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS];
    if format == QFormat::Q4_1 {
        for (b, m) in mins[..nb].iter_mut().enumerate() {
            // SAFETY: block b lies in `w`.
            m.write(unsafe { half(w.as_ptr().add(b * bb + 2)) });
        }
    }
    for (group, o) in acts.chunks(4).zip(out.chunks_mut(4)) {
        // SAFETY (all arms): lengths checked above; features by the caller.
        unsafe {
            match (format, group.len()) {
                (QFormat::Q4_1, 1) => q4_1::<1>(w, nb, group, o),
                (QFormat::Q4_1, 2) => q4_1::<2>(w, nb, group, o),
                (QFormat::Q4_1, 3) => q4_1::<3>(w, nb, group, o),
                (QFormat::Q4_1, _) => q4_1::<4>(w, nb, group, o),
                (QFormat::Q8_0, 1) => q8_0::<1>(w, nb, group, o),
                (QFormat::Q8_0, 2) => q8_0::<2>(w, nb, group, o),
                (QFormat::Q8_0, 3) => q8_0::<3>(w, nb, group, o),
                (QFormat::Q8_0, _) => q8_0::<4>(w, nb, group, o),
            }
        }
    }
    if format == QFormat::Q4_1 {
        // SAFETY: the first `nb` entries were written above.
        let mins: &[f32] = unsafe { std::slice::from_raw_parts(mins.as_ptr().cast(), nb) };
        for (a, o) in acts.iter().zip(out.iter_mut()) {
            *o += min_term(mins, &a.s[..nb]);
        }
    }
}

/// Q4_1's minimum term `sum_b m_b * s_b`: eight lanes, then a fixed
/// reduction (the same order for every row and batch).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn min_term(m: &[f32], s: &[f32]) -> f32 {
    let n = m.len().min(s.len());
    let mut acc = _mm256_setzero_ps();
    let mut b = 0;
    while b + 8 <= n {
        // SAFETY: b + 8 <= n, within both slices.
        unsafe {
            let mv = _mm256_loadu_ps(m.as_ptr().add(b));
            let sv = _mm256_loadu_ps(s.as_ptr().add(b));
            acc = _mm256_fmadd_ps(mv, sv, acc);
        }
        b += 8;
    }
    let mut tail = 0.0f32;
    for i in b..n {
        tail += m[i] * s[i];
    }
    hsum(acc) + tail
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    // SAFETY: the caller points at two readable bytes.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// One weight row against `N` activation rows, the scale term
/// `sum_b d_b d_jb sum_i q_i x_jbi` (the minimum term is added by [`row`]).
/// Even and odd blocks go to two eight-lane accumulators per output, so
/// consecutive fused multiply-adds do not wait on each other; every batch
/// size uses the same split.
///
/// # Safety
/// `w` holds `nb` Q4_1 blocks; each act row at least as many; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1<const N: usize>(w: &[u8], nb: usize, acts: &[ActRow<'_>], out: &mut [f32]) {
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut even = [_mm256_setzero_ps(); N];
    let mut odd = [_mm256_setzero_ps(); N];
    // One block into `acc`.
    let block = |b: usize, acc: &mut [__m256; N]| {
        // SAFETY: block b lies in `w` (20 bytes each); act blocks checked by
        // the caller; CPU features as this function's.
        unsafe {
            let d = half(w.as_ptr().add(b * 20));
            let raw = _mm_loadu_si128(w.as_ptr().add(b * 20 + 4).cast());
            let wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask);
            for (j, e) in acc.iter_mut().enumerate() {
                let a = acts.get_unchecked(j);
                let x = _mm256_loadu_si256(a.qs.as_ptr().add(b * BLOCK).cast());
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, x), ones);
                let sc = _mm256_set1_ps(d * *a.d.get_unchecked(b));
                *e = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), *e);
            }
        }
    };
    let mut b = 0;
    while b + 2 <= nb {
        block(b, &mut even);
        block(b + 1, &mut odd);
        b += 2;
    }
    if b < nb {
        block(b, &mut even);
    }
    for j in 0..N {
        out[j] = hsum(_mm256_add_ps(even[j], odd[j]));
    }
}

/// # Safety
/// `w` holds `nb` Q8_0 blocks; each act row at least as many; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const N: usize>(w: &[u8], nb: usize, acts: &[ActRow<'_>], out: &mut [f32]) {
    let ones = _mm256_set1_epi16(1);
    let mut even = [_mm256_setzero_ps(); N];
    let mut odd = [_mm256_setzero_ps(); N];
    let block = |b: usize, acc: &mut [__m256; N]| {
        // SAFETY: block b lies in `w` (34 bytes each); act blocks checked by
        // the caller; CPU features as this function's.
        unsafe {
            let d = half(w.as_ptr().add(b * 34));
            let wq = _mm256_loadu_si256(w.as_ptr().add(b * 34 + 2).cast());
            let aw = _mm256_sign_epi8(wq, wq);
            for (j, e) in acc.iter_mut().enumerate() {
                let a = acts.get_unchecked(j);
                let x = _mm256_loadu_si256(a.qs.as_ptr().add(b * BLOCK).cast());
                let sx = _mm256_sign_epi8(x, wq);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones);
                let sc = _mm256_set1_ps(d * *a.d.get_unchecked(b));
                *e = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), *e);
            }
        }
    };
    let mut b = 0;
    while b + 2 <= nb {
        block(b, &mut even);
        block(b + 1, &mut odd);
        b += 2;
    }
    if b < nb {
        block(b, &mut even);
    }
    for j in 0..N {
        out[j] = hsum(_mm256_add_ps(even[j], odd[j]));
    }
}
