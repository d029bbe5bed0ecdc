//! Mesh files as `--check-config` reads them: a bad file is refused with
//! the field, the value and the reason; a good one's settings (pools,
//! handshake, device, the model's description) are shown as the process
//! would run them.

use kvmesh_integration::roles::write_secret;
use kvmesh_integration::{run_kvmesh, texts};

#[test]
fn bad_mesh_files_are_refused_with_field_value_and_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = "router: {http: \"127.0.0.1:1\", grpc: \"127.0.0.1:2\"}\n\
                prefill: [{name: p, grpc: \"127.0.0.1:3\"}]\n\
                decode: [{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}]\n\
                mesh: {insecure_no_mesh_auth: true}\n";
    let insecure = "mesh: {insecure_no_mesh_auth: true}\n";
    std::fs::write(dir.path().join("short.secret"), "short\n").expect("write");
    std::fs::write(dir.path().join("same.secret"), [b'a'; 40]).expect("write");
    let cases = [
        (
            good.replace("127.0.0.1:1", "nope"),
            "router.http = \"nope\": expected HOST:PORT",
        ),
        (
            good.replace("kv: \"127.0.0.1:5\"", "kv: \"x\""),
            "decode[0].kv = \"x\": expected HOST:PORT",
        ),
        (
            good.replace("name: d", "name: p"),
            "decode[0].name = \"p\": names must be non-empty and unique",
        ),
        (
            format!("{good}transport: carrier-pigeon\n"),
            "transport = \"carrier-pigeon\": expected tcp, shm or ucx",
        ),
        (
            format!("{good}page_size: 0\n"),
            "page_size = \"0\": must be at least 1",
        ),
        (
            format!("{good}kv_cache_dtype: fp8\n"),
            "kv_cache_dtype = \"fp8\": unknown KV dtype \"fp8\" (f32 or f16), or auto",
        ),
        (format!("{good}colour: blue\n"), "unknown field `colour`"),
        (
            format!("{good}scrub: sometimes\n"),
            "scrub = \"sometimes\": ",
        ),
        (
            format!("{good}lease_ms: 0\n"),
            "lease_ms = \"0\": must be at least 1",
        ),
        (
            format!("{good}abort_timeout_ms: 0\n"),
            "abort_timeout_ms = \"0\": must be at least 1",
        ),
        (
            good.replace(
                "decode: [{name: d, grpc: \"127.0.0.1:4\", kv: \"127.0.0.1:5\"}]",
                "decode: []",
            ),
            "decode = \"[]\"",
        ),
        // Mesh authentication: a secret, or an explicit opt-out.
        (
            good.replace(insecure, ""),
            "mesh.secret_file = \"\": the internal services accept only peers that prove the per-mesh secret",
        ),
        (
            good.replace(insecure, "mesh: {}\n"),
            "mesh.secret_file = \"\": the internal services accept only peers",
        ),
        (
            good.replace(insecure, "mesh: {secret_file: short.secret}\n"),
            "mesh.secret_file = \"short.secret\": mesh secret file",
        ),
        (
            good.replace(insecure, "mesh: {secret_file: short.secret}\n"),
            "6 bytes, at least 32 are needed",
        ),
        (
            good.replace(insecure, "mesh: {secret_file: same.secret}\n"),
            "every byte is the same",
        ),
        (
            good.replace(insecure, "mesh: {secret_file: nope.secret}\n"),
            "mesh.secret_file = \"nope.secret\"",
        ),
        (
            good.replace(
                insecure,
                "mesh: {secret_file: short.secret, insecure_no_mesh_auth: true}\n",
            ),
            "mesh.insecure_no_mesh_auth = \"true\": contradicts mesh.secret_file",
        ),
        (
            good.replace(insecure, "mesh: {secret: hunter2}\n"),
            "unknown field `secret`",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("mesh{i}.yaml"));
        std::fs::write(&f, text).expect("write");
        let out = run_kvmesh(
            &["router", "--config", &f.to_string_lossy(), "--check-config"],
            &[],
        );
        let (_, stderr) = texts(&out);
        assert!(!out.status.success(), "accepted: {text}");
        assert!(stderr.contains(want), "{want:?} not in {stderr}");
    }
    // The pool and handshake settings of `serve` are the mesh file's too,
    // parsed into typed values once.
    let f = dir.path().join("settings.yaml");
    let text =
        format!("{good}lease_ms: 5000\nabort_timeout_ms: 700\ndrain_timeout_ms: 2500\nscrub: on-release\npoison: true\n");
    std::fs::write(&f, text).expect("write");
    let out = run_kvmesh(
        &["decode", "--config", &f.to_string_lossy(), "--check-config"],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(
            "lease 5000 ms, abort timeout 700 ms, drain timeout 2500 ms, scrub on-release, poison on"
        ),
        "{stdout}"
    );
    // Device settings: the node's over the mesh's, weights shown for a CUDA
    // node, and a weight type for a CPU node refused, not ignored.
    let f = dir.path().join("device.yaml");
    std::fs::write(&f, format!("{good}device: cuda:1\ndevice_weights: bf16\n")).expect("write");
    let out = run_kvmesh(
        &["decode", "--config", &f.to_string_lossy(), "--check-config"],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("device cuda:1 (weights bf16)"), "{stdout}");
    // The model: described from its metadata (no weights read), or said to
    // be absent from this host (a file checked for another host).
    let tiny = kvmesh_integration::tiny_model_dir();
    let f = dir.path().join("model.yaml");
    std::fs::write(&f, format!("{good}model: {}\n", tiny.display())).expect("write");
    let out = run_kvmesh(
        &["router", "--config", &f.to_string_lossy(), "--check-config"],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "model {}: llama, weights safetensors ",
            tiny.display()
        )),
        "{stdout}"
    );
    std::fs::write(&f, format!("{good}model: /models/elsewhere.gguf\n")).expect("write");
    let out = run_kvmesh(
        &[
            "prefill",
            "--config",
            &f.to_string_lossy(),
            "--check-config",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("model /models/elsewhere.gguf: not readable on this host"),
        "{stdout}"
    );
    let f = dir.path().join("cpu-weights.yaml");
    std::fs::write(&f, format!("{good}device_weights: f16\n")).expect("write");
    let out = run_kvmesh(
        &[
            "prefill",
            "--config",
            &f.to_string_lossy(),
            "--check-config",
        ],
        &[],
    );
    let (_, stderr) = texts(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("device_weights f16 applies to a CUDA device only; this node runs on cpu"),
        "{stderr}"
    );
    // A node name the file does not have.
    let f = dir.path().join("good.yaml");
    std::fs::write(&f, good).expect("write");
    let out = run_kvmesh(
        &[
            "decode",
            "--config",
            &f.to_string_lossy(),
            "--name",
            "zz",
            "--check-config",
        ],
        &[],
    );
    assert!(texts(&out).1.contains("no decode node named \"zz\""));
    // The opt-out is accepted, and said loudly; a real secret is named.
    let out = run_kvmesh(
        &["router", "--config", &f.to_string_lossy(), "--check-config"],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("mesh auth: OFF"), "{stdout}");
    assert!(stderr.contains("MESH AUTHENTICATION IS OFF"), "{stderr}");
    let secret = write_secret(dir.path(), "mesh.secret");
    std::fs::write(
        &f,
        good.replace(insecure, "mesh: {secret_file: mesh.secret}\n"),
    )
    .expect("write");
    let out = run_kvmesh(
        &["router", "--config", &f.to_string_lossy(), "--check-config"],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!("mesh auth: secret file {}", secret.display())),
        "{stdout}"
    );
    assert!(!stderr.contains("MESH AUTHENTICATION IS OFF"), "{stderr}");
}
