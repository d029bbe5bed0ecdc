//! Membership through etcd (issue 18 item 2), against a real etcd on
//! loopback (one for this binary, a key prefix per test) and real
//! processes (the committed tiny model; every answer is checked against
//! the reference engine):
//!
//! - a node killed with SIGKILL leaves the router's membership within its
//!   lease TTL (measured, printed);
//! - a new decode node joins and takes traffic with nothing restarted
//!   (measured, printed);
//! - a restarted router rebuilds its view from etcd;
//! - SIGTERM deregisters a node before it drains;
//! - a node registered without the mesh secret is never used, and entries
//!   that are not registrations are refused and counted.
//!
//! The registrar itself (names, lost leases) is `etcd_registrar.rs`.
//!
//! The router losing etcd itself is `etcd_outage.rs` (it kills its etcd).

use std::time::{Duration, Instant};

use kvmesh_integration::etcd::{Etcd, EtcdMesh};
use kvmesh_integration::http::{self, post_streaming_headers};
use kvmesh_integration::roles::wait_healthy;
use kvmesh_integration::{reference_text, tiny_model_dir};
use kvmesh_meshauth::MeshSecret;
use kvmesh_proto::internal::v1::{LoadReport, LoadRequest};
use serde_json::{json, Value};

/// The mesh files' lease TTL (the default).
const TTL: Duration = Duration::from_secs(3);
/// Bound on anything a test waits for.
const WITHIN: Duration = Duration::from_secs(30);

fn prompt(i: usize) -> String {
    format!(
        "Request {i} of the membership test: the {} quick brown foxes",
        i * 3
    )
}

/// A greedy completion of `prompt`, checked against the reference engine.
fn complete_checked(addr: &str, prompt: &str) {
    let want = reference_text(&tiny_model_dir(), prompt, false, 12);
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], want.as_str(), "{prompt}");
}

/// Waits until `check` holds for the router's metrics, returning how long
/// it took.
fn wait_metrics(
    addr: &str,
    what: &str,
    check: impl Fn(&kvmesh_client::Metrics) -> bool,
) -> Duration {
    let t0 = Instant::now();
    loop {
        let m = http::metrics(addr);
        if check(&m) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < WITHIN, "never {what}:\n{}", m.text());
        std::thread::sleep(Duration::from_millis(25));
    }
}

fn members(m: &kvmesh_client::Metrics, role: &str) -> f64 {
    m.value("kvmesh_discovery_members", &[("role", role)])
        .unwrap_or(-1.0)
}

/// Whether the router has the node in its view at all (every member has a
/// `kvmesh_node_up` series).
fn known(m: &kvmesh_client::Metrics, node: &str) -> bool {
    m.first("kvmesh_node_up", &[("node", node)]).is_some()
}

fn up(m: &kvmesh_client::Metrics, node: &str) -> bool {
    m.first("kvmesh_node_up", &[("node", node)]) == Some(1.0)
}

#[test]
fn a_killed_node_leaves_the_membership_within_its_lease_ttl() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "killed",
        &[
            ("prefill", "prefill-0"),
            ("decode", "decode-0"),
            ("decode", "decode-1"),
        ],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let d1 = mesh.start("decode", Some("decode-1"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_metrics(&mesh.http, "both decode nodes up", |m| {
        up(m, "decode-0") && up(m, "decode-1") && up(m, "prefill-0")
    });
    complete_checked(&mesh.http, &prompt(0));
    let key = format!("{}decode/decode-1", mesh.prefix);
    assert!(etcd.keys(&mesh.prefix).contains(&key));

    // SIGKILL: no deregistration, the lease has to run out.
    drop(d1);
    let killed = Instant::now();
    let out_of_choice = wait_metrics(&mesh.http, "decode-1 down", |m| !up(m, "decode-1"));
    let left = wait_metrics(&mesh.http, "decode-1 out of the membership", |m| {
        !known(m, "decode-1") && members(m, "decode") == 1.0
    }) + out_of_choice;
    let since_kill = killed.elapsed();
    assert!(!etcd.keys(&mesh.prefix).contains(&key));
    eprintln!(
        "MEASURED: decode-1 SIGKILLed: out of the choice after {:.2} s (load poll), out of the \
         membership after {:.2} s (lease TTL {} s, kept alive every {:.1} s)",
        out_of_choice.as_secs_f64(),
        left.as_secs_f64(),
        TTL.as_secs(),
        TTL.as_secs_f64() / 3.0
    );
    // The lease was last renewed at most a third of a TTL before the kill,
    // and etcd checks expiries every 500 ms.
    assert!(
        since_kill <= TTL + Duration::from_millis(1500),
        "left after {since_kill:?}"
    );
    for i in 1..5 {
        complete_checked(&mesh.http, &prompt(i));
    }
}

#[test]
fn a_new_decode_node_joins_and_takes_traffic_without_a_restart() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "join",
        &[
            ("prefill", "prefill-0"),
            ("decode", "decode-0"),
            ("decode", "decode-1"),
        ],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    complete_checked(&mesh.http, &prompt(0));
    let m = http::metrics(&mesh.http);
    assert_eq!(members(&m, "decode"), 1.0, "{}", m.text());
    assert!(!known(&m, "decode-1"));

    // Registered once its ready line is out.
    let _d1 = mesh.start("decode", Some("decode-1"), &[], false);
    let joined = Instant::now();
    let granted = |m: &kvmesh_client::Metrics| {
        m.value(
            "kvmesh_node_reservations_granted_total",
            &[("node", "decode-1")],
        )
        .unwrap_or(0.0)
    };
    let mut i = 1;
    let took = loop {
        // Distinct prompts: no decode node has one cached, so the choice
        // is by load, free pages, then the node sent fewest requests.
        complete_checked(&mesh.http, &prompt(i));
        i += 1;
        if granted(&http::metrics(&mesh.http)) > 0.0 {
            break joined.elapsed();
        }
        assert!(joined.elapsed() < WITHIN, "decode-1 never took a request");
        std::thread::sleep(Duration::from_millis(25));
    };
    let m = http::metrics(&mesh.http);
    assert_eq!(members(&m, "decode"), 2.0, "{}", m.text());
    eprintln!(
        "MEASURED: decode-1 registered: took traffic after {:.2} s ({} requests; its load \
         report, polled every 200 ms, says when)",
        took.as_secs_f64(),
        i - 1
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn a_restarted_router_rebuilds_its_view_from_etcd() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "router-restart",
        &[("prefill", "prefill-0"), ("decode", "decode-0")],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    complete_checked(&mesh.http, &prompt(0));
    drop(router);
    let restarted = Instant::now();
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    let took = restarted.elapsed();
    let m = http::metrics(&mesh.http);
    assert_eq!(members(&m, "decode"), 1.0, "{}", m.text());
    assert_eq!(members(&m, "prefill"), 1.0, "{}", m.text());
    assert_eq!(
        m.value("kvmesh_discovery_degraded", &[("source", "etcd")]),
        Some(0.0)
    );
    complete_checked(&mesh.http, &prompt(1));
    eprintln!(
        "MEASURED: a restarted router was healthy with its view from etcd {:.2} s after it was started",
        took.as_secs_f64()
    );
}

/// A registration deleted by hand (or by anyone who can write the prefix)
/// while its lease lives: the node writes it again with its next
/// keep-alive, and the router takes it back.
#[test]
fn a_deleted_registration_is_written_again() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "deleted",
        &[("prefill", "prefill-0"), ("decode", "decode-0")],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    let key = format!("{}decode/decode-0", mesh.prefix);
    etcd.delete(&key);
    let deleted = Instant::now();
    wait_metrics(&mesh.http, "decode-0 out", |m| members(m, "decode") == 0.0);
    wait_metrics(&mesh.http, "decode-0 back", |m| {
        members(m, "decode") == 1.0 && up(m, "decode-0")
    });
    let back = deleted.elapsed();
    assert!(etcd.keys(&mesh.prefix).contains(&key));
    assert!(back < TTL, "{back:?}");
    complete_checked(&mesh.http, &prompt(0));
}

#[test]
fn sigterm_deregisters_a_node_before_it_drains() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "sigterm",
        &[("prefill", "prefill-0"), ("decode", "decode-0")],
    );
    let mut d0 = mesh.start("decode", Some("decode-0"), &["--fault-injection"], true);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &["--fault-injection"], false);
    wait_healthy(&mesh.http);
    let key = format!("{}decode/decode-0", mesh.prefix);
    assert!(etcd.keys(&mesh.prefix).contains(&key));

    // A stream held up at decode, so the drain has work to wait for.
    let text = prompt(0);
    let want = reference_text(&tiny_model_dir(), &text, false, 16);
    let addr = mesh.http.clone();
    let (first, rx) = std::sync::mpsc::channel();
    let stream = std::thread::spawn(move || {
        let body = json!({"prompt": text, "max_tokens": 16, "temperature": 0, "stream": true});
        let mut s = post_streaming_headers(
            &addr,
            "/v1/completions",
            &body,
            &[("x-kvmesh-fault", "step:3=delay:2500")],
        );
        assert_eq!(s.status, 200);
        let mut out = String::new();
        let mut sent = false;
        while let Some(d) = s.next_event() {
            if !sent {
                let _ = first.send(());
                sent = true;
            }
            if d == "[DONE]" {
                return (out, Instant::now());
            }
            let v: Value = serde_json::from_str(&d).expect("JSON event");
            assert!(v.get("error").is_none(), "{v}");
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
        }
        panic!("the stream broke off: {out:?}");
    });
    rx.recv_timeout(WITHIN).expect("the stream's first event");
    d0.terminate();
    let t0 = Instant::now();
    while etcd.keys(&mesh.prefix).contains(&key) {
        assert!(t0.elapsed() < WITHIN, "decode-0 never deregistered");
        std::thread::sleep(Duration::from_millis(10));
    }
    let deregistered = Instant::now();
    // The node said so before its drain began, and the router dropped it.
    d0.log_line("deregistered from etcd", WITHIN)
        .expect("the deregistration in the node's log");
    d0.log_line("decode node draining", WITHIN)
        .expect("the drain, after the deregistration, in the node's log");
    wait_metrics(&mesh.http, "decode-0 out of the membership", |m| {
        members(m, "decode") == 0.0
    });
    let (got, ended) = stream.join().expect("stream thread");
    assert_eq!(got, want, "the stream in flight finished whole");
    assert!(
        deregistered < ended,
        "the entry must be gone while the drain still waits for the stream"
    );
    eprintln!(
        "MEASURED: SIGTERM: deregistered after {:.3} s; the stream in flight ended {:.2} s later",
        (deregistered - t0).as_secs_f64(),
        (ended - deregistered).as_secs_f64()
    );
    let status = d0.wait_exit(WITHIN).expect("decode-0 exits");
    assert!(status.success(), "{status:?}");
}

/// The load report of the node at `addr`, asked as a peer holding `secret`.
fn load_report(addr: &str, secret: &MeshSecret, decode: bool) -> LoadReport {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("url")
            .connect_lazy();
        let req = LoadRequest::default();
        let r = if decode {
            kvmesh_proto::peer::decode_client(ch, secret.clone())
                .load(req)
                .await
        } else {
            kvmesh_proto::peer::prefill_client(ch, secret.clone())
                .load(req)
                .await
        };
        r.expect("load").into_inner()
    })
}

/// The `grpc` address the mesh file gives `name`.
fn grpc_of(file: &std::path::Path, name: &str) -> String {
    let text = std::fs::read_to_string(file).expect("mesh file");
    let line = text
        .lines()
        .find(|l| l.contains(&format!("name: {name},")))
        .expect("the node's line");
    line.split("grpc: \"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("grpc address")
        .to_owned()
}

#[test]
fn a_registered_node_without_the_mesh_secret_is_never_used() {
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::new(
        etcd,
        "intruder",
        &[("prefill", "prefill-0"), ("decode", "decode-0")],
    );
    let _d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    // A node that can write to etcd but holds another secret registers
    // under the mesh's prefix (a decode and a prefill node), and entries
    // that are not registrations appear beside them.
    let (file, other) =
        mesh.intruder_file(etcd, &[("decode", "decode-x"), ("prefill", "prefill-x")]);
    let _dx = kvmesh_integration::roles::start("decode", &file, Some("decode-x"), "ready").0;
    let _px = kvmesh_integration::roles::start("prefill", &file, Some("prefill-x"), "ready").0;
    etcd.put(
        &format!("{}decode/garbage", mesh.prefix),
        b"not a registration",
    );
    etcd.put(
        &format!("{}decode/decode-y", mesh.prefix),
        br#"{"format":1,"name":"decode-z","role":"decode","grpc":"127.0.0.1:1","kv":"tcp://127.0.0.1:2"}"#,
    );
    etcd.put(&format!("{}router/r", mesh.prefix), b"{}");
    wait_metrics(&mesh.http, "the intruders in the membership", |m| {
        members(m, "decode") == 2.0
            && members(m, "prefill") == 2.0
            && m.get("kvmesh_discovery_refused_registrations_total") >= Some(3.0)
    });
    // Polled a few times, refused every time.
    std::thread::sleep(Duration::from_millis(1000));
    for i in 0..8 {
        complete_checked(&mesh.http, &prompt(i));
    }
    // Every request went to decode-0 (its load report lags by a poll).
    wait_metrics(&mesh.http, "8 grants at decode-0", |m| {
        m.value(
            "kvmesh_node_reservations_granted_total",
            &[("node", "decode-0")],
        ) == Some(8.0)
    });
    let m = http::metrics(&mesh.http);
    assert!(!up(&m, "decode-x") && !up(&m, "prefill-x"), "{}", m.text());
    // What the intruders saw: the router's polls refused by mesh
    // authentication (the router's proofs are not of their secret), no
    // grant, and (decode-x) the real prefill node's KV connections refused.
    let other = MeshSecret::load(&other).expect("intruder secret");
    let dx = load_report(&grpc_of(&file, "decode-x"), &other, true);
    assert_eq!(dx.reservations_granted, 0, "{dx:?}");
    assert!(dx.grpc_auth_refused.values().sum::<u64>() > 0, "{dx:?}");
    assert!(dx.kv_auth_refused.values().sum::<u64>() > 0, "{dx:?}");
    let px = load_report(&grpc_of(&file, "prefill-x"), &other, false);
    assert!(px.grpc_auth_refused.values().sum::<u64>() > 0, "{px:?}");
    assert_eq!(px.queue_depth, 0);
}

/// The default model (SmolLM2) through a mesh whose membership changes
/// under it: a decode node joins, the first one is SIGKILLed, and every
/// answer, before, between and after, equals the reference engine's.
#[test]
fn the_default_model_through_a_changing_etcd_mesh_equals_the_reference() {
    let Some(model) = kvmesh_model::default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped (run `kvmesh fetch-model`)");
        return;
    };
    let etcd = Etcd::shared();
    let mesh = EtcdMesh::with_model(
        etcd,
        "smollm2",
        &[
            ("prefill", "prefill-0"),
            ("decode", "decode-0"),
            ("decode", "decode-1"),
        ],
        &model,
        "max_model_len: 1024\n",
    );
    let ask = |prompt: &str| {
        let want = reference_text(&model, prompt, false, 24);
        let r = http::post(
            &mesh.http,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.as_str(), "{prompt}");
    };
    let d0 = mesh.start("decode", Some("decode-0"), &[], false);
    let _p0 = mesh.start("prefill", Some("prefill-0"), &[], false);
    let _router = mesh.start("router", None, &[], false);
    wait_healthy(&mesh.http);
    ask("The capital of France is");
    let _d1 = mesh.start("decode", Some("decode-1"), &[], false);
    wait_metrics(&mesh.http, "decode-1 up", |m| up(m, "decode-1"));
    ask("Once upon a time, in a small village,");
    drop(d0);
    wait_metrics(&mesh.http, "decode-0 out of the membership", |m| {
        !known(m, "decode-0") && members(m, "decode") == 1.0
    });
    ask("The three primary colours are");
    ask("The capital of France is");
    // Both answers after the kill came from decode-1 (its report lags a
    // poll).
    wait_metrics(&mesh.http, "decode-1's grants", |m| {
        m.value(
            "kvmesh_node_reservations_granted_total",
            &[("node", "decode-1")],
        ) >= Some(2.0)
    });
}
