//! The AVX2 and AVX-VNNI panel kernel of [`super::i8`] for several
//! activation rows: [`super::i8_x86_512`]'s layout and operations on eight
//! weight rows per 256-bit register (one activation row per tile: sixteen
//! registers hold the eight lanes' accumulators and the operands), so the
//! same bits. AVX2 multiplies with `vpmaddubsw` + `vpmaddwd`, which would
//! saturate on Q8_0's bytes biased to unsigned: Q8_0 stays on the one-row
//! kernel there ([`takes`]).

use std::arch::x86_64::*;

use super::i8::{bias, scales_by_lane, Acts, Dot, Row};
use super::{QFormat, GROUP};

/// Weight rows per panel (one per lane).
pub(super) const NR: usize = 8;

/// Whether `dot` runs `format` on this panel.
pub(super) fn takes(dot: Dot, format: QFormat) -> bool {
    match dot {
        Dot::AvxVnni => true,
        Dot::Avx2 => bias(format).is_some(),
        _ => false,
    }
}

/// Eight weight rows: bytes as `[group][four-byte column][row][4]`
/// (unsigned; Q8_0 biased by 128), scales and offsets as `[sub-block][row]`.
#[derive(Default)]
pub(super) struct Panel {
    u: Vec<u8>,
    s: Vec<f32>,
    o: Vec<f32>,
    subs: usize,
}

impl Panel {
    /// Fill from the unpacked rows (at most [`NR`]), each group's 8 x 8
    /// four-byte columns transposed in registers.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn fill(&mut self, format: QFormat, rows: &[Row]) {
        assert!(!rows.is_empty() && rows.len() <= NR);
        let (groups, subs) = (rows[0].u.len() / GROUP, rows[0].s.len());
        assert!(rows
            .iter()
            .all(|r| r.u.len() == groups * GROUP && r.s.len() == subs));
        self.subs = subs;
        self.u.resize(groups * GROUP * NR, 0);
        let flip = _mm256_set1_epi8(if bias(format).is_none() { -128 } else { 0 });
        let zero = [0u8; GROUP];
        for g in 0..groups {
            let at = |c: usize| -> *const u8 {
                rows.get(c)
                    .map_or(zero.as_ptr(), |r| r.u[g * GROUP..].as_ptr())
            };
            // SAFETY (all): each pointer is a whole group (a row's or the
            // zeros); the stores are the panel's group `g`.
            unsafe {
                let z: [__m256i; 8] = std::array::from_fn(|c| {
                    _mm256_xor_si256(_mm256_loadu_si256(at(c).cast()), flip)
                });
                let t: [__m256i; 8] = std::array::from_fn(|i| {
                    let (a, b) = (z[2 * (i / 2)], z[2 * (i / 2) + 1]);
                    if i % 2 == 0 {
                        _mm256_unpacklo_epi32(a, b)
                    } else {
                        _mm256_unpackhi_epi32(a, b)
                    }
                });
                let s: [__m256i; 8] = std::array::from_fn(|q| {
                    let base = 4 * (q / 4);
                    let (a, b) = if q % 4 < 2 {
                        (t[base], t[base + 2])
                    } else {
                        (t[base + 1], t[base + 3])
                    };
                    if q % 2 == 0 {
                        _mm256_unpacklo_epi64(a, b)
                    } else {
                        _mm256_unpackhi_epi64(a, b)
                    }
                });
                let dst = self.u.as_mut_ptr().add(g * GROUP * NR);
                for q in 0..4 {
                    let (a, b) = (s[q], s[q + 4]);
                    _mm256_storeu_si256(
                        dst.add(q * NR * 4).cast(),
                        _mm256_permute2x128_si256::<0x20>(a, b),
                    );
                    _mm256_storeu_si256(
                        dst.add((q + 4) * NR * 4).cast(),
                        _mm256_permute2x128_si256::<0x31>(a, b),
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
    /// `dot`'s features, and [`takes`]; `out` valid for those writes; the
    /// panel filled for `format` at `acts`' width.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        dot: Dot,
        format: QFormat,
        acts: &Acts,
        t0: usize,
        nt: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
    ) {
        debug_assert!(takes(dot, format) && dot.available());
        for t in t0..t0 + nt {
            // SAFETY: by the caller.
            unsafe {
                let at = out.add(t * stride);
                if dot == Dot::AvxVnni {
                    self.row_vnni(format, acts, t, live, at);
                } else {
                    self.row_avx2(format, acts, t, live, at);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,avxvnni")]
    unsafe fn row_vnni(&self, format: QFormat, a: &Acts, t: usize, live: usize, out: *mut f32) {
        // SAFETY: by the caller.
        unsafe { self.row::<true>(format, a, t, live, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_avx2(&self, format: QFormat, a: &Acts, t: usize, live: usize, out: *mut f32) {
        // SAFETY: by the caller.
        unsafe { self.row::<false>(format, a, t, live, out) }
    }

    /// Activation row `t` against the panel (`VNNI`: `vpdpbusd`, else
    /// `vpmaddubsw` + `vpmaddwd`).
    #[allow(clippy::needless_range_loop)] // the lanes index the accumulators
    #[inline(always)]
    unsafe fn row<const VNNI: bool>(
        &self,
        format: QFormat,
        a: &Acts,
        t: usize,
        live: usize,
        out: *mut f32,
    ) {
        let sub16 = format.sub_block() == 16;
        let offset = format.has_offset();
        let bias = bias(format).map_or(128, i32::from);
        let (n, d, b, xb) = if sub16 {
            (a.n16(), &a.d16, &a.b16, &a.xb16)
        } else {
            (a.n32(), &a.d32, &a.b32, &a.xb32)
        };
        let row0 = t * n;
        let n = n.min(self.subs);
        let real = a.cols() / format.sub_block();
        let cols = if sub16 { 4 } else { 8 };
        let (u, s, o) = (self.u.as_ptr(), self.s.as_ptr(), self.o.as_ptr());
        // SAFETY (all): the panel and the acts hold `n` sub-blocks (padded
        // with zeros); AVX2/FMA (and AVX-VNNI when `VNNI`), by the callers.
        unsafe {
            let x = a.q.as_ptr().add(t * a.stride8());
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); 8];
            for m in 0..n / 8 {
                for j in 0..8 {
                    let k = 8 * m + j;
                    if k >= real {
                        continue;
                    }
                    let mut i = _mm256_setzero_si256();
                    for v in 0..cols {
                        let byte = k * cols * 4 + 4 * v;
                        let w = _mm256_loadu_si256(u.add(byte * NR).cast());
                        let xv = _mm256_set1_epi32(x.add(byte).cast::<i32>().read_unaligned());
                        i = if VNNI {
                            _mm256_dpbusd_avx_epi32(i, w, xv)
                        } else {
                            _mm256_add_epi32(
                                i,
                                _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones),
                            )
                        };
                    }
                    let at = row0 + k;
                    let p = if bias > 0 {
                        _mm256_sub_epi32(i, _mm256_set1_epi32(bias * b[at]))
                    } else {
                        i
                    };
                    let scale =
                        _mm256_mul_ps(_mm256_loadu_ps(s.add(k * NR)), _mm256_set1_ps(d[at]));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[j]);
                    if offset {
                        acc[j] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(o.add(k * NR)),
                            _mm256_set1_ps(xb[at]),
                            acc[j],
                        );
                    }
                }
            }
            let l = &acc;
            let sum = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
                _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])),
            );
            if live >= NR {
                _mm256_storeu_ps(out, sum);
            } else {
                let lanes: [f32; NR] = std::mem::transmute(sum);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), out, live);
            }
        }
    }
}
