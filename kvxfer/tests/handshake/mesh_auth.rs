//! Mesh authentication of the KV transport (issue 5 item 6): a writer
//! without the mesh secret never gets a connection, nothing it sends
//! before a valid Hello reaches the reservation table (every refusal closes
//! the connection and is counted by kind), the pool stays whole, and a
//! writer that checks the Welcome refuses a decode node of another mesh.

use std::time::Duration;

use kvmesh_kvwire::{
    AbortConfirmed, Challenge, DataPath, Message, TransferDone, Welcome, WriterId, NONCE_LEN,
};
use kvmesh_kvxfer::handshake::ReserveError;
use kvmesh_kvxfer::transport::client::KvClient;
use kvmesh_kvxfer::transport::server::{HELLO_TIMEOUT, MAX_UNAUTHENTICATED};
use kvmesh_kvxfer::transport::TransportError;
use kvmesh_meshauth::kv::hello_proof;
use kvmesh_meshauth::MeshSecret;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::common::*;

/// Nothing reached the table: no refusal of any kind counted there.
fn table_untouched(node: &Node) {
    let s = node.table.stats();
    assert_eq!(s.frame_rejects, 0);
    assert!(s.control_rejects.iter().all(|(_, n)| *n == 0), "{s:?}");
}

both!(a_writer_with_another_secret_is_refused);
/// A writer of another mesh (another secret, or the insecure key) is closed
/// after its Hello, learns it was refused, and cannot be granted anything;
/// a writer with the right secret then transfers as usual.
async fn a_writer_with_another_secret_is_refused(kind: TransportKind) {
    let node = Node::start(kind).await;
    for (i, wrong) in [MeshSecret::generate().expect("rng"), MeshSecret::insecure()]
        .iter()
        .enumerate()
    {
        let writer = WriterId::mint().expect("rng");
        let e = KvClient::connect(&node.endpoint(), writer, wrong)
            .await
            .expect_err("another mesh's writer");
        assert!(
            matches!(e, TransportError::Unauthenticated(_)),
            "{e:?}: {e}"
        );
        assert_eq!(e.kind(), "unauthenticated");
        wait_for("counted", || {
            node.server.auth_refused().get("bad_proof") == i as u64 + 1
        })
        .await;
        assert!(node.table.connected_writers().is_empty());
        assert!(matches!(
            node.table.reserve(Node::request(4, 2, writer)),
            Err(ReserveError::WriterNotConnected { .. })
        ));
    }
    assert_eq!(node.server.auth_refused().total(), 2);
    assert_eq!(node.free(), N_PAGES);
    table_untouched(&node);

    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(6, 2, client.writer()))
        .expect("reserve");
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 3.0).await;
    w.finish(5).await.expect("finish");
    let live = pending.wait().await.expect("live");
    assert_prompt(live.reservation(), 6, 3.0);
    drop(live);
    node.assert_idle().await;
    assert_eq!(node.server.auth_refused().total(), 2);
}

/// Frames, transfer-dones and abort-confirmeds before a Hello, a Hello
/// replayed from another connection, a Hello proving another secret,
/// garbage, silence: each closes its connection and is counted by kind.
/// Meanwhile a real grant is open; none of it lands, and the grant then
/// completes with the true data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anything_before_a_valid_hello_is_refused_and_counted() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut honest = RawWriter::connect(&node).await;
    let (g, p) = node
        .table
        .reserve(Node::request(4, 0, honest.id))
        .expect("reserve");
    let refused = || node.server.auth_refused();

    // A frame of the live grant, capability and all, without a Hello; and
    // one sent blind, before even reading the Challenge.
    for read_challenge in [true, false] {
        let mut raw = RawWriter::unauthenticated(&node).await;
        if read_challenge {
            raw.challenge().await;
        }
        raw.send_bytes(&frames_for(&g, 0, 99.0)[0]).await;
        assert!(raw.closed_by_peer().await, "connection closed");
    }
    assert_eq!(refused().get("frame_before_hello"), 2);

    let mut raw = RawWriter::unauthenticated(&node).await;
    raw.challenge().await;
    raw.send(&Message::TransferDone(TransferDone {
        reservation: g.reservation,
        capability: g.capability.clone(),
        tokens_written: 4,
        first: 0.into(),
        page_checksums: checksums_for(&g, 99.0),
    }))
    .await;
    assert!(raw.closed_by_peer().await);
    assert_eq!(refused().get("transfer_done_before_hello"), 1);

    let mut raw = RawWriter::unauthenticated(&node).await;
    raw.send(&Message::AbortConfirmed(AbortConfirmed {
        reservation: g.reservation,
        frames_sent: 0,
    }))
    .await;
    assert!(raw.closed_by_peer().await);
    assert_eq!(refused().get("abort_confirmed_before_hello"), 1);

    // A Welcome or Challenge from a writer is no Hello either.
    let mut raw = RawWriter::unauthenticated(&node).await;
    raw.send(&Message::Challenge(Challenge {
        nonce: [1; NONCE_LEN],
    }))
    .await;
    assert!(raw.closed_by_peer().await);
    assert_eq!(refused().get("message_before_hello"), 1);

    // A Hello made for another connection's challenge (a replay), and one
    // proving another secret.
    let mut first = RawWriter::unauthenticated(&node).await;
    let c1 = first.challenge().await;
    let recorded = first.hello(&node.secret, &c1);
    let mut second = RawWriter::unauthenticated(&node).await;
    second.challenge().await;
    second.send(&Message::Hello(recorded)).await;
    assert!(second.closed_by_peer().await);
    let mut third = RawWriter::unauthenticated(&node).await;
    let c3 = third.challenge().await;
    let forged = third.hello(&MeshSecret::generate().expect("rng"), &c3);
    third.send(&Message::Hello(forged)).await;
    assert!(third.closed_by_peer().await);
    assert_eq!(refused().get("bad_proof"), 2);
    drop(first);

    // Not a message at all; a Hello header declaring a huge body (refused
    // from the header, nothing read or allocated); silence then a hang-up.
    let mut raw = RawWriter::unauthenticated(&node).await;
    raw.send_bytes(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(raw.closed_by_peer().await);
    let mut raw = RawWriter::unauthenticated(&node).await;
    let mut header = Vec::new();
    header.extend_from_slice(b"KVMW");
    header.extend_from_slice(&2u16.to_le_bytes());
    header.extend_from_slice(&7u16.to_le_bytes());
    header.extend_from_slice(&(1u32 << 20).to_le_bytes());
    raw.send_bytes(&header).await;
    assert!(raw.closed_by_peer().await);
    wait_for("two malformed", || refused().get("malformed") == 2).await;
    drop(RawWriter::unauthenticated(&node).await);
    wait_for("closed", || refused().get("closed") >= 1).await;

    // None of it reached the table; the grant is intact and the honest
    // writer's transfer verifies with its own data, not the intruders'.
    table_untouched(&node);
    assert_eq!(node.table.connected_writers(), vec![honest.id]);
    for layer in 0..N_LAYERS as u16 {
        for f in frames_for(&g, layer, 10.0) {
            honest.send_bytes(&f).await;
        }
    }
    honest
        .send(&Message::TransferDone(TransferDone {
            reservation: g.reservation,
            capability: g.capability.clone(),
            tokens_written: 4,
            first: 0.into(),
            page_checksums: checksums_for(&g, 10.0),
        }))
        .await;
    let live = p.wait().await.expect("verifies");
    assert_prompt(live.reservation(), 4, 10.0);
    drop(live);
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended("completed"), 1);
    table_untouched(&node);
}

/// A connection that says nothing is closed at the listener's Hello
/// timeout and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_times_out_and_is_counted() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::unauthenticated(&node).await;
    raw.challenge().await;
    let t0 = std::time::Instant::now();
    assert!(
        raw.closed_within(HELLO_TIMEOUT + Duration::from_secs(5))
            .await
    );
    assert!(t0.elapsed() >= HELLO_TIMEOUT - Duration::from_millis(100));
    wait_for("counted", || node.server.auth_refused().get("timeout") == 1).await;
    assert_eq!(node.server.auth_refused().total(), 1);
}

/// Issue 35 item 5: strangers cannot hold more than MAX_UNAUTHENTICATED
/// connections waiting for their Hello: one more is closed at once and
/// counted, and once the silent ones are gone a writer of the mesh
/// connects and transfers as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_waiting_for_their_hello_are_bounded() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut silent = Vec::new();
    for _ in 0..MAX_UNAUTHENTICATED {
        let mut raw = RawWriter::unauthenticated(&node).await;
        raw.challenge().await;
        silent.push(raw);
    }
    let mut extra = RawWriter::unauthenticated(&node).await;
    let t0 = std::time::Instant::now();
    assert!(extra.closed_within(Duration::from_secs(2)).await);
    assert!(t0.elapsed() < HELLO_TIMEOUT, "{:?}", t0.elapsed());
    wait_for("counted", || {
        node.server.auth_refused().get("too_many_unauthenticated") == 1
    })
    .await;
    // The room comes back as the silent ones leave.
    drop(silent);
    wait_for("the silent ones counted as closed", || {
        node.server.auth_refused().get("closed") == MAX_UNAUTHENTICATED as u64
    })
    .await;
    let honest = RawWriter::connect(&node).await;
    wait_for("the writer registered", || {
        node.table.connected_writers() == vec![honest.id]
    })
    .await;
    table_untouched(&node);
}

/// The writer's side of mutual authentication: a listener that is not of
/// this mesh (it cannot make the Welcome's proof, or reflects the writer's
/// own Hello proof back) is refused before anything is written to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_refuses_a_decode_node_of_another_mesh() {
    let secret = MeshSecret::generate().expect("rng");
    for reflect in [false, true] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let impostor = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut out = Vec::new();
            Message::Challenge(Challenge {
                nonce: [9; NONCE_LEN],
            })
            .encode(&mut out)
            .expect("encode");
            s.write_all(&out).await.expect("challenge");
            let mut hello = vec![0u8; 12 + 80 + 8];
            s.read_exact(&mut hello).await.expect("hello");
            let Ok((Message::Hello(h), _)) = kvmesh_kvwire::decode_message(&hello) else {
                panic!("not a hello")
            };
            let proof = if reflect {
                h.proof
            } else {
                let other = MeshSecret::generate().expect("rng");
                hello_proof(&other, &[9; NONCE_LEN], &h.nonce, h.writer)
            };
            let mut out = Vec::new();
            Message::Welcome(Welcome {
                proof,
                data_path: DataPath::Frames,
                geometry: kvmesh_kvwire::Geometry {
                    page_size: PAGE_SIZE as u32,
                    n_layers: N_LAYERS as u16,
                    n_kv_heads: 1,
                    head_dim: KV_DIM as u16,
                    dtype: kvmesh_kvwire::Dtype::F32,
                    entry: kvmesh_kvwire::KvEntry::KeyValue,
                },
            })
            .encode(&mut out)
            .expect("encode");
            s.write_all(&out).await.expect("welcome");
            // Anything the writer sends after this would be a leak.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            rest
        });
        let e = KvClient::connect(
            &format!("tcp://{addr}"),
            WriterId::mint().expect("rng"),
            &secret,
        )
        .await
        .expect_err("impostor refused");
        assert!(
            matches!(e, TransportError::Unauthenticated(m) if m.contains("Welcome")),
            "reflect={reflect}: {e}"
        );
        let rest = impostor.await.expect("impostor");
        assert!(rest.is_empty(), "the writer sent {} bytes more", rest.len());
    }
}
