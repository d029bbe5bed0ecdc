//! Mesh-internal authentication and mesh-minted identities (issue 5 item
//! 6), across real processes started from a mesh file with a secret:
//!
//! - the internal Decode and Prefill services refuse calls without a proof
//!   of the mesh secret (none, another secret, malformed, stale, replayed):
//!   UNAUTHENTICATED, counted by kind in the node's load report, nothing
//!   granted; the KV listener closes a connection whose first message is a
//!   frame; with the secret, a reserve works (and is aborted);
//! - a client that sends another request's id everywhere it can (headers,
//!   body fields) gets its own fresh id and reaches nothing of the other
//!   request, whose answer equals the reference; and an internal abort of
//!   that request's reservation from a caller without the secret is
//!   refused while it streams.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvmesh_integration::http::{self, post_streaming_headers};
use kvmesh_integration::roles::{start, start_logged, start_with, tiny_mesh_file, wait_healthy};
use kvmesh_integration::tiny_model_dir;
use kvmesh_kvwire::{decode_message, KvFrame, Message};
use kvmesh_meshauth::call::{body_digest, Call};
use kvmesh_meshauth::grpc::unix_ms;
use kvmesh_meshauth::{sign_call, MeshSecret, CALL_HEADER};
use kvmesh_proto::internal::v1::decode_client::DecodeClient;
use kvmesh_proto::internal::v1::prefill_client::PrefillClient;
use kvmesh_proto::internal::v1::{
    AbortRequest, GenerateRequest, LoadReport, LoadRequest, PrefillRequest,
};
use kvmesh_proto::peer::{decode_client, prefill_client};
use serde_json::{json, Value};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// Ports of one mesh: router http, router grpc, prefill, decode, decode KV.
struct Mesh {
    _dir: tempfile::TempDir,
    file: PathBuf,
    secret: MeshSecret,
    ports: Vec<u16>,
}

fn mesh_file() -> Mesh {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, ports) = tiny_mesh_file(dir.path());
    let secret = MeshSecret::load(&dir.path().join("mesh.secret")).expect("mesh secret");
    Mesh {
        _dir: dir,
        file,
        secret,
        ports: ports.to_vec(),
    }
}

fn channel(port: u16) -> Channel {
    Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("url")
        .connect_lazy()
}

/// A call with `token` as its proof, as a peer without the secret might
/// send one it made up, recorded or kept too long.
fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert(CALL_HEADER, token.parse().expect("ascii token"));
    r
}

/// A proof of `secret` for calling `path` on node `to` with `msg`, made at
/// `at` (unix ms): what the signing channel makes, by hand, so a test can
/// keep, replay or misdirect it.
fn token_for(
    secret: &MeshSecret,
    path: &str,
    to: &str,
    msg: &impl prost::Message,
    at: u64,
) -> String {
    // The call's body: one uncompressed gRPC frame.
    let payload = msg.encode_to_vec();
    let mut body = vec![0u8];
    body.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    body.extend_from_slice(&payload);
    let call = Call {
        path,
        recipient: to,
        body: &body_digest(&body),
    };
    sign_call(secret, &call, at).expect("sign").token
}

fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>, what: &str) -> tonic::Status {
    let e = r.expect_err(what);
    assert_eq!(e.code(), Code::Unauthenticated, "{what}: {e}");
    e
}

fn counts(m: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<_> = m
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    v.sort();
    v
}

fn kinds(pairs: &[(&str, u64)]) -> Vec<(String, u64)> {
    pairs.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
}

async fn load_decode(d: &mut DecodeClient<kvmesh_meshauth::grpc::PeerChannel>) -> LoadReport {
    d.load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_services_refuse_callers_without_the_mesh_secret() {
    let m = mesh_file();
    let _d = start("decode", &m.file, Some("decode-0"));
    let _p = start("prefill", &m.file, Some("prefill-0"));
    let (pport, dport, kvport) = (m.ports[2], m.ports[3], m.ports[4]);
    let mut decode = decode_client(channel(dport), m.secret.clone(), "decode-0");
    let mut prefill = prefill_client(channel(pport), m.secret.clone(), "prefill-0");
    let writer_id = prefill
        .load(LoadRequest::default())
        .await
        .expect("load with the secret")
        .into_inner()
        .writer_id;
    let reserve = || GenerateRequest {
        prompt_ids: vec![1, 2, 3, 4, 5],
        max_new_tokens: 4,
        writer_id: writer_id.clone(),
        sampling: None,
        stop_token_ids: Vec::new(),
        cache_namespace: Vec::new(),
    };
    let some_grant = |rid: &[u8]| AbortRequest {
        reservation_id: rid.to_vec(),
        reason: 1,
    };

    // No credentials at all: the generated clients as anyone would use
    // them.
    let mut anon_d = DecodeClient::new(channel(dport));
    let mut anon_p = PrefillClient::new(channel(pport));
    let e = refused(anon_d.generate(reserve()).await, "reserve without a proof");
    assert!(e.message().contains("missing x-kvmesh-peer"), "{e}");
    refused(
        anon_d.abort(some_grant(&[7; 16])).await,
        "abort without a proof",
    );
    refused(
        anon_d.load(LoadRequest::default()).await,
        "load without a proof",
    );
    refused(
        anon_p
            .prefill(PrefillRequest {
                prompt_ids: vec![1, 2, 3, 4, 5],
                grant: vec![0; 64],
                ..PrefillRequest::default()
            })
            .await,
        "prefill without a proof",
    );

    // A peer of another mesh: its own secret, proofs well-formed.
    let wrong = MeshSecret::generate().expect("rng");
    let mut other_d = decode_client(channel(dport), wrong.clone(), "decode-0");
    let mut other_p = prefill_client(channel(pport), wrong, "prefill-0");
    let e = refused(other_d.generate(reserve()).await, "another mesh's reserve");
    assert!(e.message().contains("does not prove"), "{e}");
    refused(
        other_d.abort(some_grant(&[7; 16])).await,
        "another mesh's abort",
    );
    refused(
        other_p
            .prefill(PrefillRequest {
                prompt_ids: vec![1, 2, 3, 4, 5],
                grant: vec![0; 64],
                ..PrefillRequest::default()
            })
            .await,
        "another mesh's prefill",
    );

    // Made up, kept past the window, replayed: all refused. A proof made
    // for Load is not one for Generate either.
    refused(
        anon_d
            .load(with_token(LoadRequest::default(), "1.2.3"))
            .await,
        "malformed",
    );
    let load_path = "/kvmesh.internal.v1.Decode/Load";
    let load = LoadRequest::default();
    let old = token_for(&m.secret, load_path, "decode-0", &load, unix_ms() - 120_000);
    refused(
        anon_d.load(with_token(LoadRequest::default(), &old)).await,
        "stale",
    );
    let once = token_for(&m.secret, load_path, "decode-0", &load, unix_ms());
    anon_d
        .load(with_token(LoadRequest::default(), &once))
        .await
        .expect("a fresh proof works once");
    refused(
        anon_d.load(with_token(LoadRequest::default(), &once)).await,
        "replayed",
    );
    let for_load = token_for(&m.secret, load_path, "decode-0", &load, unix_ms());
    refused(
        anon_d.generate(with_token(reserve(), &for_load)).await,
        "a Load proof on Generate",
    );
    // A proof names its node and its body: one made for a sibling (as one
    // captured there and replayed here would be) or for other bytes is
    // refused.
    let for_sibling = token_for(&m.secret, load_path, "decode-1", &load, unix_ms());
    let e = refused(
        anon_d.load(with_token(load, &for_sibling)).await,
        "a proof made for another node",
    );
    assert!(e.message().contains("to this node"), "{e}");
    let other_body = LoadRequest {
        known_cache_epoch: 7,
    };
    let for_default = token_for(&m.secret, load_path, "decode-0", &load, unix_ms());
    refused(
        anon_d.load(with_token(other_body, &for_default)).await,
        "a proof made for another body",
    );

    // Counted by kind, in the nodes' own load reports; nothing granted.
    let r = load_decode(&mut decode).await;
    assert_eq!(
        counts(&r.grpc_auth_refused),
        kinds(&[
            ("bad_mac", 5),
            ("malformed", 1),
            ("missing", 3),
            ("replayed", 1),
            ("stale", 1)
        ]),
        "{r:?}"
    );
    assert_eq!(r.reservations_granted, 0);
    assert_eq!(r.kv_pages_free, r.kv_pages_total);
    let pr = prefill
        .load(LoadRequest::default())
        .await
        .expect("load")
        .into_inner();
    assert_eq!(
        counts(&pr.grpc_auth_refused),
        kinds(&[("bad_mac", 1), ("missing", 1)]),
        "{pr:?}"
    );

    // The mesh's own peer: the reserve works. The stream stays open (its
    // drop would abort the reservation) until the test aborts it by id.
    let mut stream = decode
        .generate(reserve())
        .await
        .expect("generate")
        .into_inner();
    let grant = kvmesh_integration::nodes::first_grant(&mut stream).await;
    let Ok((Message::Grant(g), _)) = decode_message(&grant.grant) else {
        panic!("not a grant")
    };

    // A KV frame for that very grant, capability and all, on a connection
    // that never said Hello: the listener closes it, counts it, and the
    // frame lands nowhere.
    let slots = g.prompt_slots(0).expect("page 0");
    let kv_dim = g.geometry.kv_dim() as usize;
    let payload = vec![0u8; 2 * slots as usize * kv_dim * 4];
    let frame = KvFrame {
        reservation: g.reservation,
        capability: g.capability.clone(),
        page_index: 0,
        page: g.pages[0],
        geometry: g.geometry,
        layers: 0..1,
        slots: 0..slots,
        payload: &payload,
    };
    let mut bytes = Vec::new();
    frame.encode(&mut bytes).expect("encode frame");
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", kvport)).expect("connect KV");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(&bytes).expect("send frame");
        let mut sink = Vec::new();
        // The challenge, then the end of the stream (or a reset).
        let _ = s.read_to_end(&mut sink);
        sink.len()
    })
    .await
    .expect("join");
    assert!(
        closed < 200,
        "the listener sent {closed} bytes: only its challenge"
    );
    let t0 = Instant::now();
    loop {
        let r = load_decode(&mut decode).await;
        if r.kv_auth_refused.get("frame_before_hello") == Some(&1) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "not counted: {r:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Then the reservation is aborted, confirmed by the real writer, and
    // every page comes back; it never went live.
    let state = decode
        .abort(some_grant(&grant.reservation_id))
        .await
        .expect("abort")
        .into_inner()
        .state;
    assert_eq!(state, "aborting");
    let t0 = Instant::now();
    loop {
        let r = load_decode(&mut decode).await;
        if r.kv_pages_free == r.kv_pages_total && r.reservations_ended.get("aborted") == Some(&1) {
            assert_eq!(r.reservations_granted, 1);
            assert_eq!(
                r.reservations_ended.get("completed").copied().unwrap_or(0),
                0
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "abort never confirmed: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reference(prompt: &str, n: usize) -> String {
    kvmesh_integration::reference_text(&tiny_model_dir(), prompt, false, n)
}

/// `cmpl-` or `chatcmpl-` and 32 lowercase hex digits (128 bits).
fn assert_minted(id: &str) {
    let hex = id
        .strip_prefix("cmpl-")
        .or_else(|| id.strip_prefix("chatcmpl-"))
        .unwrap_or_else(|| panic!("unexpected id {id:?}"));
    assert_eq!(hex.len(), 32, "{id}");
    assert!(
        hex.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
        "{id}"
    );
}

fn hex16(s: &str) -> Vec<u8> {
    (0..16)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn metric(addr: &str, selector: &str) -> Option<f64> {
    http::metric(addr, selector)
}

fn wait_metric(addr: &str, prefix: &str, want: f64) {
    let t0 = Instant::now();
    while metric(addr, prefix) != Some(want) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{prefix} never {want}:\n{}",
            http::get(addr, "/metrics").body
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn client_chosen_ids_cannot_reach_another_request() {
    const LONG: usize = 200;
    let prompt_a = "Once upon a time";
    let want_a = reference(prompt_a, LONG);
    let m = mesh_file();
    // The decode node logs each grant's reservation id at debug level: the
    // test reads A's from there, as nothing a client sees carries it.
    let d = start_logged(
        "decode",
        &m.file,
        Some("decode-0"),
        "warn,kvmesh_decode=debug",
    );
    let _p = start("prefill", &m.file, Some("prefill-0"));
    // Fault injection holds A open (a 3 s pause at its fifth decode step)
    // while B tries to reach it.
    let _r = start_with("router", &m.file, None, &["--fault-injection"]);
    let addr = format!("127.0.0.1:{}", m.ports[0]);
    wait_healthy(&addr);

    // A streams a long answer; its first event names its id.
    let mut a = post_streaming_headers(
        &addr,
        "/v1/completions",
        &json!({"prompt": prompt_a, "max_tokens": LONG, "temperature": 0, "stream": true}),
        &[("x-kvmesh-fault", "step:4=delay:3000")],
    );
    assert_eq!(a.status, 200);
    let first = a.next_event().expect("A's first event");
    let first: Value = serde_json::from_str(&first).expect("json");
    let a_id = first["id"].as_str().expect("id").to_owned();
    let a_first = Instant::now();
    assert_minted(&a_id);
    let mut a_text = first["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let line = d
        .log_line("granted", Duration::from_secs(10))
        .expect("the grant's log line");
    let rid = line
        .split("reservation=")
        .nth(1)
        .map(|r| &r[..32])
        .unwrap_or_else(|| panic!("no reservation id in {line:?}"));
    let a_reservation = hex16(rid);

    // While A runs, an internal Abort naming A's reservation from a caller
    // without the secret (or with another mesh's) is refused.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let stop = AbortRequest {
            reservation_id: a_reservation.clone(),
            reason: 1,
        };
        let mut anon = DecodeClient::new(channel(m.ports[3]));
        refused(anon.abort(stop.clone()).await, "abort of A without a proof");
        let mut other = decode_client(
            channel(m.ports[3]),
            MeshSecret::generate().expect("rng"),
            "decode-0",
        );
        refused(other.abort(stop).await, "abort of A by another mesh");
    });

    // The refused abort came, and B's requests go, while A holds its
    // reservation: A's pause alone (3 s from its fifth step) outlasts this.
    assert!(
        a_first.elapsed() < Duration::from_millis(2500),
        "A may have finished already: {:?}",
        a_first.elapsed()
    );
    // B sends A's id everywhere a client can put one; each request gets its
    // own fresh id and its own answer. Body fields that name an id are
    // refused outright (the mesh mints ids), the `user` label and the
    // header are taken and not used as an id.
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "Hello world", "id": a_id}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hello world"}], "request_id": a_id}),
        ),
    ] {
        let r = http::request_headers(&addr, "POST", path, Some(&body.to_string()), &[]);
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(!r.body.contains(&a_id[a_id.len() - 32..]), "{}", r.body);
    }
    let mut b_ids = Vec::new();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "user": a_id}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 8,
                   "temperature": 0, "user": a_id}),
        ),
    ] {
        let r = http::request_headers(
            &addr,
            "POST",
            path,
            Some(&body.to_string()),
            &[("X-Request-Id", &a_id)],
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let id = r.json()["id"].as_str().expect("id").to_owned();
        assert_minted(&id);
        assert!(
            r.headers
                .iter()
                .all(|(_, v)| !v.contains(&a_id[a_id.len() - 32..])),
            "A's id echoed in B's headers: {:?}",
            r.headers
        );
        b_ids.push(id);
    }
    let mut s = post_streaming_headers(
        &addr,
        "/v1/completions",
        &json!({"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "stream": true,
                "user": a_id}),
        &[("X-Request-Id", &a_id)],
    );
    assert_eq!(s.status, 200);
    let ev: Value = serde_json::from_str(&s.next_event().expect("event")).expect("json");
    b_ids.push(ev["id"].as_str().expect("id").to_owned());
    while let Some(e) = s.next_event() {
        if e == "[DONE]" {
            break;
        }
    }
    let a_hex = &a_id[a_id.len() - 32..];
    for id in &b_ids {
        assert_minted(id);
        assert!(!id.ends_with(a_hex), "B got A's id: {id}");
    }
    let distinct: std::collections::HashSet<&str> =
        b_ids.iter().map(|i| &i[i.len() - 32..]).collect();
    assert_eq!(distinct.len(), b_ids.len(), "{b_ids:?}");

    // A completes, equal to the reference: nothing of B (nor the refused
    // abort) touched its pages.
    while let Some(e) = a.next_event() {
        if e == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&e).expect("json");
        assert!(v.get("error").is_none(), "{e}");
        assert_eq!(v["id"], a_id.as_str());
        a_text.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    assert_eq!(a_text, want_a);

    // The refusals are in the decode node's metrics; every request
    // completed on its own reservation; no guard fired; pages all back.
    let refused_metric = |kind: &str| {
        format!("kvmesh_node_auth_refused_total{{node=\"decode-0\",via=\"grpc\",kind=\"{kind}\"}}")
    };
    wait_metric(&addr, &refused_metric("missing"), 1.0);
    wait_metric(&addr, &refused_metric("bad_mac"), 1.0);
    wait_metric(
        &addr,
        "kvmesh_node_reservations_total{node=\"decode-0\",outcome=\"completed\"}",
        4.0,
    );
    wait_metric(
        &addr,
        "kvmesh_node_reservations_granted_total{node=\"decode-0\"}",
        4.0,
    );
    wait_metric(
        &addr,
        "kvmesh_node_kv_guard_violations_total{node=\"decode-0\"}",
        0.0,
    );
    let t0 = Instant::now();
    loop {
        let total = metric(&addr, "kvmesh_node_kv_pages_total{node=\"decode-0\"");
        if total.is_some() && total == metric(&addr, "kvmesh_node_kv_pages_free{node=\"decode-0\"")
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pages never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
