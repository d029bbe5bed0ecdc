//! `kvmesh certs`: what it mints passes the mesh's own TLS code (a real
//! handshake through `kvmesh_meshauth::tls::MeshTls`, both ways), another
//! CA's certificates do not, a joining node's certificate from the reused
//! CA does, and nothing is replaced unless asked.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvmesh_meshauth::tls::{MeshTls, Purpose, TlsFiles, TlsRefusal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{mint, CertsError, NameSpec, Request};

fn names(specs: &[&str]) -> Vec<NameSpec> {
    specs
        .iter()
        .map(|s| s.parse().expect("a valid --name"))
        .collect()
}

fn request(out: &Path, specs: &[&str]) -> Request {
    Request {
        out: out.to_owned(),
        names: names(specs),
        ca_key: None,
        reuse_ca: false,
        force: false,
        days: 30,
        ca_days: 365,
    }
}

/// The identity of `name` minted in `dir`, trusting the CA of `trust`.
fn identity(dir: &Path, name: &str, trust: &Path) -> Arc<MeshTls> {
    MeshTls::load(TlsFiles {
        ca: trust.join("ca.pem"),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
    })
    .expect("the minted files load as a mesh identity")
}

/// A mutual-TLS handshake over an in-memory pipe: `client` dials `server`
/// as `addr`; the server's result (the refusal it counted, if any), and
/// whether bytes then crossed both ways.
async fn handshake(
    server: &MeshTls,
    client: &MeshTls,
    addr: &str,
) -> (Result<(), TlsRefusal>, bool) {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let serve = async {
        let mut s = server.accept(a, Purpose::Kv).await?;
        let mut buf = [0u8; 4];
        let echoed = s.read_exact(&mut buf).await.is_ok()
            && s.write_all(&buf).await.is_ok()
            && s.flush().await.is_ok();
        Ok::<_, TlsRefusal>(echoed)
    };
    let dial = async {
        let Ok(mut c) = client.connect(b, addr, Purpose::Kv).await else {
            return false;
        };
        let mut buf = [0u8; 4];
        c.write_all(b"ping").await.is_ok()
            && c.flush().await.is_ok()
            && c.read_exact(&mut buf).await.is_ok()
            && &buf == b"ping"
    };
    let (served, dialled) = tokio::join!(serve, dial);
    match served {
        Ok(echoed) => (Ok(()), echoed && dialled),
        Err(r) => (Err(r), false),
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).expect("file").permissions().mode() & 0o777
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(p).expect("file")
}

#[tokio::test]
async fn minted_certificates_pass_the_mesh_tls_both_ways_and_another_cas_do_not() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("certs");
    let m = mint(&request(
        &out,
        &["router", "decode-0", "etcd:localhost,127.0.0.1"],
    ))
    .expect("mint");
    assert!(m.new_ca);
    assert_eq!(m.written.len(), 3);
    // Keys owner-only; the folder it made too.
    for f in [
        "ca-key.pem",
        "router-key.pem",
        "decode-0-key.pem",
        "etcd-key.pem",
    ] {
        assert_eq!(mode(&out.join(f)), 0o600, "{f}");
    }
    assert_eq!(mode(&out), 0o700);

    // The router dials decode-0 by its name, and decode-0 the router: each
    // certificate serves and is accepted as a client. The extra names
    // (an etcd dialled as 127.0.0.1 or localhost) are names of it too.
    let router = identity(&out, "router", &out);
    let decode = identity(&out, "decode-0", &out);
    let etcd = identity(&out, "etcd", &out);
    assert_eq!(
        handshake(&decode, &router, "decode-0:7301").await,
        (Ok(()), true)
    );
    assert_eq!(
        handshake(&router, &decode, "router:50051").await,
        (Ok(()), true)
    );
    for addr in ["etcd:2379", "127.0.0.1:2379", "localhost:2379"] {
        assert_eq!(
            handshake(&etcd, &decode, addr).await,
            (Ok(()), true),
            "{addr}"
        );
    }
    // A certificate names only what it was given.
    assert!(
        !handshake(&decode, &router, "decode-1:7301").await.1,
        "decode-0's certificate passed for decode-1"
    );

    // Another mesh's CA (another `kvmesh certs` run): its node's
    // certificate, even from a client that trusts this mesh's CA (so the
    // server's check is what stops it), is refused as an unknown CA ...
    let other = tmp.path().join("other");
    mint(&request(&other, &["decode-0"])).expect("mint the other mesh");
    let borrowed = identity(&other, "decode-0", &out);
    assert_eq!(
        handshake(&decode, &borrowed, "decode-0:7301").await,
        (Err(TlsRefusal::UnknownCa), false)
    );
    assert_eq!(decode.refused().get("unknown_ca"), 1);
    // ... and neither side of that mesh talks to this one's.
    let stranger = identity(&other, "decode-0", &other);
    assert!(!handshake(&decode, &stranger, "decode-0:7301").await.1);
    let (_, crossed) = handshake(&stranger, &router, "decode-0:7301").await;
    assert!(!crossed, "the router talked to another CA's server");
}

#[tokio::test]
async fn a_joining_node_is_signed_by_the_reused_ca_and_nothing_is_replaced_unasked() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().to_owned();
    mint(&request(&out, &["router", "decode-0"])).expect("mint");
    let (ca, ca_key, router_pem) = (
        read(out.join("ca.pem")),
        read(out.join("ca-key.pem")),
        read(out.join("router.pem")),
    );

    // Without --reuse-ca or --force an existing CA is refused, whatever
    // the names, and nothing is written.
    let e = mint(&request(&out, &["decode-1"])).expect_err("CA exists");
    assert!(
        matches!(&e, CertsError::CaExists(p) if p.ends_with("ca.pem")),
        "{e}"
    );
    assert!(e.to_string().contains("--reuse-ca"), "{e}");
    assert!(!out.join("decode-1.pem").exists());

    // --reuse-ca: a name that exists is refused (before anything is
    // written: decode-1 is not made either) ...
    let mut reuse = request(&out, &["decode-1", "router"]);
    reuse.reuse_ca = true;
    let e = mint(&reuse).expect_err("router exists");
    assert!(
        matches!(&e, CertsError::Exists(p) if p.ends_with("router.pem")),
        "{e}"
    );
    assert!(!out.join("decode-1.pem").exists());

    // ... a new one is signed by the same CA, which stays as it was.
    reuse.names = names(&["decode-1"]);
    let m = mint(&reuse).expect("reuse the CA");
    assert!(!m.new_ca);
    assert_eq!(read(out.join("ca.pem")), ca);
    assert_eq!(read(out.join("ca-key.pem")), ca_key);
    assert_eq!(mode(&out.join("decode-1-key.pem")), 0o600);
    let (router, joined) = (
        identity(&out, "router", &out),
        identity(&out, "decode-1", &out),
    );
    assert_eq!(
        handshake(&joined, &router, "decode-1:7201").await,
        (Ok(()), true)
    );
    assert_eq!(
        handshake(&router, &joined, "router:50051").await,
        (Ok(()), true)
    );

    // --reuse-ca --force renews a name; the rest is untouched.
    reuse.names = names(&["router"]);
    reuse.force = true;
    mint(&reuse).expect("renew");
    assert_ne!(read(out.join("router.pem")), router_pem);
    assert_eq!(read(out.join("ca.pem")), ca);
    assert_eq!(mode(&out.join("router-key.pem")), 0o600);
    let renewed = identity(&out, "router", &out);
    assert_eq!(
        handshake(&joined, &renewed, "decode-1:7201").await,
        (Ok(()), true)
    );

    // --force without --reuse-ca replaces the CA: the old certificates no
    // longer pass against the new one.
    let mut fresh = request(&out, &["decode-0"]);
    fresh.force = true;
    mint(&fresh).expect("a new CA");
    assert_ne!(read(out.join("ca.pem")), ca);
    let decode = identity(&out, "decode-0", &out);
    let old_router = identity(&out, "router", &out);
    assert_eq!(
        handshake(&decode, &old_router, "decode-0:7201").await,
        (Err(TlsRefusal::UnknownCa), false)
    );

    // --ca-key: the CA's key kept outside the folder, and read back from
    // there to sign a joining node.
    let (apart, key) = (tmp.path().join("apart"), tmp.path().join("mesh-ca-key.pem"));
    let mut r = request(&apart, &["decode-0"]);
    r.ca_key = Some(key.clone());
    assert_eq!(mint(&r).expect("CA key apart").ca_key, key);
    assert_eq!(mode(&key), 0o600);
    assert!(!apart.join("ca-key.pem").exists());
    let e = mint(&r).expect_err("the CA key exists");
    assert!(matches!(&e, CertsError::CaExists(_)), "{e}");
    r.names = names(&["decode-1"]);
    r.reuse_ca = true;
    mint(&r).expect("reuse the CA whose key is apart");
    assert_eq!(
        handshake(
            &identity(&apart, "decode-1", &apart),
            &identity(&apart, "decode-0", &apart),
            "decode-1:7201"
        )
        .await,
        (Ok(()), true)
    );
}

#[test]
fn a_ca_that_cannot_sign_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("mesh");
    let mut reuse = request(&out, &["decode-1"]);
    reuse.reuse_ca = true;
    // No CA to reuse.
    let e = mint(&reuse).expect_err("no CA");
    assert!(
        matches!(&e, CertsError::NoCaToReuse { path, .. } if path.ends_with("ca.pem")),
        "{e}"
    );
    assert!(!out.exists(), "the folder was made for nothing");

    // A CA key that is not the CA certificate's: refused (the new
    // certificate would verify nowhere), and decode-1 is not written.
    mint(&request(&out, &[])).expect("a CA alone");
    let other = tmp.path().join("other");
    mint(&request(&other, &[])).expect("another CA");
    std::fs::copy(other.join("ca-key.pem"), out.join("ca-key.pem")).expect("swap the key");
    let e = mint(&reuse).expect_err("mismatched key");
    assert!(
        matches!(&e, CertsError::Verify { name, .. } if name == "decode-1"),
        "{e}"
    );
    assert!(!out.join("decode-1.pem").exists());
    assert!(!out.join("decode-1-key.pem").exists());

    // Not PEM at all.
    std::fs::write(out.join("ca-key.pem"), "not a key").expect("write");
    let e = mint(&reuse).expect_err("garbage key");
    assert!(
        matches!(&e, CertsError::CaUnusable { path, .. } if path.ends_with("ca-key.pem")),
        "{e}"
    );
    std::fs::write(out.join("ca.pem"), "not a certificate").expect("write");
    std::fs::copy(other.join("ca-key.pem"), out.join("ca-key.pem")).expect("a key");
    let e = mint(&reuse).expect_err("garbage CA");
    assert!(
        matches!(&e, CertsError::CaUnusable { path, .. } if path.ends_with("ca.pem")),
        "{e}"
    );

    // --reuse-ca with no name has nothing to do; a name twice is refused.
    reuse.names.clear();
    assert!(matches!(mint(&reuse), Err(CertsError::NothingToDo)));
    let twice = request(
        &tmp.path().join("twice"),
        &["decode-0", "decode-0:localhost"],
    );
    assert!(matches!(mint(&twice), Err(CertsError::Duplicate(n)) if n == "decode-0"));
}

#[test]
fn names_parse_as_documented_and_bad_ones_are_refused_naming_the_argument() {
    let n: NameSpec = "etcd:localhost,127.0.0.1,etcd,localhost,::1"
        .parse()
        .expect("valid");
    assert_eq!(n.name, "etcd");
    assert_eq!(n.also, ["localhost", "127.0.0.1", "::1"]);
    assert_eq!(n.alt_names(), ["etcd", "localhost", "127.0.0.1", "::1"]);
    assert_eq!(n.to_string(), "etcd:localhost,127.0.0.1,::1");
    let n: NameSpec = "kvmesh-decode-0".parse().expect("valid");
    assert!(n.also.is_empty());
    for (bad, why) in [
        ("", "1 to 63 characters"),
        (":localhost", "1 to 63 characters"),
        ("../router", "letters, digits"),
        ("-x", "letters, digits"),
        ("de code", "letters, digits"),
        ("ca", "the CA's or a key's file"),
        ("router-key", "the CA's or a key's file"),
        ("etcd:", "an empty name"),
        ("etcd:a,,b", "an empty name"),
        ("etcd:not a host", "\"not a host\" is not a DNS name"),
    ] {
        let e = bad.parse::<NameSpec>().expect_err(bad).to_string();
        assert!(e.contains(why), "{bad:?}: {e}");
        assert!(e.starts_with(&format!("--name {bad:?}")), "{e}");
    }
}
