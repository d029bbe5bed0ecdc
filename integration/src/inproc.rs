//! The mesh in this process: a decode node, a prefill node and the router,
//! each serving on its own listener bound to 127.0.0.1:0, on one tokio
//! runtime the [`InProcessMesh`] owns, wired as `kvmesh serve` wires them
//! (`cli/src/serve.rs`). No stdout to parse, no sleep to wait for it: the
//! ports are known once bound, and `start` returns once the router's first
//! load poll found both nodes up.
//!
//! Tests that need a process of their own (a kill, SIGTERM, a planted bug,
//! which is global to a process, deploy files) use [`crate::mesh::Mesh`] or
//! [`crate::roles`] instead.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvmesh_decode::{DecodeConfig, DecodeNode, Drained};
use kvmesh_kvxfer::transport::{ListenSettings, TransportKind};
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::Precision;
use kvmesh_prefill::{PrefillConfig, PrefillNode};
use kvmesh_router::nodes::{Nodes, Role};
use kvmesh_router::{Listeners, Router, RouterConfig};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::http;

/// What `kvmesh serve`'s flags would set.
#[derive(Clone, Debug)]
pub struct Options {
    /// `--transport`.
    pub transport: TransportKind,
    /// Pool, page, context and precision settings of both nodes; the
    /// default is `serve`'s (quantized weights where the model has them,
    /// KV dtype auto, pages of 16, one full context).
    pub engine: EngineConfig,
    /// `--allow-small-pool`.
    pub allow_small_pool: bool,
    /// `--api-key KEY=TENANT`, as pairs.
    pub api_keys: Vec<(String, String)>,
    /// `--fault-injection`: the router honours `x-kvmesh-fault` (a testing
    /// build only, which the integration tests are).
    pub fault_injection: bool,
    /// `--drain-timeout`.
    pub drain_timeout: Duration,
    /// `--prefix-cache on|off`.
    pub prefix_cache: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            transport: TransportKind::Tcp,
            engine: EngineConfig {
                precision: Precision::Quantized,
                ..EngineConfig::default()
            },
            allow_small_pool: false,
            api_keys: Vec::new(),
            fault_injection: false,
            drain_timeout: Duration::from_secs(30),
            prefix_cache: true,
        }
    }
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

/// A running mesh in this process; drained on [`shutdown`](Self::shutdown)
/// or drop.
#[derive(Debug)]
pub struct InProcessMesh {
    /// The gateway's `HOST:PORT`.
    pub http: String,
    /// The public gRPC API's `HOST:PORT`.
    pub grpc: String,
    decode: DecodeNode,
    prefill: PrefillNode,
    stop_router: watch::Sender<bool>,
    stop_nodes: watch::Sender<bool>,
    /// `None` once drained.
    runs: Option<Runs>,
    // Last: the tasks above end before it goes.
    rt: Runtime,
}

/// The roles' run futures, awaited by the drain.
#[derive(Debug)]
struct Runs {
    router: JoinHandle<std::io::Result<()>>,
    prefill: NodeRun,
    decode: NodeRun,
    /// The nodes' load poller (the binary's job, so here the mesh's).
    poller: JoinHandle<()>,
}

/// What `start_on` builds on the runtime.
type Started = (
    String,
    String,
    DecodeNode,
    PrefillNode,
    [watch::Sender<bool>; 2],
    Runs,
);

/// Resolves once `flag` is set.
fn when_set(flag: &watch::Sender<bool>) -> impl Future<Output = ()> + Send + 'static {
    let mut rx = flag.subscribe();
    async move {
        let _ = rx.wait_for(|set| *set).await;
    }
}

async fn listen() -> Result<TcpListener> {
    TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding 127.0.0.1:0")
}

/// A Unix socket path no other mesh of this process uses.
fn shm_socket() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    std::env::temp_dir().join(format!(
        "kvmesh-{}-inproc-{}-decode.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The options' keys (scope `inference`), and [`http::SCRAPE_KEY`]
/// (scope `metrics`) when there are any.
fn api_keys(keys: &[(String, String)]) -> Result<kvmesh_router::auth::ApiKeys> {
    use kvmesh_router::auth::Scope;
    let mut all: Vec<_> = keys
        .iter()
        .map(|(k, t)| (k.clone(), t.clone(), vec![Scope::Inference]))
        .collect();
    if !all.is_empty() {
        all.push((
            http::SCRAPE_KEY.into(),
            "scraper".into(),
            vec![Scope::Metrics],
        ));
    }
    kvmesh_router::auth::ApiKeys::with_scopes(all).map_err(anyhow::Error::msg)
}

impl InProcessMesh {
    /// Loads `model` for both nodes and starts the mesh. Call it outside
    /// any tokio runtime (the mesh brings its own; see
    /// [`block_on`](Self::block_on)).
    pub fn start(model: &Path, opts: Options) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the mesh's runtime")?;
        let (http, grpc, decode, prefill, [stop_router, stop_nodes], runs) =
            rt.block_on(Self::start_on(model, opts))?;
        Ok(Self {
            http,
            grpc,
            decode,
            prefill,
            stop_router,
            stop_nodes,
            runs: Some(runs),
            rt,
        })
    }

    async fn start_on(model: &Path, o: Options) -> Result<Started> {
        let load = || {
            kvmesh_model::load_with(model, o.engine.precision)
                .with_context(|| format!("loading {}", model.display()))
        };
        let decode_model = load()?;
        let info = decode_model.info();
        let model_description = info.description();
        let max_model_len = o.engine.max_model_len.unwrap_or(info.context_length);
        let stop_ids = info.stop_token_ids();
        let transport = ListenSettings::loopback(o.transport, PathBuf::from("/dev/shm"), || {
            shm_socket()
                .into_os_string()
                .into_string()
                .map_err(|p| anyhow::anyhow!("the KV socket path {p:?} is not UTF-8"))
        })?;
        let secret = MeshSecret::generate().context("minting the mesh secret")?;
        let decode = DecodeNode::start(
            DecodeConfig {
                name: "decode-0".into(),
                engine: o.engine.clone(),
                allow_small_pool: o.allow_small_pool,
                transport,
                lease: Duration::from_secs(60),
                abort_timeout: Duration::from_secs(10),
                kv_advertise: None,
                mesh_secret: secret.clone(),
                tls: None,
                drain_timeout: o.drain_timeout,
                prefix_cache: o.prefix_cache,
            },
            decode_model,
        )
        .await?;
        let prefill = PrefillNode::start(
            PrefillConfig {
                name: "prefill-0".into(),
                engine: o.engine.clone(),
                allow_small_pool: o.allow_small_pool,
                mesh_secret: secret.clone(),
                tls: None,
                drain_timeout: o.drain_timeout,
                prefix_cache: o.prefix_cache,
            },
            load()?,
        )?;
        prefill
            .connect(decode.kv_endpoint())
            .await
            .context("connecting prefill to the decode node's KV transport")?;
        let (dl, pl) = (listen().await?, listen().await?);
        let (daddr, paddr) = (dl.local_addr()?, pl.local_addr()?);
        let stop_nodes = watch::channel(false).0;
        let decode_run: NodeRun = tokio::spawn({
            let (node, stop) = (decode.clone(), when_set(&stop_nodes));
            async move { Ok(kvmesh_decode::run(node, dl, stop).await?) }
        });
        let prefill_run: NodeRun = tokio::spawn({
            let (node, stop) = (prefill.clone(), when_set(&stop_nodes));
            async move { Ok(kvmesh_prefill::run(node, pl, stop).await?) }
        });
        let nodes = Nodes::new(
            &[
                ("prefill-0".into(), Role::Prefill, format!("http://{paddr}")),
                ("decode-0".into(), Role::Decode, format!("http://{daddr}")),
            ],
            secret,
        )
        .map_err(anyhow::Error::msg)?;
        let view = nodes.clone();
        let router = Router::new(
            RouterConfig {
                model_id: model
                    .file_stem()
                    .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned()),
                model_description: model_description.clone(),
                max_model_len,
                api_keys: api_keys(&o.api_keys)?,
                fault_injection: o.fault_injection,
                drain_timeout: o.drain_timeout,
                prefix_cache: o.prefix_cache,
                ..RouterConfig::default()
            },
            info.tokenizer,
            stop_ids,
            nodes,
        );
        // Both nodes serve already; one load poll that finds them up is
        // what the router's health needs. Bounded, in case a node failed.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            view.poll_all().await;
            if view.all().iter().all(|n| n.report().is_some()) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the nodes never answered a load poll"
            );
            tokio::task::yield_now().await;
        }
        let listeners = Listeners {
            http: listen().await?,
            grpc: listen().await?,
        };
        let (http, grpc) = listeners.addrs()?;
        let stop_router = watch::channel(false).0;
        let router_run = tokio::spawn(kvmesh_router::run(
            router,
            listeners,
            when_set(&stop_router),
        ));
        let runs = Runs {
            router: router_run,
            prefill: prefill_run,
            decode: decode_run,
            poller: view.spawn_poller(),
        };
        Ok((
            http.to_string(),
            grpc.to_string(),
            decode,
            prefill,
            [stop_router, stop_nodes],
            runs,
        ))
    }

    /// Runs `f` on the mesh's runtime (a test's async client code).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// The decode node's reservation table, counted now.
    pub fn decode_table(&self) -> kvmesh_kvxfer::handshake::TableStats {
        self.decode.table().stats()
    }

    /// The decode node's pool, counted now.
    pub fn decode_pool(&self) -> kvmesh_kvpool::PoolStats {
        self.decode.table().pool().stats()
    }

    /// The prefill node's pool, counted now.
    pub fn prefill_pool(&self) -> kvmesh_kvpool::PoolStats {
        self.prefill.pool().stats()
    }

    /// The value of the gateway's sample `selector` names (see
    /// [`kvmesh_client::Metrics::get`]).
    pub fn metric(&self, selector: &str) -> Option<f64> {
        http::metric(&self.http, selector)
    }

    /// The gateway's metrics text (read with [`http::SCRAPE_KEY`]).
    pub fn metrics(&self) -> String {
        http::metrics(&self.http).text().to_owned()
    }

    /// Waits (bounded: 10 s) until `done` holds of the nodes' state, read
    /// directly (no load report to wait for).
    pub fn wait_until(&self, what: &str, mut done: impl FnMut(&Self) -> bool) {
        let start = Instant::now();
        while !done(self) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "never happened: {what}; decode {:?}, {:?}; prefill {:?}",
                self.decode_table(),
                self.decode_pool(),
                self.prefill_pool()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (bounded) until `n` reservations completed at the decode node.
    pub fn wait_completed(&self, n: u64) {
        self.wait_until(&format!("{n} reservations completed"), |m| {
            m.decode_table().ended("completed") == n
        });
    }

    /// Waits (bounded) until every page of both nodes is free again (or
    /// cached with no lease: the prefix cache keeps finished sequences'
    /// pages) and the decode node's table is empty.
    pub fn assert_pages_come_back(&self) {
        self.wait_until(
            "every page free or cached unleased, no reservation open",
            |m| {
                let (d, p) = (m.decode_pool(), m.prefill_pool());
                d.available_pages() == d.capacity_pages
                    && p.available_pages() == p.capacity_pages
                    && m.decode_table().open == 0
            },
        );
    }

    /// Drains the mesh as `kvmesh serve` does on SIGTERM: the router
    /// first, then the nodes; returns what their drains found.
    pub fn shutdown(mut self) -> Result<MeshDrained> {
        self.drain()
    }

    fn drain(&mut self) -> Result<MeshDrained> {
        let Some(runs) = self.runs.take() else {
            anyhow::bail!("drained already");
        };
        let (stop_router, stop_nodes) = (&self.stop_router, &self.stop_nodes);
        self.rt.block_on(async {
            stop_router.send_replace(true);
            let served = runs.router.await.context("the router's task")?;
            runs.poller.abort();
            stop_nodes.send_replace(true);
            let prefill = runs.prefill.await.context("the prefill node's task")??;
            let decode = runs.decode.await.context("the decode node's task")??;
            served.context("the gateway")?;
            anyhow::Ok(MeshDrained { prefill, decode })
        })
    }
}

impl Drop for InProcessMesh {
    fn drop(&mut self) {
        if self.runs.is_some() {
            if let Err(e) = self.drain() {
                eprintln!("in-process mesh: {e:#}");
            }
        }
    }
}
