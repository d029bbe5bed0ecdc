//! The formats themselves: GGML ids and sizes, the packed-scale decoding,
//! and GGUF's own dequantization (gguf-py) as ground truth.

use super::*;

/// GGML type ids and block sizes as ggml.h / gguf-py's `GGML_QUANT_SIZES`
/// define them: (id, name, values per block, bytes per block; F16 and
/// BF16 in blocks of 32).
const GGUF: [(u32, &str, usize, usize); 13] = [
    (1, "F16", 32, 64),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (30, "BF16", 32, 64),
    (39, "MXFP4", 32, 17),
];

#[test]
fn formats_have_gguf_ids_names_and_sizes() {
    for (format, &(id, name, values, bytes)) in QFormat::ALL.iter().zip(&GGUF) {
        assert_eq!(QFormat::from_ggml_type(id), Some(*format), "{name}");
        assert_eq!(format.ggml_type(), id);
        assert_eq!(format.name(), name);
        assert_eq!(format.to_string(), name);
        assert_eq!(
            (format.block_values(), format.block_bytes()),
            (values, bytes)
        );
        assert_eq!(QFormat::of_code(format.code()), *format);
    }
    // F32, Q8_1, Q8_K, the IQ and TQ families, NVFP4 (40), unknown ids.
    for id in [0, 4, 5, 9, 15, 16, 20, 23, 24, 29, 31, 34, 40, 1000] {
        assert_eq!(QFormat::from_ggml_type(id), None, "id {id}");
    }
}

/// The packed six-bit scales, word-at-a-time ([`scalar::k4_scales`],
/// [`scalar::q3k_scales`]), equal their definitions written index by
/// index, on random bytes.
#[test]
fn packed_scales_unpack_as_defined() {
    let mut rng = Rng(3);
    for _ in 0..2000 {
        let sc: [u8; 12] = std::array::from_fn(|_| rng.byte());
        let (s, m) = scalar::k4_scales(&sc);
        let (s, m) = (s.to_le_bytes(), m.to_le_bytes());
        for j in 0..8 {
            let (ws, wm) = if j < 4 {
                (sc[j] & 63, sc[j + 4] & 63)
            } else {
                (
                    (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4),
                    (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
                )
            };
            assert_eq!((s[j], m[j]), (ws, wm), "Q4_K scale {j} of {sc:?}");
        }
        let q3 = scalar::q3k_scales(&sc);
        for j in 0..16 {
            let low = if j < 8 { sc[j] & 0x0f } else { sc[j - 8] >> 4 };
            let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
            assert_eq!(
                q3[j / 8].to_le_bytes()[j % 8],
                low | (high << 4),
                "Q3_K scale {j} of {sc:?}"
            );
        }
    }
}

/// Hand-built blocks: the layouts' less obvious corners (Q5_0's fifth
/// bits, Q3_K's inverted high bit, Q6_K's interleaved quarters).
#[test]
fn dequantize_reads_the_k_and_five_bit_layouts() {
    let one = 0x3c00u16.to_le_bytes(); // 1.0
                                       // Q5_0: d = 1, qh = bit i for odd i, nibbles all 15: values -1 (even
                                       // i: 15 - 16) and 15 (odd: 31 - 16).
    let mut b = one.to_vec();
    b.extend(0xaaaa_aaaau32.to_le_bytes());
    b.extend([0xff; 16]);
    let mut row = vec![0.0; 32];
    for path in kernels() {
        path.dequantize(QFormat::Q5_0, &b, &mut row);
        for (i, v) in row.iter().enumerate() {
            assert_eq!(*v, if i % 2 == 1 { 15.0 } else { -1.0 }, "{path} Q5_0 {i}");
        }
    }
    // Q3_K: all scales 33 (so each sub-block's scale is d * 1), d = 1;
    // low bits 3, high bit set only in group 5 (value 3, else 3 - 4).
    let mut b = vec![0u8; 110];
    b[..32].fill(1 << 5); // hmask: bit 5 = group 5
    b[32..96].fill(0xff); // qs: 3 in every 2-bit field
    b[96..104].fill(0x11); // low nibbles 1 -> 0b01 | 0b10 << 4 = 33
    b[104..108].fill(0xaa); // top bits 2 for every scale
    b[108..110].copy_from_slice(&one);
    let mut row = vec![0.0; 256];
    for path in kernels() {
        path.dequantize(QFormat::Q3_K, &b, &mut row);
        for (i, v) in row.iter().enumerate() {
            assert_eq!(*v, if i / 32 == 5 { 3.0 } else { -1.0 }, "{path} Q3_K {i}");
        }
    }
    // Q6_K: d = 1, scale j = j + 1; ql byte i = i % 16 | (15 - i % 16) << 4,
    // qh = 0: value v of half h, quarter t, lane l is the nibble minus 32
    // times scale 8h + 2t + l / 16.
    let mut b = vec![0u8; 210];
    for (i, q) in b[..128].iter_mut().enumerate() {
        *q = (i % 16) as u8 | ((15 - i % 16) as u8) << 4;
    }
    for (j, s) in b[192..208].iter_mut().enumerate() {
        *s = j as u8 + 1;
    }
    b[208..].copy_from_slice(&one);
    for path in kernels() {
        path.dequantize(QFormat::Q6_K, &b, &mut row);
        for (v, got) in row.iter().enumerate() {
            let (h, t, l) = (v / 128, (v % 128) / 32, v % 32);
            let byte = b[64 * h + 32 * (t % 2) + l];
            let q = f32::from((byte >> (4 * (t / 2))) & 0x0f) - 32.0;
            let s = (8 * h + 2 * t + l / 16 + 1) as f32;
            assert_eq!(*got, s * q, "{path} Q6_K {v}");
        }
    }
}

/// Hand-built MXFP4 blocks: byte `i` holds code `i` in its low nibble
/// (value `i`) and code `15 - i` in its high one (value `i + 16`), under
/// exponents from the subnormal scales (`e` = 0, 1) to the largest finite
/// product; each value is the e2m1 number the OCP spec gives its code
/// (sign, two exponent bits, one mantissa bit), times `2^(e - 127)`,
/// computed here in f64 without the table.
#[test]
fn dequantize_reads_mxfp4_codes_and_exponents() {
    /// OCP e2m1: `(-1)^s * 2^(E - 1) * (1 + m / 2)`, subnormal `m / 2`
    /// at `E` = 0.
    fn e2m1(code: u8) -> f64 {
        let (s, e, m) = (code >> 3, (code >> 1) & 3, code & 1);
        let mag = if e == 0 {
            f64::from(m) / 2.0
        } else {
            2f64.powi(i32::from(e) - 1) * (1.0 + f64::from(m) / 2.0)
        };
        if s == 1 {
            -mag
        } else {
            mag
        }
    }
    let mut row = vec![0.0; 32];
    for e in [0u8, 1, 2, 100, 127, 128, 129, 200, 252] {
        let mut b = vec![e];
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        for path in kernels() {
            path.dequantize(QFormat::MXFP4, &b, &mut row);
            for (v, got) in row.iter().enumerate() {
                let code = if v < 16 { v as u8 } else { 31 - v as u8 };
                let want = e2m1(code) * 2f64.powi(i32::from(e) - 127);
                assert_eq!(f64::from(*got), want, "{path} MXFP4 e {e} value {v}");
            }
        }
    }
}

/// The e8m0 table the SIMD paths load holds [`scalar::e8m0_half`] of
/// every byte, and that is `2^(e - 128)`.
#[test]
fn e8m0_scales_are_powers_of_two() {
    for e in 0..=255u8 {
        let want = 2f64.powi(i32::from(e) - 128);
        assert_eq!(f64::from(scalar::e8m0_half(e)), want, "byte {e}");
        assert_eq!(
            scalar::E8M0_HALF[usize::from(e)].to_bits(),
            scalar::e8m0_half(e).to_bits()
        );
    }
}

/// One format's rows from the fixture.
struct Golden {
    format: QFormat,
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
    values: Vec<f32>,
}

/// `kernels/tests/data/gguf_quants.bin`, made by
/// `scripts/golden/make_quant_fixtures.py` with gguf-py 0.19.0 (its format
/// is described there; its MXFP4 rows take every exponent byte of finite
/// products, 0 to 252).
fn golden() -> Vec<Golden> {
    let data: &[u8] = include_bytes!("../../../tests/data/gguf_quants.bin");
    let mut at = 0;
    let u32_at = |at: &mut usize| {
        let v = u32::from_le_bytes(data[*at..*at + 4].try_into().expect("4 bytes"));
        *at += 4;
        v as usize
    };
    assert_eq!(&data[..4], b"KVQF");
    at += 4;
    assert_eq!(u32_at(&mut at), 1, "fixture version");
    let n = u32_at(&mut at);
    let mut out = Vec::new();
    for _ in 0..n {
        let id = u32_at(&mut at) as u32;
        let format = QFormat::from_ggml_type(id).expect("a format the kernels run");
        let (rows, cols, len) = (u32_at(&mut at), u32_at(&mut at), u32_at(&mut at));
        let blocks = data[at..at + len].to_vec();
        at += len;
        let values = data[at..at + 4 * rows * cols]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        at += 4 * rows * cols;
        out.push(Golden {
            format,
            rows,
            cols,
            blocks,
            values,
        });
    }
    assert_eq!(at, data.len(), "trailing bytes");
    out
}

/// Our dequantization equals gguf-py's `gguf.quants.dequantize` to the
/// bit, for every format, on every path: the same layouts, and (scalar.rs)
/// the same single rounding.
#[test]
fn dequantize_equals_gguf_py() {
    let golden = golden();
    let formats: Vec<QFormat> = golden.iter().map(|g| g.format).collect();
    assert_eq!(formats, QFormat::ALL, "one entry per format, in id order");
    for g in &golden {
        let w = QMatrix::from_bytes(g.format, g.rows, g.cols, g.blocks.clone()).expect("shape");
        assert!(g.values.iter().all(|v| v.is_finite()));
        for path in kernels() {
            let mut row = vec![0.0; g.cols];
            for r in 0..g.rows {
                path.dequantize(g.format, w.row(r), &mut row);
                let want = &g.values[r * g.cols..(r + 1) * g.cols];
                for (i, (got, want)) in row.iter().zip(want).enumerate() {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{path} {} row {r} value {i}: {got} vs gguf-py {want}",
                        g.format
                    );
                }
            }
        }
        // And what the kernels multiply with: a one-hot activation row
        // picks each weight out exactly (0 * finite + ... + 1 * w).
        let k = g.cols;
        for path in kernels() {
            for c in [0, 1, 17, k / 2 + 3, k - 1] {
                let mut x = vec![0.0; k];
                x[c] = 1.0;
                let mut out = vec![0.0; g.rows];
                matmul_with(path, &w, &x, 1, &mut out);
                for (r, got) in out.iter().enumerate() {
                    let want = g.values[r * k + c];
                    // The lane sums add +0.0 terms, which turn a -0.0 weight
                    // into +0.0; every other value passes through exactly.
                    assert_eq!(
                        *got, want,
                        "{path} {} row {r} column {c} through matmul",
                        g.format
                    );
                }
            }
        }
    }
}
