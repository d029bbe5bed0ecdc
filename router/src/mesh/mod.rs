//! How the gateway reaches the mesh: the [`Mesh`] trait, what it takes
//! ([`Admitted`], which only [`crate::Router::admit_all`] makes) and what it
//! streams back ([`Event`]), and the gateway's reading of that stream
//! ([`Generation`], which counts every request's outcome exactly once).
//!
//! The real mesh is `grpc::GrpcMesh`: the prefill and decode nodes over
//! gRPC and the KV handshake. Tests put a scripted mesh behind the same
//! trait (`fake::FakeMesh`), so validation, admission, SSE framing, error
//! bodies and metrics are exercised without any node.

pub(crate) mod grpc;

#[cfg(test)]
pub(crate) mod fake;

use std::fmt;
use std::sync::Arc;

use kvmesh_faults::FaultPlan;
use kvmesh_proto::internal::v1::Sampling;
use tokio::sync::{mpsc, watch};

use crate::admission::Permit;
use crate::auth::Tenant;
use crate::error::{DispatchError, Rejection};
use crate::membership::Discovery;
use crate::metrics::Metrics;
use crate::validate::Valid;

/// The mesh behind the gateway.
///
/// Contract of [`Mesh::generate`]: it either refuses at once, with nothing
/// allocated anywhere (a [`Rejection`], I3), or returns a stream on which
/// every later failure arrives as one [`Event::Error`]; the stream ends
/// with exactly one terminal event ([`Event::Done`] or [`Event::Error`]).
/// The mesh holds the request's [`Slot`] until its work for the request
/// has ended, and when the receiver is dropped (the client is gone) it
/// stops that work and releases what it holds.
pub trait Mesh: Send + Sync + fmt::Debug + 'static {
    /// The longest sequence (prompt plus completion, tokens) that every
    /// role can take now; `None` while a role has no healthy node.
    fn capacity(&self) -> Option<usize>;

    /// Starts one admitted request.
    fn generate(&self, req: Admitted) -> Result<mpsc::Receiver<Event>, Rejection>;

    /// Appends the mesh's own Prometheus series (per-node figures) to the
    /// gateway's.
    fn render_metrics(&self, out: &mut String);

    /// Where the mesh's membership comes from and whether it is current,
    /// as a receiver that hears each change (health reports a degraded
    /// membership). Default: a fixed membership.
    fn discovery(&self) -> watch::Receiver<Discovery> {
        watch::channel(Discovery::Static).1
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// The budget.
    Length,
}

impl Finish {
    /// The OpenAI name (also the metric label of the outcome).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// A generated token's logprob and its most likely alternatives', as
/// the sampler saw them (`kvmesh_model::sampling`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub id: u32,
    /// Its logprob.
    pub logprob: f32,
    /// The alternatives, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A prompt token and, for every token but the first, its score under the
/// model given the tokens before it (computed by prefill).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptToken {
    /// The token.
    pub id: u32,
    /// `None` for the first prompt token, which nothing precedes.
    pub score: Option<PromptScore>,
}

/// A prompt token's raw log-probability, rank and the most likely
/// alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptScore {
    /// Its logprob.
    pub logprob: f32,
    /// 1 + the tokens with a larger logit.
    pub rank: u32,
    /// The alternatives, most likely first (ranks 1, 2, ...).
    pub top: Vec<(u32, f32)>,
}

/// What the mesh streams to the gateway.
#[derive(Debug)]
pub enum Event {
    /// The prompt's tokens and scores, when the request asked for them
    /// ([`Job::prompt_logprobs`]): before any other event.
    Prompt(Vec<PromptToken>),
    /// New text (whole UTF-8 characters, possibly none) and, when the
    /// request asked for logprobs, those of the tokens generated since the
    /// last event, in order (a token whose text is held back, by an
    /// incomplete character or a possible stop string, comes with its own
    /// event all the same).
    Text {
        /// The text.
        text: String,
        /// The tokens' logprobs.
        logprobs: Vec<TokenLogprob>,
    },
    /// The end.
    Done {
        /// Why.
        finish: Finish,
        /// Tokens generated.
        completion_tokens: usize,
        /// Prompt tokens that came from the prefix cache (not computed).
        cached_tokens: usize,
    },
    /// A failure after dispatch: the end.
    Error(DispatchError),
}

/// An admitted request, as the mesh needs it.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt token ids (at least one).
    pub prompt_ids: Vec<u32>,
    /// Completion budget, at least 1.
    pub max_tokens: usize,
    /// Sampling, as validated (the nodes get it as it is).
    pub sampling: Sampling,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Special tokens the decoded text keeps (the markers the request's
    /// parsers read); every other special token is skipped.
    pub keep_special: Vec<u32>,
    /// Token ids that end generation besides end-of-sequence.
    pub stop_token_ids: Vec<u32>,
    /// End-of-sequence tokens do not end generation: the decode node gets
    /// only `stop_token_ids`, so it runs to `max_tokens` (or a stop).
    pub ignore_eos: bool,
    /// The tenant, from the request's API key only (I8).
    pub tenant: Tenant,
    /// The client's `cache_salt`: narrows the tenant's prefix-cache
    /// namespace (the mesh derives the namespace from `tenant` first).
    pub cache_salt: Option<String>,
    /// Injected faults (testing builds; see `kvmesh_faults`).
    pub faults: FaultPlan,
    /// Shared by the samples of one prompt ([`crate::choices`]): where the
    /// first ran, which the later ones prefer.
    pub placement: Option<Arc<Placement>>,
    /// Score the prompt with this many alternatives per position: the
    /// stream opens with [`Event::Prompt`]. Prefill then computes every
    /// position (no prefix-cache lookup for the prompt).
    pub prompt_logprobs: Option<u32>,
    /// The span its mesh work is a child of: the gateway's request span
    /// current at admission (a later sample starts outside it); none with
    /// tracing off.
    pub trace: tracing::Span,
}

/// Where the first sample of a prompt ran (its prefill and decode nodes,
/// by name), recorded once it holds a grant. The prompt's later samples
/// prefer those nodes: their prefix caches hold the prompt's pages (decode
/// shares them as soon as they arrive) before the nodes' load reports can
/// say so, and there the samples fork from one transfer.
#[derive(Debug, Default)]
pub struct Placement {
    nodes: std::sync::OnceLock<(String, String)>,
}

impl Placement {
    /// Records the first placement; later ones change nothing.
    pub fn set(&self, prefill: &str, decode: &str) {
        let _ = self.nodes.set((prefill.to_owned(), decode.to_owned()));
    }

    /// The (prefill, decode) node names, once recorded.
    pub fn get(&self) -> Option<(&str, &str)> {
        self.nodes.get().map(|(p, d)| (p.as_str(), d.as_str()))
    }
}

/// One of the router's `max_running` dispatch slots, of the request's
/// tenant. Whoever runs the request holds it until the request's work has
/// ended; dropping it lets the next queued request in (the next tenant's,
/// under fair admission: [`crate::admission`]).
#[derive(Debug)]
pub struct Slot {
    _permit: Permit,
}

/// A request that passed validation and admission (I3) and holds a
/// [`Slot`]. Only [`crate::Router::admit_all`] makes one, so nothing reaches
/// [`Mesh::generate`] unchecked.
#[derive(Debug)]
pub struct Admitted {
    job: Job,
    slot: Slot,
}

impl Admitted {
    pub(crate) fn new(valid: Valid, tenant: Tenant, faults: FaultPlan, permit: Permit) -> Self {
        let (prompt_ids, s) = valid.into_parts();
        Self {
            job: Job {
                prompt_ids,
                max_tokens: s.max_tokens,
                sampling: s.sampling,
                stop: s.stop,
                keep_special: s.keep_special,
                stop_token_ids: s.stop_token_ids,
                ignore_eos: s.ignore_eos,
                tenant,
                cache_salt: s.cache_salt,
                faults,
                placement: None,
                prompt_logprobs: s.prompt_logprobs,
                trace: kvmesh_telemetry::current(),
            },
            slot: Slot { _permit: permit },
        }
    }

    /// The request.
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Makes this request one of the samples that share `placement`.
    pub fn share_placement(&mut self, placement: Arc<Placement>) {
        self.job.placement = Some(placement);
    }

    /// The request and its slot, for the mesh to run.
    pub fn into_parts(self) -> (Job, Slot) {
        (self.job, self.slot)
    }
}

/// One request's events as the front ends read them. It records the
/// request's outcome exactly once (`kvmesh_requests_total{outcome}`):
/// the finish reason or the error kind at the terminal event, or
/// `client_gone` when dropped before it. A stream that closes without a
/// terminal event yields [`DispatchError::Unfinished`].
#[derive(Debug)]
pub struct Generation {
    rx: mpsc::Receiver<Event>,
    metrics: Arc<Metrics>,
    prompt_tokens: usize,
    /// The request asked for logprobs.
    logprobs: bool,
    ended: bool,
    /// Set at the gateway's drain deadline: the request ends with
    /// [`DispatchError::ShuttingDown`] and the receiver is dropped, which
    /// tells the mesh to stop and release what it holds.
    cut: watch::Receiver<bool>,
}

impl Generation {
    pub(crate) fn new(
        rx: mpsc::Receiver<Event>,
        metrics: Arc<Metrics>,
        prompt_tokens: usize,
        cut: watch::Receiver<bool>,
    ) -> Self {
        Self {
            rx,
            metrics,
            prompt_tokens,
            logprobs: false,
            ended: false,
            cut,
        }
    }

    /// Marks a request that asked for logprobs (its text events carry them).
    pub(crate) fn with_logprobs(mut self, on: bool) -> Self {
        self.logprobs = on;
        self
    }

    /// Whether the request asked for logprobs.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs
    }

    /// The prompt's token count (for usage).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The next event; `None` after the terminal one. Cancel-safe (the
    /// SSE writer races it against the client's departure).
    pub async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let ev = tokio::select! {
            ev = self.rx.recv() => ev.unwrap_or(Event::Error(DispatchError::Unfinished)),
            () = cut_set(&mut self.cut) => {
                // Nothing more is read: dropping the receiver stops the mesh.
                self.rx.close();
                Event::Error(DispatchError::ShuttingDown)
            }
        };
        match &ev {
            Event::Text { .. } | Event::Prompt(_) => {}
            Event::Done { finish, .. } => self.end(finish.as_str()),
            Event::Error(e) => self.end(e.kind()),
        }
        Some(ev)
    }

    fn end(&mut self, outcome: &'static str) {
        self.ended = true;
        self.metrics.finished(outcome);
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.ended {
            self.metrics.finished("client_gone");
        }
    }
}

/// Resolves once `flag` is set (the drain deadline's cut), or at once if
/// its sender is gone. (The nodes' drain has the same helper in
/// `kvmesh_node::serve`, which the router does not link: that crate links
/// the model runtime.)
async fn cut_set(flag: &mut watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}
