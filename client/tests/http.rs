//! The client against a real axum server on 127.0.0.1:0: a chunked SSE
//! stream (events split across chunks, multi-line data, comments), a JSON
//! error body with a non-200 status, headers both ways, a keep-alive
//! connection, a client that goes away, and the blocking facade.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvmesh_client::blocking;
use kvmesh_client::http::{self, Connection, Request};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Pieces of an event stream, each sent as its own chunk: an event split
/// in the middle of its data, a comment, a two-line event, CRLF endings.
const PIECES: [&str; 6] = [
    ": keep-alive\n\n",
    "data: {\"n\":",
    "1}\n\n",
    "data: line one\ndata: line two\n\n",
    "event: x\r\ndata: crlf\r\n\r\n",
    "data: [DONE]\n\n",
];

async fn sse() -> Response {
    let chunks = tokio_stream::iter(
        PIECES
            .iter()
            .map(|p| Ok::<_, Infallible>(axum::body::Bytes::from_static(p.as_bytes()))),
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(chunks))
        .unwrap_or_default()
}

async fn bad(headers: HeaderMap, body: String) -> Response {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (
        StatusCode::BAD_REQUEST,
        [("x-echo", auth)],
        axum::Json(
            json!({"error": {"type": "invalid_request_error", "code": "bad", "message": body}}),
        ),
    )
        .into_response()
}

/// A stream that sends one event and then waits: the test sees the socket
/// close when the client drops the response.
async fn hold(axum::extract::State(gone): axum::extract::State<mpsc::Sender<()>>) -> Response {
    let (tx, rx) = mpsc::channel::<Result<axum::body::Bytes, Infallible>>(1);
    tokio::spawn(async move {
        let _ = tx.send(Ok("data: first\n\n".into())).await;
        tx.closed().await;
        let _ = gone.send(()).await;
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_default()
}

async fn server() -> (String, mpsc::Receiver<()>) {
    let (gone_tx, gone_rx) = mpsc::channel(1);
    let app = axum::Router::new()
        .route("/sse", get(sse))
        .route("/bad", post(bad))
        .route("/hold", get(hold))
        .route(
            "/missing-on-purpose",
            get(|| async { StatusCode::NOT_FOUND }),
        )
        .route("/text", get(|| async { "plain" }))
        .route(
            "/metrics",
            get(|| async { "# TYPE up gauge\nup{node=\"a\"} 1\nup{node=\"b\"} 0\n" }),
        )
        .with_state(gone_tx);
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (addr, gone_rx)
}

#[tokio::test]
async fn chunked_sse_is_read_event_by_event() {
    let (addr, _) = server().await;
    let open = http::send(&addr, &Request::get("/sse"))
        .await
        .expect("send");
    assert_eq!(open.status, 200);
    assert_eq!(open.header("Content-Type"), Some("text/event-stream"));
    assert_eq!(open.header("transfer-encoding"), Some("chunked"));
    let mut events = open.events();
    let mut got = Vec::new();
    while let Some(e) = events.next().await.expect("event") {
        got.push(e);
    }
    assert_eq!(got, ["{\"n\":1}", "line one\nline two", "crlf", "[DONE]"]);
}

#[tokio::test]
async fn a_json_error_body_and_its_status_come_back() {
    let (addr, _) = server().await;
    let req = Request::post("/bad", "{not json").bearer("sk-1");
    let r = http::request(&addr, &req).await.expect("request");
    assert_eq!(r.status, 400);
    assert_eq!(r.header("x-echo"), Some("Bearer sk-1"));
    let v: Value = r.json().expect("json body");
    assert_eq!(v["error"]["code"], "bad");
    assert_eq!(v["error"]["message"], "{not json");
    let r = http::get(&addr, "/missing-on-purpose").await.expect("404");
    assert_eq!((r.status, r.body.len()), (404, 0));
    let r = http::get(&addr, "/nowhere").await.expect("no route");
    assert_eq!(r.status, 404);
    assert!(r.json().is_err());
}

#[tokio::test]
async fn a_keep_alive_connection_takes_requests_in_turn() {
    let (addr, _) = server().await;
    let mut c = Connection::open(&addr).await.expect("connect");
    for _ in 0..3 {
        assert!(c.ready().await);
        let r = c.exchange(&Request::get("/text")).await.expect("exchange");
        assert_eq!((r.status, r.text().as_str()), (200, "plain"));
    }
}

#[tokio::test]
async fn dropping_a_response_closes_the_connection() {
    let (addr, mut gone) = server().await;
    let mut events = http::send(&addr, &Request::get("/hold"))
        .await
        .expect("send")
        .events();
    assert_eq!(
        events.next().await.expect("event").as_deref(),
        Some("first")
    );
    drop(events);
    tokio::time::timeout(Duration::from_secs(10), gone.recv())
        .await
        .expect("the server saw the client go");
}

#[tokio::test]
async fn connect_errors_name_the_step() {
    // A port nothing listens on: bind one, then close it.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    drop(l);
    let e = http::get(&addr, "/").await.expect_err("refused");
    assert!(e.to_string().starts_with("connect: "), "{e}");
    let e = Request::get("/").header("bad name", "x").build(&addr);
    assert!(e.is_err());
}

#[test]
fn the_blocking_facade_reads_the_same() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (addr, mut gone) = rt.block_on(server());
    let r = blocking::request(&addr, &Request::post_json("/bad", &json!({"a": 1}))).expect("bad");
    assert_eq!(r.status, 400);
    assert_eq!(r.json().expect("json")["error"]["message"], "{\"a\":1}");
    let mut s = blocking::stream(&addr, &Request::get("/sse")).expect("stream");
    assert_eq!(s.status, 200);
    let mut got = Vec::new();
    while let Some(e) = s.next_event().expect("event") {
        got.push(e);
    }
    assert_eq!(got.len(), 4);
    assert_eq!(s.next_event().expect("after the end"), None);
    let mut s = blocking::stream(&addr, &Request::get("/hold")).expect("hold");
    assert_eq!(s.next_event().expect("event").as_deref(), Some("first"));
    drop(s);
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), gone.recv())
            .await
            .expect("the server saw the client go")
    });
    // From inside a runtime, too.
    let text = rt.block_on(async { blocking::get(&addr, "/text").expect("get").text() });
    assert_eq!(text, "plain");
    let m = blocking::scrape(&addr).expect("scrape");
    assert_eq!(m.get("up{node=\"b\"}"), Some(0.0));
    assert_eq!(m.sum("up", &[]), 1.0);
}
