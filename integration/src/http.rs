//! The tests' HTTP calls: `kvmesh_client`'s blocking client, with the
//! panics a test wants (a gateway that cannot be reached, or a body that
//! should be JSON and is not, fails the test with what it got).

use kvmesh_client::blocking;
use kvmesh_client::http::Request;

/// A response: status, headers (lower-cased names), body.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header name (lower case) and value.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: String,
}

impl Response {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// An open response whose body is read as it arrives (SSE); dropping it
/// closes the connection.
#[derive(Debug)]
pub struct Streaming {
    /// The status code.
    pub status: u16,
    inner: blocking::Streaming,
}

impl Streaming {
    /// The next SSE event's data, or `None` at the end of the stream (or
    /// when it was cut: the tests then look at what came before).
    pub fn next_event(&mut self) -> Option<String> {
        self.inner.next_event().ok().flatten()
    }
}

fn build(method: &str, path: &str, body: Option<&str>, headers: &[(&str, &str)]) -> Request {
    let method = method
        .parse()
        .unwrap_or_else(|e| panic!("method {method}: {e}"));
    Request::new(method, path)
        .body(body.unwrap_or_default().to_owned())
        .headers(headers)
}

/// GET or POST, read the whole response.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Response {
    request_with(addr, method, path, body, None)
}

/// [`request`] with an `Authorization` header value.
pub fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<&str>,
) -> Response {
    let auth: Vec<(&str, &str)> = auth.map(|a| ("Authorization", a)).into_iter().collect();
    request_headers(addr, method, path, body, &auth)
}

/// [`request`] with extra headers (name, value).
pub fn request_headers(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Response {
    send(addr, &build(method, path, body, headers))
        .unwrap_or_else(|e| panic!("{method} {addr}{path}: {e}"))
}

/// Send `req` and read the whole response, or the transport error.
fn send(addr: &str, req: &Request) -> Result<Response, kvmesh_client::http::Error> {
    let r = blocking::request(addr, req)?;
    Ok(Response {
        status: r.status,
        body: r.text(),
        headers: r.headers,
    })
}

/// POST a JSON body.
pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// GET.
pub fn get(addr: &str, path: &str) -> Response {
    request(addr, "GET", path, None)
}

/// GET that returns the transport error instead of panicking, for polling
/// a server that is still starting (it may refuse, or accept and drop, a
/// connection before it serves).
pub fn try_get(addr: &str, path: &str) -> Result<Response, kvmesh_client::http::Error> {
    send(addr, &build("GET", path, None, &[]))
}

/// POST and return the response open, to read SSE events one by one.
pub fn post_streaming(addr: &str, path: &str, body: &serde_json::Value) -> Streaming {
    post_streaming_headers(addr, path, body, &[])
}

/// [`post_streaming`] with extra headers (name, value).
pub fn post_streaming_headers(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Streaming {
    let req = build("POST", path, Some(&body.to_string()), headers);
    let inner = blocking::stream(addr, &req).unwrap_or_else(|e| panic!("POST {addr}{path}: {e}"));
    Streaming {
        status: inner.status,
        inner,
    }
}

/// The gateway's metrics at `addr`, parsed.
pub fn metrics(addr: &str) -> kvmesh_client::Metrics {
    metrics_with(addr, &format!("Bearer {SCRAPE_KEY}"))
}

/// The key every test mesh with API keys also accepts, with the `metrics`
/// scope only (as an operator's Prometheus would hold one): [`metrics`]
/// sends it, and a gateway without keys ignores it.
pub const SCRAPE_KEY: &str = "kvmesh-test-scrape-key";

/// The gateway's metrics at `addr`, read with `auth` (`Bearer KEY`: a key
/// with the metrics scope, where the gateway has API keys).
pub fn metrics_with(addr: &str, auth: &str) -> kvmesh_client::Metrics {
    let r = request_with(addr, "GET", "/metrics", None, Some(auth));
    assert_eq!(r.status, 200, "{addr}/metrics: {}", r.body);
    kvmesh_client::Metrics::parse(r.body)
}

/// Waits (bounded: 10 s) until the router at `addr` has received two
/// load reports from each of `nodes` since this call, so the node figures
/// it relays are newer than anything that happened before the call (the
/// first may have been polled before it). The signal is the router's
/// `kvmesh_router_node_load_reports_total`, not a sleep of some polls.
pub fn wait_fresh_reports(addr: &str, nodes: &[&str]) {
    let count = |m: &kvmesh_client::Metrics, n: &str| {
        m.first("kvmesh_router_node_load_reports_total", &[("node", n)])
            .unwrap_or(0.0)
    };
    let before = metrics(addr);
    let start: Vec<f64> = nodes.iter().map(|n| count(&before, n)).collect();
    let t0 = std::time::Instant::now();
    loop {
        let m = metrics(addr);
        if nodes
            .iter()
            .zip(&start)
            .all(|(n, s)| count(&m, n) >= s + 2.0)
        {
            return;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "no two fresh load reports from {nodes:?}:\n{}",
            m.text()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The value of the sample a selector names at `addr`
/// (`name{label="v"}` exactly, `name{label="v"` at least those labels; see
/// [`kvmesh_client::Metrics::get`]).
pub fn metric(addr: &str, selector: &str) -> Option<f64> {
    metrics(addr).get(selector)
}

/// A whole (unstreamed) generation's body; anything but 200 fails.
pub fn complete(addr: &str, path: &str, body: &serde_json::Value) -> serde_json::Value {
    let r = post(addr, path, body);
    assert_eq!(r.status, 200, "{body}: {}", r.body);
    r.json()
}

/// A streamed generation's chunks (parsed), `[DONE]` excluded; a status
/// other than 200, an error event or a stream without `[DONE]` fails.
pub fn stream_chunks(addr: &str, path: &str, body: &serde_json::Value) -> Vec<serde_json::Value> {
    let mut s = post_streaming(addr, path, body);
    assert_eq!(s.status, 200, "{body}");
    let mut out = Vec::new();
    while let Some(data) = s.next_event() {
        if data == "[DONE]" {
            return out;
        }
        let v: serde_json::Value =
            serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert!(v.get("error").is_none(), "{v}");
        out.push(v);
    }
    panic!("the stream ended without [DONE]: {body}");
}

/// The text of a body's or chunk's first choice: a completion's `text`, a
/// chat message's or delta's `content` (empty when there is none).
pub fn choice_text(v: &serde_json::Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .or_else(|| c["delta"]["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}
