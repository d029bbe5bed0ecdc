//! kvmesh mesh-internal authentication: only peers of the same mesh may open a KV
//! transport connection to a decode node or call the internal gRPC
//! services (Decode, Prefill).
//!
//! Every node of a mesh holds one [`MeshSecret`] (at least 32 bytes, the
//! same file on every node; `kvmesh serve` mints one per run in memory).
//! The secret itself never travels: peers show HMAC-SHA256 proofs that
//! they know it, bound to something fresh, so a recorded proof is worth
//! nothing later.
//!
//! - [`kv`]: the KV transport's per-connection mutual challenge. The decode
//!   node opens with a Challenge (a fresh nonce); the writer's Hello carries
//!   its own nonce and a proof over both nonces and its writer id; the
//!   decode node checks it before anything else on the connection is read,
//!   and its Welcome carries a proof over the reverse, so the writer knows
//!   it reached its own mesh and not a look-alike. Anything before a valid
//!   Hello ends the connection and is counted by kind.
//! - [`call`]: gRPC, both ways. Each call carries `x-kvmesh-peer:
//!   MS.NONCE.MAC`, a proof over the send time, a fresh nonce, the method
//!   path, the recipient node's name and the body's digest; the receiver
//!   accepts it within [`call::CALL_WINDOW`] of its own clock, once (a
//!   bounded cache of recent nonces), only for that method, node and body.
//!   Every answer carries `x-kvmesh-node`, the node's proof over the call's
//!   proof, checked by the caller before it uses any of the answer.
//!   Refusals are UNAUTHENTICATED, counted by kind on each side.
//! - [`grpc`] (feature `tonic`): the glue for tonic services and clients:
//!   [`grpc::Authenticated`] wraps a server, refuses calls without a valid
//!   proof before the service sees them and signs the answers;
//!   [`grpc::SignedChannel`] is the client side.
//! - [`tls`] (feature `tls`): mutual TLS (rustls, TLS 1.3) for the gRPC
//!   channels and the TCP KV transport, from a CA, a certificate and a key
//!   named in the mesh file, reloaded when they change; refusals counted.
//!
//! # What this stops, and what it does not
//! It stops a process that can reach a node's ports but does not hold the
//! mesh's secret (another tenant's workload on the network, a stray client,
//! a node of another mesh) from reserving pages, aborting or reading
//! others' requests, feeding frames into a pool, or learning the pool's
//! layout. The other way, it stops a process that answers on a registered
//! address without the secret (a key written into an unauthenticated etcd,
//! a process on a dead node's port), or one that passes calls on to a node
//! of another name, from being used: its first answer fails the node's
//! proof, so it is never chosen and never sent a prompt. By itself it does not hide or protect the traffic: without
//! [`tls`], connections are plain TCP, so an attacker *on the path* can
//! read KV data and token ids, and could alter or inject messages on a
//! connection after its handshake (the KV frames' checksums are not MACs).
//! Mutual TLS adds confidentiality and per-record integrity, and a second
//! gate (a certificate of the mesh's CA) that the proofs run inside.
//! A leaked secret admits its holder as a full peer until every node is
//! restarted with a new one.
//!
//! Domains: every proof starts with a label naming what it proves (Hello,
//! Welcome, gRPC call) and a version, and every part is length-prefixed, so
//! no proof made for one purpose verifies as another, and no two part lists
//! hash alike.

#![deny(missing_docs)]

pub mod call;
#[cfg(feature = "tonic")]
pub mod grpc;
pub mod kv;
#[cfg(feature = "tls")]
pub mod tls;

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use thiserror::Error;

use kvmesh_kvwire::ids::random_nonzero;
use kvmesh_kvwire::MintError;

pub use call::{
    sign_call, CallRefusal, CallVerifier, ReplyRefusal, CALL_HEADER, CALL_REFUSAL_KINDS,
    REPLY_HEADER, REPLY_REFUSAL_KINDS,
};
pub use kv::{KvAuthCounters, KvAuthRefusal, KV_AUTH_REFUSAL_KINDS};

/// Fewest bytes a secret may have: 256 bits, so guessing it is out of
/// reach whatever the file's encoding (32 raw bytes, or 64 hex digits).
pub const MIN_SECRET_LEN: usize = 32;
/// Most bytes a secret file may have; a larger file is refused before it is
/// read (a mistaken path to a log or a disk image).
pub const MAX_SECRET_LEN: usize = 4096;
/// Bytes of one proof (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// The key of an insecure mesh: public, so anyone can compute its proofs.
/// Nodes of such a mesh talk to each other (and to anyone), and refuse
/// nodes that hold a real secret, as those refuse them.
const INSECURE_KEY: &[u8] = b"kvmesh: insecure mesh without authentication (insecure_no_mesh_auth)";

type HmacSha256 = Hmac<Sha256>;

/// The per-mesh secret. Cheap to clone; never printed (its `Debug` is
/// `MeshSecret(<redacted>)`), no `Display`, no accessor for its bytes.
/// Memory holding a dropped secret is not zeroed.
#[derive(Clone)]
pub struct MeshSecret {
    key: Arc<[u8]>,
    insecure: bool,
}

/// Why a secret was refused.
#[derive(Debug, Error)]
pub enum SecretError {
    /// Fewer than [`MIN_SECRET_LEN`] bytes.
    #[error("mesh secret {origin}: {len} bytes, at least {MIN_SECRET_LEN} are needed (e.g. `head -c 32 /dev/urandom > FILE`)")]
    TooShort {
        /// Where it came from.
        origin: String,
        /// Its length.
        len: u64,
    },
    /// More than [`MAX_SECRET_LEN`] bytes.
    #[error("mesh secret {origin}: {len} bytes, at most {MAX_SECRET_LEN} are read (is this the right file?)")]
    TooLong {
        /// Where it came from.
        origin: String,
        /// Its length (at least).
        len: u64,
    },
    /// Every byte the same: a placeholder, not a random secret.
    #[error("mesh secret {origin}: every byte is the same: not a random secret")]
    NotRandom {
        /// Where it came from.
        origin: String,
    },
    /// The file could not be read.
    #[error("mesh secret file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The OS random number generator failed.
    #[error(transparent)]
    Mint(#[from] MintError),
}

impl MeshSecret {
    /// A fresh random secret ([`MIN_SECRET_LEN`] bytes from the OS), for a
    /// mesh whose nodes all live in one process (`kvmesh serve`) and for
    /// tests.
    pub fn generate() -> Result<Self, MintError> {
        let b: [u8; MIN_SECRET_LEN] = random_nonzero()?;
        Ok(Self {
            key: Arc::from(&b[..]),
            insecure: false,
        })
    }

    /// A secret from its bytes, used verbatim (a trailing newline is part
    /// of it: every node must read the same file). Refused: fewer than
    /// [`MIN_SECRET_LEN`] or more than [`MAX_SECRET_LEN`] bytes, or every
    /// byte the same.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self, SecretError> {
        let len = bytes.len() as u64;
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                origin: origin.to_owned(),
                len,
            });
        }
        if bytes.len() > MAX_SECRET_LEN {
            return Err(SecretError::TooLong {
                origin: origin.to_owned(),
                len,
            });
        }
        if bytes.iter().all(|&b| b == bytes[0]) {
            return Err(SecretError::NotRandom {
                origin: origin.to_owned(),
            });
        }
        Ok(Self {
            key: Arc::from(bytes),
            insecure: false,
        })
    }

    /// Reads the secret from `path` (at most [`MAX_SECRET_LEN`] + 1 bytes
    /// are read, whatever the file's size) and checks it as
    /// [`MeshSecret::from_bytes`] does.
    pub fn load(path: &Path) -> Result<Self, SecretError> {
        let io = |source| SecretError::Io {
            path: path.to_owned(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(io)?
            .take(MAX_SECRET_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        Self::from_bytes(&bytes, &format!("file {}", path.display()))
    }

    /// The insecure mesh's key: public, so it authenticates nothing. Only
    /// for a mesh file that says `insecure_no_mesh_auth: true`; the caller
    /// warns loudly.
    pub fn insecure() -> Self {
        Self {
            key: Arc::from(INSECURE_KEY),
            insecure: true,
        }
    }

    /// Whether this is [`MeshSecret::insecure`].
    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    /// A key for another use of the secret (the prefix cache's keyed
    /// hashes): HMAC-SHA256 of `domain` under the secret. A distinct
    /// domain gives an independent key, and no value made with it verifies
    /// as one of this crate's proofs (those domains are fixed here).
    pub fn derive_key(&self, domain: &str) -> [u8; MAC_LEN] {
        self.mac(domain, &[])
    }

    fn keyed(&self, domain: &str, parts: &[&[u8]]) -> HmacSha256 {
        #[allow(clippy::expect_used)]
        let mut m = HmacSha256::new_from_slice(&self.key).expect("HMAC accepts keys of any length");
        for p in std::iter::once(domain.as_bytes()).chain(parts.iter().copied()) {
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// HMAC-SHA256 under the secret of `domain` and `parts`, each
    /// length-prefixed.
    pub(crate) fn mac(&self, domain: &str, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        self.keyed(domain, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`MeshSecret::mac`] of `domain` and `parts`;
    /// compared in constant time.
    pub(crate) fn verify(&self, domain: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.keyed(domain, parts).verify_slice(tag).is_ok()
    }
}

impl fmt::Debug for MeshSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.insecure {
            f.write_str("MeshSecret(insecure: no mesh authentication)")
        } else {
            f.write_str("MeshSecret(<redacted>)")
        }
    }
}

/// Whether users other than the file's owner and this process's own group
/// may read `path`: the world read bit, or the group read bit of a group
/// that is not this process's effective group. (Kubernetes mounts a
/// Secret read-only with mode 0440 in the pod's `fsGroup`, which is the
/// process's group when `runAsGroup` names it: readable by that pod only.)
/// The caller warns: a secret others can read is not one.
pub fn readable_by_others(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)?;
    let mode = meta.mode();
    if mode & 0o004 != 0 {
        return Ok(true);
    }
    // The owner of /proc/self is the process's effective uid and gid.
    let own_group = std::fs::metadata("/proc/self").map(|m| m.gid()).ok();
    Ok(mode & 0o040 != 0 && own_group != Some(meta.gid()))
}

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_private_to_its_owner_or_the_processs_own_group() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("mesh.secret");
        std::fs::write(&path, [1u8; 32]).expect("write");
        let others = |mode| {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            readable_by_others(&path).expect("stat")
        };
        assert!(!others(0o600));
        assert!(!others(0o400));
        // Created by this process: its group is ours (Kubernetes' fsGroup
        // mount with runAsGroup).
        assert!(!others(0o440));
        assert!(others(0o604), "world-readable");
        assert!(others(0o444), "world-readable");
    }

    #[test]
    fn secrets_are_checked_and_never_printed() {
        let s = MeshSecret::generate().expect("rng");
        assert_eq!(
            format!("{s:?} {:#?}", s.clone()),
            "MeshSecret(<redacted>) MeshSecret(<redacted>)"
        );
        assert!(!s.is_insecure());
        let raw = *b"0123456789abcdef0123456789abcdef";
        let from = MeshSecret::from_bytes(&raw, "test").expect("32 bytes");
        assert!(!format!("{from:?}").contains("0123"));
        assert!(matches!(
            MeshSecret::from_bytes(&raw[..31], "test"),
            Err(SecretError::TooShort { len: 31, .. })
        ));
        assert!(matches!(
            MeshSecret::from_bytes(&[7u8; 64], "test"),
            Err(SecretError::NotRandom { .. })
        ));
        assert!(matches!(
            MeshSecret::from_bytes(&vec![1u8; MAX_SECRET_LEN + 1], "test"),
            Err(SecretError::TooLong { .. })
        ));
        let e = MeshSecret::from_bytes(b"short\n", "file /x").expect_err("short");
        assert!(
            e.to_string().contains("file /x: 6 bytes, at least 32"),
            "{e}"
        );
        assert!(MeshSecret::insecure().is_insecure());
    }

    #[test]
    fn files_are_read_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("secret");
        std::fs::write(&p, b"0123456789abcdef0123456789abcdef\n").expect("write");
        assert!(MeshSecret::load(&p).is_ok());
        std::fs::write(&p, vec![b'x'; 10 << 20]).expect("write");
        assert!(matches!(
            MeshSecret::load(&p),
            Err(SecretError::TooLong { len, .. }) if len == MAX_SECRET_LEN as u64 + 1
        ));
        let missing = MeshSecret::load(&dir.path().join("nope")).expect_err("missing");
        assert!(missing.to_string().contains("nope"), "{missing}");
    }

    #[test]
    fn macs_depend_on_key_domain_and_every_part() {
        let (a, b) = (
            MeshSecret::generate().expect("rng"),
            MeshSecret::generate().expect("rng"),
        );
        let m = a.mac("d", &[b"x", b"yz"]);
        assert!(a.verify("d", &[b"x", b"yz"], &m));
        assert!(!b.verify("d", &[b"x", b"yz"], &m));
        assert!(!a.verify("e", &[b"x", b"yz"], &m));
        // Length prefixes: moving a byte between parts changes the MAC.
        assert!(!a.verify("d", &[b"xy", b"z"], &m));
        assert!(!a.verify("d", &[b"x", b"yz"], &m[..31]));
        let mut flipped = m;
        flipped[31] ^= 1;
        assert!(!a.verify("d", &[b"x", b"yz"], &flipped));
        // The insecure key verifies its own proofs only.
        let i = MeshSecret::insecure();
        assert!(!a.verify("d", &[b"x"], &i.mac("d", &[b"x"])));
        assert!(MeshSecret::insecure().verify("d", &[b"x"], &i.mac("d", &[b"x"])));
    }
}
