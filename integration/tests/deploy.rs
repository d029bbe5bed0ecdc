//! Multi-process meshes from one mesh file, and the deployment files: every
//! command docker-compose.yml runs is accepted by the binary (no container
//! engine runs here; bad mesh files are mesh_file.rs's), and a mesh of 2
//! prefill and 2 decode processes serves 32
//! concurrent streams equal to the reference, and survives losing a node.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvmesh_integration::http::{self, post_streaming};
use kvmesh_integration::roles::{
    free_port, start, start_two_by_two, tiny_mesh_file, two_by_two_mesh_file, wait_healthy,
    write_secret,
};
use kvmesh_integration::{certs, run_kvmesh, texts, tiny_model_dir};
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every kvmesh service of the compose file `file` runs a command the
/// binary accepts (`--check-config`) with the files its volumes mount at
/// their container paths; returns (role, `--check-config` line) per kvmesh
/// service, sorted, and the services that are not kvmesh's.
fn check_compose(file: &str) -> (Vec<(String, String)>, Vec<String>) {
    let compose: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(repo().join(file)).expect("compose file"))
            .expect("compose YAML");
    let services = compose["services"].as_mapping().expect("services");
    // The mesh secret is the operator's (`head -c 32 /dev/urandom >
    // deploy/mesh.secret`), never committed: make one as they would; and
    // the certificates, where the file's header says how (`kvmesh certs`).
    let secrets = tempfile::tempdir().expect("tempdir");
    let operator_secret = write_secret(secrets.path(), "mesh.secret");
    let text = std::fs::read_to_string(repo().join(file)).expect("compose file");
    if text.contains("kvmesh certs ") {
        certs::mint_as_documented(&repo().join(file), secrets.path());
    }
    let mut roles = Vec::new();
    let mut others = Vec::new();
    for (name, svc) in services {
        let name = name.as_str().expect("service name").to_owned();
        if !svc["image"]
            .as_str()
            .is_some_and(|i| i == "kvmesh:latest" || i == "kvmesh:cuda")
        {
            others.push(name);
            continue;
        }
        let mut args: Vec<String> = svc["command"]
            .as_sequence()
            .expect("command list")
            .iter()
            .map(|a| a.as_str().expect("string arg").to_owned())
            .collect();
        // Each service's file system: the files its volumes mount, at
        // their container paths under a root of its own (so the mesh
        // file's relative secret path resolves as in the container).
        let root = tempfile::tempdir().expect("tempdir");
        for v in svc["volumes"].as_sequence().into_iter().flatten() {
            let v = v.as_str().expect("volume");
            let mut parts = v.split(':');
            let (host, inside) = (
                parts.next().expect("host"),
                parts.next().expect("container"),
            );
            let at = root.path().join(inside.trim_start_matches('/'));
            std::fs::create_dir_all(at.parent().expect("parent")).expect("mkdir");
            let from = if host.ends_with(".secret") {
                operator_secret.clone()
            } else if host.starts_with("./deploy/certs/") {
                secrets.path().join(host)
            } else {
                repo().join(host)
            };
            std::fs::copy(&from, &at).unwrap_or_else(|e| panic!("{name:?}: {v}: {e}"));
            for a in &mut args {
                if a == inside {
                    *a = at.to_string_lossy().into_owned();
                }
            }
        }
        args.push("--check-config".into());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run_kvmesh(&refs, &[]);
        let (stdout, stderr) = texts(&out);
        assert!(
            out.status.success(),
            "{file}: service {name:?}: kvmesh {args:?}: {stderr}"
        );
        assert!(stdout.starts_with("config ok"), "{stdout}");
        assert!(!stderr.contains("readable by other users"), "{stderr}");
        // Every service authenticates its peers with the mounted secret.
        assert!(
            stdout.contains("mesh auth: secret file") && stdout.contains("mesh.secret"),
            "{stdout}"
        );
        roles.push((args[0].clone(), stdout));
    }
    roles.sort();
    (roles, others)
}

#[test]
fn every_compose_command_is_accepted() {
    let (roles, others) = check_compose("docker-compose.yml");
    let names: Vec<&str> = roles.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(names, ["decode", "prefill", "router"]);
    assert!(others.is_empty(), "{others:?}");
    // The image bakes the model the mesh file names, and the mesh file.
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    let mesh = std::fs::read_to_string(repo().join("deploy/mesh.yaml")).expect("mesh file");
    let model_line = mesh
        .lines()
        .find(|l| l.starts_with("model:"))
        .expect("model line");
    let model = model_line.trim_start_matches("model:").trim();
    assert!(
        dockerfile.contains(&format!("COPY --from=kvmesh {model} {model}")),
        "{model}"
    );
    assert!(dockerfile.contains("COPY deploy/mesh.yaml /etc/kvmesh/mesh.yaml"));
}

/// The GPU variant: prefill and decode on a GPU each of one host (device
/// reservations of the NVIDIA driver, different device ids), `device: cuda`
/// in their mesh file and the router on the CPU; the image built with the
/// CUDA libraries, which the Dockerfile installs from the pinned wheels.
#[test]
fn every_compose_command_of_the_gpu_variant_is_accepted() {
    let (roles, others) = check_compose("docker-compose.gpu.yml");
    let names: Vec<&str> = roles.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(names, ["decode", "prefill", "router"]);
    assert!(others.is_empty(), "{others:?}");
    for (role, line) in &roles {
        let want = if role == "router" {
            "device cpu"
        } else {
            "device cuda:0"
        };
        assert!(line.contains(want), "{role}: {line}");
    }
    let compose: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("docker-compose.gpu.yml")).expect("compose file"),
    )
    .expect("compose YAML");
    let gpus = |svc: &str| -> Vec<String> {
        let devices = &compose["services"][svc]["deploy"]["resources"]["reservations"]["devices"];
        let d = &devices.as_sequence().expect("device reservations")[0];
        assert_eq!(d["driver"].as_str(), Some("nvidia"), "{svc}");
        assert!(
            d["capabilities"]
                .as_sequence()
                .is_some_and(|c| c.iter().any(|c| c.as_str() == Some("gpu"))),
            "{svc}"
        );
        d["device_ids"]
            .as_sequence()
            .expect("device ids")
            .iter()
            .map(|i| i.as_str().expect("id").to_owned())
            .collect()
    };
    let (p, d) = (gpus("prefill-0"), gpus("decode-0"));
    assert_eq!(p.len(), 1);
    assert_eq!(d.len(), 1);
    assert_ne!(p, d, "prefill and decode on different GPUs");
    assert!(
        compose["services"]["router"]["deploy"].is_null(),
        "the router reserves no GPU"
    );
    assert_eq!(
        compose["services"]["decode-0"]["build"]["args"]["CUDA"].as_str(),
        Some("1")
    );
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    for pin in [
        "nvidia-cuda-nvrtc==13.0.88",
        "nvidia-cublas==13.0.2.14",
        "ENV KVMESH_CUDA_LIB_DIR=/opt/kvmesh/cuda/lib",
    ] {
        assert!(dockerfile.contains(pin), "{pin}");
    }
    // The GPU mesh file is the CPU one with the device added.
    let cpu = std::fs::read_to_string(repo().join("deploy/mesh.yaml")).expect("mesh");
    let gpu = std::fs::read_to_string(repo().join("deploy/mesh-gpu.yaml")).expect("mesh");
    let body = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#') && !l.starts_with("device:"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        body(&cpu),
        body(&gpu),
        "deploy/mesh-gpu.yaml drifted from deploy/mesh.yaml"
    );
}

/// The etcd-discovered variant (issue 18 item 5): the same roles (and a
/// second decode node behind a profile) on deploy/mesh-etcd.yaml, whose
/// etcd endpoint is the compose file's etcd service and whose prefix is
/// its own; the etcd image is Debian's package. Everything inside TLS
/// (issue 35 item 1): each service's `--check-config` takes mutual TLS and
/// etcd over https with the certificates the header's `kvmesh certs`
/// command makes, mounted as the file mounts them; etcd serves TLS to
/// clients with a certificate of that CA, from files the same command
/// made; and each certificate passes the mesh's TLS for the address its
/// peers dial.
#[test]
fn every_compose_command_of_the_etcd_variant_is_accepted() {
    let (roles, others) = check_compose("docker-compose.etcd.yml");
    let names: Vec<&str> = roles.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(names, ["decode", "decode", "prefill", "router"]);
    assert_eq!(others, ["etcd"]);
    for (role, line) in &roles {
        for want in [
            "discovery etcd: https://etcd:2379 prefix /kvmesh/compose/, lease TTL 3 s, TLS with a client certificate",
            "TLS: mutual, certificate ",
        ] {
            assert!(line.contains(want), "{role}: {line}");
        }
    }
    let compose: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("docker-compose.etcd.yml")).expect("compose file"),
    )
    .expect("compose YAML");
    let etcd = &compose["services"]["etcd"];
    let args: Vec<&str> = etcd["command"]
        .as_sequence()
        .expect("etcd command")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    for want in [
        "--listen-client-urls=https://0.0.0.0:2379",
        "--advertise-client-urls=https://etcd:2379",
        "--client-cert-auth",
        // One member: no other host reaches its peer port.
        "--listen-peer-urls=http://127.0.0.1:2380",
    ] {
        assert!(args.contains(&want), "{want} not in {args:?}");
    }
    // etcd's certificate, key and CA are files the documented command
    // makes, mounted where its flags read them.
    let dir = tempfile::tempdir().expect("tempdir");
    let minted = certs::mint_as_documented(&repo().join("docker-compose.etcd.yml"), dir.path());
    let mounts: Vec<(&str, &str)> = etcd["volumes"]
        .as_sequence()
        .expect("etcd volumes")
        .iter()
        .filter_map(|v| v.as_str()?.split_once(':'))
        .collect();
    let mut etcd_stem = None;
    for flag in ["--cert-file=", "--key-file=", "--trusted-ca-file="] {
        let inside = args
            .iter()
            .find_map(|a| a.strip_prefix(flag))
            .unwrap_or_else(|| panic!("{flag} not in {args:?}"));
        let (host, _) = mounts
            .iter()
            .find(|(_, rest)| rest.split(':').next() == Some(inside))
            .unwrap_or_else(|| panic!("{inside} is not mounted: {mounts:?}"));
        let file = host
            .strip_prefix("./deploy/certs/")
            .expect("from deploy/certs");
        assert!(minted.join(file).is_file(), "{file} was not made");
        if flag == "--cert-file=" {
            etcd_stem = file.strip_suffix(".pem").map(str::to_owned);
        }
    }
    let etcd_stem = etcd_stem.expect("etcd's certificate");
    // Each certificate passes the mesh's TLS for what its peers dial: etcd
    // as the endpoint names it, each node at its grpc and kv hosts.
    let mesh: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(repo().join("deploy/mesh-etcd.yaml")).expect("mesh file"),
    )
    .expect("mesh YAML");
    let endpoint = mesh["etcd"]["endpoints"][0].as_str().expect("endpoint");
    let endpoint = endpoint.strip_prefix("https://").expect("https");
    assert!(certs::handshake(&minted, &etcd_stem, "router", endpoint));
    certs::assert_every_node_handshakes(&minted, &mesh);
    assert!(!certs::handshake(
        &minted,
        "decode-0",
        "router",
        "decode-1:7201"
    ));
    // The nodes wait for etcd; the second decode node joins on demand.
    for svc in ["decode-0", "decode-1", "prefill-0", "router"] {
        let deps = &compose["services"][svc]["depends_on"];
        assert!(
            deps.as_sequence()
                .is_some_and(|d| d.iter().any(|s| s.as_str() == Some("etcd"))),
            "{svc} does not depend on etcd"
        );
    }
    assert_eq!(
        compose["services"]["decode-1"]["profiles"][0].as_str(),
        Some("more")
    );
    let build = etcd["build"].as_str().expect("etcd build context");
    let dockerfile =
        std::fs::read_to_string(repo().join(build).join("Dockerfile")).expect("etcd Dockerfile");
    assert!(dockerfile.contains("apt-get install -y --no-install-recommends etcd-server"));
    // Only the Dockerfile is in its build context (no secret travels).
    let context: Vec<_> = std::fs::read_dir(repo().join(build))
        .expect("context")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(context, ["Dockerfile"]);
}

fn reference(prompt: &str, n: usize) -> String {
    kvmesh_integration::reference_text(&tiny_model_dir(), prompt, false, n)
}

/// The `error.code` of an OpenAI-style error body or SSE error event.
fn error_code(e: &str) -> Option<String> {
    let v: Value = serde_json::from_str(e).ok()?;
    Some(v["error"]["code"].as_str()?.to_owned())
}

fn complete(addr: &str, prompt: &str, n: usize, stream: bool) -> Result<String, String> {
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream});
    if !stream {
        let r = http::post(addr, "/v1/completions", &body);
        if r.status != 200 {
            return Err(r.body);
        }
        return Ok(r.json()["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned());
    }
    let mut s = post_streaming(addr, "/v1/completions", &body);
    if s.status != 200 {
        return Err(format!("status {}", s.status));
    }
    let mut text = String::new();
    while let Some(d) = s.next_event() {
        if d == "[DONE]" {
            return Ok(text);
        }
        let v: Value = serde_json::from_str(&d).map_err(|e| e.to_string())?;
        if v.get("error").is_some() {
            return Err(d);
        }
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    Err("stream ended without [DONE]".into())
}

#[test]
fn two_prefill_two_decode_processes_serve_32_concurrent_streams() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, addr) = two_by_two_mesh_file(dir.path());
    let mut procs = start_two_by_two(&file, &addr);

    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Prompt number {i}: the {} quick brown foxes", i * 7))
        .collect();
    let want: Vec<String> = prompts.iter().map(|p| reference(p, 40)).collect();
    let handles: Vec<_> = (0..32)
        .map(|i| {
            let (addr, prompt, want) = (addr.clone(), prompts[i % 8].clone(), want[i % 8].clone());
            std::thread::spawn(move || {
                let got = complete(&addr, &prompt, 40, i % 2 == 0);
                assert_eq!(got.as_deref(), Ok(want.as_str()), "stream {i}");
            })
        })
        .collect();
    for h in handles {
        h.join().expect("stream thread");
    }
    // Reports lag by a poll; both decode nodes took work.
    http::wait_fresh_reports(&addr, &["decode-0", "decode-1"]);
    let metrics = http::metrics(&addr);
    let per_node: Vec<f64> = ["decode-0", "decode-1"]
        .iter()
        .map(|n| {
            metrics
                .value(
                    "kvmesh_node_reservations_total",
                    &[("node", n), ("outcome", "completed")],
                )
                .unwrap_or(0.0)
        })
        .collect();
    assert_eq!(per_node.iter().sum::<f64>(), 32.0, "{}", metrics.text());
    assert!(
        per_node.iter().all(|&n| n > 0.0),
        "both decode nodes serve: {per_node:?}"
    );

    // A decode node dies: the router takes it out and the rest serve.
    drop(procs.remove(1));
    let t0 = Instant::now();
    for i in 0..8 {
        let r = complete(&addr, &prompts[i], 40, false);
        match r {
            Ok(text) => assert_eq!(text, want[i]),
            // A request routed to the dead node before the router noticed
            // fails fast with a clear error, never hangs.
            // (`decode_failed`: the client is told which role failed,
            // never the node's name or words).
            Err(e) => assert_eq!(error_code(&e), Some("decode_failed".into()), "{e}"),
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "requests after a node died took {:?}",
        t0.elapsed()
    );
    kvmesh_integration::roles::wait_node_down(&addr, "decode-1");
    for i in 0..4 {
        assert_eq!(
            complete(&addr, &prompts[i], 40, true).as_deref(),
            Ok(want[i].as_str())
        );
    }
    let up = http::get(&addr, "/metrics").body;
    assert!(
        up.contains("kvmesh_node_up{node=\"decode-1\",role=\"decode\"} 0"),
        "{up}"
    );
    drop(procs);
}

/// A decode node killed and started again at its address takes traffic
/// again, with no restart of the others: the prefill node opens a new KV
/// connection to it (the new process knows no writer, and refuses every
/// grant for one that has not connected: `writer_not_connected`).
#[test]
fn a_restarted_decode_node_takes_traffic_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, p) = tiny_mesh_file(dir.path());
    let decode = start("decode", &file, Some("decode-0"));
    let _prefill = start("prefill", &file, Some("prefill-0"));
    let _router = start("router", &file, None);
    let addr = format!("127.0.0.1:{}", p[0]);
    wait_healthy(&addr);
    let want = reference("Hello world", 8);
    assert_eq!(
        complete(&addr, "Hello world", 8, false).as_deref(),
        Ok(want.as_str())
    );
    drop(decode);
    let t0 = Instant::now();
    while http::get(&addr, "/health").status == 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the router never saw the decode node go"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _decode = start("decode", &file, Some("decode-0"));
    wait_healthy(&addr);
    for stream in [false, true, false] {
        assert_eq!(
            complete(&addr, "Hello world", 8, stream).as_deref(),
            Ok(want.as_str()),
            "after the restart (stream={stream})"
        );
    }
}

/// A decode node dies while it streams: the client gets a clear error
/// within seconds (not a hang), and the router takes the node out. Also:
/// a full queue answers 429 at once.
#[test]
fn a_dead_decode_node_fails_its_streams_fast() {
    let Some(model) = kvmesh_model::default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped (run `kvmesh fetch-model`)");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let p: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let mesh = format!(
        "model: {}\nmax_model_len: 512\nrouter: {{http: \"127.0.0.1:{}\", grpc: \"127.0.0.1:{}\", max_running: 1, max_queued: 0}}\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{}\"}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{}\", kv: \"127.0.0.1:{}\"}}\n",
        model.display(),
        p[0], p[1], p[2], p[3], p[4]
    );
    let file = dir.path().join("mesh.yaml");
    let secret = write_secret(dir.path(), "mesh.secret");
    let mesh = format!("{mesh}mesh: {{secret_file: {}}}\n", secret.display());
    std::fs::write(&file, mesh).expect("write mesh file");
    let d0 = start("decode", &file, Some("decode-0"));
    let _p0 = start("prefill", &file, Some("prefill-0"));
    let _router = start("router", &file, None);
    let addr = format!("127.0.0.1:{}", p[0]);
    wait_healthy(&addr);
    let body = json!({"prompt": "Once upon a time, in a land far away,", "max_tokens": 400, "temperature": 0, "stream": true});
    let mut s = post_streaming(&addr, "/v1/completions", &body);
    assert_eq!(s.status, 200);
    for _ in 0..2 {
        let ev = s.next_event().expect("an event");
        assert!(ev.contains("\"text\""), "{ev}");
    }
    // Saturation: one request runs, none may queue: the next gets 429 at
    // once, never an unbounded wait.
    let r = http::post(
        &addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    drop(d0);
    let killed = Instant::now();
    let mut error = None;
    while let Some(d) = s.next_event() {
        if d == "[DONE]" {
            break;
        }
        if d.contains("\"error\"") {
            error = Some(d);
        }
    }
    let took = killed.elapsed();
    let error = error.expect("the stream ends with an error event");
    assert_eq!(error_code(&error), Some("decode_failed".into()), "{error}");
    assert!(
        !error.contains("decode-0"),
        "a node name reached the client: {error}"
    );
    assert!(took < Duration::from_secs(5), "the failure took {took:?}");
    // The router takes the node out; new requests get 503, not a hang.
    kvmesh_integration::roles::wait_node_down(&addr, "decode-0");
    let r = http::post(
        &addr,
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 4}),
    );
    assert_eq!(r.status, 503, "{}", r.body);
}

/// The internal services driven by hand across processes: a prefill that
/// the router stopped is refused before any compute, and the decode node's
/// abort completes through the writer's confirmation, pages back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_services_stop_and_abort_across_processes() {
    use kvmesh_meshauth::MeshSecret;
    use kvmesh_proto::internal::v1::{AbortRequest, GenerateRequest, LoadRequest, PrefillRequest};
    use kvmesh_proto::peer::{decode_client, prefill_client};

    let dir = tempfile::tempdir().expect("tempdir");
    let (file, p) = tiny_mesh_file(dir.path());
    let secret = dir.path().join("mesh.secret");
    let _d = start("decode", &file, Some("decode-0"));
    let _p = start("prefill", &file, Some("prefill-0"));
    // The test is a peer of this mesh: it holds the secret.
    let secret = MeshSecret::load(&secret).expect("mesh secret");
    let channel = |port: u16| {
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
            .expect("url")
            .connect_lazy()
    };
    let mut prefill = prefill_client(channel(p[2]), secret.clone(), "prefill-0");
    let mut decode = decode_client(channel(p[3]), secret, "decode-0");

    let writer_id = prefill
        .load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner()
        .writer_id;
    assert_eq!(writer_id.len(), 16);
    // The stream stays open to the end (its drop would abort).
    let mut stream = decode
        .generate(GenerateRequest {
            prompt_ids: vec![1, 2, 3, 4, 5],
            max_new_tokens: 4,
            writer_id,
            sampling: None,
            stop_token_ids: Vec::new(),
            cache_namespace: Vec::new(),
        })
        .await
        .expect("generate")
        .into_inner();
    let grant = kvmesh_integration::nodes::first_grant(&mut stream).await;
    let before = decode
        .load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner();
    assert!(before.kv_pages_free < before.kv_pages_total);

    let stop = AbortRequest {
        reservation_id: grant.reservation_id.clone(),
        reason: 1,
    };
    prefill.abort(stop.clone()).await.expect("prefill abort");
    let err = prefill
        .prefill(PrefillRequest {
            prompt_ids: vec![1, 2, 3, 4, 5],
            grant: grant.grant.clone(),
            ..PrefillRequest::default()
        })
        .await
        .expect_err("stopped before compute");
    assert_eq!(err.code(), tonic::Code::Aborted, "{err}");
    // A prompt that is not the grant's is refused too (the node's re-check).
    let err = prefill
        .prefill(PrefillRequest {
            prompt_ids: vec![1, 2, 3],
            grant: grant.grant.clone(),
            ..PrefillRequest::default()
        })
        .await
        .expect_err("prompt is not the grant's");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    let state = decode
        .abort(stop)
        .await
        .expect("decode abort")
        .into_inner()
        .state;
    assert_eq!(state, "aborting");
    let t0 = Instant::now();
    loop {
        let r = decode
            .load(LoadRequest::default())
            .await
            .expect("load")
            .into_inner();
        if r.kv_pages_free == r.kv_pages_total && r.reservations_ended.get("aborted") == Some(&1) {
            assert_eq!(r.reservations_granted, 1);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "abort never confirmed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
