//! A node's own entry: written under a lease, kept alive, revoked first
//! thing on shutdown.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp,
};
use tokio::sync::watch;

use crate::{bounded, connect, sleep_or_stop, DiscoveryError, EtcdConfig, Member};

/// How often a taken key is tried again while its holder's lease runs out.
const CLAIM_RETRY: Duration = Duration::from_millis(250);

/// A node's registration, kept alive by a task until
/// [`Registration::deregister`] (or the drop, which stops the keep-alives
/// and leaves the entry to expire with its lease).
pub struct Registration {
    key: String,
    client: Client,
    cfg: EtcdConfig,
    /// The lease the entry is under now (a new one after a lost lease).
    lease: Arc<AtomicI64>,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Registers `member` under `cfg.prefix` with a lease of `cfg.lease_ttl`
/// and keeps it alive in a task. If another live lease holds the key (a
/// process of the same name, or this node's predecessor killed less than a
/// TTL ago), waits up to two TTLs for it to go, then refuses with
/// [`DiscoveryError::NameTaken`].
pub async fn register(cfg: &EtcdConfig, member: Member) -> Result<Registration, DiscoveryError> {
    member.check()?;
    let mut client = connect(cfg).await?;
    let key = member.key(&cfg.prefix);
    let value = member.encode();
    let lease = claim(
        &mut client,
        cfg,
        &key,
        &value,
        cfg.lease_ttl * 2 + Duration::from_secs(1),
    )
    .await?;
    tracing::info!(key = %key, lease = format!("{lease:x}"), ttl_s = cfg.ttl_secs(), "registered in etcd");
    let lease = Arc::new(AtomicI64::new(lease));
    let (stop, stop_rx) = watch::channel(false);
    let task = tokio::spawn(keep_alive(
        client.clone(),
        cfg.clone(),
        key.clone(),
        value,
        Arc::clone(&lease),
        stop_rx,
    ));
    Ok(Registration {
        key,
        client,
        cfg: cfg.clone(),
        lease,
        stop,
        task: Some(task),
    })
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.key)
            .field("lease", &self.lease.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Registration {
    /// The key the entry is under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Removes the entry now: stops the keep-alives, then revokes the lease
    /// (which deletes the key, so every watcher drops the node at once).
    /// With etcd unreachable it fails after the dial timeout, and the entry
    /// goes when its lease expires (at most one TTL).
    pub async fn deregister(mut self) -> Result<(), DiscoveryError> {
        self.stop.send_replace(true);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        let lease = self.lease.load(Ordering::Acquire);
        bounded(
            "revoke the lease",
            self.cfg.dial_timeout,
            self.client.lease_revoke(lease),
        )
        .await?;
        tracing::info!(key = %self.key, "deregistered from etcd");
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// A lease of `cfg.lease_ttl` holding `key` = `value`: granted, then the
/// key written only if no live lease holds it (create revision 0), tried
/// again until `wait` has passed.
async fn claim(
    client: &mut Client,
    cfg: &EtcdConfig,
    key: &str,
    value: &[u8],
    wait: Duration,
) -> Result<i64, DiscoveryError> {
    let granted = bounded(
        "grant a lease",
        cfg.dial_timeout,
        client.lease_grant(cfg.ttl_secs(), None),
    )
    .await?;
    if granted.ttl() <= 0 || !granted.error().is_empty() {
        return Err(DiscoveryError::Lease {
            ttl: cfg.ttl_secs(),
            reason: granted.error().to_owned(),
        });
    }
    let lease = granted.id();
    let started = Instant::now();
    // Our own lease is kept alive while we wait (the wait may outlast it).
    let mut keeper = None;
    loop {
        if put_if_free(client, cfg, key, value, lease).await? {
            return Ok(lease);
        }
        let holder = bounded(
            "read the registration",
            cfg.dial_timeout,
            client.get(key, None),
        )
        .await?
        .kvs()
        .first()
        .map_or(0, |kv| kv.lease());
        if started.elapsed() >= wait {
            let _ = bounded(
                "revoke the lease",
                cfg.dial_timeout,
                client.lease_revoke(lease),
            )
            .await;
            return Err(DiscoveryError::NameTaken {
                key: key.to_owned(),
                lease: holder,
                waited: started.elapsed(),
            });
        }
        let (k, stream) = match keeper.as_mut() {
            Some(k) => k,
            None => {
                tracing::warn!(
                    key,
                    holder = format!("{holder:x}"),
                    "this node's key is held by another lease (a predecessor killed less than a TTL ago, \
                     or another process of this name): waiting for it to expire"
                );
                keeper.insert(open(client, cfg, lease).await?)
            }
        };
        if renew(k, stream, cfg).await? <= 0 {
            return Err(DiscoveryError::Lease {
                ttl: cfg.ttl_secs(),
                reason: "the lease was revoked while waiting for the key".into(),
            });
        }
        tokio::time::sleep(CLAIM_RETRY).await;
    }
}

/// Keeps the lease alive every third of its TTL until stopped. A broken
/// stream is reopened (with the same lease: it lives on at etcd for its
/// TTL); a lease etcd no longer knows (cut off longer than a TTL, or
/// revoked by someone) is replaced by a new one and the key written again,
/// only while no other live lease holds it ([`claim`]).
///
/// Which of the two a failure is, etcd itself says ([`lease_gone`]): the
/// client library turns a lost lease into errors of several shapes (a
/// keep-alive answer with TTL 0 on an open stream; a generic "lease keep
/// alive error" when a stream is opened for it; "requested lease not
/// found" from a write under it), and taking every one but the first for a
/// broken connection retried the dead lease for ever.
async fn keep_alive(
    mut client: Client,
    cfg: EtcdConfig,
    key: String,
    value: Vec<u8>,
    lease: Arc<AtomicI64>,
    mut stop: watch::Receiver<bool>,
) {
    let mut logged = Logged {
        held: Held::Ours,
        in_touch: true,
    };
    loop {
        let id = lease.load(Ordering::Acquire);
        let broke = hold(&mut client, &cfg, &key, &value, id, &mut stop, &mut logged).await;
        if *stop.borrow() {
            return;
        }
        let lost = match broke {
            Broke::Stopped => return,
            Broke::Lost => true,
            Broke::Failed(e) => {
                let gone = lease_gone(&mut client, &cfg, id).await;
                tracing::debug!(key = %key, lease = format!("{id:x}"), error = %e, gone, "etcd keep-alive failed");
                if !gone && logged.in_touch {
                    logged.in_touch = false;
                    tracing::warn!(key = %key, error = %e, "etcd keep-alive failed; retrying (the entry lives on for its TTL)");
                }
                gone
            }
        };
        if lost {
            tracing::warn!(key = %key, lease = format!("{id:x}"), "the registration's lease is gone at etcd (revoked, or expired while cut off): registering again");
            match claim(&mut client, &cfg, &key, &value, cfg.lease_ttl * 2).await {
                Ok(new) => {
                    lease.store(new, Ordering::Release);
                    tracing::info!(key = %key, lease = format!("{new:x}"), "registered in etcd again");
                    logged = Logged {
                        held: Held::Ours,
                        in_touch: true,
                    };
                    continue;
                }
                Err(e) => {
                    tracing::warn!(key = %key, error = %e, "registering again failed; retrying")
                }
            }
        }
        if sleep_or_stop((cfg.lease_ttl / 3).min(Duration::from_secs(1)), &mut stop).await {
            return;
        }
    }
}

/// Why [`hold`] stopped keeping a lease alive.
enum Broke {
    /// Asked to stop.
    Stopped,
    /// etcd answered a keep-alive with TTL 0: it no longer knows the lease.
    Lost,
    /// Anything else: etcd unreachable, a stream that ended, an error that
    /// may or may not mean a lost lease ([`lease_gone`] tells).
    Failed(DiscoveryError),
}

/// What [`keep_alive`] last logged, kept across streams so that a state is
/// logged once, when it begins.
struct Logged {
    /// Who held the key.
    held: Held,
    /// Whether the last keep-alive was answered.
    in_touch: bool,
}

/// Keeps lease `id` alive on one keep-alive stream, every third of the
/// TTL, checking after each renewal that `key` is still ours
/// ([`restore`]).
async fn hold(
    client: &mut Client,
    cfg: &EtcdConfig,
    key: &str,
    value: &[u8],
    id: i64,
    stop: &mut watch::Receiver<bool>,
    logged: &mut Logged,
) -> Broke {
    let (mut keeper, mut stream) = match open(client, cfg, id).await {
        Ok(k) => k,
        Err(e) => return Broke::Failed(e),
    };
    loop {
        match renew(&mut keeper, &mut stream, cfg).await {
            Ok(ttl) if ttl > 0 => {}
            Ok(_) => return Broke::Lost,
            Err(e) => return Broke::Failed(e),
        }
        if !logged.in_touch {
            logged.in_touch = true;
            tracing::info!(key, "etcd keep-alive restored");
        }
        let now = match restore(client, cfg, key, value, id).await {
            Ok(now) => now,
            Err(e) => return Broke::Failed(e),
        };
        if now != logged.held {
            match now {
                Held::Ours => {}
                Held::Rewritten => {
                    tracing::warn!(
                        key,
                        "the registration had been deleted while its lease lived: written again"
                    )
                }
                Held::Other(l) => {
                    tracing::warn!(key, holder = format!("{l:x}"), "another lease holds this node's key (a process of the same name?): not overwriting it")
                }
            }
        }
        logged.held = if now == Held::Rewritten {
            Held::Ours
        } else {
            now
        };
        if sleep_or_stop(cfg.lease_ttl / 3, stop).await {
            return Broke::Stopped;
        }
    }
}

/// Opens a keep-alive stream for lease `id`, bounded by the dial timeout.
/// `etcd-client` sends the first keep-alive as it opens the stream, so a
/// lease etcd no longer knows fails here, as a generic keep-alive error.
async fn open(
    client: &mut Client,
    cfg: &EtcdConfig,
    id: i64,
) -> Result<(LeaseKeeper, LeaseKeepAliveStream), DiscoveryError> {
    bounded(
        "keep the lease alive",
        cfg.dial_timeout,
        client.lease_keep_alive(id),
    )
    .await
}

/// One keep-alive on an open stream, bounded by the dial timeout: the
/// lease's TTL as etcd renewed it (0: etcd no longer knows the lease).
async fn renew(
    keeper: &mut LeaseKeeper,
    stream: &mut LeaseKeepAliveStream,
    cfg: &EtcdConfig,
) -> Result<i64, DiscoveryError> {
    let answer = bounded("keep the lease alive", cfg.dial_timeout, async {
        keeper.keep_alive().await?;
        stream.message().await
    })
    .await?;
    match answer {
        Some(r) => Ok(r.ttl()),
        None => Err(DiscoveryError::Watch("the keep-alive stream ended".into())),
    }
}

/// Whether etcd says lease `id` is gone (TTL -1: revoked, or expired).
/// No answer is not a yes: while etcd cannot be reached the lease may live
/// on, and replacing it then would only fail the same way.
async fn lease_gone(client: &mut Client, cfg: &EtcdConfig, id: i64) -> bool {
    bounded(
        "look the lease up",
        cfg.dial_timeout,
        client.lease_time_to_live(id, None),
    )
    .await
    .is_ok_and(|r| r.ttl() < 0)
}

/// Who holds a node's key, as [`restore`] found it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Our lease.
    Ours,
    /// Nobody did (someone deleted it while our lease lived): written again.
    Rewritten,
    /// Another lease (a process of the same name): left alone.
    Other(i64),
}

/// Checks that `key` is still ours, and writes it again under `lease` if
/// it is gone (deleted by hand, or by anyone who can write the prefix, while
/// the lease lived: the keep-alives alone would not bring it back).
async fn restore(
    client: &mut Client,
    cfg: &EtcdConfig,
    key: &str,
    value: &[u8],
    lease: i64,
) -> Result<Held, DiscoveryError> {
    let got = bounded(
        "read the registration",
        cfg.dial_timeout,
        client.get(key, Some(etcd_client::GetOptions::new().with_keys_only())),
    )
    .await?;
    match got.kvs().first().map(|kv| kv.lease()) {
        Some(l) if l == lease => Ok(Held::Ours),
        Some(other) => Ok(Held::Other(other)),
        None => Ok(if put_if_free(client, cfg, key, value, lease).await? {
            Held::Rewritten
        } else {
            // Lost the race to another writer: it holds the key now.
            Held::Other(0)
        }),
    }
}

/// Writes `key` = `value` under `lease` only if no live lease holds the
/// key (its create revision is 0: absent); whether it was written.
async fn put_if_free(
    client: &mut Client,
    cfg: &EtcdConfig,
    key: &str,
    value: &[u8],
    lease: i64,
) -> Result<bool, DiscoveryError> {
    let txn = Txn::new()
        .when([Compare::create_revision(key, CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key,
            value.to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        )]);
    let resp = bounded("write the registration", cfg.dial_timeout, client.txn(txn)).await?;
    Ok(resp.succeeded())
}
