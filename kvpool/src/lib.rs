//! kvmesh KV pages: the paged pool, reservations, and the checked reader
//! attention goes through. Nothing here knows how pages travel between
//! nodes (`kvmesh-kvwire`, `kvmesh-kvxfer`) or what a model is.
//!
//! # Layout
//! - [`cache`]: the prefix cache: full pages kept after their sequence,
//!   keyed inside a tenant's namespace, leased read-only by the sequences
//!   that reuse them; evicted only at zero leases.
//! - [`config`]: [`PoolConfig`] (shape, validation, byte size) and
//!   [`ScrubMode`], with the costs and the choice of default (I6).
//! - [`pool`]: [`KvPool`]: per-page generation, owner and per-layer
//!   written-slot watermarks; the free list; the one allocation path and the
//!   one release path; the soundness argument for the unsafe storage access.
//! - [`reservation`]: [`Reservation`] (the pages one sequence holds, its
//!   page table, the write path that raises watermarks, release on drop) and
//!   [`OwnerTag`].
//! - [`reader`]: [`SeqKv`], the pool's [`kvmesh_kernels::PagedKv`]: every
//!   page attention reads is checked here first.
//! - [`staging`]: landing a remote transfer in a reservation's pages
//!   without making it readable, the view verification hashes, and
//!   [`Reservation::publish_prompt`], the last step of I4 (called only by
//!   `kvmesh_kvxfer::handshake` after verification).
//! - [`stats`]: [`PoolStats`] and the guard-violation counters (the alarm
//!   metric, by [`kvmesh_kernels::GuardViolation::kind`]).
//! - [`error`]: the pool's error type, [`PoolError`], whose `kind()` is
//!   the metric label.
//! - `storage` (private): the one raw allocation (or caller-provided
//!   [`PoolMemory`], such as a shared-memory mapping) and its layout,
//!   page-major so a page is contiguous; the only place with raw pointers.
//!
//! # Invariants owned here
//! - **I1 Ownership**: [`SeqKv::read_page`](kvmesh_kernels::PagedKv::read_page)
//!   returns a page only if its current generation equals the table entry's
//!   and its owner is the reading reservation; otherwise it fails and counts
//!   the violation. Generations change on every allocation and release.
//! - **I2 Initialisation**: writes raise a per-(page, layer) watermark of
//!   contiguously written slots; reads beyond it fail. Release resets it.
//!   A landed transfer raises none until [`Reservation::publish_prompt`].
//! - **I6 Nothing left behind**: [`ScrubMode`] and the debug poison canary.
//! - **I7 Lifetimes close**: a [`Reservation`] is the only holder of its
//!   pages and releases them exactly once, on drop; with every reservation
//!   dropped, [`KvPool::free_pages`] equals [`KvPool::capacity_pages`].
//!
//! Test hooks (forged page tables, the `step:N=corrupt` fault) exist only
//! with the `testing` feature, which only test builds enable.

#![deny(missing_docs)]

pub mod cache;
pub mod config;
pub mod error;
pub mod observer;
pub mod pool;
pub mod reader;
pub mod reservation;
pub mod staging;
pub mod stats;
mod storage;

#[cfg(test)]
mod tests;

pub use cache::{CacheCounters, CacheIndex, CacheStats, Namespace, PageKey};
pub use config::{ParseScrubModeError, PoolConfig, ScrubMode};
pub use error::PoolError;
pub use kvmesh_kernels::{KvDtype, KvEntry};
pub use observer::{PageEvent, PageFill, PageObserver};
pub use pool::{KvPool, POISON_BITS, POISON_BITS_F16};
pub use reader::SeqKv;
pub use reservation::{OwnerTag, Reservation};
pub use staging::NotHeld;
pub use stats::{PoolStats, GUARD_VIOLATION_KINDS};
pub use storage::PoolMemory;
