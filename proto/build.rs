//! Compiles `proto/**/*.proto` with protox (pure Rust: no system protoc)
//! into prost messages and tonic clients and servers, and writes the
//! encoded descriptor set of the public API alone for the public port's
//! gRPC server reflection (the internal services are not served there, so
//! reflection must not list them).

use std::path::PathBuf;

use prost::Message;

const PROTOS: [&str; 2] = [
    "proto/kvmesh/v1/generation.proto",
    "proto/kvmesh/internal/v1/nodes.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let public = protox::compile([PROTOS[0]], ["proto"])?;
    std::fs::write(
        out.join("kvmesh_public_descriptor.bin"),
        public.encode_to_vec(),
    )?;
    let fds = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
