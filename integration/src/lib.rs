//! Helpers for kvmesh's end-to-end tests, which live in `tests/` and start
//! the real `kvmesh` binary as a separate process.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `kvmesh` binary that `cargo test --workspace` built next to the test
/// executables (`target/<profile>/kvmesh`), or `$KVMESH_BIN`.
pub fn kvmesh_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/kvmesh
    let profile_dir = exe.parent().and_then(|p| p.parent()).expect("target profile dir");
    let bin = profile_dir.join(format!("kvmesh{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.exists(), "{} not built: run `cargo test --workspace` (or set KVMESH_BIN)", bin.display());
    bin
}

/// The committed tiny random-weight Llama model.
pub fn tiny_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama")
}

/// Run `kvmesh` with `args` and return its output.
pub fn run_kvmesh(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(kvmesh_bin());
    cmd.args(args).env("KVMESH_LOG", "warn");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("spawn kvmesh")
}

/// stdout and stderr as text.
pub fn texts(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}
