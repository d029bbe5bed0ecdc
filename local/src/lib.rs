//! The whole mesh in one process: a decode node, a prefill node and the
//! router, each a real gRPC service on its own loopback port, KV over the
//! chosen transport, sharing a secret minted for this run and never
//! written anywhere. `kvmesh serve` runs it; the in-process test mesh
//! (`kvmesh_integration::inproc`) is the same [`LocalMesh`] on a runtime
//! of its own. One builder, so the two cannot drift apart.
//!
//! [`LocalMesh::start`] returns once both nodes answered the router's
//! first load poll (bounded: [`NODES_UP_WITHIN`]): from then on the
//! gateway serves. [`LocalMesh::wait`] ends with the drain in the order
//! the mesh needs: the router first (when its `stop` future resolves; it
//! lets streams in flight finish), then both nodes, which by then have
//! nothing in flight.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvmesh_decode::{DecodeConfig, DecodeNode, Drained};
use kvmesh_kvxfer::transport::ListenSettings;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::LoadedModel;
use kvmesh_prefill::{PrefillConfig, PrefillNode};
use kvmesh_router::nodes::{Nodes, Role};
use kvmesh_router::{Listeners, Router, RouterConfig};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long [`LocalMesh::start`] waits for both nodes' first load report.
pub const NODES_UP_WITHIN: Duration = Duration::from_secs(30);

/// The nodes' names in a one-process mesh.
pub const DECODE_NAME: &str = "decode-0";
/// See [`DECODE_NAME`].
pub const PREFILL_NAME: &str = "prefill-0";

/// The model, loaded once per node (each node owns its weights and pool).
#[derive(Debug)]
pub struct Models {
    /// The name the API serves it under (`model` in requests).
    pub id: String,
    /// The decode node's copy; the router reads its metadata (tokenizer,
    /// context length, stop ids) from it instead of the file.
    pub decode: LoadedModel,
    /// The prefill node's copy.
    pub prefill: LoadedModel,
}

/// What `kvmesh serve`'s flags set.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Both nodes' pool, page, context and precision settings.
    pub engine: EngineConfig,
    /// The decode node's KV listener (its transport).
    pub transport: ListenSettings,
    /// Let a node start with a pool smaller than one full context.
    pub allow_small_pool: bool,
    /// How long a grant may wait for its transfer.
    pub lease: Duration,
    /// How long an abort may wait for the writer's confirmation.
    pub abort_timeout: Duration,
    /// How long each role's drain lets work in flight finish.
    pub drain_timeout: Duration,
    /// The tenant-isolated prefix cache, on both nodes and the router.
    pub prefix_cache: bool,
    /// The router's settings. The model's fields (`model_id`,
    /// `model_description`, `max_model_len` unless the engine caps it),
    /// `drain_timeout` and `prefix_cache` are set from the above.
    pub router: RouterConfig,
}

/// What the nodes' drains found.
#[derive(Debug)]
pub struct MeshDrained {
    /// The prefill node's.
    pub prefill: Drained,
    /// The decode node's.
    pub decode: Drained,
}

type NodeRun = JoinHandle<Result<Drained>>;

/// A running one-process mesh.
#[derive(Debug)]
pub struct LocalMesh {
    http: SocketAddr,
    grpc: SocketAddr,
    router: Router,
    decode: DecodeNode,
    prefill: PrefillNode,
    stop_nodes: watch::Sender<bool>,
    router_run: JoinHandle<std::io::Result<()>>,
    prefill_run: NodeRun,
    decode_run: NodeRun,
    /// The router's load poller: the binary's job, so the mesh's.
    poller: JoinHandle<()>,
}

async fn loopback() -> Result<TcpListener> {
    TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding 127.0.0.1:0 for a node")
}

impl LocalMesh {
    /// Starts both nodes and the router on the current tokio runtime, the
    /// gateway and the public gRPC API on `listeners`; the router drains
    /// once `stop` resolves. Returns once both nodes answered a load poll.
    pub async fn start<F>(
        models: Models,
        s: Settings,
        listeners: Listeners,
        stop: F,
    ) -> Result<Self>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let info = models.decode.info();
        let secret = MeshSecret::generate().context("minting the mesh secret")?;
        let decode = DecodeNode::start(
            DecodeConfig {
                name: DECODE_NAME.into(),
                engine: s.engine.clone(),
                allow_small_pool: s.allow_small_pool,
                transport: s.transport,
                lease: s.lease,
                abort_timeout: s.abort_timeout,
                kv_advertise: None,
                mesh_secret: secret.clone(),
                tls: None,
                drain_timeout: s.drain_timeout,
                prefix_cache: s.prefix_cache,
            },
            models.decode,
        )
        .await?;
        let prefill = PrefillNode::start(
            PrefillConfig {
                name: PREFILL_NAME.into(),
                engine: s.engine.clone(),
                allow_small_pool: s.allow_small_pool,
                mesh_secret: secret.clone(),
                tls: None,
                drain_timeout: s.drain_timeout,
                prefix_cache: s.prefix_cache,
            },
            models.prefill,
        )?;
        prefill
            .connect(decode.kv_endpoint())
            .await
            .context("connecting prefill to the decode node's KV transport")?;
        let (dl, pl) = (loopback().await?, loopback().await?);
        let (daddr, paddr) = (dl.local_addr()?, pl.local_addr()?);
        let stop_nodes = watch::channel(false).0;
        let when_stopped = || {
            let mut rx = stop_nodes.subscribe();
            async move {
                let _ = rx.wait_for(|set| *set).await;
            }
        };
        let decode_run: NodeRun = tokio::spawn({
            let (node, stop) = (decode.clone(), when_stopped());
            async move { Ok(kvmesh_decode::run(node, dl, stop).await?) }
        });
        let prefill_run: NodeRun = tokio::spawn({
            let (node, stop) = (prefill.clone(), when_stopped());
            async move { Ok(kvmesh_prefill::run(node, pl, stop).await?) }
        });
        let nodes = Nodes::new(
            &[
                (
                    PREFILL_NAME.into(),
                    Role::Prefill,
                    format!("http://{paddr}"),
                ),
                (DECODE_NAME.into(), Role::Decode, format!("http://{daddr}")),
            ],
            secret,
        )
        .map_err(anyhow::Error::msg)?;
        // Readiness: both nodes serve already; the router routes to a node
        // once a load poll found it up.
        let deadline = Instant::now() + NODES_UP_WITHIN;
        loop {
            nodes.poll_all().await;
            if nodes.all().iter().all(|n| n.report().is_some()) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the nodes never answered a load poll within {} s",
                NODES_UP_WITHIN.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let poller = nodes.spawn_poller();
        let (description, stop_ids) = (info.description(), info.stop_token_ids());
        let router = Router::new(
            RouterConfig {
                model_id: models.id,
                model_description: description,
                max_model_len: s.engine.max_model_len.unwrap_or(info.context_length),
                drain_timeout: s.drain_timeout,
                prefix_cache: s.prefix_cache,
                ..s.router
            },
            info.tokenizer,
            stop_ids,
            nodes,
        );
        let (http, grpc) = listeners.addrs()?;
        let router_run = tokio::spawn(kvmesh_router::run(router.clone(), listeners, stop));
        Ok(Self {
            http,
            grpc,
            router,
            decode,
            prefill,
            stop_nodes,
            router_run,
            prefill_run,
            decode_run,
            poller,
        })
    }

    /// The gateway's address.
    pub fn http(&self) -> SocketAddr {
        self.http
    }

    /// The public gRPC API's address.
    pub fn grpc(&self) -> SocketAddr {
        self.grpc
    }

    /// The router (its config and parsers, for what `serve` prints).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The decode node (its reservation table and pool, for tests).
    pub fn decode(&self) -> &DecodeNode {
        &self.decode
    }

    /// The prefill node.
    pub fn prefill(&self) -> &PrefillNode {
        &self.prefill
    }

    /// Waits for the router to end (its `stop` resolved and its drain
    /// finished), then drains both nodes; returns what their drains found.
    pub async fn wait(self) -> Result<MeshDrained> {
        let served = self.router_run.await.context("the router's task")?;
        self.poller.abort();
        self.stop_nodes.send_replace(true);
        let prefill = self
            .prefill_run
            .await
            .context("the prefill node's task")??;
        let decode = self.decode_run.await.context("the decode node's task")??;
        served.context("the gateway")?;
        Ok(MeshDrained { prefill, decode })
    }
}
