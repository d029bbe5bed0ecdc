use super::*;
use crate::test_rng::Rng;

/// Where a block of `format` keeps its f16 scales (byte offsets).
fn scale_offsets(format: QFormat) -> &'static [usize] {
    match format {
        QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0 => &[0],
        QFormat::Q4_1 | QFormat::Q5_1 | QFormat::Q4_K | QFormat::Q5_K => &[0, 2],
        QFormat::Q2_K => &[80, 82],
        QFormat::Q3_K => &[108],
        QFormat::Q6_K => &[208],
        QFormat::F16 | QFormat::BF16 | QFormat::MXFP4 => &[],
    }
}

/// One block of `format`: random bytes with sane f16 scales (F16 and
/// BF16: sane values of either sign).
fn random_block(rng: &mut Rng, format: QFormat) -> Vec<u8> {
    let mut b: Vec<u8> = (0..format.block_bytes()).map(|_| rng.byte()).collect();
    match format {
        QFormat::F16 => {
            for h in b.chunks_exact_mut(2) {
                h.copy_from_slice(&rng.half());
            }
        }
        QFormat::BF16 => {
            for h in b.chunks_exact_mut(2) {
                // Sign, an exponent near 2^0, a random 7-bit mantissa.
                let exp = 120 + (rng.next() % 12) as u16;
                let bits = ((rng.next() & 1) as u16) << 15 | exp << 7 | (rng.next() & 0x7f) as u16;
                h.copy_from_slice(&bits.to_le_bytes());
            }
        }
        // An e8m0 scale of 2^-10 .. 2^2 (halved: byte 118 .. 130).
        QFormat::MXFP4 => b[0] = 118 + (rng.next() % 13) as u8,
        _ => {
            for &at in scale_offsets(format) {
                b[at..at + 2].copy_from_slice(&rng.half());
            }
        }
    }
    b
}

fn random_matrix(rng: &mut Rng, format: QFormat, rows: usize, cols: usize) -> QMatrix {
    let blocks = rows * cols / format.block_values();
    let data = (0..blocks)
        .flat_map(|_| random_block(rng, format))
        .collect();
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

/// Every path this CPU runs, portable first.
fn kernels() -> Vec<Path> {
    crate::cpu::available_paths()
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
        Err(QuantError::Columns {
            cols: 40,
            block: 32,
            ..
        })
    ));
    assert!(matches!(
        QMatrix::from_bytes(QFormat::Q8_0, 2, 64, vec![0; 135]),
        Err(QuantError::Length {
            expected: 136,
            got: 135,
            ..
        })
    ));
    for format in QFormat::ALL {
        let bv = format.block_values();
        // Whole blocks of the format, or nothing.
        let bad = if bv == 32 { 48 } else { 128 };
        let err = QMatrix::from_bytes(format, 1, bad, vec![0; format.block_bytes()])
            .expect_err("a partial block");
        assert_eq!(
            err,
            QuantError::Columns {
                format: format.name(),
                block: bv,
                cols: bad
            }
        );
        assert!(err.to_string().contains(format.name()), "{err}");
        // Too wide, though whole blocks.
        let wide = MAX_COLS + bv;
        assert!(matches!(
            QMatrix::from_bytes(format, 1, wide, vec![0; format.row_bytes(wide)]),
            Err(QuantError::Columns { .. })
        ));
        // One byte short, one byte over, then exact.
        let need = 3 * 2 * format.block_bytes();
        for got in [need - 1, need + 1] {
            assert_eq!(
                QMatrix::from_bytes(format, 3, 2 * bv, vec![0; got]).expect_err("wrong length"),
                QuantError::Length {
                    format: format.name(),
                    rows: 3,
                    cols: 2 * bv,
                    expected: need,
                    got
                }
            );
        }
        let w = QMatrix::from_bytes(format, 3, 2 * bv, vec![0; need]).expect("exact");
        assert_eq!((w.rows(), w.cols(), w.byte_len()), (3, 2 * bv, need));
    }
    // Stacking needs one format and one width.
    let mut rng = Rng(7);
    for (fa, fb) in [
        (QFormat::Q8_0, QFormat::Q4_1),
        (QFormat::Q4_K, QFormat::Q5_K),
        (QFormat::F16, QFormat::BF16),
        (QFormat::Q6_K, QFormat::Q8_0),
    ] {
        let a = random_matrix(&mut rng, fa, 2, 256);
        let b = random_matrix(&mut rng, fb, 2, 256);
        assert_eq!(
            QMatrix::stack(&[&a, &b]).expect_err("mixed formats"),
            QuantError::Stack {
                a: fa.name(),
                a_cols: 256,
                b: fb.name(),
                b_cols: 256
            }
        );
    }
    let a = random_matrix(&mut rng, QFormat::Q4_K, 2, 256);
    let b = random_matrix(&mut rng, QFormat::Q4_K, 2, 512);
    assert!(matches!(
        QMatrix::stack(&[&a, &b]),
        Err(QuantError::Stack {
            a_cols: 256,
            b_cols: 512,
            ..
        })
    ));
}

/// Both paths against the f64 product of the dequantized weights and the
/// activations: only f32 rounding separates them.
#[test]
fn matmul_matches_the_dense_product() {
    for format in QFormat::ALL {
        let mut rng = Rng(11);
        let (n, k) = (37, 512);
        let w = random_matrix(&mut rng, format, n, k);
        let wd = dense(&w);
        // One and two rows take the fused path, more the panel path.
        for t in [1, 2, 5, 50] {
            let x = random_acts(&mut rng, t, k);
            for kernel in kernels() {
                let mut out = vec![0.0; t * n];
                matmul_with(kernel, &w, &x, t, &mut out);
                for ti in 0..t {
                    let xr = &x[ti * k..(ti + 1) * k];
                    for r in 0..n {
                        let wr = &wd[r * k..(r + 1) * k];
                        let exact: f64 = xr
                            .iter()
                            .zip(wr)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum();
                        let mag: f64 = xr
                            .iter()
                            .zip(wr)
                            .map(|(a, b)| f64::from((a * b).abs()))
                            .sum();
                        let got = f64::from(out[ti * n + r]);
                        assert!(
                            (got - exact).abs() <= mag * 1e-6 + 1e-6,
                            "{format:?} {kernel:?} rows {t}, t{ti} r{r}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }
}

/// Matrix shapes for `format` in the bit-equality tests: one block, odd
/// row counts (partial tiles and pairs, a lone last row, a panel whose
/// second strip is partial), a few widths.
fn shapes(format: QFormat) -> Vec<(usize, usize)> {
    let bv = format.block_values();
    let mut v = vec![
        (1, bv),
        (3, 3 * bv),
        (9, 2 * bv),
        (50, 2 * bv),
        (70, 1536),
        (131, 768),
    ];
    if bv == 32 {
        v.push((20, 576));
    }
    v
}

/// `path` computes the portable path's bits on fresh random matrices and
/// activations, every format: batch sizes from the fused one-row path to
/// several panel tiles and both panel widths; and the dequantized rows.
fn equals_portable(path: Path, seed: u64) {
    let mut rng = Rng(seed);
    for format in QFormat::ALL {
        for (n, k) in shapes(format) {
            let w = random_matrix(&mut rng, format, n, k);
            for t in [1, 2, 3, 5, 17, 49, 64] {
                let x = random_acts(&mut rng, t, k);
                let (mut a, mut b) = (vec![0.0; t * n], vec![0.0; t * n]);
                matmul_with(Path::Portable, &w, &x, t, &mut a);
                matmul_with(path, &w, &x, t, &mut b);
                assert_eq!(bits(&a), bits(&b), "{path} {format} [{n}x{k}], {t} rows");
            }
            for r in [0, n - 1] {
                let (mut a, mut b) = (vec![0.0; k], vec![0.0; k]);
                scalar::dequantize_row(format, w.row(r), &mut a);
                path.dequantize(format, w.row(r), &mut b);
                assert_eq!(bits(&a), bits(&b), "{path} {format} dequantized row {r}");
            }
        }
    }
}

/// The AVX2 path computes the portable path's bits: same dequantized
/// weights, same lanes, same order.
#[test]
fn avx2_path_equals_the_portable_path_to_the_bit() {
    if crate::cpu::require(Path::Avx2) {
        equals_portable(Path::Avx2, 5);
    }
}

/// The AVX-512 path (two chains per register) computes the portable
/// path's bits.
#[test]
fn avx512_path_equals_the_portable_path_to_the_bit() {
    if crate::cpu::require(Path::Avx512) {
        for seed in [5, 17, 23] {
            equals_portable(Path::Avx512, seed);
        }
    }
}

/// Random shapes and batch splits (proptest): every path this CPU runs
/// equals the portable one, and a row's bits do not depend on the batch
/// it runs in.
mod random {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn every_path_equals_portable_in_any_batch(
            seed in any::<u64>(),
            format in proptest::sample::select(QFormat::ALL.to_vec()),
            n in 1usize..40,
            blocks in 1usize..6,
            rows in 1usize..30,
            cut in 0usize..30,
        ) {
            let k = blocks * format.block_values();
            let mut rng = Rng(seed | 1);
            let w = random_matrix(&mut rng, format, n, k);
            let x = random_acts(&mut rng, rows, k);
            let mut want = vec![0.0; rows * n];
            matmul_with(Path::Portable, &w, &x, rows, &mut want);
            let cut = cut.min(rows);
            for path in kernels() {
                let mut got = vec![0.0; rows * n];
                matmul_with(path, &w, &x, rows, &mut got);
                prop_assert_eq!(bits(&want), bits(&got), "{} whole", path);
                // The same rows in two calls.
                let mut split = vec![0.0; rows * n];
                let (a, b) = split.split_at_mut(cut * n);
                matmul_with(path, &w, &x[..cut * k], cut, a);
                matmul_with(path, &w, &x[cut * k..], rows - cut, b);
                prop_assert_eq!(bits(&want), bits(&split), "{} split at {}", path, cut);
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A row's result does not depend on the batch around it (bit for bit),
/// whichever path and tile the batch size picks: what lets batched decode
/// and chunked prefill equal the reference.
#[test]
fn results_do_not_depend_on_the_batch() {
    for format in QFormat::ALL {
        let mut rng = Rng(9);
        let (n, k) = (300, 768);
        let w = random_matrix(&mut rng, format, n, k);
        let x = random_acts(&mut rng, 53, k);
        for kernel in kernels() {
            let mut whole = vec![0.0; 53 * n];
            matmul_with(kernel, &w, &x, 53, &mut whole);
            // Single rows (fused), pairs (fused), odd groups (panel tiles
            // with a lone row), and a smaller panel batch.
            let parts = [(0, 1), (52, 53), (10, 12), (3, 10), (20, 36), (0, 47)];
            assert_parts_equal_whole(kernel, &w, &x, &whole, &parts);
        }
    }
}

/// Rows `from..to` of `x` run on their own give, to the bit, the rows of
/// `whole` (all of `x` in one call).
fn assert_parts_equal_whole(
    kernel: Path,
    w: &QMatrix,
    x: &[f32],
    whole: &[f32],
    parts: &[(usize, usize)],
) {
    let (n, k) = (w.rows(), w.cols());
    for &(from, to) in parts {
        let rows = to - from;
        let mut part = vec![0.0; rows * n];
        matmul_with(kernel, w, &x[from * k..to * k], rows, &mut part);
        assert_eq!(
            bits(&part),
            bits(&whole[from * n..to * n]),
            "{:?} {kernel:?}: rows {from}..{to} differ from the {}-row call",
            w.format(),
            x.len() / k
        );
    }
}

/// A call longer than one row block (activations of 48 rows of 1,536 are
/// one block) runs its blocks and panels as one parallel section, the last
/// block short and the last panel partial: every row still equals itself
/// computed alone, or in a batch inside one block.
#[test]
fn row_blocks_and_partial_panels_do_not_change_results() {
    for format in QFormat::ALL {
        let mut rng = Rng(11);
        let (n, k, rows) = (130, 1536, 101);
        let w = random_matrix(&mut rng, format, n, k);
        let x = random_acts(&mut rng, rows, k);
        for kernel in kernels() {
            let mut whole = vec![0.0; rows * n];
            matmul_with(kernel, &w, &x, rows, &mut whole);
            let parts = [(0, 1), (47, 48), (48, 49), (100, 101), (40, 60), (96, 101)];
            assert_parts_equal_whole(kernel, &w, &x, &whole, &parts);
        }
    }
}

#[test]
fn stack_and_permute_move_whole_rows() {
    for format in QFormat::ALL {
        let mut rng = Rng(13);
        let k = 2 * format.block_values();
        let a = random_matrix(&mut rng, format, 3, k);
        let b = random_matrix(&mut rng, format, 2, k);
        let s = QMatrix::stack(&[&a, &b]).expect("same format");
        assert_eq!((s.rows(), s.cols(), s.format()), (5, k, format));
        let p = s.permute_rows(&[4, 0, 3, 1, 2]);
        let (mut x, mut y) = (vec![0.0; k], vec![0.0; k]);
        for (i, (src, r)) in [(&b, 1), (&a, 0), (&b, 0), (&a, 1), (&a, 2)]
            .iter()
            .enumerate()
        {
            p.dequantize_row(i, &mut x);
            src.dequantize_row(*r, &mut y);
            assert_eq!(bits(&x), bits(&y), "{format} row {i}");
        }
    }
}

mod formats;
mod int8;

/// A matrix in huge pages (read there by a loader, copied or stacked
/// there for streaming) multiplies to the bits of the same blocks on the
/// heap, is checked as they are, and is not copied again by
/// `in_huge_pages`.
#[test]
fn huge_page_blocks_multiply_as_the_heap_ones() {
    let mut rng = Rng(41);
    let (rows, cols) = (37, 256);
    let w = random_matrix(&mut rng, QFormat::Q4_K, rows, cols);
    let mut mem = crate::huge::HugeMem::zeroed(w.byte_len()).expect("memory");
    mem.as_mut_slice().copy_from_slice(w.bytes());
    let loaded = QMatrix::from_huge(QFormat::Q4_K, rows, cols, mem.into()).expect("valid");
    let placed = w.in_huge_pages();
    let x = random_acts(&mut rng, 3, cols);
    let product = |m: &QMatrix| {
        let mut out = vec![0.0; 3 * rows];
        matmul(m, &x, 3, &mut out);
        bits(&out)
    };
    assert_eq!(product(&loaded), product(&w));
    assert_eq!(product(&placed), product(&w));
    let again = placed.in_huge_pages();
    assert_eq!(
        again.bytes().as_ptr(),
        placed.bytes().as_ptr(),
        "shared, not copied"
    );
    let short = crate::huge::HugeMem::zeroed(w.byte_len() - 1).expect("memory");
    assert!(QMatrix::from_huge(QFormat::Q4_K, rows, cols, short.into()).is_err());
    // Stacked straight into huge pages: the heap stack's blocks and rows,
    // and its refusals.
    let v = random_matrix(&mut rng, QFormat::Q4_K, 5, cols);
    let (heap, huge) = (
        QMatrix::stack(&[&w, &v, &w]).expect("one format"),
        QMatrix::stack_in_huge_pages(&[&w, &v, &w]).expect("one format"),
    );
    assert_eq!((huge.rows(), huge.bytes()), (heap.rows(), heap.bytes()));
    let other = random_matrix(&mut rng, QFormat::Q8_0, 5, cols);
    assert!(QMatrix::stack_in_huge_pages(&[&w, &other]).is_err());
    assert!(QMatrix::stack_in_huge_pages(&[]).is_err());
}
