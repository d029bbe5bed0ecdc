//! The one-row kernel's groups in pairs ([`super::i8_x86_row`], Q4_0 and
//! Q4_1, every dot product): group `g` and `g + 4` of every eight share
//! one vector of products, `g`'s in the low 128-bit half and `g + 4`'s in
//! the high one, so eight groups' sums come from four vectors and one
//! [`sum4`] instead of eight vectors, two `sum4`s and a cross-half add.
//!
//! A pair is two byte products accumulated in one register: the low
//! nibbles of both blocks' sixteen quant bytes (`W1 = [g 0-15 | g+4 0-15]`),
//! then the high ones (`W2 = [g 16-31 | g+4 16-31]`), against activations
//! laid out the same way once per call ([`interleave`]: [`Acts::pairs`]).
//! A lane then holds twice the products of one group; the integer sums
//! are exact either way (an i32 holds a group's sum; AVX2's i16 lanes
//! hold what [`paired_in`] bounds), so the bits are the unpaired kernel's.
//!
//! # Cost
//! Per chunk of eight groups: nine reduction instructions instead of 21;
//! the decoding as before (a 16-byte load and insert, a shift and two
//! masks a pair, against a broadcast, a variable shift and a mask a
//! group); one copy of the activation quants a call, for calls of fewer
//! than `PANEL_FROM` rows on Q4_0 or Q4_1. Measured (`RAYON_NUM_THREADS=1
//! QUANT_BENCH_TABLE=int8 QUANT_BENCH_ROWS=1 QUANT_BENCH="[576x1536]"
//! QUANT_BENCH_PATH=avx2 QUANT_BENCH_DOT=avx512-vnni` (or `avx2`) `cargo
//! bench -p kvmesh-kernels --bench quant`, a Zen 4, the two builds
//! alternated three times, ms a call): VNNI Q4_0 0.019-0.020 against
//! 0.022, Q4_1 0.023-0.024 against 0.025; AVX2 Q4_0 0.021 against 0.022,
//! Q4_1 0.024 against 0.026. The other formats of 32-value sub-blocks
//! paired (two 128-bit permutes a pair from their decoded groups; Q4_K by
//! inserts) ran as fast as unpaired, so they are not.

use std::arch::x86_64::*;

use super::i8::{max_byte, pairs_in_i16, Acts, Dot, PANEL_FROM};
use super::i8_x86_row::{sum4, Bytes};
use super::{code, QFormat, GROUP};

/// Whether a format's groups are paired (module doc).
pub(super) const fn paired(f: QFormat) -> bool {
    matches!(f, QFormat::Q4_0 | QFormat::Q4_1)
}

/// [`paired`], and where the dot product's pair sums are i16 (`i16`:
/// AVX2's `vpmaddubsw`) only if a lane's sums still fit after `sum4`'s i16
/// levels: a paired lane starts with two pair sums, so it ends with twice
/// [`pairs_in_i16`]'s (Q4_0, Q4_1: `2 * 4 * 2 * 15 * 127 = 30480`).
pub(super) const fn paired_in(f: QFormat, i16: bool) -> bool {
    paired(f) && (!i16 || 2 * pairs_in_i16(f, 4) * 2 * max_byte(f) as usize * 127 < 1 << 15)
}

/// Fills `a.pairs` from its quants where a call of `rows` activation rows
/// runs the one-row kernel (below [`PANEL_FROM`]) with an x86 dot product
/// on a paired format among `formats`; empties it otherwise, so no kernel
/// reads another call's pairs.
pub(super) fn prepare(
    a: &mut Acts,
    dot: Dot,
    mut formats: impl Iterator<Item = QFormat>,
    rows: usize,
) {
    if rows < PANEL_FROM && dot != Dot::Portable && formats.any(paired) {
        a.pairs.resize(a.q.len());
        interleave(&a.q, &mut a.pairs);
    } else {
        a.pairs.resize(0);
    }
}

/// Groups per chunk: the lanes of eight sub-block sums.
const CHUNK: usize = 8;

/// Writes `q`'s quants (rows of whole chunks of eight groups) to `pairs`
/// in the pairs' order: per chunk, for `j` in `0..4`, group
/// `j`'s bytes 0-15, group `j + 4`'s 0-15, group `j`'s 16-31, group
/// `j + 4`'s 16-31.
pub(super) fn interleave(q: &[i8], pairs: &mut [i8]) {
    assert_eq!(q.len(), pairs.len());
    const HALF: usize = GROUP / 2;
    for (src, dst) in q
        .chunks_exact(CHUNK * GROUP)
        .zip(pairs.chunks_exact_mut(CHUNK * GROUP))
    {
        for j in 0..CHUNK / 2 {
            let (a, b) = (&src[j * GROUP..], &src[(j + 4) * GROUP..]);
            let out = &mut dst[j * 2 * GROUP..(j + 1) * 2 * GROUP];
            out[..HALF].copy_from_slice(&a[..HALF]);
            out[HALF..2 * HALF].copy_from_slice(&b[..HALF]);
            out[2 * HALF..3 * HALF].copy_from_slice(&a[HALF..GROUP]);
            out[3 * HALF..].copy_from_slice(&b[HALF..GROUP]);
        }
    }
}

/// One weight row of blocks against `T` activation rows' pairs.
pub(super) struct Pairs<const T: usize> {
    /// The row's blocks.
    p: *const u8,
    /// Each activation row's interleaved quants ([`Acts::pairs`]).
    x: [*const i8; T],
    /// The row's groups (zeros from here on).
    real: usize,
}

/// Whether `a` has pairs for its rows below `end` ([`prepare`]).
pub(super) fn prepared(a: &Acts, end: usize) -> bool {
    a.pairs.len() >= end * a.stride8()
}

impl<const T: usize> Pairs<T> {
    /// The pairs of activation rows `t .. t + T` of `a` against the row
    /// at `p` (nothing read yet: [`Self::chunk`] reads them, where
    /// [`prepared`] for `t + T`).
    pub fn new(p: *const u8, a: &Acts, t: usize) -> Self {
        Pairs {
            p,
            x: std::array::from_fn(|i| a.pairs.as_ptr().wrapping_add((t + i) * a.stride8())),
            real: a.cols() / GROUP,
        }
    }

    /// Chunk `m`'s eight group sums for each activation row, as
    /// `[g0 g1 g2 g3 | g4 g5 g6 g7]` (the unpaired kernel's order after its
    /// cross-half add); groups from `real` on give zeros, not read.
    ///
    /// # Safety
    /// The row at `p` holds `real` groups of `F`, [`paired_in`] for `B`;
    /// the pairs [`prepared`] for the rows; the features of `B`
    /// and AVX2.
    #[inline(always)]
    pub unsafe fn chunk<B: Bytes, const F: u8>(&self, m: usize) -> [__m256i; T] {
        // SAFETY (all): groups below `real` are in the row; the
        // activation rows are whole chunks (the caller).
        unsafe {
            let acc = [
                self.products::<B, F>(m, 0),
                self.products::<B, F>(m, 1),
                self.products::<B, F>(m, 2),
                self.products::<B, F>(m, 3),
            ];
            // A loop, not `array::from_fn`: its closure would not have
            // the caller's target features, and `sum4` would not inline.
            let mut out = [_mm256_setzero_si256(); T];
            for (i, o) in out.iter_mut().enumerate() {
                *o = sum4::<B, F>([acc[0][i], acc[1][i], acc[2][i], acc[3][i]]);
            }
            out
        }
    }

    /// Chunk `m`'s pair `j` (groups `8m + j`, `8m + j + 4`) against each
    /// activation row; zeros past `real`.
    ///
    /// # Safety
    /// As [`Self::chunk`].
    #[inline(always)]
    unsafe fn products<B: Bytes, const F: u8>(&self, m: usize, j: usize) -> [__m256i; T] {
        // SAFETY (all): by the caller.
        unsafe {
            let mut v = [_mm256_setzero_si256(); T];
            let g = CHUNK * m + j;
            if g < self.real {
                let (w1, w2) = if g + 4 < self.real {
                    pair::<F, true>(self.p, g)
                } else {
                    pair::<F, false>(self.p, g)
                };
                for (v, x) in v.iter_mut().zip(self.x) {
                    let x = x.add(m * CHUNK * GROUP + j * 2 * GROUP);
                    let x1 = _mm256_loadu_si256(x.cast());
                    let x2 = _mm256_loadu_si256(x.add(GROUP).cast());
                    *v = B::accumulate(B::pairs(w1, x1), w2, x2);
                }
            }
            v
        }
    }
}

/// Blocks `g` and `g + 4` (`g % 8 < 4`) of the row at `p`, biased as
/// [`Bytes::biased`] gives them, by halves: `(W1, W2)` (module doc);
/// `g + 4`'s bytes zeros unless `BOTH`. A block's sixteen quant bytes
/// hold values 0-15 in their low nibbles and 16-31 in the high ones;
/// biased, the nibble is the byte multiplied (Q4_0's bias undoes its
/// minus 8).
///
/// # Safety
/// Block `g` (and `g + 4` where `BOTH`) in the row; AVX2.
#[inline(always)]
unsafe fn pair<const F: u8, const BOTH: bool>(p: *const u8, g: usize) -> (__m256i, __m256i) {
    debug_assert!(paired(QFormat::of_code(F)));
    let bb = const { QFormat::of_code(F).block_bytes() };
    let at = if F == code::Q4_0 { 2 } else { 4 };
    // SAFETY: the quant bytes are inside the blocks; `g + 4` read only
    // where `BOTH`; AVX2 by the caller.
    unsafe {
        let w = halves::<BOTH>(p.add(g * bb + at), p.wrapping_add((g + 4) * bb + at));
        let low4 = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(w, low4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(w), low4),
        )
    }
}

/// Sixteen bytes at `a` in the low half, at `b` (zeros unless `BOTH`) in
/// the high one.
///
/// # Safety
/// `a` (and `b` where `BOTH`) readable for sixteen bytes; AVX2.
#[inline(always)]
unsafe fn halves<const BOTH: bool>(a: *const u8, b: *const u8) -> __m256i {
    // SAFETY: by the caller.
    unsafe {
        let lo = _mm_loadu_si128(a.cast());
        if BOTH {
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), _mm_loadu_si128(b.cast()))
        } else {
            _mm256_zextsi128_si256(lo)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each chunk's pair `j` holds group `j`'s first half, group `j + 4`'s
    /// first half, then their second halves; rows and chunks stay apart.
    #[test]
    fn interleave_puts_each_pairs_halves_together() {
        // Two rows of two chunks; byte = its group (0-31) * 4 + half.
        let q: Vec<i8> = (0..4 * CHUNK * GROUP)
            .map(|i| ((i / GROUP) * 4 + (i % GROUP) / (GROUP / 2)) as i8)
            .collect();
        let mut pairs = vec![0i8; q.len()];
        interleave(&q, &mut pairs);
        for (c, chunk) in pairs.chunks_exact(CHUNK * GROUP).enumerate() {
            for (j, pair) in chunk.chunks_exact(2 * GROUP).enumerate() {
                let group = |k: usize| (c * CHUNK + k) as i8 * 4;
                let want = [group(j), group(j + 4), group(j) + 1, group(j + 4) + 1];
                for (quarter, w) in pair.chunks_exact(GROUP / 2).zip(want) {
                    assert!(quarter.iter().all(|&b| b == w), "chunk {c} pair {j}");
                }
            }
        }
    }
}
