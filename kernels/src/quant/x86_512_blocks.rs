//! The AVX-512 build's block decoding: two rows' blocks in the two halves
//! of 512-bit registers (see [`super::x86_512`]), each half doing
//! [`super::x86_blocks`]'s operations, so the portable path's bits.
//!
//! - Every format: [`pair_quants`] puts two rows' 32 quants of a group in
//!   one register, interleaved by eighths, and [`chunk2`] widens and scales
//!   eight values of each row in one instruction each.
//! - The legacy formats and MXFP4 in the fused path: [`legacy_pair`]
//!   decodes two blocks straight from their bytes (MXFP4's codes by one
//!   `vpermd` table lookup per sixteen), the scales converted once per
//!   block pair ([`legacy_pair_scales`]).

use std::arch::x86_64::*;

use super::scalar::{self, Head};
use super::x86_blocks::{field, legacy_bias, legacy_layout, load16, nibbles16, qh, quants, sub};
use super::{code, QFormat, GROUP};

/// Group `g`'s quants of two blocks: 128-bit lane `c` holds row `a`'s
/// bytes `8c .. 8c + 8` then row `b`'s.
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F`; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn pair_quants<const F: u8>(a: *const u8, b: *const u8, g: usize) -> __m512i {
    if !const { QFormat::of_code(F).is_quantized() } {
        return _mm512_setzero_si512();
    }
    // SAFETY: by the caller.
    let (qa, qb) = unsafe { (quants512::<F>(a, g), quants512::<F>(b, g)) };
    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qa), qb);
    _mm512_permutexvar_epi64(_mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0), v)
}

/// [`quants`] with AVX-512's byte masks where a format has a bit plane
/// (the fifth bit of Q5_0, Q5_1 and Q5_K, Q3_K's high bit): one test and
/// one masked add instead of AVX2's shuffles and compares. The same
/// integers.
///
/// # Safety
/// As [`quants`]; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn quants512<const F: u8>(p: *const u8, g: usize) -> __m256i {
    let sixteen = _mm256_set1_epi8(16);
    // SAFETY (all): offsets inside the block, by the format's layout.
    unsafe {
        match F {
            code::Q5_0 | code::Q5_1 => {
                let (qh_at, qs_at) = if F == code::Q5_0 { (2, 6) } else { (4, 8) };
                let low = nibbles16(load16(p.add(qs_at)));
                let k = _cvtu32_mask32(qh(p.add(qh_at)));
                let q = _mm256_mask_add_epi8(low, k, low, sixteen);
                if F == code::Q5_0 {
                    sub(q, 16)
                } else {
                    q
                }
            }
            code::Q3_K => {
                // Minus 4 where the high bit is clear.
                let low = field(p.add(32 + 32 * (g / 4)), 2 * (g % 4), 3);
                let plane = _mm256_loadu_si256(p.cast());
                let clear = _mm256_testn_epi8_mask(plane, _mm256_set1_epi8((1u8 << g) as i8));
                _mm256_mask_sub_epi8(low, clear, low, _mm256_set1_epi8(4))
            }
            code::Q5_K => {
                let low = field(p.add(48 + 32 * (g / 2)), 4 * (g % 2), 0x0f);
                let plane = _mm256_loadu_si256(p.add(16).cast());
                let set = _mm256_test_epi8_mask(plane, _mm256_set1_epi8((1u8 << g) as i8));
                _mm256_mask_add_epi8(low, set, low, sixteen)
            }
            _ => quants::<F>(p, g),
        }
    }
}

/// `x` in the low half and `y` in the high half of every lane pair.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn both(x: f32, y: f32) -> __m512 {
    _mm512_insertf32x8::<1>(_mm512_set1_ps(x), _mm256_set1_ps(y))
}

/// Values `8c .. 8c + 8` of group `g` of blocks `a` (low half) and `b`
/// (high half): each half [`super::x86_blocks::chunk`]'s operations, so
/// its bits. `q` is the group's [`pair_quants`], `ha`, `hb` the blocks'
/// heads.
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F`, `g` below their groups,
/// `c < 4`; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn chunk2<const F: u8>(
    a: *const u8,
    b: *const u8,
    q: __m512i,
    ha: &Head,
    hb: &Head,
    g: usize,
    c: usize,
) -> __m512 {
    let f = const { QFormat::of_code(F) };
    if !f.is_quantized() {
        // SAFETY: eight halves of each 32-value block.
        let raw = unsafe { _mm256_set_m128i(load16(b.add(16 * c)), load16(a.add(16 * c))) };
        return if F == code::F16 {
            _mm512_cvtph_ps(raw)
        } else {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        };
    }
    let e = match c {
        0 => _mm512_castsi512_si128(q),
        1 => _mm512_extracti32x4_epi32::<1>(q),
        2 => _mm512_extracti32x4_epi32::<2>(q),
        _ => _mm512_extracti32x4_epi32::<3>(q),
    };
    let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e));
    let i = (GROUP * g + 8 * c) / f.sub_block();
    let s = both(ha.s[i], hb.s[i]);
    if f.has_offset() {
        _mm512_fmadd_ps(v, s, both(ha.o[i], hb.o[i]))
    } else {
        _mm512_mul_ps(v, s)
    }
}

/// Permutation indices that spread lanes 0 and 2 (or 1 and 3) of a
/// converted scale vector over the low and high halves.
const D_IDX: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2];
const M_IDX: [i32; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3];

/// Two legacy blocks' scales and offsets as pair vectors (`a`'s in the low
/// half, `b`'s in the high; the offsets are garbage without one): one
/// conversion for all four halves. MXFP4's scales are its exponent bytes'
/// [`scalar::e8m0_half`] (its table, [`scalar::E8M0_HALF`]; no offsets).
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F` ([`super::x86_blocks::is_legacy`]); AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn legacy_pair_scales<const F: u8>(
    a: *const u8,
    b: *const u8,
) -> (__m512, __m512) {
    if F == code::MXFP4 {
        // SAFETY: by the caller (a block's first byte is its exponent).
        let (ea, eb) = unsafe { (*a, *b) };
        let t = &scalar::E8M0_HALF;
        let d = both(t[usize::from(ea)], t[usize::from(eb)]);
        return (d, _mm512_setzero_ps());
    }
    // SAFETY: by the caller (blocks of at least 18 bytes); constant arrays
    // of sixteen lanes.
    unsafe {
        // [d_a, m_a, d_b, m_b] (no offset: [d_a, q, d_b, q]).
        let s = _mm_cvtph_ps(_mm_unpacklo_epi32(
            _mm_cvtsi32_si128(a.cast::<i32>().read_unaligned()),
            _mm_cvtsi32_si128(b.cast::<i32>().read_unaligned()),
        ));
        let s = _mm512_castps128_ps512(s);
        let (di, mi) = (
            _mm512_loadu_si512(D_IDX.as_ptr().cast()),
            _mm512_loadu_si512(M_IDX.as_ptr().cast()),
        );
        (_mm512_permutexvar_ps(di, s), _mm512_permutexvar_ps(mi, s))
    }
}

/// [`scalar::KVALUES_MXFP4`] widened to sixteen i32 lanes (a `vpermd`
/// table: each lane's low four bits pick one).
const KV_MXFP4_I32: [i32; 16] = {
    let mut t = [0; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = scalar::KVALUES_MXFP4[i] as i32;
        i += 1;
    }
    t
};

/// Two legacy blocks of format `F` in pair vectors: chunk `c` holds `a`'s
/// values `8c .. 8c + 8` then `b`'s. The integers and operations of
/// [`super::x86_blocks::legacy_chunk`] (MXFP4, which the AVX2 build
/// decodes by groups: of [`super::x86_blocks::chunk`]), so their bits.
///
/// # Safety
/// `a`, `b` point at whole blocks of format `F`; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn legacy_pair<const F: u8>(
    a: *const u8,
    b: *const u8,
    d: __m512,
    m: __m512,
) -> [__m512; 4] {
    let f = const { QFormat::of_code(F) };
    let (qs, qh_at) = const { legacy_layout(QFormat::of_code(F)) };
    // SAFETY (all): offsets inside the blocks, by the format's layout.
    let mut q = unsafe {
        if F == code::Q8_0 {
            let (a0, b0) = (load16(a.add(2)), load16(b.add(2)));
            let (a1, b1) = (load16(a.add(18)), load16(b.add(18)));
            [
                _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a0, b0)),
                _mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a0, b0)),
                _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a1, b1)),
                _mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a1, b1)),
            ]
        } else {
            // Bytes 0-7 of each block hold values 0-7 (low nibbles) and
            // 16-23 (high); bytes 8-15 values 8-15 and 24-31.
            let (qa, qb) = (load16(a.add(qs)), load16(b.add(qs)));
            let lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
            let hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(qa, qb));
            let mask = _mm512_set1_epi32(0x0f);
            let q = [
                _mm512_and_si512(lo, mask),
                _mm512_and_si512(hi, mask),
                _mm512_srli_epi32::<4>(lo),
                _mm512_srli_epi32::<4>(hi),
            ];
            if F == code::MXFP4 {
                // Codes to quants: one table lookup per sixteen values.
                let table = _mm512_loadu_si512(KV_MXFP4_I32.as_ptr().cast());
                q.map(|c| _mm512_permutexvar_epi32(c, table))
            } else {
                q
            }
        }
    };
    if qh_at != 0 {
        // SAFETY: as above.
        let (ha, hb) = unsafe { (qh(a.add(qh_at)), qh(b.add(qh_at))) };
        for (c, q) in q.iter_mut().enumerate() {
            // Bits 8c .. 8c + 8 of each qh: plus 16 where set.
            let k = ((ha >> (8 * c)) & 0xff) | (((hb >> (8 * c)) & 0xff) << 8);
            *q = _mm512_mask_add_epi32(*q, k as __mmask16, *q, _mm512_set1_epi32(16));
        }
    }
    let mut out = [_mm512_setzero_ps(); 4];
    for (o, q) in out.iter_mut().zip(q) {
        let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(legacy_bias(f))));
        *o = if f.has_offset() {
            _mm512_fmadd_ps(v, d, m)
        } else {
            _mm512_mul_ps(v, d)
        };
    }
    out
}
