//! AVX-512 VNNI panel kernel of [`super::i8`] for several activation rows:
//! weight rows' bytes interleaved four at a time, sixteen rows per 512-bit
//! register ("strip"), so one `vpdpbusd` multiplies four values of sixteen
//! rows by four broadcast activations, and a sub-block's exact sums come
//! out one per lane, one lane per weight row, with no horizontal adds. The
//! scaling then runs on sixteen outputs at once: the same operations as
//! the one-row kernel, so the same bits.
//!
//! # Order: lane by lane
//! Output lane `j` (the module's eight f32 lanes) sees only the sub-blocks
//! `k = j, j + 8, j + 16, ...`, in that order. A tile therefore runs lane 0
//! over its sub-blocks, then lane 1, and so on, with one f32 accumulator
//! per (activation row, strip) live at a time instead of eight: the
//! registers this frees hold a tile of [`MR`] activation rows x [`W`]
//! strips, so each weight load feeds `MR` products and each broadcast
//! activation `W`. Each lane's result is parked in a register and the
//! eight are summed in the module's tree at the end. A sub-block's integer
//! sum starts from `-bias * B` (the activation quants' sum times the
//! unsigned bias), so it needs no subtraction after: the same integer.
//!
//! # Cost
//! Per sub-block of 32 values (16: half the products), `MR` activation
//! rows and `W` strips: `8 W` weight loads, `8 MR` broadcasts,
//! `8 MR W` `vpdpbusd`, and per (row, strip) a conversion, a multiply and
//! a fused multiply-add (one more with an offset): about three products in
//! four instructions on the vector ports. Filling a panel (unpacking its
//! rows and interleaving their bytes) is paid once per task, which runs
//! every activation row of the call (or its share of them) against it.
//! The tiles prefetch the next task's rows as they go
//! ([`super::ahead::Ahead`]), so that fill reads L2, not memory (at 16
//! activation rows it had waited about as long as the multiply took).
//! The panel and every activation row start on a cache line
//! ([`super::lines::Lines`]), so no 64-byte load splits two lines: 0.79-0.91x
//! the time at 1536 columns, 0.89-0.97x at 576, even at 8192 (512 rows,
//! one thread, three rounds alternated with the unaligned buffers).
//!
//! # Not AMX
//! AMX-INT8 tiles give a sub-block's sums for sixteen by sixteen outputs
//! in one `tdpbssd`, but the class scales each sub-block's sums in f32, so
//! every product is stored (1 KiB per 8192 multiply-adds) and read back
//! into vectors, and on the Emerald Rapids host the tile instructions and
//! the vector scaling did not overlap (a product and its scaling took the
//! sum of their times). A bit-exact AMX build of this tile took 0.91-1.26x
//! this tile's time (512 rows, one thread, best of 15, alternated), so the
//! class does not use it.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::ahead::Ahead;
use super::i8::{bias, padded, Acts};
use super::i8_x86::{f16_head, lane_scales, real_subs, shape_panel, unsigned_quants};
use super::lines::Lines;
use super::x86_blocks::quants;
use super::{with_format, QFormat, GROUP};

/// Bytes ahead in a weight row that filling a panel prefetches: sixteen
/// rows stream at once, more than the hardware prefetcher follows.
const AHEAD: usize = 1024;

/// Weight rows per strip (one per lane of a 512-bit register).
const NR: usize = 16;

/// Strips per panel.
const W: usize = 2;

/// Weight rows per panel.
pub(super) const ROWS: usize = NR * W;

/// Activation rows per register tile: `MR * W` integer and as many f32
/// accumulators, plus the operands.
const MR: usize = 5;

/// Up to [`ROWS`] weight rows ready for [`Panel::tile`]: bytes as
/// `[group][four-byte column v][strip][row][4]` (unsigned: Q8_0 biased by
/// 128 here), and scales and offsets as `[sub-block][strip][row]`; zeros
/// past the live rows and the rows' padded ends.
#[derive(Default)]
pub(super) struct Panel {
    u: Lines<u8>,
    s: Vec<f32>,
    o: Vec<f32>,
    groups: usize,
    subs: usize,
    /// Strips holding live rows (1 or [`W`]).
    strips: usize,
}

impl Panel {
    /// Fill from `live` (at most [`ROWS`]) consecutive rows of blocks `w`
    /// of `cols` values of `format`: each group of 32 quants is decoded by
    /// the f32 class's block decoding ([`super::x86_blocks`]) straight into
    /// registers, made unsigned, and the strip's sixteen rows transposed
    /// into the interleaved layout (two 8 x 8 transposes of four-byte
    /// columns side by side); each block's scales and offsets go straight
    /// to their lanes. One pass over the weight bytes, nothing in between.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL with AVX2/FMA/F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn fill_blocks(&mut self, format: QFormat, w: &[u8], live: usize, cols: usize) {
        assert!(
            (1..=ROWS).contains(&live)
                && cols.is_multiple_of(format.block_values())
                && w.len() >= live * format.row_bytes(cols)
        );
        // SAFETY: sizes asserted; the caller has the features.
        with_format!(format, F => unsafe { self.fill_f::<F>(w, live, cols) })
    }

    /// [`Self::fill_blocks`] for format `F` (sizes checked).
    ///
    /// # Safety
    /// As [`Self::fill_blocks`].
    #[allow(clippy::needless_range_loop)] // index loops: no closures (see below)
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn fill_f<const F: u8>(&mut self, w: &[u8], live: usize, cols: usize) {
        let f = const { QFormat::of_code(F) };
        let (bb, bv) = (f.block_bytes(), f.block_values());
        let rb = f.row_bytes(cols);
        let (real, subs) = shape_panel(f, cols, ROWS, &mut self.u, &mut self.s, &mut self.o);
        self.subs = subs;
        self.strips = if live > NR { W } else { 1 };
        let (add, flip) = unsigned_quants(f);
        self.groups = padded(real);
        let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        let wp = w.as_ptr();
        let base = self.u.as_mut_ptr();
        // No closures below: a closure does not inherit the target
        // features, so the decoding and the shuffles would not inline.
        let zero = _mm256_setzero_si256();
        let mut q = [zero; NR];
        let mut z = [_mm512_setzero_si512(); 8];
        let mut t = z;
        let mut sh = z;
        for strip in 0..self.strips {
            let rows = live.saturating_sub(strip * NR).min(NR);
            for g in 0..real {
                let (b, gi) = (g / (bv / GROUP), g % (bv / GROUP));
                // SAFETY (all): block b of each live row is inside `w`;
                // the stores are strip `strip` of the panel's group g.
                unsafe {
                    for (c, q) in q.iter_mut().enumerate() {
                        *q = if c < rows {
                            let p = wp.add((strip * NR + c) * rb + b * bb);
                            if gi == 0 {
                                // The next blocks of this row (a hint: it
                                // never faults).
                                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                            }
                            _mm256_xor_si256(_mm256_add_epi8(quants::<F>(p, gi), add), flip)
                        } else {
                            zero
                        };
                    }
                    // z[c]: rows c and c + 8 of group g, eight columns each.
                    for c in 0..8 {
                        z[c] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q[c]), q[c + 8]);
                    }
                    for i in 0..8 {
                        let (a, b) = (z[2 * (i / 2)], z[2 * (i / 2) + 1]);
                        t[i] = if i % 2 == 0 {
                            _mm512_unpacklo_epi32(a, b)
                        } else {
                            _mm512_unpackhi_epi32(a, b)
                        };
                    }
                    // sh[k]: columns (k % 4, k % 4 + 4) of rows 0-3 (k < 4)
                    // or 4-7, per 256-bit half.
                    for k in 0..8 {
                        let base = 4 * (k / 4);
                        let (a, b) = if k % 4 < 2 {
                            (t[base], t[base + 2])
                        } else {
                            (t[base + 1], t[base + 3])
                        };
                        sh[k] = if k % 2 == 0 {
                            _mm512_unpacklo_epi64(a, b)
                        } else {
                            _mm512_unpackhi_epi64(a, b)
                        };
                    }
                    for k in 0..4 {
                        let (a, b) = (sh[k], sh[k + 4]);
                        let at = |v: usize| base.add(((g * 8 + v) * W + strip) * NR * 4);
                        _mm512_storeu_si512(at(k).cast(), _mm512_permutex2var_epi64(a, lo, b));
                        _mm512_storeu_si512(at(k + 4).cast(), _mm512_permutex2var_epi64(a, hi, b));
                    }
                }
            }
        }
        // Each live row's scales (and offsets) to their lanes.
        // SAFETY: `w` holds the live rows (asserted by `fill_blocks`).
        unsafe {
            if f16_head(f) && i32::try_from(NR * rb).is_ok() {
                self.head_scales::<F>(wp, live, cols);
            } else {
                lane_scales::<F>(wp, live, cols, ROWS, &mut self.s, &mut self.o);
            }
        }
    }

    /// [`lane_scales`] for a format whose block starts with its f16 scale
    /// (and f16 offset) and is one sub-block: a strip's sixteen rows at a
    /// time, one gather of their blocks' first four bytes each, widened
    /// by the same conversion (`vcvtph2ps`), so the same values. One block
    /// at a time per row, these conversions were about a quarter of
    /// filling a Q4_1 panel.
    ///
    /// # Safety
    /// As [`Self::fill_blocks`], `f16_head(format)`, sixteen rows'
    /// bytes within an `i32` (the gather's offsets); the panel shaped.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn head_scales<const F: u8>(&mut self, w: *const u8, live: usize, cols: usize) {
        let f = const { QFormat::of_code(F) };
        let (bb, rb) = (f.block_bytes(), f.row_bytes(cols));
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        // Row offsets: under sixteen rows' bytes, which fit an i32 (the
        // caller checked), so neither the cast nor the products wrap.
        let rows_at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(rb as i32));
        for strip in 0..live.div_ceil(NR) {
            let rows = (live - strip * NR).min(NR);
            let mask = ((1u32 << rows) - 1) as __mmask16;
            for b in 0..cols / f.block_values() {
                // SAFETY: block b of the strip's live rows is inside `w`
                // (each block holds at least four bytes); lanes past them
                // are not read; the stores are the strip's sixteen lanes
                // of sub-block b.
                unsafe {
                    let base = w.add(strip * NR * rb + b * bb);
                    let head = _mm512_mask_i32gather_epi32::<1>(
                        _mm512_setzero_si512(),
                        mask,
                        rows_at,
                        base.cast(),
                    );
                    let at = (b * W + strip) * NR;
                    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
                    _mm512_storeu_ps(self.s.as_mut_ptr().add(at), d);
                    if f.has_offset() {
                        let m =
                            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(head)));
                        _mm512_storeu_ps(self.o.as_mut_ptr().add(at), m);
                    }
                }
            }
        }
    }

    /// Every activation row `t0 .. t0 + nt` against the panel:
    /// `out[t * stride + c]` for `c < live`, prefetching `next` (the next
    /// task's rows, [`Ahead`]) as the tiles go.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI; `out` valid for those writes; the panel
    /// filled for `format` at `acts`' width.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn run(
        &self,
        format: QFormat,
        acts: &Acts,
        t0: usize,
        nt: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        next: &[u8],
    ) {
        let ahead = &mut Ahead::new(next, nt.div_ceil(MR) * real_subs(format, acts, self.subs));
        let mut t = t0;
        while t < t0 + nt {
            // Tiles as even as they can be (16 rows: four of 4, not three
            // of 5 and a lone row).
            let left = t0 + nt - t;
            let m = left.div_ceil(left.div_ceil(MR));
            let o = out.wrapping_add(t * stride);
            // SAFETY: by the caller; rows t .. t + m exist in `acts`.
            unsafe {
                match (m, self.strips) {
                    (MR, W) => self.tile::<MR, W>(format, acts, t, live, o, stride, ahead),
                    (MR, _) => self.tile::<MR, 1>(format, acts, t, live, o, stride, ahead),
                    (4, W) => self.tile::<4, W>(format, acts, t, live, o, stride, ahead),
                    (4, _) => self.tile::<4, 1>(format, acts, t, live, o, stride, ahead),
                    (3, W) => self.tile::<3, W>(format, acts, t, live, o, stride, ahead),
                    (3, _) => self.tile::<3, 1>(format, acts, t, live, o, stride, ahead),
                    (2, W) => self.tile::<2, W>(format, acts, t, live, o, stride, ahead),
                    (2, _) => self.tile::<2, 1>(format, acts, t, live, o, stride, ahead),
                    (_, W) => self.tile::<1, W>(format, acts, t, live, o, stride, ahead),
                    _ => self.tile::<1, 1>(format, acts, t, live, o, stride, ahead),
                }
            }
            t += m;
        }
    }

    /// `M` activation rows from `t` against the panel's first `S` strips,
    /// lane by lane (see the module docs), a step of `ahead` per sub-block.
    #[allow(clippy::needless_range_loop)] // tile loops index several arrays
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const M: usize, const S: usize>(
        &self,
        format: QFormat,
        a: &Acts,
        t: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        let sub16 = format.sub_block() == 16;
        let offset = format.has_offset();
        let bias = bias(format).map_or(128, i32::from);
        let (n, d, b, xb) = if sub16 {
            (a.n16(), &a.d16, &a.b16, &a.xb16)
        } else {
            (a.n32(), &a.d32, &a.b32, &a.xb32)
        };
        let real = real_subs(format, a, self.subs);
        let (u, s, o) = (self.u.as_ptr(), self.s.as_ptr(), self.o.as_ptr());
        let xs: [*const i8; M] = std::array::from_fn(|r| {
            // SAFETY: row t + r is inside the acts.
            unsafe { a.q.as_ptr().add((t + r) * a.stride8()) }
        });
        let at: [usize; M] = std::array::from_fn(|r| (t + r) * n);
        // Values per sub-block in four-byte columns: 8 (32) or 4 (16).
        let cols = if sub16 { 4 } else { 8 };
        // Every lane is written below (j in 0..8, for every r and p)
        // before the sums read it: left uninitialized, not zeroed (a
        // memset of M x S x 8 vectors per tile was 3% of a prefill).
        let mut lanes = [[[MaybeUninit::<__m512>::uninit(); 8]; S]; M];
        // SAFETY (all): the panel holds `subs >= real` sub-blocks of every
        // strip, the acts `n >= real` per row and their quants.
        unsafe {
            for j in 0..8 {
                let mut acc = [[_mm512_setzero_ps(); S]; M];
                let mut k = j;
                while k < real {
                    let mut i = [[_mm512_setzero_si512(); S]; M];
                    // A format without a bias (Q4_1, Q5_1, the K-quants
                    // with offsets) starts at zero: no multiply and
                    // broadcast per row (a branch the loop always takes
                    // the same way).
                    if bias != 0 {
                        for r in 0..M {
                            let init = _mm512_set1_epi32(-bias * b[at[r] + k]);
                            i[r] = [init; S];
                        }
                    }
                    for v in 0..cols {
                        let byte = k * cols * 4 + 4 * v;
                        let wv: [__m512i; S] = std::array::from_fn(|p| {
                            _mm512_loadu_si512(u.add(((byte / 4) * W + p) * NR * 4).cast())
                        });
                        for r in 0..M {
                            let x =
                                _mm512_set1_epi32(xs[r].add(byte).cast::<i32>().read_unaligned());
                            for p in 0..S {
                                i[r][p] = _mm512_dpbusd_epi32(i[r][p], wv[p], x);
                            }
                        }
                    }
                    let sk: [__m512; S] =
                        std::array::from_fn(|p| _mm512_loadu_ps(s.add((k * W + p) * NR)));
                    for r in 0..M {
                        let dr = _mm512_set1_ps(d[at[r] + k]);
                        for p in 0..S {
                            acc[r][p] = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(i[r][p]),
                                _mm512_mul_ps(sk[p], dr),
                                acc[r][p],
                            );
                        }
                    }
                    if offset {
                        let ok: [__m512; S] =
                            std::array::from_fn(|p| _mm512_loadu_ps(o.add((k * W + p) * NR)));
                        for r in 0..M {
                            let xr = _mm512_set1_ps(xb[at[r] + k]);
                            for p in 0..S {
                                acc[r][p] = _mm512_fmadd_ps(ok[p], xr, acc[r][p]);
                            }
                        }
                    }
                    ahead.step();
                    k += 8;
                }
                for r in 0..M {
                    for p in 0..S {
                        lanes[r][p][j].write(acc[r][p]);
                    }
                }
            }
            for (r, row) in lanes.iter().enumerate() {
                for (p, l) in row.iter().enumerate() {
                    let l = l.map(|v| v.assume_init());
                    let sum = _mm512_add_ps(
                        _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                        _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
                    );
                    let cols = live.saturating_sub(p * NR).min(NR);
                    if cols > 0 {
                        let mask: __mmask16 = if cols == NR { !0 } else { (1u16 << cols) - 1 };
                        _mm512_mask_storeu_ps(out.add(r * stride + p * NR), mask, sum);
                    }
                }
            }
        }
    }
}

/// One group of 32 activations quantized as `super::i8::quantize_group`
/// does, to the bit, with its halves' quant sums: the scale from the
/// largest magnitude (a NaN is passed over, as `f32::max` does: `vmaxps`
/// returns its second operand, the running maximum, when the first is
/// NaN; zeros where `127 / amax` overflows), the quants `(v * id + 1.5 * 2^23) - 1.5 * 2^23` in separate
/// multiply, add and subtract (no fused step, as the scalar code), and a
/// NaN quant 0 (as Rust's `as i8`).
///
/// # Safety
/// AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_group(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> (f32, i32, i32) {
    const ROUND: f32 = 12_582_912.0;
    // SAFETY: 32 values in `x`, 32 bytes in `q`.
    unsafe {
        let v = [
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        ];
        let m = _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_setzero_ps());
        let m = _mm512_max_ps(_mm512_abs_ps(v[1]), m);
        let amax = _mm512_reduce_max_ps(m);
        let inverse = match super::i8::inverse_scale(amax, q) {
            Ok(id) => id,
            Err(d) => return (d, 0, 0),
        };
        let id = _mm512_set1_ps(inverse);
        let round = _mm512_set1_ps(ROUND);
        let mut sums = [0i32; 2];
        for h in 0..2 {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v[h], id), round), round);
            let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
            let i = _mm512_maskz_cvtps_epi32(ordered, r);
            _mm_storeu_si128(q.as_mut_ptr().add(16 * h).cast(), _mm512_cvtepi32_epi8(i));
            sums[h] = _mm512_reduce_add_epi32(i);
        }
        (amax / 127.0, sums[0], sums[1])
    }
}
