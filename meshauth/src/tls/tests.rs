use super::*;
use kvmesh_testkit::tls::{TestCa, Validity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn files(f: kvmesh_testkit::tls::NodeFiles) -> TlsFiles {
    TlsFiles {
        ca: f.ca,
        cert: f.cert,
        key: f.key,
    }
}

/// A handshake between `client` and `server` over an in-memory pipe, then
/// one message each way; the server's refusal if it refused.
async fn exchange(client: &MeshTls, server: &MeshTls, purpose: Purpose) -> Result<(), TlsRefusal> {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let serve = async {
        let mut s = server.accept(b, purpose).await?;
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf)
            .await
            .map_err(|_| TlsRefusal::Handshake)?;
        assert_eq!(&buf, b"hello");
        s.write_all(b"world")
            .await
            .map_err(|_| TlsRefusal::Handshake)?;
        s.flush().await.map_err(|_| TlsRefusal::Handshake)?;
        Ok::<_, TlsRefusal>(())
    };
    let dial = async {
        // The client's view does not decide the test: TLS 1.3 finishes a
        // client's handshake before the server has judged its certificate.
        if let Ok(mut c) = client.connect(a, "127.0.0.1:7000", purpose).await {
            let _ = c.write_all(b"hello").await;
            let _ = c.flush().await;
            let mut buf = [0u8; 5];
            if c.read_exact(&mut buf).await.is_ok() {
                assert_eq!(&buf, b"world");
            }
        }
    };
    let (r, ()) = tokio::join!(serve, dial);
    r
}

#[tokio::test]
async fn a_peer_of_the_mesh_ca_is_accepted_and_others_are_refused_by_kind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let other = TestCa::new(dir.path(), "other").expect("other ca");
    let names = ["127.0.0.1", "localhost"];
    let load = |f| MeshTls::load(files(f)).expect("load");
    let server = load(
        ca.write_node(dir.path(), "server", &names, Validity::Current)
            .expect("node"),
    );
    let good = load(
        ca.write_node(dir.path(), "good", &names, Validity::Current)
            .expect("node"),
    );
    for purpose in [Purpose::Grpc, Purpose::Kv] {
        exchange(&good, &server, purpose)
            .await
            .expect("a mesh peer");
    }

    // A certificate from another CA (trusting the mesh's CA, so only the
    // server's check can refuse it).
    let mut stranger = files(
        other
            .write_node(dir.path(), "stranger", &names, Validity::Current)
            .expect("node"),
    );
    stranger.ca = ca.ca_file.clone();
    let stranger = MeshTls::load(stranger).expect("load");
    assert_eq!(
        exchange(&stranger, &server, Purpose::Grpc).await,
        Err(TlsRefusal::UnknownCa)
    );
    // An expired certificate of the mesh's own CA.
    let expired = load(
        ca.write_node(dir.path(), "expired", &names, Validity::Expired)
            .expect("node"),
    );
    assert_eq!(
        exchange(&expired, &server, Purpose::Kv).await,
        Err(TlsRefusal::Expired)
    );
    // No certificate: a client that trusts the CA and presents nothing.
    let anonymous = {
        let mut roots = RootCertStore::empty();
        for c in certs(&ca.ca_file).expect("ca") {
            roots.add(c).expect("root");
        }
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls13")
            .with_root_certificates(roots)
            .with_no_client_auth()
    };
    let (a, b) = tokio::io::duplex(64 * 1024);
    let dial = async move {
        let name = server_name("127.0.0.1:1").expect("name");
        if let Ok(mut c) = tokio_rustls::TlsConnector::from(Arc::new(anonymous))
            .connect(name, a)
            .await
        {
            let _ = c.write_all(b"hello").await;
            let _ = c.flush().await;
            let mut buf = [0u8; 1];
            let _ = c.read(&mut buf).await;
        }
    };
    let (r, ()) = tokio::join!(server.accept(b, Purpose::Grpc), dial);
    assert_eq!(r.err(), Some(TlsRefusal::NoCertificate));
    // Plaintext: a gRPC preface where a handshake belongs.
    let (mut a, b) = tokio::io::duplex(1024);
    a.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("write");
    drop(a);
    assert_eq!(
        server.accept(b, Purpose::Grpc).await.err(),
        Some(TlsRefusal::Handshake)
    );

    let counts: Vec<_> = server
        .refused()
        .by_kind()
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(
        counts,
        [
            ("no_certificate", 1),
            ("unknown_ca", 1),
            ("expired", 1),
            ("handshake", 1)
        ]
    );
    // The server's own name is checked by the client: a certificate for
    // another host is refused on the client's side.
    let elsewhere = load(
        ca.write_node(dir.path(), "elsewhere", &["10.9.8.7"], Validity::Current)
            .expect("node"),
    );
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (dialled, _) = tokio::join!(
        good.connect(a, "127.0.0.1:7000", Purpose::Grpc),
        elsewhere.accept(b, Purpose::Grpc)
    );
    assert!(
        dialled.is_err(),
        "a server certificate for another host was accepted"
    );
}

#[tokio::test]
async fn changed_files_are_reloaded_and_a_broken_change_keeps_the_old_identity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let names = ["127.0.0.1"];
    let server_files = ca
        .write_node(dir.path(), "server", &names, Validity::Current)
        .expect("node");
    let server = MeshTls::load(files(server_files.clone())).expect("load");
    let client = MeshTls::load(files(
        ca.write_node(dir.path(), "client", &names, Validity::Current)
            .expect("node"),
    ))
    .expect("load");
    exchange(&client, &server, Purpose::Grpc)
        .await
        .expect("before");

    // The server's certificate is replaced by an expired one: once the
    // reload check comes round, clients refuse it.
    let (cert, key) = ca.node_pem(&names, Validity::Expired).expect("pem");
    std::thread::sleep(RELOAD_CHECK + Duration::from_millis(50));
    std::fs::write(&server_files.cert, cert).expect("write cert");
    std::fs::write(&server_files.key, key).expect("write key");
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (dialled, _) = tokio::join!(
        client.connect(a, "127.0.0.1:7000", Purpose::Grpc),
        server.accept(b, Purpose::Grpc)
    );
    assert!(
        dialled.is_err(),
        "the reloaded (expired) certificate was not used"
    );

    // A half-written key: the reload fails and the identity stays.
    std::thread::sleep(RELOAD_CHECK + Duration::from_millis(50));
    std::fs::write(&server_files.key, "-----BEGIN PRIVATE KEY-----\nAAAA\n").expect("write");
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (dialled, _) = tokio::join!(
        client.connect(a, "127.0.0.1:7000", Purpose::Grpc),
        server.accept(b, Purpose::Grpc)
    );
    assert!(dialled.is_err(), "still the expired identity");
    assert_eq!(server.reload_failures(), 1);
}

#[test]
fn bad_files_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path(), "mesh").expect("ca");
    let f = files(
        ca.write_node(dir.path(), "n", &["127.0.0.1"], Validity::Current)
            .expect("node"),
    );
    let missing = TlsFiles {
        cert: dir.path().join("nope.pem"),
        ..f.clone()
    };
    let e = MeshTls::load(missing)
        .expect_err("missing file")
        .to_string();
    assert!(e.contains("nope.pem"), "{e}");
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not pem").expect("write");
    let e = MeshTls::load(TlsFiles {
        ca: empty,
        ..f.clone()
    })
    .expect_err("no CA")
    .to_string();
    assert!(
        e.contains("empty.pem") && e.contains("no PEM certificate"),
        "{e}"
    );
    // A key that is not the certificate's.
    let other = files(
        ca.write_node(dir.path(), "m", &["127.0.0.1"], Validity::Current)
            .expect("node"),
    );
    let e = MeshTls::load(TlsFiles {
        key: other.key,
        ..f
    })
    .expect_err("mismatched key");
    assert!(matches!(e, TlsError::Config(_)), "{e}");
    assert!(matches!(
        server_name("not a host:1"),
        Err(TlsError::ServerName(_))
    ));
    assert!(server_name("[::1]:7000").is_ok());
}
