//! The machine's own ceilings, measured, for benchmark reports: how fast
//! the cores can stream memory ([`read_gbps`]), how many f32
//! multiply-adds they can issue on a kernel path ([`fma_peak_gflops`]),
//! and how many 8-bit multiply-adds an integer dot product can
//! ([`int8_peak_gops`], the 8-bit-activation class's ceiling), and how
//! fast that class's own matrix multiplication runs on operands in cache
//! ([`int8_cached_gops`]: what its arithmetic leaves of that ceiling).
//! A batch-1 decode step is bound by the first (it reads every weight
//! once), a long prefill by the second; `kvmesh bench-engine` reports its
//! rates against both.
//!
//! All run on the rayon pool (every thread `RAYON_NUM_THREADS` gives),
//! take the best of a few runs (a ceiling, not a typical value) and cost
//! about half a second each.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use crate::cpu::Path;
use crate::quant::Dot;

/// The best rate, in billions a second, of `runs` timed calls of `run`,
/// each returning the units of work it did: a ceiling, not a typical value.
fn best_rate(runs: usize, mut run: impl FnMut() -> u64) -> f64 {
    let mut best = 0.0f64;
    for _ in 0..runs {
        let t = Instant::now();
        let done = run();
        best = best.max(done as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// GB/s (10^9 bytes) of reading `bytes` of memory, on every pool thread, each
/// thread summing its share with eight independent 64-bit accumulators (a
/// load per lane, no arithmetic bound). Use a size well beyond the last
/// level cache (256 MiB is). The memory is in huge pages where the OS
/// gives them, as the weights a step streams are ([`crate::huge`]): the
/// limit, not a TLB's.
pub fn read_gbps(bytes: usize) -> f64 {
    let words = (bytes / 8).max(1 << 10);
    let Some(mem) = crate::huge::HugeMem::zeroed(words * 8) else {
        return 0.0;
    };
    // SAFETY: `mem` holds `words` u64 (2 MiB-aligned, zeroed: valid
    // values) and nothing else refers to it.
    let buf: &mut [u64] = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr().cast(), words) };
    // Touched once before timing: page faults are not bandwidth.
    buf.iter_mut().zip(0u64..).for_each(|(w, i)| *w = i);
    let buf: &[u64] = buf;
    let chunk = words.div_ceil(rayon::current_num_threads().max(1) * 4);
    best_rate(4, || {
        let s: u64 = buf
            .par_chunks(chunk)
            .map(|c| {
                let mut acc = [0u64; 8];
                let mut it = c.chunks_exact(8);
                for v in &mut it {
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a = a.wrapping_add(*x);
                    }
                }
                let tail: u64 = it.remainder().iter().fold(0, |a, x| a.wrapping_add(*x));
                acc.iter().fold(tail, |a, x| a.wrapping_add(*x))
            })
            .reduce(|| 0, u64::wrapping_add);
        black_box(s);
        (words * 8) as u64
    })
}

/// GFLOP/s (a multiply-add counts two) of fused multiply-adds on `path`'s
/// widest f32 vectors, on every pool thread: twelve independent
/// accumulators per thread (enough to cover the FMA latency on current
/// cores), in registers. The peak a matrix multiplication on that path can
/// approach, measured rather than computed from a clock that turbo and
/// shared hosts make unknowable.
///
/// # Panics
/// If this CPU does not run `path`.
pub fn fma_peak_gflops(path: Path) -> f64 {
    assert!(path.available(), "this CPU does not run the {path} path");
    // About 0.1 s a run at 3 GHz on AVX2: long enough that starting the
    // threads does not count.
    const ITERS: usize = 40_000_000;
    // Exactly one loop on each pool thread (a parallel iterator may run
    // two items on one thread while the other sleeps).
    best_rate(3, || {
        rayon::broadcast(|_| fma_loop(path, ITERS)).iter().sum()
    })
}

/// GOP/s (an 8-bit multiply-add counts two) of `dot`'s integer dot
/// product at the width the 8-bit-activation kernels use it (AVX-512 VNNI
/// `vpdpbusd` on 512-bit vectors, AVX-VNNI on 256-bit, AVX2
/// `vpmaddubsw` + `vpmaddwd` + `vpaddd`, each chain's accumulator its
/// next unsigned operand so nothing is loop-invariant), twelve
/// independent accumulators per pool thread, in registers: what an int8
/// matrix multiplication can approach, measured as [`fma_peak_gflops`] is.
///
/// # Panics
/// If this CPU does not have `dot`.
pub fn int8_peak_gops(dot: Dot) -> f64 {
    assert!(dot.available(), "this CPU does not have {}", dot.name());
    const ITERS: usize = 20_000_000;
    best_rate(3, || {
        rayon::broadcast(|_| dot_loop(dot, ITERS)).iter().sum()
    })
}

/// GOP/s (an 8-bit multiply-add counts two) of the 8-bit-activation
/// class's own matrix multiplication ([`crate::quant::matmul_int8_with`]
/// with `dot`) where memory is not the bound: a Q4_1 matrix of 1024 rows
/// per pool thread by 576 columns (SmolLM2's width; about 370 KB a
/// thread) against a prompt's 512 activation rows (300 KB quantized),
/// which fit in L2 (the outputs, 2 MB a thread, are written once). The
/// activations' quantization and the panels' fill count, as in a
/// prefill. This is the ceiling a prefill's projections can approach in
/// this class: below [`int8_peak_gops`], because every 32 activations
/// carry their own scale, which each tile applies in f32 beside its
/// integer products (docs/performance.md).
///
/// # Panics
/// If this CPU does not have `dot`.
pub fn int8_cached_gops(dot: Dot) -> f64 {
    use crate::quant::{matmul_int8_with, QFormat, QMatrix};
    assert!(dot.available(), "this CPU does not have {}", dot.name());
    const COLS: usize = 576;
    const ROWS: usize = 512;
    let n = 1024 * rayon::current_num_threads().max(1);
    // Q4_1 blocks: an f16 scale 2^-6 and offset -2^-3 (finite, as a
    // model's), then the quants of a fixed pattern.
    let format = QFormat::Q4_1;
    let blocks = n * COLS / format.block_values();
    let mut bytes = Vec::with_capacity(blocks * format.block_bytes());
    for b in 0..blocks {
        bytes.extend_from_slice(&[0x00, 0x24, 0x00, 0xB0]);
        bytes.extend((0..format.block_bytes() - 4).map(|i| (b * 31 + i * 7) as u8));
    }
    let w = QMatrix::from_bytes(format, n, COLS, bytes).expect("a valid Q4_1 matrix");
    let x: Vec<f32> = (0..ROWS * COLS)
        .map(|i| ((i % 97) as f32 - 48.0) / 31.0)
        .collect();
    let mut out = vec![0.0f32; ROWS * n];
    let ops = 2 * n * COLS * ROWS;
    // Calls per timed run: about 0.1 s, sized by a first (warm-up) call.
    let t = Instant::now();
    matmul_int8_with(dot, &w, &x, ROWS, &mut out);
    let calls = (0.1 / t.elapsed().as_secs_f64().max(1e-6)).clamp(1.0, 1e5) as usize;
    best_rate(3, || {
        for _ in 0..calls {
            matmul_int8_with(dot, &w, black_box(&x), ROWS, black_box(&mut out));
        }
        (calls * ops) as u64
    })
}

/// Runs `iters` rounds of twelve independent integer dot-product chains
/// with `dot`; returns the operations done (two per 8-bit multiply-add).
fn dot_loop(dot: Dot, iters: usize) -> u64 {
    match dot {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `int8_peak_gops` checked the CPU has it.
        Dot::Avx512Vnni => unsafe { x86::dot_avx512_vnni(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Dot::AvxVnni => unsafe { x86::dot_avx_vnni(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Dot::Avx2 => unsafe { x86::dot_avx2(iters) },
        _ => {
            let (w, x) = (black_box([3u8; 4]), black_box([5i8; 4]));
            let mut acc = [0i32; 12];
            for _ in 0..iters / 8 {
                for a in &mut acc {
                    for (w, x) in w.iter().zip(&x) {
                        *a = a.wrapping_add(i32::from(*w) * i32::from(*x));
                    }
                }
            }
            black_box(acc);
            (iters / 8 * 12 * 4 * 2) as u64
        }
    }
}

/// Runs `iters` rounds of twelve independent multiply-add chains on
/// `path`; returns the floating-point operations done.
fn fma_loop(path: Path, iters: usize) -> u64 {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `fma_peak_gflops` checked the CPU runs the path.
        Path::Avx2 => unsafe { x86::fma_avx2(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx512 => unsafe { x86::fma_avx512(iters) },
        _ => {
            let (mut acc, m, a) = ([1.0f32; 12], black_box(0.999_999f32), black_box(1e-7f32));
            for _ in 0..iters / 8 {
                for x in &mut acc {
                    *x = x.mul_add(m, a);
                }
            }
            black_box(acc);
            (iters / 8 * 12 * 2) as u64
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma_avx2(iters: usize) -> u64 {
        let (m, a) = (
            _mm256_set1_ps(black_box(0.999_999)),
            _mm256_set1_ps(black_box(1e-7)),
        );
        let mut acc = [_mm256_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm256_fmadd_ps(*x, m, a);
            }
        }
        black_box(acc);
        (iters * 12 * 8 * 2) as u64
    }

    /// # Safety
    /// AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma_avx512(iters: usize) -> u64 {
        let (m, a) = (
            _mm512_set1_ps(black_box(0.999_999)),
            _mm512_set1_ps(black_box(1e-7)),
        );
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in &mut acc {
                *x = _mm512_fmadd_ps(*x, m, a);
            }
        }
        black_box(acc);
        (iters * 12 * 16 * 2) as u64
    }

    /// # Safety
    /// AVX-512 F and VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) unsafe fn dot_avx512_vnni(iters: usize) -> u64 {
        let (w, x) = (
            _mm512_set1_epi8(black_box(3)),
            _mm512_set1_epi8(black_box(5)),
        );
        let mut acc = [_mm512_setzero_si512(); 12];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_dpbusd_epi32(*a, w, x);
            }
        }
        black_box(acc);
        (iters * 12 * 64 * 2) as u64
    }

    /// # Safety
    /// AVX2 and AVX-VNNI.
    #[target_feature(enable = "avx2,avxvnni")]
    pub(super) unsafe fn dot_avx_vnni(iters: usize) -> u64 {
        let (w, x) = (
            _mm256_set1_epi8(black_box(3)),
            _mm256_set1_epi8(black_box(5)),
        );
        let mut acc = [_mm256_setzero_si256(); 12];
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_dpbusd_avx_epi32(*a, w, x);
            }
        }
        black_box(acc);
        (iters * 12 * 32 * 2) as u64
    }

    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot_avx2(iters: usize) -> u64 {
        let (x, ones) = (_mm256_set1_epi8(black_box(5)), _mm256_set1_epi16(1));
        // Each chain's accumulator is its next unsigned operand: with a
        // fixed one, both products were loop-invariant and hoisted out of
        // the loop, which then timed only the additions (a 3.6x "peak" on
        // a Zen 3 host). Twelve chains cover the products' latency.
        let mut acc: [__m256i; 12] =
            std::array::from_fn(|i| _mm256_set1_epi8(black_box(3 + i as i8)));
        for _ in 0..iters {
            for a in &mut acc {
                let pairs = _mm256_maddubs_epi16(*a, x);
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
            }
        }
        black_box(acc);
        (iters * 12 * 32 * 2) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_are_measured_on_every_available_path() {
        // Positive and finite: the loops ran and were timed (no value is
        // asserted: these machines are shared).
        let read = read_gbps(8 << 20);
        assert!(read.is_finite() && read > 0.0, "read {read}");
        for p in crate::cpu::available_paths() {
            let g = fma_peak_gflops(p);
            assert!(g.is_finite() && g > 0.0, "{p}: {g}");
        }
        for d in [Dot::Portable, Dot::Avx2, Dot::AvxVnni, Dot::Avx512Vnni] {
            if d.available() {
                let g = int8_peak_gops(d);
                assert!(g.is_finite() && g > 0.0, "{}: {g}", d.name());
                let c = int8_cached_gops(d);
                assert!(c.is_finite() && c > 0.0, "{}: {c}", d.name());
            }
        }
    }
}
