//! x86 builds of [`super::i8`]: the weight rows unpacked with the f32
//! class's block decoding ([`super::x86_blocks`]: the same integer quants,
//! the same scales to the bit), and the dot products with AVX2
//! `vpmaddubsw`/`vpmaddwd`, AVX-VNNI or AVX-512 VNNI `vpdpbusd`. Every
//! integer sum is exact (see [`super::i8`] for the bounds), so the three
//! give the portable path's bits.
//!
//! A group's 32 byte products come as eight i32 lanes (lane `j`: values
//! `4j .. 4j + 4`). Eight sub-blocks' lanes are summed into one vector of
//! eight sums by unpacks and adds (no horizontal adds), which then is
//! scaled and added to the eight f32 lanes of the output at once.

use std::arch::x86_64::*;

use super::i8::{bias, padded, Acts, Dot, Row};
use super::scalar::Head;
use super::x86_blocks::{head, quants};
use super::{with_format, QFormat, GROUP};
use crate::simd::hsum;

/// Bytes ahead of the block being unpacked that are prefetched: weights
/// stream from memory (or L3) at batch 1, and one sequential stream per
/// core is not enough to keep the loads in flight.
const PREFETCH: usize = 8192;

/// Unpack a row of blocks of `format` into `row` (shaped for it).
///
/// # Safety
/// `dot`'s features ([`Dot::available`]), not the portable one.
pub(super) unsafe fn unpack(dot: Dot, format: QFormat, row: &mut Row, blocks: &[u8]) {
    debug_assert!(dot != Dot::Portable && dot.available());
    // SAFETY: every x86 dot product has AVX2/FMA/F16C.
    with_format!(format, F => unsafe { unpack_f::<F>(row, blocks) })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_f<const F: u8>(row: &mut Row, blocks: &[u8]) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv, subs) = (
        f.block_bytes(),
        f.block_values(),
        f.block_values() / f.sub_block(),
    );
    let add = _mm256_set1_epi8(bias(f).unwrap_or(0) as i8);
    assert!(blocks.len().is_multiple_of(bb));
    let n = blocks.len() / bb;
    assert!(row.u.len() >= n * bv && row.s.len() >= n * subs && row.o.len() >= n * subs);
    let mut h = Head::ZERO;
    for b in 0..n {
        // SAFETY: block `b` is inside `blocks`; the row's arrays hold its
        // values and sub-blocks (asserted).
        unsafe {
            let p = blocks.as_ptr().add(b * bb);
            // The bytes a few blocks on (the next rows' once this one
            // ends: a task's rows are consecutive in memory). A hint only:
            // it may point past the matrix and never faults.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH).cast());
            head::<F>(p, &mut h);
            std::ptr::copy_nonoverlapping(h.s.as_ptr(), row.s.as_mut_ptr().add(b * subs), subs);
            if f.has_offset() {
                std::ptr::copy_nonoverlapping(h.o.as_ptr(), row.o.as_mut_ptr().add(b * subs), subs);
            }
            for g in 0..bv / GROUP {
                let q = _mm256_add_epi8(quants::<F>(p, g), add);
                _mm256_storeu_si256(row.u.as_mut_ptr().add(b * bv + g * GROUP).cast(), q);
            }
        }
    }
}

/// A panel's byte and scale buffers sized for rows of `cols` values of
/// `format` and `lanes` weight rows: `u` holds `padded(groups)` groups of
/// `lanes` rows (zeros from the row's last real group on), `s` and `o`
/// `[sub-block][lane]`, all zeros. Returns (real groups, padded
/// sub-blocks).
pub(super) fn shape_panel(
    format: QFormat,
    cols: usize,
    lanes: usize,
    u: &mut Vec<u8>,
    s: &mut Vec<f32>,
    o: &mut Vec<f32>,
) -> (usize, usize) {
    let real = cols / GROUP;
    let subs = padded(cols / format.sub_block());
    u.resize(padded(real) * GROUP * lanes, 0);
    u[real * GROUP * lanes..].fill(0);
    for v in [s, o] {
        v.clear();
        v.resize(subs * lanes, 0.0);
    }
    (real, subs)
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

/// The dot product of the unpacked `row` with activation row `t`.
///
/// # Safety
/// `dot`'s features; `row` unpacked from `format` for `acts`' width.
pub(super) unsafe fn dot(dot: Dot, format: QFormat, row: &Row, acts: &Acts, t: usize) -> f32 {
    // SAFETY (all): by the caller.
    with_format!(format, F => unsafe {
        match dot {
            Dot::Avx512Vnni => dot_vnni512::<F>(row, acts, t),
            Dot::AvxVnni => dot_avxvnni::<F>(row, acts, t),
            _ => dot_avx2::<F>(row, acts, t),
        }
    })
}

/// A group's byte products: unsigned weight bytes by signed activations,
/// eight i32 lanes of four products each.
trait Bytes {
    /// # Safety
    /// The implementation's features.
    unsafe fn dp(u: __m256i, x: __m256i) -> __m256i;
}

struct Avx2;
impl Bytes for Avx2 {
    #[inline(always)]
    unsafe fn dp(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX2 (the caller). No pair saturates (module bounds).
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)) }
    }
}

struct AvxVnni;
impl Bytes for AvxVnni {
    #[inline(always)]
    unsafe fn dp(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-VNNI (the caller).
        unsafe { _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x) }
    }
}

struct Avx512Vnni;
impl Bytes for Avx512Vnni {
    #[inline(always)]
    unsafe fn dp(u: __m256i, x: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI + VL (the caller).
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x) }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2<const F: u8>(row: &Row, acts: &Acts, t: usize) -> f32 {
    // SAFETY: by the caller.
    unsafe { body::<Avx2, F>(row, acts, t) }
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn dot_avxvnni<const F: u8>(row: &Row, acts: &Acts, t: usize) -> f32 {
    // SAFETY: by the caller.
    unsafe { body::<AvxVnni, F>(row, acts, t) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn dot_vnni512<const F: u8>(row: &Row, acts: &Acts, t: usize) -> f32 {
    // SAFETY: by the caller.
    unsafe { body::<Avx512Vnni, F>(row, acts, t) }
}

/// Group `g`'s exact products (lanes of four), as [`Bytes::dp`] or, for
/// Q8_0's signed bytes, magnitudes against sign-moved activations.
#[inline(always)]
unsafe fn group<B: Bytes, const F: u8>(u: *const u8, x: *const i8, g: usize) -> __m256i {
    // SAFETY: the caller's rows hold group `g` (padded to whole lanes).
    unsafe {
        let w = _mm256_loadu_si256(u.add(g * GROUP).cast());
        let a = _mm256_loadu_si256(x.add(g * GROUP).cast());
        if const { bias(QFormat::of_code(F)).is_none() } {
            B::dp(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w))
        } else {
            B::dp(w, a)
        }
    }
}

/// Four groups' lanes summed per half: `[s0 s1 s2 s3 | s0' s1' s2' s3']`,
/// `s_i` the sum of `p[i]`'s lanes 0-3 (values 0-15), `s_i'` of lanes 4-7.
#[inline(always)]
unsafe fn sum4(p: [__m256i; 4]) -> __m256i {
    // SAFETY: AVX2 (every caller).
    unsafe {
        let t0 = _mm256_add_epi32(
            _mm256_unpacklo_epi32(p[0], p[1]),
            _mm256_unpackhi_epi32(p[0], p[1]),
        );
        let t1 = _mm256_add_epi32(
            _mm256_unpacklo_epi32(p[2], p[3]),
            _mm256_unpackhi_epi32(p[2], p[3]),
        );
        _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1))
    }
}

/// The module's dot product for format `F` with products `B`.
#[inline(always)]
unsafe fn body<B: Bytes, const F: u8>(row: &Row, a: &Acts, t: usize) -> f32 {
    let f = const { QFormat::of_code(F) };
    let shift = const {
        match bias(QFormat::of_code(F)) {
            Some(b) if b > 0 => b.trailing_zeros() as i32,
            _ => -1,
        }
    };
    let sub16 = const { QFormat::of_code(F).sub_block() == 16 };
    // SAFETY (all): `row` and `a` are padded to whole lanes of sub-blocks
    // (`Row::shape`, `Acts::quantize`), which the loops take; AVX2/FMA.
    unsafe {
        let x = a.q.as_ptr().add(t * a.stride8());
        let u = row.u.as_ptr();
        let (n, d, b, xb) = if sub16 {
            let n = a.n16();
            (
                n,
                a.d16.as_ptr().add(t * n),
                a.b16.as_ptr().add(t * n),
                a.xb16.as_ptr().add(t * n),
            )
        } else {
            let n = a.n32();
            (
                n,
                a.d32.as_ptr().add(t * n),
                a.b32.as_ptr().add(t * n),
                a.xb32.as_ptr().add(t * n),
            )
        };
        let (s, o) = (row.s.as_ptr(), row.o.as_ptr());
        // Groups past the row's end are zeros: not read (a 576-wide row is
        // 18 groups, padded to 24).
        let real = a.cols() / GROUP;
        let group = |g: usize| {
            if g < real {
                group::<B, F>(u, x, g)
            } else {
                _mm256_setzero_si256()
            }
        };
        let mut l = _mm256_setzero_ps();
        for m in 0..n / 8 {
            let mut p = if sub16 {
                let g = 4 * m;
                let r = sum4([group(g), group(g + 1), group(g + 2), group(g + 3)]);
                // Sub-blocks in order: 2g, 2g + 1, 2g + 2, ...
                _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
            } else {
                let g = 8 * m;
                let r0 = sum4([group(g), group(g + 1), group(g + 2), group(g + 3)]);
                let r1 = sum4([group(g + 4), group(g + 5), group(g + 6), group(g + 7)]);
                _mm256_add_epi32(
                    _mm256_permute2x128_si256::<0x20>(r0, r1),
                    _mm256_permute2x128_si256::<0x31>(r0, r1),
                )
            };
            if shift >= 0 {
                let bs = _mm256_loadu_si256(b.add(8 * m).cast());
                p = _mm256_sub_epi32(p, _mm256_sll_epi32(bs, _mm_cvtsi32_si128(shift)));
            }
            let scale = _mm256_mul_ps(_mm256_loadu_ps(s.add(8 * m)), _mm256_loadu_ps(d.add(8 * m)));
            l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, l);
            if f.has_offset() {
                l = _mm256_fmadd_ps(
                    _mm256_loadu_ps(o.add(8 * m)),
                    _mm256_loadu_ps(xb.add(8 * m)),
                    l,
                );
            }
        }
        hsum(l)
    }
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
