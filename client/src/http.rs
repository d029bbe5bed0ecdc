//! The async HTTP/1.1 client, on hyper: a request, a response held open or
//! read whole, a keep-alive connection, and an SSE reader.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::Method;
use serde_json::Value;
use tokio::task::JoinHandle;

/// A line (or an event's data) of an event stream longer than this is
/// refused rather than buffered without bound.
pub const MAX_SSE_LINE: usize = 1 << 20;

/// What can go wrong talking to a server. The messages name the step
/// (`connect`, `handshake`, `no response`, `body`, `stream cut`), which the
/// tools use as an error kind.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The TCP connection was refused or failed.
    #[error("connect: {0}")]
    Connect(std::io::ErrorKind),
    /// The HTTP/1.1 handshake failed.
    #[error("handshake: {0}")]
    Handshake(hyper::Error),
    /// The request could not be built (a header name or value, the path).
    #[error("request: {0}")]
    Build(#[from] hyper::http::Error),
    /// The request was sent but no response head came back.
    #[error("no response: {0}")]
    Send(hyper::Error),
    /// The body of a response read whole failed.
    #[error("body: {0}")]
    Body(hyper::Error),
    /// An event stream's body failed part way.
    #[error("stream cut: {0}")]
    StreamCut(hyper::Error),
    /// An event-stream line (or one event's data) over [`MAX_SSE_LINE`].
    #[error("an SSE line over 1 MiB")]
    SseLineTooLong,
    /// A blocking call got no answer in time.
    #[error("no answer in {} s", .0.as_secs())]
    Timeout(Duration),
    /// A blocking call could not start its runtime.
    #[error("runtime: {0}")]
    Runtime(std::io::Error),
}

/// A request: method, path (with query), body, extra headers. Every
/// request says `Content-Type: application/json` (the gateway's only body
/// type) unless a header sets another.
#[derive(Clone, Debug)]
pub struct Request {
    /// The method.
    pub method: Method,
    /// The path and query, e.g. `/v1/completions`.
    pub path: String,
    /// The body (empty for none).
    pub body: Bytes,
    /// Extra headers, name and value, in order.
    pub headers: Vec<(String, String)>,
}

impl Request {
    /// A request with an empty body.
    pub fn new(method: Method, path: &str) -> Self {
        Self {
            method,
            path: path.to_owned(),
            body: Bytes::new(),
            headers: Vec::new(),
        }
    }

    /// `GET path`.
    pub fn get(path: &str) -> Self {
        Self::new(Method::GET, path)
    }

    /// `POST path` with a raw body (which need not be valid JSON).
    pub fn post(path: &str, body: impl Into<Bytes>) -> Self {
        Self::new(Method::POST, path).body(body)
    }

    /// `POST path` with a JSON body.
    pub fn post_json(path: &str, body: &Value) -> Self {
        Self::post(path, body.to_string())
    }

    /// The same request with `body`.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    /// The same request with one more header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// The same request with these headers added.
    pub fn headers(mut self, headers: &[(&str, &str)]) -> Self {
        for (name, value) in headers {
            self.headers.push(((*name).to_owned(), (*value).to_owned()));
        }
        self
    }

    /// The same request with `Authorization: Bearer KEY`.
    pub fn bearer(self, key: &str) -> Self {
        self.header("authorization", &format!("Bearer {key}"))
    }

    /// The same request with a fault plan (`kvmesh_faults::HEADER`),
    /// honoured only by a router that injects faults.
    pub fn fault(self, spec: &str) -> Self {
        self.header(kvmesh_faults::HEADER, spec)
    }

    /// The hyper request to `addr` (which goes in `Host`).
    pub fn build(&self, addr: &str) -> Result<hyper::Request<Full<Bytes>>, Error> {
        let mut req = hyper::Request::builder()
            .method(self.method.clone())
            .uri(self.path.as_str())
            .header(hyper::header::HOST, addr);
        let mut typed = false;
        for (name, value) in &self.headers {
            typed |= name.eq_ignore_ascii_case("content-type");
            req = req.header(name.as_str(), value.as_str());
        }
        if !typed {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        Ok(req.body(Full::new(self.body.clone()))?)
    }
}

/// A response read whole: status, headers (names lower case), body.
#[derive(Clone, Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Bytes,
}

impl Reply {
    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    pub fn json(&self) -> Result<Value, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        header_of(&self.headers, name)
    }
}

fn header_of<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn header_list(h: &hyper::HeaderMap) -> Vec<(String, String)> {
    h.iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// Aborts a connection's task on drop, which closes its socket.
#[derive(Debug)]
struct ConnTask(JoinHandle<()>);

impl Drop for ConnTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A keep-alive HTTP/1.1 connection: requests one after another. Dropping
/// it closes the socket.
#[derive(Debug)]
pub struct Connection {
    addr: String,
    sender: SendRequest<Full<Bytes>>,
    // Declared after `sender`, so the sender goes first.
    _task: ConnTask,
}

impl Connection {
    /// Connects to `addr` (`HOST:PORT`), with `TCP_NODELAY`.
    pub async fn open(addr: &str) -> Result<Self, Error> {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| Error::Connect(e.kind()))?;
        let _ = tcp.set_nodelay(true);
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(Error::Handshake)?;
        let task = ConnTask(tokio::spawn(async move {
            let _ = conn.await;
        }));
        Ok(Self {
            addr: addr.to_owned(),
            sender,
            _task: task,
        })
    }

    /// Whether the connection can take a request now (false once the
    /// server closed it); waits while the previous response is read.
    pub async fn ready(&mut self) -> bool {
        self.sender.ready().await.is_ok()
    }

    /// Sends `req` and returns the response head with its body unread.
    pub async fn send(&mut self, req: &Request) -> Result<hyper::Response<Incoming>, Error> {
        let req = req.build(&self.addr)?;
        self.sender.send_request(req).await.map_err(Error::Send)
    }

    /// Sends `req` and reads the whole response.
    pub async fn exchange(&mut self, req: &Request) -> Result<Reply, Error> {
        let resp = self.send(req).await?;
        collect(resp).await
    }
}

async fn collect(resp: hyper::Response<Incoming>) -> Result<Reply, Error> {
    let status = resp.status().as_u16();
    let headers = header_list(resp.headers());
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(Error::Body)?
        .to_bytes();
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// A response whose body is still to be read; it owns its connection, so
/// dropping it closes the socket (the client goes away).
#[derive(Debug)]
pub struct Open {
    /// The status code.
    pub status: u16,
    /// Header names (lower case) and values, in order.
    pub headers: Vec<(String, String)>,
    body: Incoming,
    // After `body`: the body goes first, then the connection.
    conn: Connection,
}

impl Open {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        header_of(&self.headers, name)
    }

    /// Reads the rest of the body.
    pub async fn read_all(self) -> Result<Reply, Error> {
        let body = self.body.collect().await.map_err(Error::Body)?.to_bytes();
        Ok(Reply {
            status: self.status,
            headers: self.headers,
            body,
        })
    }

    /// The body as server-sent events.
    pub fn events(self) -> SseReader {
        SseReader::new(self.body, Some(self.conn))
    }
}

/// Sends `req` to `addr` on a fresh connection and returns the response
/// with its body unread.
pub async fn send(addr: &str, req: &Request) -> Result<Open, Error> {
    let mut conn = Connection::open(addr).await?;
    let resp = conn.send(req).await?;
    let status = resp.status().as_u16();
    let headers = header_list(resp.headers());
    Ok(Open {
        status,
        headers,
        body: resp.into_body(),
        conn,
    })
}

/// Sends `req` to `addr` on a fresh connection and reads the whole response.
pub async fn request(addr: &str, req: &Request) -> Result<Reply, Error> {
    send(addr, req).await?.read_all().await
}

/// `GET path` on a fresh connection.
pub async fn get(addr: &str, path: &str) -> Result<Reply, Error> {
    request(addr, &Request::get(path)).await
}

/// The `data` of server-sent events, read off a response body as it
/// arrives. An event ends at a blank line; several `data:` lines of one
/// event are joined with `\n`; comments (`:keep-alive`) and other fields
/// are skipped.
#[derive(Debug)]
pub struct SseReader {
    body: Incoming,
    buf: Vec<u8>,
    data: String,
    has_data: bool,
    // Keeps the socket open while events are read; closed on drop.
    _conn: Option<Connection>,
}

impl SseReader {
    /// Reads events off `body`; `conn`, if given, lives as long as the
    /// reader.
    pub fn new(body: Incoming, conn: Option<Connection>) -> Self {
        Self {
            body,
            buf: Vec::new(),
            data: String::new(),
            has_data: false,
            _conn: conn,
        }
    }

    /// The next event's data; `Ok(None)` when the body ends (an event not
    /// closed by a blank line by then is not returned).
    pub async fn next(&mut self) -> Result<Option<String>, Error> {
        loop {
            while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let raw: Vec<u8> = self.buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&raw);
                let line = line.trim_end_matches(['\n', '\r']);
                if let Some(d) = line.strip_prefix("data:") {
                    if self.has_data {
                        self.data.push('\n');
                    }
                    self.data.push_str(d.strip_prefix(' ').unwrap_or(d));
                    self.has_data = true;
                } else if line.is_empty() && self.has_data {
                    self.has_data = false;
                    return Ok(Some(std::mem::take(&mut self.data)));
                }
            }
            if self.buf.len() > MAX_SSE_LINE || self.data.len() > MAX_SSE_LINE {
                return Err(Error::SseLineTooLong);
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(Error::StreamCut(e)),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}
