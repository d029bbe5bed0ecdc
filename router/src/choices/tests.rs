//! Several choices over the scripted mesh, through the HTTP gateway:
//! later samples start only after the first's first event, each sample its
//! own seed, prompt-major indices, usage counting each prompt once, every
//! choice admitted before any starts, and one failure ending the request.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::error::Rejection;
use crate::mesh::fake::{router, FakeMesh, Script, Step};
use crate::mesh::{Event, Finish};
use crate::{Router, RouterConfig};

fn text(t: &str) -> Event {
    Event::Text {
        text: t.into(),
        logprobs: Vec::new(),
    }
}

fn done(finish: Finish, completion_tokens: usize, cached_tokens: usize) -> Event {
    Event::Done {
        finish,
        completion_tokens,
        cached_tokens,
    }
}

async fn post(r: &Router, path: &str, body: Value) -> (StatusCode, String) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let resp = r.http().oneshot(req).await.expect("infallible");
    crate::error::tests::body_of(resp).await
}

async fn received_at_least(mesh: &FakeMesh, n: usize) {
    for _ in 0..200 {
        if mesh.received().len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "the mesh received {} of {n} requests",
        mesh.received().len()
    );
}

#[tokio::test]
async fn later_samples_start_after_the_first_is_prefilled_each_with_its_seed() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, RouterConfig::default());
    let gate = Arc::new(Notify::new());
    mesh.push(Script::Play(vec![
        Step::Gate(Arc::clone(&gate)),
        Step::Send(text("A")),
        Step::Send(done(Finish::Stop, 1, 0)),
    ]));
    mesh.play(vec![text("B"), done(Finish::Length, 2, 16)]);
    mesh.play(vec![text("C"), done(Finish::Stop, 1, 16)]);
    let call = {
        let r = r.clone();
        tokio::spawn(async move {
            post(
                &r,
                "/v1/completions",
                json!({"prompt": "hi", "n": 3, "seed": 7, "max_tokens": 2}),
            )
            .await
        })
    };
    // Only the first sample runs until its first event (prefill's token).
    received_at_least(&mesh, 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(mesh.received().len(), 1, "later samples waited");
    gate.notify_one();
    let (status, body) = call.await.expect("the call");
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    let prompt = r.tokenizer().encode("hi").expect("encode");
    let choices: Vec<(u64, &str, &str)> = v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| {
            (
                c["index"].as_u64().expect("index"),
                c["text"].as_str().expect("text"),
                c["finish_reason"].as_str().expect("finish"),
            )
        })
        .collect();
    assert_eq!(
        choices,
        [(0, "A", "stop"), (1, "B", "length"), (2, "C", "stop")]
    );
    // The prompt once; every sample's tokens; the first sample's cache hit.
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": 4,
            "total_tokens": prompt.len() + 4, "prompt_tokens_details": {"cached_tokens": 0}})
    );
    let jobs = mesh.received();
    assert_eq!(
        jobs.iter().map(|j| j.sampling.seed).collect::<Vec<_>>(),
        [7, 8, 9]
    );
    assert!(jobs.iter().all(|j| j.prompt_ids == prompt));
    mesh.idle().await;
}

#[tokio::test]
async fn a_batch_streams_prompt_major_indexed_chunks_with_usage_last() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, RouterConfig::default());
    for _ in 0..4 {
        mesh.play(vec![text("x"), done(Finish::Length, 1, 0)]);
    }
    let (status, body) = post(
        &r,
        "/v1/completions",
        json!({"prompt": ["a", "b"], "n": 2, "echo": true, "max_tokens": 1, "stream": true}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let frames: Vec<&str> = body
        .split("\n\n")
        .filter(|f| f.starts_with("data: "))
        .map(|f| &f["data: ".len()..])
        .collect();
    assert_eq!(frames.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).expect("a JSON chunk"))
        .collect();
    // Each choice opens with its prompt's echo, then its text, then its
    // finish; only the very last chunk carries usage.
    let mut per: Vec<Vec<(String, Value)>> = vec![Vec::new(); 4];
    for c in &chunks {
        let choice = &c["choices"][0];
        let i = usize::try_from(choice["index"].as_u64().expect("index")).expect("small");
        per[i].push((
            choice["text"].as_str().expect("text").to_owned(),
            choice["finish_reason"].clone(),
        ));
    }
    for (i, p) in per.iter().enumerate() {
        let echo = if i < 2 { "a" } else { "b" };
        assert_eq!(
            p,
            &vec![
                (echo.to_owned(), Value::Null),
                ("x".to_owned(), Value::Null),
                (String::new(), json!("length")),
            ],
            "choice {i}"
        );
    }
    let with_usage: Vec<&Value> = chunks.iter().filter(|c| c.get("usage").is_some()).collect();
    assert_eq!(with_usage.len(), 1);
    assert!(std::ptr::eq(with_usage[0], chunks.last().expect("chunks")));
    let a = r.tokenizer().encode("a").expect("encode").len();
    let b = r.tokenizer().encode("b").expect("encode").len();
    assert_eq!(with_usage[0]["usage"]["prompt_tokens"], a + b);
    assert_eq!(with_usage[0]["usage"]["completion_tokens"], 4);
    // Two jobs per prompt, seeds s and s + 1 within each.
    let jobs = mesh.received();
    for p in ["a", "b"] {
        let ids = r.tokenizer().encode(p).expect("encode");
        let mut seeds: Vec<u64> = jobs
            .iter()
            .filter(|j| j.prompt_ids == ids)
            .map(|j| j.sampling.seed)
            .collect();
        seeds.sort_unstable();
        assert_eq!(seeds.len(), 2, "{p}");
        assert_eq!(seeds[1], seeds[0].wrapping_add(1), "{p}");
    }
    mesh.idle().await;
}

#[tokio::test]
async fn every_choice_is_admitted_before_any_starts() {
    let mesh = FakeMesh::new(Some(64));
    let r = router(&mesh, RouterConfig::default());
    let long = "hello ".repeat(60);
    let (status, body) = post(
        &r,
        "/v1/completions",
        json!({"prompt": ["hi", long], "max_tokens": 8}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("context_length_exceeded"), "{body}");
    assert!(mesh.received().is_empty(), "nothing started");
    assert_eq!(mesh.running(), 0);
}

#[tokio::test]
async fn a_sample_that_cannot_start_ends_the_request_and_the_others_are_dropped() {
    let mesh = FakeMesh::new(Some(256));
    let r = router(&mesh, RouterConfig::default());
    let gate = Arc::new(Notify::new());
    mesh.push(Script::Play(vec![
        Step::Send(text("A")),
        Step::Gate(Arc::clone(&gate)),
        Step::Send(done(Finish::Stop, 1, 0)),
    ]));
    mesh.push(Script::Refuse(Rejection::NoHealthyNode { role: "decode" }));
    let (status, body) = post(
        &r,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["error"]["code"], "service_unavailable", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("decode"),
        "{v}"
    );
    // The first sample was dropped mid-script: the mesh saw it abandoned.
    mesh.idle().await;
    assert_eq!(mesh.abandoned(), 1);
    assert_eq!(mesh.received().len(), 2);
}
