//! Quantized matmul throughput (f32 activations): every path this CPU runs
//! (AVX-512, AVX2, portable) and a plain copy of the same weight bytes (the
//! memory-bandwidth baseline), in one run, reported as times and ratios
//! (`512/avx2`: AVX2's time over AVX-512's, above 1 when AVX-512 is faster;
//! `p/copy`: the path's time over the copy's). GB/s and GMAC/s are the
//! fastest path's.
//!
//! `cargo bench -p kvmesh-kernels --bench quant` (shapes of SmolLM2-135M:
//! hidden 576, intermediate 1536, vocab 49,152). A benchmark, not a test:
//! nothing here asserts a time.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvmesh_kernels::cpu::{self, Path};
use kvmesh_kernels::quant::{matmul_with, QFormat, QMatrix};

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
    let paths = cpu::available_paths();
    let threads = rayon::current_num_threads();
    let names: Vec<&str> = paths.iter().map(|p| p.name()).collect();
    println!(
        "quantized matmul, {threads} threads (rayon); paths: {}; ms per call (median)",
        names.join(", ")
    );
    print!("{:<30}", "shape x rows");
    for p in paths.iter().rev() {
        print!(" {:>9}", format!("{} ms", p.name()));
    }
    print!(" {:>9}", "copy ms");
    if paths.contains(&Path::Avx512) {
        print!(" {:>9}", "512/avx2");
    }
    for p in paths.iter().rev().filter(|p| **p != Path::Portable) {
        print!(" {:>10}", format!("{}/copy", p.name()));
    }
    println!(" {:>8} {:>8}", "GB/s", "GMAC/s");
    let budget = Duration::from_millis(300);
    for (name, format, rows, cols) in [
        ("gate+up Q4_1 [3072x576]", QFormat::Q4_1, 3072, 576),
        ("down Q4_1 [576x1536]", QFormat::Q4_1, 576, 1536),
        ("lm_head Q8_0 [49152x576]", QFormat::Q8_0, 49152, 576),
    ] {
        // `QUANT_BENCH=lm_head` (a substring of the shape) runs one shape.
        if std::env::var("QUANT_BENCH").is_ok_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let w = matrix(format, rows, cols, 7);
        // Baseline: copy the weight bytes once (what a pass must read).
        let src = vec![1u8; w.byte_len()];
        let mut dst = vec![0u8; w.byte_len()];
        let copy = time(budget, || dst.copy_from_slice(black_box(&src)));
        black_box(&dst);
        for t in [1usize, 2, 16, 64, 512] {
            if format == QFormat::Q8_0 && t > 64 {
                continue;
            }
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 31.0)
                .collect();
            let mut out = vec![0.0f32; t * rows];
            let mut ms = Vec::new();
            for &p in paths.iter().rev() {
                // The portable path is slow where `mul_add` is a library
                // call: small batches only.
                let m = if p != Path::Portable || t <= 2 {
                    time(budget, || matmul_with(p, &w, &x, t, black_box(&mut out)))
                } else {
                    f64::NAN
                };
                ms.push((p, m));
            }
            let of = |p: Path| ms.iter().find(|m| m.0 == p).map_or(f64::NAN, |m| m.1);
            print!("{:<30}", format!("{name} x{t}"));
            for (_, m) in &ms {
                print!(" {:>9.3}", m * 1e3);
            }
            print!(" {:>9.3}", copy * 1e3);
            if paths.contains(&Path::Avx512) {
                print!(" {:>9.2}", of(Path::Avx2) / of(Path::Avx512));
            }
            for (p, m) in ms.iter().filter(|m| m.0 != Path::Portable) {
                let _ = p;
                print!(" {:>10.2}", m / copy);
            }
            let best = ms[0].1;
            println!(
                " {:>8.1} {:>8.1}",
                w.byte_len() as f64 / best / 1e9,
                (t * rows * cols) as f64 / best / 1e9,
            );
        }
    }
}
