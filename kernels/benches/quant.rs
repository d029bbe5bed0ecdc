//! Quantized matmul throughput, three tables:
//!
//! - `formats`: every GGUF format on this CPU's best path, at 1, 16 and 512
//!   activation rows, on a [576 x 1536] matrix (SmolLM2-135M's down
//!   projection, L2-resident at 4 bits) and a [2048 x 8192] one (a 1-2B
//!   model's MLP, from memory): ms per call, GB/s of weight bytes read, and
//!   GMAC/s; `copy` is a plain copy of the same bytes (the bandwidth
//!   baseline), `x1/copy` the one-row call's time over it. Q8_0 and Q4_1,
//!   the formats that came first, are the baseline of the others.
//! - `paths`: every path this CPU runs (AVX-512, AVX2, portable) and the
//!   copy, on SmolLM2-135M's shapes (hidden 576, intermediate 1536, vocab
//!   49,152), as times and ratios (`512/avx2`: AVX2's time over AVX-512's,
//!   above 1 when AVX-512 is faster; `p/copy`: the path's time over the
//!   copy's). GB/s and GMAC/s are the fastest path's.
//!
//! - `int8`: the f32 class against the 8-bit-activation class, every
//!   quantized format at 1, 16 and 512 rows (see `fn int8`), the largest
//!   batch's rate also as a share of the dot product's peak measured in
//!   the same run.
//!
//! - `stream`: batch 1 of the int8 class as a decode step runs it, every
//!   quantized format on a [4096 x 1024] matrix whose copies (256 MB in
//!   all, in huge pages as a model's) are called in turn, so the weights
//!   stream from memory: GB/s of weight bytes against the read bandwidth
//!   measured in the same run (the physical limit of batch-1 decode), and
//!   ns per 32-value group a thread.
//!   `QUANT_BENCH_COLS=576` streams rows of that width instead (about the
//!   same bytes; formats whose blocks do not divide it are left out): a
//!   model's own row width, where a row's fixed costs weigh more.
//!
//! `cargo bench -p kvmesh-kernels --bench quant` runs them all;
//! `QUANT_BENCH_TABLE=formats` (or `paths`) one of them, `QUANT_BENCH` (a
//! substring of a shape's or format's name) only some rows, and
//! `QUANT_BENCH_ROWS=1,16` only those batch sizes in `formats`, and
//! `QUANT_BENCH_PATH=avx2` that path instead of the best in `formats`. A benchmark,
//! not a test: nothing here asserts a time.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvmesh_kernels::cpu::{self, Path};
use kvmesh_kernels::quant::{matmul_int8_with, matmul_with, Dot, QFormat, QMatrix};

/// Where a block of `format` keeps its f16 scales (byte offsets).
fn scale_offsets(format: QFormat) -> &'static [usize] {
    match format {
        QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0 => &[0],
        QFormat::Q4_1 | QFormat::Q5_1 | QFormat::Q4_K | QFormat::Q5_K => &[0, 2],
        QFormat::Q2_K => &[80, 82],
        QFormat::Q3_K => &[108],
        QFormat::Q6_K => &[208],
        _ => &[],
    }
}

/// Random quants with small f16 scales (MXFP4: 2^-4; F16 and BF16: small
/// values).
fn matrix(format: QFormat, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let blocks = rows * cols / format.block_values();
    let bb = format.block_bytes();
    let mut data = Vec::with_capacity(blocks * bb);
    for _ in 0..blocks {
        let at = data.len();
        data.extend((0..bb).map(|_| next() as u8));
        let block = &mut data[at..];
        match format {
            // 2^-5 .. 2^-4 in either sign (F16: exponent 10; BF16: 122).
            QFormat::F16 => block.chunks_exact_mut(2).for_each(|h| {
                h.copy_from_slice(&(0x2800 | (next() as u16 & 0x83ff)).to_le_bytes())
            }),
            QFormat::BF16 => block.chunks_exact_mut(2).for_each(|h| {
                h.copy_from_slice(&(0x3d00 | (next() as u16 & 0x807f)).to_le_bytes())
            }),
            // An e8m0 scale of 2^-4 (the byte halved: 2^(124 - 128)).
            QFormat::MXFP4 => block[0] = 124,
            _ => {
                for &s in scale_offsets(format) {
                    block[s..s + 2].copy_from_slice(&0x2c00u16.to_le_bytes());
                }
            }
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
    let table = std::env::var("QUANT_BENCH_TABLE").unwrap_or_default();
    // On one of the pool's threads, as the model's forward pass runs: a
    // call then starts its tasks from inside the pool instead of injecting
    // them and sleeping until they finish (several microseconds a call on
    // these machines, which would swamp the small shapes).
    rayon::scope(|_| {
        if table.is_empty() || table == "formats" {
            formats();
        }
        if table.is_empty() || table == "paths" {
            paths();
        }
        if table.is_empty() || table == "int8" {
            int8();
        }
        if table.is_empty() || table == "stream" {
            stream();
        }
    });
}

/// The two numerics classes side by side on the best path: every quantized
/// format, f32 activations against 8-bit ones (the best integer dot
/// product), ms per call and the f32 class's time over the int8 one's
/// (above 1: int8 faster); `copy` as in `formats`. `QUANT_BENCH_TABLE=int8`
/// runs it alone.
fn int8() {
    // `QUANT_BENCH_PATH=avx2` (the f32 class's path) and
    // `QUANT_BENCH_DOT=avx2` (or avx-vnni, avx512-vnni, portable): others
    // than the best.
    let path = bench_path();
    let dot = std::env::var("QUANT_BENCH_DOT").map_or(Dot::of(path), |d| {
        [Dot::Avx512Vnni, Dot::AvxVnni, Dot::Avx2, Dot::Portable]
            .into_iter()
            .find(|x| x.name() == d && x.available())
            .expect("a dot product this CPU has: avx512-vnni, avx-vnni, avx2 or portable")
    });
    // The dot product's own ceiling, measured now (two operations per
    // 8-bit multiply-add): the last column's base.
    let peak = kvmesh_kernels::roofline::int8_peak_gops(dot);
    println!(
        "f32 against int8 activations, {} path, {} dot products ({peak:.0} GOP/s peak now), {} threads; ms per call (median)",
        path.name(),
        dot.name(),
        rayon::current_num_threads()
    );
    println!(
        "{:<6} {:<13} {:>8} {:>8} {:>8} {:>6} {:>8} {:>8} {:>6} {:>8} {:>8} {:>6} {:>9} {:>6}",
        "format",
        "shape",
        "copy ms",
        "x1 f32",
        "x1 int8",
        "ratio",
        "x16 f32",
        "x16 int8",
        "ratio",
        "x512 f32",
        "x512 i8",
        "ratio",
        "i8 GMAC/s",
        "% peak"
    );
    let budget = Duration::from_millis(300);
    for (rows, cols) in [(576, 1536), (3072, 576), (49152, 576), (2048, 8192)] {
        for format in quantized_formats() {
            let shape = format!("[{rows}x{cols}]");
            if !wanted(&format!("{} {shape}", format.name())) {
                continue;
            }
            if cols % format.block_values() != 0 {
                continue;
            }
            let w = matrix(format, rows, cols, 7);
            let copy = copy_time(w.byte_len(), budget);
            print!("{:<6} {:<13} {:>8.3}", format.name(), shape, copy * 1e3);
            let mut last = 0.0;
            for t in [1usize, 16, 512] {
                if !rows_wanted(t) {
                    print!(" {:>8} {:>8} {:>6}", "-", "-", "-");
                    continue;
                }
                let x: Vec<f32> = (0..t * cols)
                    .map(|i| ((i % 97) as f32 - 48.0) / 31.0)
                    .collect();
                let mut out = vec![0.0f32; t * rows];
                let f = time(budget, || matmul_with(path, &w, &x, t, black_box(&mut out)));
                let q = time(budget, || {
                    matmul_int8_with(dot, &w, &x, t, black_box(&mut out))
                });
                print!(" {:>8.3} {:>8.3} {:>6.2}", f * 1e3, q * 1e3, f / q);
                last = (t * rows * cols) as f64 / q / 1e9;
            }
            println!(" {:>9.1} {:>5.0}%", last, 100.0 * 2.0 * last / peak);
        }
    }
    println!();
}

/// Batch 1 from memory (see the module docs): the best dot product, each
/// call on the next copy of the matrix.
fn stream() {
    let dot = Dot::of(bench_path());
    let threads = rayon::current_num_threads();
    let read = kvmesh_kernels::roofline::read_gbps(256 << 20);
    println!(
        "batch 1 streamed from memory, {} dot products, {threads} threads; read bandwidth now {read:.1} GB/s",
        dot.name()
    );
    println!(
        "{:<6} {:<13} {:>8} {:>8} {:>8} {:>9}",
        "format", "shape", "ms", "GB/s", "% read", "ns/group"
    );
    let cols: usize = std::env::var("QUANT_BENCH_COLS").map_or(1024, |c| {
        c.parse()
            .ok()
            .filter(|&c: &usize| c > 0 && c.is_multiple_of(32))
            .expect("QUANT_BENCH_COLS: a positive multiple of 32")
    });
    let rows = 4096 * 1024 / cols;
    let x: Vec<f32> = (0..cols).map(|i| ((i % 97) as f32 - 48.0) / 31.0).collect();
    let mut out = vec![0.0f32; rows];
    for format in quantized_formats() {
        let shape = format!("[{rows}x{cols}]");
        if !wanted(&format!("{} {shape}", format.name()))
            || !cols.is_multiple_of(format.block_values())
        {
            continue;
        }
        let one = matrix(format, rows, cols, 7);
        // In huge pages, as a loaded model's projections are.
        let copies: Vec<QMatrix> = (0..(256usize << 20).div_ceil(one.byte_len()))
            .map(|_| one.in_huge_pages())
            .collect();
        let mut next = 0;
        let s = time(Duration::from_millis(600), || {
            next = (next + 1) % copies.len();
            matmul_int8_with(dot, &copies[next], &x, 1, black_box(&mut out))
        });
        let gbps = one.byte_len() as f64 / s / 1e9;
        println!(
            "{:<6} {:<13} {:>8.3} {:>8.1} {:>7.0}% {:>9.2}",
            format.name(),
            shape,
            s * 1e3,
            gbps,
            100.0 * gbps / read,
            s * 1e9 * threads as f64 / (rows * cols / 32) as f64,
        );
    }
    println!();
}

/// Every block format (not F16 or BF16): the int8 class's.
fn quantized_formats() -> impl Iterator<Item = QFormat> {
    QFormat::ALL
        .into_iter()
        .filter(|f| !matches!(f, QFormat::F16 | QFormat::BF16))
}

/// Seconds to copy `bytes` once (median): the bandwidth baseline a pass
/// over the weights is compared with.
fn copy_time(bytes: usize, budget: Duration) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let copy = time(budget, || dst.copy_from_slice(black_box(&src)));
    black_box(&dst);
    copy
}

/// `QUANT_BENCH_PATH=avx2` (or `portable`): another path than the best.
fn bench_path() -> Path {
    std::env::var("QUANT_BENCH_PATH").map_or(Path::detect(), |p| {
        *cpu::available_paths()
            .iter()
            .find(|a| a.name() == p)
            .expect("a path this CPU runs: avx512, avx2 or portable")
    })
}

fn wanted(name: &str) -> bool {
    std::env::var("QUANT_BENCH").map_or(true, |f| name.contains(f.as_str()))
}

/// `QUANT_BENCH_ROWS=1,16` (activation row counts) runs only those.
fn rows_wanted(t: usize) -> bool {
    std::env::var("QUANT_BENCH_ROWS")
        .map_or(true, |r| r.split(',').any(|r| r.trim() == t.to_string()))
}

/// Every format on the best path (see the module docs).
fn formats() {
    let path = bench_path();
    println!(
        "every format, {} path, {} threads (rayon); ms per call (median), GB/s of weight bytes",
        path.name(),
        rayon::current_num_threads()
    );
    println!(
        "{:<6} {:<13} {:>8} {:>8} {:>7} {:>8} {:>8} {:>7} {:>8} {:>7} {:>8} {:>7}",
        "format",
        "shape",
        "MB",
        "copy ms",
        "copy GB/s",
        "x1 ms",
        "x1 GB/s",
        "x1/copy",
        "x16 ms",
        "x16 GB/s",
        "x512 ms",
        "GMAC/s"
    );
    let budget = Duration::from_millis(300);
    for (rows, cols) in [(576, 1536), (2048, 8192)] {
        for format in QFormat::ALL {
            let shape = format!("[{rows}x{cols}]");
            if !wanted(&format!("{} {shape}", format.name())) {
                continue;
            }
            let w = matrix(format, rows, cols, 7);
            let bytes = w.byte_len() as f64;
            let copy = copy_time(w.byte_len(), budget);
            let ms: Vec<f64> = [1usize, 16, 512]
                .iter()
                .map(|&t| {
                    if !rows_wanted(t) {
                        return f64::NAN;
                    }
                    let x: Vec<f32> = (0..t * cols)
                        .map(|i| ((i % 97) as f32 - 48.0) / 31.0)
                        .collect();
                    let mut out = vec![0.0f32; t * rows];
                    time(budget, || matmul_with(path, &w, &x, t, black_box(&mut out)))
                })
                .collect();
            println!(
                "{:<6} {:<13} {:>8.2} {:>8.3} {:>7.1} {:>8.3} {:>8.1} {:>7.2} {:>8.3} {:>7.1} {:>8.2} {:>7.1}",
                format.name(),
                shape,
                bytes / 1e6,
                copy * 1e3,
                bytes / copy / 1e9,
                ms[0] * 1e3,
                bytes / ms[0] / 1e9,
                ms[0] / copy,
                ms[1] * 1e3,
                bytes / ms[1] / 1e9,
                ms[2] * 1e3,
                (512 * rows * cols) as f64 / ms[2] / 1e9,
            );
        }
    }
    println!();
}

/// Every path on SmolLM2-135M's shapes (see the module docs).
fn paths() {
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
        if !wanted(name) {
            continue;
        }
        let w = matrix(format, rows, cols, 7);
        // Baseline: copy the weight bytes once (what a pass must read).
        let copy = copy_time(w.byte_len(), budget);
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
