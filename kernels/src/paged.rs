//! The checked read interface between attention and the paged KV pool.
//!
//! A sequence's KV lives in fixed-size pages of a shared pool. The sequence
//! keeps a page table: for each logical page (positions
//! `i * page_size .. (i + 1) * page_size`) a [`PageRef`], the physical page
//! and the generation that page had when the sequence was given it. The pool
//! bumps a page's generation on every allocation and every release, so a
//! page table that outlived its reservation names a generation that no longer
//! exists.
//!
//! Attention never indexes pool memory itself. It asks a [`PagedKv`] for each
//! page, and the implementation must check, before returning any data:
//! - I1: the page's current generation equals `PageRef::generation` and the
//!   page is owned by the sequence doing the read;
//! - I2: every requested slot is below the page's written-slot watermark for
//!   that layer.
//!
//! On failure it returns a [`GuardViolation`] (and the pool counts it); the
//! kernel then fails the whole call without reading anything.

use thiserror::Error;

/// One entry of a sequence's page table: a physical page and the generation
/// the sequence was granted it at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// Physical page index in the pool.
    pub page: u32,
    /// Generation of the page when it was granted to the sequence.
    pub generation: u64,
}

/// What one token's KV entry of one layer holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvEntry {
    /// A key and a value, each `n_kv_heads x head_dim` values, stored as
    /// two blocks (multi-head, grouped-query and multi-query attention).
    #[default]
    KeyValue,
    /// One vector per KV head of `head_dim` values that is the key, and
    /// whose leading values are the value (multi-head latent attention,
    /// DeepSeek V2/V3: the compressed latent, then the rope key shared by
    /// every head). One block; nothing is stored twice. How many leading
    /// values the value takes is the model's ([`crate::AttentionShape::v_dim`]).
    Latent,
}

impl KvEntry {
    /// Blocks per layer of a page: 2 (K then V) or 1 (the latent).
    pub fn blocks(self) -> usize {
        match self {
            Self::KeyValue => 2,
            Self::Latent => 1,
        }
    }

    /// The name in logs and errors: `key-value` or `latent`.
    pub fn name(self) -> &'static str {
        match self {
            Self::KeyValue => "key-value",
            Self::Latent => "latent",
        }
    }
}

/// The shape of one page's KV for one layer.
///
/// Within a page, for each layer, K (and, for [`KvEntry::KeyValue`], V
/// after it) is stored slot-major: `[page_size][n_kv_heads][head_dim]`
/// values of the pool's [`KvDtype`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Token slots per page.
    pub page_size: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimension of one head's key (the stored vector).
    pub head_dim: usize,
    /// What an entry holds.
    pub entry: KvEntry,
}

impl KvGeometry {
    /// Values of K (or of V) for one token slot of one layer.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Values of one block (K, or V) of one page and layer.
    pub fn block(&self) -> usize {
        self.page_size * self.kv_dim()
    }

    /// Values of one page and layer: [`KvEntry::blocks`] blocks.
    pub fn layer_values(&self) -> usize {
        self.entry.blocks() * self.block()
    }
}

/// Element type of a KV pool, chosen when the pool is made; every page of
/// a pool has it.
///
/// - `F32`: the values exactly as the model computed them (the exact mode,
///   compared against Hugging Face transformers).
/// - `F16`: IEEE binary16, rounded to nearest even from the model's f32 on
///   write (values beyond the f16 range saturate to +-65504 instead of
///   becoming infinite). Half the memory and half the bytes read per
///   attention step and sent per transfer; what llama.cpp keeps by default
///   and what vLLM keeps for a half-precision model.
///
/// Every read converts to f32 exactly, so attention's arithmetic is f32
/// either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 4 bytes per value.
    #[default]
    F32,
    /// 2 bytes per value.
    F16,
}

impl KvDtype {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }

    /// The name used in flags and configs: `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "float32" => Ok(Self::F32),
            "f16" | "float16" | "half" => Ok(Self::F16),
            other => Err(format!("unknown KV dtype {other:?} (f32 or f16)")),
        }
    }
}

/// f32 to the f16 a pool stores: rounded to nearest even, saturated to the
/// finite range (a NaN stays a NaN).
#[inline]
pub fn f16_from_f32(x: f32) -> half::f16 {
    half::f16::from_f32(x.clamp(-65504.0, 65504.0))
}

/// `src` converted into `dst` as [`f16_from_f32`] does, to the bit; equal
/// lengths. Sixteen values per instruction on the AVX-512 path, eight on
/// the AVX2 one (F16C), the rest one by one ([`crate::cpu::path`]).
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [half::f16]) {
    f32_to_f16_slice_with(crate::cpu::path(), src, dst);
}

/// [`f32_to_f16_slice`] on a chosen path (tests, benchmarks); the same bits on
/// every path.
///
/// # Panics
/// If this CPU lacks `path`, or the lengths differ.
pub fn f32_to_f16_slice_with(path: crate::cpu::Path, src: &[f32], dst: &mut [half::f16]) {
    assert_eq!(src.len(), dst.len(), "f16 conversion lengths");
    assert!(path.available(), "{path} kernels on a CPU without them");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::Path;
        if path == Path::Avx512 {
            // SAFETY: the CPU has the path (asserted).
            done = unsafe { crate::simd512::narrow(src, dst) };
        }
        if path >= Path::Avx2 {
            // SAFETY: as above (AVX-512 implies the AVX2 set).
            done += unsafe { convert::narrow(&src[done..], &mut dst[done..]) };
        }
    }
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = f16_from_f32(*s);
    }
}

/// `src` widened into `dst` (exact); equal lengths. Sixteen values per
/// instruction on the AVX-512 path, eight on the AVX2 one (F16C).
pub fn f16_to_f32_slice(src: &[half::f16], dst: &mut [f32]) {
    f16_to_f32_slice_with(crate::cpu::path(), src, dst);
}

/// [`f16_to_f32_slice`] on a chosen path (tests, benchmarks); the same bits on
/// every path.
///
/// # Panics
/// If this CPU lacks `path`, or the lengths differ.
pub fn f16_to_f32_slice_with(path: crate::cpu::Path, src: &[half::f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16 conversion lengths");
    assert!(path.available(), "{path} kernels on a CPU without them");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use crate::cpu::Path;
        if path == Path::Avx512 {
            // SAFETY: the CPU has the path (asserted).
            done = unsafe { crate::simd512::widen(src, dst) };
        }
        if path >= Path::Avx2 {
            // SAFETY: as above.
            done += unsafe { convert::widen(&src[done..], &mut dst[done..]) };
        }
    }
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = s.to_f32();
    }
}

/// The F16C builds of the slice conversions (the AVX2 path's): whole
/// groups of eight; the caller converts the rest one by one. The AVX-512
/// builds (sixteen at a time) are `simd512::narrow` and `widen`.
#[cfg(target_arch = "x86_64")]
mod convert {
    use std::arch::x86_64::*;

    /// As [`super::f16_from_f32`]: clamped to +-65504 with the value as
    /// the second operand of min and max, so a NaN passes through (they
    /// return the second operand when either is a NaN), then rounded to
    /// nearest even. Returns the values converted.
    ///
    /// # Safety
    /// AVX and F16C; `dst.len() >= src.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow(src: &[f32], dst: &mut [half::f16]) -> usize {
        let n = src.len() / 8 * 8;
        let (hi, lo) = (_mm256_set1_ps(65504.0), _mm256_set1_ps(-65504.0));
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, within both slices.
            unsafe {
                let x = _mm256_loadu_ps(src.as_ptr().add(i));
                let x = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
            }
        }
        n
    }

    /// Exact widening. Returns the values converted.
    ///
    /// # Safety
    /// AVX and F16C; `dst.len() >= src.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen(src: &[half::f16], dst: &mut [f32]) -> usize {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 <= n, within both slices.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        n
    }
}

/// Some K (or V) values of a page, as the pool stores them.
#[derive(Clone, Copy, Debug)]
pub enum KvValues<'a> {
    /// A pool of [`KvDtype::F32`].
    F32(&'a [f32]),
    /// A pool of [`KvDtype::F16`].
    F16(&'a [half::f16]),
}

impl<'a> KvValues<'a> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            Self::F32(_) => KvDtype::F32,
            Self::F16(_) => KvDtype::F16,
        }
    }

    /// The values in `range` (panics outside, like slicing).
    pub fn slice(&self, range: std::ops::Range<usize>) -> KvValues<'a> {
        match self {
            Self::F32(v) => Self::F32(&v[range]),
            Self::F16(v) => Self::F16(&v[range]),
        }
    }

    /// The values of an f32 pool; `None` for another dtype.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self {
            Self::F32(v) => Some(v),
            Self::F16(_) => None,
        }
    }

    /// The values as f32 (exact for both types), in a new vector.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        self.extend_f32(&mut out);
        out
    }

    /// Appends the values to `out` as f32 (exact for both types).
    pub fn extend_f32(&self, out: &mut Vec<f32>) {
        match self {
            Self::F32(v) => out.extend_from_slice(v),
            Self::F16(v) => {
                let at = out.len();
                out.resize(at + v.len(), 0.0);
                f16_to_f32_slice(v, &mut out[at..]);
            }
        }
    }

    /// Bytes held.
    pub fn byte_len(&self) -> usize {
        match self {
            Self::F32(v) => std::mem::size_of_val(*v),
            Self::F16(v) => std::mem::size_of_val(*v),
        }
    }

    /// Asks the CPU to bring the values into its L2 cache ahead of their
    /// reads: one hint per 64-byte line, which never faults and changes no
    /// value (nothing on other architectures).
    pub fn prefetch(&self) {
        let (ptr, len) = match self {
            Self::F32(v) => (v.as_ptr().cast::<u8>(), self.byte_len()),
            Self::F16(v) => (v.as_ptr().cast::<u8>(), self.byte_len()),
        };
        #[cfg(target_arch = "x86_64")]
        for off in (0..len).step_by(64) {
            // SAFETY: a hint for an address inside the slice; SSE is in
            // every x86-64 CPU.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    ptr.add(off).cast(),
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (ptr, len);
    }

    /// Whether any value has the bits of `canary` (the pool's poison
    /// pattern for this type).
    pub fn contains_bits(&self, canary: u32) -> bool {
        match self {
            Self::F32(v) => v.iter().any(|x| x.to_bits() == canary),
            Self::F16(v) => v.iter().any(|x| u32::from(x.to_bits()) == canary),
        }
    }
}

/// The K and V values of the first `n_slots` slots of one page for one layer,
/// each `n_slots * kv_dim` long, slot-major; for a [`KvEntry::Latent`]
/// pool `v` is empty (the values are the leading part of each key).
#[derive(Clone, Copy, Debug)]
pub struct PageSlices<'a> {
    /// Keys, `[n_slots][n_kv_heads][head_dim]`.
    pub k: KvValues<'a>,
    /// Values, `[n_slots][n_kv_heads][head_dim]`; empty for a latent pool.
    pub v: KvValues<'a>,
}

/// A read that would break I1 or I2. The sequence that attempted it fails;
/// no data was read.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum GuardViolation {
    /// The page table names a page the pool does not have.
    #[error("page {page} is out of range: the pool has {n_pages} pages")]
    PageOutOfRange {
        /// Page named by the table.
        page: u32,
        /// Pages in the pool.
        n_pages: u32,
    },
    /// The page was released (and perhaps reallocated) since the sequence
    /// was granted it.
    #[error(
        "stale page table entry: page {page} has generation {actual}, the table says {expected}"
    )]
    StaleGeneration {
        /// Page named by the table.
        page: u32,
        /// Generation recorded in the page table.
        expected: u64,
        /// The page's current generation.
        actual: u64,
    },
    /// The page's generation matches but it belongs to another sequence.
    #[error("page {page} is not owned by this sequence")]
    ForeignPage {
        /// Page named by the table.
        page: u32,
    },
    /// A slot that was never written for this sequence would be read.
    #[error("read of unwritten KV: page {page}, layer {layer}, slots 0..{requested} requested but only {watermark} written")]
    Unwritten {
        /// Page named by the table.
        page: u32,
        /// Layer being read.
        layer: usize,
        /// Slots the read needed.
        requested: usize,
        /// The page's written-slot watermark for that layer.
        watermark: usize,
    },
    /// The read needs more pages than the sequence's page table has.
    #[error("page table too short: position {position} needs logical page {needed}, the table has {len}")]
    TableTooShort {
        /// Highest position attended.
        position: usize,
        /// Logical page index needed.
        needed: usize,
        /// Entries in the table.
        len: usize,
    },
    /// Debug poison mode: the page still held the free-page canary.
    #[error("poison canary read on page {page}, layer {layer}: a read of never-written KV")]
    Poisoned {
        /// Page that held the canary.
        page: u32,
        /// Layer being read.
        layer: usize,
    },
    /// The layer index is outside the pool's layer count.
    #[error("layer {layer} is out of range: the pool has {n_layers} layers")]
    LayerOutOfRange {
        /// Layer requested.
        layer: usize,
        /// Layers in the pool.
        n_layers: usize,
    },
}

impl GuardViolation {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::PageOutOfRange { .. } => "page_out_of_range",
            Self::StaleGeneration { .. } => "stale_generation",
            Self::ForeignPage { .. } => "foreign_page",
            Self::Unwritten { .. } => "unwritten",
            Self::TableTooShort { .. } => "table_too_short",
            Self::Poisoned { .. } => "poisoned",
            Self::LayerOutOfRange { .. } => "layer_out_of_range",
        }
    }
}

/// Checked read access to a sequence's KV pages.
///
/// An implementation is bound to one reader (one sequence); it knows which
/// owner the reader is. Implementations must uphold: `read_page` returns data
/// only after checking I1 (generation and owner of `entry`) and I2
/// (`n_slots` at most the page's watermark for `layer`), and must count every
/// violation it returns.
pub trait PagedKv {
    /// The pool's page shape.
    fn geometry(&self) -> KvGeometry;

    /// The first `n_slots` slots of `entry`'s page at `layer`, after the I1
    /// and I2 checks. Cost: O(1) checks (plus an O(page) canary scan in debug
    /// poison mode).
    fn read_page(
        &self,
        entry: PageRef,
        layer: usize,
        n_slots: usize,
    ) -> Result<PageSlices<'_>, GuardViolation>;

    /// Count a violation that the kernel detected itself (a page table too
    /// short for the positions read), so that every refused read raises the
    /// same alarm as the ones `read_page` refuses.
    fn report(&self, violation: &GuardViolation);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs that exercise every branch of f32 -> f16: halfway cases
    /// (ties to even, both ways), subnormals, the edges of the range,
    /// overflow to the saturation, infinities, NaNs with payloads, zeros.
    fn hard_inputs() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            -(1.0 + 2f32.powi(-11)),
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            1.0e9,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7FA0_0001),
            f32::from_bits(0xFFC1_2345),
            2f32.powi(-24),
            2f32.powi(-25),
            3.0 * 2f32.powi(-26),
            2f32.powi(-14),
            2f32.powi(-14) - 2f32.powi(-25),
            f32::MIN_POSITIVE,
            1.0e-30,
        ];
        let mut s = 0x9E37_79B9u32;
        for _ in 0..4000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            v.push(f32::from_bits(s));
            v.push((s as f32 / u32::MAX as f32 - 0.5) * 300.0);
        }
        v
    }

    #[test]
    fn slice_conversions_equal_the_scalar_ones_to_the_bit() {
        for path in crate::cpu::available_paths() {
            conversions_equal_the_scalar_ones(path);
        }
    }

    /// The AVX-512 build (sixteen at a time, then eight, then one by one).
    #[test]
    fn avx512_conversions_equal_the_scalar_ones_to_the_bit() {
        if crate::cpu::require(crate::cpu::Path::Avx512) {
            conversions_equal_the_scalar_ones(crate::cpu::Path::Avx512);
        }
    }

    fn conversions_equal_the_scalar_ones(path: crate::cpu::Path) {
        let src = hard_inputs();
        // Lengths that leave a tail after the groups of sixteen and eight.
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 24, 25, 31, 47, src.len()] {
            let mut h = vec![half::f16::ZERO; n];
            f32_to_f16_slice_with(path, &src[..n], &mut h);
            for (x, y) in src[..n].iter().zip(&h) {
                let want = f16_from_f32(*x);
                assert!(
                    want.to_bits() == y.to_bits(),
                    "{x:e} ({:#x}): {:#x} vs {:#x}",
                    x.to_bits(),
                    y.to_bits(),
                    want.to_bits()
                );
            }
            let mut back = vec![0.0f32; n];
            f16_to_f32_slice_with(path, &h, &mut back);
            for (h, b) in h.iter().zip(&back) {
                let want = h.to_f32();
                assert_eq!(want.to_bits(), b.to_bits());
            }
        }
        // Saturation, not infinity, in both.
        let mut h = vec![half::f16::ZERO; 16];
        f32_to_f16_slice_with(path, &[1.0e9; 16], &mut h);
        assert!(h.iter().all(|h| h.to_f32() == 65504.0));
    }
}
