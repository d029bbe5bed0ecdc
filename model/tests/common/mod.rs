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
