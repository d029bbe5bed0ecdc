//! AVX2 + FMA build of one KV head's attention for a block of queries, in
//! register tiles (head sizes that are a multiple of 32).
//!
//! # Arithmetic (independent of the block, to the bit)
//! - Score of query `i` at position `p`: eight lanes, lane `l` accumulating
//!   `q[l + 8s] * k[l + 8s]` over `s` in order with fused multiply-adds, then
//!   `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, times the scale,
//!   then soft-capped where the shape says (`super::softcap`, scalar).
//! - Softmax per query: `e = exp(s - max)` (one vector polynomial), the sum
//!   over eight lanes in position order then reduced as above; weights
//!   `e * (1 / sum)`. With a sink, `max` is raised to the sink where it is
//!   higher and the reduced sum gains `exp(sink - max)` (the C library's
//!   `expf`, `super::with_sink`) before the reciprocal.
//! - Output element `d` of query `i`: `fma(w_ip, v_p[d], acc)` over the
//!   query's positions in ascending order, from `+0`.
//!
//! K and V rows are f32 or f16 (the pool's [`crate::KvDtype`]); an f16 row
//! is widened eight values at a time (`vcvtph2ps`, exact), so the arithmetic
//! above is the same for both and an f16 pool gives the bits an f32 pool
//! holding the same (f16-representable) values gives. A block with more
//! queries than one tile takes widens its rows once into a per-thread f32
//! copy (up to 1 MiB of it) instead of in every tile (a 16-token block of
//! SmolLM2's 3 queries per KV head is eight AVX-512 tiles):
//! `PATHS_BENCH="attention prefill"`, 4 rounds alternated, f16 went from
//! 1.06-1.19x the f32 pool's time in the same run to 0.76-0.99x (AVX-512).
//!
//! Tiles only group independent results (scores) or interleave independent
//! chains (outputs), so a query computes the same bits alone (a decode step)
//! as in any block of a prompt chunk.
//!
//! # Cost
//! Scores: 3 queries x 4 positions per tile, seven loads per twelve
//! multiply-adds, and one transposing reduction per four scores. Outputs:
//! 3 queries x 32 values per tile, four loads per twelve multiply-adds,
//! accumulators in registers for the whole common range of positions.

use std::arch::x86_64::*;

use super::{window_start, BlockArgs};
use crate::paged::KvValues;
use crate::simd::exp;

/// A KV element type this build loads eight at a time.
pub(super) trait Elem: Copy {
    /// The pool values if they are of this type.
    fn values(v: KvValues<'_>) -> Option<&[Self]>;

    /// Eight values from `p`, as f32.
    ///
    /// # Safety
    /// `p` readable for eight values; AVX2/F16C.
    unsafe fn load8(p: *const Self) -> __m256;

    /// Sixteen values from `p`, as f32 (the AVX-512 build).
    ///
    /// # Safety
    /// `p` readable for sixteen values; AVX-512 F.
    unsafe fn load16(p: *const Self) -> __m512;

    /// Whether a load widens (f16): a block with several tiles then
    /// widens its rows once ([`attend_typed`]).
    const WIDENS: bool;
}

impl Elem for f32 {
    const WIDENS: bool = false;

    #[inline(always)]
    fn values(v: KvValues<'_>) -> Option<&[f32]> {
        match v {
            KvValues::F32(s) => Some(s),
            KvValues::F16(_) => None,
        }
    }

    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: by the caller.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: by the caller.
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Elem for half::f16 {
    const WIDENS: bool = true;

    #[inline(always)]
    fn values(v: KvValues<'_>) -> Option<&[half::f16]> {
        match v {
            KvValues::F16(s) => Some(s),
            KvValues::F32(_) => None,
        }
    }

    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        // SAFETY: by the caller (eight f16 are sixteen bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> __m512 {
        // SAFETY: by the caller (sixteen f16 are 32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// The register tiles of one instruction set: [`attend_typed`] is the
/// same loop over them for AVX2 ([`Avx2Tiles`]) and AVX-512
/// (`tiled512::Avx512Tiles`), which compute the same bits.
pub(super) trait Tiles {
    /// Queries per score tile (at most [`MAX_SQ`]).
    const SQ: usize;
    /// Queries per output tile (at most [`MAX_SQ`]).
    const WQ: usize;

    /// `q.len()` queries (at most `SQ`) against four key rows: the scores
    /// before scaling, rows past `q.len()` unspecified.
    ///
    /// # Safety
    /// Every pointer readable for `hd` values; the build's features.
    unsafe fn scores<E: Elem>(q: &[*const f32], k: &[*const E; 4], hd: usize)
        -> [[f32; 4]; MAX_SQ];

    /// Values `d .. d + 32` of `out.len()` queries' outputs (at most `WQ`),
    /// as [`weighted`].
    ///
    /// # Safety
    /// As [`weighted`]; the build's features.
    unsafe fn weighted<E: Elem>(
        out: &[*mut f32],
        w: &[Vec<f32>],
        off: &[usize],
        d: usize,
        vr: &[*const E],
    );

    /// As [`axpy1`].
    ///
    /// # Safety
    /// As [`axpy1`]; the build's features.
    unsafe fn axpy1<E: Elem>(w: f32, v: *const E, out: *mut f32, hd: usize);

    /// Each score of `body` (whole groups of eight) to `exp(s - max)` in
    /// place, added to `sum` lane by lane in position order (lane `l`:
    /// positions `l, l + 8, ...`), as [`softmax`] sums them.
    ///
    /// # Safety
    /// The build's features.
    unsafe fn exp_sum(body: &mut [f32], max: __m256, sum: __m256) -> __m256;

    /// The `hd` values at `r` as f32 at `dst` (exact).
    ///
    /// # Safety
    /// `r` readable and `dst` writable for `hd` values (a multiple of 32);
    /// the build's features.
    unsafe fn widen<E: Elem>(r: *const E, dst: *mut f32, hd: usize);
}

/// The most queries any build's tile takes.
pub(super) const MAX_SQ: usize = 6;

/// The AVX2 tiles: 3 queries x 4 keys, 3 queries x 32 values.
pub(super) struct Avx2Tiles;

impl Tiles for Avx2Tiles {
    const SQ: usize = 3;
    const WQ: usize = 3;

    #[inline(always)]
    unsafe fn scores<E: Elem>(
        q: &[*const f32],
        k: &[*const E; 4],
        hd: usize,
    ) -> [[f32; 4]; MAX_SQ] {
        // SAFETY: by the caller.
        unsafe {
            match q.len() {
                3 => pad(scores::<3, E>(q, k, hd)),
                2 => pad(scores::<2, E>(q, k, hd)),
                _ => pad(scores::<1, E>(q, k, hd)),
            }
        }
    }

    #[inline(always)]
    unsafe fn weighted<E: Elem>(
        out: &[*mut f32],
        w: &[Vec<f32>],
        off: &[usize],
        d: usize,
        vr: &[*const E],
    ) {
        // SAFETY: by the caller.
        unsafe {
            match out.len() {
                3 => weighted::<3, E>(out, w, off, d, vr),
                2 => weighted::<2, E>(out, w, off, d, vr),
                _ => weighted::<1, E>(out, w, off, d, vr),
            }
        }
    }

    #[inline(always)]
    unsafe fn axpy1<E: Elem>(w: f32, v: *const E, out: *mut f32, hd: usize) {
        // SAFETY: by the caller.
        unsafe { axpy1(w, v, out, hd) }
    }

    #[inline(always)]
    unsafe fn exp_sum(body: &mut [f32], max: __m256, sum: __m256) -> __m256 {
        // SAFETY: by the caller.
        unsafe { exp_sum8(body, max, sum) }
    }

    #[inline(always)]
    unsafe fn widen<E: Elem>(r: *const E, dst: *mut f32, hd: usize) {
        for d in (0..hd).step_by(8) {
            // SAFETY: by the caller.
            unsafe { _mm256_storeu_ps(dst.add(d), E::load8(r.add(d))) };
        }
    }
}

/// Whether this build takes a head of `head_dim` values.
pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(32)
}

/// One KV head's attention for `queries` (vector, position) into `outs`.
///
/// # Safety
/// AVX2, FMA and F16C; `supports(head_dim)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_block(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    let f16 = args
        .1
        .iter()
        .flatten()
        .any(|s| s.k.dtype() == crate::KvDtype::F16);
    // SAFETY: by the caller.
    unsafe {
        if f16 {
            attend_typed::<half::f16, Avx2Tiles>(queries, outs, args)
        } else {
            attend_typed::<f32, Avx2Tiles>(queries, outs, args)
        }
    }
}

/// [`attend_block`] over K/V rows of type `E` in `T`'s tiles (inlined
/// into the build's entry point, which carries its target features).
///
/// # Safety
/// As [`attend_block`], with `T`'s features.
#[inline(always)]
pub(super) unsafe fn attend_typed<E: Elem, T: Tiles>(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    let (shape, pages, page_size, kv_dim, head_off, sinks, _) = args;
    let Some(hd) = queries.first().map(|(q, _)| q.len()) else {
        return;
    };
    assert!(supports(hd) && outs.len() == queries.len());
    for ((q, _), o) in queries.iter().zip(outs.iter()) {
        assert!(q.len() == hd && o.len() == hd, "head sizes");
    }
    let spans: Vec<(usize, usize)> = queries
        .iter()
        .map(|&(_, pos)| (window_start(pos, shape.window), pos))
        .collect();
    let lo = spans.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
    // Each K and V row of the block's range, sliced (and so bounds-checked)
    // once.
    let (mut krows, mut vrows) = (
        Vec::with_capacity(hi + 1 - lo),
        Vec::with_capacity(hi + 1 - lo),
    );
    for p in lo..=hi {
        let Some(s) = pages[p / page_size].as_ref() else {
            unreachable!("page inside the window was not fetched")
        };
        let (Some(k), Some(v)) = (E::values(s.k), E::values(s.v)) else {
            unreachable!("every page of a pool has the pool's dtype")
        };
        let at = (p % page_size) * kv_dim + head_off;
        krows.push(k[at..][..hd].as_ptr());
        vrows.push(v[at..][..hd].as_ptr());
    }
    // An f16 pool's rows widened once for the block when several tiles
    // read them (each tile would widen every row again) and the copy stays
    // in L2: exact, so the same bits. Taken out of the thread's slot, not
    // borrowed in a closure (a closure would not inherit the target
    // features).
    if E::WIDENS && queries.len() > T::SQ && 2 * krows.len() * hd * 4 <= WIDE_BYTES {
        let mut wide = WIDE.take();
        let n = krows.len();
        if wide.len() < 2 * n * hd {
            wide.resize(2 * n * hd, 0.0);
        }
        let base = wide.as_mut_ptr();
        for (i, &r) in krows.iter().chain(&vrows).enumerate() {
            // SAFETY: row r holds hd values; slot i of `wide` too.
            unsafe { T::widen(r, base.add(i * hd), hd) };
        }
        let rows: Vec<*const f32> = wide[..2 * n * hd]
            .chunks_exact(hd)
            .map(<[f32]>::as_ptr)
            .collect();
        let (kw, vw) = rows.split_at(n);
        // SAFETY: by the caller; the rows are `wide`'s, alive meanwhile.
        unsafe { attend_rows::<f32, T>(queries, outs, shape, sinks, &spans, lo, kw, vw) };
        WIDE.set(wide);
        return;
    }
    // SAFETY: by the caller.
    unsafe { attend_rows::<E, T>(queries, outs, shape, sinks, &spans, lo, &krows, &vrows) }
}

/// The most bytes of widened rows a block copies (a thread's copy stays
/// in L2 beside the block's queries; longer ranges widen in the tiles).
const WIDE_BYTES: usize = 1 << 20;

thread_local! {
    /// Each thread's widened K and V rows of a block.
    static WIDE: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The block's scores, softmax and outputs over its K and V rows
/// (`krows[p - lo]`, `vrows[p - lo]`).
///
/// # Safety
/// As [`attend_block`]; every row pointer readable for the head's values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn attend_rows<E: Elem, T: Tiles>(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    shape: &super::AttentionShape,
    sinks: Option<&[f32]>,
    spans: &[(usize, usize)],
    lo: usize,
    krows: &[*const E],
    vrows: &[*const E],
) {
    let hd = queries[0].0.len();
    let row = |p: usize, v: bool| -> *const E {
        if v {
            vrows[p - lo]
        } else {
            krows[p - lo]
        }
    };
    // Positions every query of the block sees (may be empty).
    let common_lo = spans.iter().map(|s| s.0).max().unwrap_or(0);
    let common_hi = spans.iter().map(|s| s.1).min().unwrap_or(0);
    let common = common_lo <= common_hi;

    // Scores, then weights, per query.
    let mut w: Vec<Vec<f32>> = spans.iter().map(|&(a, b)| vec![0.0; b + 1 - a]).collect();
    let qp: Vec<*const f32> = queries.iter().map(|(q, _)| q.as_ptr()).collect();
    let scale = shape.scale;
    // SAFETY (scores): every pointer is a head's `hd` values (asserted or
    // sliced above); positions are inside each query's span.
    unsafe {
        if common {
            let mut i = 0;
            while i < queries.len() {
                let mr = (queries.len() - i).min(T::SQ);
                let mut p = common_lo;
                while p <= common_hi {
                    let keys = [0, 1, 2, 3].map(|j| row((p + j).min(common_hi), false));
                    let live = (common_hi + 1 - p).min(4);
                    let s = T::scores::<E>(&qp[i..i + mr], &keys, hd);
                    // Scaled in f32 and stored four at a time (one
                    // bounds check a row; written one by one with the
                    // scale reloaded each time, this was 18% of a
                    // prompt's attention).
                    for (r, s) in s.iter().take(mr).enumerate() {
                        let (start, _) = spans[i + r];
                        let dst = &mut w[i + r][p - start..][..live];
                        if live == 4 {
                            let v = _mm_mul_ps(_mm_loadu_ps(s.as_ptr()), _mm_set1_ps(scale));
                            _mm_storeu_ps(dst.as_mut_ptr(), v);
                        } else {
                            for (d, v) in dst.iter_mut().zip(s) {
                                *d = v * scale;
                            }
                        }
                    }
                    p += 4;
                }
                i += mr;
            }
        }
        // Each query's own positions outside the common range.
        for (i, &(start, pos)) in spans.iter().enumerate() {
            let (below, above) = if common {
                (start..common_lo, common_hi + 1..pos + 1)
            } else {
                (start..pos + 1, 0..0)
            };
            let own: Vec<usize> = below.chain(above).collect();
            for group in own.chunks(4) {
                let keys = [0, 1, 2, 3].map(|j| row(group[j.min(group.len() - 1)], false));
                let s = scores::<1, E>(&qp[i..], &keys, hd);
                for (&p, v) in group.iter().zip(s[0]) {
                    w[i][p - start] = v * scale;
                }
            }
        }
        for (i, w) in w.iter_mut().enumerate() {
            if shape.softcap.is_some() {
                w.iter_mut()
                    .for_each(|s| *s = super::softcap(*s, shape.softcap));
            }
            softmax::<T>(w, sinks.map(|s| s[i]));
        }
    }

    // Outputs: own positions below the common range, the common range in
    // tiles, then own positions above it; each element's chain ascends.
    for o in outs.iter_mut() {
        o.fill(0.0);
    }
    let op: Vec<*mut f32> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
    // SAFETY (outputs): `op[i]` is query i's `hd` outputs (distinct slices);
    // rows and weights as above.
    unsafe {
        for (i, &(start, pos)) in spans.iter().enumerate() {
            let end = if common { common_lo } else { pos + 1 };
            for p in start..end {
                T::axpy1(w[i][p - start], row(p, true), op[i], hd);
            }
        }
        if !common {
            return;
        }
        let vr = &vrows[common_lo - lo..=common_hi - lo];
        let mut i = 0;
        while i < queries.len() {
            let mr = (queries.len() - i).min(T::WQ);
            let offs: Vec<usize> = spans[i..i + mr].iter().map(|s| common_lo - s.0).collect();
            for d in (0..hd).step_by(32) {
                T::weighted::<E>(&op[i..i + mr], &w[i..], &offs, d, vr);
            }
            i += mr;
        }
        for (i, &(start, pos)) in spans.iter().enumerate() {
            for p in common_hi + 1..=pos {
                T::axpy1(w[i][p - start], row(p, true), op[i], hd);
            }
        }
    }
}

fn pad<const MR: usize>(s: [[f32; 4]; MR]) -> [[f32; 4]; MAX_SQ] {
    let mut out = [[0.0; 4]; MAX_SQ];
    out[..MR].copy_from_slice(&s);
    out
}

/// `MR` queries against four key rows: the scores before scaling.
///
/// # Safety
/// Every pointer readable for `hd` values; AVX2/FMA.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<const MR: usize, E: Elem>(
    q: &[*const f32],
    k: &[*const E; 4],
    hd: usize,
) -> [[f32; 4]; MR] {
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    let mut d = 0;
    while d < hd {
        // SAFETY: d + 8 <= hd.
        unsafe {
            let mut qv = [_mm256_setzero_ps(); MR];
            for (i, v) in qv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(q[i].add(d));
            }
            for j in 0..4 {
                let kv = E::load8(k[j].add(d));
                for i in 0..MR {
                    acc[i][j] = _mm256_fmadd_ps(qv[i], kv, acc[i][j]);
                }
            }
        }
        d += 8;
    }
    let mut out = [[0.0; 4]; MR];
    for i in 0..MR {
        out[i] = reduce4(acc[i]);
    }
    out
}

/// Four eight-lane sums at once, each `((l0 + l1) + (l2 + l3)) + ((l4 +
/// l5) + (l6 + l7))`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn reduce4(a: [__m256; 4]) -> [f32; 4] {
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    // Lanes 0-3 hold (l0+l1)+(l2+l3) of a0..a3; lanes 4-7 (l4+l5)+(l6+l7).
    let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    let mut out = [0.0f32; 4];
    // SAFETY: four floats into a four-float array.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// Scores to softmax weights in place: whole groups of eight in vectors,
/// the last few through a padded buffer (lane `l` always sums the
/// positions `l, l + 8, ...`, so the bits do not depend on the length's
/// remainder); a sink, where given, joins the maximum and the sum.
///
/// # Safety
/// AVX2/FMA and `T`'s features.
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax<T: Tiles>(s: &mut [f32], sink: Option<f32>) {
    let whole = s.len() / 8 * 8;
    let (body, tail) = s.split_at_mut(whole);
    // The maximum is exact in any order.
    let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
    for c in body.chunks_exact(8) {
        // SAFETY (every vector access below): a chunk of eight floats.
        mv = _mm256_max_ps(mv, unsafe { _mm256_loadu_ps(c.as_ptr()) });
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: an eight-float array.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mv) };
    let max = lanes
        .iter()
        .chain(tail.iter())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let (max, sink_term) = super::with_sink(max, sink);
    let mx = _mm256_set1_ps(max);
    // SAFETY: by the caller.
    let mut sum = unsafe { T::exp_sum(body, mx, _mm256_setzero_ps()) };
    if !tail.is_empty() {
        let len = tail.len();
        let mut buf = [max; 8];
        buf[..len].copy_from_slice(tail);
        // Lanes past the end compute exp(0); they are zeroed before the
        // sum.
        // SAFETY: an eight-float buffer.
        let e = exp(_mm256_sub_ps(unsafe { _mm256_loadu_ps(buf.as_ptr()) }, mx));
        // SAFETY: an eight-float buffer.
        unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), e) };
        buf[len..].fill(0.0);
        // SAFETY: an eight-float buffer.
        sum = _mm256_add_ps(sum, unsafe { _mm256_loadu_ps(buf.as_ptr()) });
        tail.copy_from_slice(&buf[..len]);
    }
    let zero = _mm256_setzero_ps();
    let inv = 1.0 / (reduce4([sum, zero, zero, zero])[0] + sink_term);
    let iv = _mm256_set1_ps(inv);
    for c in body.chunks_exact_mut(8) {
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_ps(
                c.as_mut_ptr(),
                _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), iv),
            )
        };
    }
    for v in tail.iter_mut() {
        *v *= inv;
    }
}

/// [`Tiles::exp_sum`] eight scores at a time.
///
/// # Safety
/// AVX2/FMA.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_sum8(body: &mut [f32], max: __m256, mut sum: __m256) -> __m256 {
    for c in body.chunks_exact_mut(8) {
        // SAFETY: a chunk of eight floats.
        unsafe {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), max));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    sum
}

/// `out += w * v` for one query and one value row (`hd` values).
///
/// # Safety
/// Both pointers valid for `hd` values; AVX2/FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy1<E: Elem>(w: f32, v: *const E, out: *mut f32, hd: usize) {
    let wv = _mm256_set1_ps(w);
    let mut d = 0;
    while d < hd {
        // SAFETY: d + 8 <= hd.
        unsafe {
            let o = out.add(d);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(wv, E::load8(v.add(d)), _mm256_loadu_ps(o)),
            );
        }
        d += 8;
    }
}

/// Values `d .. d + 32` of `MR` queries' outputs over the value rows
/// `vr` (query `i`'s weight for `vr[n]` is `w[i][off[i] + n]`),
/// accumulators in registers.
///
/// # Safety
/// Output pointers valid for `d + 32` values, rows for `d + 32`; AVX2/FMA.
#[allow(clippy::needless_range_loop)] // tile loops index several arrays
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted<const MR: usize, E: Elem>(
    out: &[*mut f32],
    w: &[Vec<f32>],
    off: &[usize],
    d: usize,
    vr: &[*const E],
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    let ws: [&[f32]; MR] = std::array::from_fn(|i| &w[i][off[i]..off[i] + vr.len()]);
    // SAFETY: by the caller.
    unsafe {
        for i in 0..MR {
            for j in 0..4 {
                acc[i][j] = _mm256_loadu_ps(out[i].add(d + 8 * j));
            }
        }
        for (n, &v) in vr.iter().enumerate() {
            let v = v.add(d);
            let mut wv = [_mm256_setzero_ps(); MR];
            for i in 0..MR {
                wv[i] = _mm256_set1_ps(*ws[i].get_unchecked(n));
            }
            for j in 0..4 {
                let vj = E::load8(v.add(8 * j));
                for i in 0..MR {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], vj, acc[i][j]);
                }
            }
        }
        for i in 0..MR {
            for j in 0..4 {
                _mm256_storeu_ps(out[i].add(d + 8 * j), acc[i][j]);
            }
        }
    }
}
