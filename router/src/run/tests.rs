//! The gateway's drain over a scripted mesh, on real listeners (port 0):
//! admission and health refuse at once, a request in flight past the
//! deadline ends with the terminal `shutting_down` event and the mesh sees
//! its client gone, and `run` returns.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::mesh::fake::{router, FakeMesh, Script, Step};
use crate::mesh::{Event, Finish};
use crate::{run, Listeners, RouterConfig};

fn post(body: &str) -> Request<Body> {
    Request::post("/v1/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("request")
}

#[tokio::test]
async fn a_drain_refuses_new_work_and_ends_what_outlives_its_deadline() {
    let mesh = FakeMesh::new(Some(256));
    let gate = Arc::new(Notify::new());
    // Held at the gate until the drain's deadline cuts it.
    mesh.push(Script::Play(vec![
        Step::Send(Event::Text {
            text: "Once".into(),
            logprobs: Vec::new(),
        }),
        Step::Gate(Arc::clone(&gate)),
        Step::Send(Event::Done {
            finish: Finish::Length,
            completion_tokens: 2,
            cached_tokens: 0,
        }),
    ]));
    let r = router(
        &mesh,
        RouterConfig {
            drain_timeout: Duration::from_millis(200),
            ..RouterConfig::default()
        },
    );
    let listeners = Listeners::bind("127.0.0.1:0", "127.0.0.1:0")
        .await
        .expect("bind");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(run(r.clone(), listeners, async {
        let _ = stopped.await;
    }));
    let resp = r
        .http()
        .oneshot(post(r#"{"prompt":"hi","max_tokens":2,"stream":true}"#))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(r.in_flight(), 1);
    stop.send(()).expect("signal");
    // The drain starts at once: a new request and health are refused.
    while !r.is_draining() {
        tokio::task::yield_now().await;
    }
    let (status, body) = crate::error::tests::body_of(
        r.http()
            .oneshot(post(r#"{"prompt":"hi","max_tokens":2}"#))
            .await
            .expect("infallible"),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["error"]["code"], "shutting_down");
    let health = r
        .http()
        .oneshot(Request::get("/health").body(Body::empty()).expect("req"))
        .await
        .expect("infallible");
    assert_eq!(health.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The stream in flight: its text, then the terminal error, then [DONE].
    let (_, sse) = crate::error::tests::body_of(resp).await;
    let data: Vec<&str> = sse
        .split("\n\n")
        .filter_map(|f| f.strip_prefix("data: "))
        .collect();
    let [.., err, done] = data.as_slice() else {
        panic!("{sse}")
    };
    assert_eq!(*done, "[DONE]");
    let err: serde_json::Value = serde_json::from_str(err).expect("JSON");
    assert_eq!(err["error"]["code"], "shutting_down", "{sse}");
    assert!(sse.contains("Once"), "{sse}");
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("run returned")
        .expect("task")
        .expect("served");
    // The mesh saw its client gone and gave its slot back.
    mesh.idle().await;
    assert_eq!(mesh.abandoned(), 1);
    assert_eq!(r.in_flight(), 0);
}
