//! kvmesh decode service: grants page reservations, verifies transfers
//! (invariant I4) and runs continuous batching over verified sequences.
//!
//! # Layout
//! Empty until the mesh issue lands; it will wrap `kvmesh-model` and the
//! reservation side of `kvmesh-kvxfer`.
