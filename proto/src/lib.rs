//! kvmesh's gRPC API: the public `kvmesh.v1.Generation` service (Generate,
//! Tokenize, ListModels) and the internal `kvmesh.internal.v1` Decode and
//! Prefill services the router drives. The `.proto` files under `proto/`
//! are the source of truth, every field documented there; `build.rs`
//! compiles them with protox (pure Rust, no system `protoc`) and
//! tonic-prost-build.
//!
//! # Layout
//! - [`v1`], [`internal`]: the generated messages, clients and servers;
//!   [`PUBLIC_FILE_DESCRIPTOR_SET`] for the public port's reflection;
//!   [`LOGPROBS_MAX`].
//! - [`peer`]: the client half of the internal services' contract: the
//!   clients whose every call proves the mesh secret and carries the trace
//!   context (`kvmesh_meshauth::grpc` holds the interceptor and the server
//!   wrapper that refuses calls without a proof), over channels inside
//!   mutual TLS when the mesh has certificates.
//! - [`refusal`]: the draining refusal a node answers with and the router
//!   recognises.
//!
//! This is a contract crate: it links no model runtime and serves nothing.
//! What the nodes share beyond the contract (serving and draining, the
//! reading of `Sampling` into the model's parameters, the load report's
//! common fields, `/metrics`) is `kvmesh-node`'s.

#![allow(missing_docs, clippy::all)]

pub mod peer;
pub mod refusal;

/// The most alternatives per token a public-API `logprobs` may ask for.
pub const LOGPROBS_MAX: u64 = 20;

/// The public API.
pub mod v1 {
    tonic::include_proto!("kvmesh.v1");
}

/// The internal node services.
pub mod internal {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("kvmesh.internal.v1");
    }
}

/// The encoded `FileDescriptorSet` of the public API (`kvmesh.v1`) alone,
/// for the public port's gRPC server reflection: the internal services are
/// not served there, so reflection does not name them.
pub const PUBLIC_FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kvmesh_public_descriptor.bin"));
