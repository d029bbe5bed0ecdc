//! What kvmesh's tests use and the shipped binary never does: a dev-only
//! crate (every user names it under `[dev-dependencies]`).
//!
//! Layout:
//! - [`tls`]: a throwaway certificate authority that writes a CA and node
//!   certificates (current, expired, or from another CA) as PEM files, for
//!   the mutual-TLS tests of `kvmesh-meshauth`, `kvmesh-kvxfer` and the
//!   integration suite.
//!
//! The client the tools and tests talk to a gateway with is
//! `kvmesh-client`, which the `kvmesh` binary links.

pub mod tls;
