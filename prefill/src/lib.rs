//! kvmesh prefill service: computes a prompt's KV cache and writes it into
//! the pages a decode node granted, over the KV transport, then reports
//! transfer-done with the first sampled token.
//!
//! # Layout
//! - [`PrefillNode`]: the node: a model engine with its own KV pool (where
//!   the prompt is computed), one KV transport connection per decode node
//!   it has written to (as one writer id, minted at start), the compute
//!   thread, and the `kvmesh.internal.v1.Prefill` gRPC service.
//! - `compute` (private): the compute thread's batches and each request's
//!   shipping task; `metrics` (private): the node's own `/metrics` series.
//!
//! # Per request
//! The grant is decoded and re-checked (prompt length equals the grant's
//! prompt tokens, within this node's limits: I3); the writer for it is
//! taken before any compute (an abort that overtook the grant refuses it
//! here); the compute thread runs every prompt waiting (up to a token
//! budget) as one batched forward pass; each layer's K and V go to the
//! request's shipping task as soon as the layer is computed, which writes
//! them through the grant's writer (checking before each whether the decode
//! node aborted) while later layers compute; transfer-done, with the first
//! sampled token and its report (its logprobs, the prompt's scores when
//! asked, the tokens taken from this node's prefix cache: what the router
//! reports, which the decode node relays on its token stream), goes last,
//! so the decode node still verifies the whole (I4).
//! Any failure drops the writer: the decode node's abort (or lease) then
//! ends the reservation through the confirmation path.
//!
//! # Lifecycle
//! [`run`] serves the node on a listener until shutdown, then drains:
//! Prefill is refused and the load report says `draining`; calls in flight
//! finish (bounded by the drain timeout; past it they stop before their
//! next layer and the decode node's abort ends their reservations); the
//! server stops and the compute thread is joined.

mod compute;
mod metrics;
mod run;

use metrics::PrefillMetrics;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use kvmesh_faults::FaultPlan;
use kvmesh_kvpool::Namespace;
use kvmesh_kvwire::{
    decode_message, FirstToken, Grant, Message, PromptScore, ReservationId, TokenLogprobs, WriterId,
};
use kvmesh_kvxfer::transport::client::{GrantWriter, KvClient, WriterError};
use kvmesh_kvxfer::transport::KvAuth;
use kvmesh_meshauth::grpc::Authenticated;
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::{CallVerifier, MeshSecret};
use kvmesh_model::engine::{check_pool_capacity, Engine, EngineConfig};
use kvmesh_model::sampling::{PromptLogprob, Sampled, Sampler, MAX_TOP_LOGPROBS};
use kvmesh_model::LoadedModel;
use kvmesh_proto::internal::v1::prefill_server::{Prefill, PrefillServer};
use kvmesh_proto::internal::v1::{
    AbortRequest, AbortResponse, LoadReport, LoadRequest, PrefillRequest, PrefillResponse,
};
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch, Mutex as AsyncMutex};

use kvmesh_node::serve::cut_set;
pub use kvmesh_node::serve::Drained;
pub use run::run;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// A prefill node's settings.
#[derive(Clone, Debug)]
pub struct PrefillConfig {
    /// The node's name (load reports, metrics).
    pub name: String,
    /// Pool, page and context settings of its own pool.
    pub engine: EngineConfig,
    /// Start even if the pool cannot hold one max-context request.
    pub allow_small_pool: bool,
    /// The per-mesh secret: proven to decode nodes' KV listeners, and
    /// required of every gRPC caller.
    pub mesh_secret: MeshSecret,
    /// Mutual TLS (on top of the secret) on the gRPC port and to decode
    /// nodes' TCP KV listeners, when the mesh has certificates.
    pub tls: Option<Arc<MeshTls>>,
    /// How long a drain waits for prompts in flight before it stops them
    /// ([`run`]).
    pub drain_timeout: Duration,
    /// Keep computed prompts' pages in a prefix cache and compute only
    /// the part of a new prompt its cached prefix lacks.
    pub prefix_cache: bool,
}

/// Why a prefill request failed.
#[derive(Debug, Error)]
pub enum PrefillError {
    /// The request does not match its grant or this node's limits.
    #[error("{0}")]
    Invalid(String),
    /// The grant is not a valid kvxfer grant.
    #[error("grant: {0}")]
    Grant(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] kvmesh_model::ModelError),
    /// The writer stopped (aborted, revoked) or the transport failed.
    #[error(transparent)]
    Writer(#[from] WriterError),
    /// The KV transport could not connect.
    #[error(transparent)]
    Transport(#[from] kvmesh_kvxfer::transport::TransportError),
    /// The node is shutting down.
    #[error("prefill node shutting down")]
    ShuttingDown,
    /// The gRPC server failed.
    #[error("prefill gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The compute thread panicked.
    #[error("the prefill compute thread panicked")]
    ComputePanicked,
}

impl PrefillError {
    /// A short label of the failure (a span's `error.kind`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid",
            Self::Grant(_) => "grant",
            Self::Model(_) => "model",
            Self::Writer(e) => e.kind(),
            Self::Transport(_) => "transport",
            Self::ShuttingDown => "shutting_down",
            Self::Serve(_) => "serve",
            Self::ComputePanicked => "compute_panicked",
        }
    }
}

/// The one mapping from prefill errors to gRPC status codes.
impl From<PrefillError> for Status {
    fn from(e: PrefillError) -> Self {
        match &e {
            PrefillError::Invalid(_) => Status::invalid_argument(e.to_string()),
            // A grant is minted by a decode node and relayed by the router:
            // one that does not decode was damaged inside the mesh.
            PrefillError::Grant(_) => Status::internal(e.to_string()),
            PrefillError::Writer(
                WriterError::Aborted(_) | WriterError::Revoked(_) | WriterError::Expired(_),
            ) => Status::aborted(e.to_string()),
            PrefillError::Writer(WriterError::DuplicateGrant(_)) => {
                Status::already_exists(e.to_string())
            }
            PrefillError::Writer(WriterError::Transport(_)) | PrefillError::Transport(_) => {
                Status::unavailable(e.to_string())
            }
            PrefillError::Writer(_) => Status::failed_precondition(e.to_string()),
            PrefillError::Model(_) => Status::internal(e.to_string()),
            PrefillError::ShuttingDown => kvmesh_proto::refusal::draining(e.to_string()),
            PrefillError::Serve(_) | PrefillError::ComputePanicked => {
                Status::internal(e.to_string())
            }
        }
    }
}

/// What the compute thread is sent.
enum Work {
    /// Boxed: the channel holds many.
    Job(Box<Job>),
    /// Return (the node has drained).
    Stop,
}

struct Job {
    prompt: Vec<u32>,
    /// Draws the first token (with the prompt as its history).
    sampler: Sampler,
    writer: GrantWriter,
    /// The prefix-cache namespace, when the router sent one.
    ns: Option<Namespace>,
    /// Score the prompt with this many alternatives per position.
    prompt_logprobs: Option<usize>,
    /// Answered with prefill's cached token count once transfer-done is
    /// sent (or with why not).
    done: oneshot::Sender<Result<u32, PrefillError>>,
    /// The request's span here (`prefill.request`): parent of its compute
    /// and transfer spans.
    span: tracing::Span,
}

/// A running prefill node.
#[derive(Clone, Debug)]
pub struct PrefillNode {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: String,
    writer: WriterId,
    max_seq_tokens: usize,
    engine: Arc<Engine>,
    jobs: mpsc::Sender<Work>,
    depth: Arc<AtomicUsize>,
    /// One transport connection per decode endpoint, each behind a lock of
    /// its own: connecting to one endpoint (bounded by the caller; a
    /// registered address may drop packets) never holds up requests to the
    /// others.
    clients: Mutex<HashMap<String, Arc<AsyncMutex<Option<KvClient>>>>>,
    /// Proven to decode nodes when a transport connection opens.
    secret: MeshSecret,
    /// Checks every gRPC call's proof of the mesh secret; counts refusals.
    calls: Arc<CallVerifier>,
    /// Reservations the router stopped, with when (forgotten after
    /// [`FORGET_STOPPED`]).
    stopped: Stopped,
    /// Set when a drain starts: Prefill is refused (`UNAVAILABLE`) and the
    /// load report says `draining`, so the router stops choosing this node.
    draining: AtomicBool,
    /// Set at the drain deadline: calls still waiting stop their transfer
    /// (the decode node's abort then ends the reservation).
    cut: watch::Sender<bool>,
    /// Prefill calls in flight.
    open: Arc<AtomicUsize>,
    drain_timeout: Duration,
    /// The compute thread, joined when the node stops.
    compute: Mutex<Option<JoinHandle<()>>>,
    /// Batches and transfers (`/metrics`).
    metrics: Arc<PrefillMetrics>,
    /// The node's TLS identity (its gRPC server's, and its KV writer's).
    tls: Option<Arc<MeshTls>>,
}

/// Counts a Prefill call until it returns: the drain waits for none.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a stop request is remembered (longer than any lease).
const FORGET_STOPPED: std::time::Duration = std::time::Duration::from_secs(600);

fn is_stopped(
    stopped: &std::sync::Mutex<HashMap<ReservationId, std::time::Instant>>,
    id: ReservationId,
) -> bool {
    stopped
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .contains_key(&id)
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("prompt_tokens", &self.prompt.len())
            .finish_non_exhaustive()
    }
}

impl PrefillNode {
    /// Builds the engine and its pool (checked against the context window),
    /// mints the writer id, starts the compute thread.
    pub fn start(cfg: PrefillConfig, loaded: LoadedModel) -> Result<Self, PrefillError> {
        let model_len = loaded.config.max_position_embeddings;
        let max_model_len = cfg.engine.max_model_len.unwrap_or(model_len);
        let pool_tokens = cfg.engine.kv_pool_tokens.unwrap_or(max_model_len);
        let max_seq_tokens = check_pool_capacity(pool_tokens, max_model_len, cfg.allow_small_pool)
            .map_err(PrefillError::Invalid)?;
        let mut engine = Engine::from_loaded(loaded, &cfg.engine)?;
        if cfg.prefix_cache {
            engine = engine.with_prefix_cache(
                kvmesh_prefix::CacheKeys::new(&cfg.mesh_secret),
                kvmesh_model::engine::PREFIX_CACHE_SHARE,
            );
        }
        let engine = Arc::new(engine);
        tracing::info!(
            node = %cfg.name,
            kv_pool_tokens = engine.pool().capacity_tokens(),
            max_model_len,
            max_seq_tokens,
            "prefill node KV pool"
        );
        let writer = WriterId::mint().map_err(|e| PrefillError::Invalid(e.to_string()))?;
        let (jobs, rx) = mpsc::channel(256);
        let depth = Arc::new(AtomicUsize::new(0));
        let stopped = Arc::new(std::sync::Mutex::new(HashMap::new()));
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            PrefillError::Invalid("start the prefill node inside a tokio runtime".into())
        })?;
        let metrics = Arc::new(PrefillMetrics::default());
        let compute = {
            let (engine, depth, stopped, metrics) = (
                Arc::clone(&engine),
                Arc::clone(&depth),
                Arc::clone(&stopped),
                Arc::clone(&metrics),
            );
            std::thread::Builder::new()
                .name(format!("prefill-{}", cfg.name))
                .spawn(move || compute::compute(engine, rx, depth, handle, stopped, metrics))
                .map_err(|e| {
                    PrefillError::Invalid(format!("cannot start the compute thread: {e}"))
                })?
        };
        Ok(Self {
            inner: Arc::new(Inner {
                name: cfg.name.clone(),
                writer,
                max_seq_tokens,
                engine,
                jobs,
                depth,
                clients: Mutex::default(),
                calls: Arc::new(CallVerifier::new(cfg.mesh_secret.clone(), cfg.name.clone())),
                secret: cfg.mesh_secret,
                stopped,
                draining: AtomicBool::new(false),
                cut: watch::channel(false).0,
                open: Arc::default(),
                drain_timeout: cfg.drain_timeout,
                compute: Mutex::new(Some(compute)),
                metrics,
                tls: cfg.tls.clone(),
            }),
        })
    }

    /// Stops the compute thread (after the batch it runs) and joins it.
    async fn join_compute(&self) -> Result<(), PrefillError> {
        let _ = self.inner.jobs.send(Work::Stop).await;
        kvmesh_node::serve::join_thread(&self.inner.compute)
            .await
            .map_err(|_| PrefillError::ComputePanicked)
    }

    /// Remembers that reservation `id` was stopped: its shipping task
    /// stops before its next layer.
    fn stop(&self, id: ReservationId) {
        let now = std::time::Instant::now();
        let mut stopped = self
            .inner
            .stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        stopped.retain(|_, at| now.duration_since(*at) < FORGET_STOPPED);
        stopped.insert(id, now);
    }

    /// The writer id its KV connections announce.
    pub fn writer_id(&self) -> WriterId {
        self.inner.writer
    }

    /// Connects to a decode node's KV endpoint now (so that node can grant
    /// to this writer before the first request).
    pub async fn connect(&self, endpoint: &str) -> Result<(), PrefillError> {
        self.client(endpoint).await.map(|_| ())
    }

    async fn client(&self, endpoint: &str) -> Result<KvClient, PrefillError> {
        let slot = Arc::clone(
            self.inner
                .clients
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(endpoint.to_owned())
                .or_default(),
        );
        // One connection per endpoint: callers for the same endpoint wait
        // for the one connecting.
        let mut slot = slot.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| c.is_connected()) {
            return Ok(c.clone());
        }
        let auth = KvAuth {
            secret: self.inner.secret.clone(),
            tls: self.inner.tls.clone(),
        };
        let c = KvClient::connect(endpoint, self.inner.writer, auth).await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// The gRPC service; serves only peers that prove the mesh secret on
    /// every call.
    pub fn service(&self) -> Authenticated<PrefillServer<PrefillNode>> {
        Authenticated::new(
            PrefillServer::new(self.clone()),
            Arc::clone(&self.inner.calls),
        )
    }

    /// The engine's pool (tests and metrics).
    pub fn pool(&self) -> &kvmesh_kvpool::KvPool {
        self.inner.engine.pool()
    }

    /// Prefills `r` into its grant; once transfer-done (with the first
    /// token and its report) is sent, answers the prompt tokens taken from
    /// this node's prefix cache (for its span).
    async fn prefill(&self, r: PrefillRequest, faults: FaultPlan) -> Result<u32, PrefillError> {
        if self.inner.draining.load(Ordering::Acquire) {
            return Err(PrefillError::ShuttingDown);
        }
        let _open = Open::new(&self.inner.open);
        let grant = match decode_message(&r.grant)
            .map_err(|e| PrefillError::Grant(e.to_string()))?
            .0
        {
            Message::Grant(g) => g,
            other => {
                return Err(PrefillError::Grant(format!(
                    "not a grant: {:?}",
                    other.message_type()
                )))
            }
        };
        check(&grant, &r.prompt_ids, self.inner.max_seq_tokens)?;
        // Pages of another shape or dtype than this node computes would be
        // refused page by page (lengths) or, for the dtype, rounded on the
        // way: refuse the grant up front instead.
        let own = kvmesh_kvxfer::pool_geometry(self.pool().config())
            .map_err(|e| PrefillError::Invalid(e.to_string()))?;
        if grant.geometry != own {
            return Err(PrefillError::Invalid(format!(
                "the decode node's KV pages are {:?}, this node's {own:?}: start both with the same model and --kv-cache-dtype",
                grant.geometry
            )));
        }
        let params = kvmesh_node::sampling::params(&r.sampling.clone().unwrap_or_default(), || {
            self.inner.engine.vocabulary()
        })
        .map_err(PrefillError::Invalid)?;
        let sampler = Sampler::new(params, &r.prompt_ids, &r.stop_token_ids);
        let prompt_logprobs = match r.prompt_logprobs {
            Some(k) if k as usize > MAX_TOP_LOGPROBS => {
                return Err(PrefillError::Invalid(format!(
                    "prompt_logprobs: at most {MAX_TOP_LOGPROBS}, got {k}"
                )))
            }
            k => k.map(|k| k as usize),
        };
        let ns = match r.cache_namespace.as_slice() {
            [] => None,
            b => Some(Namespace::from_slice(b).ok_or_else(|| {
                PrefillError::Invalid("cache_namespace: 32 bytes or none".into())
            })?),
        };
        let client = self.client(&grant.endpoint).await?;
        let id = grant.reservation;
        let mut writer = client.begin(grant)?;
        tracing::debug!(reservation = %id, prompt_tokens = r.prompt_ids.len(), "prefill accepted");
        let span = kvmesh_telemetry::current();
        kvmesh_telemetry::record(&span, "reservation.id", id.to_string());
        writer.set_faults(faults);
        let (done, rx) = oneshot::channel();
        self.inner
            .jobs
            .send(Work::Job(Box::new(Job {
                prompt: r.prompt_ids,
                sampler,
                writer,
                ns,
                prompt_logprobs,
                done,
                span,
            })))
            .await
            .map_err(|_| PrefillError::ShuttingDown)?;
        let mut cut = self.inner.cut.subscribe();
        tokio::select! {
            r = rx => r.map_err(|_| PrefillError::ShuttingDown)?,
            () = cut_set(&mut cut) => {
                // The drain deadline: the shipping task stops before its
                // next layer and drops the writer.
                self.stop(id);
                Err(PrefillError::ShuttingDown)
            }
        }
    }
}

/// The node's own re-check (I3): the prompt is exactly the grant's, and
/// within this node's limits.
fn check(grant: &Grant, prompt: &[u32], max_seq_tokens: usize) -> Result<(), PrefillError> {
    if prompt.is_empty() || prompt.len() as u64 != grant.prompt_tokens {
        return Err(PrefillError::Invalid(format!(
            "{} prompt tokens, but the grant covers {}",
            prompt.len(),
            grant.prompt_tokens
        )));
    }
    if prompt.len() > max_seq_tokens {
        return Err(PrefillError::Invalid(format!(
            "{} prompt tokens exceed this node's limit of {max_seq_tokens}",
            prompt.len()
        )));
    }
    Ok(())
}

/// Reservations the router stopped.
type Stopped = Arc<std::sync::Mutex<HashMap<ReservationId, std::time::Instant>>>;

#[tonic::async_trait]
impl Prefill for PrefillNode {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillResponse>, Status> {
        let faults = FaultPlan::from_header(
            req.metadata()
                .get(kvmesh_faults::HEADER)
                .and_then(|v| v.to_str().ok()),
        )
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
        // The request's span here: a child of the router's dispatch span.
        let span = kvmesh_telemetry::span!(
            "prefill.request",
            node = %self.inner.name,
            prompt_tokens = req.get_ref().prompt_ids.len() as u64
        );
        kvmesh_telemetry::propagate::continue_grpc(&span, req.metadata());
        let cached = PrefillNode::prefill(self, req.into_inner(), faults)
            .instrument(span.clone())
            .await
            .inspect_err(|e| kvmesh_telemetry::fail(&span, e.kind()))?;
        kvmesh_telemetry::record(&span, "cached_tokens", i64::from(cached));
        // The first token and its report went to the decode node with the
        // transfer; the router reads them on its token stream.
        Ok(Response::new(PrefillResponse {}))
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let span = kvmesh_telemetry::span!("prefill.abort", node = %self.inner.name);
        kvmesh_telemetry::propagate::continue_grpc(&span, req.metadata());
        let _entered = span.enter();
        let id = <[u8; 16]>::try_from(req.into_inner().reservation_id.as_slice())
            .ok()
            .and_then(ReservationId::from_bytes)
            .ok_or_else(|| Status::invalid_argument("reservation_id: 16 bytes, not all zero"))?;
        kvmesh_telemetry::record(&span, "reservation.id", id.to_string());
        self.stop(id);
        Ok(Response::new(AbortResponse {
            state: "stopping".into(),
        }))
    }

    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(
            self.load_report(Some(req.get_ref().known_cache_epoch)),
        ))
    }
}

impl PrefillNode {
    /// The node's Prometheus text: its load report's series, then its
    /// batches and transfers (what `GET /metrics` on its gRPC port
    /// answers).
    pub fn metrics_text(&self) -> String {
        let report = self.load_report(None);
        let mut out = String::new();
        kvmesh_node::metrics::render_report(&report, &mut out);
        let labels = kvmesh_node::metrics::node_labels(
            &report.node,
            kvmesh_proto::internal::v1::NodeRole::Prefill,
        );
        self.inner.metrics.render(&labels, &mut out);
        out
    }

    /// The load report; the prefix-cache advert (routing ids) only with
    /// `known_cache_epoch` (the router's poll), not for `/metrics`.
    fn load_report(&self, known_cache_epoch: Option<u64>) -> LoadReport {
        let engine = &self.inner.engine;
        LoadReport {
            node: self.inner.name.clone(),
            role: kvmesh_proto::internal::v1::NodeRole::Prefill.into(),
            max_seq_tokens: self.inner.max_seq_tokens as u64,
            queue_depth: self.inner.depth.load(Ordering::Relaxed) as u32,
            writer_id: self.inner.writer.to_bytes().to_vec(),
            draining: self.inner.draining.load(Ordering::Acquire),
            // No reservations and no KV listener here: those fields stay
            // empty.
            ..kvmesh_node::report::common(
                engine,
                engine.pool(),
                &self.inner.calls,
                self.inner.tls.as_deref(),
                known_cache_epoch,
            )
        }
    }
}

#[cfg(test)]
mod tests;
