//! The official `openai` Python client against `kvmesh serve`: the gateway
//! is what an OpenAI user's code expects. The client is installed from PyPI
//! with the machine's pip into the kvmesh cache (outside the repository) on
//! first use.

use std::path::PathBuf;
use std::process::Command;

use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::python::{pip_install, python};
use kvmesh_integration::tiny_model_dir;

/// Pinned for reproducible runs.
const OPENAI: &str = "openai==3.57.0";

/// The directory the client is installed into.
fn client_dir() -> PathBuf {
    pip_install(OPENAI)
}

fn reference(prompt: &str, chat: bool) -> String {
    kvmesh_integration::reference_text(&tiny_model_dir(), prompt, chat, 16)
}

#[test]
fn official_openai_client_streaming_and_not() {
    let dir = client_dir();
    let mesh = InProcessMesh::start(&tiny_model_dir(), Options::default()).expect("the mesh");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/openai_client.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(format!("http://{}/v1", mesh.http))
        .arg("tiny-llama")
        .arg("Hello world")
        .arg("16")
        .env("PYTHONPATH", &dir)
        .output()
        .expect("run python");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let plain = reference("Hello world", false);
    let chat = reference("Hello world", true);
    assert_eq!(v["completion"], plain.as_str());
    assert_eq!(v["completion_stream"], plain.as_str());
    assert_eq!(v["chat"], chat.as_str());
    assert_eq!(v["chat_stream"], chat.as_str());
    assert_eq!(v["chat_role"], "assistant");
    assert!(
        matches!(v["completion_finish"].as_str(), Some("length" | "stop")),
        "{v}"
    );
    assert_eq!(v["models"][0], "tiny-llama");
    assert_eq!(v["over_length"], "BadRequestError: context_length_exceeded");
}
