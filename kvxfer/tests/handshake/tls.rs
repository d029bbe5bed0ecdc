//! Mutual TLS on the TCP KV transport (issue 18 item 4): a transfer inside
//! TLS lands and verifies like any other, and the bytes on the wire are
//! not the KV or the handshake's messages (a relay between writer and
//! decode node records them; the same relay sees them in the clear without
//! TLS, so the check can fail); a writer whose certificate is of another
//! CA or expired, or one that speaks plaintext, never reaches the table and
//! is counted by kind.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvmesh_kvwire::WriterId;
use kvmesh_kvxfer::transport::client::KvClient;
use kvmesh_kvxfer::transport::server::HELLO_TIMEOUT;
use kvmesh_kvxfer::transport::KvAuth;
use kvmesh_meshauth::tls::{MeshTls, TlsFiles};
use kvmesh_testkit::tls::{TestCa, Validity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::common::*;

fn identity(ca: &TestCa, dir: &std::path::Path, stem: &str, validity: Validity) -> Arc<MeshTls> {
    let f = ca
        .write_node(dir, stem, &["127.0.0.1"], validity)
        .expect("node certificate");
    MeshTls::load(TlsFiles {
        ca: ca.ca_file.clone(),
        cert: f.cert,
        key: f.key,
    })
    .expect("identity")
}

/// Copies `from` into `into`, recording what passes.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut into: tokio::net::tcp::OwnedWriteHalf,
    record: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 || into.write_all(&buf[..n]).await.is_err() {
            break;
        }
        record.lock().expect("record").extend_from_slice(&buf[..n]);
    }
    let _ = into.shutdown().await;
}

/// A relay on 127.0.0.1 to `to` that records every byte, both ways.
async fn recording_relay(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = TcpStream::connect(&to).await else {
                continue;
            };
            let (ir, iw) = inbound.into_split();
            let (or, ow) = outbound.into_split();
            tokio::spawn(pump(ir, ow, Arc::clone(&record)));
            tokio::spawn(pump(or, iw, Arc::clone(&record)));
        }
    });
    (addr, seen)
}

/// One verified transfer of a 6-token prompt from a writer at `endpoint`
/// with `auth` into `node`; the bytes of its layer-0 K as f32.
async fn transfer(node: &Node, endpoint: &str, auth: KvAuth) -> Vec<u8> {
    let client = KvClient::connect(endpoint, WriterId::mint().expect("rng"), auth)
        .await
        .expect("connect");
    let (grant, pending) = node
        .table
        .reserve(Node::request(6, 2, client.writer()))
        .expect("reserve");
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 7.0).await;
    w.finish(1).await.expect("finish");
    let live = pending.wait().await.expect("verified");
    assert_prompt(live.reservation(), 6, 7.0);
    drop(live);
    let (k, _) = layer_kv(6, 0, 7.0);
    k.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_inside_mutual_tls_verifies_and_the_wire_is_not_plaintext() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let decode_tls = identity(&ca, dir.path(), "decode", Validity::Current);
    let writer_tls = identity(&ca, dir.path(), "prefill", Validity::Current);
    // Without TLS first: the relay sees the KV and the Hello in the clear
    // (what makes the check below able to fail).
    let plain = Node::start(TransportKind::Tcp).await;
    let (relay, seen) =
        recording_relay(plain.endpoint().trim_start_matches("tcp://").to_owned()).await;
    let k = transfer(&plain, &format!("tcp://{relay}"), (&plain.secret).into()).await;
    let clear = seen.lock().expect("seen").clone();
    assert!(
        contains(&clear, &k[..32]),
        "the plaintext relay saw no KV bytes"
    );
    plain.assert_idle().await;

    let node = Node::with_tls(
        TransportKind::Tcp,
        table_config(),
        pool_config(),
        Some(decode_tls),
    )
    .await;
    let (relay, seen) =
        recording_relay(node.endpoint().trim_start_matches("tcp://").to_owned()).await;
    let auth = KvAuth {
        secret: node.secret.clone(),
        tls: Some(writer_tls),
    };
    let k = transfer(&node, &format!("tcp://{relay}"), auth).await;
    let wire = seen.lock().expect("seen").clone();
    assert!(
        wire.len() > k.len() * 2 * N_LAYERS,
        "{} bytes on the wire",
        wire.len()
    );
    for window in k.chunks(16) {
        assert!(
            !contains(&wire, window),
            "KV bytes in the clear on a TLS connection"
        );
    }
    // The handshake's own messages are inside TLS too: the first bytes
    // each way are TLS records (handshake, content type 22), not kvwire.
    assert_eq!(wire[0], 22, "not a TLS record");
    node.assert_idle().await;
}

/// A peer that opens a connection to a TLS listener and says nothing is
/// cut off at the Hello timeout and counted, not held forever (issue 35
/// item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_of_a_tls_listener_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let decode_tls = identity(&ca, dir.path(), "decode", Validity::Current);
    let node = Node::with_tls(
        TransportKind::Tcp,
        table_config(),
        pool_config(),
        Some(decode_tls),
    )
    .await;
    let mut raw = TcpStream::connect(node.endpoint().trim_start_matches("tcp://"))
        .await
        .expect("connect");
    let t0 = std::time::Instant::now();
    let mut b = [0u8; 64];
    let closed = tokio::time::timeout(HELLO_TIMEOUT + Duration::from_secs(5), async {
        loop {
            match raw.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "still open after {:?}", t0.elapsed());
    assert!(t0.elapsed() >= HELLO_TIMEOUT - Duration::from_millis(100));
    wait_for("timeout", || node.server.auth_refused().get("timeout") == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_without_a_mesh_certificate_never_reach_the_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let other = TestCa::new(dir.path(), "other").expect("other ca");
    let decode_tls = identity(&ca, dir.path(), "decode", Validity::Current);
    let node = Node::with_tls(
        TransportKind::Tcp,
        table_config(),
        pool_config(),
        Some(Arc::clone(&decode_tls)),
    )
    .await;
    // Another CA's certificate (it trusts ours, so only our check refuses
    // it), then an expired one of our own CA: each connect fails (the
    // decode node closes), with the right secret all along.
    let stranger = {
        let f = other
            .write_node(dir.path(), "stranger", &["127.0.0.1"], Validity::Current)
            .expect("node");
        MeshTls::load(TlsFiles {
            ca: ca.ca_file.clone(),
            cert: f.cert,
            key: f.key,
        })
        .expect("identity")
    };
    let expired = identity(&ca, dir.path(), "expired", Validity::Expired);
    for (tls, kind) in [(stranger, "unknown_ca"), (expired, "expired")] {
        let auth = KvAuth {
            secret: node.secret.clone(),
            tls: Some(tls),
        };
        KvClient::connect(&node.endpoint(), WriterId::mint().expect("rng"), auth)
            .await
            .expect_err("a writer without a mesh certificate");
        wait_for(kind, || decode_tls.refused().get(kind) == 1).await;
    }
    // Plaintext: a writer that speaks kvwire without TLS.
    let mut raw = TcpStream::connect(node.endpoint().trim_start_matches("tcp://"))
        .await
        .expect("connect");
    raw.write_all(&[0u8; 64]).await.expect("write");
    drop(raw);
    wait_for("handshake", || decode_tls.refused().get("handshake") == 1).await;
    // Nothing of theirs reached the table: no writer, no refusal there.
    assert!(node.table.connected_writers().is_empty());
    assert_eq!(node.server.auth_refused().total(), 0);
    let s = node.table.stats();
    assert_eq!(s.frame_rejects, 0);
    node.assert_idle().await;
    // A writer with a mesh certificate then transfers as usual.
    let ok = KvAuth {
        secret: node.secret.clone(),
        tls: Some(identity(&ca, dir.path(), "prefill", Validity::Current)),
    };
    transfer(&node, &node.endpoint(), ok).await;
    node.assert_idle().await;
}
