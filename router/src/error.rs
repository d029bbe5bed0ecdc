//! The gateway's one error type, [`GatewayError`], and the one place it
//! maps to what a client sees: the HTTP status and OpenAI-style body
//! (`IntoResponse`), the SSE error event ([`GatewayError::sse_event`]) and
//! the public gRPC status ([`GatewayError::grpc`]). Front ends never build
//! an error body, event or status of their own.
//!
//! Invariants:
//! - A client gets a stable [`GatewayError::code`] (the body's `code`, the
//!   SSE event's `code`, the gRPC status's `kvmesh-error-code` metadata and
//!   the stream's `error_code`) and a safe [`GatewayError::message`]: never
//!   a node's name or address, never a node's gRPC status or its words.
//!   Those reach the logs only, once per failure, when it is mapped
//!   (`GatewayError::log`).
//! - A [`Rejection`] is a refusal before anything was dispatched (I3), a
//!   value of its own type; a [`DispatchError`] is a failure after
//!   dispatch began. Each kind is also its metric label
//!   ([`GatewayError::kind`]).
//! - The status (HTTP), the OpenAI `type` and the gRPC code are derived
//!   from one table ([`GatewayError::status`]), so the three cannot
//!   disagree.

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use kvmesh_proto::internal::v1::RefuseKind;
use serde_json::json;
use thiserror::Error;

use crate::auth::AuthError;
use crate::nodes::Role;

/// The gRPC metadata key that carries [`GatewayError::code`].
pub const GRPC_CODE_KEY: &str = "kvmesh-error-code";

/// A request the router refused before dispatching anything (I3): a
/// terminal value, never a flag on a request that keeps moving. Its
/// message is the client's to read (it names the client's own field and
/// values, never a node).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Rejection {
    /// Prompt plus `max_tokens` over the context window or over what every
    /// node can hold.
    #[error(
        "This model's maximum context length is {limit} tokens. However, you requested {requested} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )]
    ContextLengthExceeded {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Requested completion tokens.
        max_tokens: usize,
        /// Their sum.
        requested: usize,
        /// The smaller of the context window and the nodes' capacity.
        limit: usize,
    },
    /// A malformed or out-of-range request field.
    #[error("{message}")]
    Invalid {
        /// The field.
        param: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The bounded queue is full.
    #[error("the server is saturated: {queued} requests are queued; retry later")]
    Saturated {
        /// Requests waiting.
        queued: usize,
    },
    /// The tenant's share of the gateway is full (a limit of its API key,
    /// or its fair share of a full queue): other tenants may still be
    /// served.
    #[error("{}", .0.message())]
    TenantShareExceeded(ShareLimit),
    /// No prefill or no decode node is healthy.
    #[error("no healthy {role} node")]
    NoHealthyNode {
        /// Which role is missing ("prefill", "decode", "prefill or decode").
        role: &'static str,
    },
    /// Healthy nodes of `role` exist, but none computes with the CPU
    /// numerics of a node of the other role (the mesh mixes portable and
    /// x86 kernel paths): pairing them would decode over KV that decode
    /// would not have computed itself.
    #[error(
        "no healthy {role} node computes with the same CPU kernels as the other role's nodes; the mesh's operator must give every node the same cpu_kernels and activations"
    )]
    MixedCpuKernels {
        /// The role that had no matching node.
        role: &'static str,
        /// The numerics the other role's nodes have.
        wanted: String,
        /// The healthy nodes of `role` left out, with path and numerics
        /// (for the router's log: clients see neither node names nor
        /// paths).
        found: String,
    },
    /// The model named is not served.
    #[error("the model {0:?} does not exist")]
    UnknownModel(String),
    /// The gateway is draining: it finishes what it holds, takes nothing new.
    #[error("the server is shutting down; retry on another replica")]
    ShuttingDown,
}

impl Rejection {
    /// The metric label (`kvmesh_requests_rejected_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ContextLengthExceeded { .. } => "context_length_exceeded",
            Self::Invalid { .. } => "invalid_request",
            Self::Saturated { .. } => "saturated",
            Self::TenantShareExceeded(_) => "tenant_share_exceeded",
            Self::NoHealthyNode { .. } => "no_healthy_node",
            Self::MixedCpuKernels { .. } => "mixed_cpu_kernels",
            Self::UnknownModel(_) => "model_not_found",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

/// Which of a tenant's bounds refused a request
/// ([`Rejection::TenantShareExceeded`]). The message names the client's
/// own limit, never another tenant or how many there are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShareLimit {
    /// The tenant's waiting requests would hold more prompt tokens than
    /// its API key's `max_queued_tokens`.
    QueuedTokens {
        /// The cap.
        cap: usize,
    },
    /// The queue is full and the tenant holds its share of it while other
    /// tenants wait.
    Queue,
}

impl ShareLimit {
    fn message(self) -> String {
        match self {
            Self::QueuedTokens { cap } => format!(
                "this API key's waiting requests would hold more than its limit of {cap} queued prompt tokens; retry later"
            ),
            Self::Queue => "the server's queue is full and this API key holds its share of it; retry later".into(),
        }
    }
}

/// A request that was dispatched and then failed. The node's name and
/// words are kept for the logs; no client sees them (see the module
/// invariants).
#[derive(Debug, Error)]
pub enum DispatchError {
    /// A node failed the request.
    #[error("{} node {node}: {status}", role.as_str())]
    Node {
        /// Which role.
        role: Role,
        /// The node's name.
        node: String,
        /// What it said.
        status: tonic::Status,
    },
    /// The decode node refused to reserve (nothing was allocated).
    #[error("decode node {node}: refused ({}): {message}", refuse_label(*kind))]
    Refused {
        /// The node's name.
        node: String,
        /// Why, as the node typed it.
        kind: RefuseKind,
        /// The node's words (for the logs: they may name limits and nodes).
        message: String,
    },
    /// The detokenizer failed on an id the node produced.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Every node of a role went away after dispatch began; nothing is
    /// held (the request's own reservation, if any, is dropped).
    #[error("no healthy {} node", role.as_str())]
    NoHealthyNode {
        /// The role.
        role: Role,
    },
    /// The mesh's event stream ended without a result.
    #[error("the event stream ended without a result")]
    Unfinished,
    /// An injected fault ended the request (testing builds only).
    #[error("injected fault: {0}")]
    Injected(&'static str),
    /// The gateway's drain deadline passed with the request in flight.
    #[error("the server is shutting down: generation stopped at the drain deadline")]
    ShuttingDown,
}

impl DispatchError {
    /// The metric label (`kvmesh_requests_total{outcome}`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Node {
                role: Role::Prefill,
                ..
            } => "prefill_failed",
            Self::Node {
                role: Role::Decode, ..
            } => "decode_failed",
            Self::Refused { .. } => "decode_refused",
            Self::Tokenizer(_) => "tokenizer",
            Self::NoHealthyNode { .. } => "no_healthy_node",
            Self::Unfinished => "internal",
            Self::Injected(_) => "injected_fault",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

/// Every way a request can fail at the gateway, and nothing else: the one
/// error type the front ends map (HTTP, SSE, gRPC), here only.
#[derive(Debug, Error)]
pub enum GatewayError {
    /// Refused before dispatch (I3).
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Failed after dispatch began.
    #[error(transparent)]
    Dispatch(#[from] DispatchError),
    /// No known API key.
    #[error("{}", .0.message())]
    Auth(AuthError),
    /// The body could not be read (over the size limit: 413; a broken
    /// stream: 400), before it was parsed.
    #[error("{message}")]
    Body {
        /// 413 or 400.
        status: StatusCode,
        /// axum's description (no internals: it names the limit only).
        message: String,
    },
    /// A malformed fault-injection header (testing builds started with
    /// `--fault-injection` only).
    #[error("{header}: {0}", header = kvmesh_faults::HEADER)]
    FaultSpec(kvmesh_faults::FaultSpecError),
    /// The gateway itself failed before dispatch (the OS random number
    /// generator could not mint a request id).
    #[error("{0}")]
    Internal(&'static str),
}

impl From<AuthError> for GatewayError {
    fn from(e: AuthError) -> Self {
        Self::Auth(e)
    }
}

impl From<axum::extract::rejection::BytesRejection> for GatewayError {
    fn from(e: axum::extract::rejection::BytesRejection) -> Self {
        Self::Body {
            status: e.status(),
            message: e.body_text(),
        }
    }
}

/// How a failure is counted: refused before dispatch (`rejected`, by
/// reason) or ended after it (`finished`, by outcome).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    /// `kvmesh_requests_rejected_total{reason}` (and
    /// `kvmesh_requests_total{outcome="rejected"}`).
    Rejected(&'static str),
    /// `kvmesh_requests_total{outcome}`.
    Finished(&'static str),
}

impl GatewayError {
    /// The metric label of the failure.
    pub fn kind(&self) -> &'static str {
        match self.count() {
            Count::Rejected(k) | Count::Finished(k) => k,
        }
    }

    /// Which counter the failure goes to.
    pub fn count(&self) -> Count {
        match self {
            Self::Rejected(r) => Count::Rejected(r.reason()),
            Self::Dispatch(d) => Count::Finished(d.kind()),
            Self::Auth(AuthError::OutOfScope(_)) => Count::Rejected("forbidden"),
            Self::Auth(_) => Count::Rejected("unauthenticated"),
            Self::Body { .. } => Count::Rejected("invalid_request"),
            Self::FaultSpec(_) => Count::Rejected("invalid_fault_spec"),
            Self::Internal(_) => Count::Rejected("internal"),
        }
    }

    /// The HTTP status; the OpenAI `type` and the gRPC code follow from it.
    pub fn status(&self) -> StatusCode {
        use Rejection as R;
        match self {
            Self::Rejected(R::ContextLengthExceeded { .. } | R::Invalid { .. }) => {
                StatusCode::BAD_REQUEST
            }
            Self::Rejected(R::Saturated { .. } | R::TenantShareExceeded(_)) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Rejected(
                R::NoHealthyNode { .. } | R::MixedCpuKernels { .. } | R::ShuttingDown,
            ) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Rejected(R::UnknownModel(_)) => StatusCode::NOT_FOUND,
            Self::Dispatch(d) => dispatch_status(d),
            Self::Auth(AuthError::OutOfScope(_)) => StatusCode::FORBIDDEN,
            Self::Auth(_) => StatusCode::UNAUTHORIZED,
            Self::Body { status, .. } => *status,
            Self::FaultSpec(_) => StatusCode::BAD_REQUEST,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable code clients see (the body's `code`).
    pub fn code(&self) -> &'static str {
        use Rejection as R;
        match self {
            Self::Rejected(R::ContextLengthExceeded { .. }) => "context_length_exceeded",
            Self::Rejected(R::Invalid { .. }) => "invalid_value",
            Self::Rejected(R::Saturated { .. }) => "rate_limit_exceeded",
            Self::Rejected(R::TenantShareExceeded(_)) => "tenant_share_exceeded",
            Self::Rejected(R::NoHealthyNode { .. })
            | Self::Dispatch(DispatchError::NoHealthyNode { .. }) => "service_unavailable",
            Self::Rejected(R::MixedCpuKernels { .. }) => "mixed_cpu_kernels",
            Self::Rejected(R::UnknownModel(_)) => "model_not_found",
            Self::Rejected(R::ShuttingDown) => "shutting_down",
            Self::Dispatch(d) => d.kind(),
            Self::Auth(AuthError::OutOfScope(_)) => "insufficient_scope",
            Self::Auth(_) => "invalid_api_key",
            Self::Body { .. } => "invalid_body",
            Self::FaultSpec(_) => "invalid_fault_spec",
            Self::Internal(_) => "internal",
        }
    }

    /// The OpenAI error `type`: the client's request (`invalid_request_error`),
    /// a limit (`rate_limit_error`, every 429), or the server's
    /// (`server_error`, every 5xx and every failure after dispatch).
    pub fn error_type(&self) -> &'static str {
        match self {
            _ if self.status() == StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            Self::Dispatch(_) | Self::Internal(_) => "server_error",
            _ if self.status().is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The request field at fault, if one is.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::Rejected(Rejection::ContextLengthExceeded { .. }) => Some("messages"),
            Self::Rejected(Rejection::Invalid { param, .. }) => Some(*param),
            Self::Rejected(Rejection::UnknownModel(_)) => Some("model"),
            Self::Body { .. } => Some("body"),
            Self::FaultSpec(_) => Some(kvmesh_faults::HEADER),
            _ => None,
        }
    }

    /// The message clients see: for a failure after dispatch a fixed
    /// sentence per kind, never the node's name, address or words.
    pub fn message(&self) -> String {
        match self {
            Self::Dispatch(d) => safe_message(d).to_owned(),
            other => other.to_string(),
        }
    }

    /// The OpenAI-style body: `{"error": {message, type, param, code}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.code(),
        }})
    }

    /// The SSE event of a failure after the response began: the same body
    /// as the unstreamed response, as the stream's last event before
    /// `[DONE]`.
    pub fn sse_event(&self) -> SseEvent {
        self.log();
        SseEvent::default().data(self.body().to_string())
    }

    /// The public gRPC status: the code follows the HTTP status, the
    /// message is [`GatewayError::message`], and the metadata
    /// [`GRPC_CODE_KEY`] carries [`GatewayError::code`].
    pub fn grpc(&self) -> tonic::Status {
        self.log();
        let mut meta = tonic::metadata::MetadataMap::new();
        meta.insert(
            GRPC_CODE_KEY,
            tonic::metadata::MetadataValue::from_static(self.code()),
        );
        tonic::Status::with_metadata(grpc_code(self.status()), self.message(), meta)
    }

    /// The public gRPC stream's last message of a failure after the stream
    /// began: finish reason ERROR, the code and the safe message.
    pub fn grpc_stream_end(&self) -> kvmesh_proto::v1::GenerateResponse {
        self.log();
        kvmesh_proto::v1::GenerateResponse {
            finish_reason: kvmesh_proto::v1::FinishReason::Error as i32,
            error: self.message(),
            error_code: self.code().to_owned(),
            ..Default::default()
        }
    }

    /// Logs what the client is not told: a node's name and words at warn
    /// (the mesh failed), the gateway's own failures at error, refusals of
    /// the client's request at debug. Called once per mapping.
    fn log(&self) {
        let code = self.code();
        match self {
            Self::Dispatch(DispatchError::Node { role, node, status }) => tracing::warn!(
                code,
                role = role.as_str(),
                node = %node,
                grpc_code = ?status.code(),
                status = %status.message(),
                "a node failed a request"
            ),
            Self::Dispatch(DispatchError::Refused {
                node,
                kind,
                message,
            }) => tracing::warn!(
                code,
                node = %node,
                refused = refuse_label(*kind),
                words = %message,
                "the decode node refused a request"
            ),
            Self::Dispatch(DispatchError::Tokenizer(e)) => {
                tracing::error!(code, error = %e, "detokenizing a node's token failed")
            }
            Self::Dispatch(DispatchError::Unfinished) | Self::Internal(_) => {
                tracing::error!(code, error = %self, "gateway failure")
            }
            Self::Dispatch(d) => tracing::warn!(code, error = %d, "request failed"),
            other => tracing::debug!(code, error = %other, "request refused"),
        }
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        self.log();
        (self.status(), axum::Json(self.body())).into_response()
    }
}

/// The gRPC code of an HTTP status (gRPC's own HTTP mapping, with 400 and
/// 413 as the client's fault).
fn grpc_code(status: StatusCode) -> tonic::Code {
    match status {
        StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => tonic::Code::InvalidArgument,
        StatusCode::UNAUTHORIZED => tonic::Code::Unauthenticated,
        StatusCode::FORBIDDEN => tonic::Code::PermissionDenied,
        StatusCode::NOT_FOUND => tonic::Code::NotFound,
        StatusCode::TOO_MANY_REQUESTS => tonic::Code::ResourceExhausted,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => tonic::Code::Unavailable,
        _ => tonic::Code::Internal,
    }
}

fn dispatch_status(d: &DispatchError) -> StatusCode {
    match d {
        DispatchError::Node { status, .. } => match status.code() {
            tonic::Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
            _ => StatusCode::BAD_GATEWAY,
        },
        DispatchError::Refused { kind, .. } => refused_status(*kind),
        DispatchError::Injected(_) => StatusCode::BAD_GATEWAY,
        DispatchError::NoHealthyNode { .. } | DispatchError::ShuttingDown => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        DispatchError::Tokenizer(_) | DispatchError::Unfinished => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// The client's message of a failure after dispatch: fixed per kind.
fn safe_message(d: &DispatchError) -> &'static str {
    match d {
        DispatchError::Node { role, status, .. } => match (role, status.code()) {
            (Role::Prefill, tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                "the prefill node became unavailable during the request"
            }
            (Role::Decode, tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                "the decode node became unavailable during the request"
            }
            (Role::Prefill, tonic::Code::ResourceExhausted) => {
                "the prefill node is out of capacity; retry later"
            }
            (Role::Decode, tonic::Code::ResourceExhausted) => {
                "the decode node is out of capacity; retry later"
            }
            (Role::Prefill, _) => "the prefill node failed the request",
            (Role::Decode, _) => "the decode node failed the request",
        },
        DispatchError::Refused { kind, .. } => match kind {
            RefuseKind::EmptyPrompt => "the decode node refused an empty prompt",
            RefuseKind::TooLong => "the request is longer than the decode node can hold",
            RefuseKind::OverCapacity => {
                "the request needs more KV pages than the decode node's pool has"
            }
            RefuseKind::Exhausted => {
                "the decode nodes had no free KV pages within the queue timeout; retry later"
            }
            RefuseKind::WriterNotConnected => {
                "the decode node could not accept the prompt's transfer"
            }
            RefuseKind::InvalidRequest => "the decode node refused the request as invalid",
            RefuseKind::Draining => "the decode node is shutting down; retry",
            RefuseKind::Internal | RefuseKind::Unspecified => {
                "the decode node failed to reserve pages for the request"
            }
        },
        DispatchError::Tokenizer(_) => "the generated tokens could not be decoded to text",
        DispatchError::NoHealthyNode {
            role: Role::Prefill,
        } => "no healthy prefill node is left to finish the request",
        DispatchError::NoHealthyNode { role: Role::Decode } => {
            "no healthy decode node is left to finish the request"
        }
        DispatchError::Unfinished => "generation ended without a result",
        DispatchError::Injected(what) => what,
        DispatchError::ShuttingDown => {
            "the server is shutting down: generation stopped at the drain deadline"
        }
    }
}

/// A decode refusal's label (logs, messages).
fn refuse_label(kind: RefuseKind) -> &'static str {
    match kind {
        RefuseKind::EmptyPrompt => "empty_prompt",
        RefuseKind::TooLong => "too_long",
        RefuseKind::OverCapacity => "over_capacity",
        RefuseKind::Exhausted => "exhausted",
        RefuseKind::WriterNotConnected => "writer_not_connected",
        RefuseKind::InvalidRequest => "invalid_request",
        RefuseKind::Draining => "draining",
        RefuseKind::Internal | RefuseKind::Unspecified => "internal",
    }
}

/// The HTTP status of a decode refusal: the request's fault (400), a full
/// pool past the queue timeout (429), a draining node (503), or the
/// mesh's (502).
fn refused_status(kind: RefuseKind) -> StatusCode {
    match kind {
        RefuseKind::EmptyPrompt
        | RefuseKind::TooLong
        | RefuseKind::OverCapacity
        | RefuseKind::InvalidRequest => StatusCode::BAD_REQUEST,
        RefuseKind::Exhausted => StatusCode::TOO_MANY_REQUESTS,
        RefuseKind::Draining => StatusCode::SERVICE_UNAVAILABLE,
        RefuseKind::WriterNotConnected | RefuseKind::Internal | RefuseKind::Unspecified => {
            StatusCode::BAD_GATEWAY
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
