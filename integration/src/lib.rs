//! Helpers for kvmesh's end-to-end tests, which live in `tests/`.
//!
//! Layout: [`inproc`] runs the mesh in the test's process on port 0 (most
//! tests); [`mesh`] (`kvmesh serve`) and [`roles`] (one process per role
//! from a mesh file) start the real `kvmesh` binary, for what needs a
//! process of its own (kills, SIGTERM, planted bugs, deploy files);
//! [`cache`] holds the prefix cache's request helpers and isolation scenario;
//! [`certs`] makes certificates as a deployment file's `kvmesh certs`
//! command says, and checks them through the mesh's TLS;
//! [`etcd`] runs a real etcd for the membership tests and meshes that
//! register in it;
//! [`http`] is the tests' face of `kvmesh_client`'s client and scraper;
//! [`nodes`] drives the internal services by hand; [`python`] runs the
//! external clients; [`netlab`] puts each role on a host of its own
//! (network namespaces) behind links it shapes and cuts.

use std::path::PathBuf;
use std::process::{Command, Output};

pub mod cache;
pub mod certs;
pub mod etcd;
pub mod http;
pub mod inproc;
pub mod mesh;
pub mod netlab;
pub mod nodes;
pub mod python;
pub mod roles;

/// The `kvmesh` binary that `cargo test --workspace` built next to the test
/// executables (`target/<profile>/kvmesh`), or `$KVMESH_BIN`.
pub fn kvmesh_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/kvmesh
    let profile_dir = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("target profile dir");
    let bin = profile_dir.join(format!("kvmesh{}", std::env::consts::EXE_SUFFIX));
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} not built: run `cargo build --workspace --all-targets` first (scripts/test.sh does), or set KVMESH_BIN", bin.display()));
    // `cargo test` rebuilds the binary only when a package with integration
    // tests of its own needs it; refuse to test a binary older than its code.
    // The code is what cargo's dep-info lists for the binary: a change to a
    // test module (which does not rebuild it) is not a reason to refuse it.
    let dep_info = bin.with_extension("d");
    let sources = std::fs::read_to_string(&dep_info).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: run `cargo build --workspace --all-targets` first (scripts/test.sh does)",
            dep_info.display()
        )
    });
    if let Some(newer) = dep_info_sources(&sources).into_iter().find(|src| {
        std::fs::metadata(src)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t > built)
    }) {
        panic!(
            "{} is older than {}: run `cargo build --workspace --all-targets` first (scripts/test.sh does)",
            bin.display(),
            newer.display()
        );
    }
    bin
}

/// The sources a dep-info file (`target: src src ...`, spaces in a path
/// escaped as `\ `) lists for its first target.
fn dep_info_sources(text: &str) -> Vec<PathBuf> {
    let line = text.lines().next().unwrap_or_default();
    // The target ends at the first `: ` (a Windows drive's `C:` has none).
    let deps = line.split_once(": ").map_or("", |(_, deps)| deps);
    let mut out = Vec::new();
    let mut cur = String::new();
    for part in deps.split(' ') {
        // `a\ b` is one path with a space.
        if let Some(head) = part.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(part);
        if !cur.is_empty() {
            out.push(PathBuf::from(std::mem::take(&mut cur)));
        }
    }
    out
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
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs a `kvmesh` command that starts its own mesh and writes a JSON
/// report (`bench`, `bench-router`, `bench-cache`, `soak`): `args` plus
/// `--json` and `--serve-log` in a fresh temporary directory. Fails the
/// test unless it exited 0, showing stdout, stderr and the last 30 lines of
/// every serve log it wrote; returns its stdout and the report.
pub fn run_reported(args: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().expect("temp dir");
    let json_path = dir.path().join("report.json");
    let (json_arg, log_arg) = (
        json_path.to_string_lossy().into_owned(),
        dir.path().join("serve.log").to_string_lossy().into_owned(),
    );
    let mut all = args.to_vec();
    all.extend(["--json", &json_arg, "--serve-log", &log_arg]);
    let out = run_kvmesh(&all, &[]);
    let (stdout, stderr) = texts(&out);
    if !out.status.success() {
        // `bench-cache` names a log per target and round after the one given.
        let mut logs: Vec<_> = std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        let logs: String = logs
            .iter()
            .map(|p| {
                let text = std::fs::read_to_string(p).unwrap_or_default();
                format!("serve log {} (tail):\n{}\n", p.display(), tail(&text, 30))
            })
            .collect();
        panic!("kvmesh {} failed:\n{stdout}\n{stderr}\n{logs}", args[0]);
    }
    let text = std::fs::read_to_string(&json_path).expect("the JSON report");
    let report = serde_json::from_str(&text).expect("the report is JSON");
    (stdout, report)
}

/// The reference text: `kvmesh generate` with `--temperature 0` (plus
/// `--chat` when asked), its own final newline
/// removed: what the mesh's output must equal.
pub fn reference_text(
    model: &std::path::Path,
    prompt: &str,
    chat: bool,
    max_tokens: usize,
) -> String {
    reference_text_with(model, prompt, chat, max_tokens, &[])
}

/// [`reference_text`] with `extra` flags for `kvmesh generate` (say
/// `--kv-cache-dtype f16`, to match a mesh started with it).
pub fn reference_text_with(
    model: &std::path::Path,
    prompt: &str,
    chat: bool,
    max_tokens: usize,
    extra: &[&str],
) -> String {
    let model = model.to_string_lossy().into_owned();
    let n = max_tokens.to_string();
    let mut args = vec![
        "generate",
        "--model",
        &model,
        "--prompt",
        prompt,
        "--max-tokens",
        &n,
        "--temperature",
        "0",
    ];
    if chat {
        args.push("--chat");
    }
    args.extend_from_slice(extra);
    let out = run_kvmesh(&args, &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "reference failed: {stderr}");
    stdout.strip_suffix('\n').unwrap_or(&stdout).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dep_info_lists_each_source_with_escaped_spaces() {
        let text = "/t/kvmesh: /w/a.rs /w/my\\ dir/b.rs  /w/c.proto\n\n/w/a.rs:\n";
        assert_eq!(
            dep_info_sources(text),
            ["/w/a.rs", "/w/my dir/b.rs", "/w/c.proto"].map(PathBuf::from)
        );
        assert!(dep_info_sources("").is_empty());
    }
}
