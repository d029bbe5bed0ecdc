//! What the gateway refuses before anything reaches the mesh: exact
//! OpenAI error bodies, each refusal counted, and an oversized body.

use super::*;

#[tokio::test]
async fn refusals_are_exact_openai_bodies_counted_before_anything_reaches_the_mesh() {
    let mesh = FakeMesh::new(Some(64));
    let r = router(&mesh, keyed());
    let hi = tokens(&r, "hi").len();
    let cases = [
        (
            "/v1/completions",
            r#"{"prompt":"hi","temperature":9}"#,
            StatusCode::BAD_REQUEST,
            error(
                "temperature 9 is not in [0, 2]",
                "invalid_request_error",
                Some("temperature"),
                "invalid_value",
            ),
        ),
        (
            "/v1/completions",
            r#"{"prompt":["hi","ho"],"n":9}"#,
            StatusCode::BAD_REQUEST,
            error(
                "2 prompt(s) times n = 9 is 18 choices; at most 16",
                "invalid_request_error",
                Some("n"),
                "invalid_value",
            ),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","cache_salt":""}"#,
            StatusCode::BAD_REQUEST,
            error(
                "cache_salt must have 1 to 256 characters",
                "invalid_request_error",
                Some("cache_salt"),
                "invalid_value",
            ),
        ),
        (
            "/v1/completions",
            r#"{"max_tokens":4}"#,
            StatusCode::BAD_REQUEST,
            error(
                "prompt is required",
                "invalid_request_error",
                Some("prompt"),
                "invalid_value",
            ),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#,
            StatusCode::BAD_REQUEST,
            error(
                "messages must not be empty",
                "invalid_request_error",
                Some("messages"),
                "invalid_value",
            ),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","model":"gpt-x"}"#,
            StatusCode::NOT_FOUND,
            error(
                "the model \"gpt-x\" does not exist",
                "invalid_request_error",
                Some("model"),
                "model_not_found",
            ),
        ),
        // Over the 256-token window.
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":300}"#,
            StatusCode::BAD_REQUEST,
            error(
                &format!("This model's maximum context length is 256 tokens. However, you requested {} tokens ({hi} in the messages, 300 in the completion). Please reduce the length of the messages or completion.", hi + 300),
                "invalid_request_error",
                Some("messages"),
                "context_length_exceeded",
            ),
        ),
        // Inside the window, over what the mesh can hold (64).
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":100}"#,
            StatusCode::BAD_REQUEST,
            error(
                &format!("This model's maximum context length is 64 tokens. However, you requested {} tokens ({hi} in the messages, 100 in the completion). Please reduce the length of the messages or completion.", hi + 100),
                "invalid_request_error",
                Some("messages"),
                "context_length_exceeded",
            ),
        ),
    ];
    for (path, body, status, want) in cases {
        assert_eq!(send_json(&r, path, body).await, (status, want), "{body}");
    }
    // Not JSON: the field is the body, the message serde's.
    let (status, v) = send_json(&r, "/v1/completions", "{not json").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        (
            &v["error"]["param"],
            &v["error"]["code"],
            &v["error"]["type"]
        ),
        (
            &json!("body"),
            &json!("invalid_value"),
            &json!("invalid_request_error")
        )
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("invalid JSON body: ")),
        "{v}"
    );
    // No key: 401 before the body is read.
    let anon = Request::post("/v1/completions")
        .body(Body::from(r#"{"prompt":"hi"}"#))
        .expect("request");
    let (status, body) = send(&r, anon).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        serde_json::from_str::<Value>(&body).expect("JSON"),
        error(
            "missing API key: send Authorization: Bearer YOUR_KEY",
            "invalid_request_error",
            None,
            "invalid_api_key"
        )
    );
    assert!(
        mesh.received().is_empty(),
        "a refused request reached the mesh"
    );
    let m = metrics(&r).await;
    assert_eq!(
        metric_lines(&m, "kvmesh_requests_rejected_total{"),
        [
            "kvmesh_requests_rejected_total{reason=\"context_length_exceeded\"} 2",
            "kvmesh_requests_rejected_total{reason=\"invalid_request\"} 6",
            "kvmesh_requests_rejected_total{reason=\"model_not_found\"} 1",
            "kvmesh_requests_rejected_total{reason=\"unauthenticated\"} 1",
        ]
    );
    assert_eq!(
        metric_lines(&m, "kvmesh_requests_total{"),
        ["kvmesh_requests_total{outcome=\"rejected\"} 10"]
    );
}

#[tokio::test]
async fn an_oversized_body_is_a_json_413() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, keyed());
    let big = format!("{{\"prompt\":\"{}\"}}", "a".repeat(3 << 20));
    let (status, v) = send_json(&r, "/v1/completions", &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        (
            &v["error"]["param"],
            &v["error"]["code"],
            &v["error"]["type"]
        ),
        (
            &json!("body"),
            &json!("invalid_body"),
            &json!("invalid_request_error")
        )
    );
    assert!(mesh.received().is_empty());
}
