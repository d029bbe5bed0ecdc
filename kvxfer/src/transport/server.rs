//! The decode node's transport listener: accepts writer connections, runs
//! the mesh-authenticated Challenge/Hello/Welcome exchange
//! ([`kvmesh_meshauth::kv`]; nothing from a connection reaches the table before
//! its Hello proved the mesh secret), feeds frames and control messages to
//! the [`ReservationTable`], carries its Abort and Revoke messages back,
//! and reports a lost connection so everything bound to it is revoked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::handshake::{outbound_capacity, HandshakeError, ReservationTable};
use crate::shm::PeerProcess;
use kvmesh_kvwire::{decode, DecodeLimits, Message, MessageType, Welcome, PROOF_LEN};
use kvmesh_meshauth::kv::{mint_nonce, welcome_proof};
use kvmesh_meshauth::{KvAuthCounters, KvAuthRefusal, MeshSecret};

use super::greeting::authenticate;
use super::stream::{pump, read_message};
use super::{KvAuth, TransportError};
use kvmesh_meshauth::tls::Purpose;

/// How long a new connection has to answer the Challenge with a valid
/// Hello (and, before that, to finish its TLS handshake).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections that may wait for their Hello at once; one more is closed
/// as soon as it is accepted (`too_many_unauthenticated`), so strangers
/// cannot hold more than this many tasks and sockets, each for at most
/// [`HELLO_TIMEOUT`] (or twice that behind TLS). Writers are a handful of
/// prefill nodes that authenticate within a round trip.
pub const MAX_UNAUTHENTICATED: usize = 64;
/// Bytes read from a connection per syscall, at most.
const READ_BUFFER: usize = 1 << 18;
/// How often the table's timers run.
pub const TICK: Duration = Duration::from_millis(20);

/// A running listener. Dropping it stops accepting and ticking; open
/// connections end when their writers hang up.
#[derive(Debug)]
pub struct KvServer {
    endpoint: String,
    accept: JoinHandle<()>,
    ticker: JoinHandle<()>,
    socket_path: Option<PathBuf>,
    auth: Arc<Auth>,
}

/// The mesh secret writers must prove, the connections refused, and the
/// room for connections still to prove it.
#[derive(Debug)]
struct Auth {
    secret: MeshSecret,
    refused: KvAuthCounters,
    unauthenticated: Arc<tokio::sync::Semaphore>,
}

impl Auth {
    fn new(secret: MeshSecret) -> Arc<Self> {
        Arc::new(Self {
            secret,
            refused: KvAuthCounters::default(),
            unauthenticated: Arc::new(tokio::sync::Semaphore::new(MAX_UNAUTHENTICATED)),
        })
    }

    /// Room for one more connection to authenticate, or `None` (counted:
    /// the caller closes it).
    fn admit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let permit = Arc::clone(&self.unauthenticated).try_acquire_owned().ok();
        if permit.is_none() {
            self.refused.record(KvAuthRefusal::TooManyUnauthenticated);
        }
        permit
    }
}

impl KvServer {
    /// Listens on TCP `addr` (e.g. `127.0.0.1:0`); accepts writers that
    /// prove the mesh secret, inside mutual TLS when `auth` has an identity
    /// (handshake refusals counted by it).
    pub async fn bind_tcp(
        table: ReservationTable,
        addr: &str,
        auth: impl Into<KvAuth>,
    ) -> Result<Self, TransportError> {
        let KvAuth { secret, tls } = auth.into();
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| TransportError::Io {
                op: "bind tcp",
                source,
            })?;
        let local = listener.local_addr().map_err(|source| TransportError::Io {
            op: "local addr",
            source,
        })?;
        let endpoint = format!("tcp://{local}");
        table.set_endpoint(&endpoint);
        let t = table.clone();
        let auth = Auth::new(secret);
        let a = Arc::clone(&auth);
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let Some(permit) = a.admit() else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (t, a, tls) = (t.clone(), Arc::clone(&a), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => serve(t, stream, None, a, permit).await,
                        // A refused handshake is counted by the TLS
                        // identity; nothing reached the table. A silent
                        // peer is cut off like one that sends no Hello.
                        Some(tls) => {
                            let shake = tls.accept(stream, Purpose::Kv);
                            match tokio::time::timeout(HELLO_TIMEOUT, shake).await {
                                Ok(Ok(s)) => serve(t, s, None, a, permit).await,
                                Ok(Err(_)) => {}
                                Err(_) => a.refused.record(KvAuthRefusal::Timeout),
                            }
                        }
                    }
                });
            }
        });
        Ok(Self {
            endpoint,
            accept,
            ticker: spawn_ticker(table),
            socket_path: None,
            auth,
        })
    }

    /// Listens on a Unix-domain socket at `path` (the shared-memory
    /// transport's control connection; the peer's pid comes from the
    /// socket, and its process is watched through a pidfd); accepts
    /// writers that prove `secret`.
    pub async fn bind_unix(
        table: ReservationTable,
        path: &Path,
        secret: MeshSecret,
    ) -> Result<Self, TransportError> {
        let listener = UnixListener::bind(path).map_err(|source| TransportError::Io {
            op: "bind unix socket",
            source,
        })?;
        let endpoint = format!("unix:{}", path.display());
        table.set_endpoint(&endpoint);
        let t = table.clone();
        let auth = Auth::new(secret);
        let a = Arc::clone(&auth);
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let Some(permit) = a.admit() else {
                    continue;
                };
                let peer = stream
                    .peer_cred()
                    .ok()
                    .and_then(|c| c.pid())
                    .and_then(|pid| PeerProcess::from_pid(pid).ok());
                tokio::spawn(serve(t.clone(), stream, peer, Arc::clone(&a), permit));
            }
        });
        Ok(Self {
            endpoint,
            accept,
            ticker: spawn_ticker(table),
            socket_path: Some(path.to_owned()),
            auth,
        })
    }

    /// Where writers connect: `tcp://ADDR` or `unix:PATH`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Connections closed before their writer was authenticated, by kind.
    pub fn auth_refused(&self) -> &KvAuthCounters {
        &self.auth.refused
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        self.accept.abort();
        self.ticker.abort();
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn spawn_ticker(table: ReservationTable) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(TICK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            table.tick(Instant::now());
        }
    })
}

/// One writer connection, start to end; `unauthenticated` is its room
/// among the connections waiting for their Hello, given back once it has
/// proved the mesh secret (or ended).
async fn serve<S>(
    table: ReservationTable,
    stream: S,
    peer: Option<PeerProcess>,
    auth: Arc<Auth>,
    unauthenticated: tokio::sync::OwnedSemaphorePermit,
) where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, mut wr) = tokio::io::split(stream);
    // Frames arrive back to back: read them in large chunks, not one
    // syscall per header and body.
    let mut rd = tokio::io::BufReader::with_capacity(READ_BUFFER, rd);
    let limits = DecodeLimits::default();
    let mut buf = Vec::new();
    // No nonce, no connection (the OS random number generator failed).
    let Ok(challenge) = mint_nonce() else {
        return;
    };
    let opened = authenticate(&mut rd, &mut wr, &mut buf, &limits, &auth.secret, challenge);
    let hello = match tokio::time::timeout(HELLO_TIMEOUT, opened).await {
        Ok(Ok(h)) => h,
        Ok(Err(refusal)) => {
            auth.refused.record(refusal);
            return;
        }
        Err(_) => {
            auth.refused.record(KvAuthRefusal::Timeout);
            return;
        }
    };
    drop(unauthenticated);
    let mut welcome = Welcome {
        proof: [0; PROOF_LEN],
        data_path: table.landing().data_path(),
        geometry: table.geometry(),
    };
    welcome.proof = welcome_proof(&auth.secret, &challenge, &hello, &welcome);
    // Registered before the Welcome goes out, so a writer that has its
    // Welcome can be granted to at once. What the table sends meanwhile
    // waits in the queue until the pump starts, behind the Welcome.
    let (tx, rx) = mpsc::channel(outbound_capacity(table.pool()));
    let conn = match table.register(hello.writer, tx, peer) {
        Ok(c) => c,
        Err(_) => return,
    };
    let mut bytes = Vec::new();
    if welcome.encode(&mut bytes).is_err() || wr.write_all(&bytes).await.is_err() {
        table.connection_lost(conn);
        return;
    }
    let pump = tokio::spawn(pump(wr, rx));
    loop {
        match read_message(&mut rd, &mut buf, &limits).await {
            Ok(true) => {}
            Ok(false) | Err(_) => break,
        }
        let msg = match decode(&buf, &limits) {
            Ok((m, _)) => m,
            // The header was sound (read_message checked it), so the
            // stream stays in step: count, drop this message, go on.
            Err(e) => {
                table.frame_rejects().record_wire(&e);
                continue;
            }
        };
        // Refusals are typed and counted by the table; the connection
        // goes on (a late frame after an abort is normal).
        let _ = match msg {
            Message::KvFrame(f) => table.land_frame(conn, &f).map(|_| ()),
            Message::TransferDone(d) => table.transfer_done(conn, &d).map(|_| ()),
            Message::AbortConfirmed(c) => table.abort_confirmed(conn, &c).map(|_| ()),
            other => {
                let e = HandshakeError::UnexpectedMessage(unexpected_name(&other));
                table.count_control_reject(&e);
                Err(e)
            }
        };
    }
    table.connection_lost(conn);
    pump.abort();
}

fn unexpected_name(m: &Message<'_>) -> &'static str {
    match m.message_type() {
        MessageType::KvFrame => "kv_frame",
        MessageType::Grant => "grant",
        MessageType::TransferDone => "transfer_done",
        MessageType::Abort => "abort",
        MessageType::AbortConfirmed => "abort_confirmed",
        MessageType::Revoke => "revoke",
        MessageType::Hello => "hello",
        MessageType::Welcome => "welcome",
        MessageType::Challenge => "challenge",
    }
}
