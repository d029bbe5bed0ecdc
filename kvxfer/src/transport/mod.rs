//! KV transports: how a prefill node's writes reach a decode node's pool,
//! behind one pair of traits that fits TCP, shared memory and RDMA.
//!
//! | | TCP ([`tcp`]) | shared memory ([`shm`]) | UCX ([`ucx`]; RDMA where the fabric has it) |
//! |---|---|---|---|
//! | data | [`kvmesh_kvwire::KvFrame`]s on the connection | one-sided copies into the pool's mapping | one-sided puts (`ucp_put_nbx`) into the registered pool |
//! | receiver checks each write before it lands | yes | no | no |
//! | grant's write key | 0 (unused) | lane and epoch of a write gate | a random key one writer endpoint binds |
//! | a write bounded by its grant's pages | `Grant::check_frame` on arrival (`wrong_page`) | the page-owner table in the mapping, checked by the writer's `write_slots` (`outside_grant`) | data messages: the target's handler checks the key's pages (`outside_grant`); hardware puts: not yet (issue 35 item 2) |
//! | revoke | refuse the reservation's frames (under its entry lock) | close the lane, wait for active writes to end | close the grant's endpoint (force, peer error mode), wait for the close |
//! | drain (writer) | stream order: nothing to wait for | copies are synchronous | flush the grant's endpoint (`ucp_ep_flush_nbx`) |
//! | writer death | connection reset | connection reset + pidfd | endpoint error, then the same close |
//!
//! Control messages (Challenge, Hello, Welcome, TransferDone, Abort,
//! AbortConfirmed, Revoke) always travel on the connection (`stream`), in
//! order with the frames where frames travel there too. A connection
//! carries nothing before its writer proved the mesh secret
//! ([`kvmesh_meshauth::kv`]). [`server`] is the decode side's
//! listener, [`client`] the prefill side's connection.
//!
//! # Choosing a transport
//! [`TransportKind`] is the one name of a transport (flags, the mesh file,
//! tests); [`kind`] holds the one table of what each kind does, and
//! [`ListenSettings`] builds a decode node's pool, landing and listener
//! from it. A writer picks its [`WritePath`] from the data path the
//! decode node's `Welcome` names, through the same table.
//!
//! # The two traits
//! - [`Landing`] (decode side): what a grant's `write_key` is, and how a
//!   grant's write path is revoked. [`Revocation::Complete`] is the promise
//!   that no write of that grant can land any more; the reservation table
//!   releases pages only after it (I5).
//! - [`WritePath`] (prefill side): post one write of a slot range of one
//!   layer of one granted page, and drain (wait until every posted write
//!   has landed, or is ordered before anything sent later).

pub mod client;
mod greeting;
pub mod kind;
pub mod server;
pub mod shm;
pub(crate) mod stream;
pub mod tcp;
pub mod ucx;

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;

use thiserror::Error;

use crate::shm::{PeerProcess, ShmError};
use kvmesh_kernels::PageRef;
use kvmesh_kvwire::{DataPath, Grant, MintError, WireError};
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::MeshSecret;

pub use kind::{Control, ListenSettings, TransportKind, UnknownTransport};

/// A boxed future, so the traits stay usable as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a revocation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revocation {
    /// No write of the grant can land any more.
    Complete,
    /// Writes may still land (a one-sided write is active and its writer
    /// is alive); ask again later. The pages stay held.
    Pending {
        /// Writes active on the path.
        active: u32,
    },
}

/// Decode side of a transport.
pub trait Landing: Send + Sync + fmt::Debug {
    /// What `Welcome` tells writers.
    fn data_path(&self) -> DataPath;

    /// Whether writes arrive as frames the receiver checks before they land
    /// (TCP). If not, writes are one-sided and frames on the connection are
    /// refused.
    fn receiver_checked(&self) -> bool;

    /// Opens the write path of a new grant of `pages`; returns its write
    /// key. A one-sided transport lets the key write those pages only
    /// (issue 35 item 3): a write that names another page is refused and
    /// counted in [`Self::refused`].
    fn open(&self, pages: &[PageRef]) -> Result<u64, TransportError>;

    /// Writes this landing refused that the reservation table never sees
    /// (one-sided transports), by kind: `outside_grant` counts writes that
    /// named a page outside their key's grant. Receiver-checked transports
    /// count their refusals in the table's frame counters instead.
    fn refused(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Closes the write path of the grant with `key`. `writer` is the
    /// writer process, where the transport can watch it: a dead writer's
    /// one-sided writes cannot land, which completes a revocation its
    /// active count alone would leave pending. Idempotent; once `Complete`
    /// is returned the key is spent and must not be revoked again.
    fn revoke(&self, key: u64, writer: Option<&PeerProcess>) -> Revocation;
}

/// One write: slots `slots` of layer `layer` of logical page `index` of
/// `grant`; `k` and `v` hold `slots.len() * kv_dim` values each.
#[derive(Debug)]
pub struct PageWrite<'a> {
    /// The grant written.
    pub grant: &'a Grant,
    /// Logical page index in the grant.
    pub index: u32,
    /// The layer.
    pub layer: u16,
    /// Slot range within the page.
    pub slots: Range<u32>,
    /// K values, slot-major, encoded in the grant's dtype, little-endian
    /// ([`kvmesh_kvwire::encode_values`]): the bytes a frame carries and the
    /// page checksum covers, encoded once by the writer.
    pub k: &'a [u8],
    /// V values, as `k`.
    pub v: &'a [u8],
}

/// Prefill side of a transport: one connection's data path.
pub trait WritePath: Send + Sync + fmt::Debug {
    /// Posts one write. It may land after this returns; [`Self::drain`]
    /// waits for that.
    fn write<'a>(&'a self, w: PageWrite<'a>) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Returns once every write posted so far has landed, or is ordered
    /// before any control message sent after this call, or can no longer
    /// land (its grant's path was revoked).
    fn drain(&self) -> BoxFuture<'_, Result<(), TransportError>>;

    /// Returns once every write posted for the grant with `write_key` has
    /// landed; an error if any may not have (a revoked one-sided path).
    /// What transfer-done waits for.
    fn drain_grant(&self, _write_key: u64) -> BoxFuture<'_, Result<(), TransportError>> {
        self.drain()
    }

    /// The writer is done with the grant with `write_key` (finished,
    /// aborted or failed): resources bound to it can go.
    fn release(&self, _write_key: u64) {}
}

/// A transport failure.
#[derive(Debug, Error)]
pub enum TransportError {
    /// Socket I/O failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer sent bytes that are not a valid message.
    #[error("malformed message from peer: {0}")]
    Wire(#[from] WireError),
    /// The shared-memory mapping refused the operation.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The decode node's pool could not be built.
    #[error("KV pool: {0}")]
    Pool(#[from] kvmesh_kvpool::PoolError),
    /// The connection is closed.
    #[error("connection closed")]
    Closed,
    /// The endpoint string is not one this build can reach.
    #[error("bad endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// What was given.
        endpoint: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The peer broke the connection protocol (Hello/Welcome).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer did not answer in time.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// No lane is free for a new grant (more grants than pages: a bug).
    #[error("no free write lane")]
    NoLane,
    /// The peer did not prove it holds this mesh's secret (or refused
    /// this side's proof).
    #[error("mesh authentication failed: {0}")]
    Unauthenticated(&'static str),
    /// The OS random number generator failed (no handshake nonce).
    #[error(transparent)]
    Mint(#[from] MintError),
    /// The UCX data path failed (or UCX is not installed).
    #[error(transparent)]
    Ucx(#[from] kvmesh_ucx::UcxError),
}

impl TransportError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::Wire(e) => e.kind(),
            Self::Shm(e) => e.kind(),
            Self::Pool(e) => e.kind(),
            Self::Closed => "closed",
            Self::Endpoint { .. } => "endpoint",
            Self::Protocol(_) => "protocol",
            Self::Timeout(_) => "timeout",
            Self::NoLane => "no_lane",
            Self::Unauthenticated(_) => "unauthenticated",
            Self::Mint(_) => "mint",
            Self::Ucx(e) => e.kind(),
        }
    }
}

/// A parsed transport endpoint: `tcp://HOST:PORT` or `unix:PATH`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(String),
    /// A Unix-domain socket path (the shared-memory transport's control
    /// connection: same host only, and the peer's pid is known).
    Unix(std::path::PathBuf),
}

impl Endpoint {
    /// Parses `tcp://HOST:PORT` or `unix:PATH`.
    pub fn parse(s: &str) -> Result<Self, TransportError> {
        let bad = |reason| TransportError::Endpoint {
            endpoint: s.to_owned(),
            reason,
        };
        if let Some(addr) = s.strip_prefix("tcp://") {
            if addr.is_empty() || !addr.contains(':') {
                return Err(bad("expected tcp://HOST:PORT"));
            }
            Ok(Self::Tcp(addr.to_owned()))
        } else if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("expected unix:PATH"));
            }
            Ok(Self::Unix(path.into()))
        } else {
            Err(bad("expected tcp://HOST:PORT or unix:PATH"))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(a) => write!(f, "tcp://{a}"),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// How a KV connection's two ends know each other: the mesh secret (the
/// challenge and proofs of `kvmesh_meshauth::kv`, always), and on TCP,
/// when the mesh file names certificates, mutual TLS under it (the
/// shared-memory transport's control socket is a Unix socket on one host:
/// no TLS there).
#[derive(Clone, Debug)]
pub struct KvAuth {
    /// The mesh secret.
    pub secret: MeshSecret,
    /// The node's TLS identity, if the mesh uses TLS.
    pub tls: Option<Arc<MeshTls>>,
}

impl From<MeshSecret> for KvAuth {
    fn from(secret: MeshSecret) -> Self {
        Self { secret, tls: None }
    }
}

impl From<&MeshSecret> for KvAuth {
    fn from(secret: &MeshSecret) -> Self {
        secret.clone().into()
    }
}
