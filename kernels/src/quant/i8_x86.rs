//! What the x86 builds of [`super::i8`] share: the panels' buffers and
//! scales ([`super::i8_x86_256`], [`super::i8_x86_512`]) and the AVX2
//! group quantizer of the activations. The one- and two-row kernel is
//! [`super::i8_x86_row`].

use std::arch::x86_64::*;

use super::i8::{bias, padded};
use super::lines::Lines;
use super::scalar::Head;
use super::x86_blocks::head;
use super::{QFormat, GROUP};

/// A panel's byte and scale buffers sized for rows of `cols` values of
/// `format` and `lanes` weight rows: `u` holds `padded(groups)` groups of
/// `lanes` rows (zeros from the row's last real group on), `s` and `o`
/// `[sub-block][lane]`, all zeros. Returns (real groups, padded
/// sub-blocks).
pub(super) fn shape_panel(
    format: QFormat,
    cols: usize,
    lanes: usize,
    u: &mut Lines<u8>,
    s: &mut Vec<f32>,
    o: &mut Vec<f32>,
) -> (usize, usize) {
    let real = cols / GROUP;
    let subs = padded(cols / format.sub_block());
    u.resize(padded(real) * GROUP * lanes);
    u[real * GROUP * lanes..].fill(0);
    for v in [s, o] {
        v.clear();
        v.resize(subs * lanes, 0.0);
    }
    (real, subs)
}

/// What makes format `F`'s signed quants the panels' unsigned bytes:
/// `(q + add) ^ flip` (a bias, or Q8_0's sign bit flipped: +128).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn unsigned_quants(f: QFormat) -> (__m256i, __m256i) {
    match bias(f) {
        Some(b) => (_mm256_set1_epi8(b as i8), _mm256_setzero_si256()),
        None => (_mm256_setzero_si256(), _mm256_set1_epi8(-128)),
    }
}

/// Each of `live` consecutive rows (`rb` bytes, `cols` values of format
/// `F`, at `w`) writes its blocks' scales, and offsets where the format has
/// them, to its lane `r` of the `[sub-block][lanes]` arrays `s` and `o`.
///
/// # Safety
/// AVX2/FMA/F16C; `w` holds those rows; `s` and `o` hold their sub-blocks
/// for `lanes >= live` lanes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn lane_scales<const F: u8>(
    w: *const u8,
    live: usize,
    cols: usize,
    lanes: usize,
    s: &mut [f32],
    o: &mut [f32],
) {
    let f = const { QFormat::of_code(F) };
    let (bb, bv, per) = (
        f.block_bytes(),
        f.block_values(),
        f.block_values() / f.sub_block(),
    );
    let rb = f.row_bytes(cols);
    let mut h = Head::ZERO;
    for r in 0..live {
        for b in 0..cols / bv {
            // SAFETY: block b of row r is inside `w` (the caller).
            unsafe { head::<F>(w.add(r * rb + b * bb), &mut h) };
            for i in 0..per {
                let at = (b * per + i) * lanes + r;
                s[at] = h.s[i];
                if f.has_offset() {
                    o[at] = h.o[i];
                }
            }
        }
    }
}

/// The next task's weight rows, brought into L2 a few cache lines per
/// step (one sub-block of one tile) of the current panel's multiply.
///
/// A task fills its panel from rows nobody has read yet, so the fill
/// waited on memory (16 or 32 rows read side by side), and at 16
/// activation rows that wait was about as long as the multiply itself.
/// Prefetched while the tiles run (compute-bound, on operands in L1), the
/// next fill finds its rows in L2: the wait overlaps the multiply instead
/// of following it. The panels call [`Ahead::step`] once per sub-block
/// of each tile and size `per` so that the last step takes the last line;
/// a few lines a step, never a burst: all of them at the start of a
/// panel's multiply stalled it as long as the fill had waited (measured:
/// the time moved from the fill to the multiply, the sum unchanged).
///
/// Measured (`bench-engine --batch 16 --prompt-tokens 32`, SmolLM2 Q4_1,
/// AVX-512, one thread, 8 alternated pairs): 1.20x the tokens a second
/// (every pair 1.04-1.25x); two threads 1.13x (6 pairs); prefill and
/// batch 1 inside the host's noise (a prefill's 512 rows pay the fill
/// once per panel; one or two rows take the one-row kernel).
pub(super) struct Ahead {
    at: *const u8,
    left: usize,
    per: usize,
}

impl Ahead {
    /// `next`'s cache lines over `steps` steps.
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

/// One group of 32 activations quantized as `super::i8::quantize_group`
/// does, to the bit, with its halves' quant sums, in AVX2 (the AVX-512
/// build's `super::i8_x86_512::quantize_group` says why each step gives
/// the same bits: NaNs passed over by `vmaxps`'s operand order, separate
/// multiply, add and subtract, a NaN quant 0).
///
/// # Safety
/// AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_group(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> (f32, i32, i32) {
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: 32 values in `x`, 32 bytes in `q`.
    unsafe {
        let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let inverse = match super::i8::inverse_scale(amax, q) {
            Ok(id) => id,
            Err(d) => return (d, 0, 0),
        };
        let (id, round) = (_mm256_set1_ps(inverse), _mm256_set1_ps(ROUND));
        let i: [__m256i; 4] = std::array::from_fn(|k| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[k], id), round), round);
            let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_and_si256(_mm256_cvtps_epi32(r), ordered)
        });
        // In [-127, 127]: the packs do not saturate; they interleave the
        // 128-bit lanes, which the permutation puts back in order.
        let words = [
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        ];
        let bytes = _mm256_packs_epi16(words[0], words[1]);
        let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered);
        let sum = |a: __m256i, b: __m256i| {
            let s = _mm256_add_epi32(a, b);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
            _mm_cvtsi128_si32(s)
        };
        (amax / 127.0, sum(i[0], i[1]), sum(i[2], i[3]))
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
