//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use kvmesh_model::default_model;

/// The committed tiny random-weight Llama model directory.
pub fn tiny_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama")
}

/// A committed golden file.
pub fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/golden")
        .join(name)
}

/// The default model if it is in the cache; tests on it are skipped (with a
/// note on stderr) when it is not. `.ci/run` fetches it first.
pub fn smollm2() -> Option<PathBuf> {
    let found = default_model::cached_default_model();
    if found.is_none() {
        eprintln!(
            "note: {} not in {}; SmolLM2 tests skipped (run `kvmesh fetch-model`)",
            default_model::DEFAULT_MODEL_FILE,
            default_model::cache_dir().display()
        );
    }
    found
}

/// An engine config on CUDA device 0, if one can be opened; `None` (with
/// "not run: no CUDA device" on stderr) on a machine without the driver or
/// a device, unless `KVMESH_REQUIRE_CUDA=1` (the GPU script), where that
/// fails the test. Any other failure to open the device fails it too.
pub fn cuda_or_skip() -> Option<kvmesh_cuda::DeviceSpec> {
    use kvmesh_cuda::{gpu::Gpu, CudaError, DeviceSpec};
    match Gpu::open(DeviceSpec::Cuda(0)) {
        Ok(_) => Some(DeviceSpec::Cuda(0)),
        Err(e @ (CudaError::NoDriver { .. } | CudaError::NoDevice { .. })) => {
            assert!(
                std::env::var("KVMESH_REQUIRE_CUDA").as_deref() != Ok("1"),
                "KVMESH_REQUIRE_CUDA=1: {e}"
            );
            eprintln!("not run: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("opening cuda:0: {e}"),
    }
}
