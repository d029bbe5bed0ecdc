//! What the x86 builds of [`super::i8`] share: the panels' buffers and
//! scales ([`super::i8_x86_256`], [`super::i8_x86_512`]) and the AVX2
//! group quantizer of the activations. The one- and two-row kernel is
//! [`super::i8_x86_row`].

use std::arch::x86_64::*;

use super::i8::{bias, padded, Acts};
use super::lines::Lines;
use super::scalar::Head;
use super::x86_blocks::{head, is_legacy};
use super::{QFormat, GROUP};

/// A panel's byte and scale buffers sized for rows of `cols` values of
/// `format` and `lanes` weight rows: `u` holds `padded(groups)` groups of
/// `lanes` rows (zeros from the row's last real group on), `s` and `o`
/// `[sub-block][lane]`, all zeros. Returns (real groups, padded
/// sub-blocks).
pub(super) fn shape_panel(
    format: QFormat,
    cols: usize,
    lanes: usize,
    u: &mut Lines<u8>,
    s: &mut Vec<f32>,
    o: &mut Vec<f32>,
) -> (usize, usize) {
    let real = cols / GROUP;
    let subs = padded(cols / format.sub_block());
    u.resize(padded(real) * GROUP * lanes);
    u[real * GROUP * lanes..].fill(0);
    for v in [s, o] {
        v.clear();
        v.resize(subs * lanes, 0.0);
    }
    (real, subs)
}

/// The sub-blocks of real values a panel's tile runs through (one
/// `super::ahead::Ahead` step each), of the `subs` the panel was shaped
/// for: those past the row's end (padding, zeros in the panel and in the
/// acts, whose rows hold at least this many) are skipped.
pub(super) fn real_subs(format: QFormat, a: &Acts, subs: usize) -> usize {
    (a.cols() / format.sub_block()).min(subs)
}

/// What makes format `F`'s signed quants the panels' unsigned bytes:
/// `(q + add) ^ flip` (a bias, or Q8_0's sign bit flipped: +128).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn unsigned_quants(f: QFormat) -> (__m256i, __m256i) {
    match bias(f) {
        Some(b) => (_mm256_set1_epi8(b as i8), _mm256_setzero_si256()),
        None => (_mm256_setzero_si256(), _mm256_set1_epi8(-128)),
    }
}

/// Each of `live` consecutive rows (`rb` bytes, `cols` values of format
/// `F`, at `w`) writes its blocks' scales, and offsets where the format has
/// them, to its lane `r` of the `[sub-block][lanes]` arrays `s` and `o`.
///
/// # Safety
/// AVX2/FMA/F16C; `w` holds those rows; `s` and `o` hold their sub-blocks
/// for `lanes >= live` lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn lane_scales<const F: u8>(
    w: *const u8,
    live: usize,
    cols: usize,
    lanes: usize,
    s: &mut [f32],
    o: &mut [f32],
) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv, per) = (
        f.block_bytes(),
        f.block_values(),
        f.block_values() / f.sub_block(),
    );
    let rb = f.row_bytes(cols);
    if f16_head(f) {
        // Eight rows' heads of a block at a time, packed by scalar loads
        // and widened by one conversion: one block at a time, each
        // conversion merged into the last one's register (a dependency
        // chain) and took half of filling a Q5_0 or Q8_0 panel.
        // Whole eights of lanes, every block's inside `s` and `o`.
        let end = cols / bv * lanes;
        assert!(
            lanes.is_multiple_of(8)
                && live <= lanes
                && end <= s.len()
                && (!f.has_offset() || end <= o.len())
        );
        for b in 0..cols / bv {
            for r in (0..live).step_by(8) {
                let n = (live - r).min(8);
                let at = b * lanes + r;
                // SAFETY: block b of rows r .. r + n is inside `w`; lanes
                // r .. r + 8 of sub-block b are inside `s` and `o`
                // (asserted; lanes past `live` get zeros, as shaped).
                unsafe {
                    let p = w.add(r * rb + b * bb);
                    _mm256_storeu_ps(s.as_mut_ptr().add(at), halves8(p, rb, n));
                    if f.has_offset() {
                        _mm256_storeu_ps(o.as_mut_ptr().add(at), halves8(p.add(2), rb, n));
                    }
                }
            }
        }
        return;
    }
    let mut h = Head::ZERO;
    for r in 0..live {
        for b in 0..cols / bv {
            // SAFETY: block b of row r is inside `w` (the caller).
            unsafe { head::<F>(w.add(r * rb + b * bb), &mut h) };
            for i in 0..per {
                let at = (b * per + i) * lanes + r;
                s[at] = h.s[i];
                if f.has_offset() {
                    o[at] = h.o[i];
                }
            }
        }
    }
}

/// The f16 values at `p + j * stride` for `j < 8`, as f32; those from
/// `live` on give zeros (not read).
///
/// # Safety
/// `p + j * stride` readable for two bytes for `j < live`; F16C.
#[inline(always)]
pub(super) unsafe fn halves8(p: *const u8, stride: usize, live: usize) -> __m256 {
    // SAFETY (all): by the caller.
    unsafe {
        let mut w = [0u64; 2];
        if live == 8 {
            for (k, w) in w.iter_mut().enumerate() {
                for j in 0..4 {
                    let h = p.add((4 * k + j) * stride).cast::<u16>().read_unaligned();
                    *w |= u64::from(h) << (16 * j);
                }
            }
        } else {
            for j in 0..live {
                let h = p.add(j * stride).cast::<u16>().read_unaligned();
                w[j / 4] |= u64::from(h) << (16 * (j % 4));
            }
        }
        _mm256_cvtph_ps(_mm_set_epi64x(w[1] as i64, w[0] as i64))
    }
}

/// Whether a block of `f` is one sub-block that starts with its f16 scale
/// (and, with an offset, the f16 offset after it): the legacy blocks but
/// MXFP4, whose scale is one e8m0 byte.
pub(super) const fn f16_head(f: QFormat) -> bool {
    is_legacy(f) && !matches!(f, QFormat::MXFP4)
}

/// One group of 32 activations quantized as `super::i8::quantize_group`
/// does, to the bit, with its halves' quant sums, in AVX2 (the AVX-512
/// build's `super::i8_x86_512::quantize_group` says why each step gives
/// the same bits: NaNs passed over by `vmaxps`'s operand order, separate
/// multiply, add and subtract, a NaN quant 0).
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_group(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> (f32, i32, i32) {
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: 32 values in `x`, 32 bytes in `q`.
    unsafe {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let inverse = match super::i8::inverse_scale(amax, q) {
            Ok(id) => id,
            Err(d) => return (d, 0, 0),
        };
        let (id, round) = (_mm256_set1_ps(inverse), _mm256_set1_ps(ROUND));
        let i: [__m256i; 4] = std::array::from_fn(|k| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[k], id), round), round);
            let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_and_si256(_mm256_cvtps_epi32(r), ordered)
        });
        // In [-127, 127]: the packs do not saturate; they interleave the
        // 128-bit lanes, which the permutation puts back in order.
        let words = [
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        ];
        let bytes = _mm256_packs_epi16(words[0], words[1]);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered);
        let sum = |a: __m256i, b: __m256i| {
            let s = _mm256_add_epi32(a, b);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            _mm_cvtsi128_si32(s)
        };
        (amax / 127.0, sum(i[0], i[1]), sum(i[2], i[3]))
    }
}
