use super::*;

/// xorshift64*: reproducible test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    /// A normal f16 of magnitude about 2^-5 .. 2^0, either sign.
    fn half(&mut self) -> [u8; 2] {
        let sign = (self.next() & 1) as u16;
        let exp = 10 + (self.next() % 6) as u16;
        let man = (self.next() & 0x3ff) as u16;
        ((sign << 15) | (exp << 10) | man).to_le_bytes()
    }
}

fn random_matrix(rng: &mut Rng, format: QFormat, rows: usize, cols: usize) -> QMatrix {
    let blocks = rows * cols / BLOCK;
    let mut data = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        data.extend_from_slice(&rng.half());
        if format == QFormat::Q4_1 {
            data.extend_from_slice(&rng.half());
        }
        let n = format.block_bytes() - data.len() % format.block_bytes();
        for _ in 0..n {
            data.push(rng.byte());
        }
    }
    QMatrix::from_bytes(format, rows, cols, data).expect("shape")
}

fn random_acts(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|_| rng.unit() * 3.0).collect()
}

fn dense(w: &QMatrix) -> Vec<f32> {
    let mut out = vec![0.0; w.rows() * w.cols()];
    for (r, row) in out.chunks_exact_mut(w.cols()).enumerate() {
        w.dequantize_row(r, row);
    }
    out
}

fn kernels() -> Vec<Kernel> {
    let mut k = vec![Kernel::Scalar];
    if Kernel::detect() != Kernel::Scalar {
        k.push(Kernel::detect());
    }
    k
}

#[test]
fn half_precision_scales_decode() {
    assert_eq!(scalar::f16_to_f32(0x3c00), 1.0);
    assert_eq!(scalar::f16_to_f32(0xc000), -2.0);
    assert_eq!(scalar::f16_to_f32(0x3800), 0.5);
    assert_eq!(scalar::f16_to_f32(0x7bff), 65504.0);
    assert_eq!(scalar::f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(scalar::f16_to_f32(0x8000).to_bits(), (-0.0f32).to_bits());
    assert!(scalar::f16_to_f32(0x7c00).is_infinite());
    assert!(scalar::f16_to_f32(0x7e00).is_nan());
}

#[test]
fn dequantize_reads_the_gguf_block_layout() {
    // Q4_1: d = 0.5, m = -1.0; byte i holds value i (low) and 15 - i (high).
    let mut q4 = vec![0x00, 0x38, 0x00, 0xbc];
    q4.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    let w = QMatrix::from_bytes(QFormat::Q4_1, 1, 32, q4).expect("shape");
    let mut row = vec![0.0; 32];
    w.dequantize_row(0, &mut row);
    for i in 0..16 {
        assert_eq!(row[i], 0.5 * i as f32 - 1.0);
        assert_eq!(row[16 + i], 0.5 * (15 - i) as f32 - 1.0);
    }
    // Q8_0: d = 2.0, values -16..16.
    let mut q8 = vec![0x00, 0x40];
    q8.extend((0..32i8).map(|i| (i - 16) as u8));
    let w = QMatrix::from_bytes(QFormat::Q8_0, 1, 32, q8).expect("shape");
    w.dequantize_row(0, &mut row);
    for (i, v) in row.iter().enumerate() {
        assert_eq!(*v, 2.0 * (i as f32 - 16.0));
    }
}

#[test]
fn shapes_are_checked() {
    assert!(matches!(
        QMatrix::from_bytes(QFormat::Q4_1, 2, 40, vec![0; 40]),
        Err(QuantError::Columns { cols: 40 })
    ));
    assert!(matches!(
        QMatrix::from_bytes(QFormat::Q8_0, 2, 64, vec![0; 135]),
        Err(QuantError::Length {
            expected: 136,
            got: 135,
            ..
        })
    ));
    let mut rng = Rng(7);
    let a = random_matrix(&mut rng, QFormat::Q8_0, 2, 64);
    let b = random_matrix(&mut rng, QFormat::Q4_1, 2, 64);
    assert!(matches!(
        QMatrix::stack(&[&a, &b]),
        Err(QuantError::Stack { .. })
    ));
}

#[test]
fn activation_quantization_is_within_half_a_step() {
    let mut rng = Rng(3);
    let x = random_acts(&mut rng, 3, 96);
    let q = QuantizedActs::quantize(&x, 3, 96);
    for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
        let d = q.d[b];
        let mut sum = 0i32;
        for (i, v) in xs.iter().enumerate() {
            let qi = q.qs[b * BLOCK + i];
            assert!(qi != i8::MIN);
            assert!((f32::from(qi) * d - v).abs() <= d * 0.5 + 1e-6);
            sum += i32::from(qi);
        }
        assert_eq!(q.s[b], d * sum as f32);
    }
    // An all-zero block quantizes to zeros with a zero scale, no NaN.
    let z = QuantizedActs::quantize(&[0.0; 32], 1, 32);
    assert_eq!((z.d[0], z.s[0]), (0.0, 0.0));
    assert!(z.qs.iter().all(|&q| q == 0));
}

/// Both paths against the f32 product of the dequantized weights and the
/// unquantized activations: the only error is the activations' rounding.
#[test]
fn matmul_matches_the_dense_product() {
    for format in [QFormat::Q4_1, QFormat::Q8_0] {
        let mut rng = Rng(11);
        let (n, k, t) = (37, 192, 5);
        let w = random_matrix(&mut rng, format, n, k);
        let x = random_acts(&mut rng, t, k);
        let wd = dense(&w);
        let acts = QuantizedActs::quantize(&x, t, k);
        for kernel in kernels() {
            let mut out = vec![0.0; t * n];
            matmul_with(kernel, &w, &acts, &mut out);
            for ti in 0..t {
                let xr = &x[ti * k..(ti + 1) * k];
                let norm: f32 = xr.iter().map(|v| v.abs()).sum::<f32>();
                for r in 0..n {
                    let wr = &wd[r * k..(r + 1) * k];
                    let exact: f32 = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
                    let wmax = wr.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    // Each activation is off by at most half a step (amax/254).
                    let bound = wmax * norm / 127.0 + 1e-3;
                    let got = out[ti * n + r];
                    assert!(
                        (got - exact).abs() <= bound,
                        "{format:?} {kernel:?} t{ti} r{r}: {got} vs {exact} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_path_agrees_with_the_scalar_reference() {
    if Kernel::detect() == Kernel::Scalar {
        eprintln!("no SIMD path on this CPU; scalar only");
        return;
    }
    for format in [QFormat::Q4_1, QFormat::Q8_0] {
        let mut rng = Rng(5);
        let (n, k, t) = (64, 1536, 7);
        let w = random_matrix(&mut rng, format, n, k);
        let acts = QuantizedActs::quantize(&random_acts(&mut rng, t, k), t, k);
        let (mut a, mut b) = (vec![0.0; t * n], vec![0.0; t * n]);
        matmul_with(Kernel::Scalar, &w, &acts, &mut a);
        matmul_with(Kernel::detect(), &w, &acts, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1.0),
                "{format:?}: {x} vs {y}"
            );
        }
    }
}

/// A row's result does not depend on the batch around it (bit for bit):
/// what lets batched decode and chunked prefill equal the reference.
#[test]
fn results_do_not_depend_on_the_batch() {
    for format in [QFormat::Q4_1, QFormat::Q8_0] {
        let mut rng = Rng(9);
        let (n, k) = (300, 576);
        let w = random_matrix(&mut rng, format, n, k);
        let x = random_acts(&mut rng, 11, k);
        for kernel in kernels() {
            let all = QuantizedActs::quantize(&x, 11, k);
            let mut batched = vec![0.0; 11 * n];
            matmul_with(kernel, &w, &all, &mut batched);
            for t in 0..11 {
                let one = QuantizedActs::quantize(&x[t * k..(t + 1) * k], 1, k);
                let mut single = vec![0.0; n];
                matmul_with(kernel, &w, &one, &mut single);
                let same = single
                    .iter()
                    .zip(&batched[t * n..(t + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{format:?} {kernel:?}: row {t} differs batched");
            }
        }
    }
}

#[test]
fn stack_and_permute_move_whole_rows() {
    let mut rng = Rng(13);
    let a = random_matrix(&mut rng, QFormat::Q4_1, 3, 64);
    let b = random_matrix(&mut rng, QFormat::Q4_1, 2, 64);
    let s = QMatrix::stack(&[&a, &b]).expect("same format");
    assert_eq!((s.rows(), s.cols()), (5, 64));
    let p = s.permute_rows(&[4, 0, 3, 1, 2]);
    let (mut x, mut y) = (vec![0.0; 64], vec![0.0; 64]);
    for (i, (src, r)) in [(&b, 1), (&a, 0), (&b, 0), (&a, 1), (&a, 2)]
        .iter()
        .enumerate()
    {
        p.dequantize_row(i, &mut x);
        src.dequantize_row(*r, &mut y);
        assert_eq!(x, y, "row {i}");
    }
}
