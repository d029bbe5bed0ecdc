//! The Kubernetes manifests (`deploy/kubernetes/`), checked offline (no
//! cluster runs here): every manifest validates against the Kubernetes
//! schemas in strict mode (the `kubernetes-validate` package, pinned,
//! pip-installed as the other Python tools are), and a misspelt field
//! fails that check; the kustomization lists every manifest; each
//! container's command, with its pod name, is accepted by the binary
//! (`--check-config`) against the ConfigMap's mesh file and the secret
//! mounted as the manifests mount it (mode 0440 in the pod's group),
//! without the warning about a secret others can read; the probes and
//! grace periods match the drain; and each node's memory request covers
//! the model and the KV pool the mesh file gives it.

use std::path::PathBuf;
use std::process::Command;

use kvmesh_integration::python::{pip_install, python};
use kvmesh_integration::roles::write_secret;
use kvmesh_integration::{run_kvmesh, texts};
use serde_yaml_ng::Value;

const VALIDATOR: &str = "kubernetes-validate==1.31.0";
const K8S_VERSION: &str = "1.31.0";

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// The manifests (every YAML file but the kustomization), by file name.
fn manifests() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir())
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    out.sort();
    out
}

/// Every document of every manifest.
fn documents() -> Vec<Value> {
    let mut docs = Vec::new();
    for name in manifests() {
        let text = std::fs::read_to_string(dir().join(&name)).expect("manifest");
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            docs.push(
                serde::Deserialize::deserialize(doc).unwrap_or_else(|e| panic!("{name}: {e}")),
            );
        }
    }
    docs
}

/// Runs the validator on `files`; (success, output).
fn validate(files: &[PathBuf]) -> (bool, String) {
    let pkg = pip_install(VALIDATOR);
    let out = Command::new(python())
        .args(["-m", "kubernetes_validate", "-k", K8S_VERSION, "--strict"])
        .args(files)
        .env("PYTHONPATH", &pkg)
        .output()
        .expect("run kubernetes_validate");
    let (stdout, stderr) = texts(&out);
    (out.status.success(), format!("{stdout}{stderr}"))
}

#[test]
fn manifests_validate_strictly_and_a_misspelt_field_does_not() {
    let files: Vec<PathBuf> = manifests().iter().map(|n| dir().join(n)).collect();
    assert_eq!(files.len(), 4, "{files:?}");
    let (ok, out) = validate(&files);
    assert!(ok, "{out}");
    // One "passed" line per resource, none skipped.
    assert_eq!(out.matches(" passed for resource ").count(), 7, "{out}");

    // The check can fail: a field Kubernetes does not have.
    let tmp = tempfile::tempdir().expect("tempdir");
    let bad = tmp.path().join("decode.yaml");
    let text = std::fs::read_to_string(dir().join("decode.yaml")).expect("decode.yaml");
    assert!(text.contains("terminationGracePeriodSeconds:"));
    std::fs::write(
        &bad,
        text.replace("terminationGracePeriodSeconds:", "terminationGracePeriod:"),
    )
    .expect("write");
    let (ok, out) = validate(&[bad]);
    assert!(!ok, "a misspelt field passed: {out}");
    assert!(out.contains("terminationGracePeriod"), "{out}");

    // The kustomization applies exactly these files.
    let k: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(dir().join("kustomization.yaml")).expect("kustomization"),
    )
    .expect("YAML");
    let mut listed: Vec<String> = k["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .map(|r| r.as_str().expect("name").to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, manifests());
}

/// The mesh file in the ConfigMap.
fn mesh_file(docs: &[Value]) -> String {
    docs.iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["mesh.yaml"].as_str())
        .expect("a ConfigMap with mesh.yaml")
        .to_owned()
}

/// Bytes of a Kubernetes quantity such as `512Mi` or `1Gi`.
fn quantity(q: &str) -> u64 {
    let units = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().expect("number") * mult;
        }
    }
    q.parse().expect("a plain number of bytes")
}

#[test]
fn every_container_command_is_accepted_and_resources_fit_the_pools() {
    let docs = documents();
    let mesh = mesh_file(&docs);
    let mesh_cfg: Value = serde_yaml_ng::from_str(&mesh).expect("mesh file YAML");
    let drain_s = mesh_cfg["drain_timeout_ms"]
        .as_u64()
        .expect("drain_timeout_ms")
        / 1000;
    // The pod's view of /etc/kvmesh: the projected mesh file and secret,
    // both 0440 (the secret the operator made with `head -c 32`).
    let root = tempfile::tempdir().expect("tempdir");
    let etc = root.path().join("etc/kvmesh");
    std::fs::create_dir_all(&etc).expect("mkdir");
    let secret = write_secret(&etc, "mesh.secret");
    std::fs::write(etc.join("mesh.yaml"), &mesh).expect("write mesh file");
    for f in [&secret, &etc.join("mesh.yaml")] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o440)).expect("chmod");
    }

    let mut roles = Vec::new();
    for d in docs
        .iter()
        .filter(|d| d["kind"] == "StatefulSet" || d["kind"] == "Deployment")
    {
        let name = d["metadata"]["name"].as_str().expect("name");
        let pod = &d["spec"]["template"]["spec"];
        // A StatefulSet's first pod is NAME-0: the mesh file's node name.
        let pod_name = format!("{name}-0");
        let c = &pod["containers"][0];
        let mut args: Vec<String> = c["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .map(|a| {
                a.as_str()
                    .expect("string arg")
                    .replace("$(POD_NAME)", &pod_name)
                    .replace(
                        "/etc/kvmesh/mesh.yaml",
                        &etc.join("mesh.yaml").to_string_lossy(),
                    )
            })
            .collect();
        // The volume the manifests mount there is the mesh file and secret.
        let mount = &c["volumeMounts"][0];
        assert_eq!(mount["mountPath"], "/etc/kvmesh", "{name}");
        let sources = pod["volumes"][0]["projected"]["sources"]
            .as_sequence()
            .expect("a projected volume");
        assert_eq!(sources[0]["configMap"]["name"], "kvmesh-mesh");
        assert_eq!(sources[1]["secret"]["items"][0]["path"], "mesh.secret");
        assert_eq!(pod["volumes"][0]["projected"]["defaultMode"], 0o440);
        assert_eq!(
            pod["securityContext"]["runAsGroup"],
            pod["securityContext"]["fsGroup"]
        );

        args.push("--check-config".into());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_kvmesh(&refs, &[]);
        let (stdout, stderr) = texts(&out);
        assert!(out.status.success(), "{name}: kvmesh {args:?}: {stderr}");
        assert!(stdout.starts_with("config ok"), "{stdout}");
        assert!(stdout.contains("mesh auth: secret file"), "{stdout}");
        assert!(
            !stderr.contains("readable by other users"),
            "{name}: {stderr}"
        );

        // The grace period covers preStop and the whole drain.
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        assert!(
            grace > drain_s + 5,
            "{name}: grace {grace} s, drain {drain_s} s"
        );
        let role = args[0].clone();
        if role == "router" {
            assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
        } else {
            // Readiness is the node's own gRPC health, on its gRPC port.
            let node = mesh_cfg[role.as_str()]
                .as_sequence()
                .expect("nodes")
                .iter()
                .find(|n| n["name"] == pod_name.as_str())
                .expect("the pod's node in the mesh file");
            let port: u64 = node["listen"]
                .as_str()
                .and_then(|l| l.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("listen port");
            assert_eq!(c["readinessProbe"]["grpc"]["port"], port, "{name}");
            check_memory(name, c, node, &mesh_cfg);
        }
        roles.push(role);
    }
    roles.sort();
    assert_eq!(roles, ["decode", "prefill", "router"]);
}

/// The container's memory request covers the weights and the node's KV
/// pool (the default model's geometry, f16 pages as `auto` keeps them for
/// quantized weights, f32 in the exact mode).
fn check_memory(name: &str, c: &Value, node: &Value, mesh: &Value) {
    let Some(model) = kvmesh_model::default_model::cached_default_model() else {
        eprintln!("note: default model not cached; {name}'s memory request not checked (run `kvmesh fetch-model`)");
        return;
    };
    let loaded = kvmesh_model::loader::load(&model).expect("load the default model");
    let cfg = &loaded.config;
    let tokens = node["kv_pool_tokens"].as_u64().expect("kv_pool_tokens") as usize;
    let page_size = mesh["page_size"].as_u64().expect("page_size") as usize;
    let dtype = if mesh["exact"].as_bool() == Some(true) {
        kvmesh_kvpool::KvDtype::F32
    } else {
        kvmesh_kvpool::KvDtype::F16
    };
    let pool = kvmesh_kvpool::PoolConfig::for_tokens(
        tokens,
        page_size,
        cfg.n_layers,
        cfg.n_kv_heads,
        cfg.head_dim,
    )
    .with_dtype(dtype)
    .bytes() as u64;
    let weights = std::fs::metadata(&model).expect("model file").len();
    let request = quantity(
        c["resources"]["requests"]["memory"]
            .as_str()
            .expect("a memory request"),
    );
    assert!(
        request >= weights + pool,
        "{name}: requests {request} bytes, weights {weights} + KV pool {pool}"
    );
    let limit = quantity(c["resources"]["limits"]["memory"].as_str().expect("limit"));
    assert!(limit >= request, "{name}");
}
