//! The router's view of the mesh: every prefill and decode node, its gRPC
//! client (every call proves the mesh secret: `kvmesh_meshauth::grpc`),
//! its last load report and whether it is healthy. A poller asks
//! each node for its load every [`POLL`]; a node that does not answer
//! within [`LOAD_TIMEOUT`] is taken out until it answers again.
//!
//! The members are fixed (the mesh file) or follow a membership service
//! (etcd: the binary's watcher calls [`Nodes::set_members`] on every
//! change and [`Nodes::set_discovery`] when it loses or regains etcd). A
//! member is only an address: it is chosen once its load report, a call
//! that must prove the mesh secret both ways, arrived, so a registered
//! node without the secret is never chosen.
//!
//! Routing follows the prefix cache: each node's report carries the
//! routing ids of the pages it caches (only when they changed since the
//! epoch the router last saw), and [`Nodes::pick`] scores a node by the
//! prompt tokens it would not have to compute or ship (the request's page
//! keys, computed here under the same keyed hash the nodes use, matched
//! from the first page) against its load (requests this router has in
//! flight there, or the node's own queue if longer). The index is a hint:
//! a node looks up whole keys in the request's namespace, so a stale or
//! false match costs a miss, never a wrong page.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use kvmesh_prefix::{ModelTag, Namespace};

use kvmesh_meshauth::grpc::PeerChannel;
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::MeshSecret;
use kvmesh_proto::internal::v1::decode_client::DecodeClient;
use kvmesh_proto::internal::v1::prefill_client::PrefillClient;
use kvmesh_proto::internal::v1::{LoadReport, LoadRequest};
use kvmesh_proto::peer::peer_channel;
use tokio::sync::{watch, Notify};

use crate::error::Rejection;
pub use crate::membership::Discovery;

/// How often load is polled.
pub const POLL: Duration = Duration::from_millis(200);
/// How long a load report may take before the node counts as down.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Connect timeout of node channels.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// What one request in flight at a node weighs against cached prompt
/// tokens when choosing it: a node that would skip this many more prompt
/// tokens is worth one more request in its queue. About a third of the
/// multi-turn scenario's shared prefix: a hit on a long system prompt
/// outweighs a request or two of queue, not a whole backlog.
pub const LOAD_TOKENS: usize = 192;

/// A node's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Computes prompts.
    Prefill,
    /// Holds pages and generates.
    Decode,
}

impl Role {
    /// The label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// One node.
#[derive(Debug)]
pub struct Node {
    /// Its name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Its gRPC address.
    pub url: String,
    /// Signs every call to this node by name and checks its answers.
    peer: PeerChannel,
    state: Mutex<NodeState>,
    /// Requests this router has at the node now ([`Node::busy`]).
    in_flight: AtomicUsize,
    /// Requests this router has sent the node, in all (breaks ties, so
    /// equal nodes take turns).
    dispatched: AtomicU64,
    /// Load reports received from it.
    reports: AtomicU64,
}

#[derive(Debug, Default)]
struct NodeState {
    report: Option<LoadReport>,
    healthy: bool,
    /// Its last answer did not prove it (said once until it does).
    warned_unproven: bool,
    cache: CacheView,
}

/// What the router knows of a node's prefix cache.
#[derive(Debug, Default)]
struct CacheView {
    /// The epoch `ids` is from (0: none yet; the next report sends all).
    epoch: u64,
    /// The tag its keys are computed with; `None` with its cache off.
    model: Option<ModelTag>,
    /// Routing ids of its cached pages.
    ids: HashSet<u64>,
}

/// A request at a node, counted in its load while this lives.
#[derive(Debug)]
pub struct Busy(Arc<Node>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The part of a request cache-aware routing scores nodes by: its
/// namespace (derived by the gateway) and prompt.
#[derive(Clone, Copy, Debug)]
pub struct Prefix<'a> {
    /// The request's namespace.
    pub ns: &'a Namespace,
    /// Its prompt's token ids.
    pub prompt: &'a [u32],
}

/// A request's page keys as one choice of node needs them: computed once
/// per model tag and page size however many nodes are scored, and only as
/// far as some node matches (one HMAC a page).
struct RoutingIds<'a> {
    keys: &'a kvmesh_prefix::CacheKeys,
    prefix: &'a Prefix<'a>,
    /// Per (tag, page size): the keys of the first pages, so far.
    memo: Vec<(ModelTag, usize, Vec<kvmesh_prefix::PageKey>)>,
}

impl RoutingIds<'_> {
    /// The routing id of page `i` under `model` and pages of `ps`; `None`
    /// past the pages a cache may supply (those before the last token's).
    fn get(&mut self, model: &ModelTag, ps: usize, i: usize) -> Option<u64> {
        if ps == 0 || i >= self.prefix.prompt.len().saturating_sub(1) / ps {
            return None;
        }
        let at = match self
            .memo
            .iter()
            .position(|(m, p, _)| m == model && *p == ps)
        {
            Some(at) => at,
            None => {
                self.memo.push((*model, ps, Vec::new()));
                self.memo.len() - 1
            }
        };
        let keys = &mut self.memo[at].2;
        while keys.len() <= i {
            let j = keys.len();
            let page = &self.prefix.prompt[j * ps..(j + 1) * ps];
            let key = self.keys.page_key(self.prefix.ns, model, keys.last(), page);
            keys.push(key);
        }
        Some(keys[i].routing_id())
    }
}

impl Node {
    /// The decode client; its calls prove the mesh secret, its answers
    /// this node.
    pub fn decode(&self) -> DecodeClient<PeerChannel> {
        DecodeClient::new(self.peer.clone())
    }

    /// The prefill client; its calls prove the mesh secret, its answers
    /// this node.
    pub fn prefill(&self) -> PrefillClient<PeerChannel> {
        PrefillClient::new(self.peer.clone())
    }

    /// Answers of this node refused for not proving it, by kind.
    pub fn unproven(&self) -> [(&'static str, u64); kvmesh_meshauth::REPLY_REFUSAL_KINDS.len()] {
        self.peer.unproven().by_kind()
    }

    /// The last load report, if the node is healthy and not draining (a
    /// draining node finishes what it holds and takes nothing new).
    pub fn report(&self) -> Option<LoadReport> {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.healthy
            .then(|| s.report.clone())
            .flatten()
            .filter(|r| !r.draining)
    }

    /// Load reports received from it so far.
    pub fn reports(&self) -> u64 {
        self.reports.load(Ordering::Relaxed)
    }

    /// Takes the node out until its next good load report (a request to it
    /// failed as if it were down).
    pub fn mark_down(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.healthy = false;
        s.cache.epoch = 0;
    }

    /// Counts a request at this node until the guard drops.
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.dispatched.fetch_add(1, Ordering::Relaxed);
        Busy(Arc::clone(self))
    }

    /// Leading pages of the request the node caches (by the router's
    /// index), at most those before the page holding the last prompt token
    /// (that one is always computed); 0 with its cache off.
    fn matched_pages(&self, ids: &mut RoutingIds<'_>) -> usize {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (Some(model), Some(ps)) = (s.cache.model, s.report.as_ref().map(|r| r.page_size))
        else {
            return 0;
        };
        if s.cache.ids.is_empty() {
            return 0;
        }
        let mut n = 0;
        while ids
            .get(&model, ps as usize, n)
            .is_some_and(|id| s.cache.ids.contains(&id))
        {
            n += 1;
        }
        n
    }

    async fn poll(&self) {
        let known = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cache
            .epoch;
        let req = LoadRequest {
            known_cache_epoch: known,
        };
        let r = match self.role {
            Role::Decode => tokio::time::timeout(LOAD_TIMEOUT, self.decode().load(req)).await,
            Role::Prefill => tokio::time::timeout(LOAD_TIMEOUT, self.prefill().load(req)).await,
        };
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match r {
            Ok(Ok(resp)) => {
                let mut report = resp.into_inner();
                s.cache.model = kvmesh_prefix::ModelTag::from_slice(&report.cache_model_tag);
                if report.cache_page_ids_sent || s.cache.model.is_none() {
                    s.cache.ids = std::mem::take(&mut report.cache_page_ids)
                        .into_iter()
                        .collect();
                }
                s.cache.epoch = report.cache_epoch;
                if !s.healthy {
                    tracing::info!(node = %self.name, role = self.role.as_str(), "node healthy");
                }
                if report.draining && !s.report.as_ref().is_some_and(|r| r.draining) {
                    tracing::info!(node = %self.name, role = self.role.as_str(), "node draining");
                }
                s.report = Some(report);
                s.healthy = true;
                s.warned_unproven = false;
                self.reports.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Err(status)) if kvmesh_meshauth::grpc::is_unproven(&status) => {
                if s.healthy || !s.warned_unproven {
                    tracing::warn!(
                        node = %self.name,
                        role = self.role.as_str(),
                        url = %self.url,
                        error = %status.message(),
                        "node did not prove the mesh secret: not chosen until it does"
                    );
                }
                s.warned_unproven = true;
                s.healthy = false;
                s.report = None;
                s.cache = CacheView::default();
            }
            _ => {
                if s.healthy {
                    tracing::warn!(node = %self.name, role = self.role.as_str(), "node down");
                }
                s.healthy = false;
                s.cache.epoch = 0;
            }
        }
    }
}

/// Every node of the mesh: a snapshot of the members, swapped whole when
/// the membership changes ([`Nodes::set_members`]); readers clone the
/// snapshot's `Arc` and never hold the lock while they work, and a node
/// that leaves lives on in the requests that hold it.
#[derive(Debug, Clone)]
pub struct Nodes {
    members: Arc<RwLock<Arc<Vec<Arc<Node>>>>>,
    /// The secret every call to a node proves.
    secret: MeshSecret,
    /// Mutual TLS on every node channel, when the mesh has certificates.
    tls: Option<Arc<MeshTls>>,
    /// Wakes the poller when members join, so a new node is polled (and
    /// chosen) without waiting for the next round.
    joined: Arc<Notify>,
    /// Where the membership comes from, and whether it is current.
    discovery: Arc<watch::Sender<Discovery>>,
    /// Registrations the membership source refused (bad entries), in all.
    refused: Arc<AtomicU64>,
    /// The prefix cache's keyed hashes under the same mesh secret the
    /// nodes hold, so the namespaces derived here are the nodes'.
    cache_keys: Arc<kvmesh_prefix::CacheKeys>,
}

/// The members at one moment; iterates as the slice it derefs to.
#[derive(Debug, Clone)]
pub struct Members(Arc<Vec<Arc<Node>>>);

impl std::ops::Deref for Members {
    type Target = [Arc<Node>];

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl IntoIterator for Members {
    type Item = Arc<Node>;
    type IntoIter = std::vec::IntoIter<Arc<Node>>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.as_ref().clone().into_iter()
    }
}

fn node(
    name: &str,
    role: Role,
    url: &str,
    secret: &MeshSecret,
    tls: Option<&Arc<MeshTls>>,
) -> Result<Node, String> {
    let channel = kvmesh_proto::peer::channel(url, tls, CONNECT_TIMEOUT)
        .map_err(|e| format!("node {name}: {e}"))?;
    Ok(Node {
        name: name.to_owned(),
        role,
        url: url.to_owned(),
        peer: peer_channel(channel, secret.clone(), name),
        state: Mutex::default(),
        in_flight: AtomicUsize::new(0),
        dispatched: AtomicU64::new(0),
        reports: AtomicU64::new(0),
    })
}

impl Nodes {
    /// Nodes from `(name, role, url)`, called as a peer of the mesh whose
    /// secret is `secret`; channels connect lazily. The membership is
    /// [`Discovery::Static`] until [`Nodes::set_discovery`] says otherwise.
    pub fn new(specs: &[(String, Role, String)], secret: MeshSecret) -> Result<Self, String> {
        Self::with_tls(specs, secret, None)
    }

    /// [`Nodes::new`], every channel inside mutual TLS with `tls` when
    /// given (each node's certificate must name the host its URL does),
    /// members that join later too.
    pub fn with_tls(
        specs: &[(String, Role, String)],
        secret: MeshSecret,
        tls: Option<Arc<MeshTls>>,
    ) -> Result<Self, String> {
        let all = specs
            .iter()
            .map(|(name, role, url)| node(name, *role, url, &secret, tls.as_ref()).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            members: Arc::new(RwLock::new(Arc::new(all))),
            cache_keys: Arc::new(kvmesh_prefix::CacheKeys::new(&secret)),
            secret,
            tls,
            joined: Arc::default(),
            discovery: Arc::new(watch::channel(Discovery::Static).0),
            refused: Arc::default(),
        })
    }

    /// Replaces the members by `specs` (`(name, role, url)`): a node of the
    /// same name, role and address keeps its state (load report, health,
    /// cache index, counts); others are new (polled at once) or gone. A
    /// spec whose address is not a URL is left out, with a warning.
    pub fn set_members(&self, specs: &[(String, Role, String)]) {
        let old = self.all();
        let mut next = Vec::with_capacity(specs.len());
        let mut joined = false;
        for (name, role, url) in specs {
            if let Some(n) = old
                .iter()
                .find(|n| n.name == *name && n.role == *role && n.url == *url)
            {
                next.push(Arc::clone(n));
                continue;
            }
            match node(name, *role, url, &self.secret, self.tls.as_ref()) {
                Ok(n) => {
                    tracing::info!(node = %name, role = role.as_str(), url = %url, "node joined the membership");
                    next.push(Arc::new(n));
                    joined = true;
                }
                Err(e) => tracing::warn!(error = %e, "membership entry left out"),
            }
        }
        for n in old.iter() {
            if !next.iter().any(|m| Arc::ptr_eq(m, n)) {
                tracing::info!(node = %n.name, role = n.role.as_str(), "node left the membership");
            }
        }
        *self.members.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(next);
        if joined {
            self.joined.notify_one();
        }
    }

    /// Says where the membership comes from and whether it is current.
    pub fn set_discovery(&self, d: Discovery) {
        self.discovery.send_if_modified(|cur| {
            let changed = *cur != d;
            *cur = d;
            changed
        });
    }

    /// Where the membership comes from and whether it is current.
    pub fn discovery(&self) -> Discovery {
        *self.discovery.borrow()
    }

    /// A receiver that hears every change of [`Nodes::discovery`].
    pub fn discovery_changes(&self) -> watch::Receiver<Discovery> {
        self.discovery.subscribe()
    }

    /// Records the membership source's count of refused registrations.
    pub fn set_refused(&self, n: u64) {
        self.refused.store(n, Ordering::Relaxed);
    }

    /// Registrations the membership source refused, in all.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The prefix cache's keyed hashes (namespaces, page keys).
    pub fn cache_keys(&self) -> &kvmesh_prefix::CacheKeys {
        &self.cache_keys
    }

    /// The members now.
    pub fn all(&self) -> Members {
        Members(Arc::clone(
            &self.members.read().unwrap_or_else(PoisonError::into_inner),
        ))
    }

    /// Polls every node once now.
    pub async fn poll_all(&self) {
        let polls = self
            .all()
            .into_iter()
            .map(|n| tokio::spawn(async move { n.poll().await }));
        for p in polls.collect::<Vec<_>>() {
            let _ = p.await;
        }
    }

    /// Starts the poller.
    pub fn spawn_poller(&self) -> tokio::task::JoinHandle<()> {
        let nodes = self.clone();
        tokio::spawn(async move {
            loop {
                nodes.poll_all().await;
                tokio::select! {
                    () = tokio::time::sleep(POLL) => {}
                    () = nodes.joined.notified() => {}
                }
            }
        })
    }

    /// The healthy node of `role` (fitting `tokens` when given) that costs
    /// `prefix` least: the prompt tokens it has not cached, plus
    /// [`LOAD_TOKENS`] per request in flight there (this router's count,
    /// or the node's queue if longer). Ties go to the most free pages, then
    /// to the node sent fewest requests. Without a prefix (the cache off)
    /// the cost is the load alone.
    pub fn pick(
        &self,
        role: Role,
        tokens: Option<usize>,
        prefix: Option<&Prefix<'_>>,
    ) -> Result<(Arc<Node>, LoadReport), Rejection> {
        self.pick_near(role, tokens, prefix, None, None)
    }

    /// The CPU numerics of the healthy nodes of `role` (fitting `tokens`
    /// when given), each once: what a node of the other role must compute
    /// with to be paired with one of them (see [`Nodes::pick_near`]).
    pub fn numerics(&self, role: Role, tokens: Option<usize>) -> Vec<String> {
        let mut seen: Vec<String> = self
            .all()
            .iter()
            .filter(|n| n.role == role)
            .filter_map(|n| n.report())
            .filter(|r| tokens.is_none_or(|t| r.max_seq_tokens as usize >= t))
            .map(|r| r.cpu_numerics)
            .collect();
        seen.sort();
        seen.dedup();
        seen
    }

    /// [`Nodes::pick`], but the node named `holder` when it is healthy and
    /// fits: it took this prompt's first sample a moment ago (OpenAI's
    /// `n`), so its cache holds the prompt's pages before its load report
    /// can say so, and the samples fork there from one transfer, as one
    /// engine runs all `n` samples in vLLM. Otherwise the usual choice.
    ///
    /// With `numerics`, only nodes whose CPU numerics (the load report's
    /// `cpu_numerics`) are among them: a prefill node and a decode node
    /// pair only when they compute the same bits, so that the transferred
    /// KV is the KV decode would have computed. Healthy nodes left out
    /// only for that give [`Rejection::MixedCpuKernels`], naming them.
    pub fn pick_near(
        &self,
        role: Role,
        tokens: Option<usize>,
        prefix: Option<&Prefix<'_>>,
        holder: Option<&str>,
        numerics: Option<&[String]>,
    ) -> Result<(Arc<Node>, LoadReport), Rejection> {
        let size_fits = |r: &LoadReport| tokens.is_none_or(|t| r.max_seq_tokens as usize >= t);
        let computes_alike =
            |r: &LoadReport| numerics.is_none_or(|ns| ns.contains(&r.cpu_numerics));
        let fits = |r: &LoadReport| size_fits(r) && computes_alike(r);
        let all = self.all();
        if let Some(held) = holder.and_then(|name| {
            all.iter()
                .filter(|n| n.role == role && n.name == name)
                .find_map(|n| n.report().filter(fits).map(|r| (Arc::clone(n), r)))
        }) {
            return Ok(held);
        }
        let mut ids = prefix.map(|prefix| RoutingIds {
            keys: &self.cache_keys,
            prefix,
            memo: Vec::new(),
        });
        all.iter()
            .filter(|n| n.role == role)
            .filter_map(|n| n.report().map(|r| (Arc::clone(n), r)))
            .filter(|(_, r)| fits(r))
            .min_by_key(|(n, r)| {
                let uncached = ids.as_mut().map_or(0, |ids| {
                    ids.prefix.prompt.len() - n.matched_pages(ids) * r.page_size as usize
                });
                let load = n
                    .in_flight
                    .load(Ordering::Relaxed)
                    .max(r.queue_depth as usize);
                (
                    uncached + LOAD_TOKENS * load,
                    std::cmp::Reverse(r.kv_pages_free),
                    n.dispatched.load(Ordering::Relaxed),
                )
            })
            .ok_or_else(|| {
                let unlike: Vec<String> = all
                    .iter()
                    .filter(|n| n.role == role)
                    .filter_map(|n| n.report().map(|r| (n, r)))
                    .filter(|(_, r)| size_fits(r) && !computes_alike(r))
                    .map(|(n, r)| format!("{} runs {} ({})", n.name, r.cpu_kernels, r.cpu_numerics))
                    .collect();
                match numerics {
                    Some(wanted) if !unlike.is_empty() => {
                        let (wanted, found) = (wanted.join(" or "), unlike.join(", "));
                        tracing::warn!(
                            role = role.as_str(),
                            wanted = %wanted,
                            found = %found,
                            "refusing to pair nodes whose CPU kernels compute different bits: \
                             give every node of the mesh the same cpu_kernels and activations \
                             (avx2 and avx512 compute alike)"
                        );
                        Rejection::MixedCpuKernels {
                            role: role.as_str(),
                            wanted,
                            found,
                        }
                    }
                    _ => Rejection::NoHealthyNode {
                        role: role.as_str(),
                    },
                }
            })
    }

    /// The longest sequence every healthy node of both roles can take: the
    /// limit admission enforces (a node started with `--allow-small-pool`
    /// advertises its real capacity). `None` while a role has no healthy
    /// node.
    pub fn capacity(&self) -> Option<usize> {
        let all = self.all();
        let cap = |role| {
            all.iter()
                .filter(|n| n.role == role)
                .filter_map(|n| n.report())
                .map(|r| r.max_seq_tokens as usize)
                .max()
        };
        Some(cap(Role::Prefill)?.min(cap(Role::Decode)?))
    }
}
