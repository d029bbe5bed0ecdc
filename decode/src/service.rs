//! The decode node and its gRPC service.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvmesh_faults::{Action, Point};
use kvmesh_kvwire::AbortReason;
use kvmesh_kvxfer::handshake::{ReservationTable, ReserveRequest, TableConfig};
use kvmesh_kvxfer::transport::server::KvServer;
use kvmesh_kvxfer::transport::{KvAuth, ListenSettings};
use kvmesh_meshauth::grpc::Authenticated;
use kvmesh_meshauth::tls::MeshTls;
use kvmesh_meshauth::{CallVerifier, MeshSecret};
use kvmesh_model::engine::{check_pool_capacity, Engine, EngineConfig};
use kvmesh_model::sampling::Sampler;
use kvmesh_model::LoadedModel;
use kvmesh_node::report::by_kind;
use kvmesh_node::serve::cut_set;
use kvmesh_prefix::CacheKeys;
use kvmesh_proto::internal::v1::decode_server::{Decode, DecodeServer};
use kvmesh_proto::internal::v1::{
    decode_event, AbortRequest, AbortResponse, DecodeEvent, GenerateRequest, Granted, LoadReport,
    LoadRequest, NodeRole, RefuseKind,
};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

mod request;

use crate::batcher::{self, Job, Open, Running, Work};
use crate::metrics::StepMetrics;
use request::{abandon, check, refuse_kind, refused, request_faults, reservation_id};

/// A decode node's settings.
#[derive(Clone, Debug)]
pub struct DecodeConfig {
    /// The node's name (load reports, metrics).
    pub name: String,
    /// Pool, page and context settings.
    pub engine: EngineConfig,
    /// Start even if the pool cannot hold one max-context request.
    pub allow_small_pool: bool,
    /// The KV transport and where it listens.
    pub transport: ListenSettings,
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
    /// Mutual TLS (on top of the secret) on the gRPC port and the TCP KV
    /// listener, when the mesh has certificates.
    pub tls: Option<Arc<MeshTls>>,
    /// How long a drain waits for in-flight streams to finish before it
    /// ends them ([`crate::run`]).
    pub drain_timeout: Duration,
    /// Keep finished sequences' pages in a prefix cache (a share of the
    /// pool, [`kvmesh_model::engine::PREFIX_CACHE_SHARE`]) and grant only
    /// the pages a new request's prefix lacks.
    pub prefix_cache: bool,
}

/// Why a decode node could not start, or did not stop cleanly.
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
    /// The gRPC server failed.
    #[error("decode gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// The batcher thread panicked.
    #[error("the batcher thread panicked")]
    BatcherPanicked,
}

/// A running decode node.
#[derive(Clone, Debug)]
pub struct DecodeNode {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    name: String,
    table: ReservationTable,
    pub(crate) engine: Arc<Engine>,
    max_seq_tokens: usize,
    kv_endpoint: String,
    jobs: mpsc::Sender<Work>,
    depth: Arc<AtomicUsize>,
    /// The batcher's step series (`/metrics`).
    steps: Arc<StepMetrics>,
    /// The node's TLS identity (its gRPC server's too).
    pub(crate) tls: Option<Arc<MeshTls>>,
    kv_server: KvServer,
    /// Checks every gRPC call's proof of the mesh secret; counts refusals.
    calls: Arc<CallVerifier>,
    /// Set when a drain starts: Generate is refused
    /// ([`RefuseKind::Draining`]) and the load report says so, so the
    /// router stops choosing this node.
    pub(crate) draining: AtomicBool,
    /// Set at the drain deadline: transfers still awaited are given up
    /// (their reservations abort through the confirmation path) and the
    /// batcher ends every running sequence with a terminal error.
    pub(crate) cut: watch::Sender<bool>,
    /// Generate streams granted and not yet ended.
    pub(crate) open: Arc<AtomicUsize>,
    pub(crate) drain_timeout: Duration,
    pub(crate) abort_timeout: Duration,
    /// The batcher thread, joined when the node stops.
    batcher: Mutex<Option<JoinHandle<()>>>,
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
            ..loaded.config.pool_config(pool_tokens, cfg.engine.page_size)
        };
        let (pool, landing) = cfg.transport.land(pool_cfg, &cfg.name)?;
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
        let auth = KvAuth {
            secret: cfg.mesh_secret.clone(),
            tls: cfg.tls.clone(),
        };
        let server = cfg.transport.listen(table.clone(), auth).await?;
        if let Some(adv) = &cfg.kv_advertise {
            table.set_endpoint(adv);
        }
        let kv_endpoint = table.endpoint();
        let mut engine = Engine::with_pool(loaded, &cfg.engine, pool)?;
        if cfg.prefix_cache {
            engine = engine.with_prefix_cache(
                CacheKeys::new(&cfg.mesh_secret),
                kvmesh_model::engine::PREFIX_CACHE_SHARE,
            );
        }
        let engine = Arc::new(engine);
        let (jobs, rx) = mpsc::channel(1024);
        let depth = Arc::new(AtomicUsize::new(0));
        let (cut, cut_rx) = watch::channel(false);
        let steps = Arc::new(StepMetrics::default());
        let batcher = {
            let (engine, depth, steps) =
                (Arc::clone(&engine), Arc::clone(&depth), Arc::clone(&steps));
            std::thread::Builder::new()
                .name(format!("decode-{}", cfg.name))
                .spawn(move || batcher::run(engine, rx, depth, cut_rx, steps))
                .map_err(|e| NodeError::Config(format!("cannot start the batcher thread: {e}")))?
        };
        Ok(Self {
            inner: Arc::new(Inner {
                name: cfg.name.clone(),
                table,
                engine,
                max_seq_tokens,
                kv_endpoint,
                jobs,
                depth,
                steps,
                tls: cfg.tls.clone(),
                kv_server: server,
                calls: Arc::new(CallVerifier::new(cfg.mesh_secret, cfg.name.clone())),
                draining: AtomicBool::new(false),
                cut,
                open: Arc::default(),
                drain_timeout: cfg.drain_timeout,
                abort_timeout: cfg.abort_timeout,
                batcher: Mutex::new(Some(batcher)),
            }),
        })
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Stops the batcher once nothing runs and joins its thread.
    pub(crate) async fn join_batcher(&self) -> Result<(), NodeError> {
        let _ = self.inner.jobs.send(Work::Stop).await;
        kvmesh_node::serve::join_thread(&self.inner.batcher)
            .await
            .map_err(|_| NodeError::BatcherPanicked)
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

    /// The node's Prometheus text: its load report's series, then the
    /// batcher's steps (what `GET /metrics` on its gRPC port answers).
    pub fn metrics_text(&self) -> String {
        let report = self.load_report(None);
        let mut out = String::new();
        kvmesh_node::metrics::render_report(&report, &mut out);
        let labels = kvmesh_node::metrics::node_labels(&report.node, NodeRole::Decode);
        self.inner.steps.render(&labels, &mut out);
        out
    }

    /// The load report; the prefix-cache advert (routing ids) only with
    /// `known_cache_epoch` (the router's poll), not for `/metrics`.
    fn load_report(&self, known_cache_epoch: Option<u64>) -> LoadReport {
        let stats = self.inner.table.stats();
        LoadReport {
            node: self.inner.name.clone(),
            role: NodeRole::Decode.into(),
            max_seq_tokens: self.inner.max_seq_tokens as u64,
            queue_depth: (self.inner.depth.load(Ordering::Relaxed) + stats.open) as u32,
            draining: self.inner.draining.load(Ordering::Acquire),
            writer_id: Vec::new(),
            reservations_ended: stats
                .ended_by
                .iter()
                .map(|(k, n)| ((*k).to_owned(), *n))
                .collect(),
            reservations_granted: stats.granted,
            kv_bytes_received: stats.kv_bytes_received,
            kv_auth_refused: by_kind(&self.inner.kv_server.auth_refused().by_kind()),
            kv_refused: self
                .inner
                .table
                .frame_rejects()
                .by_kind()
                .into_iter()
                .chain(stats.control_rejects)
                // One-sided writes the transport refused (another grant's
                // page), which the table never sees.
                .chain(self.inner.table.landing().refused())
                .filter(|(_, n)| *n > 0)
                .map(|(k, n)| (k.to_owned(), n))
                .collect(),
            ..kvmesh_node::report::common(
                &self.inner.engine,
                self.inner.table.pool(),
                &self.inner.calls,
                self.inner.tls.as_deref(),
                known_cache_epoch,
            )
        }
    }
}

#[tonic::async_trait]
impl Decode for DecodeNode {
    type GenerateStream = ReceiverStream<Result<DecodeEvent, Status>>;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let faults = request_faults(&req)?;
        // The request's span at this node, for its whole stream: a child
        // of the router's dispatch span (its `traceparent` metadata).
        let span = kvmesh_telemetry::span!(
            "decode.generate",
            node = %self.inner.name,
            prompt_tokens = req.get_ref().prompt_ids.len() as u64,
            max_new_tokens = u64::from(req.get_ref().max_new_tokens)
        );
        kvmesh_telemetry::propagate::continue_grpc(&span, req.metadata());
        let r = req.into_inner();
        // Room for the grant, prefill's report, every token and the end (and
        // one spare), so neither this task nor the batcher ever blocks on a
        // slow reader.
        let (tx, rx) = mpsc::channel((r.max_new_tokens as usize).saturating_add(4).min(1 << 16));
        let stream = Response::new(ReceiverStream::new(rx));
        if self.inner.draining.load(Ordering::Acquire) {
            kvmesh_telemetry::fail(&span, RefuseKind::Draining.as_str_name());
            let _ = tx.try_send(Ok(refused(
                RefuseKind::Draining,
                "decode node draining: it takes no new requests".into(),
            )));
            return Ok(stream);
        }
        let c = match check(&r, || self.inner.engine.vocabulary()) {
            Ok(c) => c,
            Err(message) => {
                kvmesh_telemetry::fail(&span, RefuseKind::InvalidRequest.as_str_name());
                let _ = tx.try_send(Ok(refused(RefuseKind::InvalidRequest, message)));
                return Ok(stream);
            }
        };
        // The cache's keys for the prompt's pages, when the cache is on.
        let cached = c.ns.and_then(|ns| {
            let keys = self.inner.engine.cacheable_keys(&ns, &r.prompt_ids);
            (!keys.is_empty()).then_some((ns, keys))
        });
        let reserve = kvmesh_telemetry::span!(parent: &span, "decode.reserve");
        let reserved = reserve.in_scope(|| {
            self.inner.table.reserve(ReserveRequest {
                prompt_tokens: r.prompt_ids.len(),
                max_new_tokens: c.max_new,
                writer: c.writer,
                cached,
            })
        });
        let (grant, pending) = match reserved {
            Ok(g) => g,
            Err(e) => {
                let kind = refuse_kind(&e);
                kvmesh_telemetry::fail(&reserve, kind.as_str_name());
                kvmesh_telemetry::fail(&span, kind.as_str_name());
                let _ = tx.try_send(Ok(refused(kind, e.to_string())));
                return Ok(stream);
            }
        };
        if !reserve.is_disabled() {
            let id = grant.reservation.to_string();
            kvmesh_telemetry::record(&reserve, "reservation.id", id.clone());
            kvmesh_telemetry::record(&reserve, "pages", grant.pages.len() as i64);
            kvmesh_telemetry::record(&reserve, "cached_tokens", grant.cached_tokens as i64);
            kvmesh_telemetry::record(&span, "reservation.id", id);
        }
        drop(reserve);
        let mut bytes = Vec::new();
        if let Err(e) = grant.encode(&mut bytes) {
            // `pending` drops here: the reservation ends unused.
            let _ = tx.try_send(Ok(refused(
                RefuseKind::Internal,
                format!("encode grant: {e}"),
            )));
            return Ok(stream);
        }
        let id = grant.reservation;
        let open = Open::new(&self.inner.open);
        tracing::debug!(reservation = %id, prompt_tokens = r.prompt_ids.len(), max_new = c.max_new, "granted");
        if !faults.is_empty() {
            self.inner.table.set_faults(id, faults.clone());
        }
        if !span.is_disabled() {
            // The handshake's spans (verify, abort, revoke) are its children.
            self.inner.table.set_span(id, span.clone());
        }
        if faults.at(Point::Grant) == Some(Action::Drop) {
            // Injected: the grant was made but never reaches the router,
            // which cannot abort what it never heard of: the lease ends it.
            tracing::debug!(reservation = %id, "injected fault: grant withheld");
        } else {
            let granted = DecodeEvent {
                event: Some(decode_event::Event::Granted(Granted {
                    grant: bytes,
                    reservation_id: id.to_bytes().to_vec(),
                })),
            };
            let _ = tx.try_send(Ok(granted));
        }
        let node = self.clone();
        let (prompt, stop_ids) = (r.prompt_ids, r.stop_token_ids);
        let task_span = span.clone();
        tokio::spawn(
            async move {
                // The router may leave while the transfer runs: dropping the
                // wait (and the `Pending` in it) then aborts through the
                // confirmation path.
                let wait = pending.wait();
                tokio::pin!(wait);
                let mut cut = node.inner.cut.subscribe();
                let live = tokio::select! {
                    r = &mut wait => r,
                    () = tx.closed() => {
                        abandon(&node.inner.table, id, wait, &faults).await;
                        return;
                    }
                    () = cut_set(&mut cut) => {
                        // The drain deadline: dropping `wait` aborts the
                        // reservation through the confirmation path.
                        let _ = tx.send(Err(batcher::cut_status())).await;
                        return;
                    }
                };
                let live = match live {
                    Ok(l) => l,
                    Err(ended) => {
                        kvmesh_telemetry::fail(&span, ended.outcome.kind());
                        let _ = tx
                            .send(Err(Status::aborted(format!(
                                "transfer did not complete: {ended}"
                            ))))
                            .await;
                        return;
                    }
                };
                let (first, kv) = live.into_parts();
                let (first, report) = batcher::prefilled(first);
                // Prefill's report before any token: the router emits
                // nothing before it. A router that is gone ends it here.
                if tx.send(report).await.is_err() {
                    return;
                }
                let mut sampler = Sampler::new(c.params, &prompt, &stop_ids);
                // Prefill drew the first token with the same seed and history.
                sampler.resume(first.token);
                let engine = &node.inner.engine;
                let adopt =
                    kvmesh_telemetry::span!(parent: &span, "decode.adopt", reservation.id = %id);
                let adopted = adopt.in_scope(|| match c.ns {
                    // Its pages (prompt and generated) are offered to the
                    // cache when the sequence ends.
                    Some(ns) => engine.adopt_in(ns, prompt, c.max_new, kv),
                    None => engine.adopt(prompt, c.max_new, kv),
                });
                let seq = match adopted {
                    Ok(s) => s,
                    Err(e) => {
                        kvmesh_telemetry::fail(&adopt, "adopt_failed");
                        kvmesh_telemetry::fail(&span, "adopt_failed");
                        let _ = tx
                            .send(Err(Status::internal(format!(
                                "adopt verified sequence: {e}"
                            ))))
                            .await;
                        return;
                    }
                };
                drop(adopt);
                let job = Job {
                    span: kvmesh_telemetry::span!(
                        parent: &span,
                        "decode.stream",
                        reservation.id = %id,
                        decode_steps = tracing::field::Empty,
                        outcome = tracing::field::Empty
                    ),
                    seq,
                    first,
                    max_new_tokens: c.max_new,
                    sampler,
                    stop_ids,
                    events: tx,
                    faults,
                    open,
                };
                // Prefill's token goes to the client now, not after the
                // batch's step under way; the batch takes the rest.
                let Some(running) = Running::start(job) else {
                    return;
                };
                if let Err(e) = node.inner.jobs.send(Work::Job(running)).await {
                    if let Work::Job(r) = e.0 {
                        r.release(Some(Err(Status::unavailable("decode node shutting down"))));
                    }
                }
            }
            .instrument(task_span),
        );
        Ok(stream)
    }

    async fn abort(&self, req: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        let span = kvmesh_telemetry::span!("decode.abort", node = %self.inner.name);
        kvmesh_telemetry::propagate::continue_grpc(&span, req.metadata());
        let _entered = span.enter();
        let r = req.into_inner();
        let id = reservation_id(&r.reservation_id)?;
        kvmesh_telemetry::record(&span, "reservation.id", id.to_string());
        let reason = AbortReason(u16::try_from(r.reason).unwrap_or(AbortReason::CANCELLED.0));
        let state = self
            .inner
            .table
            .abort(id, reason)
            .map_err(|e| Status::not_found(e.to_string()))?;
        Ok(Response::new(AbortResponse {
            state: state.into(),
        }))
    }

    async fn load(&self, req: Request<LoadRequest>) -> Result<Response<LoadReport>, Status> {
        Ok(Response::new(
            self.load_report(Some(req.get_ref().known_cache_epoch)),
        ))
    }
}

#[cfg(test)]
mod tests;
