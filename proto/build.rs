//! Compiles `proto/**/*.proto` with protox (pure Rust: no system protoc)
//! into prost messages and tonic clients and servers, and writes the
//! encoded descriptor set for gRPC server reflection.

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
    let fds = protox::compile(PROTOS, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("kvmesh_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
