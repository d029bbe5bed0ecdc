//! Mutual TLS between the mesh's processes (issue 18 item 4), with real
//! `kvmesh router|prefill|decode` processes and certificates of a test CA
//! named in the mesh file (`mesh.tls`, `{name}` per process).
//!
//! The mesh file points the router's channel to decode and prefill's KV
//! connection at recording relays in this test (the nodes listen
//! elsewhere), so every internal byte between those processes crosses the
//! relays: a completion works, and what the relays saw holds none of the
//! KV frames' magic, the load reports' node name and model path (all three
//! cross in the clear in a mesh without TLS), the prompt or the answer.
//! Peers with a certificate of another CA, an
//! expired one or none (plaintext gRPC) are refused by the decode node and
//! counted in its `/metrics` and in the router's relay.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_integration::roles::{free_port, start, wait_healthy, write_secret};
use kvmesh_integration::{http, run_kvmesh, texts};
use kvmesh_meshauth::tls::{MeshTls, TlsFiles};
use kvmesh_meshauth::MeshSecret;
use kvmesh_proto::internal::v1::LoadRequest;
use kvmesh_testkit::tls::{TestCa, Validity};
use serde_json::json;

/// A relay from a free port on 127.0.0.1 to `to` recording every byte
/// both ways; its address.
fn recording_relay(to: u16, seen: &Arc<Mutex<Vec<u8>>>) -> u16 {
    let port = free_port();
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind relay");
    let seen = Arc::clone(seen);
    std::thread::spawn(move || {
        for inbound in listener.incoming().map_while(Result::ok) {
            let Ok(outbound) = TcpStream::connect(("127.0.0.1", to)) else {
                continue;
            };
            for (mut from, mut into) in [
                (
                    inbound.try_clone().expect("clone"),
                    outbound.try_clone().expect("clone"),
                ),
                (outbound, inbound),
            ] {
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || into.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        seen.lock().expect("seen").extend_from_slice(&buf[..n]);
                    }
                    let _ = into.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    port
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// An identity of `ca` for this test's client calls.
fn identity(ca: &TestCa, trust: &Path, dir: &Path, stem: &str, v: Validity) -> Arc<MeshTls> {
    let f = ca
        .write_node(dir, stem, &["127.0.0.1"], v)
        .expect("certificate");
    MeshTls::load(TlsFiles {
        ca: trust.to_owned(),
        cert: f.cert,
        key: f.key,
    })
    .expect("identity")
}

#[test]
fn the_mesh_talks_inside_mutual_tls_and_refuses_peers_without_a_mesh_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("certs dir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    for name in ["router", "prefill-0", "decode-0"] {
        ca.write_node(&certs, name, &["127.0.0.1", "localhost"], Validity::Current)
            .expect("node certificate");
    }
    let secret = write_secret(dir.path(), "mesh.secret");
    let [http_port, grpc_port, prefill_port, decode_port, kv_port] =
        std::array::from_fn(|_| free_port());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let decode_relay = recording_relay(decode_port, &seen);
    let kv_relay = recording_relay(kv_port, &seen);
    let text = format!(
        "model: {model}\n\
         mesh:\n  secret_file: {secret}\n  tls: {{ca_file: mesh-ca.pem, cert_file: \"certs/{{name}}.pem\", key_file: \"certs/{{name}}-key.pem\"}}\n\
         router: {{http: \"127.0.0.1:{http_port}\", grpc: \"127.0.0.1:{grpc_port}\"}}\n\
         prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{prefill_port}\"}}\n\
         decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{decode_relay}\", listen: \"127.0.0.1:{decode_port}\", kv: \"127.0.0.1:{kv_relay}\", kv_listen: \"127.0.0.1:{kv_port}\"}}\n",
        model = kvmesh_integration::tiny_model_dir().display(),
        secret = secret.display(),
    );
    let file = dir.path().join("mesh.yaml");
    std::fs::write(&file, text).expect("mesh file");
    let f = file.to_str().expect("utf-8");

    // --check-config loads each process's identity; a missing one is named.
    let out = run_kvmesh(&["decode", "--config", f, "--check-config"], &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("TLS: mutual"), "{stdout}");
    let out = run_kvmesh(
        &[
            "prefill",
            "--config",
            f,
            "--name",
            "prefill-0",
            "--check-config",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", texts(&out).1);
    std::fs::rename(certs.join("router.pem"), certs.join("router.moved")).expect("move");
    let out = run_kvmesh(&["router", "--config", f, "--check-config"], &[]);
    let (_, stderr) = texts(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("mesh.tls") && stderr.contains("router.pem"),
        "{stderr}"
    );
    std::fs::rename(certs.join("router.moved"), certs.join("router.pem")).expect("move back");

    let _decode = start("decode", &file, Some("decode-0"));
    let _prefill = start("prefill", &file, Some("prefill-0"));
    let _router = start("router", &file, None);
    let addr = format!("127.0.0.1:{http_port}");
    wait_healthy(&addr);

    let prompt = "Zebras eat grass quietly near the river";
    let r = http::complete(
        &addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    let answer = http::choice_text(&r);
    assert!(!answer.is_empty(), "{r}");
    let wire = seen.lock().expect("seen").clone();
    assert!(
        wire.len() > 10_000,
        "only {} bytes crossed the relays",
        wire.len()
    );
    // What plaintext would show: the KV frames' magic, and the load
    // reports' strings (the router polls decode every 200 ms; the report
    // names the node and its model's path).
    let model = kvmesh_integration::tiny_model_dir().display().to_string();
    for clear in [
        b"KVMW".as_slice(),
        b"decode-0".as_slice(),
        model.as_bytes(),
        prompt.as_bytes(),
        answer.as_bytes(),
    ] {
        assert!(
            !contains(&wire, clear),
            "{:?} crossed in the clear",
            String::from_utf8_lossy(clear)
        );
    }

    // `kvmesh doctor` asks the nodes inside TLS (as the router does).
    let out = run_kvmesh(&["doctor", "--config", f, "--json"], &[]);
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "doctor: {stdout} {stderr}");

    // Peers without a certificate of the mesh's CA (each proving the right
    // secret) are refused by the decode node.
    let other = TestCa::new(dir.path(), "other").expect("other ca");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mesh_secret = MeshSecret::load(&secret).expect("secret");
    let ask = |tls: Option<Arc<MeshTls>>| {
        rt.block_on(async {
            let url = format!("http://127.0.0.1:{decode_port}");
            let channel = kvmesh_proto::peer::channel(&url, tls.as_ref(), Duration::from_secs(2))
                .expect("channel");
            let mut client =
                kvmesh_proto::peer::decode_client(channel, mesh_secret.clone(), "decode-0");
            tokio::time::timeout(
                Duration::from_secs(5),
                client.load(LoadRequest {
                    known_cache_epoch: 0,
                }),
            )
            .await
            .is_ok_and(|r| r.is_ok())
        })
    };
    let good = identity(&ca, &ca.ca_file, dir.path(), "doctor", Validity::Current);
    assert!(
        ask(Some(good)),
        "a peer with a mesh certificate was refused"
    );
    let stranger = identity(
        &other,
        &ca.ca_file,
        dir.path(),
        "stranger",
        Validity::Current,
    );
    assert!(
        !ask(Some(stranger)),
        "another CA's certificate was accepted"
    );
    let expired = identity(&ca, &ca.ca_file, dir.path(), "expired", Validity::Expired);
    assert!(!ask(Some(expired)), "an expired certificate was accepted");
    assert!(!ask(None), "plaintext gRPC was accepted");

    // Counted by the node, relayed by the router.
    let t0 = std::time::Instant::now();
    loop {
        let m = http::metrics(&addr);
        let got = |kind: &str| {
            m.first(
                "kvmesh_node_auth_refused_total",
                &[("node", "decode-0"), ("via", "tls"), ("kind", kind)],
            )
            .unwrap_or(0.0)
        };
        if got("unknown_ca") >= 1.0 && got("expired") >= 1.0 && got("handshake") >= 1.0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "refusals not counted: {}",
            m.text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Issue 35 item 1: membership through etcd runs inside mutual TLS, and
/// etcd itself over TLS with a client certificate per process
/// (`--client-cert-auth`); a node whose etcd certificate is of another CA
/// cannot register; and a mesh on etcd without `mesh.tls` is refused at
/// start unless the file says `allow_insecure_etcd: true`.
#[test]
fn an_etcd_mesh_runs_inside_mutual_tls_and_reaches_etcd_with_client_certificates() {
    use kvmesh_integration::etcd::{Etcd, EtcdServerTls};
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("certs dir");
    let mesh_ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let etcd_ca = TestCa::new(dir.path(), "etcd").expect("etcd ca");
    let rogue_ca = TestCa::new(dir.path(), "rogue").expect("rogue ca");
    for name in ["router", "prefill-0", "decode-0"] {
        mesh_ca
            .write_node(&certs, name, &["127.0.0.1", "localhost"], Validity::Current)
            .expect("node certificate");
        etcd_ca
            .write_node(&certs, &format!("etcd-{name}"), &[name], Validity::Current)
            .expect("etcd client certificate");
        rogue_ca
            .write_node(&certs, &format!("rogue-{name}"), &[name], Validity::Current)
            .expect("rogue certificate");
    }
    let server = etcd_ca
        .write_node(dir.path(), "etcd-server", &["127.0.0.1"], Validity::Current)
        .expect("etcd server certificate");
    let etcd = Etcd::start_tls(EtcdServerTls {
        cert: server.cert,
        key: server.key,
        ca: etcd_ca.ca_file.clone(),
    });
    let secret = write_secret(dir.path(), "mesh.secret");
    let [http_port, grpc_port, prefill_port, decode_port, kv_port] =
        std::array::from_fn(|_| free_port());
    let mesh = |etcd_certs: &str, mesh_tls: bool| {
        format!(
            "model: {model}\n\
             mesh:\n  secret_file: {secret}\n{tls}\
             discovery: etcd\n\
             etcd: {{endpoints: [\"https://{endpoint}\"], prefix: /kvmesh-test/tls-{pid}/, tls: {{ca_file: etcd-ca.pem, cert_file: \"certs/{etcd_certs}-{{name}}.pem\", key_file: \"certs/{etcd_certs}-{{name}}-key.pem\"}}}}\n\
             router: {{http: \"127.0.0.1:{http_port}\", grpc: \"127.0.0.1:{grpc_port}\"}}\n\
             prefill:\n  - {{name: prefill-0, grpc: \"127.0.0.1:{prefill_port}\"}}\n\
             decode:\n  - {{name: decode-0, grpc: \"127.0.0.1:{decode_port}\", kv: \"127.0.0.1:{kv_port}\"}}\n",
            model = kvmesh_integration::tiny_model_dir().display(),
            secret = secret.display(),
            tls = if mesh_tls {
                "  tls: {ca_file: mesh-ca.pem, cert_file: \"certs/{name}.pem\", key_file: \"certs/{name}-key.pem\"}\n"
            } else {
                ""
            },
            endpoint = etcd.endpoint(),
            pid = std::process::id(),
        )
    };
    // Without mesh.tls: refused at start, naming the way out.
    let plain = dir.path().join("plain.yaml");
    std::fs::write(&plain, mesh("etcd", false)).expect("mesh file");
    let out = run_kvmesh(
        &[
            "router",
            "--config",
            plain.to_str().expect("utf-8"),
            "--check-config",
        ],
        &[],
    );
    let (_, stderr) = texts(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("discovery: etcd needs mutual TLS")
            && stderr.contains("allow_insecure_etcd"),
        "{stderr}"
    );

    // A node whose etcd client certificate is of another CA: etcd refuses
    // its registration and it does not start.
    let rogue = dir.path().join("rogue.yaml");
    std::fs::write(&rogue, mesh("rogue", true)).expect("mesh file");
    let out = run_kvmesh(
        &[
            "decode",
            "--config",
            rogue.to_str().expect("utf-8"),
            "--name",
            "decode-0",
        ],
        &[],
    );
    let (_, stderr) = texts(&out);
    assert!(!out.status.success(), "a rogue etcd client started");
    assert!(
        stderr.contains("registering") && stderr.contains("in etcd"),
        "{stderr}"
    );

    // The mesh: every call inside mutual TLS, membership over etcd's TLS.
    let file = dir.path().join("mesh.yaml");
    std::fs::write(&file, mesh("etcd", true)).expect("mesh file");
    let out = run_kvmesh(
        &[
            "router",
            "--config",
            file.to_str().expect("utf-8"),
            "--check-config",
        ],
        &[],
    );
    let (stdout, stderr) = texts(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("TLS with a client certificate") && stdout.contains("https://"),
        "{stdout}"
    );
    let _d = start("decode", &file, Some("decode-0"));
    let _p = start("prefill", &file, Some("prefill-0"));
    let _r = start("router", &file, None);
    let addr = format!("127.0.0.1:{http_port}");
    wait_healthy(&addr);
    let prompt = "The membership of this mesh lives in an etcd behind TLS";
    let want =
        kvmesh_integration::reference_text(&kvmesh_integration::tiny_model_dir(), prompt, false, 8);
    let r = http::post(
        &addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], want.as_str());
}
