//! The live part: over-length prompts from keep-alive clients, and the
//! router's counters before and after.

use super::*;

/// Whether an answer is the over-length refusal; otherwise what it was,
/// as an error kind.
pub(super) fn classify(status: u16, body: &[u8]) -> Result<(), String> {
    let code = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
    match (status, code.as_deref()) {
        (400, Some("context_length_exceeded")) => Ok(()),
        (s, Some(c)) => Err(format!("HTTP {s} {c}")),
        (s, None) => Err(format!("HTTP {s}")),
    }
}

/// What the clients saw.
#[derive(Debug, Default)]
pub(super) struct LiveTally {
    /// Requests sent (each then got an answer or counts as an error).
    pub(super) sent: u64,
    /// Answers that were the over-length refusal.
    pub(super) refused: u64,
    /// Everything else, by kind.
    pub(super) errors: BTreeMap<String, u64>,
    /// The first few unexpected answers, for the report.
    pub(super) examples: Vec<String>,
    /// Client-side latency of the refusals, microseconds.
    pub(super) latency_us: Vec<f64>,
}

impl LiveTally {
    pub(super) fn error(&mut self, kind: String, detail: String) {
        *self.errors.entry(kind).or_default() += 1;
        if self.examples.len() < 5 {
            self.examples.push(detail);
        }
    }

    pub(super) fn merge(&mut self, o: Self) {
        self.sent += o.sent;
        self.refused += o.refused;
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.examples.extend(o.examples);
        self.examples.truncate(5);
        self.latency_us.extend(o.latency_us);
    }
}

/// A request of the live part: `api_key`, if any, as a bearer token.
fn live_request(method: hyper::Method, path: &str, body: Bytes, api_key: Option<&str>) -> Request {
    let req = Request::new(method, path).body(body);
    match api_key {
        Some(k) => req.bearer(k),
        None => req,
    }
}

/// One request on `conn`: status and body.
async fn exchange(conn: &mut Connection, req: &Request) -> Result<(u16, Bytes), String> {
    conn.exchange(req)
        .await
        .map(|r| (r.status, r.body))
        .map_err(|e| e.to_string())
}

/// One client: requests back to back on one connection (a new one only if
/// it breaks) until `deadline`, alternating the bodies from `first`.
pub(super) async fn client(
    addr: Arc<str>,
    bodies: Arc<[(&'static str, Bytes)]>,
    api_key: Option<Arc<str>>,
    deadline: Instant,
    first: usize,
) -> LiveTally {
    let mut t = LiveTally::default();
    let mut conn: Option<Connection> = None;
    let mut i = first;
    while Instant::now() < deadline {
        let sender = match &mut conn {
            Some(c) => c,
            None => match Connection::open(&addr).await {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    t.error("connect".into(), e.to_string());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // A connection the server closed is replaced before anything is
        // sent on it: that is not an error of the request.
        if !sender.ready().await {
            conn = None;
            continue;
        }
        let (path, body) = &bodies[i % bodies.len()];
        i += 1;
        t.sent += 1;
        let started = Instant::now();
        let answer = tokio::time::timeout(
            REQUEST_TIMEOUT,
            exchange(
                sender,
                &live_request(hyper::Method::POST, path, body.clone(), api_key.as_deref()),
            ),
        )
        .await;
        match answer {
            Ok(Ok((status, bytes))) => match classify(status, &bytes) {
                Ok(()) => {
                    t.refused += 1;
                    t.latency_us.push(started.elapsed().as_secs_f64() * 1e6);
                }
                Err(kind) => {
                    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
                    t.error(kind, format!("{path}: HTTP {status}: {text}"));
                }
            },
            Ok(Err(e)) => {
                t.error("connection".into(), format!("{path}: {e}"));
                conn = None;
            }
            Err(_) => {
                t.error(
                    "timeout".into(),
                    format!("{path}: no answer in {} s", REQUEST_TIMEOUT.as_secs()),
                );
                conn = None;
            }
        }
    }
    // Dropping the connection closes it.
    drop(conn);
    t
}

/// The router's counters the live part checks.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Counters {
    /// node -> reservations granted (from its load report).
    pub(super) granted: BTreeMap<String, f64>,
    /// reason -> requests refused before dispatch.
    pub(super) rejected: BTreeMap<String, f64>,
}

impl Counters {
    #[cfg(test)]
    pub(super) fn from_text(text: &str) -> Self {
        Self::of(&kvmesh_client::metrics::parse(text))
    }

    fn of(samples: &[kvmesh_client::Sample]) -> Self {
        let mut c = Self::default();
        for s in samples {
            match s.name.as_str() {
                "kvmesh_node_reservations_granted_total" => {
                    let node = s.labels.get("node").cloned().unwrap_or_default();
                    c.granted.insert(node, s.value);
                }
                "kvmesh_requests_rejected_total" => {
                    let reason = s.labels.get("reason").cloned().unwrap_or_default();
                    c.rejected.insert(reason, s.value);
                }
                _ => {}
            }
        }
        c
    }

    pub(super) fn granted_total(&self) -> f64 {
        self.granted.values().sum()
    }

    pub(super) fn rejected_total(&self) -> f64 {
        self.rejected.values().sum()
    }
}

/// The router's counters, read with `api_key` (with `--url` on a router
/// with API keys, a key with the metrics scope).
pub(super) async fn counters(addr: &str, api_key: Option<&str>) -> Result<Counters> {
    match kvmesh_client::metrics::scrape_with(addr, api_key).await {
        Ok(m) => Ok(Counters::of(m.samples())),
        Err(e) => bail!("{addr}: {e}"),
    }
}

/// The live part's results.
#[derive(Debug)]
pub(super) struct Live {
    pub(super) url: String,
    pub(super) max_model_len: usize,
    pub(super) clients: usize,
    pub(super) secs: f64,
    pub(super) tally: LiveTally,
    pub(super) before: Counters,
    pub(super) after: Counters,
}

impl Live {
    pub(super) fn refusals_per_s(&self) -> f64 {
        if self.secs > 0.0 {
            self.tally.refused as f64 / self.secs
        } else {
            0.0
        }
    }

    /// Reasons the run fails: the counts, never a time.
    pub(super) fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        let t = &self.tally;
        if t.sent == 0 {
            f.push("no request was sent".to_owned());
        }
        if !t.errors.is_empty() {
            f.push(format!(
                "{} answers were not the over-length refusal: {:?}",
                t.errors.values().sum::<u64>(),
                t.errors
            ));
        }
        if self.after.granted.is_empty() {
            f.push("/metrics has no kvmesh_node_reservations_granted_total".to_owned());
        } else if self.after.granted != self.before.granted {
            f.push(format!(
                "node reservations were granted: {:?} before, {:?} after",
                self.before.granted, self.after.granted
            ));
        }
        let rejected = self.after.rejected_total() - self.before.rejected_total();
        if rejected != t.sent as f64 {
            f.push(format!(
                "kvmesh_requests_rejected_total rose by {rejected}, but {} requests were sent",
                t.sent
            ));
        }
        f
    }
}

pub(super) async fn live(
    a: &BenchRouterArgs,
    addr: &str,
    p: &Prompts,
    mesh: &mut Option<MeshChild>,
) -> Result<Live> {
    crate::soak::mesh::wait_healthy(addr, mesh).await?;
    let api_key = a.api_key.as_deref();
    let mut conn = Connection::open(addr)
        .await
        .map_err(|e| anyhow!("{addr}: {e}"))?;
    let models = exchange(
        &mut conn,
        &live_request(hyper::Method::GET, "/v1/models", Bytes::new(), api_key),
    )
    .await;
    drop(conn);
    let max_model_len = match models {
        Ok((200, body)) => serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["data"][0]["max_model_len"].as_u64())
            .ok_or_else(|| anyhow!("{addr}/v1/models names no max_model_len"))?
            as usize,
        Ok((s, body)) => bail!(
            "{addr}/v1/models answered {s}: {}",
            String::from_utf8_lossy(&body)
        ),
        Err(e) => bail!("{addr}/v1/models: {e}"),
    };
    let shortest = p.completion_tokens.min(p.chat_tokens);
    if shortest + MAX_TOKENS <= max_model_len {
        bail!(
            "the prompts ({shortest} tokens plus {MAX_TOKENS}) fit the mesh's context window of \
             {max_model_len}; raise --prompt-tokens or lower the mesh's --max-model-len"
        );
    }

    let before = counters(addr, api_key).await?;
    let bodies: Arc<[(&'static str, Bytes)]> = Arc::from(vec![
        ("/v1/completions", Bytes::from(p.completion_body())),
        ("/v1/chat/completions", Bytes::from(p.chat_body())),
    ]);
    let addr_arc: Arc<str> = Arc::from(addr);
    let key: Option<Arc<str>> = api_key.map(Arc::from);
    let load_started = Instant::now();
    let deadline = load_started + Duration::from_secs(a.duration);
    let tasks: Vec<_> = (0..a.clients)
        .map(|i| {
            tokio::spawn(client(
                addr_arc.clone(),
                bodies.clone(),
                key.clone(),
                deadline,
                i,
            ))
        })
        .collect();
    let mut tally = LiveTally::default();
    for t in tasks {
        tally.merge(t.await.context("a client task failed")?);
    }
    let secs = load_started.elapsed().as_secs_f64();
    // Node counters come from load reports polled every 200 ms: wait past
    // one so any grant made during the load would show.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let after = counters(addr, api_key).await?;
    Ok(Live {
        url: format!("http://{addr}"),
        max_model_len,
        clients: a.clients,
        secs,
        tally,
        before,
        after,
    })
}
