//! HTTP/1.1 over hyper, one connection per request, and one request of the load.

use super::*;

/// Aborts the connection's task on drop, which closes the socket: how a
/// client "goes away".
pub(crate) struct ConnGuard(tokio::task::JoinHandle<()>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A JSON request to the gateway at `addr`, with extra `headers`.
pub(crate) fn json_request(
    addr: &str,
    method: hyper::Method,
    path: &str,
    body: Bytes,
    headers: &[(&str, String)],
) -> Result<hyper::Request<Full<Bytes>>, String> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr)
        .header(hyper::header::CONTENT_TYPE, "application/json");
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    req.body(Full::new(body))
        .map_err(|e| format!("request: {e}"))
}

pub(crate) async fn send(
    addr: &str,
    method: hyper::Method,
    path: &str,
    body: Option<String>,
    fault: Option<&str>,
) -> Result<(hyper::Response<hyper::body::Incoming>, ConnGuard), String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {}", e.kind()))?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    let guard = ConnGuard(tokio::spawn(async move {
        let _ = conn.await;
    }));
    let headers: Vec<(&str, String)> = fault
        .map(|f| (FAULT_HEADER, f.to_owned()))
        .into_iter()
        .collect();
    let req = json_request(
        addr,
        method,
        path,
        Bytes::from(body.unwrap_or_default()),
        &headers,
    )?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("no response: {e}"))?;
    Ok((resp, guard))
}

/// A line of an event stream longer than this is refused (the stream is
/// counted broken) rather than buffered without bound.
const MAX_SSE_LINE: usize = 1 << 20;

/// The `data` of server-sent events, read off a response body (the soak
/// client's and the load generator's streams).
pub(crate) struct SseReader {
    body: hyper::body::Incoming,
    buf: Vec<u8>,
    data: String,
}

impl SseReader {
    pub(crate) fn new(body: hyper::body::Incoming) -> Self {
        Self {
            body,
            buf: Vec::new(),
            data: String::new(),
        }
    }

    /// The next event's data; `Ok(None)` when the body ends.
    pub(crate) async fn next(&mut self) -> Result<Option<String>, String> {
        loop {
            while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let raw: Vec<u8> = self.buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&raw);
                let line = line.trim_end_matches(['\n', '\r']);
                if let Some(d) = line.strip_prefix("data:") {
                    if !self.data.is_empty() {
                        self.data.push('\n');
                    }
                    self.data.push_str(d.strip_prefix(' ').unwrap_or(d));
                } else if line.is_empty() && !self.data.is_empty() {
                    return Ok(Some(std::mem::take(&mut self.data)));
                }
                // Otherwise a comment (keep-alive) or another field.
            }
            if self.buf.len() > MAX_SSE_LINE || self.data.len() > MAX_SSE_LINE {
                return Err("an SSE line over 1 MiB".into());
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(format!("stream cut: {e}")),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}

pub(crate) async fn read_all(
    resp: hyper::Response<hyper::body::Incoming>,
) -> Result<String, String> {
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// GET `path`: status and body.
pub(crate) async fn get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let (resp, _guard) = send(addr, hyper::Method::GET, path, None, None).await?;
    let status = resp.status().as_u16();
    Ok((status, read_all(resp).await?))
}

// ---------------------------------------------------------------------------
// One request.

/// What one request is.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    pub(super) prompt: usize,
    pub(super) stream: bool,
    pub(super) fault: Option<usize>,
    /// Drop the connection after this many SSE events.
    pub(super) disconnect_after: Option<usize>,
}

/// How a request ended, as the client saw it.
#[derive(Debug)]
pub(super) enum Ending {
    /// A whole answer: its text and finish reason.
    Completed { text: String, finish: String },
    /// A non-200 status before any output.
    Http {
        status: u16,
        kind: String,
        message: String,
    },
    /// An error event in the SSE stream.
    SseError { kind: String, message: String },
    /// The client dropped the connection, as planned.
    Disconnected,
    /// No clear ending: connection failed or cut, stream ended without
    /// `[DONE]`, unparsable output, or no answer in time.
    Broken(String),
}

/// `type/code` of an OpenAI-style error body, and its message.
pub(super) fn error_kind(v: &Value) -> (String, String) {
    let e = &v["error"];
    let s = |k: &str| e[k].as_str().unwrap_or("?").to_owned();
    (format!("{}/{}", s("type"), s("code")), s("message"))
}

/// The text of choice 0: a completion's `text`, a chat message's
/// `content`, or a chat delta's `content`.
pub(super) fn choice_text(c: &Value) -> &str {
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .or_else(|| c["delta"]["content"].as_str())
        .unwrap_or_default()
}

pub(super) async fn one_request(addr: &str, r: &Reference, plan: Plan) -> Ending {
    let (path, mut body) = if r.chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": r.text}]}),
        )
    } else {
        ("/v1/completions", json!({"prompt": r.text}))
    };
    body["max_tokens"] = json!(r.max_tokens);
    body["temperature"] = json!(0);
    body["stream"] = json!(plan.stream);
    let fault = plan.fault.map(|i| FAULTS[i].spec);
    let (resp, guard) = match send(
        addr,
        hyper::Method::POST,
        path,
        Some(body.to_string()),
        fault,
    )
    .await
    {
        Ok(x) => x,
        Err(e) => return Ending::Broken(e),
    };
    let status = resp.status().as_u16();
    if status != 200 {
        let body = read_all(resp).await.unwrap_or_default();
        let (kind, message) = match serde_json::from_str::<Value>(&body) {
            Ok(v) => error_kind(&v),
            Err(_) => ("unparsed body".into(), body),
        };
        return Ending::Http {
            status,
            kind,
            message,
        };
    }
    if !plan.stream {
        let body = match read_all(resp).await {
            Ok(b) => b,
            Err(e) => return Ending::Broken(e),
        };
        let Ok(v) = serde_json::from_str::<Value>(&body) else {
            return Ending::Broken("200 with a body that is not JSON".into());
        };
        let c = &v["choices"][0];
        let Some(finish) = c["finish_reason"].as_str() else {
            return Ending::Broken("200 without a finish_reason".into());
        };
        return Ending::Completed {
            text: choice_text(c).to_owned(),
            finish: finish.to_owned(),
        };
    }
    if plan.disconnect_after == Some(0) {
        drop(resp);
        drop(guard);
        return Ending::Disconnected;
    }
    let mut sse = SseReader::new(resp.into_body());
    let mut events = 0usize;
    let mut text = String::new();
    let mut finish: Option<String> = None;
    loop {
        let event = match sse.next().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ending::Broken("the stream ended without [DONE]".into()),
            Err(e) => return Ending::Broken(e),
        };
        if event == "[DONE]" {
            return match finish {
                Some(finish) => Ending::Completed { text, finish },
                None => Ending::Broken("[DONE] without a finish_reason".into()),
            };
        }
        let Ok(v) = serde_json::from_str::<Value>(&event) else {
            return Ending::Broken("an SSE event that is not JSON".into());
        };
        if v.get("error").is_some() {
            let (kind, message) = error_kind(&v);
            return Ending::SseError { kind, message };
        }
        let c = &v["choices"][0];
        text.push_str(choice_text(c));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
        events += 1;
        if finish.is_none() && plan.disconnect_after.is_some_and(|k| events >= k) {
            drop(sse);
            drop(guard);
            return Ending::Disconnected;
        }
    }
}
