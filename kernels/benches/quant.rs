//! Quantized matmul throughput (f32 activations): the run-time-selected
//! path against the portable reference and against a plain copy of the same weight bytes (the
//! memory-bandwidth baseline), in one run, reported as ratios.
//!
//! `cargo bench -p kvmesh-kernels --bench quant` (shapes of SmolLM2-135M:
//! hidden 576, intermediate 1536, vocab 49,152). A benchmark, not a test:
//! nothing here asserts a time.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvmesh_kernels::quant::{matmul_with, Kernel, QFormat, QMatrix};

fn matrix(format: QFormat, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut x = seed | 1;
    let blocks = rows * cols / 32;
    let mut data = Vec::with_capacity(blocks * format.block_bytes());
    for _ in 0..blocks {
        // A small positive f16 scale (and minimum), then random quants.
        data.extend_from_slice(&0x2c00u16.to_le_bytes());
        if format == QFormat::Q4_1 {
            data.extend_from_slice(&0xac00u16.to_le_bytes());
        }
        while data.len() % format.block_bytes() != 0 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            data.push(x as u8);
        }
    }
    QMatrix::from_bytes(format, rows, cols, data).expect("shape")
}

/// Median seconds of `f` over enough runs to fill about `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut xs = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || xs.len() < 5 {
        let t = Instant::now();
        f();
        xs.push(t.elapsed().as_secs_f64());
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let fast = Kernel::detect();
    let threads = rayon::current_num_threads();
    println!(
        "quantized matmul: path {} vs scalar, {threads} threads (rayon)",
        fast.name()
    );
    println!(
        "{:<34} {:>10} {:>10} {:>9} {:>9} {:>11}",
        "shape", "fast ms", "GB/s", "xscalar", "xcopy", "GMAC/s"
    );
    let budget = Duration::from_millis(400);
    for (name, format, rows, cols) in [
        ("gate+up Q4_1 [3072x576]", QFormat::Q4_1, 3072, 576),
        ("down Q4_1 [576x1536]", QFormat::Q4_1, 576, 1536),
        ("lm_head Q8_0 [49152x576]", QFormat::Q8_0, 49152, 576),
    ] {
        let w = matrix(format, rows, cols, 7);
        for t in [1usize, 4, 16, 64, 512] {
            if format == QFormat::Q8_0 && t > 16 {
                continue;
            }
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 31.0)
                .collect();
            let mut out = vec![0.0f32; t * rows];
            let f = time(budget, || matmul_with(fast, &w, &x, t, black_box(&mut out)));
            // The portable path is slow where `mul_add` is a library call:
            // compare at small batches only.
            let s = if t <= 4 {
                time(budget, || {
                    matmul_with(Kernel::Scalar, &w, &x, t, black_box(&mut out))
                })
            } else {
                f64::NAN
            };
            // Baseline: copy the weight bytes once (what a pass must read).
            let src = vec![1u8; w.byte_len()];
            let mut dst = vec![0u8; w.byte_len()];
            let c = time(budget, || dst.copy_from_slice(black_box(&src)));
            black_box(&dst);
            println!(
                "{:<34} {:>10.3} {:>10.1} {:>9.2} {:>9.2} {:>11.1}",
                format!("{name} x{t}"),
                f * 1e3,
                w.byte_len() as f64 / f / 1e9,
                s / f,
                c / f,
                (t * rows * cols) as f64 / f / 1e9,
            );
        }
    }
}
