//! A forward pass with the pool's other threads kept awake: while the pass
//! runs, each other worker of the rayon pool runs a [`spin`] job that takes
//! the pass's parallel work as it appears and otherwise spins, instead of
//! going to sleep between two parallel sections and being woken through a
//! futex for the next one. A pass has ~150 sections a decode step, and the
//! sequential work between them (norms, RoPE, a batch-1 attention) is often
//! longer than rayon's idle rounds.
//!
//! On a virtual machine the wake-up is the costly part: a sleeping worker's
//! vCPU halts, and the hypervisor of a busy host may take milliseconds to
//! run it again (docs/performance.md). llama.cpp's threads spin between
//! operations for the same reason.
//!
//! # Invariants
//! - A spinner returns as soon as the pass's body has returned (or
//!   unwound): [`rayon::scope`] waits for it, so the pass ends with it.
//! - A spinner never runs on a thread that has a pass's body on its stack
//!   (it returns at once there): that body could not go on until the
//!   spinner returned, and two passes could wait on each other's spinner.
//!   So a spinner's thread only runs other jobs to completion, and every
//!   pass goes on.
//!
//! # Cost
//! The spinning threads keep their cores for the whole pass, also while
//! it runs sequential work, but yield them to any other runnable thread
//! between looks for work (`sched_yield`, as rayon's idle rounds do): on
//! a host whose cores several processes share, a spinner does not hold a
//! core another process needs. Between passes they sleep as before.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Pass bodies on this thread's stack.
    static BODIES: Cell<usize> = const { Cell::new(0) };
}

/// Run `body` on one of the pool's threads with every other thread of the
/// pool spinning for its parallel work until it returns.
pub(super) fn pass<R: Send>(body: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let _body = Body::enter();
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|_| spin(&done));
        }
        let _done = Done(&done);
        body()
    })
}

/// Take the pool's work until `done`, spinning when there is none; at once
/// on a thread with a pass's body on its stack (module invariants).
fn spin(done: &AtomicBool) {
    if BODIES.get() > 0 {
        return;
    }
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            // Nothing to take: give the core to any other runnable thread
            // (another process's pass, the node's network threads) before
            // looking again. With none, the call returns at once and the
            // vCPU stays running, which is the point.
            std::thread::yield_now();
        }
    }
}

/// Counts a pass's body on this thread while alive.
struct Body;

impl Body {
    fn enter() -> Body {
        BODIES.set(BODIES.get() + 1);
        Body
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        BODIES.set(BODIES.get() - 1);
    }
}

/// Sets its flag when dropped: the body returned or unwound.
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// A pass's parallel sections run on the spinning threads too, and
    /// the pass returns its body's value.
    #[test]
    fn the_spinners_take_the_passs_work() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool");
        let (sum, threads) = pool.install(|| {
            pass(|| {
                let mut seen = std::collections::HashSet::new();
                let mut sum = 0u64;
                // Many sections, as a decode step has: each a parallel map.
                for round in 0..200u64 {
                    let parts: Vec<(u64, usize)> = (0..64u64)
                        .into_par_iter()
                        .map(|i| {
                            let spin = std::time::Instant::now();
                            while spin.elapsed() < std::time::Duration::from_micros(20) {}
                            (i * round, rayon::current_thread_index().expect("a worker"))
                        })
                        .collect();
                    sum += parts.iter().map(|p| p.0).sum::<u64>();
                    seen.extend(parts.iter().map(|p| p.1));
                }
                (sum, seen.len())
            })
        });
        assert_eq!(
            sum,
            (0..200u64).map(|r| r * (0..64).sum::<u64>()).sum::<u64>()
        );
        assert!(threads > 1, "the sections ran on {threads} thread(s)");
    }

    /// Passes that run at once on the same pool (a prefill and a decode
    /// step of one process), and passes inside passes, all end: no spinner
    /// waits on a body below it on its own stack.
    #[test]
    fn concurrent_and_nested_passes_all_end() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        let total: u64 = pool.install(|| {
            (0..16u64)
                .into_par_iter()
                .map(|i| {
                    pass(|| {
                        let inner: u64 = (0..100u64).into_par_iter().map(|j| j + i).sum();
                        inner + pass(|| (0..10u64).into_par_iter().sum::<u64>())
                    })
                })
                .sum()
        });
        let want: u64 = (0..16u64)
            .map(|i| (0..100u64).map(|j| j + i).sum::<u64>() + 45)
            .sum();
        assert_eq!(total, want);
    }

    /// A spinner that lands on a thread with a pass's body on its stack
    /// (the body waiting in a join may pop it) returns at once: spinning
    /// there until the pass ends would wait on itself.
    #[test]
    fn a_spinner_under_a_body_returns_at_once() {
        let never = AtomicBool::new(false);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        pool.install(|| pass(|| spin(&never)));
        assert!(!never.load(Ordering::Relaxed));
    }

    /// A body that panics still ends the pass (its spinners stop) and the
    /// panic reaches the caller.
    #[test]
    fn a_panicking_body_ends_its_spinners() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool");
        let caught =
            pool.install(|| std::panic::catch_unwind(|| pass(|| panic!("a layer failed"))));
        assert!(caught.is_err());
        // The pool is usable afterwards: no spinner is left running.
        assert_eq!(
            pool.install(|| pass(|| (0..1000u64).into_par_iter().sum::<u64>())),
            499_500
        );
    }
}
