//! Each kernel against the CPU runtime.

use half::{bf16, f16};
use kvmesh_cuda::ops::{self, WeightDtype};
use kvmesh_kernels::quant::{QFormat, QMatrix};
use kvmesh_kernels::rope::{Rope, RopeLayout, RopeScaling};
use rand::rngs::StdRng;
use rand::Rng;

use super::{close, gpu, poisoned, random, rng};

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn elementwise_kernels_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    let (rows, d) = (7, 576);
    let x = random(&mut rng, rows * d);
    let w = random(&mut rng, d);

    // RMSNorm.
    let mut want = vec![0f32; rows * d];
    kvmesh_kernels::norm::rms_norm(&x, &w, 1e-5, &mut want);
    let mut out = poisoned(&gpu, rows * d);
    ops::rms_norm(
        &gpu,
        &gpu.upload(&x).expect("x"),
        &gpu.upload(&w).expect("w"),
        rows,
        d,
        1e-5,
        &mut out,
    )
    .expect("rms_norm");
    close("rms_norm", &gpu.download(&out).expect("dl"), &want, 1e-5);

    // RoPE, both layouts, Llama 3 scaling.
    let (heads, hd) = (9, 64);
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    for layout in [RopeLayout::RotateHalf, RopeLayout::Interleaved] {
        let rope = Rope::new(hd, 500_000.0, scaling, layout);
        let q = random(&mut rng, rows * heads * hd);
        let positions: Vec<usize> = (0..rows).map(|_| rng.random_range(0..100_000)).collect();
        let mut want = q.clone();
        rope.apply(&mut want, &positions, heads);
        let mut dq = gpu.upload(&q).expect("q");
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        ops::rope(
            &gpu,
            &mut dq,
            &gpu.upload(&pos).expect("pos"),
            &gpu.upload(rope.inv_freq()).expect("freq"),
            rows,
            heads,
            hd,
            layout == RopeLayout::Interleaved,
        )
        .expect("rope");
        // Angles up to 1e5 rad: sin/cos of a large f32 argument differ in
        // the last bits between libm and the device.
        close(
            &format!("rope {layout:?}"),
            &gpu.download(&dq).expect("dl"),
            &want,
            2e-4,
        );
    }

    // SwiGLU.
    let width = 1536;
    let gu = random(&mut rng, rows * 2 * width);
    let mut want = vec![0f32; rows * width];
    kvmesh_kernels::activation::swiglu(&gu, width, &mut want);
    let mut out = poisoned(&gpu, rows * width);
    ops::swiglu(&gpu, &gpu.upload(&gu).expect("gu"), rows, width, &mut out).expect("swiglu");
    close("swiglu", &gpu.download(&out).expect("dl"), &want, 1e-5);

    // add_into, add_bias, gather_rows.
    let y = random(&mut rng, rows * d);
    let mut dx = gpu.upload(&x).expect("x");
    ops::add_into(&gpu, &mut dx, &gpu.upload(&y).expect("y"), rows * d).expect("add");
    let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    close("add_into", &gpu.download(&dx).expect("dl"), &want, 0.0);
    ops::add_bias(&gpu, &mut dx, &gpu.upload(&w).expect("w"), rows, d).expect("bias");
    let want: Vec<f32> = want.iter().enumerate().map(|(i, v)| v + w[i % d]).collect();
    close("add_bias", &gpu.download(&dx).expect("dl"), &want, 0.0);
    let sel = [6u32, 0, 3];
    let mut out = poisoned(&gpu, sel.len() * d);
    ops::gather_rows(
        &gpu,
        &dx,
        &gpu.upload(&sel).expect("sel"),
        sel.len(),
        d,
        &mut out,
    )
    .expect("gather");
    let want: Vec<f32> = sel
        .iter()
        .flat_map(|&r| want[r as usize * d..(r as usize + 1) * d].to_vec())
        .collect();
    close("gather_rows", &gpu.download(&out).expect("dl"), &want, 0.0);
}

/// f32 to a half type's bits, and back.
type Narrow = fn(f32) -> u16;
type Widen = fn(u16) -> f32;

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn embedding_and_conversions_match_the_host_conversions() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    let (vocab, hidden) = (1000, 192);
    let table = random(&mut rng, vocab * hidden);
    let ids: Vec<u32> = (0..11).map(|_| rng.random_range(0..vocab as u32)).collect();
    let dids = gpu.upload(&ids).expect("ids");
    let rows_of = |t: &dyn Fn(usize) -> f32| -> Vec<f32> {
        ids.iter()
            .flat_map(|&i| (0..hidden).map(move |j| (i as usize, j)))
            .map(|(i, j)| t(i * hidden + j))
            .collect()
    };
    let mut out = poisoned(&gpu, ids.len() * hidden);
    ops::embedding(
        &gpu,
        &gpu.upload(&table).expect("t"),
        WeightDtype::F32,
        &dids,
        ids.len(),
        vocab,
        hidden,
        &mut out,
    )
    .expect("emb");
    close(
        "embedding f32",
        &gpu.download(&out).expect("dl"),
        &rows_of(&|k| table[k]),
        0.0,
    );
    let halves: [(WeightDtype, Narrow, Widen); 2] = [
        (
            WeightDtype::F16,
            |v| f16::from_f32(v).to_bits(),
            |b| f16::from_bits(b).to_f32(),
        ),
        (
            WeightDtype::Bf16,
            |v| bf16::from_f32(v).to_bits(),
            |b| bf16::from_bits(b).to_f32(),
        ),
    ];
    for (dtype, narrow, widen) in halves {
        let bits: Vec<u16> = table.iter().map(|v| narrow(*v)).collect();
        let dt = gpu.upload(&bits).expect("t");
        ops::embedding(&gpu, &dt, dtype, &dids, ids.len(), vocab, hidden, &mut out).expect("emb");
        let want = rows_of(&|k| widen(bits[k]));
        close(
            &format!("embedding {}", dtype.name()),
            &gpu.download(&out).expect("dl"),
            &want,
            0.0,
        );
    }

    // f32 -> f16 / bf16, round to nearest even, as the `half` crate.
    let x: Vec<f32> = random(&mut rng, 4096)
        .into_iter()
        .map(|v| v * 300.0)
        .collect();
    let dx = gpu.upload(&x).expect("x");
    for dtype in [WeightDtype::F16, WeightDtype::Bf16] {
        let mut out = gpu.upload(&vec![0xFFFFu16; x.len()]).expect("out");
        ops::f32_to_half(&gpu, &dx, x.len(), dtype, &mut out).expect("conv");
        let got = gpu.download(&out).expect("dl");
        let want: Vec<u16> = x
            .iter()
            .map(|v| {
                if dtype == WeightDtype::F16 {
                    f16::from_f32(*v).to_bits()
                } else {
                    bf16::from_f32(*v).to_bits()
                }
            })
            .collect();
        assert_eq!(got, want, "f32_to_half {}", dtype.name());
        println!("f32_to_half {:<28} bit-exact", dtype.name());
    }
}

/// Random GGUF blocks of `format` (finite scales).
fn random_blocks(rng: &mut StdRng, format: QFormat, rows: usize, cols: usize) -> QMatrix {
    let n_blocks = rows * cols / 32;
    let mut data = Vec::with_capacity(n_blocks * format.block_bytes());
    for _ in 0..n_blocks {
        data.extend_from_slice(
            &f16::from_f32(rng.random_range(0.001f32..0.05))
                .to_bits()
                .to_le_bytes(),
        );
        match format {
            QFormat::Q4_1 => {
                data.extend_from_slice(
                    &f16::from_f32(rng.random_range(-0.2f32..0.2))
                        .to_bits()
                        .to_le_bytes(),
                );
                data.extend((0..16).map(|_| rng.random::<u8>()));
            }
            QFormat::Q8_0 => data.extend((0..32).map(|_| rng.random::<u8>())),
            other => unreachable!("{other} has no device kernel to test"),
        }
    }
    QMatrix::from_bytes(format, rows, cols, data).expect("blocks")
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn quantized_kernels_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    let (out_rows, cols) = (300, 576);
    for format in [QFormat::Q4_1, QFormat::Q8_0] {
        let w = random_blocks(&mut rng, format, out_rows, cols);
        let dw = gpu.upload(w.bytes()).expect("w");
        let mut want = vec![0f32; out_rows * cols];
        for r in 0..out_rows {
            w.dequantize_row(r, &mut want[r * cols..(r + 1) * cols]);
        }
        let mut out = poisoned(&gpu, out_rows * cols);
        ops::dequantize(
            &gpu,
            &dw,
            format,
            out_rows * cols / 32,
            WeightDtype::F32,
            &mut out,
        )
        .expect("deq");
        close(
            &format!("dequantize {} -> f32", format.name()),
            &gpu.download(&out).expect("dl"),
            &want,
            0.0,
        );
        let mut half = gpu.upload(&vec![0xFFFFu16; out_rows * cols]).expect("h");
        ops::dequantize(
            &gpu,
            &dw,
            format,
            out_rows * cols / 32,
            WeightDtype::F16,
            &mut half,
        )
        .expect("deq16");
        let got: Vec<f32> = gpu
            .download(&half)
            .expect("dl")
            .iter()
            .map(|b| f16::from_bits(*b).to_f32())
            .collect();
        close(
            &format!("dequantize {} -> f16", format.name()),
            &got,
            &want,
            1e-3,
        );

        for rows in [1, 3, 8] {
            let x = random(&mut rng, rows * cols);
            let mut want = vec![0f32; rows * out_rows];
            kvmesh_kernels::quant::matmul(&w, &x, rows, &mut want);
            let mut out = poisoned(&gpu, rows * out_rows);
            ops::qmatvec(
                &gpu,
                &dw,
                format,
                out_rows,
                cols,
                &gpu.upload(&x).expect("x"),
                rows,
                &mut out,
            )
            .expect("qmv");
            close(
                &format!("qmatvec {} x{rows}", format.name()),
                &gpu.download(&out).expect("dl"),
                &want,
                1e-4,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn gemms_match_a_double_precision_reference() {
    let Some(gpu) = gpu() else { return };
    if let Err(e) = gpu.blas() {
        assert!(
            std::env::var("KVMESH_REQUIRE_CUDA").as_deref() != Ok("1"),
            "cuBLAS: {e}"
        );
        eprintln!("not run: {e}");
        return;
    }
    let mut rng = rng();
    let (rows, k, n) = (37, 576, 1536);
    let x = random(&mut rng, rows * k);
    let w = random(&mut rng, n * k);
    let reference = |x: &[f32], w: &[f32]| -> Vec<f32> {
        let mut out = vec![0f32; rows * n];
        for t in 0..rows {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|i| f64::from(x[t * k + i]) * f64::from(w[j * k + i]))
                    .sum();
                out[t * n + j] = s as f32;
            }
        }
        out
    };
    let mut out = poisoned(&gpu, rows * n);
    ops::gemm_f32(
        &gpu,
        &gpu.upload(&x).expect("x"),
        &gpu.upload(&w).expect("w"),
        rows,
        k,
        n,
        &mut out,
    )
    .expect("sgemm");
    close(
        "gemm f32",
        &gpu.download(&out).expect("dl"),
        &reference(&x, &w),
        1e-5,
    );
    for dtype in [WeightDtype::F16, WeightDtype::Bf16] {
        let round = |v: &[f32]| -> (Vec<u16>, Vec<f32>) {
            v.iter()
                .map(|x| match dtype {
                    WeightDtype::F16 => (f16::from_f32(*x).to_bits(), f16::from_f32(*x).to_f32()),
                    _ => (bf16::from_f32(*x).to_bits(), bf16::from_f32(*x).to_f32()),
                })
                .unzip()
        };
        let (wb, wr) = round(&w);
        let (_, xr) = round(&x);
        let mut xh = gpu.upload(&vec![0u16; rows * k]).expect("xh");
        ops::f32_to_half(&gpu, &gpu.upload(&x).expect("x"), rows * k, dtype, &mut xh)
            .expect("conv");
        let mut out = poisoned(&gpu, rows * n);
        ops::gemm_half(
            &gpu,
            &xh,
            &gpu.upload(&wb).expect("w"),
            dtype,
            rows,
            k,
            n,
            &mut out,
        )
        .expect("gemm");
        // Same rounded inputs, f32 accumulation on the device.
        close(
            &format!("gemm {}", dtype.name()),
            &gpu.download(&out).expect("dl"),
            &reference(&xr, &wr),
            1e-4,
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn argmax_matches_the_cpu_rule() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    let (rows, vocab) = (5, 49_152);
    let mut logits = random(&mut rng, rows * vocab);
    // Row 1: a tie, the first wins. Row 2: a NaN is never chosen.
    logits[vocab + 7] = 5.0;
    logits[vocab + 9000] = 5.0;
    logits[2 * vocab + 3] = f32::NAN;
    logits[2 * vocab + 4] = 4.0;
    let want: Vec<u32> = logits
        .chunks(vocab)
        .map(|r| {
            let mut best = 0usize;
            for (i, &l) in r.iter().enumerate() {
                if l > r[best] {
                    best = i;
                }
            }
            best as u32
        })
        .collect();
    let mut out = gpu.upload(&vec![u32::MAX; rows]).expect("out");
    ops::argmax_rows(
        &gpu,
        &gpu.upload(&logits).expect("l"),
        rows,
        vocab,
        &mut out,
    )
    .expect("argmax");
    assert_eq!(gpu.download(&out).expect("dl"), want);
}
