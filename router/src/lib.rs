//! kvmesh router: the OpenAI-compatible HTTP gateway, tokenization and chat
//! templates, admission control (invariant I3: refuse before anything is
//! allocated anywhere), and dispatch to prefill and decode nodes.
//!
//! # Layout
//! - [`auth`]: API keys, each mapped to a tenant (401 before anything
//!   else when keys are configured).
//! - [`Router`]: the shared state (tokenizer, limits, nodes, queue,
//!   metrics) and [`Router::admit`], the admission decision.
//! - [`http`]: the axum gateway and [`http::validate`], the one entry of
//!   client request bodies: `/v1/completions`,
//!   `/v1/chat/completions` (SSE streaming or not), `/v1/models`,
//!   `/health`, `/metrics`, `/openapi.json`; [`http::endpoints`] lists them.
//! - [`openapi`]: the gateway's OpenAPI document, held to those routes.
//! - [`nodes`]: the nodes, their gRPC clients, load reports, health, and
//!   the choice of node per request.
//! - [`dispatch`]: one request through the handshake, token ids to text
//!   (`kvmesh_tokenizer::TextOut`: detokenization and stop strings).
//! - [`error`]: [`Rejection`] (refused before dispatch: its own type) and
//!   [`error::DispatchError`], and their one mapping to HTTP and gRPC.
//! - [`grpc`]: the public gRPC API (`kvmesh.v1.Generation`), health and
//!   reflection.
//! - `metrics` (private): Prometheus text.
//!
//! - [`run`]: the gateway's lifecycle: serve both ports until shutdown,
//!   then drain (admission refuses, health says not serving, requests in
//!   flight finish or end with a terminal error at the drain deadline).
//!
//! Tokenizer, chat templates and stop strings come from `kvmesh-tokenizer`;
//! the router links no model runtime (no candle) and reads no weights.

pub mod auth;
pub mod dispatch;
pub mod error;
pub mod grpc;
pub mod http;
mod metrics;
pub mod nodes;
pub mod openapi;
mod run;
pub mod validate;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_faults::{planted, PlantedBug};
use kvmesh_tokenizer::TextTokenizer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use error::Rejection;
use metrics::Metrics;
use nodes::Nodes;
pub use run::{run, Listeners};

/// The router's settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The model id clients name.
    pub model_id: String,
    /// The context window (prompt plus completion), tokens.
    pub max_model_len: usize,
    /// Requests dispatched at once.
    pub max_running: usize,
    /// Requests waiting for a slot at most; more get 429.
    pub max_queued: usize,
    /// How long a request may wait for a slot before it gets 429.
    pub queue_timeout: Duration,
    /// API keys and their tenants; empty: no authentication.
    pub api_keys: auth::ApiKeys,
    /// Honour the fault-injection header (`kvxfer::fault::HEADER`); only
    /// a testing build may set it (see `kvxfer::fault`).
    pub fault_injection: bool,
    /// How long a drain ([`run`]) lets requests in flight finish before it
    /// ends them with a terminal error.
    pub drain_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            model_id: "default".into(),
            max_model_len: 2048,
            max_running: 64,
            max_queued: 256,
            queue_timeout: Duration::from_secs(30),
            api_keys: auth::ApiKeys::default(),
            fault_injection: false,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// The router. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Router {
    cfg: Arc<RouterConfig>,
    tokenizer: Arc<TextTokenizer>,
    stop_ids: Arc<[u32]>,
    nodes: Nodes,
    slots: Arc<Semaphore>,
    queued: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    /// Set when a drain starts: admission refuses, health says not serving.
    draining: Arc<tokio::sync::watch::Sender<bool>>,
    /// Set at the drain deadline: requests in flight end with an error.
    cut: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Router {
    /// A router over `nodes` that tokenizes with `tokenizer` and ends
    /// generation at `stop_ids`.
    pub fn new(
        cfg: RouterConfig,
        tokenizer: TextTokenizer,
        stop_ids: Vec<u32>,
        nodes: Nodes,
    ) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(cfg.max_running.max(1))),
            cfg: Arc::new(cfg),
            tokenizer: Arc::new(tokenizer),
            stop_ids: stop_ids.into(),
            nodes,
            queued: Arc::default(),
            metrics: Arc::default(),
            draining: Arc::new(tokio::sync::watch::channel(false).0),
            cut: Arc::new(tokio::sync::watch::channel(false).0),
        }
    }

    /// Whether a drain has started.
    pub fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Requests holding a dispatch slot now.
    pub fn in_flight(&self) -> usize {
        self.cfg
            .max_running
            .max(1)
            .saturating_sub(self.slots.available_permits())
    }

    /// The nodes.
    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The settings.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Counts a refusal made before admission (parse and validation:
    /// [`validate::request`]), whichever front end made it; admission
    /// counts its own ([`Router::admit`]).
    pub fn refused(&self, e: &Rejection) {
        if !matches!(
            e,
            Rejection::ContextLengthExceeded { .. }
                | Rejection::Saturated { .. }
                | Rejection::NoHealthyNode { .. }
        ) {
            self.metrics.rejected(e.reason());
        }
    }

    /// The HTTP gateway.
    pub fn http(&self) -> axum::Router {
        http::routes(self.clone())
    }

    /// Admission (I3), decided here with no call to any node: prompt plus
    /// `max_tokens` against the context window, then against the largest
    /// sequence the healthy nodes advertise (a node started with
    /// `--allow-small-pool` advertises its real pool). Then a slot in the
    /// bounded queue, or 429.
    pub async fn admit(
        &self,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<OwnedSemaphorePermit, Rejection> {
        let r = self.check(prompt_tokens, max_tokens).await;
        if let Err(e) = &r {
            self.metrics.rejected(e.reason());
        }
        r
    }

    async fn check(
        &self,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<OwnedSemaphorePermit, Rejection> {
        if self.is_draining() {
            return Err(Rejection::ShuttingDown);
        }
        let requested = prompt_tokens.saturating_add(max_tokens);
        let too_long = |limit| Rejection::ContextLengthExceeded {
            prompt_tokens,
            max_tokens,
            requested,
            limit,
        };
        // I3, unless a test planted the bug that switches it off (then
        // the nodes' own re-checks must refuse).
        if !planted(PlantedBug::NoAdmission) {
            if requested > self.cfg.max_model_len {
                return Err(too_long(self.cfg.max_model_len));
            }
            let capacity = self.nodes.capacity().ok_or(Rejection::NoHealthyNode {
                role: "prefill or decode",
            })?;
            if requested > capacity {
                return Err(too_long(capacity.min(self.cfg.max_model_len)));
            }
        }
        if let Ok(p) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(p);
        }
        let queued = self.queued.fetch_add(1, Ordering::AcqRel) + 1;
        let _leave = Leave(&self.queued);
        if queued > self.cfg.max_queued {
            return Err(Rejection::Saturated { queued: queued - 1 });
        }
        match tokio::time::timeout(
            self.cfg.queue_timeout,
            Arc::clone(&self.slots).acquire_owned(),
        )
        .await
        {
            // A drain that began while this request queued refuses it.
            Ok(Ok(_)) if self.is_draining() => Err(Rejection::ShuttingDown),
            Ok(Ok(p)) => Ok(p),
            _ => Err(Rejection::Saturated { queued }),
        }
    }
}

struct Leave<'a>(&'a AtomicUsize);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
