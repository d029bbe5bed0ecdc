//! kvmesh decode service: grants page reservations, verifies transfers
//! (invariant I4) and runs continuous batching over verified sequences.
//!
//! # Layout
//! - [`DecodeNode`]: the node: its KV pool (heap, or a shared-memory
//!   mapping for same-host prefill), the reservation table and KV transport
//!   listener from `kvmesh-kvxfer`, the batcher, and the gRPC service.
//! - `batcher` (private): the continuous-batching actor, one OS thread
//!   that owns the engine's compute: verified sequences join the running
//!   batch at the next step, finished or abandoned ones leave it.
//! - `service` (private): the `kvmesh.internal.v1.Decode` gRPC service and
//!   the one mapping from this crate's errors to gRPC status codes.
//! - `metrics` (private): the node's own Prometheus series, served as
//!   `GET /metrics` beside its gRPC service ([`DecodeNode::metrics_text`]).
//! - [`run`]: the node's lifecycle: serve on a listener until shutdown,
//!   then drain (refuse new work, finish or cut what is in flight through
//!   the handshake, join the batcher, count the pool: [`Drained`]).

mod batcher;
mod metrics;
mod run;
#[cfg(test)]
mod run_tests;
mod service;

pub use kvmesh_node::serve::Drained;
pub use run::run;
pub use service::{DecodeConfig, DecodeNode, NodeError};
