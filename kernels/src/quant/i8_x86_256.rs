//! The AVX2 and AVX-VNNI panel kernel of [`super::i8`] for several
//! activation rows: [`super::i8_x86_512`]'s layout and order on eight
//! weight rows per 256-bit register ("strip"), so the same bits. A tile is
//! [`MR`] activation rows x [`W`] strips, taken lane by lane as the
//! AVX-512 kernel does: with sixteen registers, that is what lets each
//! weight load feed two rows and each broadcast two strips. AVX2
//! multiplies with `vpmaddubsw` + `vpmaddwd`, which would saturate on
//! Q8_0's bytes biased to unsigned (a pair up to `2 * 255 * 127`): there
//! a Q8_0 tile takes the one-row kernel's sign trick instead, `|q|`
//! against `x` with `q`'s sign (a pair at most `2 * 128 * 127 < 2^15`), two
//! more instructions per weight load and one per product. Before, Q8_0
//! stayed on the one-row kernel, which at 16 rows read the matrix eight
//! times: every shipped GGUF's output projection is Q8_0.
//! Its tiles prefetch the next task's rows as the AVX-512 tiles do
//! ([`super::ahead::Ahead`]).

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::ahead::Ahead;
use super::i8::{bias, pairs_in_i16, Acts, Dot};
use super::i8_x86::{lane_scales, real_subs, shape_panel, unsigned_quants};
use super::lines::Lines;
use super::x86_blocks::quants;
use super::{with_format, QFormat, GROUP};

/// Bytes ahead in a weight row that filling a panel prefetches.
const AHEAD: usize = 1024;

/// Weight rows per strip (one per lane).
const NR: usize = 8;

/// Strips per panel.
const W: usize = 2;

/// Weight rows per panel.
pub(super) const ROWS: usize = NR * W;

/// Activation rows per register tile.
const MR: usize = 2;

/// Whether `dot` runs on this panel (every format).
pub(super) fn takes(dot: Dot) -> bool {
    matches!(dot, Dot::AvxVnni | Dot::Avx2)
}

/// Up to [`ROWS`] weight rows: bytes as
/// `[group][four-byte column][strip][row][4]` (unsigned; Q8_0 biased by
/// 128), scales and offsets as `[sub-block][strip][row]`.
#[derive(Default)]
pub(super) struct Panel {
    u: Lines<u8>,
    s: Vec<f32>,
    o: Vec<f32>,
    subs: usize,
    /// Strips holding live rows (1 or [`W`]).
    strips: usize,
}

impl Panel {
    /// Fill from `live` (at most [`ROWS`]) consecutive rows of blocks `w`
    /// of `cols` values of `format`, as the AVX-512 panel fills (each group
    /// decoded straight into registers and transposed, 8 x 8 four-byte
    /// columns per strip; scales and offsets straight to their lanes).
    ///
    /// # Safety
    /// AVX2/FMA/F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
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
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fill_f<const F: u8>(&mut self, w: &[u8], live: usize, cols: usize) {
        let f = const { QFormat::of_code(F) };
        let (bb, bv) = (f.block_bytes(), f.block_values());
        let rb = f.row_bytes(cols);
        let (real, subs) = shape_panel(f, cols, ROWS, &mut self.u, &mut self.s, &mut self.o);
        self.subs = subs;
        self.strips = if live > NR { W } else { 1 };
        let (add, flip) = unsigned_quants(f);
        let wp = w.as_ptr();
        let base = self.u.as_mut_ptr();
        // No closures below: a closure does not inherit the target
        // features, so the decoding and the shuffles would not inline.
        let zero = _mm256_setzero_si256();
        let (mut z, mut t, mut sh) = ([zero; 8], [zero; 8], [zero; 8]);
        for strip in 0..self.strips {
            let rows = live.saturating_sub(strip * NR).min(NR);
            for g in 0..real {
                let (b, gi) = (g / (bv / GROUP), g % (bv / GROUP));
                // SAFETY (all): block b of each live row is inside `w`;
                // the stores are strip `strip` of the panel's group g.
                unsafe {
                    for (c, z) in z.iter_mut().enumerate() {
                        *z = if c < rows {
                            let p = wp.add((strip * NR + c) * rb + b * bb);
                            if gi == 0 {
                                // A hint: it never faults.
                                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD).cast());
                            }
                            _mm256_xor_si256(_mm256_add_epi8(quants::<F>(p, gi), add), flip)
                        } else {
                            zero
                        };
                    }
                    for i in 0..8 {
                        let (a, b) = (z[2 * (i / 2)], z[2 * (i / 2) + 1]);
                        t[i] = if i % 2 == 0 {
                            _mm256_unpacklo_epi32(a, b)
                        } else {
                            _mm256_unpackhi_epi32(a, b)
                        };
                    }
                    for k in 0..8 {
                        let base = 4 * (k / 4);
                        let (a, b) = if k % 4 < 2 {
                            (t[base], t[base + 2])
                        } else {
                            (t[base + 1], t[base + 3])
                        };
                        sh[k] = if k % 2 == 0 {
                            _mm256_unpacklo_epi64(a, b)
                        } else {
                            _mm256_unpackhi_epi64(a, b)
                        };
                    }
                    for k in 0..4 {
                        let (a, b) = (sh[k], sh[k + 4]);
                        let at = |v: usize| base.add(((g * 8 + v) * W + strip) * NR * 4);
                        _mm256_storeu_si256(at(k).cast(), _mm256_permute2x128_si256::<0x20>(a, b));
                        _mm256_storeu_si256(
                            at(k + 4).cast(),
                            _mm256_permute2x128_si256::<0x31>(a, b),
                        );
                    }
                }
            }
        }
        // SAFETY: `w` holds the live rows (asserted by `fill_blocks`).
        unsafe { lane_scales::<F>(wp, live, cols, ROWS, &mut self.s, &mut self.o) };
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
        next: &[u8],
    ) {
        debug_assert!(takes(dot) && dot.available());
        let ahead = &mut Ahead::new(next, nt.div_ceil(MR) * real_subs(format, acts, self.subs));
        // SAFETY: by the caller.
        unsafe {
            if dot == Dot::AvxVnni {
                self.run_vnni(format, acts, t0, nt, live, out, stride, ahead);
            } else {
                self.run_avx2(format, acts, t0, nt, live, out, stride, ahead);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,avxvnni")]
    unsafe fn run_vnni(
        &self,
        format: QFormat,
        a: &Acts,
        t0: usize,
        nt: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        // SAFETY: by the caller.
        unsafe { self.tiles::<true, false, 1>(format, a, t0, nt, live, out, stride, ahead) }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(
        &self,
        format: QFormat,
        a: &Acts,
        t0: usize,
        nt: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        // SAFETY: by the caller.
        unsafe {
            if bias(format).is_none() {
                self.tiles::<false, true, 1>(format, a, t0, nt, live, out, stride, ahead)
            } else {
                match columns_in_i16(format) {
                    8 => self.tiles::<false, false, 8>(format, a, t0, nt, live, out, stride, ahead),
                    4 => self.tiles::<false, false, 4>(format, a, t0, nt, live, out, stride, ahead),
                    _ => self.tiles::<false, false, 2>(format, a, t0, nt, live, out, stride, ahead),
                }
            }
        }
    }

    /// Rows `t0 .. t0 + nt` in tiles of [`MR`] (a last lone row alone).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tiles<const VNNI: bool, const SIGNED: bool, const G: usize>(
        &self,
        format: QFormat,
        a: &Acts,
        t0: usize,
        nt: usize,
        live: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        let mut t = t0;
        while t < t0 + nt {
            let m = (t0 + nt - t).min(MR);
            let o = out.wrapping_add(t * stride);
            // SAFETY: by the caller; rows t .. t + m exist in `a`.
            unsafe {
                match (m, self.strips) {
                    (MR, W) => {
                        self.tile::<VNNI, SIGNED, G, MR, W>(format, a, t, live, o, stride, ahead)
                    }
                    (MR, _) => {
                        self.tile::<VNNI, SIGNED, G, MR, 1>(format, a, t, live, o, stride, ahead)
                    }
                    (_, W) => {
                        self.tile::<VNNI, SIGNED, G, 1, W>(format, a, t, live, o, stride, ahead)
                    }
                    _ => self.tile::<VNNI, SIGNED, G, 1, 1>(format, a, t, live, o, stride, ahead),
                }
            }
            t += m;
        }
    }

    /// `M` activation rows from `t` against the first `S` strips, lane by
    /// lane (`VNNI`: `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd`, `G`
    /// columns' pairs added in i16 before each `vpmaddwd`
    /// ([`columns_in_i16`]); `SIGNED`: Q8_0 on AVX2, its bytes made signed
    /// again and multiplied by the sign trick, so its sums start at zero,
    /// not at `-128 * B`).
    #[allow(clippy::needless_range_loop)] // tile loops index several arrays
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn tile<
        const VNNI: bool,
        const SIGNED: bool,
        const G: usize,
        const M: usize,
        const S: usize,
    >(
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
        let cols = if sub16 { 4 } else { 8 };
        let (u, s, o) = (self.u.as_ptr(), self.s.as_ptr(), self.o.as_ptr());
        let at: [usize; M] = std::array::from_fn(|r| (t + r) * n);
        let xs: [*const i8; M] = std::array::from_fn(|r| {
            // SAFETY: row t + r is inside the acts.
            unsafe { a.q.as_ptr().add((t + r) * a.stride8()) }
        });
        // SAFETY (all): the panel holds `subs >= real` sub-blocks of every
        // strip, the acts `n >= real` per row; AVX2/FMA (and AVX-VNNI when
        // `VNNI`), by the callers.
        unsafe {
            // Every lane is written below (j in 0..8, for every r and p)
            // before the sums read it: left uninitialized, not zeroed (a
            // memset of M x S x 8 vectors per tile was 3% of a prefill).
            let mut lanes = [[[MaybeUninit::<__m256>::uninit(); 8]; S]; M];
            let ones = _mm256_set1_epi16(1);
            for j in 0..8 {
                let mut acc = [[_mm256_setzero_ps(); S]; M];
                let mut k = j;
                while k < real {
                    let mut i = [[_mm256_setzero_si256(); S]; M];
                    // Formats without a bias start at zero (as the AVX-512
                    // tile).
                    if bias != 0 && !SIGNED {
                        for r in 0..M {
                            i[r] = [_mm256_set1_epi32(-bias * b[at[r] + k]); S];
                        }
                    }
                    if !VNNI && !SIGNED {
                        // `G` columns' byte products summed in i16 before
                        // `vpmaddwd`, exactly ([`columns_in_i16`]; Q8_0
                        // takes SIGNED): `G + 1` multiply-pipe instructions
                        // per `G` products, not `2 * G`.
                        for v in (0..cols).step_by(G) {
                            let mut h = [[_mm256_setzero_si256(); S]; M];
                            for c in 0..G {
                                let byte = k * cols * 4 + 4 * (v + c);
                                let w = column::<S>(u, byte / 4);
                                for r in 0..M {
                                    let x = broadcast(xs[r], byte);
                                    for p in 0..S {
                                        let pair = _mm256_maddubs_epi16(w[p], x);
                                        h[r][p] = if c == 0 {
                                            pair
                                        } else {
                                            _mm256_add_epi16(h[r][p], pair)
                                        };
                                    }
                                }
                            }
                            for r in 0..M {
                                for p in 0..S {
                                    i[r][p] =
                                        _mm256_add_epi32(i[r][p], _mm256_madd_epi16(h[r][p], ones));
                                }
                            }
                        }
                    } else {
                        for v in 0..cols {
                            let byte = k * cols * 4 + 4 * v;
                            let wv = column::<S>(u, byte / 4);
                            // SIGNED: the quants (the panel holds them biased
                            // by 128) and their magnitudes.
                            let (q, mag): ([__m256i; S], [__m256i; S]) = if SIGNED {
                                let q = wv.map(|v| _mm256_xor_si256(v, _mm256_set1_epi8(-128)));
                                (q, q.map(|v| _mm256_abs_epi8(v)))
                            } else {
                                (wv, wv)
                            };
                            for r in 0..M {
                                let x = broadcast(xs[r], byte);
                                for p in 0..S {
                                    i[r][p] = if VNNI {
                                        _mm256_dpbusd_avx_epi32(i[r][p], wv[p], x)
                                    } else {
                                        let sx = _mm256_sign_epi8(x, q[p]);
                                        _mm256_add_epi32(
                                            i[r][p],
                                            _mm256_madd_epi16(
                                                _mm256_maddubs_epi16(mag[p], sx),
                                                ones,
                                            ),
                                        )
                                    };
                                }
                            }
                        }
                    }
                    let sk: [__m256; S] =
                        std::array::from_fn(|p| _mm256_loadu_ps(s.add((k * W + p) * NR)));
                    for r in 0..M {
                        let dr = _mm256_set1_ps(d[at[r] + k]);
                        for p in 0..S {
                            acc[r][p] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(i[r][p]),
                                _mm256_mul_ps(sk[p], dr),
                                acc[r][p],
                            );
                        }
                    }
                    if offset {
                        let ok: [__m256; S] =
                            std::array::from_fn(|p| _mm256_loadu_ps(o.add((k * W + p) * NR)));
                        for r in 0..M {
                            let xr = _mm256_set1_ps(xb[at[r] + k]);
                            for p in 0..S {
                                acc[r][p] = _mm256_fmadd_ps(ok[p], xr, acc[r][p]);
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
                    let sum = _mm256_add_ps(
                        _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
                        _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])),
                    );
                    let cols = live.saturating_sub(p * NR).min(NR);
                    let at = out.add(r * stride + p * NR);
                    if cols == NR {
                        _mm256_storeu_ps(at, sum);
                    } else if cols > 0 {
                        let v: [f32; NR] = std::mem::transmute(sum);
                        std::ptr::copy_nonoverlapping(v.as_ptr(), at, cols);
                    }
                }
            }
        }
    }
}

/// Columns (four bytes of eight rows) whose `vpmaddubsw` pairs the AVX2
/// tile adds in i16 before one `vpmaddwd`: the most up to a sub-block's
/// columns ([`pairs_in_i16`]).
const fn columns_in_i16(f: QFormat) -> usize {
    pairs_in_i16(f, f.sub_block() / 4)
}

// The tile's least is two columns: every biased format fits them.
const _: () = {
    let mut i = 0;
    while i < QFormat::ALL.len() {
        let f = QFormat::ALL[i];
        assert!(bias(f).is_none() || columns_in_i16(f) >= 2);
        i += 1;
    }
};

/// Four-byte column `c` of the first `S` strips of a panel's bytes `u`
/// (`[group][column][strip][row][4]`).
///
/// # Safety
/// AVX2; the panel holds that column.
#[inline(always)]
unsafe fn column<const S: usize>(u: *const u8, c: usize) -> [__m256i; S] {
    // SAFETY: by the caller.
    std::array::from_fn(|p| unsafe { _mm256_loadu_si256(u.add((c * W + p) * NR * 4).cast()) })
}

/// Activation quants `byte .. byte + 4` of the row at `x`, in every lane.
///
/// # Safety
/// AVX2; the row holds those bytes.
#[inline(always)]
unsafe fn broadcast(x: *const i8, byte: usize) -> __m256i {
    // SAFETY: by the caller.
    unsafe { _mm256_set1_epi32(x.add(byte).cast::<i32>().read_unaligned()) }
}
