//! End-to-end tests live in `tests/`; they start the real `kvmesh` binary.
