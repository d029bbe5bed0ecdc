//! Portable block decoding: the reference every path's dequantization
//! equals to the bit (the portable path runs it; the SIMD builds are tested
//! against it).
//!
//! # Decoding, and its order of operations
//! A block is read 32 values at a time (a *group*: a legacy block, an
//! eighth of a K-quant super-block, 32 halves). In a quantized format each
//! value is a small integer quant `q`, exactly as GGUF's
//! `dequantize_row_*` forms it (its offset such as `- 8` or `- 32`
//! applied in integers), times a scale `s`, plus an offset `o` in the
//! formats that have one ([`QFormat::has_offset`]):
//!
//! - without an offset: `y = q * s` (one f32 multiplication);
//! - with one: `y = fma(q, s, o)` (one rounding).
//!
//! `s` and `o` are per sub-block ([`Head`]): for the legacy formats the
//! block's `d` (and `m`); for the K-quants `d * sc` and `-(dmin * m)`,
//! the super-block's f16 scales times the sub-block's integer scale. Those
//! products are exact in f32 (an 11-bit f16 mantissa times an integer of
//! at most 8 bits), and so is `q * s` except in Q6_K (11 + 8 + 6 bits), so
//! GGUF's own order (`dl * q - ml` in ggml-quants.c and gguf-py) rounds once,
//! at the same place: the results are the same bits as GGUF's. Q6_K
//! computes `(d * sc) * q` as GGUF does (one rounding, in the last
//! multiplication).
//!
//! MXFP4's quant is the table value of its 4-bit code ([`KVALUES_MXFP4`],
//! the e2m1 value doubled, so an integer) and its scale the e8m0 byte
//! halved ([`e8m0_half`], a power of two): `q * s` is exact (a
//! product of at most 4 significant bits and a power of two, subnormal
//! included), as in ggml's `dequantize_row_mxfp4` and gguf-py, which
//! compute the same product.
//!
//! F16 and BF16 values are converted (exactly; an F16 NaN is quieted, as
//! F16C does).

use super::{code, QFormat, GROUP};

/// IEEE half to single precision (the block scales, F16 weights).
pub(super) fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exp = u32::from((bits >> 10) & 0x1f);
    let man = u32::from(bits & 0x3ff);
    let out = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: value is man * 2^-24.
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => sign | 0x7fc0_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(out)
}

/// bfloat16 to single precision: the high half of the f32's bits.
pub(super) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// MXFP4's 4-bit e2m1 codes as integers: the e2m1 value doubled (ggml's
/// `kvalues_mxfp4`; code `8 + c` is minus code `c`, and code 8 is a
/// negative zero, here 0).
pub(super) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An e8m0 exponent byte's value halved, `2^(e - 128)` (ggml's
/// `GGML_E8M0_TO_FP32_HALF`, which halves the scale because
/// [`KVALUES_MXFP4`] doubles the values): the f32 bits `(e - 1) << 23`,
/// for `e` = 0 and 1 the subnormals `2^-128` and `2^-127`. Exact; `e` =
/// 255 (an e8m0 NaN) is `2^127`, as in ggml.
pub(super) const fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// [`e8m0_half`] of every byte, computed at compile time: the SIMD paths
/// take a block's scale with one load instead of the branch and shifts.
pub(super) static E8M0_HALF: [f32; 256] = {
    let mut t = [0.0; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = e8m0_half(e as u8);
        e += 1;
    }
    t
};

fn half(block: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// A block's scales and offsets per sub-block ([`QFormat::sub_block`]
/// values: `s[i]`, `o[i]` serve values `sub * i .. sub * (i + 1)`; a legacy
/// block has one). `o` is unused in formats without an offset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Head {
    pub s: [f32; 16],
    pub o: [f32; 16],
}

impl Head {
    pub const ZERO: Head = Head {
        s: [0.0; 16],
        o: [0.0; 16],
    };
}

/// The six-bit scales and minimums of a Q4_K or Q5_K super-block (12
/// bytes, as little-endian words `w0 w1 w2`): scale `j < 4` is the low six
/// bits of byte `j`, minimum `j < 4` of byte `j + 4`; scale `j + 4` is the
/// low nibble of byte `j + 8` under the top two bits of byte `j`, minimum
/// `j + 4` the high nibble of byte `j + 8` under the top bits of byte
/// `j + 4`. Integer work, shared by every path (inline: a call from a
/// kernel's loop spills its vector registers). Returns the scales' and
/// minimums' bytes as little-endian words.
#[inline(always)]
pub(super) fn k4_scales(sc: &[u8; 12]) -> (u64, u64) {
    let w = |i: usize| u64::from(u32::from_le_bytes([sc[i], sc[i + 1], sc[i + 2], sc[i + 3]]));
    let (w0, w1, w2) = (w(0), w(4), w(8));
    const LOW6: u64 = 0x3f3f_3f3f;
    const NIB: u64 = 0x0f0f_0f0f;
    const TOP: u64 = 0x3030_3030;
    let s = (w0 & LOW6) | (((w2 & NIB) | ((w0 >> 2) & TOP)) << 32);
    let m = (w1 & LOW6) | ((((w2 >> 4) & NIB) | ((w1 >> 2) & TOP)) << 32);
    (s, m)
}

/// The sixteen six-bit scales of a Q3_K super-block (12 bytes), as two
/// little-endian words of bytes (GGUF subtracts 32 from each before use):
/// scale `j`'s low four bits
/// are the low (`j < 8`) or high nibble of byte `j % 8`, its top two bits
/// bits `2 (j / 4)` of byte `8 + j % 4`. Integer work, shared by every
/// path (inline, as [`k4_scales`]).
#[inline(always)]
pub(super) fn q3k_scales(sc: &[u8; 12]) -> [u64; 2] {
    let low = u64::from_le_bytes([sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7]]);
    let hb = u64::from(u32::from_le_bytes([sc[8], sc[9], sc[10], sc[11]]));
    const NIB: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const TWO: u64 = 0x0303_0303;
    // Top bits of scales 0-7 (bits 0-1 then 2-3 of bytes 8-11), 8-15
    // (bits 4-5, 6-7).
    let top_a = (hb & TWO) | (((hb >> 2) & TWO) << 32);
    let top_b = ((hb >> 4) & TWO) | (((hb >> 6) & TWO) << 32);
    [
        (low & NIB) | (top_a << 4),
        ((low >> 4) & NIB) | (top_b << 4),
    ]
}

/// A quantized block's [`Head`] (the portable conversions).
pub(super) fn head(format: QFormat, b: &[u8]) -> Head {
    let mut h = Head::ZERO;
    match format.code() {
        code::Q4_0 | code::Q5_0 | code::Q8_0 => h.s = [half(b, 0); 16],
        code::MXFP4 => h.s = [e8m0_half(b[0]); 16],
        code::Q4_1 | code::Q5_1 => (h.s, h.o) = ([half(b, 0); 16], [half(b, 2); 16]),
        code::Q2_K => {
            let (d, dmin) = (half(b, 80), half(b, 82));
            for (i, &sc) in b[..16].iter().enumerate() {
                h.s[i] = d * f32::from(sc & 0x0f);
                h.o[i] = -dmin * f32::from(sc >> 4);
            }
        }
        code::Q3_K => {
            let d = half(b, 108);
            let sc = q3k_scales(b[96..108].try_into().expect("12 bytes"));
            for (i, s) in h.s.iter_mut().enumerate() {
                *s = d * f32::from(sc[i / 8].to_le_bytes()[i % 8] as i8 - 32);
            }
        }
        code::Q4_K | code::Q5_K => {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let (sc, m) = k4_scales(b[4..16].try_into().expect("12 bytes"));
            for (i, (sc, m)) in sc
                .to_le_bytes()
                .into_iter()
                .zip(m.to_le_bytes())
                .enumerate()
            {
                h.s[i] = d * f32::from(sc);
                h.o[i] = -dmin * f32::from(m);
            }
        }
        code::Q6_K => {
            let d = half(b, 208);
            for (s, &sc) in h.s.iter_mut().zip(&b[192..208]) {
                *s = d * f32::from(sc as i8);
            }
        }
        _ => unreachable!("{format} has no scales"),
    }
    h
}

/// The 32 quants of group `g` of a quantized block, as GGUF defines them.
pub(super) fn quants(format: QFormat, b: &[u8], g: usize) -> [i8; 32] {
    let mut q = [0i8; 32];
    // Legacy formats: byte i's low nibble is value i, its high nibble
    // value i + 16; bit i of the 32-bit `qh` is value i's fifth bit.
    let nibbles = |qs: &[u8], i: usize| (qs[i % 16] >> (4 * (i / 16))) & 0x0f;
    let qh = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    // K-quants: group g = 4 h + t of a 2-bit array reads bits 2t of bytes
    // 32h .. 32h + 32; a bit plane (hmask, qh) bit g of bytes 0 .. 32.
    let (h, t) = (g / 4, g % 4);
    let bit = |plane: usize, i: usize| (b[plane + i] >> g) & 1;
    for (i, q) in q.iter_mut().enumerate() {
        *q = match format.code() {
            code::Q4_0 => nibbles(&b[2..18], i) as i8 - 8,
            code::Q4_1 => nibbles(&b[4..20], i) as i8,
            code::Q5_0 => (nibbles(&b[6..22], i) | (((qh(2) >> i) & 1) << 4) as u8) as i8 - 16,
            code::Q5_1 => (nibbles(&b[8..24], i) | (((qh(4) >> i) & 1) << 4) as u8) as i8,
            code::Q8_0 => b[2 + i] as i8,
            code::MXFP4 => KVALUES_MXFP4[usize::from(nibbles(&b[1..17], i))],
            code::Q2_K => ((b[16 + 32 * h + i] >> (2 * t)) & 3) as i8,
            code::Q3_K => {
                let low = (b[32 + 32 * h + i] >> (2 * t)) & 3;
                (low | (bit(0, i) << 2)) as i8 - 4
            }
            code::Q4_K => ((b[16 + 32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0f) as i8,
            code::Q5_K => {
                let low = (b[48 + 32 * (g / 2) + i] >> (4 * (g % 2))) & 0x0f;
                (low | (bit(16, i) << 4)) as i8
            }
            code::Q6_K => {
                // Values t = 0..4 of a half: low nibbles of ql bytes 0-31,
                // then 32-63, then their high nibbles; qh bits 2t.
                let low = (b[64 * h + 32 * (t % 2) + i] >> (4 * (t / 2))) & 0x0f;
                let high = (b[128 + 32 * h + i] >> (2 * t)) & 3;
                (low | (high << 4)) as i8 - 32
            }
            _ => unreachable!("{format} has no quants"),
        };
    }
    q
}

/// Dequantize whole blocks of one format (the module's order of
/// operations).
pub(super) fn dequantize_row(format: QFormat, row: &[u8], out: &mut [f32]) {
    let (bb, bv) = (format.block_bytes(), format.block_values());
    for (b, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bv)) {
        if !format.is_quantized() {
            let to_f32 = if format == QFormat::F16 {
                f16_to_f32
            } else {
                bf16_to_f32
            };
            for (o, h) in o.iter_mut().zip(b.chunks_exact(2)) {
                *o = to_f32(u16::from_le_bytes([h[0], h[1]]));
            }
            continue;
        }
        let h = head(format, b);
        let sub = format.sub_block();
        for (g, o) in o.chunks_exact_mut(GROUP).enumerate() {
            for (i, (o, q)) in o.iter_mut().zip(quants(format, b, g)).enumerate() {
                let (s, off) = (h.s[(GROUP * g + i) / sub], h.o[(GROUP * g + i) / sub]);
                *o = if format.has_offset() {
                    f32::from(q).mul_add(s, off)
                } else {
                    f32::from(q) * s
                };
            }
        }
    }
}
