//! Every format's block decoding in AVX2 registers, shared by the AVX2
//! build ([`super::x86`]) and the AVX-512 one ([`super::x86_512`], which
//! pairs two rows' quants in one register). The operations are
//! [`super::scalar`]'s, so the values are its bits: the integer quants and
//! scale bytes are the same integers, the f16 scales convert exactly
//! (F16C), the scale products `d * sc` are exact, and a value is the same
//! `q * s` or `fma(q, s, o)`.
//!
//! A group is 32 values. Its quants come as 32 signed bytes in value
//! order ([`quants`]); [`chunk`] turns eight of them into f32.

use std::arch::x86_64::*;

use super::scalar::{self, Head};
use super::{code, QFormat, GROUP};

/// Four f16 at `p` (two scales) as f32 lanes 0-3.
///
/// # Safety
/// `p` readable for four bytes; F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves(p: *const u8) -> __m128 {
    // SAFETY: by the caller.
    _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        p.cast::<i32>().read_unaligned()
    }))
}

/// Eight integers (the low bytes of `v`) times `d`, stored at `out`: the
/// K-quants' sub-block scales.
///
/// # Safety
/// `out` writable for eight floats; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale8(v: __m128i, signed: bool, d: __m256, out: *mut f32) {
    let v = if signed {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    };
    // SAFETY: by the caller.
    unsafe { _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(v), d)) };
}

/// A block's [`Head`] into `h`, as [`scalar::head`] (to the bit): the
/// entries format `F` uses are written, the others left as they were (so
/// a tile's heads are set up once, not per block). F16 and BF16 have none.
///
/// # Safety
/// `p` points at a whole block of format `F`; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn head<const F: u8>(p: *const u8, h: &mut Head) {
    // SAFETY (all): offsets inside the block, by the format's layout.
    unsafe {
        match F {
            code::Q4_0 | code::Q5_0 | code::Q8_0 => h.s[0] = _mm_cvtss_f32(halves(p)),
            // The portable conversion's table.
            code::MXFP4 => h.s[0] = scalar::E8M0_HALF[usize::from(*p)],
            code::Q4_1 | code::Q5_1 => {
                let s = halves(p);
                h.s[0] = _mm_cvtss_f32(s);
                h.o[0] = _mm_cvtss_f32(_mm_movehdup_ps(s));
            }
            code::Q2_K => {
                let s = halves(p.add(80));
                let (d, m) = (_mm256_broadcastss_ps(s), _mm256_broadcastss_ps(neg(s)));
                let sc = _mm_loadu_si128(p.cast());
                let lo = _mm_and_si128(sc, _mm_set1_epi8(0x0f));
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(sc), _mm_set1_epi8(0x0f));
                scale8(lo, false, d, h.s.as_mut_ptr());
                scale8(
                    _mm_unpackhi_epi64(lo, lo),
                    false,
                    d,
                    h.s.as_mut_ptr().add(8),
                );
                scale8(hi, false, m, h.o.as_mut_ptr());
                scale8(
                    _mm_unpackhi_epi64(hi, hi),
                    false,
                    m,
                    h.o.as_mut_ptr().add(8),
                );
            }
            code::Q3_K => {
                let d = _mm256_broadcastss_ps(halves(p.add(108)));
                let sc = scalar::q3k_scales(&*p.add(96).cast::<[u8; 12]>());
                for (i, w) in sc.into_iter().enumerate() {
                    // Minus 32 in every byte (values below 64: no borrow
                    // across bytes in an 8-bit subtraction).
                    let v = _mm_sub_epi8(_mm_cvtsi64_si128(w as i64), _mm_set1_epi8(32));
                    scale8(v, true, d, h.s.as_mut_ptr().add(8 * i));
                }
            }
            code::Q4_K | code::Q5_K => {
                let s = halves(p);
                let (sc, m) = scalar::k4_scales(&*p.add(4).cast::<[u8; 12]>());
                let (sc, m) = (_mm_cvtsi64_si128(sc as i64), _mm_cvtsi64_si128(m as i64));
                scale8(sc, false, _mm256_broadcastss_ps(s), h.s.as_mut_ptr());
                scale8(m, false, _mm256_broadcastss_ps(neg(s)), h.o.as_mut_ptr());
            }
            code::Q6_K => {
                let d = _mm256_broadcastss_ps(halves(p.add(208)));
                let sc = _mm_loadu_si128(p.add(192).cast());
                scale8(sc, true, d, h.s.as_mut_ptr());
                scale8(_mm_unpackhi_epi64(sc, sc), true, d, h.s.as_mut_ptr().add(8));
            }
            _ => {}
        }
    }
}

/// Lane 1 of `s` (a block's `dmin`) negated, in lane 0: the sign flipped
/// exactly as the portable `-dmin`.
#[inline]
#[target_feature(enable = "avx2")]
fn neg(s: __m128) -> __m128 {
    _mm_xor_ps(_mm_movehdup_ps(s), _mm_set1_ps(-0.0))
}

/// Sixteen bytes `v` split into nibbles: low nibbles in bytes 0-15, high
/// nibbles in bytes 16-31 (a legacy block's value order). `v` in both
/// halves, the upper half's dwords shifted by four: two vector operations
/// and no lane insert (the broadcast folds into the load).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn nibbles16(v: __m128i) -> __m256i {
    // A dword shift moves bits across bytes, but the mask keeps only the
    // four that came from the byte itself.
    let v = _mm256_srlv_epi32(
        _mm256_broadcastsi128_si256(v),
        _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4),
    );
    _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
}

/// The 32 bits of `qh` as bytes: `0x10` where bit `i` is set, else 0
/// (a Q5 block's fifth bits, in value order).
#[inline]
#[target_feature(enable = "avx2")]
fn fifth_bits(qh: u32) -> __m256i {
    // Byte i takes byte i / 8 of qh, then tests its bit i % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Bits `shift .. shift + width` of each of 32 bytes at `p`, as bytes.
///
/// # Safety
/// `p` readable for 32 bytes; AVX2.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn field(p: *const u8, shift: usize, mask: i8) -> __m256i {
    // SAFETY: by the caller.
    let v = unsafe { _mm256_loadu_si256(p.cast()) };
    // A 16-bit shift moves bits across the byte pair, but the mask keeps
    // only bits that came from the byte itself.
    let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift as i32));
    _mm256_and_si256(v, _mm256_set1_epi8(mask))
}

/// The 32 quants of group `g` of a block of format `F` (not F16/BF16), as
/// signed bytes in value order: [`scalar::quants`], to the bit.
///
/// # Safety
/// `p` points at a whole block; `g` below its groups; AVX2.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quants<const F: u8>(p: *const u8, g: usize) -> __m256i {
    let (h, t) = (g / 4, g % 4);
    // SAFETY (all): offsets inside the block, by the format's layout.
    unsafe {
        match F {
            code::Q4_0 => sub(nibbles16(load16(p.add(2))), 8),
            code::Q4_1 => nibbles16(load16(p.add(4))),
            code::Q5_0 => sub(
                _mm256_or_si256(nibbles16(load16(p.add(6))), fifth_bits(qh(p.add(2)))),
                16,
            ),
            code::Q5_1 => _mm256_or_si256(nibbles16(load16(p.add(8))), fifth_bits(qh(p.add(4)))),
            code::Q8_0 => _mm256_loadu_si256(p.add(2).cast()),
            code::MXFP4 => mxfp4_codes(nibbles16(load16(p.add(1)))),
            code::Q2_K => field(p.add(16 + 32 * h), 2 * t, 3),
            code::Q3_K => {
                let low = field(p.add(32 + 32 * h), 2 * t, 3);
                let high = _mm256_slli_epi16::<2>(field(p, g, 1));
                sub(_mm256_or_si256(low, high), 4)
            }
            code::Q4_K => field(p.add(16 + 32 * (g / 2)), 4 * (g % 2), 0x0f),
            code::Q5_K => {
                let low = field(p.add(48 + 32 * (g / 2)), 4 * (g % 2), 0x0f);
                let high = _mm256_slli_epi16::<4>(field(p.add(16), g, 1));
                _mm256_or_si256(low, high)
            }
            code::Q6_K => {
                let low = field(p.add(64 * h + 32 * (t % 2)), 4 * (t / 2), 0x0f);
                let high = _mm256_slli_epi16::<4>(field(p.add(128 + 32 * h), 2 * t, 3));
                sub(_mm256_or_si256(low, high), 32)
            }
            _ => _mm256_setzero_si256(),
        }
    }
}

/// MXFP4 codes (one per byte, 0-15) as their quants, by a byte shuffle
/// with [`scalar::KVALUES_MXFP4`] in both 128-bit lanes (`vpshufb` reads
/// the low four bits of each index byte).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn mxfp4_codes(codes: __m256i) -> __m256i {
    // SAFETY: sixteen bytes.
    let lane = unsafe { _mm_loadu_si128(scalar::KVALUES_MXFP4.as_ptr().cast()) };
    _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(lane), codes)
}

/// Sixteen bytes at `p`.
///
/// # Safety
/// `p` readable for sixteen bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn load16(p: *const u8) -> __m128i {
    // SAFETY: by the caller.
    unsafe { _mm_loadu_si128(p.cast()) }
}

/// The little-endian u32 at `p`.
///
/// # Safety
/// `p` readable for four bytes.
#[inline]
pub(super) unsafe fn qh(p: *const u8) -> u32 {
    // SAFETY: by the caller.
    u32::from_le(unsafe { p.cast::<u32>().read_unaligned() })
}

/// `v - k` in every byte.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn sub(v: __m256i, k: i8) -> __m256i {
    _mm256_sub_epi8(v, _mm256_set1_epi8(k))
}

/// Bytes `8c .. 8c + 8` of `q` in the low half.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn eighth(q: __m256i, c: usize) -> __m128i {
    let half = if c < 2 {
        _mm256_castsi256_si128(q)
    } else {
        _mm256_extracti128_si256::<1>(q)
    };
    if c.is_multiple_of(2) {
        half
    } else {
        _mm_unpackhi_epi64(half, half)
    }
}

/// Values `8c .. 8c + 8` of group `g` of the block at `p` (`q`: the
/// group's [`quants`]; `h`: the block's [`head`]).
///
/// # Safety
/// `p` points at a whole block, `g` below its groups, `c < 4`;
/// AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn chunk<const F: u8>(
    p: *const u8,
    q: __m256i,
    h: &Head,
    g: usize,
    c: usize,
) -> __m256 {
    let f = const { QFormat::of_code(F) };
    match F {
        // SAFETY (both): eight halves of the 32-value block.
        code::F16 => _mm256_cvtph_ps(unsafe { load16(p.add(16 * c)) }),
        code::BF16 => {
            let v = _mm256_cvtepu16_epi32(unsafe { load16(p.add(16 * c)) });
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
        }
        _ => {
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eighth(q, c)));
            let i = (GROUP * g + 8 * c) / f.sub_block();
            let s = _mm256_set1_ps(h.s[i]);
            if f.has_offset() {
                _mm256_fmadd_ps(v, s, _mm256_set1_ps(h.o[i]))
            } else {
                _mm256_mul_ps(v, s)
            }
        }
    }
}

/// Dequantize whole blocks of format `F` into `out` (values in order).
///
/// # Safety
/// `w` whole blocks, `out` at least their values; AVX2/FMA/F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize<const F: u8>(w: &[u8], out: &mut [f32]) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv) = (f.block_bytes(), f.block_values());
    let nb = w.len() / bb;
    assert!(w.len() == nb * bb && out.len() >= nb * bv, "whole blocks");
    for b in 0..nb {
        // SAFETY: block b's bytes lie in `w` and its values in `out`.
        unsafe {
            let p = w.as_ptr().add(b * bb);
            let mut h = Head::ZERO;
            head::<F>(p, &mut h);
            for g in 0..bv / GROUP {
                let q = quants::<F>(p, g);
                for c in 0..4 {
                    let at = out.as_mut_ptr().add(b * bv + GROUP * g + 8 * c);
                    _mm256_storeu_ps(at, chunk::<F>(p, q, &h, g, c));
                }
            }
        }
    }
}

/// Whether format `F` is a 32-value block with quants (Q4_0, Q4_1, Q5_0,
/// Q5_1, Q8_0, MXFP4): the AVX-512 fused path decodes those straight from
/// memory with the scales in registers, as the AVX2 one does those
/// without fifth bits ([`is_direct`]); the same operations as [`chunk`],
/// so the same bits.
pub(super) const fn is_legacy(f: QFormat) -> bool {
    f.is_quantized() && f.block_values() == GROUP
}

/// The formats the AVX2 fused path decodes straight from memory
/// ([`legacy_scales`], [`legacy_chunk`]): Q4_0, Q4_1, Q8_0. (MXFP4's
/// codes take one table lookup per 32 values from a register, [`quants`],
/// but two 8-entry permutes per eight values here: its fused path is its
/// own, `x86::fused_mxfp4`.)
pub(super) const fn is_direct(f: QFormat) -> bool {
    is_legacy(f) && legacy_layout(f).1 == 0 && !matches!(f, QFormat::MXFP4)
}

/// Where a legacy block's `qs` and `qh` start.
pub(super) const fn legacy_layout(f: QFormat) -> (usize, usize) {
    match f {
        QFormat::Q4_0 => (2, 0),
        QFormat::Q4_1 => (4, 0),
        QFormat::Q5_0 => (6, 2),
        QFormat::Q5_1 => (8, 4),
        QFormat::MXFP4 => (1, 0),
        _ => (2, 0),
    }
}

/// What a legacy format subtracts from its quants (Q4_0: 8, Q5_0: 16).
pub(super) const fn legacy_bias(f: QFormat) -> i32 {
    match f {
        QFormat::Q4_0 => 8,
        QFormat::Q5_0 => 16,
        _ => 0,
    }
}

/// A legacy block's scale and offset, broadcast (the offset is garbage in
/// formats without one, and unused).
///
/// # Safety
/// `p` points at a whole block; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_scales(p: *const u8) -> (__m256, __m256) {
    // SAFETY: by the caller (a block is at least 18 bytes).
    let s = unsafe { halves(p) };
    (
        _mm256_broadcastss_ps(s),
        _mm256_broadcastss_ps(_mm_movehdup_ps(s)),
    )
}

/// Values `8c .. 8c + 8` of a block of format `F` ([`is_direct`]), read
/// from memory: [`chunk`]'s integers and operations.
///
/// # Safety
/// `p` points at a whole block, `c < 4`; AVX2/FMA/F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_chunk<const F: u8>(
    p: *const u8,
    c: usize,
    d: __m256,
    m: __m256,
) -> __m256 {
    let f = const { QFormat::of_code(F) };
    let (qs, qh_at) = const { legacy_layout(QFormat::of_code(F)) };
    // SAFETY (all): offsets inside the block, by the format's layout.
    let q = unsafe {
        if F == code::Q8_0 {
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(2 + 8 * c).cast()))
        } else {
            // Bytes 0-7 hold values 0-7 (low nibbles) and 16-23 (high).
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(qs + 8 * (c % 2)).cast()));
            let q = if c < 2 {
                _mm256_and_si256(v, _mm256_set1_epi32(0x0f))
            } else {
                _mm256_srli_epi32::<4>(v)
            };
            // (Q5_0 and Q5_1 are not decoded here: their fifth bits cost
            // more per eight values in AVX2 than the group decoding's.)
            debug_assert_eq!(qh_at, 0, "no fifth bits on this path");
            _mm256_sub_epi32(q, _mm256_set1_epi32(legacy_bias(f)))
        }
    };
    let v = _mm256_cvtepi32_ps(q);
    if f.has_offset() {
        _mm256_fmadd_ps(v, d, m)
    } else {
        _mm256_mul_ps(v, d)
    }
}
