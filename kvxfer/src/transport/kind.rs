//! Which KV transport a mesh runs ([`TransportKind`]), and the one table
//! that says, per kind, how the decode side lands writes and listens
//! ([`ListenSettings`]) and how a writer reaches them (`KvClient`, from
//! the kind its `Welcome` names).
//!
//! Each kind's code lives in its own module (`tcp`, `shm`, `ucx`), which
//! exports one `Spec` row. `TransportKind::spec` is the only match on
//! the kind; everything else (the decode node, `kvmesh serve`, the mesh
//! file, the in-process test mesh, the suites that run over every
//! transport) goes through [`TransportKind::ALL`] and these methods.
//!
//! Adding a transport: its module with a `Landing`, a `WritePath` and its
//! `SPEC`; a variant here, with its entry in `ALL`, its row in `spec` and
//! in [`TransportKind::of`] (the data path its `Welcome` names, a wire tag
//! of `kvmesh-kvwire`); an arm in the suites that name each transport.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use kvmesh_kvpool::{KvPool, PoolConfig};
use kvmesh_kvwire::{DataPath, Welcome};
use tokio::sync::mpsc;

use super::server::KvServer;
use super::{Endpoint, KvAuth, Landing, TransportError, WritePath};
use crate::handshake::ReservationTable;

/// How KV pages travel from prefill to decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// KV frames over TCP, checked by the receiver before they land
    /// ([`super::tcp`]).
    #[default]
    Tcp,
    /// One-sided writes into the decode pool's shared-memory mapping
    /// ([`super::shm`]).
    Shm,
    /// One-sided UCX puts into the decode pool ([`super::ucx`]).
    Ucx,
}

/// How a transport's control connection (Challenge, Hello, Welcome,
/// TransferDone, Abort, ...) travels, and so what its listen address is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// TCP on `HOST:PORT` (mutual TLS where the mesh has certificates).
    Tcp,
    /// A Unix socket at a path: one host, and the peer's pid is known.
    Unix,
}

impl Control {
    /// The endpoint writers dial for a listener at `addr`.
    pub fn endpoint(self, addr: &str) -> Endpoint {
        match self {
            Self::Tcp => Endpoint::Tcp(addr.to_owned()),
            Self::Unix => Endpoint::Unix(addr.into()),
        }
    }
}

/// A decode node's pool and the landing its writes go through.
pub(crate) type Landed = (KvPool, Arc<dyn Landing>);

/// A writer connection's write path.
pub(crate) type Writer = Box<dyn WritePath>;

/// One transport's row of the table; each transport module exports its
/// own (`SPEC`).
#[derive(Debug)]
pub(crate) struct Spec {
    /// The name flags and the mesh file use.
    pub(crate) name: &'static str,
    /// One line for `--help`.
    pub(crate) about: &'static str,
    /// How its control connection travels.
    pub(crate) control: Control,
    /// Whether this process can run it (a library it loads at run time).
    pub(crate) available: fn() -> Result<(), TransportError>,
    /// The decode side: a pool of the config and its landing, under the
    /// settings; the `&str` is the node's name, for logs.
    pub(crate) land: fn(PoolConfig, &ListenSettings, &str) -> Result<Landed, TransportError>,
    /// The writer side: the write path of a connection whose Welcome named
    /// this transport's data path.
    pub(crate) write_path: fn(&Welcome, &Outbound<'_>) -> Result<Writer, TransportError>,
}

/// What a writer's connection offers a write path.
#[derive(Debug)]
pub(crate) struct Outbound<'a> {
    /// The connection's outbound queue (frames travel there, in order with
    /// control messages).
    pub(crate) tx: &'a mpsc::Sender<Vec<u8>>,
    /// The IP the writer dialled (a UCX listener on an unspecified IP is
    /// reached there).
    pub(crate) peer: Option<IpAddr>,
}

impl TransportKind {
    /// Every transport, in the order `--help` lists them; the suites that
    /// run over every transport iterate this.
    pub const ALL: [Self; 3] = [Self::Tcp, Self::Shm, Self::Ucx];

    /// The table: this kind's row.
    fn spec(self) -> &'static Spec {
        match self {
            Self::Tcp => &super::tcp::SPEC,
            Self::Shm => &super::shm::SPEC,
            Self::Ucx => &super::ucx::SPEC,
        }
    }

    /// The kind whose writers a `Welcome`'s data path calls for.
    pub fn of(path: &DataPath) -> Self {
        match path {
            DataPath::Frames => Self::Tcp,
            DataPath::SharedMemory { .. } => Self::Shm,
            DataPath::Ucx { .. } => Self::Ucx,
        }
    }

    /// The name `--transport` and the mesh file's `transport` use.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// One line on what it is, for `--help`.
    pub fn about(self) -> &'static str {
        self.spec().about
    }

    /// How its control connection travels.
    pub fn control(self) -> Control {
        self.spec().control
    }

    /// Whether this process can run it: an error naming what is missing
    /// (UCX: libucp not installed). Suites skip a kind that is not.
    pub fn available(self) -> Result<(), TransportError> {
        (self.spec().available)()
    }

    /// The writer side of a connection whose Welcome is `welcome`.
    pub(crate) fn write_path(
        welcome: &Welcome,
        out: &Outbound<'_>,
    ) -> Result<Box<dyn WritePath>, TransportError> {
        (Self::of(&welcome.data_path).spec().write_path)(welcome, out)
    }
}

/// Always available (nothing loaded at run time).
pub(crate) fn always() -> Result<(), TransportError> {
    Ok(())
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A transport name that is none of [`TransportKind::ALL`]'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownTransport;

impl fmt::Display for UnknownTransport {
    /// "expected tcp, shm or ucx": the names, from the table.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("expected ")?;
        let n = TransportKind::ALL.len();
        for (i, k) in TransportKind::ALL.iter().enumerate() {
            let sep = match i {
                0 => "",
                i if i + 1 == n => " or ",
                _ => ", ",
            };
            write!(f, "{sep}{k}")?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownTransport {}

impl FromStr for TransportKind {
    type Err = UnknownTransport;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or(UnknownTransport)
    }
}

/// Where and how a decode node's KV transport listens: what `kvmesh
/// serve`'s flags or the mesh file say, for any kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenSettings {
    /// The transport.
    pub kind: TransportKind,
    /// The control listener: `HOST:PORT` where the kind's control travels
    /// on TCP ([`Control::Tcp`]), a Unix socket path where it is
    /// [`Control::Unix`] (a stale socket there is removed first).
    pub control: String,
    /// Where the shared-memory pool mapping goes (e.g. `/dev/shm`; `shm`
    /// only).
    pub shm_dir: PathBuf,
    /// UCX's listener (`ucx` only; port 0: any; an unspecified IP is
    /// reached at the host writers dialled for control).
    pub ucx_listen: SocketAddr,
}

impl ListenSettings {
    /// The settings of a mesh on one host: control on `127.0.0.1:0`, or
    /// on the Unix socket `socket()` makes where the kind's control is a
    /// Unix socket (called only then); pool mappings in `shm_dir`; UCX on
    /// `127.0.0.1:0`.
    pub fn loopback<E>(
        kind: TransportKind,
        shm_dir: PathBuf,
        socket: impl FnOnce() -> Result<String, E>,
    ) -> Result<Self, E> {
        let control = match kind.control() {
            Control::Tcp => "127.0.0.1:0".to_owned(),
            Control::Unix => socket()?,
        };
        Ok(Self {
            kind,
            control,
            shm_dir,
            ucx_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        })
    }

    /// The decode side's pool of `pool` and its landing; `node` names the
    /// node in logs.
    pub fn land(
        &self,
        pool: PoolConfig,
        node: &str,
    ) -> Result<(KvPool, Arc<dyn Landing>), TransportError> {
        (self.kind.spec().land)(pool, self, node)
    }

    /// The listener writers connect to, in front of `table`. TLS (in
    /// `auth`) applies where control travels on TCP.
    pub async fn listen(
        &self,
        table: ReservationTable,
        auth: KvAuth,
    ) -> Result<KvServer, TransportError> {
        match self.kind.control() {
            Control::Tcp => KvServer::bind_tcp(table, &self.control, auth).await,
            Control::Unix => {
                let socket = Path::new(&self.control);
                let _ = std::fs::remove_file(socket);
                KvServer::bind_unix(table, socket, auth.secret).await
            }
        }
    }
}
