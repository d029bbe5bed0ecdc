//! What the prefill and decode nodes share beyond the contract
//! (`kvmesh-proto`): how a node serves and drains, how it reads the
//! router's `Sampling` into the model's parameters, the load report fields
//! both roles fill alike, and a node's own `/metrics`.
//!
//! # Layout
//! - [`serve`]: the gRPC server of a node ([`serve::Serving`]: TCP_NODELAY,
//!   mutual TLS when the mesh has certificates, the standard health
//!   service, `GET /metrics` on the same port), the graceful stop, and the
//!   drain's helpers ([`serve::settle`], [`serve::cut_set`],
//!   [`serve::join_thread`]) and its report ([`serve::Drained`]).
//! - [`sampling`]: the internal `Sampling` message as `kvmesh-model`'s
//!   `SamplingParams`, checked again (a node trusts no caller's ranges),
//!   and a drawn token's logprobs back into the message. Prefill (the first
//!   token) and decode (the rest) read it the same way, so one seed and one
//!   set of settings give one sampler's tokens.
//! - [`report`]: the load report's fields both roles fill from their
//!   engine, pool and refusal counters ([`report::common`]).
//! - [`metrics`]: a node's own Prometheus series rendered from its load
//!   report, so `/metrics` and the router's relay never disagree (the text
//!   format is `kvmesh_telemetry::metrics`).
//!
//! This crate links the model runtime (the sampler's parameters, the
//! engine a report reads); the router never links it: it reaches the
//! nodes through `kvmesh-proto` alone.

#![deny(missing_docs)]

pub mod metrics;
pub mod report;
pub mod sampling;
pub mod serve;
