//! Frame and page checksum candidates, measured in one run: xxh3-64
//! (`xxhash-rust`) and CRC-32C (`crc32c`, SSE4.2 picked at run time).
//!
//! `cargo bench -p kvmesh-kvwire --bench checksum`
//!
//! Sizes are those the wire carries for the default model (SmolLM2-135M: 30
//! layers, 3 KV heads of 64, page_size 16): a whole page is
//! 30 * 2 * 16 * 192 * 4 = 737,280 bytes, one layer of a page 24,576, one
//! slot of one layer (K and V) 1,536; plus control-message sizes. "hot"
//! hashes one buffer over and over (it stays in cache, as a frame the sender
//! has just encoded does); "cold" walks a 256 MiB buffer page by page (the
//! pages come from memory, as when the receiver checks pages landed long
//! ago). Each cell is the fastest of 7 timed runs (the machine is shared:
//! the fastest run is the least disturbed one); the two algorithms
//! alternate within each repetition so drift hits both alike.
//!
//! Prints a table of GB/s (10^9 bytes per second) and the ratio
//! xxh3 / crc32c; above 1 means xxh3 is faster.

use std::hint::black_box;
use std::time::Instant;

use kvmesh_kvwire::checksum;

const PAGE: usize = 30 * 2 * 16 * 3 * 64 * 4;
const LAYER: usize = 2 * 16 * 3 * 64 * 4;
const REPS: usize = 7;
/// Bytes hashed per timed run of a hot cell.
const HOT_BYTES: usize = 256 << 20;
const COLD_BUFFER: usize = 256 << 20;

type Algo = (&'static str, fn(&[u8]) -> u64);

const ALGOS: [Algo; 2] = [
    ("xxh3-64", |b| xxhash_rust::xxh3::xxh3_64(b)),
    ("crc32c", |b| u64::from(crc32c::crc32c(b))),
];

fn filled(len: usize) -> Vec<u8> {
    // xorshift64: incompressible, not all-zero, deterministic.
    let mut x = 0x9E37_79B9_7F4A_7C15_u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Seconds per call.
fn time_hot(f: fn(&[u8]) -> u64, buf: &[u8]) -> f64 {
    let iters = (HOT_BYTES / buf.len()).max(1);
    let t = Instant::now();
    for _ in 0..iters {
        black_box(f(black_box(buf)));
    }
    t.elapsed().as_secs_f64() / iters as f64
}

/// Seconds per call, each call on the next `chunk` of `buf`.
fn time_cold(f: fn(&[u8]) -> u64, buf: &[u8], chunk: usize) -> f64 {
    let t = Instant::now();
    let mut n = 0usize;
    for c in buf.chunks_exact(chunk) {
        black_box(f(black_box(c)));
        n += 1;
    }
    t.elapsed().as_secs_f64() / n.max(1) as f64
}

fn fastest(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-12) / 1e9
}

fn row(label: &str, bytes: usize, mut time: impl FnMut(fn(&[u8]) -> u64) -> f64) {
    let mut runs = [Vec::new(), Vec::new()];
    for rep in 0..REPS {
        // Alternate which algorithm goes first.
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            runs[i].push(time(ALGOS[i].1));
        }
    }
    let [a, b] = runs.map(fastest);
    let (ga, gb) = (gbps(bytes, a), gbps(bytes, b));
    println!(
        "| {label:<26} | {bytes:>9} | {ga:>8.2} | {gb:>8.2} | {:>6.2} | {:>9.1} | {:>9.1} |",
        ga / gb,
        a * 1e9,
        b * 1e9,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too,
    // so keep a quick mode for that.
    let quick = !std::env::args().any(|a| a == "--bench");
    #[cfg(target_arch = "x86_64")]
    println!(
        "cpu: sse4.2 (crc32c, detected at run time) = {}; xxh3 vector path chosen at compile time: {}",
        std::arch::is_x86_feature_detected!("sse4.2"),
        if cfg!(target_feature = "avx512f") {
            "avx512"
        } else if cfg!(target_feature = "avx2") {
            "avx2"
        } else {
            "sse2"
        },
    );
    if quick {
        let buf = filled(LAYER);
        assert_eq!(checksum(&buf), xxhash_rust::xxh3::xxh3_64(&buf));
        println!("quick mode (no --bench): checked the wiring only");
        return;
    }
    println!(
        "| {:<26} | {:>9} | {:>8} | {:>8} | {:>6} | {:>9} | {:>9} |",
        "case", "bytes", "xxh3", "crc32c", "ratio", "xxh3 ns", "crc32c ns"
    );
    println!(
        "|{:-<28}|{:->11}|{:->10}|{:->10}|{:->8}|{:->11}|{:->11}|",
        "", "", "", "", "", "", ""
    );
    let cases = [
        ("hot: Abort (header+body)", 30),
        ("hot: TransferDone, 4 pages", 108),
        ("hot: slot (K+V, 1 layer)", 1_536),
        ("hot: 4 KiB", 4_096),
        ("hot: page, one layer", LAYER),
        ("hot: page, all layers", PAGE),
    ];
    for (label, len) in cases {
        let buf = filled(len);
        row(label, len, |f| time_hot(f, &buf));
    }
    let big = filled(COLD_BUFFER);
    row("cold: page, one layer", LAYER, |f| {
        time_cold(f, &big, LAYER)
    });
    row("cold: page, all layers", PAGE, |f| time_cold(f, &big, PAGE));
}
