//! A parallel section's cost on the pool: rayon's split of an index range
//! (`into_par_iter().for_each`) against [`kvmesh_kernels::tasks::each`],
//! which the quantized matmuls use, alternated in one run. Each step runs
//! 150 sections back to back (a batch-1 decode token's count) of 60 tasks
//! (a 576-wide model's projection in 16-row tasks), each task a dot
//! product in L1 sized to take about `us` microseconds. Reported: the
//! median microseconds a section, and each way's time over the section's
//! one-thread time divided by the threads (1.00 would be a free split).
//! A benchmark, not a test: nothing here asserts a time.
//!
//! `cargo bench -p kvmesh-kernels --bench sections` (`RAYON_NUM_THREADS`
//! sets the pool).

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;

const TASKS: usize = 60;
const SECTIONS: usize = 150;

/// One task: `n` multiply-adds over `x` (in L1), as a dependent chain.
fn task(x: &[f32], n: usize) -> f32 {
    let mut acc = 0.0f32;
    for v in x.iter().cycle().take(n) {
        acc = acc.mul_add(0.999, *v);
    }
    acc
}

/// Median seconds of one step of `SECTIONS` sections run by `section`.
fn step_time(steps: usize, mut section: impl FnMut()) -> f64 {
    let mut xs: Vec<f64> = (0..steps)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..SECTIONS {
                section();
            }
            t.elapsed().as_secs_f64()
        })
        .collect();
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    // The steps run on a pool thread, as a model's pass does: a section
    // then starts inside the pool instead of being injected from outside.
    let pool = rayon::ThreadPoolBuilder::new().build().expect("a pool");
    pool.install(table);
}

fn table() {
    let threads = rayon::current_num_threads();
    let x: Vec<f32> = (0..256).map(|i| (i % 7) as f32 * 0.25).collect();
    // Multiply-adds a microsecond on one thread, measured.
    let probe = 1 << 20;
    let t = Instant::now();
    black_box(task(black_box(&x), probe));
    let per_us = probe as f64 / (t.elapsed().as_secs_f64() * 1e6);
    println!("{threads} threads; {TASKS} tasks a section, {SECTIONS} sections a step (median us a section)");
    println!(
        "{:>8} {:>10} {:>8} {:>8} {:>10} {:>8} {:>12}",
        "task us", "1 thread", "rayon", "x ideal", "tasks", "x ideal", "tasks/rayon"
    );
    for us in [0.05, 0.1, 0.3, 1.0] {
        let n = ((us * per_us) as usize).max(1);
        let run = |i: usize| {
            black_box(task(black_box(&x), n + i % 2));
        };
        let alone = step_time(20, || (0..TASKS).for_each(run)) / SECTIONS as f64;
        let ideal = alone / threads as f64;
        let (mut rayon_s, mut each_s) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            rayon_s.push(step_time(20, || (0..TASKS).into_par_iter().for_each(run)));
            each_s.push(step_time(20, || kvmesh_kernels::tasks::each(TASKS, run)));
        }
        rayon_s.sort_by(f64::total_cmp);
        each_s.sort_by(f64::total_cmp);
        let (r, e) = (rayon_s[2] / SECTIONS as f64, each_s[2] / SECTIONS as f64);
        println!(
            "{:>8.2} {:>10.2} {:>8.2} {:>8.2} {:>10.2} {:>8.2} {:>12.2}",
            us,
            alone * 1e6,
            r * 1e6,
            r / ideal,
            e * 1e6,
            e / ideal,
            e / r
        );
    }
}
