//! kvmesh's CUDA device layer: what the engine's CUDA backend runs on.
//!
//! - [`device`]: `--device cpu|cuda[:N]`, parsed and printed.
//! - [`toolkit`]: where libcuda, libnvrtc and libcublas come from. All three
//!   are opened at run time (cudarc's dynamic loading), so nothing here needs
//!   CUDA to build, and a CPU process never touches them.
//! - [`source`]: the kernels, CUDA C in `src/kernels/`, embedded in the
//!   binary and compiled by NVRTC when a process first asks for a device.
//! - [`compile`]: NVRTC, the PTX-or-CUBIN choice by the driver's and NVRTC's
//!   versions and the device's architecture, the compiler's resource report
//!   (registers, spills), and the on-disk cache of compiled modules.
//! - [`table`]: the host side of the device page checks: block-table
//!   entries `(generation << 32) | page`, and the violation records the
//!   kernels fill, decoded into typed errors.
//! - [`gpu`]: a device opened for use (context, stream, modules, cuBLAS),
//!   typed launches of every kernel ([`ops`]), and the device KV pool
//!   ([`pool`]) that mirrors the host pool's generations and watermarks.
//!
//! # Invariants the kernels keep (see `kernels/attention.cu`, `kernels/kv.cu`)
//! - Attention reads a page only after checking that the sequence's block
//!   table names it with the generation the page has on the device, and
//!   that the layer's watermark covers every slot read (I1, I2 of
//!   `design/kv-safety.md`). A failure is recorded per sequence, and that
//!   sequence's output is zeros from then on; the host turns the record into
//!   the same `GuardViolation` the CPU pool would have raised.
//! - The KV write checks the same entries before writing, refuses a write
//!   that would leave a gap above the watermark, and raises the watermark
//!   only to the end of what it wrote.
//! - Page generations and watermarks on the device change only through the
//!   host pool's events (allocation, release, eviction), applied on the
//!   compute stream before the next kernel that could read the page.

pub mod compile;
pub mod device;
pub mod error;
pub mod gpu;
pub mod ops;
pub mod pool;
pub mod source;
pub mod table;
pub mod toolkit;

/// The cudarc this crate is built on (device buffers in its callers' types).
pub use cudarc;
pub use device::DeviceSpec;
pub use error::{CudaError, Result};
