//! The mesh in this process: a decode node, a prefill node and the router,
//! each serving on its own listener bound to 127.0.0.1:0, on one tokio
//! runtime the [`InProcessMesh`] owns: the [`LocalMesh`] `kvmesh serve`
//! runs. No stdout to parse, no sleep to wait for it: the ports are known
//! once bound, and `start` returns once the router's first load poll found
//! both nodes up.
//!
//! Tests that need a process of their own (a kill, SIGTERM, a planted bug,
//! which is global to a process, deploy files) use [`crate::mesh::Mesh`] or
//! [`crate::roles`] instead.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvmesh_kvxfer::transport::{ListenSettings, TransportKind};
use kvmesh_local::{LocalMesh, Models, Settings};
use kvmesh_model::engine::EngineConfig;
use kvmesh_model::Precision;
use kvmesh_router::{Listeners, RouterConfig};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::watch;

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
    /// `--max-running`: the router's dispatch slots.
    pub max_running: usize,
    /// `--admission fair|fifo`.
    pub admission: kvmesh_router::admission::Policy,
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
            max_running: RouterConfig::default().max_running,
            admission: kvmesh_router::admission::Policy::Fair,
        }
    }
}

pub use kvmesh_local::MeshDrained;

/// A running mesh in this process; drained on [`shutdown`](Self::shutdown)
/// or drop.
#[derive(Debug)]
pub struct InProcessMesh {
    /// The gateway's `HOST:PORT`.
    pub http: String,
    /// The public gRPC API's `HOST:PORT`.
    pub grpc: String,
    /// Set to start the router's drain.
    stop_router: watch::Sender<bool>,
    /// `None` once drained.
    mesh: Option<LocalMesh>,
    // Last: the mesh's tasks end before it goes.
    rt: Runtime,
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

async fn listen() -> Result<TcpListener> {
    TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding 127.0.0.1:0")
}

impl InProcessMesh {
    /// Loads `model` for both nodes and starts the mesh (the one
    /// [`LocalMesh`] `kvmesh serve` runs). Call it outside any tokio
    /// runtime (the mesh brings its own; see [`block_on`](Self::block_on)).
    pub fn start(model: &Path, o: Options) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the mesh's runtime")?;
        let load = || {
            kvmesh_model::load_with(model, o.engine.precision)
                .with_context(|| format!("loading {}", model.display()))
        };
        let models = Models {
            id: model
                .file_stem()
                .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned()),
            decode: load()?,
            prefill: load()?,
        };
        let transport = ListenSettings::loopback(o.transport, PathBuf::from("/dev/shm"), || {
            shm_socket()
                .into_os_string()
                .into_string()
                .map_err(|p| anyhow::anyhow!("the KV socket path {p:?} is not UTF-8"))
        })?;
        let settings = Settings {
            engine: o.engine.clone(),
            transport,
            allow_small_pool: o.allow_small_pool,
            lease: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(10),
            drain_timeout: o.drain_timeout,
            prefix_cache: o.prefix_cache,
            router: RouterConfig {
                api_keys: api_keys(&o.api_keys)?,
                max_running: o.max_running,
                admission: o.admission,
                fault_injection: o.fault_injection,
                ..RouterConfig::default()
            },
        };
        let stop_router = watch::channel(false).0;
        let stop = {
            let mut rx = stop_router.subscribe();
            async move {
                let _ = rx.wait_for(|set| *set).await;
            }
        };
        let mesh = rt.block_on(async {
            let listeners = Listeners {
                http: listen().await?,
                grpc: listen().await?,
            };
            LocalMesh::start(models, settings, listeners, stop).await
        })?;
        Ok(Self {
            http: mesh.http().to_string(),
            grpc: mesh.grpc().to_string(),
            stop_router,
            mesh: Some(mesh),
            rt,
        })
    }

    fn live(&self) -> &LocalMesh {
        self.mesh
            .as_ref()
            .expect("the mesh is running until shutdown")
    }

    /// Runs `f` on the mesh's runtime (a test's async client code).
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// The decode node's reservation table, counted now.
    pub fn decode_table(&self) -> kvmesh_kvxfer::handshake::TableStats {
        self.live().decode().table().stats()
    }

    /// The decode node's pool, counted now.
    pub fn decode_pool(&self) -> kvmesh_kvpool::PoolStats {
        self.live().decode().table().pool().stats()
    }

    /// The prefill node's pool, counted now.
    pub fn prefill_pool(&self) -> kvmesh_kvpool::PoolStats {
        self.live().prefill().pool().stats()
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
        let Some(mesh) = self.mesh.take() else {
            anyhow::bail!("drained already");
        };
        self.stop_router.send_replace(true);
        self.rt.block_on(mesh.wait())
    }
}

impl Drop for InProcessMesh {
    fn drop(&mut self) {
        if self.mesh.is_some() {
            if let Err(e) = self.drain() {
                eprintln!("in-process mesh: {e:#}");
            }
        }
    }
}
