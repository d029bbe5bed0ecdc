//! `discovery: etcd` in the processes of a mesh: the router follows the
//! mesh's prefix into its [`Nodes`]; prefill and decode nodes register
//! (and deregister first thing on SIGTERM); prefill nodes keep a KV
//! connection to every registered decode node. A prefill node of a static
//! mesh keeps one to every decode node of the mesh file the same way.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvmesh_discovery::{EtcdConfig, Health, Member, Registration, View, Watcher};
use kvmesh_prefill::PrefillNode;
use kvmesh_router::membership::Discovery;
use kvmesh_router::nodes::{Nodes, Role};
use tokio::sync::watch;

/// How often a prefill node checks its KV connections to decode nodes
/// (and retries those that failed, after their backoff).
const RECONNECT_EVERY: Duration = Duration::from_millis(500);
/// Bound on one KV connection attempt (TCP connect and the mesh-secret
/// handshake).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait before a failing decode endpoint is tried again.
const MAX_RETRY: Duration = Duration::from_secs(10);
/// The same for a static mesh's decode nodes: one that is down is still
/// routed to once it is back (its address never leaves the mesh file, and
/// the router asks it within its poll), so a long wait here would be a
/// long window of refused grants (the router retries those for 2 s). A
/// refused connect every second costs nothing.
const FIXED_MAX_RETRY: Duration = Duration::from_secs(1);

/// The router's membership following etcd, until dropped.
#[derive(Debug)]
pub(crate) struct Following {
    watcher: Watcher,
    task: tokio::task::JoinHandle<()>,
}

impl Following {
    /// Stops following.
    pub(crate) async fn stop(self) {
        self.task.abort();
        self.watcher.stop().await;
    }
}

/// Starts following `cfg`'s prefix into `nodes` (members, and whether the
/// view is current); returns once the first answer (or failure) is in,
/// at most the dial timeout and a second after.
pub(crate) async fn follow(cfg: &EtcdConfig, nodes: &Nodes) -> Following {
    let started = Instant::now();
    let watcher = Watcher::spawn(cfg.clone());
    let first = watcher
        .first(cfg.dial_timeout + Duration::from_secs(1))
        .await;
    apply(nodes, &first, started);
    let mut views = watcher.views();
    let nodes = nodes.clone();
    let task = tokio::spawn(async move {
        while views.changed().await.is_ok() {
            let view = views.borrow_and_update().clone();
            apply(&nodes, &view, started);
        }
    });
    Following { watcher, task }
}

/// One view into the router's nodes.
fn apply(nodes: &Nodes, view: &View, started: Instant) {
    let specs: Vec<(String, Role, String)> = view
        .members()
        .map(|m| {
            let role = match m.role {
                kvmesh_discovery::Role::Prefill => Role::Prefill,
                kvmesh_discovery::Role::Decode => Role::Decode,
            };
            (m.name.clone(), role, format!("http://{}", m.grpc))
        })
        .collect();
    nodes.set_members(&specs);
    nodes.set_refused(view.refused);
    let degraded_since = match &view.health {
        Health::Live => None,
        // Not reached yet: as stale as it gets.
        Health::Connecting => Some(started),
        Health::Degraded { since, .. } => Some(*since),
    };
    nodes.set_discovery(Discovery::Watched {
        source: "etcd",
        degraded_since,
    });
}

/// Registers `member` (waiting out a predecessor's lease, see
/// `kvmesh_discovery::register`).
pub(crate) async fn register(cfg: &EtcdConfig, member: Member) -> Result<Registration> {
    let key = member.key(&cfg.prefix);
    kvmesh_discovery::register(cfg, member)
        .await
        .with_context(|| format!("registering {key} in etcd"))
}

/// `signal`, then the registration revoked: what a node's drain waits
/// for, so the node leaves every view before it starts refusing work.
pub(crate) async fn leave_first(signal: impl Future<Output = ()>, reg: Option<Registration>) {
    signal.await;
    if let Some(reg) = reg {
        let key = reg.key().to_owned();
        if let Err(e) = reg.deregister().await {
            tracing::warn!(key = %key, error = %e, "could not deregister: the entry expires with its lease");
        }
    }
}

/// A prefill node's decode peers: the task that keeps a KV connection to
/// every decode node (registered in etcd, or listed in a static mesh
/// file), and the watcher it follows with etcd.
#[derive(Debug)]
pub(crate) struct DecodePeers {
    watcher: Option<Watcher>,
    task: tokio::task::JoinHandle<()>,
}

impl DecodePeers {
    /// Follows `cfg`'s prefix and connects `node` to every decode node
    /// registered now (each attempt bounded), before returning; then keeps
    /// connecting to those that join and reconnecting to those whose
    /// connection broke, in a task.
    pub(crate) async fn start(cfg: &EtcdConfig, node: &PrefillNode) -> Self {
        let watcher = Watcher::spawn(cfg.clone());
        let view = watcher
            .first(cfg.dial_timeout + Duration::from_secs(1))
            .await;
        let mut peers = Peers::new(MAX_RETRY);
        peers.round(node, &endpoints(&view)).await;
        let views = watcher.views();
        let task = tokio::spawn(keep_connected(node.clone(), views, peers));
        Self {
            watcher: Some(watcher),
            task,
        }
    }

    /// Keeps `node` connected to the fixed decode nodes `decode` (name, KV
    /// endpoint), which the caller connected once already. A decode node
    /// that restarts at its address knows no writer: until this node
    /// connects again it refuses every grant for it (`writer_not_connected`),
    /// and nothing else would reconnect, since this node is called only
    /// after a grant.
    pub(crate) fn fixed(node: &PrefillNode, decode: Vec<(String, String)>) -> Self {
        let node = node.clone();
        let task = tokio::spawn(async move {
            let mut peers = Peers::new(FIXED_MAX_RETRY);
            loop {
                tokio::time::sleep(RECONNECT_EVERY).await;
                peers.round(&node, &decode).await;
            }
        });
        Self {
            watcher: None,
            task,
        }
    }

    /// Stops connecting and following.
    pub(crate) async fn stop(self) {
        self.task.abort();
        if let Some(w) = self.watcher {
            w.stop().await;
        }
    }
}

/// The decode nodes of `view` that have a KV endpoint: (name, endpoint).
fn endpoints(view: &View) -> Vec<(String, String)> {
    view.members()
        .filter_map(|m| Some((m.name.clone(), m.kv.clone()?)))
        .collect()
}

/// Per decode endpoint that failed: when to try again, and the wait after
/// that (doubling up to `max_retry`).
#[derive(Debug)]
struct Peers {
    failing: HashMap<String, (Instant, Duration)>,
    max_retry: Duration,
}

impl Peers {
    fn new(max_retry: Duration) -> Self {
        Self {
            failing: HashMap::new(),
            max_retry,
        }
    }

    /// Connects to every decode node of `decode` (name, KV endpoint) not
    /// connected (connected ones cost a check), those that failed only once
    /// their wait passed; the attempts run at once, each bounded.
    async fn round(&mut self, node: &PrefillNode, decode: &[(String, String)]) {
        let now = Instant::now();
        let mut attempts = tokio::task::JoinSet::new();
        for (name, ep) in decode {
            if self.failing.get(ep).is_some_and(|(at, _)| *at > now) {
                continue;
            }
            let (node, name, ep) = (node.clone(), name.clone(), ep.clone());
            attempts.spawn(async move {
                let r = tokio::time::timeout(CONNECT_TIMEOUT, node.connect(&ep)).await;
                (name, ep, r)
            });
        }
        while let Some(done) = attempts.join_next().await {
            let Ok((name, ep, r)) = done else { continue };
            match r {
                Ok(Ok(())) => {
                    if self.failing.remove(&ep).is_some() {
                        tracing::info!(decode = %name, endpoint = %ep, "KV connection to the decode node up");
                    }
                }
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".into(),
                    };
                    let wait = self
                        .failing
                        .get(&ep)
                        .map_or(RECONNECT_EVERY, |(_, w)| (*w * 2).min(self.max_retry));
                    if wait == RECONNECT_EVERY {
                        tracing::warn!(decode = %name, endpoint = %ep, %error, "cannot open a KV connection to the decode node; retrying");
                    }
                    self.failing.insert(ep, (Instant::now() + wait, wait));
                }
            }
        }
        // Forget endpoints that left the view.
        self.failing
            .retain(|ep, _| decode.iter().any(|(_, d)| d == ep));
    }
}

async fn keep_connected(node: PrefillNode, mut views: watch::Receiver<View>, mut peers: Peers) {
    loop {
        tokio::select! {
            r = views.changed() => if r.is_err() { return },
            () = tokio::time::sleep(RECONNECT_EVERY) => {}
        }
        let view = views.borrow_and_update().clone();
        peers.round(&node, &endpoints(&view)).await;
    }
}

/// How often a mesh on etcd without mutual TLS says so.
const INSECURE_ETCD_WARNING: Duration = Duration::from_secs(60);

/// Warns now and every minute, for the life of the process, that the mesh
/// runs on etcd without mutual TLS (`etcd.allow_insecure_etcd: true`): a
/// choice the mesh file made that every operator reading any minute of the
/// log should see.
pub(crate) async fn warn_insecure_etcd() {
    let mut every = tokio::time::interval(INSECURE_ETCD_WARNING);
    loop {
        every.tick().await;
        tracing::warn!(
            "INSECURE MEMBERSHIP (etcd.allow_insecure_etcd: true): discovery through etcd without mesh.tls: \
             anything that can write to etcd can register an address; mesh authentication keeps a \
             process without the secret from being chosen, but prompts and KV cross the network in \
             the clear. Set mesh.tls outside test meshes"
        );
    }
}
