//! kvmesh router: the OpenAI-compatible HTTP gateway and gRPC API,
//! tokenization and chat templates, and admission control (invariant I3:
//! reject before anything is allocated anywhere).
//!
//! # Layout
//! Empty until the mesh issue lands. The router will never link the model
//! runtime's compute code: it depends on `kvmesh-proto` and the tokenizer only.
