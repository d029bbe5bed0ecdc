//! The operator's certificates, made as a deployment file says: the
//! `kvmesh certs` command in its comment header, run as written (relative
//! paths in a folder of the test's own) with the real binary; and whether
//! a certificate so made passes the mesh's own TLS code for an address.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvmesh_meshauth::tls::{MeshTls, Purpose, TlsFiles};

/// The arguments (after `kvmesh`) of the first `kvmesh certs` command in
/// `file`'s `#` comments, its `\`-continued lines joined. Its words are
/// plain (no quotes), as the headers write them.
pub fn documented_certs_command(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut words = Vec::new();
    let mut lines = text
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix('#'))
        .skip_while(|l| !l.trim_start().starts_with("kvmesh certs "));
    for line in lines.by_ref() {
        let line = line.trim();
        let (line, more) = match line.strip_suffix('\\') {
            Some(l) => (l, true),
            None => (line, false),
        };
        words.extend(line.split_whitespace().map(str::to_owned));
        if !more {
            break;
        }
    }
    assert_eq!(
        words.first().map(String::as_str),
        Some("kvmesh"),
        "{}: no `kvmesh certs` command in its comments",
        file.display()
    );
    words.remove(0);
    words
}

/// Runs `file`'s documented `kvmesh certs` command in `dir` (its relative
/// paths land there); the folder its `--out` names.
pub fn mint_as_documented(file: &Path, dir: &Path) -> PathBuf {
    let args = documented_certs_command(file);
    let out = Command::new(crate::kvmesh_bin())
        .args(&args)
        .current_dir(dir)
        .env("KVMESH_LOG", "warn")
        .output()
        .expect("run kvmesh certs");
    let (stdout, stderr) = crate::texts(&out);
    assert!(out.status.success(), "kvmesh {args:?}: {stderr}");
    assert!(stdout.contains("new CA: "), "{stdout}");
    let at = args
        .iter()
        .position(|a| a == "--out")
        .expect("the command names --out");
    dir.join(&args[at + 1])
}

/// Whether a client holding `client`'s certificate (`STEM.pem`,
/// `STEM-key.pem` in `dir`) and a server holding `server`'s complete a
/// mutual-TLS handshake through [`MeshTls`] with the server dialled as
/// `addr`, both trusting `dir/ca.pem`, and bytes then cross.
pub fn handshake(dir: &Path, server: &str, client: &str, addr: &str) -> bool {
    let load = |stem: &str| {
        MeshTls::load(TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}-key.pem")),
        })
        .unwrap_or_else(|e| panic!("{stem}'s identity: {e}"))
    };
    let (server, client) = (load(server), load(client));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (a, b) = tokio::io::duplex(16 * 1024);
        let serve = async {
            let Ok(mut s) = server.accept(a, Purpose::Grpc).await else {
                return false;
            };
            let mut buf = [0u8; 2];
            s.read_exact(&mut buf).await.is_ok() && s.write_all(&buf).await.is_ok()
        };
        let dial = async {
            let Ok(mut c) = client.connect(b, addr, Purpose::Grpc).await else {
                return false;
            };
            let mut buf = [0u8; 2];
            c.write_all(b"ok").await.is_ok() && c.read_exact(&mut buf).await.is_ok()
        };
        let (served, dialled) = tokio::join!(serve, dial);
        served && dialled
    })
}

/// Asserts that every prefill and decode node of `mesh` (a mesh file's
/// YAML) completes [`handshake`] as the server at each address its peers
/// dial (`grpc` and `kv`), with `dir`'s certificate named after the node
/// and the router's as the client.
pub fn assert_every_node_handshakes(dir: &Path, mesh: &serde_yaml_ng::Value) {
    for role in ["prefill", "decode"] {
        for node in mesh[role].as_sequence().expect("nodes") {
            let name = node["name"].as_str().expect("name");
            for field in ["grpc", "kv"] {
                if let Some(addr) = node[field].as_str() {
                    assert!(
                        handshake(dir, name, "router", addr),
                        "{name}: {field} {addr}"
                    );
                }
            }
        }
    }
}
