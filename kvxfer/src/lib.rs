//! kvmesh KV pages: the paged pool, reservations, and the checked reader
//! attention goes through.
//!
//! # Layout
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
//! - [`stats`]: [`PoolStats`] and the guard-violation counters (the alarm
//!   metric, by [`kvmesh_kernels::GuardViolation::kind`]).
//! - [`error`]: the pool's error type, [`PoolError`], whose `kind()` is
//!   the metric label.
//! - [`wire`]: the versioned wire format of KV transfers: data frames and
//!   the handshake's control messages (grant, transfer done, abort, abort
//!   confirmed, revoke), their byte layouts, 128-bit ids and the write
//!   capability (I8), the checksum and why, typed decode errors, the frame
//!   check against a grant (I5's "stale or unknown frames are refused") and
//!   the reject counters.
//! - [`handshake`]: the decode side's [`handshake::ReservationTable`]:
//!   grants bound to a writer's connection, frames landed without raising
//!   watermarks, verification before live (I4), aborts that wait for the
//!   writer's confirmation, leases, revocation before every release (I5),
//!   one [`handshake::Outcome`] per reservation (I7), and
//!   [`handshake::LiveSequence`], the only way to a verified sequence.
//! - [`transport`]: the [`transport::Landing`] (decode) and
//!   [`transport::WritePath`] (prefill) traits, TCP and shared-memory
//!   implementations, the decode node's listener and the prefill node's
//!   connection with its grant-bound [`transport::client::GrantWriter`].
//! - [`auth`]: mesh-internal authentication: the per-mesh
//!   [`auth::MeshSecret`], the KV transport's per-connection mutual
//!   challenge (Challenge, Hello, Welcome) and the per-call proofs of the
//!   internal gRPC services, with their refusal counters.
//! - [`shm`]: the shared-memory mapping a pool can live in, and the per-grant
//!   write gates (lanes) that make one-sided writes revocable; writer
//!   processes watched through pidfds.
//! - `staging` (private): landing a transfer in a reservation's pages and
//!   the checks verification runs over them.
//! - `protocol_model` (`testing` feature only): the reservation and abort
//!   handshake as a stateright model, checked in `tests/protocol_model.rs`
//!   for I1/I2 (no read of unwritten or foreign slots), I5 (no page reused
//!   while a writer can still reach it), I7 (every reservation ends exactly
//!   once, and ends under fair delivery), with bug variants the checker must
//!   catch. Its module doc lists the rules the implementation must follow.
//! - `storage` (private): the one raw allocation and its layout, page-major
//!   so a page is contiguous; the only place with raw pointers.
//!
//! # Invariants owned here
//! - **I1 Ownership**: [`SeqKv::read_page`](kvmesh_kernels::PagedKv::read_page)
//!   returns a page only if its current generation equals the table entry's
//!   and its owner is the reading reservation; otherwise it fails and counts
//!   the violation. Generations change on every allocation and release.
//! - **I2 Initialisation**: writes raise a per-(page, layer) watermark of
//!   contiguously written slots; reads beyond it fail. Release resets it.
//! - **I6 Nothing left behind**: [`ScrubMode`] and the debug poison canary.
//! - **I7 Lifetimes close**: a [`Reservation`] is the only holder of its
//!   pages and releases them exactly once, on drop; with every reservation
//!   dropped, [`KvPool::free_pages`] equals [`KvPool::capacity_pages`].
//! - **I4 Complete transfer** and **I5 No late writes** at run time:
//!   [`handshake`] and [`transport`], following `protocol_model`'s rules.

#![deny(missing_docs)]

pub mod auth;
pub mod config;
mod counters;
pub mod error;
pub mod fault;
pub mod handshake;
pub mod pool;
#[cfg(feature = "testing")]
pub mod protocol_model;
pub mod reader;
pub mod reservation;
pub mod shm;
mod staging;
pub mod stats;
mod storage;
pub mod transport;
pub mod wire;

#[cfg(test)]
mod tests;

pub use config::{ParseScrubModeError, PoolConfig, ScrubMode};
pub use error::PoolError;
pub use kvmesh_kernels::KvDtype;
pub use pool::{KvPool, POISON_BITS, POISON_BITS_F16};
pub use reader::SeqKv;
pub use reservation::{OwnerTag, Reservation};
pub use stats::{PoolStats, GUARD_VIOLATION_KINDS};
