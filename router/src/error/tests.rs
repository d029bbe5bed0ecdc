//! Every [`GatewayError`] kind through every mapping: HTTP status and body,
//! SSE event, gRPC status and stream end, metric label; and no node name,
//! address or status in anything a client sees (only in the logs).

use std::convert::Infallible;
use std::io::Write;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::IntoResponse;
use kvmesh_proto::internal::v1::RefuseKind;
use serde_json::{json, Value};
use tonic::Code;

use super::*;

fn node(role: Role, code: Code, words: &str) -> GatewayError {
    DispatchError::Node {
        role,
        node: "decode-secret-7".into(),
        status: tonic::Status::new(code, words),
    }
    .into()
}

fn refused(kind: RefuseKind) -> GatewayError {
    DispatchError::Refused {
        node: "decode-secret-7".into(),
        kind,
        message: "max_seq_tokens 77 at 10.9.8.7:50051".into(),
    }
    .into()
}

/// A kind and what each mapping must give: HTTP status, OpenAI type,
/// code, param, gRPC code, counter.
pub(crate) type Case = (
    GatewayError,
    StatusCode,
    &'static str,
    &'static str,
    Option<&'static str>,
    Code,
    Count,
);

/// One of each kind.
pub(crate) fn every_kind() -> Vec<Case> {
    use Count::{Finished, Rejected as Refused};
    use StatusCode as S;
    let bad = "invalid_request_error";
    let server = "server_error";
    let limit = "rate_limit_error";
    vec![
        (
            Rejection::ContextLengthExceeded {
                prompt_tokens: 60,
                max_tokens: 10,
                requested: 70,
                limit: 64,
            }
            .into(),
            S::BAD_REQUEST,
            bad,
            "context_length_exceeded",
            Some("messages"),
            Code::InvalidArgument,
            Refused("context_length_exceeded"),
        ),
        (
            Rejection::Invalid {
                param: "top_p",
                message: "top_p 2 is not in (0, 1]".into(),
            }
            .into(),
            S::BAD_REQUEST,
            bad,
            "invalid_value",
            Some("top_p"),
            Code::InvalidArgument,
            Refused("invalid_request"),
        ),
        (
            Rejection::Saturated { queued: 3 }.into(),
            S::TOO_MANY_REQUESTS,
            limit,
            "rate_limit_exceeded",
            None,
            Code::ResourceExhausted,
            Refused("saturated"),
        ),
        (
            Rejection::TenantShareExceeded(ShareLimit::QueuedTokens { cap: 4096 }).into(),
            S::TOO_MANY_REQUESTS,
            limit,
            "tenant_share_exceeded",
            None,
            Code::ResourceExhausted,
            Refused("tenant_share_exceeded"),
        ),
        (
            Rejection::TenantShareExceeded(ShareLimit::Queue).into(),
            S::TOO_MANY_REQUESTS,
            limit,
            "tenant_share_exceeded",
            None,
            Code::ResourceExhausted,
            Refused("tenant_share_exceeded"),
        ),
        (
            Rejection::NoHealthyNode {
                role: "prefill or decode",
            }
            .into(),
            S::SERVICE_UNAVAILABLE,
            server,
            "service_unavailable",
            None,
            Code::Unavailable,
            Refused("no_healthy_node"),
        ),
        (
            Rejection::MixedCpuKernels {
                role: "decode",
                wanted: "portable".into(),
                found: "decode-0 runs avx512 (x86-fma)".into(),
            }
            .into(),
            S::SERVICE_UNAVAILABLE,
            server,
            "mixed_cpu_kernels",
            None,
            Code::Unavailable,
            Refused("mixed_cpu_kernels"),
        ),
        (
            Rejection::UnknownModel("gpt-x".into()).into(),
            S::NOT_FOUND,
            bad,
            "model_not_found",
            Some("model"),
            Code::NotFound,
            Refused("model_not_found"),
        ),
        (
            Rejection::ShuttingDown.into(),
            S::SERVICE_UNAVAILABLE,
            server,
            "shutting_down",
            None,
            Code::Unavailable,
            Refused("shutting_down"),
        ),
        (
            AuthError::Unknown.into(),
            S::UNAUTHORIZED,
            bad,
            "invalid_api_key",
            None,
            Code::Unauthenticated,
            Refused("unauthenticated"),
        ),
        (
            GatewayError::Body {
                status: S::PAYLOAD_TOO_LARGE,
                message: "length limit exceeded".into(),
            },
            S::PAYLOAD_TOO_LARGE,
            bad,
            "invalid_body",
            Some("body"),
            Code::InvalidArgument,
            Refused("invalid_request"),
        ),
        (
            GatewayError::FaultSpec(kvmesh_faults::FaultSpecError {
                rule: "frame=drop".into(),
                reason: "needs an index".into(),
            }),
            S::BAD_REQUEST,
            bad,
            "invalid_fault_spec",
            Some("x-kvmesh-fault"),
            Code::InvalidArgument,
            Refused("invalid_fault_spec"),
        ),
        (
            GatewayError::Internal("cannot mint a request id"),
            S::INTERNAL_SERVER_ERROR,
            server,
            "internal",
            None,
            Code::Internal,
            Refused("internal"),
        ),
        (
            node(Role::Prefill, Code::Unavailable, "connection refused"),
            S::BAD_GATEWAY,
            server,
            "prefill_failed",
            None,
            Code::Unavailable,
            Finished("prefill_failed"),
        ),
        (
            node(Role::Decode, Code::Internal, "page 3 unwritten"),
            S::BAD_GATEWAY,
            server,
            "decode_failed",
            None,
            Code::Unavailable,
            Finished("decode_failed"),
        ),
        (
            node(Role::Decode, Code::ResourceExhausted, "queue full"),
            S::TOO_MANY_REQUESTS,
            limit,
            "decode_failed",
            None,
            Code::ResourceExhausted,
            Finished("decode_failed"),
        ),
        (
            node(Role::Decode, Code::InvalidArgument, "writer id"),
            S::BAD_REQUEST,
            server,
            "decode_failed",
            None,
            Code::InvalidArgument,
            Finished("decode_failed"),
        ),
        (
            refused(RefuseKind::TooLong),
            S::BAD_REQUEST,
            server,
            "decode_refused",
            None,
            Code::InvalidArgument,
            Finished("decode_refused"),
        ),
        (
            refused(RefuseKind::Exhausted),
            S::TOO_MANY_REQUESTS,
            limit,
            "decode_refused",
            None,
            Code::ResourceExhausted,
            Finished("decode_refused"),
        ),
        (
            refused(RefuseKind::WriterNotConnected),
            S::BAD_GATEWAY,
            server,
            "decode_refused",
            None,
            Code::Unavailable,
            Finished("decode_refused"),
        ),
        (
            DispatchError::Tokenizer("id 99999 out of range".into()).into(),
            S::INTERNAL_SERVER_ERROR,
            server,
            "tokenizer",
            None,
            Code::Internal,
            Finished("tokenizer"),
        ),
        (
            DispatchError::NoHealthyNode { role: Role::Decode }.into(),
            S::SERVICE_UNAVAILABLE,
            server,
            "service_unavailable",
            None,
            Code::Unavailable,
            Finished("no_healthy_node"),
        ),
        (
            refused(RefuseKind::Draining),
            S::SERVICE_UNAVAILABLE,
            server,
            "decode_refused",
            None,
            Code::Unavailable,
            Finished("decode_refused"),
        ),
        (
            DispatchError::ShuttingDown.into(),
            S::SERVICE_UNAVAILABLE,
            server,
            "shutting_down",
            None,
            Code::Unavailable,
            Finished("shutting_down"),
        ),
        (
            DispatchError::Unfinished.into(),
            S::INTERNAL_SERVER_ERROR,
            server,
            "internal",
            None,
            Code::Internal,
            Finished("internal"),
        ),
        (
            DispatchError::Injected("the reserve request was lost").into(),
            S::BAD_GATEWAY,
            server,
            "injected_fault",
            None,
            Code::Unavailable,
            Finished("injected_fault"),
        ),
    ]
}

pub(crate) async fn body_of(resp: axum::response::Response) -> (StatusCode, String) {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    (status, String::from_utf8(bytes.to_vec()).expect("utf-8"))
}

/// What the SSE event of `e` puts on the wire.
async fn sse_text(e: &GatewayError) -> String {
    let events = tokio_stream::iter([Ok::<_, Infallible>(e.sse_event())]);
    body_of(axum::response::sse::Sse::new(events).into_response())
        .await
        .1
}

#[tokio::test]
async fn every_kind_maps_to_one_status_type_code_and_counter_everywhere() {
    for (e, status, ty, code, param, grpc, count) in every_kind() {
        let what = format!("{e:?}");
        assert_eq!(e.count(), count, "{what}");
        let message = e.message();
        assert!(!message.is_empty(), "{what}");
        let want = json!({"error": {"message": message, "type": ty, "param": param, "code": code}});
        // The SSE event carries the same body.
        assert_eq!(sse_text(&e).await, format!("data: {want}\n\n"), "{what}");
        // gRPC: the code follows the status; the code rides in metadata.
        let s = e.grpc();
        assert_eq!(s.code(), grpc, "{what}");
        assert_eq!(s.message(), message, "{what}");
        assert_eq!(
            s.metadata()
                .get(GRPC_CODE_KEY)
                .and_then(|v| v.to_str().ok()),
            Some(code),
            "{what}"
        );
        let end = e.grpc_stream_end();
        assert_eq!(
            (
                end.finish_reason,
                end.error.as_str(),
                end.error_code.as_str()
            ),
            (
                kvmesh_proto::v1::FinishReason::Error as i32,
                message.as_str(),
                code
            ),
            "{what}"
        );
        // HTTP last: it consumes the error.
        let (got_status, body) = body_of(e.into_response()).await;
        assert_eq!(got_status, status, "{what}");
        let body: Value = serde_json::from_str(&body).expect("JSON body");
        assert_eq!(body, want, "{what}");
    }
}

#[test]
fn client_messages_are_fixed_per_kind() {
    let cases = [
        (
            node(Role::Decode, Code::Internal, "x"),
            "the decode node failed the request",
        ),
        (
            node(Role::Prefill, Code::Aborted, "x"),
            "the prefill node failed the request",
        ),
        (
            node(Role::Decode, Code::Unavailable, "x"),
            "the decode node became unavailable during the request",
        ),
        (
            refused(RefuseKind::TooLong),
            "the request is longer than the decode node can hold",
        ),
        (
            refused(RefuseKind::Exhausted),
            "the decode nodes had no free KV pages within the queue timeout; retry later",
        ),
        (
            Rejection::ContextLengthExceeded {
                prompt_tokens: 60,
                max_tokens: 10,
                requested: 70,
                limit: 64,
            }
            .into(),
            "This model's maximum context length is 64 tokens. However, you requested 70 tokens (60 in the messages, 10 in the completion). Please reduce the length of the messages or completion.",
        ),
        (
            Rejection::MixedCpuKernels {
                role: "decode",
                wanted: "portable".into(),
                found: "decode-0 runs avx512 (x86-fma)".into(),
            }
            .into(),
            "no healthy decode node computes with the same CPU kernels as the other role's nodes; the mesh's operator must give every node the same cpu_kernels and activations",
        ),
        (
            GatewayError::FaultSpec(kvmesh_faults::FaultSpecError {
                rule: "frame=drop".into(),
                reason: "needs an index".into(),
            }),
            "x-kvmesh-fault: fault spec \"frame=drop\": needs an index",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.message(), want, "{e:?}");
    }
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Node names, node addresses and node statuses never reach a client
/// (HTTP body, SSE event, gRPC status, gRPC stream end); they reach the
/// logs, once per mapping.
#[tokio::test]
async fn node_names_addresses_and_statuses_never_reach_clients_only_the_logs() {
    let words = "error trying to connect: tcp connect error: 10.9.8.7:50051: connection refused; page 3 unwritten";
    let failures: Vec<GatewayError> = [Role::Prefill, Role::Decode]
        .into_iter()
        .flat_map(|role| {
            [
                Code::Unavailable,
                Code::Internal,
                Code::Aborted,
                Code::ResourceExhausted,
                Code::InvalidArgument,
                Code::DeadlineExceeded,
            ]
            .map(|c| node(role, c, words))
        })
        .chain(
            [
                RefuseKind::EmptyPrompt,
                RefuseKind::TooLong,
                RefuseKind::OverCapacity,
                RefuseKind::Exhausted,
                RefuseKind::WriterNotConnected,
                RefuseKind::InvalidRequest,
                RefuseKind::Internal,
                RefuseKind::Unspecified,
            ]
            .map(refused),
        )
        .collect();
    let secrets = [
        "decode-secret-7",
        "10.9.8.7",
        "50051",
        "unwritten",
        "connection refused",
        "max_seq_tokens",
        "Unavailable",
        "Internal",
        "status",
    ];
    for e in failures {
        let what = format!("{e:?}");
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer({
                let logs = logs.clone();
                move || logs.clone()
            })
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        let status = e.grpc();
        let end = e.grpc_stream_end();
        let sse = sse_text(&e).await;
        let (_, body) = body_of(e.into_response()).await;
        let seen = [
            body,
            sse,
            status.message().to_owned(),
            format!("{:?}", status.metadata()),
            end.error,
            end.error_code,
        ];
        for s in &seen {
            for secret in secrets {
                assert!(!s.contains(secret), "{what}: {secret:?} in {s}");
            }
        }
        let logged = String::from_utf8(logs.0.lock().expect("logs").clone()).expect("utf-8");
        assert_eq!(
            logged.matches("decode-secret-7").count(),
            4,
            "{what}: one log line per mapping:\n{logged}"
        );
        let detail = if what.contains("Refused") {
            "10.9.8.7:50051"
        } else {
            "page 3 unwritten"
        };
        assert!(logged.contains(detail), "{what}: {logged}");
    }
}
