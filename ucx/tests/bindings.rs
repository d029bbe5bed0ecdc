//! The committed bindings (src/sys.rs) against the installed UCX: the
//! headers' API version, the loaded library's, and (where bindgen is
//! installed) a full regeneration that must produce the same file.

use std::path::Path;
use std::process::Command;

const VERSION_HEADER: &str = "/usr/include/ucp/api/ucp_version.h";

fn header_define(text: &str, name: &str) -> Option<u32> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("#define"))
        .filter_map(|l| l.trim().strip_prefix(name))
        .find_map(|v| v.trim().parse().ok())
}

#[test]
fn the_bindings_are_of_the_installed_headers_api_version() {
    let Ok(text) = std::fs::read_to_string(VERSION_HEADER) else {
        eprintln!("not run: {VERSION_HEADER} missing (Debian's libucx-dev)");
        return;
    };
    assert_eq!(
        header_define(&text, "UCP_API_MAJOR"),
        Some(kvmesh_ucx::sys::UCP_API_MAJOR)
    );
    assert_eq!(
        header_define(&text, "UCP_API_MINOR"),
        Some(kvmesh_ucx::sys::UCP_API_MINOR)
    );
}

#[test]
fn the_loaded_library_is_at_least_the_bindings_version() {
    match kvmesh_ucx::version() {
        Ok((major, minor, _)) => {
            assert_eq!(major, kvmesh_ucx::sys::UCP_API_MAJOR);
            assert!(minor >= kvmesh_ucx::sys::UCP_API_MINOR);
        }
        Err(e) => {
            // The error names the package to install.
            assert!(e.to_string().contains("libucx0"), "{e}");
            eprintln!("not run: {e}");
        }
    }
}

#[test]
fn regenerating_the_bindings_changes_nothing() {
    let has_bindgen = Command::new("bindgen")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_bindgen || !Path::new(VERSION_HEADER).exists() {
        eprintln!("not run: needs bindgen-cli and libucx-dev (scripts/ucx-bindgen)");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ucx-bindgen");
    let out = Command::new("bash")
        .arg(script)
        .arg("--check")
        .output()
        .expect("run scripts/ucx-bindgen");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
