//! The router's view of the mesh: every prefill and decode node, its gRPC
//! client (every call proves the mesh secret: `kvmesh_meshauth::grpc`),
//! its last load report and whether it is healthy. A poller asks
//! each node for its load every [`POLL`]; a node that does not answer
//! within [`LOAD_TIMEOUT`] is taken out until it answers again.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvmesh_meshauth::grpc::PeerChannel;
use kvmesh_meshauth::MeshSecret;
use kvmesh_proto::internal::v1::decode_client::DecodeClient;
use kvmesh_proto::internal::v1::prefill_client::PrefillClient;
use kvmesh_proto::internal::v1::{LoadReport, LoadRequest};
use kvmesh_proto::peer::{decode_client, prefill_client};
use tonic::transport::{Channel, Endpoint};

use crate::error::Rejection;

/// How often load is polled.
pub const POLL: Duration = Duration::from_millis(200);
/// How long a load report may take before the node counts as down.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(2);
/// Connect timeout of node channels.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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
    channel: Channel,
    secret: MeshSecret,
    state: Mutex<NodeState>,
}

#[derive(Debug, Default)]
struct NodeState {
    report: Option<LoadReport>,
    healthy: bool,
}

impl Node {
    /// The decode client; its calls prove the mesh secret.
    pub fn decode(&self) -> DecodeClient<PeerChannel> {
        decode_client(self.channel.clone(), self.secret.clone())
    }

    /// The prefill client; its calls prove the mesh secret.
    pub fn prefill(&self) -> PrefillClient<PeerChannel> {
        prefill_client(self.channel.clone(), self.secret.clone())
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

    /// Takes the node out until its next good load report (a request to it
    /// failed as if it were down).
    pub fn mark_down(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .healthy = false;
    }

    async fn poll(&self) {
        let req = LoadRequest {};
        let r = match self.role {
            Role::Decode => tokio::time::timeout(LOAD_TIMEOUT, self.decode().load(req)).await,
            Role::Prefill => tokio::time::timeout(LOAD_TIMEOUT, self.prefill().load(req)).await,
        };
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        match r {
            Ok(Ok(resp)) => {
                let report = resp.into_inner();
                if !s.healthy {
                    tracing::info!(node = %self.name, role = self.role.as_str(), "node healthy");
                }
                if report.draining && !s.report.as_ref().is_some_and(|r| r.draining) {
                    tracing::info!(node = %self.name, role = self.role.as_str(), "node draining");
                }
                s.report = Some(report);
                s.healthy = true;
            }
            _ => {
                if s.healthy {
                    tracing::warn!(node = %self.name, role = self.role.as_str(), "node down");
                }
                s.healthy = false;
            }
        }
    }
}

/// Every node of the mesh.
#[derive(Debug, Clone)]
pub struct Nodes {
    all: Arc<Vec<Arc<Node>>>,
    /// The prefix cache's keyed hashes under the same mesh secret the
    /// nodes hold, so the namespaces derived here are the nodes'.
    cache_keys: Arc<kvmesh_prefix::CacheKeys>,
}

impl Nodes {
    /// Nodes from `(name, role, url)`, called as a peer of the mesh whose
    /// secret is `secret`; channels connect lazily.
    pub fn new(specs: &[(String, Role, String)], secret: MeshSecret) -> Result<Self, String> {
        let mut all = Vec::new();
        for (name, role, url) in specs {
            let channel = Endpoint::from_shared(url.clone())
                .map_err(|e| format!("node {name}: bad address {url:?}: {e}"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .connect_lazy();
            all.push(Arc::new(Node {
                name: name.clone(),
                role: *role,
                url: url.clone(),
                channel,
                secret: secret.clone(),
                state: Mutex::default(),
            }));
        }
        Ok(Self {
            all: Arc::new(all),
            cache_keys: Arc::new(kvmesh_prefix::CacheKeys::new(&secret)),
        })
    }

    /// The prefix cache's keyed hashes (namespaces, page keys).
    pub fn cache_keys(&self) -> &kvmesh_prefix::CacheKeys {
        &self.cache_keys
    }

    /// All nodes.
    pub fn all(&self) -> &[Arc<Node>] {
        &self.all
    }

    /// Polls every node once now.
    pub async fn poll_all(&self) {
        let polls = self.all.iter().map(|n| {
            let n = Arc::clone(n);
            tokio::spawn(async move { n.poll().await })
        });
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
                tokio::time::sleep(POLL).await;
            }
        })
    }

    /// The healthy node of `role` with the most free pages, fewest queued
    /// requests breaking ties; among those fitting `tokens` when given.
    pub fn pick(
        &self,
        role: Role,
        tokens: Option<usize>,
    ) -> Result<(Arc<Node>, LoadReport), Rejection> {
        self.all
            .iter()
            .filter(|n| n.role == role)
            .filter_map(|n| n.report().map(|r| (Arc::clone(n), r)))
            .filter(|(_, r)| tokens.is_none_or(|t| r.max_seq_tokens as usize >= t))
            .max_by_key(|(_, r)| (r.kv_pages_free, std::cmp::Reverse(r.queue_depth)))
            .ok_or(Rejection::NoHealthyNode {
                role: role.as_str(),
            })
    }

    /// The longest sequence every healthy node of both roles can take: the
    /// limit admission enforces (a node started with `--allow-small-pool`
    /// advertises its real capacity). `None` while a role has no healthy
    /// node.
    pub fn capacity(&self) -> Option<usize> {
        let cap = |role| {
            self.all
                .iter()
                .filter(|n| n.role == role)
                .filter_map(|n| n.report())
                .map(|r| r.max_seq_tokens as usize)
                .max()
        };
        Some(cap(Role::Prefill)?.min(cap(Role::Decode)?))
    }
}
