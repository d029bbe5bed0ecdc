//! kvmesh router: the OpenAI-compatible HTTP gateway and the public gRPC
//! API, tokenization and chat templates, admission control (invariant I3:
//! refuse before anything is allocated anywhere), and the mesh behind them.
//!
//! # Layout
//! - [`auth`]: API keys, each mapped to a tenant (401 before anything
//!   else when keys are configured).
//! - [`admission`]: who gets the dispatch slots: per-tenant queues served
//!   fairly (or in arrival order), per-tenant caps, a request's choices
//!   admitted together; a slot is an RAII [`admission::Permit`].
//! - [`Router`]: the shared state (tokenizer, limits, the mesh, the
//!   admission scheduler, metrics); [`Router::admit_all`], the admission
//!   decision (the only maker of [`mesh::Admitted`]); [`Router::generate`],
//!   admission then the mesh.
//! - [`validate`]: the one validation of both front ends
//!   (front-end-neutral request in, [`validate::Valid`] out).
//! - [`choices`]: several choices of one request (`n`, a batch of
//!   prompts) as one stream of indexed events; later samples of a prompt
//!   start when its first has been prefilled, so prefill's cache serves
//!   them.
//! - [`tokenize`]: tokenization as a service for both front ends, encoding
//!   exactly as a generation request is encoded.
//! - [`http`]: the axum gateway and [`http::validate`], the one entry of
//!   client request bodies: `/v1/completions`,
//!   `/v1/chat/completions` (SSE streaming or not), `/v1/models`,
//!   `/tokenize`, `/detokenize`, `/version`, `/health`, `/metrics`,
//!   `/openapi.json`; [`http::endpoints`] lists them.
//! - [`grpc`]: the public gRPC API (`kvmesh.v1.Generation`), health and
//!   reflection.
//! - [`error`]: [`error::GatewayError`], the one error type of both front
//!   ends ([`Rejection`], refused before dispatch, is its own type inside
//!   it), and its one mapping to HTTP bodies, SSE events and gRPC statuses;
//!   clients get a code and a safe message, node names and statuses go to
//!   the logs.
//! - [`mesh`]: the [`mesh::Mesh`] trait the gateway reaches the nodes
//!   through, its events, and [`mesh::Generation`] (each request's outcome
//!   counted once); `mesh::grpc` is the real one (the prefill and decode
//!   nodes, the handshake, token ids to text through
//!   `kvmesh_tokenizer::TextOut`), one request as phases (admit, reserve,
//!   prefill, relay, finish) reading one decode stream; unit tests use a
//!   scripted fake.
//! - [`tools`]: tools (`tools`, `tool_choice`), their calls read out of
//!   the text by the served model's format ([`tools::parsers`]: hermes,
//!   llama3_json, mistral), and [`tools::parse`], the one reader of a
//!   choice's text into reasoning, content and calls, streamed or whole.
//! - [`reasoning`]: reasoning formats (`<think>` blocks: deepseek_r1,
//!   qwen3), read into `reasoning_content`.
//! - [`parsing`]: which formats the router reads with
//!   (`--tool-call-parser`, `--reasoning-parser`, `auto` from the chat
//!   template), resolved once at start ([`parsing::Parsers`]).
//! - [`structured`]: structured output's request fields (`response_format`,
//!   `structured_outputs`) read into a `kvmesh_structured::Constraint`, and
//!   compiled once here so a refused schema or grammar is a 400 naming its
//!   field ([`Router::vocabulary`] is built on the first such request).
//! - [`openapi`]: the gateway's OpenAPI document, held to those routes.
//! - [`nodes`]: the nodes, their gRPC clients, load reports, health, and
//!   the choice of node per request; the members are fixed or swapped
//!   whole when a membership service (etcd) says they changed.
//! - [`membership`]: where the membership comes from and whether it is
//!   current ([`membership::Discovery`]: degraded while etcd cannot be
//!   reached), and its metrics.
//! - `metrics` (private): Prometheus text.
//!
//! - [`run`]: the gateway's lifecycle: serve both ports until shutdown,
//!   then drain (admission refuses, health says not serving, requests in
//!   flight finish or end with a terminal error at the drain deadline).
//!
//! Tokenizer, chat templates and stop strings come from `kvmesh-tokenizer`;
//! the router links no model runtime (no candle) and reads no weights.

pub mod admission;
pub mod auth;
pub mod choices;
pub mod error;
pub mod grpc;
pub mod http;
mod logprobs;
pub mod membership;
pub mod mesh;
mod metrics;
pub mod nodes;
pub mod openapi;
pub mod parsing;
pub mod reasoning;
mod run;
pub mod structured;
pub mod tokenize;
pub mod tools;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use kvmesh_faults::{planted, FaultPlan, PlantedBug};
use kvmesh_structured::{StructuredError, Vocabulary};
use kvmesh_tokenizer::TextTokenizer;
use tracing::Instrument;

use admission::{Admission, Permit};
use auth::Tenant;
pub use error::Rejection;
use error::{Count, GatewayError};
use mesh::{Admitted, Generation, Mesh};
use metrics::Metrics;
use nodes::Nodes;
use parsing::{Parsers, ReasoningParserSetting, ToolParserSetting};
pub use run::{run, Listeners};
use validate::Valid;

/// The router's settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The model id clients name.
    pub model_id: String,
    /// The model's architecture and how its weights are stored
    /// (`ModelInfo::architecture`, `ModelInfo::quantization`), shown by
    /// `/v1/models`; empty: not shown.
    pub model_description: (String, String),
    /// The context window (prompt plus completion), tokens.
    pub max_model_len: usize,
    /// Dispatch slots: choices running at once (a request holds one per
    /// choice).
    pub max_running: usize,
    /// Choices waiting for a slot at most; more get 429.
    pub max_queued: usize,
    /// How long a request may wait for its slots before it gets 429.
    pub queue_timeout: Duration,
    /// How waiting requests are ordered ([`admission::Policy`]).
    pub admission: admission::Policy,
    /// Slots only a tenant running nothing may take (fair admission);
    /// `None`: [`admission::default_reserve`] of the keys' tenants.
    pub reserve: Option<usize>,
    /// Per-tenant limits (weights, caps), by tenant.
    pub shares: admission::Shares,
    /// API keys and their tenants; empty: no authentication.
    pub api_keys: auth::ApiKeys,
    /// Honour the fault-injection header (`kvxfer::fault::HEADER`); only
    /// a testing build may set it (see `kvxfer::fault`).
    pub fault_injection: bool,
    /// How long a drain ([`run`]) lets requests in flight finish before it
    /// ends them with a terminal error.
    pub drain_timeout: Duration,
    /// Requests carry their tenant's prefix-cache namespace to the nodes
    /// (`--prefix-cache on`); off, they carry none and no node caches or
    /// reuses their pages.
    pub prefix_cache: bool,
    /// How `tool_choice: auto` reads calls (`--tool-call-parser`).
    pub tool_call_parser: ToolParserSetting,
    /// How chat answers' reasoning is read (`--reasoning-parser`).
    pub reasoning_parser: ReasoningParserSetting,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            model_id: "default".into(),
            model_description: (String::new(), String::new()),
            max_model_len: 2048,
            max_running: 64,
            max_queued: 256,
            queue_timeout: Duration::from_secs(30),
            admission: admission::Policy::Fair,
            reserve: None,
            shares: admission::Shares::default(),
            api_keys: auth::ApiKeys::default(),
            fault_injection: false,
            drain_timeout: Duration::from_secs(30),
            prefix_cache: true,
            tool_call_parser: ToolParserSetting::Auto,
            reasoning_parser: ReasoningParserSetting::Auto,
        }
    }
}

/// The router. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Router {
    cfg: Arc<RouterConfig>,
    tokenizer: Arc<TextTokenizer>,
    mesh: Arc<dyn Mesh>,
    admission: Admission,
    metrics: Arc<Metrics>,
    /// Set when a drain starts: admission refuses, health says not serving.
    draining: Arc<tokio::sync::watch::Sender<bool>>,
    /// Set at the drain deadline: requests in flight end with an error.
    cut: Arc<tokio::sync::watch::Sender<bool>>,
    /// The model's end-of-sequence ids: the grammar's end.
    eos: Arc<[u32]>,
    /// Structured output's vocabulary, built on first use.
    vocabulary: Arc<std::sync::OnceLock<Result<Vocabulary, StructuredError>>>,
    /// The tool-call and reasoning formats answers are read with.
    parsers: Arc<Parsers>,
}

impl Router {
    /// A router over the gRPC mesh of `nodes` that tokenizes with
    /// `tokenizer` and ends generation at `stop_ids`.
    pub fn new(
        cfg: RouterConfig,
        tokenizer: TextTokenizer,
        stop_ids: Vec<u32>,
        nodes: Nodes,
    ) -> Self {
        let tokenizer = Arc::new(tokenizer);
        let metrics = Arc::<Metrics>::default();
        let eos: Arc<[u32]> = stop_ids.clone().into();
        let mesh = mesh::grpc::GrpcMesh::new(
            nodes,
            Arc::clone(&tokenizer),
            stop_ids.into(),
            cfg.queue_timeout,
            Arc::clone(&metrics),
            cfg.prefix_cache,
        );
        Self::build(cfg, tokenizer, Arc::new(mesh), metrics, eos)
    }

    /// A router over any [`Mesh`] (a scripted one in tests).
    pub fn with_mesh(cfg: RouterConfig, tokenizer: TextTokenizer, mesh: Arc<dyn Mesh>) -> Self {
        let eos = tokenizer.eos_token_ids().into();
        Self::build(cfg, Arc::new(tokenizer), mesh, Arc::default(), eos)
    }

    fn build(
        cfg: RouterConfig,
        tokenizer: Arc<TextTokenizer>,
        mesh: Arc<dyn Mesh>,
        metrics: Arc<Metrics>,
        eos: Arc<[u32]>,
    ) -> Self {
        let parsers = Parsers::resolve(cfg.tool_call_parser, cfg.reasoning_parser, &tokenizer);
        tracing::info!(model = %cfg.model_id, "{}", parsers.describe());
        Self {
            parsers: Arc::new(parsers),
            admission: Admission::new(admission::Limits {
                slots: cfg.max_running.max(1),
                max_queued: cfg.max_queued,
                queue_timeout: cfg.queue_timeout,
                policy: cfg.admission,
                reserve: cfg.reserve.unwrap_or_else(|| {
                    admission::default_reserve(cfg.max_running, cfg.api_keys.tenants())
                }),
                shares: cfg.shares.clone(),
            }),
            cfg: Arc::new(cfg),
            tokenizer,
            mesh,
            metrics,
            draining: Arc::new(tokio::sync::watch::channel(false).0),
            cut: Arc::new(tokio::sync::watch::channel(false).0),
            eos,
            vocabulary: Arc::default(),
        }
    }

    /// The model's vocabulary for structured output, built once per
    /// process (a few hundred milliseconds for a large vocabulary): on a
    /// blocking thread when [`run()`] starts, else on first use.
    pub fn vocabulary(&self) -> Result<&Vocabulary, StructuredError> {
        self.vocabulary
            .get_or_init(|| {
                Vocabulary::new(&self.tokenizer, self.tokenizer.vocab_size(), &self.eos)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether a drain has started.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Dispatch slots held now (one per running choice).
    pub fn in_flight(&self) -> usize {
        self.admission.running()
    }

    /// Starts a drain: admission refuses new requests and those waiting,
    /// health says not serving ([`run`] calls this on shutdown).
    pub(crate) fn start_drain(&self) {
        self.draining.send_replace(true);
        self.admission.close();
    }

    /// The mesh.
    pub fn mesh(&self) -> &dyn Mesh {
        &*self.mesh
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The settings.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// The tool-call and reasoning formats answers are read with.
    pub fn parsers(&self) -> &Parsers {
        &self.parsers
    }

    /// Counts a failure the client is about to be told of, in the counter
    /// its kind names ([`GatewayError::count`]), and hands it back for
    /// mapping. Every front end calls this once per refused or failed
    /// request; a failure inside a [`Generation`] counts itself.
    pub fn fail(&self, e: GatewayError) -> GatewayError {
        match e.count() {
            Count::Rejected(reason) => self.metrics.rejected(reason),
            Count::Finished(outcome) => self.metrics.finished(outcome),
        }
        e
    }

    /// The Prometheus text: the gateway's counters, then the mesh's.
    pub fn metrics_text(&self) -> String {
        self.metrics.render(&*self.mesh)
    }

    /// The HTTP gateway.
    pub fn http(&self) -> axum::Router {
        http::routes(self.clone())
    }

    /// Admission (I3) of one choice: [`Router::admit_all`] of one.
    pub async fn admit(
        &self,
        valid: Valid,
        tenant: Tenant,
        faults: FaultPlan,
    ) -> Result<Admitted, Rejection> {
        let mut one = self.admit_all(vec![valid], tenant, faults).await?;
        Ok(one.remove(0))
    }

    /// Admission (I3) of a request's choices, decided here with no call
    /// to any node: each choice's prompt plus `max_tokens` against the
    /// context window, then against the largest sequence the mesh can take
    /// ([`Mesh::capacity`]: a node started with `--allow-small-pool`
    /// advertises its real pool). Then one slot per choice, all together,
    /// from the [`admission`] scheduler (at once, after the tenant's turn
    /// in the queue, or 429). The only maker of an [`Admitted`]; the
    /// choices come back in order.
    pub async fn admit_all(
        &self,
        valid: Vec<Valid>,
        tenant: Tenant,
        faults: FaultPlan,
    ) -> Result<Vec<Admitted>, Rejection> {
        let prompt_tokens: usize = valid.iter().map(|v| v.ids().len()).sum();
        let max_tokens = valid
            .iter()
            .map(|v| v.settings().max_tokens)
            .max()
            .unwrap_or(0);
        let span = kvmesh_telemetry::span!(
            "router.admit",
            prompt_tokens = prompt_tokens as u64,
            max_tokens = max_tokens as u64,
            choices = valid.len() as u64
        );
        let permits = self
            .check(&valid, &tenant, prompt_tokens)
            .instrument(span.clone())
            .await
            .inspect_err(|r| kvmesh_telemetry::fail(&span, r.reason()))?;
        Ok(valid
            .into_iter()
            .zip(permits)
            .map(|(v, p)| Admitted::new(v, tenant.clone(), faults.clone(), p))
            .collect())
    }

    /// [`Router::admit`], then the mesh: the request's events, or why it
    /// did not start. Not counted here: the caller passes an error through
    /// [`Router::fail`].
    pub async fn generate(
        &self,
        valid: Valid,
        tenant: Tenant,
        faults: FaultPlan,
    ) -> Result<Generation, GatewayError> {
        let admitted = self.admit(valid, tenant, faults).await?;
        self.run(admitted)
    }

    /// An admitted request on the mesh: its events, or why it did not
    /// start (not counted here either).
    pub fn run(&self, admitted: Admitted) -> Result<Generation, GatewayError> {
        let prompt_tokens = admitted.job().prompt_ids.len();
        let logprobs = admitted.job().sampling.logprobs.is_some();
        let rx = self.mesh.generate(admitted)?;
        Ok(Generation::new(
            rx,
            Arc::clone(&self.metrics),
            prompt_tokens,
            self.cut.subscribe(),
        )
        .with_logprobs(logprobs))
    }

    async fn check(
        &self,
        valid: &[Valid],
        tenant: &Tenant,
        prompt_tokens: usize,
    ) -> Result<Vec<Permit>, Rejection> {
        if self.is_draining() {
            return Err(Rejection::ShuttingDown);
        }
        for v in valid {
            self.fits(v.ids().len(), v.settings().max_tokens)?;
        }
        let permits = self
            .admission
            .acquire(tenant, valid.len(), prompt_tokens)
            .await?;
        // A drain closes the queue; this covers a grant that raced it.
        if self.is_draining() {
            return Err(Rejection::ShuttingDown);
        }
        Ok(permits)
    }

    /// I3 for one choice: the context window, then the nodes' capacity.
    fn fits(&self, prompt_tokens: usize, max_tokens: usize) -> Result<(), Rejection> {
        let requested = prompt_tokens.saturating_add(max_tokens);
        let too_long = |limit| Rejection::ContextLengthExceeded {
            prompt_tokens,
            max_tokens,
            requested,
            limit,
        };
        // I3, unless a test planted the bug that switches it off (then
        // the nodes' own re-checks must refuse).
        if planted(PlantedBug::NoAdmission) {
            return Ok(());
        }
        if requested > self.cfg.max_model_len {
            return Err(too_long(self.cfg.max_model_len));
        }
        let capacity = self.mesh.capacity().ok_or(Rejection::NoHealthyNode {
            role: "prefill or decode",
        })?;
        if requested > capacity {
            return Err(too_long(capacity.min(self.cfg.max_model_len)));
        }
        Ok(())
    }
}
