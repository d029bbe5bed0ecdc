//! kvmesh compute kernels.
//!
//! # Layout
//! - [`paged`]: the read side of the paged KV cache as the kernels see it:
//!   [`PageRef`] (page id + generation), the [`PagedKv`] trait through which
//!   every KV read goes, and [`GuardViolation`], the typed failure of a read
//!   that would break invariant I1 (ownership) or I2 (initialisation).
//! - [`attention`]: causal grouped-query attention over a sequence's page
//!   table. It obtains every page through [`PagedKv::read_page`], which checks
//!   I1 and I2 *before* any byte of the page is touched, so a stale or foreign
//!   page table fails the sequence instead of reading another tenant's KV.
//!   Sliding windows and logit soft-capping are part of its shape.
//! - [`rope`]: rotary position embeddings (rotate-half and interleaved
//!   layouts; plain, linear, Llama-3 and YaRN frequency scaling).
//! - [`norm`] holds RMSNorm; [`activation`] SwiGLU (their AVX-512 builds
//!   in `elementwise512`).
//! - [`huge`]: memory in 2 MiB transparent huge pages for what every step
//!   streams (the quantized weights, the KV pool).
//! - [`roofline`]: the machine's measured memory read bandwidth and FMA
//!   peak per path, for benchmark reports.
//! - [`cpu`]: the crate-wide kernel path ([`cpu::Path`]: AVX-512, AVX2 or
//!   portable) and activation class ([`cpu::Activations`]), detected or
//!   forced once per process ([`cpu::select`], [`cpu::select_activations`])
//!   and read by every kernel; [`cpu::numerics`] names the pair.
//! - [`quant`]: matrix multiplication over GGUF blocks (F16, BF16, the
//!   legacy and the K-quant formats) used as stored, with f32 activations
//!   or, as a second numerics class ([`cpu::Activations`]), 8-bit ones and
//!   integer dot products; AVX-512, AVX2 (and VNNI) chosen at run time, a
//!   portable reference they equal to the bit, every core through rayon.
//!
//! Dense f32 matmuls (the exact mode) go through candle-core in
//! `kvmesh-model`.
//!
//! This crate sits at the bottom of the dependency graph: it knows nothing of
//! pools, reservations or models. The pool in `kvmesh-kvpool` implements
//! [`PagedKv`].

pub mod activation;
pub mod attention;
pub mod cpu;
#[cfg(target_arch = "x86_64")]
mod elementwise512;
pub mod huge;
pub mod norm;
pub mod paged;
pub mod quant;
pub mod roofline;
pub mod rope;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(target_arch = "x86_64")]
mod simd512;
pub mod tasks;
#[cfg(test)]
mod test_rng;

pub use attention::{paged_attention, AttentionShape};
pub use paged::{
    f16_from_f32, f16_to_f32_slice, f32_to_f16_slice, GuardViolation, KvDtype, KvEntry, KvGeometry,
    KvValues, PageRef, PageSlices, PagedKv,
};
