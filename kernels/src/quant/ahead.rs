//! The next task's weight rows, brought into L2 a few cache lines per
//! step of the current panel's multiply: every panel kernel (both
//! numerics classes, AVX2 and AVX-512) takes the bytes of the panel its
//! thread most likely fills next (a thread's tasks are mostly consecutive
//! panels).
//!
//! A task fills its panel from rows nobody has read yet, so without this
//! the fill waits on memory (16 to 64 rows read side by side), and at 16
//! activation rows that wait is about as long as the multiply itself.
//! Prefetched while the tiles run (compute-bound, on operands in L1), the
//! next fill finds its rows in L2: the wait overlaps the multiply instead
//! of following it. A few lines a step, never a burst: all of them at the
//! start of a panel's multiply stalled it as long as the fill had waited
//! (measured in the int8 class: the time moved from the fill to the
//! multiply, the sum unchanged).
//!
//! Measured in the int8 class (`bench-engine --batch 16 --prompt-tokens
//! 32`, AVX-512, alternated with the build without it): one thread,
//! SmolLM2 Q4_1 1.20x the tokens a second (8 pairs, each 1.04-1.25x),
//! Qwen2.5-Coder 0.5B and Gemma 3 270M (Q4_K_M) 1.18x and 1.11x (4 pairs);
//! two threads, SmolLM2 1.13x (6 pairs). Prefill and batch 1 stayed inside
//! the host's noise (a prefill's hundreds of rows pay each fill once; one
//! or two rows take the one-row kernels).

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};

/// `next`'s cache lines, to be asked for over a known number of steps.
pub(super) struct Ahead {
    at: *const u8,
    left: usize,
    per: usize,
}

impl Ahead {
    /// `next`'s cache lines over `steps` steps: the caller calls
    /// [`Self::step`] that many times (once per register tile, or per
    /// sub-block of one), and the last call asks for the last line.
    pub fn new(next: &[u8], steps: usize) -> Self {
        let left = next.len().div_ceil(64);
        Self {
            at: next.as_ptr(),
            left,
            per: left.div_ceil(steps.max(1)),
        }
    }

    /// The next few lines (none when all are asked for).
    #[inline(always)]
    pub fn step(&mut self) {
        let n = self.per.min(self.left);
        for i in 0..n {
            // SAFETY: a hint, inside `next` (it never faults anyway).
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.at.wrapping_add(64 * i).cast()) };
        }
        self.at = self.at.wrapping_add(64 * n);
        self.left -= n;
    }
}

#[cfg(test)]
mod tests {
    use super::Ahead;

    /// Every line of `next` is asked for by the last of `steps` steps,
    /// none twice, none past its end (lengths not whole lines, more lines
    /// than steps and fewer).
    #[test]
    fn ahead_covers_the_next_rows_by_the_last_step() {
        let buf = vec![0u8; 64 * 40];
        for (len, steps) in [(0, 5), (1, 1), (64 * 40, 7), (64 * 40 - 3, 200), (100, 3)] {
            let next = &buf[..len];
            let mut a = Ahead::new(next, steps);
            let mut asked = 0;
            for _ in 0..steps {
                let before = a.left;
                a.step();
                asked += before - a.left;
                assert!(a.at <= next.as_ptr().wrapping_add(len.div_ceil(64) * 64));
            }
            assert_eq!(
                (asked, a.left),
                (len.div_ceil(64), 0),
                "{len} bytes, {steps} steps"
            );
        }
    }
}
