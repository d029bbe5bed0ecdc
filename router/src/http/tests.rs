//! The HTTP gateway over a scripted mesh (`mesh::fake`), driven in process
//! (`tower::ServiceExt::oneshot` on `Router::http()`), no node anywhere:
//! validation through the handlers, unstreamed bodies, SSE framing, error
//! bodies and statuses, admission's slots, and the metrics text.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio_stream::StreamExt;
use tower::ServiceExt;

use crate::auth::{ApiKeys, Scope};
use crate::error::{DispatchError, Rejection};
use crate::mesh::fake::{router, FakeMesh, Script, Step};
use crate::mesh::{Event, Finish};
use crate::nodes::Role;
use crate::{Router, RouterConfig};

fn keyed() -> RouterConfig {
    RouterConfig {
        // The test's one key may also read /metrics.
        api_keys: ApiKeys::with_scopes([(
            "k-test".to_owned(),
            "tenant-a".to_owned(),
            vec![Scope::Inference, Scope::Metrics],
        )])
        .expect("keys"),
        ..RouterConfig::default()
    }
}

fn post(path: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", "Bearer k-test")
        .body(Body::from(body.to_owned()))
        .expect("request")
}

async fn send(r: &Router, req: Request<Body>) -> (StatusCode, String) {
    let resp = r.http().oneshot(req).await.expect("infallible");
    crate::error::tests::body_of(resp).await
}

async fn send_json(r: &Router, path: &str, body: &str) -> (StatusCode, Value) {
    let (status, text) = send(r, post(path, body)).await;
    (status, serde_json::from_str(&text).expect("a JSON body"))
}

fn error(message: &str, ty: &str, param: Option<&str>, code: &str) -> Value {
    json!({"error": {"message": message, "type": ty, "param": param, "code": code}})
}

/// The `data:` payloads of an SSE body, keep-alive comments left out.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|f| !f.is_empty())
        .filter(|f| !f.starts_with(':'))
        .map(|f| {
            f.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data frame: {f:?}"))
                .to_owned()
        })
        .collect()
}

async fn metrics(r: &Router) -> String {
    let req = Request::get("/metrics")
        .header("authorization", "Bearer k-test")
        .body(Body::empty())
        .expect("request");
    send(r, req).await.1
}

fn metric_lines(text: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

fn tokens(r: &Router, text: &str) -> Vec<u32> {
    r.tokenizer().encode(text).expect("encode")
}

fn text(t: &str) -> Event {
    Event::Text {
        text: t.into(),
        logprobs: Vec::new(),
    }
}

fn done(finish: Finish, completion_tokens: usize) -> Event {
    Event::Done {
        finish,
        completion_tokens,
        cached_tokens: 0,
    }
}

fn decode_failed() -> Event {
    Event::Error(DispatchError::Node {
        role: Role::Decode,
        node: "decode-0".into(),
        status: tonic::Status::internal("guard violation: page 3 layer 1 unwritten"),
    })
}

/// `v` without its `id` and `created`, after checking them: the id is the
/// mesh's fresh one with the kind's prefix.
fn strip_id(mut v: Value, prefix: &str) -> Value {
    let id = v["id"].as_str().expect("an id").to_owned();
    let hex = id.strip_prefix(prefix).expect("the prefix");
    assert_eq!(hex.len(), 32, "{id}");
    assert!(v["created"].as_u64().is_some_and(|c| c > 1_600_000_000));
    let o = v.as_object_mut().expect("object");
    o.remove("id");
    o.remove("created");
    v
}

#[tokio::test]
async fn unstreamed_completions_are_whole_bodies_and_the_mesh_gets_the_validated_job() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    mesh.play(vec![
        text("Hello"),
        text(" world"),
        Event::Done {
            finish: Finish::Length,
            completion_tokens: 2,
            cached_tokens: 16,
        },
    ]);
    let (status, v) = send_json(
        &r,
        "/v1/completions",
        r#"{"prompt":"Once upon","max_tokens":5,"temperature":0,"seed":7,"stop":["."],"ignore_eos":true}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let prompt = tokens(&r, "Once upon");
    let p = prompt.len();
    assert_eq!(
        strip_id(v, "cmpl-"),
        json!({"object": "text_completion", "model": "tiny-llama",
            "choices": [{"index": 0, "text": "Hello world", "finish_reason": "length", "logprobs": null}],
            "usage": {"prompt_tokens": p, "completion_tokens": 2, "total_tokens": p + 2,
                "prompt_tokens_details": {"cached_tokens": 16}}})
    );
    let job = &mesh.received()[0];
    assert_eq!(job.prompt_ids, prompt);
    assert_eq!(
        (
            job.max_tokens,
            job.sampling.temperature,
            job.sampling.top_p,
            job.sampling.seed
        ),
        (5, 0.0, 1.0, 7)
    );
    assert_eq!(
        (job.stop.as_slice(), job.ignore_eos),
        (&[".".to_owned()][..], true)
    );
    assert_eq!(job.tenant.0, "tenant-a", "the tenant comes from the key");
    assert_eq!(job.cache_salt, None);

    mesh.play(vec![text("Hi"), done(Finish::Stop, 1)]);
    let (status, v) = send_json(
        &r,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"Hello"}],"cache_salt":"conversation-1"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let chat = r
        .tokenizer()
        .encode_chat(&[kvmesh_tokenizer::ChatMessage::new("user", "Hello")])
        .expect("chat");
    let p = chat.len();
    assert_eq!(
        strip_id(v, "chatcmpl-"),
        json!({"object": "chat.completion", "model": "tiny-llama",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop", "logprobs": null}],
            "usage": {"prompt_tokens": p, "completion_tokens": 1, "total_tokens": p + 1,
                "prompt_tokens_details": {"cached_tokens": 0}}})
    );
    let job = &mesh.received()[1];
    assert_eq!(job.prompt_ids, chat);
    assert_eq!(job.max_tokens, crate::validate::DEFAULT_MAX_TOKENS);
    assert_eq!(job.stop, Vec::<String>::new());
    assert_eq!(job.cache_salt.as_deref(), Some("conversation-1"));
}

#[tokio::test]
async fn sse_frames_each_text_then_the_finish_with_usage_then_done() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    let p = tokens(&r, "Once upon").len();
    mesh.play(vec![text("Hel"), text("lo"), done(Finish::Stop, 2)]);
    let (status, body) = send(
        &r,
        post("/v1/completions", r#"{"prompt":"Once upon","stream":true}"#),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let frames = sse_data(&body);
    assert_eq!(frames.len(), 4, "{body}");
    assert_eq!(frames[3], "[DONE]");
    let chunks: Vec<Value> = frames[..3]
        .iter()
        .map(|f| serde_json::from_str(f).expect("a JSON chunk"))
        .collect();
    let id = chunks[0]["id"].clone();
    assert!(chunks.iter().all(|c| c["id"] == id), "one id per stream");
    let got: Vec<Value> = chunks.into_iter().map(|c| strip_id(c, "cmpl-")).collect();
    let chunk = |t: &str, finish: Value| {
        json!({"object": "text_completion", "model": "tiny-llama",
            "choices": [{"index": 0, "text": t, "finish_reason": finish, "logprobs": null}]})
    };
    let mut last = chunk("", json!("stop"));
    last["usage"] = json!({"prompt_tokens": p, "completion_tokens": 2, "total_tokens": p + 2,
        "prompt_tokens_details": {"cached_tokens": 0}});
    assert_eq!(
        got,
        [chunk("Hel", Value::Null), chunk("lo", Value::Null), last]
    );

    // A chat stream opens with the assistant's role.
    mesh.play(vec![text("Hi"), done(Finish::Length, 1)]);
    let (status, body) = send(
        &r,
        post(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"Hello"}],"stream":true}"#,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let frames = sse_data(&body);
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"), "{body}");
    let deltas: Vec<(Value, Value)> = frames[..frames.len() - 1]
        .iter()
        .map(|f| {
            let v: Value = serde_json::from_str(f).expect("a JSON chunk");
            assert_eq!(v["object"], "chat.completion.chunk");
            let c = &v["choices"][0];
            (c["delta"].clone(), c["finish_reason"].clone())
        })
        .collect();
    assert_eq!(
        deltas,
        [
            (json!({"role": "assistant", "content": ""}), Value::Null),
            (json!({"content": "Hi"}), Value::Null),
            (json!({}), json!("length")),
        ]
    );
}

#[tokio::test]
async fn a_failure_mid_stream_is_the_terminal_error_event_with_a_safe_message() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    // Nothing after the error reaches the client.
    mesh.play(vec![text("Hel"), decode_failed(), text("never")]);
    let (status, body) = send(
        &r,
        post("/v1/completions", r#"{"prompt":"Once upon","stream":true}"#),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "the stream had begun");
    let frames = sse_data(&body);
    assert_eq!(frames.len(), 3, "{body}");
    let first: Value = serde_json::from_str(&frames[0]).expect("chunk");
    assert_eq!(first["choices"][0]["text"], "Hel");
    assert_eq!(
        serde_json::from_str::<Value>(&frames[1]).expect("error event"),
        error(
            "the decode node failed the request",
            "server_error",
            None,
            "decode_failed"
        )
    );
    assert_eq!(frames[2], "[DONE]");
    assert!(!body.contains("never") && !body.contains("decode-0") && !body.contains("unwritten"));
    assert_eq!(
        metric_lines(&metrics(&r).await, "kvmesh_requests_total{"),
        ["kvmesh_requests_total{outcome=\"decode_failed\"} 1"]
    );
}

#[tokio::test]
async fn unstreamed_failures_have_their_status_and_body() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    let refusal = |kind| {
        Event::Error(DispatchError::Refused {
            node: "decode-0".into(),
            kind,
            message: "prompt 40 + 300 over max_seq_tokens 64".into(),
        })
    };
    use kvmesh_proto::internal::v1::RefuseKind;
    let cases = [
        (
            vec![refusal(RefuseKind::TooLong)],
            StatusCode::BAD_REQUEST,
            error(
                "the request is longer than the decode node can hold",
                "server_error",
                None,
                "decode_refused",
            ),
        ),
        (
            vec![refusal(RefuseKind::Exhausted)],
            StatusCode::TOO_MANY_REQUESTS,
            error(
                "the decode nodes had no free KV pages within the queue timeout; retry later",
                "rate_limit_error",
                None,
                "decode_refused",
            ),
        ),
        (
            vec![text("partial"), decode_failed()],
            StatusCode::BAD_GATEWAY,
            error(
                "the decode node failed the request",
                "server_error",
                None,
                "decode_failed",
            ),
        ),
        (
            vec![Event::Error(DispatchError::NoHealthyNode {
                role: Role::Decode,
            })],
            StatusCode::SERVICE_UNAVAILABLE,
            error(
                "no healthy decode node is left to finish the request",
                "server_error",
                None,
                "service_unavailable",
            ),
        ),
        // The mesh's stream closed without a result.
        (
            vec![text("partial")],
            StatusCode::INTERNAL_SERVER_ERROR,
            error(
                "generation ended without a result",
                "server_error",
                None,
                "internal",
            ),
        ),
    ];
    for (events, status, want) in cases {
        mesh.play(events);
        assert_eq!(
            send_json(&r, "/v1/completions", r#"{"prompt":"hi"}"#).await,
            (status, want.clone()),
            "{want}"
        );
    }
    assert_eq!(
        metric_lines(&metrics(&r).await, "kvmesh_requests_total{"),
        [
            "kvmesh_requests_total{outcome=\"decode_failed\"} 1",
            "kvmesh_requests_total{outcome=\"decode_refused\"} 2",
            "kvmesh_requests_total{outcome=\"internal\"} 1",
            "kvmesh_requests_total{outcome=\"no_healthy_node\"} 1",
        ]
    );
}

#[tokio::test]
async fn no_capacity_or_a_mesh_refusal_is_a_503_before_dispatch() {
    let mesh = FakeMesh::new(None);
    let r = router(&mesh, keyed());
    let health = || {
        Request::get("/health")
            .body(Body::empty())
            .expect("request")
    };
    assert_eq!(
        send(&r, health()).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy prefill or decode node\n".to_owned()
        )
    );
    assert_eq!(
        send_json(&r, "/v1/completions", r#"{"prompt":"hi"}"#).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            error(
                "no healthy prefill or decode node",
                "server_error",
                None,
                "service_unavailable"
            )
        )
    );
    assert!(mesh.received().is_empty(), "admission stopped it");
    mesh.set_capacity(Some(256));
    assert_eq!(
        send(&r, health()).await,
        (StatusCode::OK, "ok\n".to_owned())
    );
    mesh.push(Script::Refuse(Rejection::NoHealthyNode { role: "decode" }));
    assert_eq!(
        send_json(&r, "/v1/completions", r#"{"prompt":"hi","stream":true}"#).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            error(
                "no healthy decode node",
                "server_error",
                None,
                "service_unavailable"
            )
        )
    );
    assert_eq!(mesh.received().len(), 1);
    let m = metrics(&r).await;
    assert_eq!(
        metric_lines(&m, "kvmesh_requests_rejected_total{"),
        ["kvmesh_requests_rejected_total{reason=\"no_healthy_node\"} 2"]
    );
}

/// The slot lives as long as the request: with one slot and no queue a
/// second request is refused with 429 while the first streams; a client
/// that leaves frees its slot (the mesh sees its stream dropped) and is
/// counted as gone.
#[tokio::test]
async fn a_running_request_holds_its_slot_until_its_client_leaves() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(
        &mesh,
        RouterConfig {
            max_running: 1,
            max_queued: 0,
            ..keyed()
        },
    );
    let gate = Arc::new(Notify::new());
    mesh.push(Script::Play(vec![
        Step::Send(text("a")),
        Step::Gate(Arc::clone(&gate)),
        Step::Send(done(Finish::Stop, 1)),
    ]));
    let resp = r
        .http()
        .oneshot(post("/v1/completions", r#"{"prompt":"hi","stream":true}"#))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let first = body.next().await.expect("a frame").expect("bytes");
    assert!(String::from_utf8_lossy(&first).contains("\"text\":\"a\""));
    assert_eq!(
        send_json(&r, "/v1/completions", r#"{"prompt":"hi"}"#).await,
        (
            StatusCode::TOO_MANY_REQUESTS,
            error(
                "the server is saturated: 0 requests are queued; retry later",
                "rate_limit_error",
                None,
                "rate_limit_exceeded"
            )
        )
    );
    assert_eq!(mesh.received().len(), 1);
    drop(body);
    mesh.idle().await;
    assert_eq!(mesh.abandoned(), 1, "the mesh saw its stream dropped");
    mesh.play(vec![text("b"), done(Finish::Stop, 1)]);
    let (status, v) = send_json(&r, "/v1/completions", r#"{"prompt":"hi"}"#).await;
    assert_eq!(status, StatusCode::OK, "the slot came back: {v}");
    assert_eq!(v["choices"][0]["text"], "b");
    let m = metrics(&r).await;
    assert_eq!(
        metric_lines(&m, "kvmesh_requests_total{"),
        [
            "kvmesh_requests_total{outcome=\"client_gone\"} 1",
            "kvmesh_requests_total{outcome=\"rejected\"} 1",
            "kvmesh_requests_total{outcome=\"stop\"} 1",
        ]
    );
    gate.notify_waiters();
}

/// The whole counter section of `/metrics` after a few requests, then the
/// mesh's own series.
#[tokio::test]
async fn metrics_count_every_outcome_once() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    mesh.play(vec![text("a"), done(Finish::Stop, 1)]);
    mesh.play(vec![text("a"), done(Finish::Length, 3)]);
    mesh.play(vec![text("a"), decode_failed()]);
    for stream in [false, true, false] {
        let body = json!({"prompt": "hi", "stream": stream}).to_string();
        send(&r, post("/v1/completions", &body)).await;
    }
    send(&r, post("/v1/completions", r#"{"prompt":"hi","top_p":0}"#)).await;
    let m = metrics(&r).await;
    let counters = m
        .split("# HELP kvmesh_time_to_first_token_seconds")
        .next()
        .expect("counters first");
    assert_eq!(
        counters,
        "# HELP kvmesh_requests_total Requests by outcome.\n\
         # TYPE kvmesh_requests_total counter\n\
         kvmesh_requests_total{outcome=\"decode_failed\"} 1\n\
         kvmesh_requests_total{outcome=\"length\"} 1\n\
         kvmesh_requests_total{outcome=\"rejected\"} 1\n\
         kvmesh_requests_total{outcome=\"stop\"} 1\n\
         # HELP kvmesh_requests_rejected_total Requests refused before dispatch, by reason.\n\
         # TYPE kvmesh_requests_rejected_total counter\n\
         kvmesh_requests_rejected_total{reason=\"invalid_request\"} 1\n"
    );
    assert!(
        m.ends_with("# fake mesh\nkvmesh_fake_requests_received 3\n"),
        "{m}"
    );
}

/// The fuzz target's corpus (`fuzz/corpus/gateway_request`, seeds for the
/// new fields among them) replayed on stable with the target's own
/// checks: CI holds every input libFuzzer ever kept to them.
#[test]
fn the_gateway_fuzz_corpus_is_refused_by_name_or_accepted_in_range() {
    let r = crate::openapi::tests::router(false);
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/gateway_request");
    let vocab = r.tokenizer().vocab_size() as u32;
    let (mut accepted, mut refused) = (0, 0);
    for entry in std::fs::read_dir(&dir).expect("the corpus") {
        let data = std::fs::read(entry.expect("entry").path()).expect("read");
        let Some((b, body)) = data.split_first() else {
            continue;
        };
        match crate::http::validate(&r, b & 1 == 1, body) {
            Ok(batch) => {
                let choices = batch.prompts.len() * batch.n;
                assert!((1..=crate::choices::MAX_CHOICES).contains(&choices));
                let v = &batch.prompts[0];
                let (ids, s) = (v.ids(), v.settings());
                let p = &s.sampling;
                assert!(s.max_tokens >= 1);
                assert!((0.0..=2.0).contains(&p.temperature));
                assert!(p.top_p > 0.0 && p.top_p <= 1.0);
                assert!(p.logit_bias.keys().all(|&id| id < vocab));
                assert!(p.min_tokens as usize <= s.max_tokens);
                assert!(ids.iter().all(|&t| t < vocab));
                assert!(
                    kvmesh_node::sampling::params(p, || r.vocabulary()).is_ok(),
                    "a node would refuse what the gateway took: {:?}",
                    String::from_utf8_lossy(body)
                );
                accepted += 1;
            }
            Err(Rejection::Invalid { param, .. }) => {
                assert!(!param.is_empty());
                refused += 1;
            }
            Err(Rejection::UnknownModel(_)) => refused += 1,
            Err(other) => panic!("validation never refuses with {other:?}"),
        }
    }
    assert!(
        accepted >= 3 && refused >= 100,
        "{accepted} accepted, {refused} refused"
    );
}

mod parsers;
mod refusals;
mod tenants;
mod tools;
