//! Portable block decoding: half-precision scales and dequantization (the
//! portable path's, and the reference the SIMD one is tested against).

use super::{QFormat, BLOCK};

/// IEEE half to single precision (the block scales).
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

pub(super) fn scale(block: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// Dequantize whole blocks: `fma(q, d, m)` (Q4_1) or `q * d` (Q8_0), the
/// same bits as the SIMD path.
pub(super) fn dequantize_row(format: QFormat, row: &[u8], out: &mut [f32]) {
    let bb = format.block_bytes();
    for (block, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
        match format {
            QFormat::Q4_1 => {
                let (d, m) = (scale(block, 0), scale(block, 2));
                for (i, &byte) in block[4..20].iter().enumerate() {
                    o[i] = f32::from(byte & 0x0f).mul_add(d, m);
                    o[i + 16] = f32::from(byte >> 4).mul_add(d, m);
                }
            }
            QFormat::Q8_0 => {
                let d = scale(block, 0);
                for (o, &q) in o.iter_mut().zip(&block[2..34]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
    }
}
