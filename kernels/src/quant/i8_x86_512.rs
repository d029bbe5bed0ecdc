//! AVX-512 VNNI panel kernel of [`super::i8`] for several activation rows:
//! sixteen weight rows' bytes interleaved four at a time, so one
//! `vpdpbusd` multiplies four values of sixteen rows by four broadcast
//! activations, and a group's exact sums come out one per lane, one lane
//! per weight row, with no horizontal adds. The scaling then runs on
//! sixteen outputs at once, and each output keeps its eight sub-block
//! lanes (the module's order) in eight registers: the same operations as
//! the one-row kernel, so the same bits.
//!
//! # Cost
//! Per group of 32 values, [`MR`] activation rows and sixteen weight rows:
//! eight weight loads, `8 * MR` `vpdpbusd` and about five vector
//! operations per activation row, against 32 multiply-adds per weight and
//! row: about 40 multiply-adds per instruction, where the f32 class's
//! AVX-512 tile does 16. Filling a panel (unpacking sixteen rows and
//! interleaving their bytes) is paid once per task and shared by every
//! activation row of the task.

use std::arch::x86_64::*;

use super::i8::{bias, scales_by_lane, Acts, Row};
use super::{QFormat, GROUP};

/// Weight rows per panel (one per lane of a 512-bit register).
pub(super) const NR: usize = 16;

/// Activation rows per register tile: `8 * MR` accumulators.
const MR: usize = 2;

/// Sixteen weight rows ready for [`tile`]: bytes as
/// `[group][four-byte column v][row][4]` (unsigned: Q8_0 biased by 128 here),
/// and scales and offsets as `[sub-block][row]`; zeros past the live rows
/// and the rows' padded ends.
#[derive(Default)]
pub(super) struct Panel {
    u: Vec<u8>,
    s: Vec<f32>,
    o: Vec<f32>,
    groups: usize,
    subs: usize,
}

impl Panel {
    /// Fill from the unpacked rows `rows` (at most [`NR`]; `format`'s
    /// unpacking, shaped for the same width): each group's 16 x 8 four-byte
    /// columns transposed in registers (two 8 x 8 transposes side by side).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub unsafe fn fill(&mut self, format: QFormat, rows: &[Row]) {
        assert!(!rows.is_empty() && rows.len() <= NR);
        let (groups, subs) = (rows[0].u.len() / GROUP, rows[0].s.len());
        assert!(rows
            .iter()
            .all(|r| r.u.len() == groups * GROUP && r.s.len() == subs));
        (self.groups, self.subs) = (groups, subs);
        self.u.resize(groups * GROUP * NR, 0);
        // Q8_0's signed bytes become unsigned: vpdpbusd never saturates.
        let flip = _mm512_set1_epi8(if bias(format).is_none() { -128 } else { 0 });
        let zero = [0u8; GROUP];
        let lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        for g in 0..groups {
            let at = |c: usize| -> *const u8 {
                rows.get(c)
                    .map_or(zero.as_ptr(), |r| r.u[g * GROUP..].as_ptr())
            };
            // SAFETY (all): each pointer is a whole group (a row's or the
            // zeros); the stores are the panel's group `g`.
            unsafe {
                // z[c]: rows c and c + 8 of group g, eight columns each.
                let z: [__m512i; 8] = std::array::from_fn(|c| {
                    let v = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(at(c).cast())),
                        _mm256_loadu_si256(at(c + 8).cast()),
                    );
                    _mm512_xor_si512(v, flip)
                });
                let t: [__m512i; 8] = std::array::from_fn(|i| {
                    let (a, b) = (z[2 * (i / 2)], z[2 * (i / 2) + 1]);
                    if i % 2 == 0 {
                        _mm512_unpacklo_epi32(a, b)
                    } else {
                        _mm512_unpackhi_epi32(a, b)
                    }
                });
                // s[q]: columns (q % 4, q % 4 + 4) of rows 0-3 (q < 4) or
                // 4-7, per 256-bit half.
                let s: [__m512i; 8] = std::array::from_fn(|q| {
                    let base = 4 * (q / 4);
                    let (a, b) = if q % 4 < 2 {
                        (t[base], t[base + 2])
                    } else {
                        (t[base + 1], t[base + 3])
                    };
                    if q % 2 == 0 {
                        _mm512_unpacklo_epi64(a, b)
                    } else {
                        _mm512_unpackhi_epi64(a, b)
                    }
                });
                let dst = self.u.as_mut_ptr().add(g * GROUP * NR);
                for q in 0..4 {
                    let (a, b) = (s[q], s[q + 4]);
                    _mm512_storeu_si512(
                        dst.add(q * NR * 4).cast(),
                        _mm512_permutex2var_epi64(a, lo, b),
                    );
                    _mm512_storeu_si512(
                        dst.add((q + 4) * NR * 4).cast(),
                        _mm512_permutex2var_epi64(a, hi, b),
                    );
                }
            }
        }
        scales_by_lane(rows, NR, &mut self.s, &mut self.o);
    }

    /// Every activation row `t0 .. t0 + nt` against the panel:
    /// `out[t * stride + c]` for `c < live`.
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
    ) {
        let mut t = t0;
        while t < t0 + nt {
            let m = (t0 + nt - t).min(MR);
            // SAFETY: by the caller; rows t .. t + m exist in `acts`.
            unsafe {
                if m == MR {
                    self.tile::<MR>(format, acts, t, live, out.add(t * stride), stride);
                } else {
                    self.tile::<1>(format, acts, t, live, out.add(t * stride), stride);
                }
            }
            t += m;
        }
    }

    /// `M` activation rows from `t` against the panel.
    #[allow(clippy::needless_range_loop)] // tile loops index several arrays
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const M: usize>(
        &self,
        format: QFormat,
        a: &Acts,
        t: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let sub16 = format.sub_block() == 16;
        let offset = format.has_offset();
        let bias = bias(format).map_or(128, i32::from);
        let (n, d, b, xb) = if sub16 {
            (a.n16(), &a.d16, &a.b16, &a.xb16)
        } else {
            (a.n32(), &a.d32, &a.b32, &a.xb32)
        };
        // Sub-blocks held by the panel (the acts may be padded further);
        // those past the row's end are zeros and skipped.
        let n = n.min(self.subs);
        let real = a.cols() / format.sub_block();
        let mut acc = [[_mm512_setzero_ps(); 8]; M];
        let (u, s, o) = (self.u.as_ptr(), self.s.as_ptr(), self.o.as_ptr());
        let xs: [*const i8; M] = std::array::from_fn(|r| {
            // SAFETY: row t + r is inside the acts.
            unsafe { a.q.as_ptr().add((t + r) * a.stride8()) }
        });
        // Values per sub-block in four-byte columns: 8 (32) or 4 (16).
        let cols = if sub16 { 4 } else { 8 };
        // SAFETY (all): the panel holds `n` sub-blocks of every row (padded
        // with zeros), the acts `n` per row and their quants.
        unsafe {
            for m in 0..n / 8 {
                for j in 0..8 {
                    let k = 8 * m + j;
                    if k >= real {
                        continue;
                    }
                    let mut i = [_mm512_setzero_si512(); M];
                    for v in 0..cols {
                        let byte = k * cols * 4 + 4 * v;
                        let w = _mm512_loadu_si512(u.add((byte / 4) * NR * 4).cast());
                        for r in 0..M {
                            let x =
                                _mm512_set1_epi32(xs[r].add(byte).cast::<i32>().read_unaligned());
                            i[r] = _mm512_dpbusd_epi32(i[r], w, x);
                        }
                    }
                    let sk = _mm512_loadu_ps(s.add(k * NR));
                    for r in 0..M {
                        let at = (t + r) * n_stride(a, sub16) + k;
                        let p = if bias > 0 {
                            _mm512_sub_epi32(i[r], _mm512_set1_epi32(bias * b[at]))
                        } else {
                            i[r]
                        };
                        let scale = _mm512_mul_ps(sk, _mm512_set1_ps(d[at]));
                        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r][j]);
                        if offset {
                            acc[r][j] = _mm512_fmadd_ps(
                                _mm512_loadu_ps(o.add(k * NR)),
                                _mm512_set1_ps(xb[at]),
                                acc[r][j],
                            );
                        }
                    }
                }
            }
            let mask: __mmask16 = if live >= NR { !0 } else { (1u16 << live) - 1 };
            for (r, l) in acc.iter().enumerate() {
                let sum = _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                    _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])),
                );
                _mm512_mask_storeu_ps(out.add(r * stride), mask, sum);
            }
        }
    }
}

/// Sub-blocks per activation row in the arrays the format reads.
#[inline(always)]
fn n_stride(a: &Acts, sub16: bool) -> usize {
    if sub16 {
        a.n16()
    } else {
        a.n32()
    }
}
