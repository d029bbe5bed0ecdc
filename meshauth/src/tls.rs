//! Mutual TLS between the mesh's processes (feature `tls`), on top of the
//! mesh secret: confidentiality and per-record integrity for the internal
//! gRPC channels and the TCP KV transport, and a second, independent
//! gate: a peer must present a certificate of the mesh's CA *and* prove
//! the mesh secret.
//!
//! [`MeshTls`] holds the rustls server and client configurations made from
//! three PEM files the mesh file names: the CA that signs every node's
//! certificate, this node's certificate chain and its private key. TLS 1.3
//! only (ring's primitives), client certificates required and checked
//! against the CA (validity dates included) by the server; the client
//! checks the server's certificate against the CA and the name it dialled
//! (so each node's certificate names, as a DNS or IP subject alternative
//! name, the address its peers dial).
//!
//! Reload: before a handshake, if [`RELOAD_CHECK`] has passed since the
//! last look, the three files' modification times are compared with the
//! loaded ones; on a change the configurations are rebuilt and used from
//! the next handshake on (connections already open keep theirs). A change
//! that does not load (a half-written key, say) keeps the previous
//! configuration and is counted ([`MeshTls::reload_failures`]).
//!
//! Refusals: a server-side handshake that fails is counted by kind
//! ([`TLS_REFUSAL_KINDS`]): no certificate, one from another CA, an
//! expired one, another bad certificate, a failed handshake (plaintext or
//! garbage), a timeout.
//!
//! Cost: one handshake per connection (the mesh keeps its connections:
//! one gRPC channel per node pair, one KV connection per decode endpoint),
//! then AES-GCM or ChaCha20-Poly1305 on every record.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use kvmesh_counters::KindCounters;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, ClientConfig, RootCertStore, ServerConfig};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};

/// How often the files are looked at for a change, at most.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);
/// How long a server-side handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Labels of [`TlsRefusals`]: every [`TlsRefusal::kind`].
pub const TLS_REFUSAL_KINDS: [&str; 6] = [
    "no_certificate",
    "unknown_ca",
    "expired",
    "bad_certificate",
    "handshake",
    "timeout",
];

/// The PEM files of a node's TLS identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The mesh's CA certificate(s): peers' certificates must chain to one.
    pub ca: PathBuf,
    /// This node's certificate chain, leaf first.
    pub cert: PathBuf,
    /// This node's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why the TLS files cannot be used.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file cannot be read or holds no usable PEM item.
    #[error("{file}: {reason}")]
    File {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration (a key that does not match the
    /// certificate, say).
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The client verifier could not be built (no usable CA).
    #[error("TLS client verifier: {0}")]
    Verifier(String),
    /// An address names no host a certificate can be checked against.
    #[error("{0:?}: not a host name or IP address to check a certificate against")]
    ServerName(String),
}

/// Why a server-side handshake failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsRefusal {
    /// The client presented no certificate.
    NoCertificate,
    /// Its certificate does not chain to the mesh's CA.
    UnknownCa,
    /// Its certificate has expired (or is not valid yet).
    Expired,
    /// Another certificate problem (wrong usage, bad signature, ...).
    BadCertificate,
    /// Not a TLS handshake, or it failed otherwise.
    Handshake,
    /// No handshake within [`HANDSHAKE_TIMEOUT`].
    Timeout,
}

impl TlsRefusal {
    /// A short stable name, used as a metric label.
    pub fn kind(self) -> &'static str {
        TLS_REFUSAL_KINDS[self as usize]
    }

    /// The refusal an accept's error stands for.
    fn of(e: &io::Error) -> Self {
        let tls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match tls {
            Some(rustls::Error::NoCertificatesPresented) => Self::NoCertificate,
            Some(rustls::Error::InvalidCertificate(c)) => match c {
                CertificateError::UnknownIssuer => Self::UnknownCa,
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => Self::Expired,
                _ => Self::BadCertificate,
            },
            _ => Self::Handshake,
        }
    }
}

/// Handshakes refused, by kind; lock-free.
#[derive(Debug, Default)]
pub struct TlsRefusals(KindCounters<{ TLS_REFUSAL_KINDS.len() }>);

impl TlsRefusals {
    /// Counts one refusal.
    pub fn record(&self, r: TlsRefusal) {
        self.0.bump(r as usize);
    }

    /// Refusals of one kind (0 for a name that is not a kind).
    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(&TLS_REFUSAL_KINDS, kind)
    }

    /// Every kind with its count, zeros included.
    pub fn by_kind(&self) -> [(&'static str, u64); TLS_REFUSAL_KINDS.len()] {
        self.0.by_kind(&TLS_REFUSAL_KINDS)
    }

    /// The kinds seen, with their counts (a load report's map).
    pub fn seen(&self) -> std::collections::HashMap<String, u64> {
        self.by_kind()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| (k.to_owned(), n))
            .collect()
    }
}

/// What a connection carries: its ALPN protocols differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// An internal gRPC channel (ALPN `h2`; the server also offers
    /// `http/1.1`, for `/metrics` scrapes).
    Grpc,
    /// A TCP KV transport connection (ALPN `kvmesh-kv`).
    Kv,
}

/// The ALPN protocol of the KV transport.
const KV_ALPN: &[u8] = b"kvmesh-kv";

struct Configs {
    /// By [`Purpose`]: gRPC, KV.
    server: [Arc<ServerConfig>; 2],
    client: [Arc<ClientConfig>; 2],
}

struct Loaded {
    configs: Configs,
    /// The files' modification times when loaded.
    stamps: [Option<SystemTime>; 3],
    checked: Instant,
}

/// A node's TLS identity, reloaded when its files change.
pub struct MeshTls {
    files: TlsFiles,
    loaded: Mutex<Loaded>,
    refused: TlsRefusals,
    reload_failures: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl MeshTls {
    /// Loads `files`; refuses what rustls would refuse.
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, TlsError> {
        let stamps = stamps(&files);
        let configs = configs(&files)?;
        Ok(Arc::new(Self {
            files,
            loaded: Mutex::new(Loaded {
                configs,
                stamps,
                checked: Instant::now(),
            }),
            refused: TlsRefusals::default(),
            reload_failures: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// The files.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The configurations for `purpose` now (reloaded first if the files
    /// changed).
    fn current(&self, purpose: Purpose) -> (Arc<ServerConfig>, Arc<ClientConfig>) {
        let mut l = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if l.checked.elapsed() >= RELOAD_CHECK {
            l.checked = Instant::now();
            let now = stamps(&self.files);
            if now != l.stamps {
                l.stamps = now;
                match configs(&self.files) {
                    Ok(c) => {
                        l.configs = c;
                        tracing::info!(cert = %self.files.cert.display(), "TLS identity reloaded");
                    }
                    Err(e) => {
                        self.reload_failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(error = %e, "TLS files changed but do not load: keeping the previous identity");
                    }
                }
            }
        }
        let i = purpose as usize;
        (
            Arc::clone(&l.configs.server[i]),
            Arc::clone(&l.configs.client[i]),
        )
    }

    /// Server-side handshakes refused, by kind.
    pub fn refused(&self) -> &TlsRefusals {
        &self.refused
    }

    /// Changes of the files that did not load.
    pub fn reload_failures(&self) -> u64 {
        self.reload_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The server side of a handshake on `io`; a failure is counted and
    /// returned.
    pub async fn accept<S>(
        &self,
        io: S,
        purpose: Purpose,
    ) -> Result<tokio_rustls::server::TlsStream<S>, TlsRefusal>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let (server, _) = self.current(purpose);
        let acceptor = tokio_rustls::TlsAcceptor::from(server);
        let r = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(TlsRefusal::of(&e)),
            Err(_) => Err(TlsRefusal::Timeout),
        };
        if let Err(k) = r {
            self.refused.record(k);
        }
        r
    }

    /// The client side of a handshake on `io` with the peer dialled as
    /// `addr` (`HOST:PORT`; the certificate must name HOST).
    pub async fn connect<S>(
        &self,
        io: S,
        addr: &str,
        purpose: Purpose,
    ) -> io::Result<tokio_rustls::client::TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let name = server_name(addr)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let (_, client) = self.current(purpose);
        tokio_rustls::TlsConnector::from(client)
            .connect(name, io)
            .await
    }
}

/// The name a certificate must carry for `addr` (`HOST:PORT`, `[V6]:PORT`).
pub fn server_name(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let host = addr
        .rsplit_once(':')
        .map_or(addr, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    ServerName::try_from(host.to_owned()).map_err(|_| TlsError::ServerName(addr.to_owned()))
}

fn stamps(f: &TlsFiles) -> [Option<SystemTime>; 3] {
    [&f.ca, &f.cert, &f.key].map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
}

fn file_error(file: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        file: file.to_owned(),
        reason: reason.to_string(),
    }
}

fn certs(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(file)
        .map_err(|e| file_error(file, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(file, e))?;
    if certs.is_empty() {
        return Err(file_error(file, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// The server and client configurations of `f`, for each purpose.
fn configs(f: &TlsFiles) -> Result<Configs, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in certs(&f.ca)? {
        roots
            .add(c)
            .map_err(|e| file_error(&f.ca, format!("not a usable CA certificate: {e}")))?;
    }
    let roots = Arc::new(roots);
    let chain = certs(&f.cert)?;
    let key = PrivateKeyDer::from_pem_file(&f.key).map_err(|e| file_error(&f.key, e))?;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
            .build()
            .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut server = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())?;
    let client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    let (mut server_kv, mut client_kv) = (server.clone(), client.clone());
    let mut client_grpc = client;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    client_grpc.alpn_protocols = vec![b"h2".to_vec()];
    server_kv.alpn_protocols = vec![KV_ALPN.to_vec()];
    client_kv.alpn_protocols = vec![KV_ALPN.to_vec()];
    Ok(Configs {
        server: [Arc::new(server), Arc::new(server_kv)],
        client: [Arc::new(client_grpc), Arc::new(client_kv)],
    })
}

#[cfg(test)]
mod tests;
