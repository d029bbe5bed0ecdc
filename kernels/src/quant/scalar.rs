//! Portable implementations: activation quantization (used by every path),
//! dequantization, and the reference dot products the SIMD paths are
//! tested against.

use super::{ActRow, QFormat, BLOCK};

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

/// Quantize 32 values to `i8` with one scale; returns `(d, d * sum(q))`.
///
/// `d = max|x| / 127` and `q = round(x / d)`, so `|q| <= 127`.
pub(super) fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, f32) {
    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, x) in qs.iter_mut().zip(xs) {
        // Round half away from zero by truncating `r + copysign(0.5, r)`
        // (plain SSE2, vectorisable; `f32::round` is a libm call here).
        // |r| <= 127 by construction, so |q| <= 127; the cast saturates on NaN.
        let r = x * inv;
        let v = (r + 0.5f32.copysign(r)) as i32 as i8;
        *q = v;
        sum += i32::from(v);
    }
    (d, d * sum as f32)
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

/// Integer dot product of one weight block's quantized values with 32
/// activation values.
fn block_isum(format: QFormat, block: &[u8], a: &[i8]) -> i32 {
    match format {
        QFormat::Q4_1 => block[4..20]
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                i32::from(b & 0x0f) * i32::from(a[i]) + i32::from(b >> 4) * i32::from(a[i + 16])
            })
            .sum(),
        QFormat::Q8_0 => block[2..34]
            .iter()
            .zip(a)
            .map(|(&w, &a)| i32::from(w as i8) * i32::from(a))
            .sum(),
    }
}

/// Dot products of one weight row with each activation row of `acts`.
pub(super) fn row(format: QFormat, w: &[u8], acts: &[ActRow<'_>], out: &mut [f32]) {
    let bb = format.block_bytes();
    for (act, o) in acts.iter().zip(out.iter_mut()) {
        let mut acc = 0.0f32;
        for (b, block) in w.chunks_exact(bb).enumerate() {
            let isum = block_isum(format, block, &act.qs[b * BLOCK..(b + 1) * BLOCK]);
            let d = scale(block, 0) * act.d[b];
            acc += d * isum as f32;
            if format == QFormat::Q4_1 {
                acc += scale(block, 2) * act.s[b];
            }
        }
        *o = acc;
    }
}
