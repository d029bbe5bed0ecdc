//! kvmesh model runtime (Llama family) — being assembled.
