//! The real [`Mesh`]: one request through the prefill and decode nodes
//! over gRPC, as five phases, each its own function:
//!
//! 1. **admit** ([`GrpcMesh::generate`]): choose the prefill node, or
//!    refuse with nothing allocated.
//! 2. **reserve** (`reserve`): choose a decode node and open its Generate
//!    stream; its first event is the grant or a typed refusal (a full pool
//!    is waited out, a draining node is left for another).
//! 3. **prefill** (`prefill`): hand the grant to the prefill node, which
//!    computes the prompt and writes its KV into the granted pages, then
//!    sends transfer-done with the first token and its report (logprobs,
//!    prompt scores, its cached count) over the KV transport.
//! 4. **relay** (`relay`): read the decode stream, the one stream the
//!    answer comes from: `prefilled` (prefill's report, relayed once the
//!    transfer is verified), then tokens (the first one prefill's, with its
//!    logprobs), turned into text (incremental detokenization, stop
//!    strings) for the gateway. Prefill's reply only says whether its call
//!    failed, which matters until `prefilled`.
//! 5. **finish**: the terminal event.
//!
//! Every way out of a request drops the decode stream, which aborts the
//! reservation at decode through the confirmation path, and the prefill
//! call's `AbortOnDrop` guard, which tells prefill to stop unless its work
//! is over: no path sends an abort by hand.
//!
//! Failures keep the node's name and status in [`DispatchError`]; they
//! reach the logs when `crate::error` maps them, never a client. A node
//! that breaks the stream's contract is a [`ProtocolViolation`], mapped
//! into a [`DispatchError`] in one place.

mod prefill;
mod relay;
mod reserve;
mod violation;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_faults::{FaultPlan, PlantedBug};
use kvmesh_proto::internal::v1::LoadReport;
use kvmesh_tokenizer::TextTokenizer;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{Admitted, Event, Finish, Job, Mesh};
use crate::error::{DispatchError, Rejection};
use crate::metrics::Metrics;
use crate::nodes::{Node, Nodes, Prefix, Role};
use kvmesh_prefix::Namespace;
pub(crate) use violation::ProtocolViolation;

/// The prefill and decode nodes behind the gateway. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct GrpcMesh {
    nodes: Nodes,
    tokenizer: Arc<TextTokenizer>,
    stop_ids: Arc<[u32]>,
    /// How long a request waits for decode pages (a full pool is
    /// transient) before the refusal reaches the client.
    queue_timeout: Duration,
    /// TTFT and inter-token latency are measured here, at the tokens.
    metrics: Arc<Metrics>,
    /// Requests carry their namespace to the nodes' prefix caches.
    prefix_cache: bool,
}

impl GrpcMesh {
    /// `nodes`, detokenizing with `tokenizer`, ending generation at
    /// `stop_ids` (unless a request ignores end-of-sequence).
    pub(crate) fn new(
        nodes: Nodes,
        tokenizer: Arc<TextTokenizer>,
        stop_ids: Arc<[u32]>,
        queue_timeout: Duration,
        metrics: Arc<Metrics>,
        prefix_cache: bool,
    ) -> Self {
        Self {
            nodes,
            tokenizer,
            stop_ids,
            queue_timeout,
            metrics,
            prefix_cache,
        }
    }
}

impl Mesh for GrpcMesh {
    fn capacity(&self) -> Option<usize> {
        self.nodes.capacity()
    }

    /// Refused before anything is allocated when no node can take it.
    fn generate(&self, req: Admitted) -> Result<mpsc::Receiver<Event>, Rejection> {
        let (job, slot) = req.into_parts();
        let total = job.prompt_ids.len() + job.max_tokens;
        let span = kvmesh_telemetry::span!(
            parent: &job.trace,
            "router.dispatch",
            prompt_tokens = job.prompt_ids.len() as u64,
            max_tokens = job.max_tokens as u64
        );
        let ns = self.namespace(&job);
        let prefix = ns.as_ref().map(|ns| Prefix {
            ns,
            prompt: &job.prompt_ids,
        });
        let choice = kvmesh_telemetry::span!(parent: &span, "router.node_choice", role = "prefill");
        let picked = choice.in_scope(|| {
            // Fail fast with no node; the node itself is chosen again per
            // try, among those computing like the prefill node.
            let decodes = self.nodes.numerics(Role::Decode, needed(total));
            if decodes.is_empty() {
                return Err(Rejection::NoHealthyNode { role: "decode" });
            }
            let near = job.placement.as_ref().and_then(|p| p.get());
            // A prompt to be scored is computed whole (prefill skips its cache
            // for it), so where its pages are cached does not matter: the
            // prefill node is chosen by load alone (or the first sample's).
            let prefill_prefix = prefix.as_ref().filter(|_| job.prompt_logprobs.is_none());
            self.nodes.pick_near(
                Role::Prefill,
                needed(job.prompt_ids.len()),
                prefill_prefix,
                near.map(|(prefill, _)| prefill),
                Some(&decodes),
            )
        });
        let (prefill, p_report) = match picked {
            Ok(p) => p,
            Err(e) => {
                kvmesh_telemetry::fail(&choice, e.reason());
                kvmesh_telemetry::fail(&span, e.reason());
                return Err(e);
            }
        };
        kvmesh_telemetry::record(&choice, "node", prefill.name.clone());
        kvmesh_telemetry::record(&span, "prefill.node", prefill.name.clone());
        drop(choice);
        let busy = prefill.busy();
        let (tx, rx) = mpsc::channel(64);
        let mesh = self.clone();
        tokio::spawn(
            async move {
                let _slot = slot;
                let _busy = busy;
                let route = Route::new(&mesh, &job, ns, &prefill, &p_report, &tx);
                route.run().await;
            }
            .instrument(span),
        );
        Ok(rx)
    }

    fn render_metrics(&self, out: &mut String) {
        crate::metrics::render_nodes(&self.nodes, out);
        crate::membership::render(&self.nodes, out);
    }

    fn discovery(&self) -> tokio::sync::watch::Receiver<crate::membership::Discovery> {
        self.nodes.discovery_changes()
    }
}

/// `msg` as a gRPC request carrying `faults` in its metadata.
fn with_faults<T>(msg: T, faults: &FaultPlan) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if !faults.is_empty() {
        if let Ok(v) = faults.to_string().parse() {
            req.metadata_mut().insert(kvmesh_faults::HEADER, v);
        }
    }
    req
}

impl GrpcMesh {
    /// The request's namespace, `None` with the prefix cache off. Rule 1
    /// of design/prefix-cache.md: it comes from the authenticated tenant,
    /// narrowed by the client's salt, derived here and nowhere downstream.
    fn namespace(&self, job: &Job) -> Option<Namespace> {
        self.prefix_cache.then(|| {
            self.nodes
                .cache_keys()
                .namespace(&job.tenant.0, job.cache_salt.as_deref())
        })
    }
}

/// Capacity the node must have: none asked when a test planted the bug
/// that switches admission off (the nodes' re-checks must then refuse).
fn needed(tokens: usize) -> Option<usize> {
    (!kvmesh_faults::planted(PlantedBug::NoAdmission)).then_some(tokens)
}

/// One request's way through the mesh, and what its phases share. Built
/// once admitted (the prefill node chosen); [`Route::run`] takes it to its
/// end.
struct Route<'a> {
    mesh: &'a GrpcMesh,
    job: &'a Job,
    /// Its prefix-cache namespace; `None` with the cache off.
    ns: Option<Namespace>,
    prefill: &'a Arc<Node>,
    /// The prefill node's report when it was chosen: the writer id the
    /// grant is bound to, the numerics the decode node must share.
    p_report: &'a LoadReport,
    /// The ids that end generation at the nodes: the request's own, and
    /// end-of-sequence unless it is ignored.
    stop_token_ids: Vec<u32>,
    tx: &'a mpsc::Sender<Event>,
    started: Instant,
    /// The dispatch span's outcome.
    outcome: Outcome,
}

/// Why a request stops before its end.
enum Stop {
    /// The client left: nothing more is sent (the gateway counts it).
    ClientGone,
    /// A failure: the request's terminal event.
    Failed(DispatchError),
}

impl From<DispatchError> for Stop {
    fn from(e: DispatchError) -> Self {
        Self::Failed(e)
    }
}

impl<'a> Route<'a> {
    fn new(
        mesh: &'a GrpcMesh,
        job: &'a Job,
        ns: Option<Namespace>,
        prefill: &'a Arc<Node>,
        p_report: &'a LoadReport,
        tx: &'a mpsc::Sender<Event>,
    ) -> Self {
        let mut stop_token_ids = job.stop_token_ids.clone();
        if !job.ignore_eos {
            stop_token_ids.extend(
                mesh.stop_ids
                    .iter()
                    .filter(|id| !job.stop_token_ids.contains(id)),
            );
        }
        Self {
            mesh,
            job,
            ns,
            prefill,
            p_report,
            stop_token_ids,
            tx,
            started: Instant::now(),
            outcome: Outcome::new(kvmesh_telemetry::current()),
        }
    }

    /// Runs the request to its end: every failure is sent as the terminal
    /// [`Event::Error`], and a client that leaves ends it silently.
    async fn run(&self) {
        match self.phases().await {
            Ok(()) | Err(Stop::ClientGone) => {}
            Err(Stop::Failed(e)) => {
                self.outcome.fail(e.kind());
                let _ = self.tx.send(Event::Error(e)).await;
            }
        }
    }

    /// Reserve, prefill, relay, finish. The decode node's in-flight count
    /// and an injected duplicate's unread stream live to the end.
    async fn phases(&self) -> Result<(), Stop> {
        let reserve::Reserved {
            decode,
            stream,
            grant,
            busy: _busy,
            lost: _lost,
        } = self.reserve().await?;
        self.placed(&decode, &grant.reservation_id);
        let prefilling = self.prefill(grant).await;
        let end = self.relay(&decode, stream, prefilling).await?;
        self.finish(end).await;
        Ok(())
    }

    /// Records where the request runs: on the dispatch span, and for the
    /// prompt's later samples.
    fn placed(&self, decode: &Node, reservation_id: &[u8]) {
        let span = &self.outcome.span;
        if !span.is_disabled() {
            kvmesh_telemetry::record(span, "decode.node", decode.name.clone());
            kvmesh_telemetry::record(span, "reservation.id", reservation(reservation_id));
        }
        if let Some(p) = &self.job.placement {
            p.set(&self.prefill.name, &decode.name);
        }
    }

    /// The request's prefix, for cache-aware choices.
    fn prefix(&self) -> Option<Prefix<'_>> {
        self.ns.as_ref().map(|ns| Prefix {
            ns,
            prompt: &self.job.prompt_ids,
        })
    }

    /// The namespace as the nodes get it (empty: no cache).
    fn cache_namespace(&self) -> Vec<u8> {
        self.ns.map(|ns| ns.as_bytes().to_vec()).unwrap_or_default()
    }

    /// Sends an event; the client is gone when it cannot be.
    async fn send(&self, ev: Event) -> Result<(), Stop> {
        self.tx.send(ev).await.map_err(|_| Stop::ClientGone)
    }

    /// The one mapping of a node's protocol violation: the node whose
    /// contract it broke failed the request.
    fn violation(&self, v: ProtocolViolation, decode: &Node) -> Stop {
        let node = match v.role() {
            Role::Prefill => &self.prefill.name,
            Role::Decode => &decode.name,
        };
        v.into_dispatch(node).into()
    }
}

/// A node's failure as the request's: a node that is unreachable, timed
/// out or did not prove itself is taken out of the choice until its next
/// good poll.
fn node_err(role: Role, node: &Node, status: tonic::Status) -> DispatchError {
    if matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
    ) || kvmesh_meshauth::grpc::is_unproven(&status)
    {
        node.mark_down();
    }
    DispatchError::Node {
        role,
        node: node.name.clone(),
        status,
    }
}

/// A reservation id (16 bytes on the wire) as its hex form, the one
/// attribute that names it in traces and logs; `invalid` for anything else.
fn reservation(bytes: &[u8]) -> String {
    <[u8; 16]>::try_from(bytes)
        .ok()
        .and_then(kvmesh_kvwire::ReservationId::from_bytes)
        .map_or_else(|| "invalid".to_owned(), |id| id.to_string())
}

/// The outcome attribute of a request's dispatch span: a finish reason or
/// an error kind, or `client_gone` if the request ends with neither (the
/// gateway dropped it: its client left).
struct Outcome {
    span: tracing::Span,
    set: std::sync::atomic::AtomicBool,
}

impl Outcome {
    fn new(span: tracing::Span) -> Self {
        Self {
            span,
            set: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn finish(&self, finish: Finish, completion_tokens: usize) {
        self.set.store(true, std::sync::atomic::Ordering::Relaxed);
        kvmesh_telemetry::record(&self.span, "outcome", finish.as_str());
        kvmesh_telemetry::record(&self.span, "completion_tokens", completion_tokens as i64);
    }

    fn fail(&self, kind: &'static str) {
        self.set.store(true, std::sync::atomic::Ordering::Relaxed);
        kvmesh_telemetry::record(&self.span, "outcome", kind);
        kvmesh_telemetry::fail(&self.span, kind);
    }
}

impl Drop for Outcome {
    fn drop(&mut self) {
        if !self.set.load(std::sync::atomic::Ordering::Relaxed) {
            kvmesh_telemetry::record(&self.span, "outcome", "client_gone");
        }
    }
}
