//! kvmesh KV transfer: how a prompt's pages get from a prefill node into a
//! decode node's pool, safely. The pool itself is `kvmesh-kvpool`, the
//! bytes on the wire `kvmesh-kvwire`, the proofs of the mesh secret
//! `kvmesh-meshauth`, fault plans `kvmesh-faults`; this crate puts them
//! together behind the handshake.
//!
//! # Layout
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
//! - [`shm`]: the shared-memory mapping a pool can live in
//!   ([`shm::shared_pool`]), and the per-grant write gates (lanes) that
//!   make one-sided writes revocable; writer processes watched through
//!   pidfds.
//! - [`landing`]: a frame's payload into a reservation's pages (no
//!   watermark raised), a page's checksum as it landed, and the wire
//!   geometry of a pool ([`landing::pool_geometry`]).
//! - `protocol_model` (`testing` feature only): the reservation and abort
//!   handshake as a stateright model, checked in `tests/protocol_model.rs`
//!   for I1/I2 (no read of unwritten or foreign slots), I5 (no page reused
//!   while a writer can still reach it), I7 (every reservation ends exactly
//!   once, and ends under fair delivery), with bug variants the checker must
//!   catch. Its module doc lists the rules the implementation must follow.
//!
//! # Invariants owned here
//! - **I4 Complete transfer** and **I5 No late writes** at run time:
//!   [`handshake`] and [`transport`], following `protocol_model`'s rules.
//!   The pool's side of I4 (no watermark until publication) is
//!   `kvmesh_kvpool::staging`; the table is its only caller.

#![deny(missing_docs)]

pub mod handshake;
pub mod landing;
#[cfg(feature = "testing")]
pub mod protocol_model;
pub mod shm;
pub mod transport;

pub use landing::pool_geometry;
