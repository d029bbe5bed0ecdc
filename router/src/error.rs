//! The router's refusals and failures, and the one place they map to HTTP
//! status codes and OpenAI-style error bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use thiserror::Error;

/// A request the router refused before dispatching anything (I3): a
/// terminal value, never a flag on a request that keeps moving.
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
    /// No prefill or no decode node is healthy.
    #[error("no healthy {role} node")]
    NoHealthyNode {
        /// Which role is missing.
        role: &'static str,
    },
    /// The model named is not served.
    #[error("the model {0:?} does not exist")]
    UnknownModel(String),
    /// The gateway is draining: it finishes what it holds, takes nothing new.
    #[error("the server is shutting down; retry on another replica")]
    ShuttingDown,
}

impl Rejection {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ContextLengthExceeded { .. } => "context_length_exceeded",
            Self::Invalid { .. } => "invalid_request",
            Self::Saturated { .. } => "saturated",
            Self::NoHealthyNode { .. } => "no_healthy_node",
            Self::UnknownModel(_) => "model_not_found",
            Self::ShuttingDown => "shutting_down",
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::ContextLengthExceeded { .. } | Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::Saturated { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::NoHealthyNode { .. } | Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Self::UnknownModel(_) => StatusCode::NOT_FOUND,
        }
    }

    fn body(&self) -> serde_json::Value {
        let (ty, code, param) = match self {
            Self::ContextLengthExceeded { .. } => (
                "invalid_request_error",
                "context_length_exceeded",
                Some("messages"),
            ),
            Self::Invalid { param, .. } => ("invalid_request_error", "invalid_value", Some(*param)),
            Self::Saturated { .. } => ("rate_limit_error", "rate_limit_exceeded", None),
            Self::NoHealthyNode { .. } => ("server_error", "service_unavailable", None),
            Self::UnknownModel(_) => ("invalid_request_error", "model_not_found", Some("model")),
            Self::ShuttingDown => ("server_error", "shutting_down", None),
        };
        json!({"error": {"message": self.to_string(), "type": ty, "param": param, "code": code}})
    }

    /// The gRPC status of the public API.
    pub fn grpc(&self) -> tonic::Status {
        match self {
            Self::ContextLengthExceeded { .. } | Self::Invalid { .. } => {
                tonic::Status::invalid_argument(self.to_string())
            }
            Self::Saturated { .. } => tonic::Status::resource_exhausted(self.to_string()),
            Self::NoHealthyNode { .. } | Self::ShuttingDown => {
                tonic::Status::unavailable(self.to_string())
            }
            Self::UnknownModel(_) => tonic::Status::not_found(self.to_string()),
        }
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}

/// A request that was dispatched and then failed.
#[derive(Debug, Error)]
pub enum DispatchError {
    /// A node refused or failed the request.
    #[error("{role} node {node}: {status}")]
    Node {
        /// "prefill" or "decode".
        role: &'static str,
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
        kind: kvmesh_proto::internal::v1::RefuseKind,
        /// The node's words.
        message: String,
    },
    /// Tokenizer or detokenizer failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Refused after dispatch began (every node went away meanwhile).
    #[error(transparent)]
    Rejected(Rejection),
    /// An injected fault ended the request (testing builds only).
    #[error("injected fault: {0}")]
    Injected(&'static str),
    /// The gateway's drain deadline passed with the request in flight.
    #[error("the server is shutting down: generation stopped at the drain deadline")]
    ShuttingDown,
}

impl DispatchError {
    /// The metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Node {
                role: "prefill", ..
            } => "prefill_failed",
            Self::Node { .. } => "decode_failed",
            Self::Refused { .. } => "decode_refused",
            Self::Tokenizer(_) => "tokenizer",
            Self::Rejected(r) => r.reason(),
            Self::Injected(_) => "injected_fault",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

impl IntoResponse for DispatchError {
    fn into_response(self) -> Response {
        let code = match &self {
            Self::Node { status, .. } if status.code() == tonic::Code::ResourceExhausted => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Node { status, .. } if status.code() == tonic::Code::InvalidArgument => {
                StatusCode::BAD_REQUEST
            }
            Self::Refused { kind, .. } => refused_status(*kind),
            Self::Node { .. } | Self::Injected(_) => StatusCode::BAD_GATEWAY,
            Self::Tokenizer(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Self::Rejected(r) => return r.clone().into_response(),
        };
        let body = json!({"error": {"message": self.to_string(), "type": "server_error", "param": null, "code": self.kind()}});
        (code, axum::Json(body)).into_response()
    }
}

/// A decode refusal's label (logs, messages).
fn refuse_label(kind: kvmesh_proto::internal::v1::RefuseKind) -> &'static str {
    use kvmesh_proto::internal::v1::RefuseKind as K;
    match kind {
        K::EmptyPrompt => "empty_prompt",
        K::TooLong => "too_long",
        K::OverCapacity => "over_capacity",
        K::Exhausted => "exhausted",
        K::WriterNotConnected => "writer_not_connected",
        K::InvalidRequest => "invalid_request",
        K::Draining => "draining",
        K::Internal | K::Unspecified => "internal",
    }
}

/// The HTTP status of a decode refusal: the request's fault (400), a full
/// pool past the queue timeout (429), or the mesh's (502).
fn refused_status(kind: kvmesh_proto::internal::v1::RefuseKind) -> StatusCode {
    use kvmesh_proto::internal::v1::RefuseKind as K;
    match kind {
        K::EmptyPrompt | K::TooLong | K::OverCapacity | K::InvalidRequest => {
            StatusCode::BAD_REQUEST
        }
        K::Exhausted => StatusCode::TOO_MANY_REQUESTS,
        K::Draining => StatusCode::SERVICE_UNAVAILABLE,
        K::WriterNotConnected | K::Internal | K::Unspecified => StatusCode::BAD_GATEWAY,
    }
}
