//! The Kubernetes manifests (`deploy/kubernetes/`), checked offline (no
//! cluster runs here), for both variants: static discovery
//! (`deploy/kubernetes`) and membership through etcd
//! (`deploy/kubernetes/etcd`, which adds an etcd and its own mesh file),
//! each the roles of `deploy/kubernetes/base` and a ConfigMap. Every
//! manifest validates against the Kubernetes schemas in strict mode (the
//! `kubernetes-validate` package, pinned, pip-installed as the other Python
//! tools are), and a misspelt field fails that check; each kustomization
//! lists every manifest beside it (and, where `kubectl` is installed,
//! `kubectl kustomize` renders exactly the resources read here); each
//! container's command, for every pod the mesh file names, is accepted by
//! the binary (`--check-config`) against the variant's mesh file and the
//! secret mounted as the manifests mount it (mode 0440 in the pod's group),
//! without the warning about a secret others can read; the probes and
//! grace periods match the drain; each node's memory request covers the
//! model and the KV pool the mesh file gives it; and etcd's variant points
//! its mesh file at the etcd it runs, inside TLS: its kustomization's
//! patches (applied here as kustomize applies them, and compared with
//! `kubectl kustomize`'s rendering) project the certificates that its
//! header's `kvmesh certs` command makes, every file the mesh file and
//! etcd's flags name is in a pod's mounts, and each certificate passes the
//! mesh's TLS for the address its peers dial.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvmesh_integration::python::{pip_install, python};
use kvmesh_integration::roles::write_secret;
use kvmesh_integration::{certs, run_kvmesh, texts};
use serde_yaml_ng::Value;

mod render;
use render::{documents, kinds_and_names, rendered, resources, unlabelled};

const VALIDATOR: &str = "kubernetes-validate==1.31.0";
const K8S_VERSION: &str = "1.31.0";

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

/// The variants: their folder under `deploy/kubernetes`, and how many
/// resources each applies.
const VARIANTS: [(&str, usize); 2] = [("", 7), ("etcd", 9)];

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
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    for (variant, count) in VARIANTS {
        let these = resources(&dir().join(variant));
        assert_eq!(documents(&these).len(), count, "{variant:?}: {these:?}");
        let docs = rendered(&dir().join(variant));
        assert_eq!(docs.len(), count, "{variant:?}");
        match Command::new("kubectl")
            .args(["kustomize"])
            .arg(dir().join(variant))
            .output()
        {
            Ok(out) => {
                let (stdout, stderr) = texts(&out);
                assert!(
                    out.status.success(),
                    "kubectl kustomize {variant:?}: {stderr}"
                );
                let rendered: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&stdout)
                    .map(|d| serde::Deserialize::deserialize(d).expect("rendered YAML"))
                    .collect();
                assert_eq!(
                    kinds_and_names(&rendered),
                    kinds_and_names(&docs),
                    "{variant:?}"
                );
                for d in &rendered {
                    assert_eq!(
                        d["metadata"]["labels"]["app.kubernetes.io/part-of"], "kvmesh",
                        "{variant:?}: {:?}",
                        d["metadata"]["name"]
                    );
                    // The patches as this test applies them are kustomize's.
                    let ours = docs
                        .iter()
                        .find(|o| {
                            o["kind"] == d["kind"] && o["metadata"]["name"] == d["metadata"]["name"]
                        })
                        .expect("the same resource");
                    assert_eq!(
                        unlabelled(d.clone()),
                        unlabelled(ours.clone()),
                        "{variant:?}: {:?}",
                        d["metadata"]["name"]
                    );
                }
            }
            Err(e) => {
                eprintln!("note: kubectl not runnable ({e}); kustomize's rendering not compared")
            }
        }
        // What is applied: each variant's documents as rendered.
        for (i, d) in docs.iter().enumerate() {
            let f = tmp
                .path()
                .join(format!("{}{i}.yaml", variant.replace('/', "-")));
            std::fs::write(&f, serde_yaml_ng::to_string(d).expect("YAML")).expect("write");
            files.push(f);
        }
    }
    let (ok, out) = validate(&files);
    assert!(ok, "{out}");
    // One "passed" line per resource of each variant, none skipped.
    let all: usize = VARIANTS.iter().map(|(_, n)| n).sum();
    assert_eq!(out.matches(" passed for resource ").count(), all, "{out}");

    // The check can fail: a field Kubernetes does not have.
    let bad = tmp.path().join("decode.yaml");
    let text = std::fs::read_to_string(dir().join("base/decode.yaml")).expect("decode.yaml");
    assert!(text.contains("terminationGracePeriodSeconds:"));
    std::fs::write(
        &bad,
        text.replace("terminationGracePeriodSeconds:", "terminationGracePeriod:"),
    )
    .expect("write");
    let (ok, out) = validate(&[bad]);
    assert!(!ok, "a misspelt field passed: {out}");
    assert!(out.contains("terminationGracePeriod"), "{out}");
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
    let docs = rendered(&dir());
    let (roles, lines) = check_commands(&docs, None);
    assert_eq!(roles, ["decode", "prefill", "router"]);
    for l in lines {
        assert!(l.contains("1 prefill and 1 decode nodes"), "{l}");
    }
}

/// The etcd variant: the same checks, for every pod its mesh file names
/// (a second decode node, for `kubectl scale`), with the certificates its
/// kustomization's `kvmesh certs` command makes (the CA key kept out of the
/// Secret); the mesh file points at the etcd the variant runs, built from
/// deploy/etcd, over TLS with client certificates; etcd's certificate
/// files are in its mounts; and each certificate passes the mesh's TLS for
/// the address its peers dial.
#[test]
fn the_etcd_variant_runs_its_etcd_and_every_command_is_accepted() {
    let docs = rendered(&dir().join("etcd"));
    let made = tempfile::tempdir().expect("tempdir");
    let certs = certs::mint_as_documented(&dir().join("etcd/kustomization.yaml"), made.path());
    assert!(
        !certs.join("ca-key.pem").exists(),
        "the CA key would go into the Secret"
    );
    let (roles, lines) = check_commands(&docs, Some(&certs));
    assert_eq!(roles, ["decode", "decode", "prefill", "router"]);
    let mesh: Value = serde_yaml_ng::from_str(&mesh_file(&docs)).expect("mesh file YAML");
    let endpoint = mesh["etcd"]["endpoints"][0].as_str().expect("an endpoint");
    for l in &lines {
        for want in [
            format!("discovery etcd: {endpoint} prefix /kvmesh/kubernetes/, lease TTL 3 s, TLS with a client certificate"),
            "TLS: mutual, certificate ".to_owned(),
        ] {
            assert!(l.contains(&want), "{want} not in {l}");
        }
    }
    // The endpoint is etcd's headless Service, on its client port.
    let endpoint = endpoint.strip_prefix("https://").expect("https");
    let (host, port) = endpoint.split_once(':').expect("HOST:PORT");
    let port: u64 = port.parse().expect("port");
    let svc = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == host)
        .expect("the Service the endpoint names");
    assert!(svc["spec"]["ports"]
        .as_sequence()
        .expect("ports")
        .iter()
        .any(|p| p["port"] == port && p["name"] == "client"));
    let sts = docs
        .iter()
        .find(|d| d["kind"] == "StatefulSet" && d["spec"]["serviceName"] == host)
        .expect("etcd's StatefulSet");
    assert_eq!(sts["spec"]["replicas"], 1);
    assert_eq!(
        svc["spec"]["selector"],
        sts["spec"]["template"]["metadata"]["labels"]
    );
    let pod = &sts["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let member = format!("{}-0", sts["metadata"]["name"].as_str().expect("name"));
    let peer = format!("http://{member}.{host}:2380");
    for want in [
        format!("--name={member}"),
        format!("--listen-client-urls=https://0.0.0.0:{port}"),
        format!("--advertise-client-urls=https://{member}.{host}:{port}"),
        "--client-cert-auth".to_owned(),
        // One member: no other pod reaches its peer port.
        "--listen-peer-urls=http://127.0.0.1:2380".to_owned(),
        format!("--initial-advertise-peer-urls={peer}"),
        format!("--initial-cluster={member}={peer}"),
    ] {
        assert!(args.contains(&want.as_str()), "{want} not in {args:?}");
    }
    // The probes ask /health on the metrics listener (no client
    // certificate there).
    let metrics = args
        .iter()
        .find_map(|a| a.strip_prefix("--listen-metrics-urls=http://0.0.0.0:"))
        .expect("a metrics listener");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["path"], "/health");
        let port = c[probe]["httpGet"]["port"].as_str().expect("a named port");
        let number = c["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .find(|p| p["name"] == port)
            .and_then(|p| p["containerPort"].as_u64());
        assert_eq!(
            number.map(|n| n.to_string()).as_deref(),
            Some(metrics),
            "{probe}"
        );
    }
    // Its certificate, key and CA: items of the Secret the documented
    // command's folder makes, where its flags read them, 0440 in the group
    // etcd runs as.
    let mount = c["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "certs")
        .expect("a certs mount");
    let volume = pod["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "certs")
        .expect("the certs volume");
    assert_eq!(volume["secret"]["secretName"], "kvmesh-certs");
    assert_eq!(volume["secret"]["defaultMode"], 0o440);
    assert_eq!(
        pod["securityContext"]["fsGroup"],
        pod["securityContext"]["runAsGroup"]
    );
    let dir_in = mount["mountPath"].as_str().expect("mountPath");
    let mut etcd_cert = None;
    for flag in ["--cert-file=", "--key-file=", "--trusted-ca-file="] {
        let file = args
            .iter()
            .find_map(|a| a.strip_prefix(flag))
            .unwrap_or_else(|| panic!("{flag} not in {args:?}"));
        let item = volume["secret"]["items"]
            .as_sequence()
            .expect("items")
            .iter()
            .find(|i| {
                i["path"]
                    .as_str()
                    .map(|p| format!("{dir_in}/{p}"))
                    .as_deref()
                    == Some(file)
            })
            .unwrap_or_else(|| panic!("{file} is not mounted"));
        let key = item["key"].as_str().expect("key");
        assert!(certs.join(key).is_file(), "the Secret has no {key}");
        if flag == "--cert-file=" {
            etcd_cert = key.strip_suffix(".pem").map(str::to_owned);
        }
    }
    let etcd_cert = etcd_cert.expect("etcd's certificate");
    // What the peers dial: etcd at the endpoint and its advertised URL,
    // each node at its grpc and kv addresses.
    for addr in [endpoint.to_owned(), format!("{member}.{host}:{port}")] {
        assert!(
            certs::handshake(&certs, &etcd_cert, "router", &addr),
            "{addr}"
        );
    }
    certs::assert_every_node_handshakes(&certs, &mesh);
    // The image is deploy/etcd's (Debian's etcd-server), whose user the pod
    // runs as, with its data folder on the pod's volume.
    assert_eq!(c["image"], "kvmesh-etcd:latest");
    let dockerfile = std::fs::read_to_string(dir().join("../etcd/Dockerfile")).expect("Dockerfile");
    assert!(dockerfile.contains("etcd-server"));
    let uid = pod["securityContext"]["runAsUser"]
        .as_u64()
        .expect("runAsUser");
    assert!(dockerfile.contains(&format!("--uid {uid} etcd")), "{uid}");
    assert!(args.contains(&"--data-dir=/var/lib/etcd/data"));
    assert_eq!(c["volumeMounts"][0]["mountPath"], "/var/lib/etcd");
}

/// For every kvmesh pod of `docs` (a StatefulSet's: each NAME-i its role's
/// list in the mesh file names): its command is accepted with the mesh file
/// and secret as the pod sees them, its probes and grace period match the
/// drain, its memory covers the model and pool. Returns the pods' roles,
/// sorted, and their `--check-config` lines.
fn check_commands(docs: &[Value], certs: Option<&Path>) -> (Vec<String>, Vec<String>) {
    let mesh = mesh_file(docs);
    let mesh_cfg: Value = serde_yaml_ng::from_str(&mesh).expect("mesh file YAML");
    let drain_s = mesh_cfg["drain_timeout_ms"]
        .as_u64()
        .expect("drain_timeout_ms")
        / 1000;
    // The Secrets the operator makes: the mesh secret (`head -c 32`), and
    // with `certs` the certificates (`--from-file=certs/`: a key per file).
    let made = tempfile::tempdir().expect("tempdir");
    let secret = write_secret(made.path(), "mesh.secret");
    let secrets = |name: &str, key: &str| -> PathBuf {
        match (name, certs) {
            ("kvmesh-mesh-secret", _) if key == "mesh.secret" => secret.clone(),
            ("kvmesh-certs", Some(dir)) if dir.join(key).is_file() => dir.join(key),
            _ => panic!("the Secret {name} has no key {key}"),
        }
    };

    let mut roles = Vec::new();
    let mut lines = Vec::new();
    for d in docs.iter().filter(|d| {
        (d["kind"] == "StatefulSet" || d["kind"] == "Deployment")
            && d["spec"]["template"]["spec"]["containers"][0]["image"] == "kvmesh:latest"
    }) {
        let name = d["metadata"]["name"].as_str().expect("name");
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let template: Vec<&str> = c["args"]
            .as_sequence()
            .expect("args")
            .iter()
            .map(|a| a.as_str().expect("string arg"))
            .collect();
        let role = template[0];
        // A StatefulSet's pods are NAME-0, NAME-1, ...: the mesh file's
        // node names, every one of them (its replicas run the first).
        let pods: Vec<String> = if role == "router" {
            vec![String::new()]
        } else {
            let names: Vec<String> = mesh_cfg[role]
                .as_sequence()
                .expect("nodes")
                .iter()
                .map(|n| n["name"].as_str().expect("node name").to_owned())
                .collect();
            let want: Vec<String> = (0..names.len()).map(|i| format!("{name}-{i}")).collect();
            assert_eq!(names, want, "{name}: the mesh file's {role} nodes");
            let replicas = d["spec"]["replicas"].as_u64().expect("replicas") as usize;
            assert!(
                replicas >= 1 && replicas <= names.len(),
                "{name}: {replicas} replicas"
            );
            names
        };

        // The volume the manifests mount there is the mesh file and secret
        // (and the certificates): the pod's view of /etc/kvmesh, every
        // file 0440.
        let mount = &c["volumeMounts"][0];
        assert_eq!(mount["mountPath"], "/etc/kvmesh", "{name}");
        let sources = pod["volumes"][0]["projected"]["sources"]
            .as_sequence()
            .expect("a projected volume");
        assert_eq!(sources[0]["configMap"]["name"], "kvmesh-mesh");
        assert_eq!(sources[1]["secret"]["items"][0]["path"], "mesh.secret");
        assert_eq!(pod["volumes"][0]["projected"]["defaultMode"], 0o440);
        let root = tempfile::tempdir().expect("tempdir");
        let etc = root.path().join("etc/kvmesh");
        for source in sources {
            let (kind, from) = match (&source["configMap"], &source["secret"]) {
                (Value::Null, s) => ("secret", s),
                (m, Value::Null) => ("configMap", m),
                _ => panic!("{name}: a source of two kinds"),
            };
            let source_name = from["name"].as_str().expect("source name");
            for item in from["items"].as_sequence().expect("items") {
                let (key, path) = (
                    item["key"].as_str().expect("key"),
                    item["path"].as_str().expect("path"),
                );
                let at = etc.join(path);
                std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
                if kind == "configMap" {
                    assert_eq!((source_name, key), ("kvmesh-mesh", "mesh.yaml"));
                    std::fs::write(&at, &mesh).expect("write mesh file");
                } else {
                    std::fs::copy(secrets(source_name, key), &at).expect("copy");
                }
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o440))
                    .expect("chmod");
            }
        }
        assert_eq!(
            pod["securityContext"]["runAsGroup"],
            pod["securityContext"]["fsGroup"]
        );
        // The grace period covers preStop and the whole drain.
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        assert!(
            grace > drain_s + 5,
            "{name}: grace {grace} s, drain {drain_s} s"
        );

        for pod_name in pods {
            let mut args: Vec<String> = template
                .iter()
                .map(|a| {
                    a.replace("$(POD_NAME)", &pod_name).replace(
                        "/etc/kvmesh/mesh.yaml",
                        &etc.join("mesh.yaml").to_string_lossy(),
                    )
                })
                .collect();
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
            // Every TLS file the mesh file names for this pod is mounted.
            let who = if role == "router" {
                "router"
            } else {
                &pod_name
            };
            for section in [&mesh_cfg["mesh"]["tls"], &mesh_cfg["etcd"]["tls"]] {
                for field in ["ca_file", "cert_file", "key_file"] {
                    if let Some(f) = section[field].as_str() {
                        let f = f.replace("{name}", who);
                        assert!(etc.join(&f).is_file(), "{name}: {f} is not mounted");
                    }
                }
            }
            if role == "router" {
                assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
            } else {
                // Readiness is the node's own gRPC health, on its gRPC port.
                let node = mesh_cfg[role]
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
                // With mesh.tls the port speaks only mutual TLS, which the
                // kubelet's gRPC probe does not: a TCP probe instead.
                let probe = if mesh_cfg["mesh"]["tls"].is_null() {
                    "grpc"
                } else {
                    "tcpSocket"
                };
                assert_eq!(c["readinessProbe"][probe]["port"], port, "{name}");
                check_memory(&pod_name, c, node, &mesh_cfg);
            }
            roles.push(role.to_owned());
            lines.push(stdout);
        }
    }
    roles.sort();
    (roles, lines)
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
