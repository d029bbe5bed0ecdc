//! A minimal HTTP/1.1 client over `std::net::TcpStream`, enough for the
//! gateway's JSON and SSE responses (fixed length or chunked), so the tests
//! exercise the real server without pulling in a client stack.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

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

/// An open response whose body is read as it arrives (SSE).
#[derive(Debug)]
pub struct Streaming {
    /// The status code.
    pub status: u16,
    reader: BufReader<TcpStream>,
    chunked: bool,
    chunk_left: usize,
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let body = body.unwrap_or("");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send request");
    s
}

fn head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    reader.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).expect("header");
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"))
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
    let mut reader = BufReader::new(send(addr, method, path, body, headers));
    let (status, headers) = head(&mut reader);
    let mut raw = Vec::new();
    reader.read_to_end(&mut raw).expect("body");
    let body = if is_chunked(&headers) {
        dechunk(&raw)
    } else {
        raw
    };
    Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// POST a JSON body.
pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// GET.
pub fn get(addr: &str, path: &str) -> Response {
    request(addr, "GET", path, None)
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&raw[..eol]).trim(), 16).unwrap_or(0);
        raw = &raw[eol + 2..];
        if size == 0 || raw.len() < size {
            break;
        }
        out.extend_from_slice(&raw[..size]);
        raw = raw.get(size + 2..).unwrap_or_default();
    }
    out
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
    let mut reader = BufReader::new(send(addr, "POST", path, Some(&body.to_string()), headers));
    let (status, headers) = head(&mut reader);
    Streaming {
        status,
        chunked: is_chunked(&headers),
        reader,
        chunk_left: 0,
    }
}

impl Streaming {
    fn read_line(&mut self) -> Option<String> {
        let mut out = Vec::new();
        loop {
            if self.chunked && self.chunk_left == 0 {
                let mut size = String::new();
                if self.reader.read_line(&mut size).ok()? == 0 {
                    return None;
                }
                if size.trim().is_empty() {
                    continue;
                }
                self.chunk_left = usize::from_str_radix(size.trim(), 16).ok()?;
                if self.chunk_left == 0 {
                    return None;
                }
            }
            let mut b = [0u8; 1];
            if self.reader.read_exact(&mut b).is_err() {
                return None;
            }
            if self.chunked {
                self.chunk_left -= 1;
                if self.chunk_left == 0 {
                    let mut crlf = [0u8; 2];
                    self.reader.read_exact(&mut crlf).ok()?;
                }
            }
            if b[0] == b'\n' {
                return Some(String::from_utf8_lossy(&out).into_owned());
            }
            out.push(b[0]);
        }
    }

    /// The next SSE `data:` payload, or `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            let line = self.read_line()?;
            if let Some(data) = line.strip_prefix("data:") {
                return Some(data.trim().to_owned());
            }
        }
    }
}
