//! A parallel section's tasks spread over the pool as its threads come:
//! one worker per thread, worker `w` owning the `w`-th contiguous range of
//! task indices and taking them in order from a counter; a worker done
//! with its range takes the rest of the others' the same way.
//!
//! rayon's split of an indexed range cuts it into a few pieces and runs
//! each piece's items in sequence, so a thread that starts late, or that
//! another process slows, leaves up to a piece to the other's tail, and
//! each split and steal costs a deque round trip. Here a late or slowed
//! thread only takes fewer tasks, and the last to finish waits at most one
//! task. Batch-1 decode runs ~150 sections a token of 5-60 us each: the
//! quantized matmuls take their tasks here (`cargo bench -p
//! kvmesh-kernels --bench sections` compares the two; docs/performance.md).
//!
//! # Invariants
//! - Every index in `0..tasks` runs exactly once, on a pool thread or the
//!   caller; `each` returns after all have returned (or unwinds with a
//!   task's panic once every worker has stopped).
//! - Which thread runs a task, and in what order, depends on timing: a
//!   task's result must depend on its index only (the matmuls' tasks write
//!   disjoint outputs with the same operations wherever they run).
//! - A worker walks its own range front to back, so a thread streams
//!   contiguous weight rows as with one piece of rayon's split (tasks
//!   handed out round-robin made batch-1 decode 0.6x as fast: the rows'
//!   prefetching broke).
//!
//! # Cost
//! One relaxed `fetch_add` a task on a counter alone on its cache lines
//! (shared only while other workers help at the end), and a tree of
//! `rayon::join` with one worker a thread; no allocation beyond the
//! counters.

use std::sync::atomic::{AtomicUsize, Ordering};

/// A range's next task, alone on its cache lines so that its owner's
/// `fetch_add` does not bounce a line between cores until others help.
#[repr(align(128))]
struct Next(AtomicUsize);

/// Run `task(i)` for every `i` in `0..tasks` on the current pool's
/// threads (module doc).
pub fn each(tasks: usize, task: impl Fn(usize) + Sync) {
    let workers = rayon::current_num_threads().min(tasks);
    if workers <= 1 {
        (0..tasks).for_each(task);
        return;
    }
    // Worker w's range: bound(w) .. bound(w + 1).
    let bound = |w: usize| w * tasks / workers;
    let next: Vec<Next> = (0..workers)
        .map(|w| Next(AtomicUsize::new(bound(w))))
        .collect();
    let work = |w: usize| {
        for r in (w..workers).chain(0..w) {
            let end = bound(r + 1);
            loop {
                let i = next[r].0.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                task(i);
            }
        }
    };
    spread(0, workers, &work);
}

/// `work(w)` for every `w` in `first .. first + n`, as a tree of
/// `rayon::join`s.
fn spread(first: usize, n: usize, work: &(impl Fn(usize) + Sync)) {
    if n <= 1 {
        work(first);
    } else {
        let half = n / 2;
        rayon::join(
            || spread(first, half, work),
            || spread(first + half, n - half, work),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every index once, whatever the pool and the task count (fewer
    /// tasks than threads, one, none, not a multiple of the threads).
    #[test]
    fn every_task_runs_once() {
        for threads in [1, 2, 3, 4, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            for tasks in [0, 1, 2, 3, 7, 60, 1000] {
                let runs: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                pool.install(|| {
                    each(tasks, |i| {
                        runs[i].fetch_add(1, Ordering::Relaxed);
                    })
                });
                let counts: Vec<u32> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
                assert!(
                    counts.iter().all(|&c| c == 1),
                    "{threads} threads, {tasks} tasks: runs {counts:?}"
                );
            }
        }
    }

    /// The pool's other threads take tasks (not all on the caller), and a
    /// task's panic reaches the caller.
    #[test]
    fn tasks_spread_and_panics_propagate() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("a pool");
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        pool.install(|| {
            each(64, |_| {
                threads
                    .lock()
                    .expect("not poisoned")
                    .insert(rayon::current_thread_index());
                std::thread::sleep(std::time::Duration::from_millis(2));
            })
        });
        assert!(
            threads.lock().expect("not poisoned").len() > 1,
            "one thread ran every task"
        );
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| {
                each(16, |i| {
                    if i == 9 {
                        panic!("task 9 failed");
                    }
                })
            })
        }));
        assert!(r.is_err(), "the panic was lost");
    }
}
