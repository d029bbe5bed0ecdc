//! The KV transport's per-connection mutual challenge (wire tags 9, 7, 8):
//!
//! ```text
//! decode                                   writer (prefill)
//!   ── Challenge { server nonce Ns } ──────►
//!   ◄── Hello { writer W, nonce Nc, proof H } ──   H = MAC("kvmesh kv hello v2", Ns, Nc, W)
//!   check H (else close, counted)
//!   ── Welcome { proof P, data path, geometry } ─►  P = MAC("kvmesh kv welcome v2", Nc, Ns, W, fields)
//!                                            check P (else close)
//! ```
//!
//! Ns is fresh per connection, so a Hello recorded on one connection proves
//! nothing on the next; Nc is fresh per attempt, so the writer knows the
//! Welcome was made for it now. The two domains differ, so a decode node's
//! Welcome proof is never a valid Hello proof (no reflection). The Welcome
//! proof covers the Welcome's fields too (data path, geometry, mapping
//! path), so the writer maps only a pool its own mesh named.

use kvmesh_counters::KindCounters;
use kvmesh_kvwire::ids::random_nonzero;
use kvmesh_kvwire::{Hello, MessageType, MintError, Welcome, WriterId, NONCE_LEN};

use crate::{MeshSecret, MAC_LEN};

/// A fresh handshake nonce from the OS random number generator.
pub fn mint_nonce() -> Result<[u8; NONCE_LEN], MintError> {
    random_nonzero()
}

const HELLO_DOMAIN: &str = "kvmesh kv hello v2";
const WELCOME_DOMAIN: &str = "kvmesh kv welcome v2";

/// The proof a writer's Hello carries.
pub fn hello_proof(
    secret: &MeshSecret,
    challenge: &[u8; NONCE_LEN],
    nonce: &[u8; NONCE_LEN],
    writer: WriterId,
) -> [u8; MAC_LEN] {
    secret.mac(HELLO_DOMAIN, &[challenge, nonce, &writer.to_bytes()])
}

/// Whether `hello` proves knowledge of `secret` for this connection's
/// `challenge`. Constant time.
pub fn hello_ok(secret: &MeshSecret, challenge: &[u8; NONCE_LEN], hello: &Hello) -> bool {
    secret.verify(
        HELLO_DOMAIN,
        &[challenge, &hello.nonce, &hello.writer.to_bytes()],
        &hello.proof,
    )
}

fn welcome_parts<'a>(
    challenge: &'a [u8; NONCE_LEN],
    hello: &'a Hello,
    writer: &'a [u8; 16],
    fields: &'a [u8],
) -> [&'a [u8]; 4] {
    [&hello.nonce, challenge, writer, fields]
}

/// The proof a decode node's Welcome carries, answering `hello` on the
/// connection it challenged with `challenge`.
pub fn welcome_proof(
    secret: &MeshSecret,
    challenge: &[u8; NONCE_LEN],
    hello: &Hello,
    welcome: &Welcome,
) -> [u8; MAC_LEN] {
    let writer = hello.writer.to_bytes();
    let fields = welcome.signed_fields();
    secret.mac(
        WELCOME_DOMAIN,
        &welcome_parts(challenge, hello, &writer, &fields),
    )
}

/// Whether `welcome` proves that the decode node holds `secret` and made
/// it for `hello`. Constant time.
pub fn welcome_ok(
    secret: &MeshSecret,
    challenge: &[u8; NONCE_LEN],
    hello: &Hello,
    welcome: &Welcome,
) -> bool {
    let writer = hello.writer.to_bytes();
    let fields = welcome.signed_fields();
    secret.verify(
        WELCOME_DOMAIN,
        &welcome_parts(challenge, hello, &writer, &fields),
        &welcome.proof,
    )
}

/// Labels of [`KvAuthCounters`]: every [`KvAuthRefusal::kind`].
pub const KV_AUTH_REFUSAL_KINDS: [&str; 9] = [
    "bad_proof",
    "frame_before_hello",
    "transfer_done_before_hello",
    "abort_confirmed_before_hello",
    "message_before_hello",
    "malformed",
    "timeout",
    "closed",
    "too_many_unauthenticated",
];

/// Why a decode node closed a KV connection before its writer was
/// authenticated. Nothing the connection sent reached the reservation
/// table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvAuthRefusal {
    /// A Hello whose proof is not this mesh's (another secret, or a replay
    /// from another connection).
    BadProof,
    /// Another message came first: a frame, a transfer-done, ... from a
    /// peer that skipped the handshake.
    BeforeHello(MessageType),
    /// The first message was not a well-formed message.
    Malformed,
    /// No Hello within the listener's timeout.
    Timeout,
    /// The peer closed (or reset) the connection before its Hello.
    Closed,
    /// Closed at once: as many connections as the listener lets wait for
    /// their Hello already were waiting.
    TooManyUnauthenticated,
}

impl KvAuthRefusal {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        KV_AUTH_REFUSAL_KINDS[self.index()]
    }

    /// Exhaustive, so a new message type or variant fails to compile
    /// instead of going uncounted.
    fn index(&self) -> usize {
        match self {
            Self::BadProof => 0,
            Self::BeforeHello(t) => match t {
                MessageType::KvFrame => 1,
                MessageType::TransferDone => 2,
                MessageType::AbortConfirmed => 3,
                MessageType::Grant
                | MessageType::Abort
                | MessageType::Revoke
                | MessageType::Hello
                | MessageType::Welcome
                | MessageType::Challenge => 4,
            },
            Self::Malformed => 5,
            Self::Timeout => 6,
            Self::Closed => 7,
            Self::TooManyUnauthenticated => 8,
        }
    }
}

/// KV connections refused before authentication, by kind; lock-free.
#[derive(Debug, Default)]
pub struct KvAuthCounters(KindCounters<{ KV_AUTH_REFUSAL_KINDS.len() }>);

impl KvAuthCounters {
    /// Counts one refused connection.
    pub fn record(&self, r: KvAuthRefusal) {
        self.0.bump(r.index());
    }

    /// Refusals of all kinds.
    pub fn total(&self) -> u64 {
        self.0.total()
    }

    /// Refusals of one kind (0 for a name that is not a kind).
    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(&KV_AUTH_REFUSAL_KINDS, kind)
    }

    /// Every kind with its count, zeros included.
    pub fn by_kind(&self) -> [(&'static str, u64); KV_AUTH_REFUSAL_KINDS.len()] {
        self.0.by_kind(&KV_AUTH_REFUSAL_KINDS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_kvwire::{DataPath, Dtype, Geometry};

    fn welcome() -> Welcome {
        Welcome {
            proof: [0; MAC_LEN],
            data_path: DataPath::SharedMemory {
                path: "/dev/shm/pool".into(),
            },
            geometry: Geometry {
                page_size: 4,
                n_layers: 2,
                n_kv_heads: 1,
                head_dim: 4,
                dtype: Dtype::F32,
                entry: kvmesh_kvwire::KvEntry::KeyValue,
            },
        }
    }

    #[test]
    fn proofs_bind_secret_nonces_writer_and_fields() {
        let s = MeshSecret::generate().expect("rng");
        let other = MeshSecret::generate().expect("rng");
        let (ns, nc) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let writer = WriterId::mint().expect("rng");
        let hello = Hello {
            writer,
            nonce: nc,
            proof: hello_proof(&s, &ns, &nc, writer),
        };
        assert!(hello_ok(&s, &ns, &hello));
        assert!(!hello_ok(&other, &ns, &hello));
        assert!(
            !hello_ok(&s, &[3u8; NONCE_LEN], &hello),
            "another challenge"
        );
        let renamed = Hello {
            writer: WriterId::mint().expect("rng"),
            ..hello
        };
        assert!(!hello_ok(&s, &ns, &renamed), "another writer");

        let mut w = welcome();
        w.proof = welcome_proof(&s, &ns, &hello, &w);
        assert!(welcome_ok(&s, &ns, &hello, &w));
        assert!(!welcome_ok(&other, &ns, &hello, &w));
        // Reflection: a Welcome proof is not a Hello proof, nor the reverse.
        let reflected = Hello {
            proof: w.proof,
            ..hello
        };
        assert!(!hello_ok(&s, &ns, &reflected));
        // The fields are covered: another mapping path fails.
        let mut moved = w.clone();
        moved.data_path = DataPath::SharedMemory {
            path: "/dev/shm/elsewhere".into(),
        };
        assert!(!welcome_ok(&s, &ns, &hello, &moved));
        let mut reshaped = w.clone();
        reshaped.geometry.page_size = 8;
        assert!(!welcome_ok(&s, &ns, &hello, &reshaped));
    }

    #[test]
    fn refusals_are_counted_by_kind() {
        let c = KvAuthCounters::default();
        c.record(KvAuthRefusal::BeforeHello(MessageType::KvFrame));
        c.record(KvAuthRefusal::BeforeHello(MessageType::TransferDone));
        c.record(KvAuthRefusal::BeforeHello(MessageType::Revoke));
        c.record(KvAuthRefusal::BadProof);
        assert_eq!(c.total(), 4);
        assert_eq!(c.get("frame_before_hello"), 1);
        assert_eq!(c.get("transfer_done_before_hello"), 1);
        assert_eq!(c.get("message_before_hello"), 1);
        assert_eq!(c.get("bad_proof"), 1);
        assert_eq!(KvAuthRefusal::Timeout.kind(), "timeout");
    }
}
