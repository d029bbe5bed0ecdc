//! The decode node and its gRPC service.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvmesh_faults::{Action, FaultPlan, Point};
use kvmesh_kvpool::KvPool;
use kvmesh_kvwire::{AbortReason, ReservationId, WriterId};
use kvmesh_kvxfer::handshake::{
    Pending, ReservationTable, ReserveError, ReserveRequest, TableConfig,
};
use kvmesh_kvxfer::transport::server::KvServer;
use kvmesh_kvxfer::transport::shm::ShmLanding;
use kvmesh_kvxfer::transport::tcp::TcpLanding;
use kvmesh_kvxfer::transport::Landing;
use kvmesh_meshauth::grpc::Authenticated;
use kvmesh_meshauth::{CallVerifier, MeshSecret};
use kvmesh_model::engine::{check_pool_capacity, Engine, EngineConfig};
use kvmesh_model::sampling::{Sampler, SamplingParams};
use kvmesh_model::LoadedModel;
use kvmesh_proto::internal::v1::decode_server::{Decode, DecodeServer};
use kvmesh_proto::internal::v1::{
    AbortRequest, AbortResponse, LoadReport, LoadRequest, ReserveResponse, TokenEvent,
    TokensRequest,
};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::batcher::{self, Job};

/// How prefill writers reach this node's pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Frames over TCP, listening on this address (`HOST:PORT`).
    Tcp(String),
    /// The pool in a shared-memory mapping in `dir` (e.g. `/dev/shm`),
    /// control over a Unix socket at `socket`.
    Shm {
        /// Where the mapping file goes.
        dir: PathBuf,
        /// The Unix socket writers connect to.
        socket: PathBuf,
    },
}

/// A decode node's settings.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// The node's name (load reports, metrics).
    pub name: String,
    /// Pool, page and context settings.
    pub engine: EngineConfig,
    /// Start even if the pool cannot hold one max-context request.
    pub allow_small_pool: bool,
    /// The KV transport.
    pub transport: Transport,
    /// How long a grant may wait for its transfer.
    pub lease: Duration,
    /// How long an abort may wait for the writer's confirmation.
    pub abort_timeout: Duration,
    /// The KV endpoint grants name, when it differs from the listen address
    /// (a host name others resolve, behind a 0.0.0.0 bind).
    pub kv_advertise: Option<String>,
    /// The per-mesh secret: KV writers (Hello) and gRPC callers (every
    /// call) must prove it.
    pub mesh_secret: MeshSecret,
}

/// Why a decode node could not start.
#[derive(Debug, Error)]
pub enum NodeError {
    /// The startup check or another setting.
    #[error("{0}")]
    Config(String),
    /// The model or pool.
    #[error(transparent)]
    Model(#[from] kvmesh_model::ModelError),
    /// The KV transport listener.
    #[error(transparent)]
    Transport(#[from] kvmesh_kvxfer::transport::TransportError),
}

/// A running decode node.
#[derive(Clone, Debug)]
pub struct DecodeNode {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: String,
    table: ReservationTable,
    lease: Duration,
    engine: Arc<Engine>,
    max_seq_tokens: usize,
    kv_endpoint: String,
    jobs: mpsc::Sender<Job>,
    depth: Arc<AtomicUsize>,
    /// Granted reservations not yet streaming: the handle that aborts on
    /// drop, the prompt, the budget.
    pending: Mutex<HashMap<ReservationId, Waiting>>,
    kv_server: KvServer,
    /// Checks every gRPC call's proof of the mesh secret; counts refusals.
    calls: Arc<CallVerifier>,
}

impl DecodeNode {
    /// Builds the pool, checks it against the context window, starts the
    /// KV transport listener and the batcher. Logs the pool size next to
    /// the context it serves.
    pub async fn start(cfg: DecodeConfig, loaded: LoadedModel) -> Result<Self, NodeError> {
        let model_len = loaded.config.max_position_embeddings;
        let max_model_len = cfg.engine.max_model_len.unwrap_or(model_len);
        let pool_tokens = cfg.engine.kv_pool_tokens.unwrap_or(max_model_len);
        let max_seq_tokens = check_pool_capacity(pool_tokens, max_model_len, cfg.allow_small_pool)
            .map_err(NodeError::Config)?;
        let pool_cfg = kvmesh_kvpool::PoolConfig {
            scrub: cfg.engine.scrub,
            poison: cfg.engine.poison,
            dtype: cfg.engine.kv_dtype_for(loaded.precision),
            ..kvmesh_kvpool::PoolConfig::for_tokens(
                pool_tokens,
                cfg.engine.page_size,
                loaded.config.n_layers,
                loaded.config.n_kv_heads,
                loaded.config.head_dim,
            )
        };
        let (pool, landing): (KvPool, Arc<dyn Landing>) = match &cfg.transport {
            Transport::Tcp(_) => (
                KvPool::new(pool_cfg).map_err(kvmesh_model::ModelError::from)?,
                Arc::new(TcpLanding),
            ),
            Transport::Shm { dir, .. } => {
                let (pool, region) = kvmesh_kvxfer::shm::shared_pool(pool_cfg, dir)
                    .map_err(kvmesh_model::ModelError::from)?;
                (pool, Arc::new(ShmLanding::new(region)))
            }
        };
        tracing::info!(
            node = %cfg.name,
            kv_pool_tokens = pool.capacity_tokens(),
            max_model_len,
            max_seq_tokens,
            "decode node KV pool"
        );
        let table = ReservationTable::new(
            pool.clone(),
            landing,
            TableConfig {
                lease: cfg.lease,
                abort_timeout: cfg.abort_timeout,
                max_seq_tokens,
            },
        )
        .map_err(|e| NodeError::Config(e.to_string()))?;
        let server = match &cfg.transport {
            Transport::Tcp(addr) => {
                KvServer::bind_tcp(table.clone(), addr, cfg.mesh_secret.clone()).await?
            }
            Transport::Shm { socket, .. } => {
                let _ = std::fs::remove_file(socket);
                KvServer::bind_unix(table.clone(), socket, cfg.mesh_secret.clone()).await?
            }
        };
        if let Some(adv) = &cfg.kv_advertise {
            table.set_endpoint(adv);
        }
        let kv_endpoint = table.endpoint();
        let engine = Arc::new(Engine::with_pool(loaded, &cfg.engine, pool)?);
        let (jobs, rx) = mpsc::channel(1024);
        let depth = Arc::new(AtomicUsize::new(0));
        {
            let (engine, depth) = (Arc::clone(&engine), Arc::clone(&depth));
            std::thread::Builder::new()
                .name(format!("decode-{}", cfg.name))
                .spawn(move || batcher::run(engine, rx, depth))
                .map_err(|e| NodeError::Config(format!("cannot start the batcher thread: {e}")))?;
        }
        Ok(Self {
            inner: Arc::new(Inner {
                name: cfg.name,
                table,
                lease: cfg.lease,
                engine,
                max_seq_tokens,
                kv_endpoint,
                jobs,
                depth,
                pending: Mutex::default(),
                kv_server: server,
                calls: Arc::new(CallVerifier::new(cfg.mesh_secret)),
            }),
        })
    }

    /// Where prefill writers connect (`tcp://…` or `unix:…`).
    pub fn kv_endpoint(&self) -> &str {
        &self.inner.kv_endpoint
    }

    /// The reservation table (tests and metrics).
    pub fn table(&self) -> &ReservationTable {
        &self.inner.table
    }

    /// The gRPC service; serves only peers that prove the mesh secret on
    /// every call.
    pub fn service(&self) -> Authenticated<DecodeServer<DecodeNode>> {
        Authenticated::new(
            DecodeServer::new(self.clone()),
            Arc::clone(&self.inner.calls),
        )
    }

    fn load_report(&self) -> LoadReport {
        let stats = self.inner.table.stats();
        let pool = self.inner.table.pool().stats();
        LoadReport {
            node: self.inner.name.clone(),
            role: "decode".into(),
            kv_pages_total: pool.capacity_pages as u64,
            kv_pages_free: pool.free_pages as u64,
            page_size: self.inner.table.pool().config().page_size as u32,
            max_seq_tokens: self.inner.max_seq_tokens as u64,
            queue_depth: (self.inner.depth.load(Ordering::Relaxed) + stats.open) as u32,
            writer_id: Vec::new(),
            reservations_ended: stats
                .ended_by
                .iter()
                .map(|(k, n)| ((*k).to_owned(), *n))
                .collect(),
            guard_violations: pool.guard_violations,
            reservations_granted: stats.granted,
            grpc_auth_refused: by_kind(&self.inner.calls.refused()),
            kv_auth_refused: by_kind(&self.inner.kv_server.auth_refused().by_kind()),
            kv_refused: self
                .inner
                .table
                .frame_rejects()
                .by_kind()
                .into_iter()
                .chain(stats.control_rejects)
                .filter(|(_, n)| *n > 0)
                .map(|(k, n)| (k.to_owned(), n))
                .collect(),
        }
    }
}

/// A granted reservation waiting for its token stream: the handle (which
/// aborts on drop), the prompt, the budget, when it was granted, its
/// injected faults.
type Waiting = (Pending, Vec<u32>, usize, std::time::Instant, FaultPlan);

/// The faults a request carries in its metadata (testing builds; none
/// otherwise).
fn request_faults<T>(req: &Request<T>) -> Result<FaultPlan, Status> {
    FaultPlan::from_header(
        req.metadata()
            .get(kvmesh_faults::HEADER)
            .and_then(|v| v.to_str().ok()),
    )
    .map_err(|e| Status::invalid_argument(e.to_string()))
}

/// Counters by kind as a load report's map.
fn by_kind(counts: &[(&'static str, u64)]) -> HashMap<String, u64> {
    counts.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn reservation_id(bytes: &[u8]) -> Result<ReservationId, Status> {
    <[u8; 16]>::try_from(bytes)
        .ok()
        .and_then(ReservationId::from_bytes)
        .ok_or_else(|| Status::invalid_argument("reservation_id: 16 bytes, not all zero"))
}

/// The one mapping from reserve refusals to gRPC status codes.
fn reserve_status(e: ReserveError) -> Status {
    match e {
        ReserveError::EmptyPrompt
        | ReserveError::TooLong { .. }
        | ReserveError::OverCapacity { .. } => Status::invalid_argument(e.to_string()),
        ReserveError::Exhausted { .. } => Status::resource_exhausted(e.to_string()),
        ReserveError::WriterNotConnected { .. } => Status::failed_precondition(e.to_string()),
        ReserveError::Transport(_) | ReserveError::Mint(_) | ReserveError::Pool(_) => {
            Status::internal(e.to_string())
        }
    }
}

#[tonic::async_trait]
impl Decode for DecodeNode {
    async fn reserve(
        &self,
        req: Request<kvmesh_proto::internal::v1::ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        let faults = request_faults(&req)?;
        let r = req.into_inner();
        let writer = <[u8; 16]>::try_from(r.writer_id.as_slice())
            .ok()
            .and_then(WriterId::from_bytes)
            .ok_or_else(|| Status::invalid_argument("writer_id: 16 bytes, not all zero"))?;
        let max_new = r.max_new_tokens as usize;
        let (grant, pending) = self
            .inner
            .table
            .reserve(ReserveRequest {
                prompt_tokens: r.prompt_ids.len(),
                max_new_tokens: max_new,
                writer,
            })
            .map_err(reserve_status)?;
        let mut bytes = Vec::new();
        grant
            .encode(&mut bytes)
            .map_err(|e| Status::internal(format!("encode grant: {e}")))?;
        let id = grant.reservation;
        tracing::debug!(reservation = %id, tenant = %r.tenant, prompt_tokens = r.prompt_ids.len(), max_new, "granted");
        if !faults.is_empty() {
            self.inner.table.set_faults(id, faults.clone());
        }
        let lost = faults.at(Point::Grant) == Some(Action::Drop);
        let now = std::time::Instant::now();
        let mut waiting = lock(&self.inner.pending);
        // A router that never opened the stream (it crashed, say): the lease
        // has ended the reservation long since; forget its handle.
        let stale = self.inner.lease * 2;
        waiting.retain(|_, w| now.duration_since(w.3) < stale);
        waiting.insert(id, (pending, r.prompt_ids, max_new, now, faults));
        if lost {
            // Injected: the grant was made but its answer is lost; the
            // router cannot abort what it never heard of, so the lease
            // ends the reservation.
            return Err(Status::aborted(
                "injected fault: the grant's answer was lost",
            ));
        }
        Ok(Response::new(ReserveResponse {
            grant: bytes,
            reservation_id: id.to_bytes().to_vec(),
        }))
    }

    type TokensStream = ReceiverStream<Result<TokenEvent, Status>>;

    async fn tokens(
        &self,
        req: Request<TokensRequest>,
    ) -> Result<Response<Self::TokensStream>, Status> {
        let r = req.into_inner();
        let id = reservation_id(&r.reservation_id)?;
        let (pending, prompt, max_new, _, faults) =
            lock(&self.inner.pending).remove(&id).ok_or_else(|| {
                Status::not_found(format!(
                    "no granted reservation {id} waiting for its stream"
                ))
            })?;
        let s = r.sampling.unwrap_or_default();
        let params = SamplingParams {
            temperature: s.temperature,
            top_p: if s.top_p > 0.0 { s.top_p } else { 1.0 },
            top_k: None,
            seed: Some(s.seed),
        };
        params.validate().map_err(Status::invalid_argument)?;
        // Room for every token and the end, so the batcher never blocks.
        let (tx, rx) = mpsc::channel(max_new + 2);
        let node = self.clone();
        tokio::spawn(async move {
            // The client may leave while the transfer runs: dropping
            // `pending` then aborts through the confirmation path.
            let live = tokio::select! {
                r = pending.wait() => r,
                () = tx.closed() => return,
            };
            let live = match live {
                Ok(l) => l,
                Err(ended) => {
                    let _ = tx
                        .send(Err(Status::aborted(format!(
                            "transfer did not complete: {ended}"
                        ))))
                        .await;
                    return;
                }
            };
            let first = live.first_token();
            let seq = match node
                .inner
                .engine
                .adopt(prompt, max_new, live.into_reservation())
            {
                Ok(s) => s,
                Err(e) => {
                    let _ = tx
                        .send(Err(Status::internal(format!(
                            "adopt verified sequence: {e}"
                        ))))
                        .await;
                    return;
                }
            };
            let mut sampler = Sampler::new(params);
            // Prefill drew the first token from the same seed.
            sampler.advance();
            let job = Job {
                seq,
                first_token: first,
                max_new_tokens: max_new,
                sampler,
                stop_ids: r.stop_token_ids,
                events: tx,
                faults,
            };
            if let Err(e) = node.inner.jobs.send(job).await {
                let _ =
                    e.0.events
                        .send(Err(Status::unavailable("decode node shutting down")))
                        .await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let r = req.into_inner();
        let id = reservation_id(&r.reservation_id)?;
        let reason = AbortReason(u16::try_from(r.reason).unwrap_or(AbortReason::CANCELLED.0));
        // A granted reservation not yet streaming: drop its handle too.
        let waiting = lock(&self.inner.pending).remove(&id);
        let state = self
            .inner
            .table
            .abort(id, reason)
            .map_err(|e| Status::not_found(e.to_string()))?;
        drop(waiting);
        Ok(Response::new(AbortResponse {
            state: state.into(),
        }))
    }

    async fn load(&self, _req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(self.load_report()))
    }
}
