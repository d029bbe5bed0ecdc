//! The 8-bit-activation class: every integer dot product gives the
//! portable path's bits, in any batch; the activations' quantization is
//! as specified; the result is the f32 class's within the activations'
//! rounding.

use super::*;
use crate::quant::i8::{Acts, Dot};

const DOTS: [Dot; 4] = [Dot::Portable, Dot::Avx2, Dot::AvxVnni, Dot::Avx512Vnni];

fn quantized() -> impl Iterator<Item = QFormat> {
    QFormat::ALL.into_iter().filter(|f| f.is_quantized())
}

fn int8(dot: Dot, w: &QMatrix, x: &[f32], t: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; t * w.rows()];
    matmul_int8_with(dot, w, x, t, &mut out);
    assert!(
        out.iter().all(|v| v.is_finite()),
        "{} wrote every output",
        dot.name()
    );
    out
}

/// Each dot product this CPU has equals the portable one to the bit, for
/// every quantized format, widths with and without a partial lane of
/// sub-blocks, and batches from one row to past a task's row block.
#[test]
fn every_integer_dot_product_equals_the_portable_one_to_the_bit() {
    let mut rng = Rng(39);
    let mut ran = Vec::new();
    for dot in DOTS.into_iter().skip(1) {
        if !dot.available() {
            eprintln!("not run: no {} on this CPU", dot.name());
            continue;
        }
        ran.push(dot);
        for format in quantized() {
            for (n, k) in shapes(format) {
                let w = random_matrix(&mut rng, format, n, k);
                for t in [1, 2, 5, 65] {
                    let x = random_acts(&mut rng, t, k);
                    assert_eq!(
                        bits(&int8(Dot::Portable, &w, &x, t)),
                        bits(&int8(dot, &w, &x, t)),
                        "{} {format} [{n}x{k}], {t} rows",
                        dot.name()
                    );
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if Path::Avx2.available() {
        assert!(ran.contains(&Dot::Avx2), "AVX2 was compared");
    }
}

/// Every format at the ends of its range, where an unsigned-by-signed
/// pair comes closest to saturating `vpmaddubsw` (Q8_0: every quant -128
/// or 127, `2 * 128 * 127` a pair; the others: every byte 0xFF, the
/// largest biased quants, MXFP4's code 7; every activation quant +-127),
/// gives the portable path's bits on every dot product this CPU has, one
/// row (the one-row kernel) and many (the panels, whose AVX2 tile adds up
/// to eight pairs in i16);
/// Q8_0 also gives the exact integer sums: a saturated pair would lose
/// 256 or more of one.
#[test]
fn every_format_at_the_ends_of_its_range_does_not_saturate() {
    let (n, k) = (32, 256);
    let q8 = [(-128i8, -1.0f32), (-128, 1.0), (127, 1.0), (127, -1.0)];
    let mut cases: Vec<(QFormat, Vec<u8>, f32, Option<f32>)> = q8
        .into_iter()
        .map(|(quant, x)| {
            // A block: scale 1.0 (f16 0x3c00), then 32 quants.
            let block = [0x00, 0x3c].into_iter().chain([quant as u8; 32]).collect();
            (
                QFormat::Q8_0,
                block,
                x,
                Some(f32::from(quant) * x * k as f32),
            )
        })
        .collect();
    for format in quantized().filter(|f| *f != QFormat::Q8_0) {
        let mut block = vec![0xff; format.block_bytes()];
        match format {
            // An e8m0 scale of 2^0, every code 7 (12, biased to 28: code
            // 15 is -12, the smallest).
            QFormat::MXFP4 => {
                block.fill(0x77);
                block[0] = 127;
            }
            _ => {
                for &at in scale_offsets(format) {
                    block[at..at + 2].copy_from_slice(&[0x00, 0x3c]);
                }
            }
        }
        for x in [1.0, -1.0] {
            cases.push((format, block.clone(), x, None));
        }
    }
    for (format, block, x, exact) in cases {
        let data = block.repeat(n * k / format.block_values());
        let w = QMatrix::from_bytes(format, n, k, data).expect("shape");
        for t in [1, 2, 5, 17] {
            let xs = vec![x; t * k];
            let want = int8(Dot::Portable, &w, &xs, t);
            if let Some(exact) = exact {
                // Each activation quantizes to +-127 with scale 1/127, so
                // each output is quant * x * k up to the scale's rounding.
                for v in &want {
                    assert!((v - exact).abs() <= 1e-3 * exact.abs(), "{v} for {exact}");
                }
            }
            for dot in DOTS.into_iter().skip(1).filter(|d| d.available()) {
                assert_eq!(
                    bits(&want),
                    bits(&int8(dot, &w, &xs, t)),
                    "{} {format} at its range's end, activations {x}, {t} rows",
                    dot.name()
                );
            }
        }
    }
}

/// Several matrices of one input width with the activations quantized
/// once (a Q4_K_M layer's Q4_K q and k beside its Q6_K v) give each
/// matrix's own bits, on every integer dot product this CPU has and
/// through `matmul_each` in this process's class, from one row to past a
/// task's row block.
#[test]
fn matrices_sharing_an_input_give_their_own_bits() {
    let mut rng = Rng(35);
    let k = 256;
    let ws = [
        random_matrix(&mut rng, QFormat::Q4_K, 64, k),
        random_matrix(&mut rng, QFormat::Q4_K, 16, k),
        random_matrix(&mut rng, QFormat::Q6_K, 16, k),
        random_matrix(&mut rng, QFormat::Q8_0, 8, k),
    ];
    let refs: Vec<&QMatrix> = ws.iter().collect();
    let fresh =
        |t: usize| -> Vec<Vec<f32>> { ws.iter().map(|w| vec![f32::NAN; t * w.rows()]).collect() };
    for t in [1, 2, 5, 65] {
        let x = random_acts(&mut rng, t, k);
        let mut outs = fresh(t);
        let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
        matmul_each(&refs, &x, t, &mut views);
        for (w, out) in ws.iter().zip(&outs) {
            let mut alone = vec![f32::NAN; t * w.rows()];
            matmul(w, &x, t, &mut alone);
            assert!(alone.iter().all(|v| v.is_finite()), "{}", w.format);
            assert_eq!(
                bits(out),
                bits(&alone),
                "{} [{}x{k}], {t} rows",
                w.format,
                w.rows()
            );
        }
        for dot in DOTS.into_iter().filter(|d| d.available()) {
            let mut outs = fresh(t);
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
            crate::quant::i8::matmul_each_dot(dot, &refs, &x, t, &mut views);
            for (w, out) in ws.iter().zip(&outs) {
                assert_eq!(
                    bits(out),
                    bits(&int8(dot, w, &x, t)),
                    "{} {} [{}x{k}], {t} rows",
                    dot.name(),
                    w.format,
                    w.rows()
                );
            }
        }
    }
}

/// The AVX-512 and AVX2 group quantizers give the portable one's bits:
/// scale, quants and halves' sums, on random groups and on the edges
/// (zeros, signed zeros, a NaN among values, infinities, subnormals, the
/// largest magnitude at either end, values at half steps).
#[test]
fn group_quantizers_agree_to_the_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        type Group = unsafe fn(&[f32; 32], &mut [i8; 32]) -> (f32, i32, i32);
        let mut rng = Rng(32);
        let mut groups: Vec<[f32; 32]> = (0..2000)
            .map(|_| {
                let x = random_acts(&mut rng, 1, 32);
                x.try_into().expect("32")
            })
            .collect();
        let mut edge = |f: &dyn Fn(&mut [f32; 32])| {
            let mut g = groups[0];
            f(&mut g);
            groups.push(g);
        };
        edge(&|g| g.fill(0.0));
        edge(&|g| g.fill(-0.0));
        edge(&|g| g[7] = f32::NAN);
        edge(&|g| g[20] = f32::INFINITY);
        edge(&|g| g[3] = f32::NEG_INFINITY);
        edge(&|g| g.fill(f32::MIN_POSITIVE / 4.0));
        edge(&|g| g[0] = -1e30);
        edge(&|g| g[31] = 1e-30);
        edge(&|g| {
            for (i, v) in g.iter_mut().enumerate() {
                *v = (i as f32 - 15.5) * 0.5;
            }
        });
        let paths: [(crate::cpu::Path, Group); 2] = [
            (
                crate::cpu::Path::Avx512,
                crate::quant::i8_x86_512::quantize_group,
            ),
            (crate::cpu::Path::Avx2, crate::quant::i8_x86::quantize_group),
        ];
        for (path, group) in paths {
            if !path.available() {
                eprintln!("not run: no {path:?} on this CPU");
                continue;
            }
            for g in &groups {
                let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
                let (da, la, ha) = crate::quant::i8::quantize_group_sums(g, &mut a);
                // SAFETY: the path's features checked above.
                let (db, lb, hb) = unsafe { group(g, &mut b) };
                assert_eq!(da.to_bits(), db.to_bits(), "{path:?} {g:?}");
                assert_eq!((a, la, ha), (b, lb, hb), "{path:?} {g:?}");
            }
        }
    }
}

/// Quants in [-127, 127] that reproduce each value within half a step, a
/// scale of amax / 127, the sums of the quants, and zeros for a zero group.
#[test]
fn activations_quantize_per_group_of_32() {
    let mut rng = Rng(7);
    let (rows, cols) = (3, 96);
    let mut x = random_acts(&mut rng, rows, cols);
    x[32..64].fill(0.0); // row 0, group 1: all zero
    x[cols] = 1000.0; // row 1, group 0: one outlier
    let mut a = Acts::default();
    a.quantize(&x, rows, cols);
    for t in 0..rows {
        for g in 0..cols / 32 {
            let xs = &x[t * cols + 32 * g..t * cols + 32 * (g + 1)];
            let qs = &a.q[t * a.stride8() + 32 * g..t * a.stride8() + 32 * (g + 1)];
            let d = a.d32[t * a.n32() + g];
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(d, amax / 127.0, "row {t} group {g}");
            for (&v, &q) in xs.iter().zip(qs) {
                assert!((-127..=127).contains(&q));
                assert!(
                    (f32::from(q) * d - v).abs() <= d * 0.5001,
                    "{v} -> {q} * {d}"
                );
            }
            let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(a.b32[t * a.n32() + g], sum);
            assert_eq!(a.xb32[t * a.n32() + g], d * sum as f32);
            let lo: i32 = qs[..16].iter().map(|&q| i32::from(q)).sum();
            assert_eq!(a.b16[t * a.n16() + 2 * g], lo);
            assert_eq!(a.b16[t * a.n16() + 2 * g + 1], sum - lo);
            assert_eq!(a.d16[t * a.n16() + 2 * g + 1], d);
        }
    }
    assert_eq!(a.d32[1], 0.0);
    assert!(a.q[32..64].iter().all(|&q| q == 0));
    assert_eq!(a.q[a.stride8()], 127, "the outlier is the scale");
    // Padding past the last group (3 groups padded to 8) stays zero.
    assert!(a.d32[3..8].iter().all(|&d| d == 0.0));
}

/// Reused buffers (wide rows, then narrow ones in the same memory) hold
/// what fresh ones would: every padding byte and sub-block is zero again,
/// in a call that splits into parallel pieces and in one that does not.
#[test]
fn reused_activation_buffers_equal_fresh_ones() {
    let mut rng = Rng(17);
    let mut reused = Acts::default();
    for (rows, cols) in [(70, 2048), (3, 96), (200, 544), (5, 1056), (1, 32)] {
        let x = random_acts(&mut rng, rows, cols);
        reused.quantize(&x, rows, cols);
        let mut fresh = Acts::default();
        fresh.quantize(&x, rows, cols);
        assert_eq!(&reused.q[..], &fresh.q[..], "[{rows}x{cols}] quants");
        for (a, b) in [
            (&reused.d32, &fresh.d32),
            (&reused.xb32, &fresh.xb32),
            (&reused.d16, &fresh.d16),
            (&reused.xb16, &fresh.xb16),
        ] {
            assert_eq!(bits(a), bits(b), "[{rows}x{cols}] scales");
        }
        assert_eq!(reused.b32, fresh.b32);
        assert_eq!(reused.b16, fresh.b16);
    }
}

/// Against the f32 class: the difference is the activations' rounding,
/// at most half a step per value times the weight's magnitude (plus f32
/// rounding), and it is not zero (the class really differs).
#[test]
fn the_result_is_the_f32_class_within_the_activations_rounding() {
    let mut rng = Rng(11);
    for format in quantized() {
        let (n, k) = (24, 4 * format.block_values());
        let w = random_matrix(&mut rng, format, n, k);
        let wd = dense(&w);
        let t = 3;
        let x = random_acts(&mut rng, t, k);
        let mut f = vec![0.0; t * n];
        matmul_with(Path::Portable, &w, &x, t, &mut f);
        let q = int8(Dot::Portable, &w, &x, t);
        let mut differs = false;
        for ti in 0..t {
            let xr = &x[ti * k..(ti + 1) * k];
            for r in 0..n {
                let wr = &wd[r * k..(r + 1) * k];
                let mut bound = 0.0f32;
                let mut mag = 0.0f32;
                for (g, (xs, ws)) in xr.chunks(32).zip(wr.chunks(32)).enumerate() {
                    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let _ = g;
                    bound += ws.iter().map(|v| v.abs()).sum::<f32>() * amax / 127.0 * 0.5;
                    mag += ws.iter().zip(xs).map(|(a, b)| (a * b).abs()).sum::<f32>();
                }
                let (a, b) = (f[ti * n + r], q[ti * n + r]);
                differs |= a != b;
                assert!(
                    (a - b).abs() <= bound * 1.001 + mag * 1e-5,
                    "{format} row {r}: f32 {a} int8 {b}, bound {bound}"
                );
            }
        }
        assert!(
            differs,
            "{format}: the int8 class computed the f32 class's bits"
        );
    }
}

/// A row's result is the same bits alone and in any batch, at any place.
#[test]
fn int8_results_do_not_depend_on_the_batch() {
    let mut rng = Rng(3);
    let dot = Dot::of(crate::cpu::detect());
    for format in [QFormat::Q4_K, QFormat::Q6_K, QFormat::Q8_0, QFormat::Q4_1] {
        let (n, k) = (40, 512);
        let w = random_matrix(&mut rng, format, n, k);
        let x = random_acts(&mut rng, 70, k);
        let all = int8(dot, &w, &x, 70);
        for t in [0, 1, 63, 64, 69] {
            let one = int8(dot, &w, &x[t * k..(t + 1) * k], 1);
            assert_eq!(
                bits(&one),
                bits(&all[t * n..(t + 1) * n]),
                "{format} row {t}"
            );
        }
    }
}

/// A zero activation row gives zeros; F16 weights in this class are the
/// f32 class's.
#[test]
fn zero_rows_and_half_precision_weights() {
    let mut rng = Rng(5);
    let w = random_matrix(&mut rng, QFormat::Q4_K, 8, 256);
    let out = int8(Dot::Portable, &w, &vec![0.0; 256], 1);
    assert!(out.iter().all(|&v| v == 0.0 && v.is_sign_positive()));
    let h = random_matrix(&mut rng, QFormat::F16, 8, 64);
    let x = random_acts(&mut rng, 2, 64);
    let mut f = vec![0.0; 16];
    matmul_with(crate::cpu::path(), &h, &x, 2, &mut f);
    assert_eq!(bits(&int8(Dot::Portable, &h, &x, 2)), bits(&f));
}
