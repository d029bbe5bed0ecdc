//! kvmesh prefill service: computes a prompt's KV cache and writes its pages
//! into a reservation that a decode node granted (kv-safety.md section 3).
//!
//! # Layout
//! Empty until the mesh issue lands; it will wrap `kvmesh-model` and the
//! writer side of `kvmesh-kvxfer`.
