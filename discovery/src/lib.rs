//! kvmesh membership through etcd (`discovery: etcd` in the mesh file).
//!
//! Prefill and decode nodes register under the mesh's key prefix with a
//! lease they keep alive ([`Registration`]); the router and the prefill
//! nodes watch the prefix ([`Watcher`]) and get the current members as one
//! value ([`View`]) each time it changes. A node killed without a word
//! leaves every view when its lease expires (its TTL, 3 s by default); a
//! node told to stop revokes its lease first ([`Registration::deregister`]),
//! before it drains.
//!
//! # Layout
//! - [`member`]: the registration value, its key, and its one decoder
//!   (etcd's content is network input: a bad entry is a typed
//!   [`MemberError`], never a panic, never a member).
//! - [`config`]: [`EtcdConfig`], checked once (endpoints, prefix, TTL).
//! - `register` (re-exported): [`register`] and [`Registration`], the
//!   keep-alive task, and re-registration when a lease was lost.
//! - `watch` (re-exported): [`Watcher`], which gets the prefix and then
//!   watches it from that revision, and starts over (get, then watch) after
//!   any failure; while etcd cannot be reached the last view stays, marked
//!   [`Health::Degraded`].
//!
//! # What this crate owns
//! - A view is built only from entries [`Member::decode`] accepted, and is
//!   replaced whole on every resynchronization, so an entry deleted while
//!   the watcher was cut off cannot survive its reconnection.
//! - A node's key is written only while no live lease holds it (a
//!   transaction on its create revision), so two processes of one name do
//!   not overwrite each other; a restarted node waits for its predecessor's
//!   lease to expire.
//! - Registrations are addresses, not credentials: nothing here proves
//!   anything about a member, and nothing secret is written (mesh
//!   authentication, `kvmesh-meshauth`, stays the gate).

pub mod config;
pub mod member;
mod register;
mod watch;

use std::time::Duration;

pub use config::{EtcdConfig, EtcdTls};
pub use member::{Member, MemberError, Role};
pub use register::{register, Registration};
pub use watch::{Health, View, Watcher};

use thiserror::Error;

/// Why an etcd operation failed.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// etcd answered with an error, or could not be reached.
    #[error("etcd ({what}): {source}")]
    Etcd {
        /// The operation.
        what: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// A TLS file of `etcd.tls` could not be read.
    #[error("etcd.tls: {}: {source}", .path.display())]
    TlsFile {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// etcd did not answer in time.
    #[error("etcd ({what}): no answer within {} ms", .after.as_millis())]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// Another live process holds this node's key.
    #[error(
        "{key} is registered by another live process (lease {lease:x}); two nodes cannot share a name \
         (waited {} s for it to expire)", .waited.as_secs()
    )]
    NameTaken {
        /// The key.
        key: String,
        /// The lease that holds it.
        lease: i64,
        /// How long this node waited.
        waited: Duration,
    },
    /// etcd granted no lease (TTL 0 or an error text).
    #[error("etcd refused a lease of {ttl} s: {reason}")]
    Lease {
        /// The TTL asked.
        ttl: i64,
        /// etcd's words.
        reason: String,
    },
    /// A watch ended for a reason other than a broken connection.
    #[error("etcd watch: {0}")]
    Watch(String),
    /// The registration to write is not valid.
    #[error(transparent)]
    Member(#[from] MemberError),
}

/// How often an etcd connection pings. etcd refuses pings closer than its
/// `--grpc-keepalive-min-time` (5 s by default): after the third it sends
/// GOAWAY (`too_many_pings`) and closes the connection. At the 1 s this
/// was, every watcher's connection was closed every 4 s while idle, so the
/// router and prefill nodes went degraded and re-read the whole prefix
/// every 4 s (found on the namespace lab, issue 36). 6 s keeps a margin
/// over the 5 s for timer and network jitter.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(6);
/// How long a ping may go unanswered before the connection counts dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs one etcd call bounded by `after`.
async fn bounded<T>(
    what: &'static str,
    after: Duration,
    call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, DiscoveryError> {
    match tokio::time::timeout(after, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(DiscoveryError::Etcd { what, source }),
        Err(_) => Err(DiscoveryError::Timeout { what, after }),
    }
}

/// A client of the mesh's etcd. Connecting is lazy (etcd-client's balanced
/// channel): an unreachable etcd shows as the first call's error or
/// timeout, which every call here bounds. HTTP/2 keep-alives make a dead
/// connection fail its streams (watch, lease keep-alive) within
/// [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`] instead of hanging.
async fn connect(cfg: &EtcdConfig) -> Result<etcd_client::Client, DiscoveryError> {
    let mut opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(cfg.dial_timeout)
        .with_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT)
        .with_keep_alive_while_idle(true);
    if let Some(tls) = &cfg.tls {
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|source| DiscoveryError::TlsFile {
                path: path.to_owned(),
                source,
            })
        };
        let (ca, cert, key) = (read(&tls.ca)?, read(&tls.cert)?, read(&tls.key)?);
        opts = opts.with_tls(
            etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(ca))
                .identity(etcd_client::Identity::from_pem(cert, key)),
        );
    }
    bounded(
        "connect",
        cfg.dial_timeout,
        etcd_client::Client::connect(&cfg.endpoints, Some(opts)),
    )
    .await
}

/// Sleeps `d`, or returns `true` early once `stop` is set (or its sender
/// is gone).
async fn sleep_or_stop(d: Duration, stop: &mut tokio::sync::watch::Receiver<bool>) -> bool {
    let stopped = tokio::time::timeout(d, stop.wait_for(|s| *s)).await;
    // Set, or the sender is gone (nobody can stop us any more: stop too).
    matches!(stopped, Ok(Ok(_)) | Ok(Err(_)))
}
