//! kvmesh wire API: the public gRPC API (Generate, Tokenize, ListModels) and the
//! internal prefill/decode services.
//!
//! # Layout
//! Empty until the mesh issue lands: the `.proto` files will live in `proto/`
//! and be compiled here by `build.rs` with protox (pure Rust, no system
//! `protoc`). Nothing in this crate is used yet, and nothing pretends to be.
