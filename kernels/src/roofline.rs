//! The machine's own ceilings, measured, for benchmark reports: how fast
//! the cores can stream memory ([`read_gbps`]) and how many f32
//! multiply-adds they can issue on a kernel path ([`fma_peak_gflops`]).
//! A batch-1 decode step is bound by the first (it reads every weight
//! once), a long prefill by the second; `kvmesh bench-engine` reports its
//! rates against both.
//!
//! Both run on the rayon pool (every thread `RAYON_NUM_THREADS` gives),
//! take the best of a few runs (a ceiling, not a typical value) and cost
//! about half a second each.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

use crate::cpu::Path;

/// GB/s (10^9 bytes) of reading `bytes` of memory, on every pool thread, each
/// thread summing its share with eight independent 64-bit accumulators (a
/// load per lane, no arithmetic bound). Use a size well beyond the last
/// level cache (256 MiB is).
pub fn read_gbps(bytes: usize) -> f64 {
    let words = (bytes / 8).max(1 << 10);
    // Touched once before timing: page faults are not bandwidth.
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(rayon::current_num_threads().max(1) * 4);
    let mut best = 0.0f64;
    for _ in 0..4 {
        let t = Instant::now();
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
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
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
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        // Exactly one loop on each pool thread (a parallel iterator may
        // run two items on one thread while the other sleeps).
        let flops: u64 = rayon::broadcast(|_| fma_loop(path, ITERS)).iter().sum();
        best = best.max(flops as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_are_measured_on_every_available_path() {
        // Positive and finite: the loops ran and were timed (no value is
        // asserted: these machines are shared).
        assert!(read_gbps(8 << 20).is_finite());
        for p in crate::cpu::available_paths() {
            let g = fma_peak_gflops(p);
            assert!(g.is_finite() && g > 0.0, "{p}: {g}");
        }
    }
}
