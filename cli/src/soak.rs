//! `kvmesh soak`: soak and chaos test of a running mesh.
//!
//! It starts `kvmesh serve` as a child process (or drives `--url`), computes
//! the reference output of a fixed set of prompts with the in-process
//! reference engine (what `kvmesh generate --temperature 0` prints), then for
//! `--duration` seconds runs `--streams` concurrent clients against the
//! OpenAI gateway: each request a random prompt of the set, streamed or not,
//! greedy; some dropped by the client mid-stream (`--disconnect-rate`), some
//! carrying an injected fault (`--fault-rate`, header `x-kvmesh-fault`, from
//! [`FAULTS`]). Every completed output is compared with the reference; every
//! error is counted by kind and judged against what its fault allows.
//! Afterwards it waits for the mesh to go idle and reads its metrics: pages
//! still held (leaked), guard violations, reservation outcomes. Resident
//! memory of the `serve` process is compared at idle: after warm-up (a
//! tenth of the load, at least 5 s) the clients pause, the mesh drains and
//! the baseline is taken (the pause does not count as load); the end is
//! taken once the mesh is idle after the load. Memory under load moves
//! with what is in flight, so it is only reported (sampled once a second,
//! peak). The mesh runs in poison mode (unless `--no-poison`), which makes
//! every pool page resident at start, so growth measures what the load
//! left behind, not first touches of the pool.
//!
//! The run fails (non-zero exit) on any mismatch, any unexpected error (a
//! 429/503 is "shed", not a failure), any leaked page, more guard
//! violations than requests with a fault that corrupts a page table (each
//! may cost one refused read, I1), failing faults that never
//! took effect, no completed request at all, the mesh process exiting, or,
//! for runs of at least [`RSS_CHECK_MIN_SECS`] seconds, resident memory
//! growth over `--max-rss-growth-pct`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use kvmesh_model::default_model;
use kvmesh_model::engine::Engine;
use kvmesh_model::sampling::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::serve::TransportKind;
use crate::ModelArgs;

/// Runs shorter than this do not check memory growth: their end-to-start
/// ratio is dominated by allocator and page-cache warm-up.
const RSS_CHECK_MIN_SECS: u64 = 120;

/// How many of each stream's first requests use the largest prompts.
const WARMUP_LONGEST: usize = 3;

/// The fault header of the gateway (honoured by `serve --fault-injection`
/// in a build with fault injection).
const FAULT_HEADER: &str = kvmesh_kvxfer::fault::HEADER;

/// How a request carrying a fault must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// As without the fault: the output equals the reference.
    Recovers,
    /// A clear error: HTTP status >= 400 before the stream starts, or an
    /// SSE error event. Completing with the reference output is accepted
    /// too (the fault may fall past the request's end, e.g. a step it
    /// never reaches); completing with any other output is a mismatch.
    Fails,
}

/// One injectable fault (header value: `POINT=ACTION[,...]`).
#[derive(Debug)]
struct Fault {
    spec: &'static str,
    expect: Expect,
    /// May make the decode node count a guard violation (a corrupted page
    /// table is refused by the read path, I1).
    trips_guard: bool,
}

const fn recovers(spec: &'static str) -> Fault {
    Fault {
        spec,
        expect: Expect::Recovers,
        trips_guard: false,
    }
}

const fn fails(spec: &'static str, trips_guard: bool) -> Fault {
    Fault {
        spec,
        expect: Expect::Fails,
        trips_guard,
    }
}

/// The faults a request may carry, each with the outcome it must have.
/// Extend here; every entry is drawn with equal probability.
const FAULTS: &[Fault] = &[
    recovers("reserve=delay:50"),
    recovers("reserve=duplicate"),
    recovers("grant=delay:50"),
    recovers("grant=duplicate"),
    recovers("frame:0=delay:30"),
    recovers("frame:1=duplicate"),
    recovers("frame:1=reorder"),
    recovers("done=delay:30"),
    recovers("done=duplicate"),
    recovers("step:2=delay:30"),
    recovers("confirm=delay:50"),
    recovers("abort=duplicate"),
    fails("grant=corrupt", false),
    fails("frame:1=drop", false),
    fails("frame:0=corrupt", false),
    fails("done=corrupt", false),
    fails("done=reorder", false),
    fails("verify=corrupt", false),
    fails("step:3=corrupt", true),
    fails("step:3=drop", false),
    // These two end only when the grant's lease runs out (--lease-ms).
    fails("grant=drop", false),
    fails("done=drop", false),
];

/// One prompt of the built-in set: `head` followed by `filler` repeated
/// `repeats` times (fewer when the model's context cannot hold it).
#[derive(Debug)]
struct PromptSpec {
    name: &'static str,
    head: &'static str,
    filler: &'static str,
    repeats: usize,
    chat: bool,
    max_tokens: usize,
}

const fn prompt(
    name: &'static str,
    head: &'static str,
    chat: bool,
    max_tokens: usize,
) -> PromptSpec {
    PromptSpec {
        name,
        head,
        filler: "",
        repeats: 0,
        chat,
        max_tokens,
    }
}

/// Mixed lengths (a few tokens to a few hundred), completion and chat,
/// completion budgets from 4 to 48 tokens.
const PROMPTS: &[PromptSpec] = &[
    prompt("hello", "Hello world", false, 8),
    prompt("capital", "The capital of France is", false, 16),
    prompt("chat-capital", "What is the capital of France?", true, 24),
    prompt("count", "1, 2, 3, 4,", false, 4),
    prompt("code", "def fibonacci(n):\n", false, 32),
    prompt(
        "chat-multibyte",
        "¿Dónde está la biblioteca? 日本語のテキスト, emoji 😀🎉",
        true,
        12,
    ),
    PromptSpec {
        name: "notes",
        head: "Meeting notes, Tuesday.\n",
        filler: "- The team reviewed the quarterly figures and agreed to revisit the budget in May.\n",
        repeats: 4,
        chat: false,
        max_tokens: 40,
    },
    PromptSpec {
        name: "chat-summary",
        head: "Summarize these notes in one sentence:\n",
        filler: "The deployment moved to the new cluster; latency fell by a third and two alerts were retired.\n",
        repeats: 5,
        chat: true,
        max_tokens: 20,
    },
    PromptSpec {
        name: "story-long",
        head: "A story.\n",
        filler: "The quick brown fox jumps over the lazy dog while the committee reviews the quarterly results. ",
        repeats: 16,
        chat: false,
        max_tokens: 48,
    },
    PromptSpec {
        name: "chat-log-long",
        head: "Read this log and say which worker failed:\n",
        filler: "12:00:01 worker-3 heartbeat ok; queue depth 17; 42 requests served; cache hit ratio 0.93.\n",
        repeats: 12,
        chat: true,
        max_tokens: 28,
    },
];

/// `kvmesh soak` flags.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Seconds of load.
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Concurrent client streams.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Probability that a request is dropped by the client mid-stream.
    #[arg(long, default_value_t = 0.05)]
    disconnect_rate: f64,
    /// Probability that a request carries an injected fault. Above 0 the
    /// mesh is started with --fault-injection, --lease-ms and
    /// --abort-timeout-ms.
    #[arg(long, default_value_t = 0.2)]
    fault_rate: f64,
    /// The decode node's grant lease, ms (faults that drop the grant or
    /// transfer-done end only when it runs out). With the abort timeout
    /// plus 5 s, it bounds the wait for the mesh to go idle at the end:
    /// with --url, give the mesh's own values.
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// How long an abort waits for the writer's confirmation, ms.
    #[arg(long, default_value_t = 1000)]
    abort_timeout_ms: u64,
    /// KV transport of the mesh started here.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportKind,
    /// Drive this running mesh (`http://HOST:PORT`) instead of starting one;
    /// its flags are then its own (fault injection, lease).
    #[arg(long)]
    url: Option<String>,
    /// With --url: the pid of the mesh process, to measure its memory.
    #[arg(long, requires = "url")]
    pid: Option<u32>,
    /// Fail when resident memory grows more than this from warm-up to the
    /// end (checked for runs of at least 120 s).
    #[arg(long, default_value_t = 5.0)]
    max_rss_growth_pct: f64,
    /// Seconds a request may take before it counts as hung.
    #[arg(long, default_value_t = 120)]
    request_timeout_s: u64,
    /// Seed of the clients' random choices [default: from the clock]; the
    /// same seed makes the same choices (timing still varies).
    #[arg(long)]
    seed: Option<u64>,
    /// Also write the summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where the started mesh's log (stderr) goes [default: a file in the
    /// temporary directory].
    #[arg(long)]
    serve_log: Option<PathBuf>,
    /// Start the mesh without `--poison`. By default it runs in poison mode:
    /// the canary fill makes every KV pool page resident at start, so memory
    /// growth measures the mesh rather than first touches of the pool, and
    /// any read of a free page fails loudly (I6).
    #[arg(long)]
    no_poison: bool,
    /// One more flag for the started `serve` (repeat: `--serve-arg=--allow-small-pool`).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    #[command(flatten)]
    model: ModelArgs,
}

/// A prompt of the set with its reference output.
#[derive(Debug)]
struct Reference {
    name: &'static str,
    text: String,
    chat: bool,
    max_tokens: usize,
    prompt_tokens: usize,
    want: String,
    finish: &'static str,
}

/// Builds the prompt set for this model (long prompts shortened until
/// prompt plus budget fit its context) and runs each through the
/// reference engine, greedy.
fn references(engine: &Engine) -> Result<Vec<Reference>> {
    let limit = engine.max_model_len();
    let greedy = SamplingParams {
        temperature: 0.0,
        top_p: 1.0,
        top_k: None,
        seed: None,
    };
    let mut out = Vec::new();
    for p in PROMPTS {
        let mut repeats = p.repeats;
        let (text, prompt_tokens) = loop {
            let text = format!("{}{}", p.head, p.filler.repeat(repeats));
            let n = engine
                .tokenize(&crate::cli_prompt(&text, p.chat))
                .with_context(|| format!("tokenizing prompt {}", p.name))?
                .len();
            if n + p.max_tokens <= limit {
                break (text, n);
            }
            if repeats == 0 {
                bail!(
                    "prompt {} ({n} tokens) plus {} completion tokens does not fit the context of {limit}",
                    p.name,
                    p.max_tokens
                );
            }
            repeats -= 1;
        };
        let g = crate::reference_generate(engine, &text, p.chat, p.max_tokens, greedy, |_| {})
            .with_context(|| format!("reference output of prompt {}", p.name))?;
        out.push(Reference {
            name: p.name,
            text,
            chat: p.chat,
            max_tokens: p.max_tokens,
            prompt_tokens,
            want: g.text,
            finish: g.finish_reason.as_str(),
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The mesh process.

/// The `serve` child; killed on drop.
#[derive(Debug)]
struct MeshChild {
    child: Child,
    log: PathBuf,
}

impl Drop for MeshChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts `<this exe> serve` on free ports and returns it with the
/// gateway's `HOST:PORT` once it printed its URLs.
fn start_mesh(a: &SoakArgs, model: &Path, kv_pool_tokens: usize) -> Result<(MeshChild, String)> {
    let exe = std::env::current_exe().context("locating the kvmesh binary")?;
    let log = a.serve_log.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvmesh-soak-{}-serve.log", std::process::id()))
    });
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .arg("--model")
        .arg(model)
        .args(["--http-port", "0", "--grpc-port", "0"])
        .args([
            "--transport",
            match a.transport {
                TransportKind::Tcp => "tcp",
                TransportKind::Shm => "shm",
            },
        ])
        .args(["--page-size", &a.model.page_size.to_string()])
        .args(["--kv-pool-tokens", &kv_pool_tokens.to_string()])
        .args(["--scrub", a.model.scrub.as_str()]);
    if let Some(n) = a.model.max_model_len {
        cmd.args(["--max-model-len", &n.to_string()]);
    }
    if a.model.poison || !a.no_poison {
        cmd.arg("--poison");
    }
    if a.model.exact {
        cmd.arg("--exact");
    }
    if a.fault_rate > 0.0 {
        cmd.arg("--fault-injection")
            .args(["--lease-ms", &a.lease_ms.to_string()])
            .args(["--abort-timeout-ms", &a.abort_timeout_ms.to_string()]);
    }
    cmd.args(&a.serve_args);
    if std::env::var_os("KVMESH_LOG").is_none() {
        cmd.env("KVMESH_LOG", "warn");
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file));
    let mut child = cmd.spawn().context("starting kvmesh serve")?;
    let stdout = child.stdout.take().context("serve's stdout")?;
    let mesh = MeshChild { child, log };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.trim().strip_prefix("OpenAI API") {
                if let Some(addr) = rest.trim().strip_prefix("http://") {
                    let _ = tx.send(addr.trim_end_matches("/v1").to_owned());
                    break;
                }
            }
        }
        // Keep draining so the server never blocks on its stdout.
        for _ in lines {}
    });
    let started = Instant::now();
    let mut mesh = mesh;
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(addr) => return Ok((mesh, addr)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {}
        }
        if let Some(status) = mesh.child.try_wait()? {
            bail!(
                "kvmesh serve exited ({status}) before printing its URLs; its log {}:\n{}",
                mesh.log.display(),
                log_tail(&mesh.log)
            );
        }
        if started.elapsed() > Duration::from_secs(300) {
            bail!(
                "kvmesh serve printed no URL in 300 s; its log {}:\n{}",
                mesh.log.display(),
                log_tail(&mesh.log)
            );
        }
    }
}

/// `http://HOST:PORT[/v1]` or `HOST:PORT` to `HOST:PORT`.
fn host_port(url: &str) -> String {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_prefix("http://").unwrap_or(u);
    u.trim_end_matches("/v1").to_owned()
}

/// Resident memory of `pid`, KiB (Linux).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------
// HTTP/1.1 over hyper, one connection per request.

/// Aborts the connection's task on drop, which closes the socket: how a
/// client "goes away".
struct ConnGuard(tokio::task::JoinHandle<()>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn send(
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
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr)
        .header(hyper::header::CONTENT_TYPE, "application/json");
    if let Some(f) = fault {
        req = req.header(FAULT_HEADER, f);
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| format!("request: {e}"))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("no response: {e}"))?;
    Ok((resp, guard))
}

async fn read_all(resp: hyper::Response<hyper::body::Incoming>) -> Result<String, String> {
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// GET `path`: status and body.
async fn get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let (resp, _guard) = send(addr, hyper::Method::GET, path, None, None).await?;
    let status = resp.status().as_u16();
    Ok((status, read_all(resp).await?))
}

// ---------------------------------------------------------------------------
// One request.

/// What one request is.
#[derive(Clone, Copy, Debug)]
struct Plan {
    prompt: usize,
    stream: bool,
    fault: Option<usize>,
    /// Drop the connection after this many SSE events.
    disconnect_after: Option<usize>,
}

/// How a request ended, as the client saw it.
#[derive(Debug)]
enum Ending {
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
fn error_kind(v: &Value) -> (String, String) {
    let e = &v["error"];
    let s = |k: &str| e[k].as_str().unwrap_or("?").to_owned();
    (format!("{}/{}", s("type"), s("code")), s("message"))
}

/// The text of choice 0: a completion's `text`, a chat message's
/// `content`, or a chat delta's `content`.
fn choice_text(c: &Value) -> &str {
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .or_else(|| c["delta"]["content"].as_str())
        .unwrap_or_default()
}

async fn one_request(addr: &str, r: &Reference, plan: Plan) -> Ending {
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
    let mut body = resp.into_body();
    let mut buf: Vec<u8> = Vec::new();
    let mut data = String::new();
    let mut events = 0usize;
    let mut text = String::new();
    let mut finish: Option<String> = None;
    loop {
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let raw: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&raw);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(d) = line.strip_prefix("data:") {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
                continue;
            }
            if !line.is_empty() || data.is_empty() {
                // Comments (keep-alives), other fields, empty events.
                continue;
            }
            let event = std::mem::take(&mut data);
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
                drop(body);
                drop(guard);
                return Ending::Disconnected;
            }
        }
        match body.frame().await {
            None => return Ending::Broken("the stream ended without [DONE]".into()),
            Some(Err(e)) => return Ending::Broken(format!("stream cut: {e}")),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Tally.

/// Per fault spec (and "none").
#[derive(Clone, Debug, Default)]
struct FaultRow {
    sent: u64,
    equal: u64,
    expected_error: u64,
    unexpected: u64,
    mismatch: u64,
    disconnected: u64,
    shed: u64,
}

#[derive(Debug)]
struct Mismatch {
    prompt: &'static str,
    chat: bool,
    stream: bool,
    fault: &'static str,
    expected: String,
    expected_finish: &'static str,
    got: String,
    got_finish: String,
}

#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    streamed: u64,
    equal: u64,
    /// Failing-fault requests that completed with the reference output.
    harmless_fault: u64,
    mismatches: Vec<Mismatch>,
    expected_errors: BTreeMap<String, u64>,
    unexpected_errors: BTreeMap<String, u64>,
    /// One example per unexpected kind: prompt, fault, message.
    unexpected_examples: BTreeMap<String, String>,
    /// Unexpected errors that were a lease running out.
    unexpected_lease_expired: u64,
    shed: BTreeMap<String, u64>,
    disconnected: u64,
    faults_injected: u64,
    failing_faults_injected: u64,
    guard_faults_injected: u64,
    per_fault: BTreeMap<&'static str, FaultRow>,
}

impl Tally {
    fn completed(&self) -> u64 {
        self.equal + self.harmless_fault + self.mismatches.len() as u64
    }
    fn count(map: &BTreeMap<String, u64>) -> u64 {
        map.values().sum()
    }

    fn record(&mut self, r: &Reference, plan: Plan, ending: Ending) {
        self.requests += 1;
        self.streamed += u64::from(plan.stream);
        let fault = plan.fault.map(|i| &FAULTS[i]);
        let spec = fault.map_or("none", |f| f.spec);
        let expect_fail = fault.is_some_and(|f| f.expect == Expect::Fails);
        if let Some(f) = fault {
            self.faults_injected += 1;
            self.failing_faults_injected += u64::from(expect_fail);
            self.guard_faults_injected += u64::from(f.trips_guard);
        }
        let row = self.per_fault.entry(spec).or_default();
        row.sent += 1;
        let mut unexpected = |kind: String, message: String, row: &mut FaultRow| {
            row.unexpected += 1;
            if message.contains("LeaseExpired") {
                self.unexpected_lease_expired += 1;
            }
            self.unexpected_examples
                .entry(kind.clone())
                .or_insert_with(|| {
                    format!(
                        "prompt {} ({}, {}), fault {spec}: {message}",
                        r.name,
                        if r.chat { "chat" } else { "completion" },
                        if plan.stream { "stream" } else { "whole" }
                    )
                });
            *self.unexpected_errors.entry(kind).or_default() += 1;
        };
        match ending {
            Ending::Completed { text, finish } => {
                if text == r.want && finish == r.finish {
                    row.equal += 1;
                    if expect_fail {
                        self.harmless_fault += 1;
                    } else {
                        self.equal += 1;
                    }
                } else {
                    row.mismatch += 1;
                    self.mismatches.push(Mismatch {
                        prompt: r.name,
                        chat: r.chat,
                        stream: plan.stream,
                        fault: spec,
                        expected: r.want.clone(),
                        expected_finish: r.finish,
                        got: text,
                        got_finish: finish,
                    });
                }
            }
            Ending::Http { status, .. } if status == 429 || status == 503 => {
                row.shed += 1;
                *self.shed.entry(format!("HTTP {status}")).or_default() += 1;
            }
            Ending::Http {
                status,
                kind,
                message,
            } => {
                let kind = format!("HTTP {status} {kind}");
                if expect_fail {
                    row.expected_error += 1;
                    *self.expected_errors.entry(kind).or_default() += 1;
                } else {
                    unexpected(kind, message, row);
                }
            }
            Ending::SseError { kind, message } if sse_shed(&kind, &message) => {
                row.shed += 1;
                *self.shed.entry(format!("SSE error {kind}")).or_default() += 1;
            }
            Ending::SseError { kind, message } => {
                let kind = format!("SSE error {kind}");
                if expect_fail {
                    row.expected_error += 1;
                    *self.expected_errors.entry(kind).or_default() += 1;
                } else {
                    unexpected(kind, message, row);
                }
            }
            Ending::Disconnected => {
                row.disconnected += 1;
                self.disconnected += 1;
            }
            // Never a clear error, whatever the fault.
            Ending::Broken(what) => {
                let kind = format!(
                    "no clear ending: {}",
                    what.split(':').next().unwrap_or(&what)
                );
                unexpected(kind, what, row);
            }
        }
    }
}

/// An SSE error that is the streamed form of a 429 or 503: the queue or
/// the nodes' pools stayed full, or no node was healthy (the status was
/// already 200 when the router found out).
fn sse_shed(kind: &str, message: &str) -> bool {
    kind.ends_with("/saturated")
        || kind.ends_with("/no_healthy_node")
        || message.contains("Some resource has been exhausted")
}

// ---------------------------------------------------------------------------
// Metrics.

/// One sample of the Prometheus text: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((head, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => {
                let labels = rest
                    .trim_end_matches('}')
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
                    .collect();
                (n.to_owned(), labels)
            }
            None => (head.to_owned(), BTreeMap::new()),
        };
        out.push(Sample {
            name,
            labels,
            value,
        });
    }
    out
}

/// The figures the soak reads from /metrics.
#[derive(Debug, Default)]
struct MeshFigures {
    /// node -> (pages total, pages free).
    pages: BTreeMap<String, (Option<f64>, Option<f64>)>,
    /// node -> guard violations.
    guard: BTreeMap<String, f64>,
    /// (node, outcome) -> reservations ended.
    reservations: BTreeMap<(String, String), f64>,
    /// outcome -> router requests.
    requests: BTreeMap<String, f64>,
}

impl MeshFigures {
    fn from_text(text: &str) -> Self {
        let mut f = Self::default();
        for s in parse_metrics(text) {
            let node = s.labels.get("node").cloned().unwrap_or_default();
            match s.name.as_str() {
                "kvmesh_node_kv_pages_total" => f.pages.entry(node).or_default().0 = Some(s.value),
                "kvmesh_node_kv_pages_free" => f.pages.entry(node).or_default().1 = Some(s.value),
                "kvmesh_node_kv_guard_violations_total" => {
                    f.guard.insert(node, s.value);
                }
                "kvmesh_node_reservations_total" => {
                    let outcome = s.labels.get("outcome").cloned().unwrap_or_default();
                    f.reservations.insert((node, outcome), s.value);
                }
                "kvmesh_requests_total" => {
                    let outcome = s.labels.get("outcome").cloned().unwrap_or_default();
                    f.requests.insert(outcome, s.value);
                }
                _ => {}
            }
        }
        f
    }

    /// Every node reports its pages, all free.
    fn idle(&self) -> bool {
        !self.pages.is_empty() && self.pages.values().all(|(t, f)| t.is_some() && t == f)
    }

    /// Pages held per node (`None`: the node reports no pages).
    fn held(&self) -> BTreeMap<String, Option<f64>> {
        self.pages
            .iter()
            .map(|(n, (t, f))| (n.clone(), t.zip(*f).map(|(t, f)| t - f)))
            .collect()
    }
}

async fn figures(addr: &str) -> Result<MeshFigures, String> {
    let (status, body) = get(addr, "/metrics").await?;
    if status != 200 {
        return Err(format!("/metrics answered {status}"));
    }
    Ok(MeshFigures::from_text(&body))
}

/// Waits for every node to report all pages free, at most `bound`; returns
/// the last figures and whether the mesh went idle.
async fn wait_idle(addr: &str, bound: Duration) -> (MeshFigures, bool) {
    // Load reports are polled every 200 ms; one older than the last request
    // may predate it.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let deadline = Instant::now() + bound;
    loop {
        let f = figures(addr).await.unwrap_or_default();
        if f.idle() {
            return (f, true);
        }
        if Instant::now() >= deadline {
            return (f, false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn delta<K: Ord + Clone>(end: &BTreeMap<K, f64>, start: &BTreeMap<K, f64>) -> BTreeMap<K, f64> {
    end.iter()
        .map(|(k, v)| (k.clone(), v - start.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v != 0.0)
        .collect()
}

// ---------------------------------------------------------------------------
// The run.

pub fn run(a: SoakArgs) -> Result<()> {
    for (name, p) in [
        ("--disconnect-rate", a.disconnect_rate),
        ("--fault-rate", a.fault_rate),
    ] {
        if !(0.0..=1.0).contains(&p) {
            bail!("{name} {p} is not in [0, 1]");
        }
    }
    if a.streams == 0 || a.duration == 0 {
        bail!("--streams and --duration must be at least 1");
    }
    let model_path = match &a.model.model {
        Some(p) => p.clone(),
        None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
    };
    let mut engine_args = a.model.clone();
    engine_args.model = Some(model_path.clone());
    let t = Instant::now();
    let engine = engine_args.load_engine()?;
    let refs = Arc::new(references(&engine)?);
    let max_model_len = engine.max_model_len();
    drop(engine);
    eprintln!(
        "soak: reference outputs of {} prompts ({}..{} prompt tokens) in {:.1} s",
        refs.len(),
        refs.iter().map(|r| r.prompt_tokens).min().unwrap_or(0),
        refs.iter().map(|r| r.prompt_tokens).max().unwrap_or(0),
        t.elapsed().as_secs_f64()
    );
    // Enough KV for every stream's longest request at once, and at least
    // one full context (what serve requires without --allow-small-pool).
    let longest = refs
        .iter()
        .map(|r| r.prompt_tokens + r.max_tokens)
        .max()
        .unwrap_or(0);
    let kv_pool_tokens = a
        .model
        .kv_pool_tokens
        .unwrap_or_else(|| (a.streams * longest).max(max_model_len));

    let (mesh, addr, pid) = match &a.url {
        Some(u) => (None, host_port(u), a.pid),
        None => {
            let (m, addr) = start_mesh(&a, &model_path, kv_pool_tokens)?;
            let pid = m.child.id();
            eprintln!(
                "soak: mesh at http://{addr} (pid {pid}), log {}",
                m.log.display()
            );
            (Some(m), addr, Some(pid))
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut mesh = mesh;
    let report = rt.block_on(drive(&a, &addr, pid, refs, seed, kv_pool_tokens, &mut mesh))?;
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report.json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", report.table);
    if report.failures.is_empty() {
        Ok(())
    } else {
        bail!("soak failed: {}", report.failures.join("; "))
    }
}

#[derive(Debug)]
struct Report {
    table: String,
    json: Value,
    failures: Vec<String>,
}

async fn drive(
    a: &SoakArgs,
    addr: &str,
    pid: Option<u32>,
    refs: Arc<Vec<Reference>>,
    seed: u64,
    kv_pool_tokens: usize,
    mesh: &mut Option<MeshChild>,
) -> Result<Report> {
    let started = Instant::now();
    loop {
        if matches!(get(addr, "/health").await, Ok((200, _))) {
            break;
        }
        if let Some(m) = mesh.as_mut() {
            if let Some(status) = m.child.try_wait()? {
                bail!(
                    "kvmesh serve exited ({status}); its log {}:\n{}",
                    m.log.display(),
                    log_tail(&m.log)
                );
            }
        }
        if started.elapsed() > Duration::from_secs(120) {
            bail!("the mesh at {addr} was not healthy within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = figures(addr)
        .await
        .map_err(|e| anyhow::anyhow!("reading {addr}/metrics: {e}"))?;

    let duration = Duration::from_secs(a.duration);
    let warmup = (duration / 10)
        .max(Duration::from_secs(5))
        .min(duration / 2);
    eprintln!(
        "soak: {} streams for {} s (seed {seed}); memory baseline at idle after {} s",
        a.streams,
        a.duration,
        warmup.as_secs_f64()
    );
    let idle_bound =
        Duration::from_millis(a.lease_ms + a.abort_timeout_ms) + Duration::from_secs(5);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let gate = Arc::new(Gate::default());
    let load_started = Instant::now();
    gate.set_deadline(duration);
    let timeout = Duration::from_secs(a.request_timeout_s);
    let mut workers = Vec::new();
    for i in 0..a.streams {
        let (refs, tally, gate) = (refs.clone(), tally.clone(), gate.clone());
        let addr = addr.to_owned();
        let mut rng =
            StdRng::seed_from_u64(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let args = PlanArgs {
            disconnect_rate: a.disconnect_rate,
            fault_rate: a.fault_rate,
        };
        workers.push(tokio::spawn(async move {
            let mut sent = 0usize;
            while gate.running(load_started) {
                if !gate.enter() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                // Warm-up starts at the peak: every stream's first requests
                // are of the largest prompts, so the allocators reach their
                // high-water mark before the memory baseline.
                let plan = args.draw(&mut rng, &refs, sent < WARMUP_LONGEST);
                sent += 1;
                let r = &refs[plan.prompt];
                let ending = match tokio::time::timeout(timeout, one_request(&addr, r, plan)).await
                {
                    Ok(e) => e,
                    Err(_) => Ending::Broken(format!("timeout: no end in {} s", timeout.as_secs())),
                };
                gate.leave();
                let back_off = match &ending {
                    Ending::Http { status, .. } => *status == 429 || *status == 503,
                    Ending::Broken(_) => true,
                    _ => false,
                };
                tally
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .record(r, plan, ending);
                if back_off {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }

    // Memory once a second; the baseline at idle after warm-up; progress;
    // watch the mesh process.
    let mut rss = Rss::default();
    let mut next_sample = load_started;
    let mut mesh_exit = None;
    let mut last_progress = Instant::now();
    while gate.running(load_started) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if Instant::now() >= next_sample {
            next_sample += Duration::from_secs(1);
            if let Some(kib) = pid.and_then(rss_kib) {
                rss.samples
                    .push((load_started.elapsed().as_secs_f64(), kib));
            }
        }
        if let Some(m) = mesh.as_mut() {
            if let Some(status) = m.child.try_wait()? {
                mesh_exit = Some(status.to_string());
                gate.stop.store(true, Ordering::SeqCst);
                break;
            }
        }
        if rss.start_at.is_none() && load_started.elapsed() >= warmup {
            // Let the clients finish what they are doing and the mesh go
            // idle, measure, and go on; the pause does not count as load.
            let paused = Instant::now();
            rss.start_at = Some(load_started.elapsed().as_secs_f64());
            gate.paused.store(true, Ordering::SeqCst);
            while gate.inflight.load(Ordering::SeqCst) > 0 && paused.elapsed() < timeout {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let (_, idle) = wait_idle(addr, idle_bound).await;
            rss.start = idle_rss(pid).await;
            rss.start_idle = idle;
            rss.pause_secs = paused.elapsed().as_secs_f64();
            gate.set_deadline(duration + paused.elapsed());
            gate.paused.store(false, Ordering::SeqCst);
        }
        if last_progress.elapsed() >= Duration::from_secs(10) {
            last_progress = Instant::now();
            let t = tally.lock().unwrap_or_else(PoisonError::into_inner);
            eprintln!(
                "soak: {:>4} s  requests {}  completed {}  mismatches {}  unexpected errors {}  disconnected {}",
                load_started.elapsed().as_secs(),
                t.requests,
                t.completed(),
                t.mismatches.len(),
                Tally::count(&t.unexpected_errors),
                t.disconnected
            );
        }
    }
    for w in workers {
        let _ = w.await;
    }
    let load_secs = load_started.elapsed().as_secs_f64() - rss.pause_secs;
    if mesh_exit.is_none() {
        if let Some(m) = mesh.as_mut() {
            if let Some(status) = m.child.try_wait()? {
                mesh_exit = Some(status.to_string());
            }
        }
    }
    let (after, idle) = if mesh_exit.is_none() {
        wait_idle(addr, idle_bound).await
    } else {
        (MeshFigures::default(), false)
    };
    rss.end = idle_rss(pid).await;
    rss.peak = rss.samples.iter().map(|(_, k)| *k).max();
    let tally = std::mem::take(&mut *tally.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(summarize(
        a,
        &Summary {
            refs: &refs,
            tally: &tally,
            before: &before,
            after: &after,
            idle,
            mesh_exit,
            rss,
            load_secs,
            seed,
            kv_pool_tokens,
            started_mesh: mesh.is_some(),
        },
    ))
}

/// Resident memory of the mesh process: at idle after warm-up and at idle
/// after the load (what the load left behind), and under load.
#[derive(Debug, Default)]
struct Rss {
    start: Option<u64>,
    /// Seconds into the load of the baseline.
    start_at: Option<f64>,
    /// Whether the mesh went idle for the baseline.
    start_idle: bool,
    /// How long the load paused for it.
    pause_secs: f64,
    end: Option<u64>,
    /// Highest once-a-second sample under load.
    peak: Option<u64>,
    /// (seconds into the load, KiB), one a second.
    samples: Vec<(f64, u64)>,
}

/// The median of five samples 200 ms apart.
async fn idle_rss(pid: Option<u32>) -> Option<u64> {
    let pid = pid?;
    let mut v = Vec::new();
    for i in 0..5 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        v.extend(rss_kib(pid));
    }
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

/// What the client tasks share: the (movable) end of the load, a stop
/// switch, and a pause with a count of requests in flight.
#[derive(Debug, Default)]
struct Gate {
    /// Milliseconds from the start of the load.
    deadline_ms: AtomicU64,
    stop: AtomicBool,
    paused: AtomicBool,
    inflight: AtomicUsize,
}

impl Gate {
    fn set_deadline(&self, d: Duration) {
        self.deadline_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    fn running(&self, started: Instant) -> bool {
        !self.stop.load(Ordering::SeqCst)
            && (started.elapsed().as_millis() as u64) < self.deadline_ms.load(Ordering::SeqCst)
    }

    /// Counts a request in unless paused. In first, then the check: a
    /// pauser that sees no request in flight knows none will start.
    fn enter(&self) -> bool {
        self.inflight.fetch_add(1, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            self.inflight.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    fn leave(&self) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The random choices' rates, copied into each client task.
#[derive(Clone, Copy, Debug)]
struct PlanArgs {
    disconnect_rate: f64,
    fault_rate: f64,
}

impl PlanArgs {
    /// A random plan; with `longest`, of one of the two largest prompts.
    fn draw(&self, rng: &mut StdRng, refs: &[Reference], longest: bool) -> Plan {
        let prompt = if longest {
            let mut by_size: Vec<usize> = (0..refs.len()).collect();
            by_size.sort_by_key(|&i| std::cmp::Reverse(refs[i].prompt_tokens + refs[i].max_tokens));
            by_size[rng.random_range(0..by_size.len().min(2))]
        } else {
            rng.random_range(0..refs.len())
        };
        let disconnect = rng.random_bool(self.disconnect_rate);
        let stream = disconnect || rng.random_bool(0.5);
        let fault = rng
            .random_bool(self.fault_rate)
            .then(|| rng.random_range(0..FAULTS.len()));
        let disconnect_after =
            disconnect.then(|| rng.random_range(0..=(refs[prompt].max_tokens / 2).max(1)));
        Plan {
            prompt,
            stream,
            fault,
            disconnect_after,
        }
    }
}

#[derive(Debug)]
struct Summary<'a> {
    refs: &'a [Reference],
    tally: &'a Tally,
    before: &'a MeshFigures,
    after: &'a MeshFigures,
    idle: bool,
    mesh_exit: Option<String>,
    rss: Rss,
    load_secs: f64,
    seed: u64,
    kv_pool_tokens: usize,
    started_mesh: bool,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn summarize(a: &SoakArgs, s: &Summary<'_>) -> Report {
    let t = s.tally;
    let mut failures = Vec::new();
    let held = s.after.held();
    let leaked = held.values().fold(0.0, |s, h| s + h.unwrap_or(0.0));
    let silent: Vec<&String> = held
        .iter()
        .filter(|(_, h)| h.is_none())
        .map(|(n, _)| n)
        .collect();
    let guard = delta(&s.after.guard, &s.before.guard);
    let guard_total = guard.values().fold(0.0, |s, v| s + v);
    let reservations = delta(&s.after.reservations, &s.before.reservations);
    let requests = delta(&s.after.requests, &s.before.requests);
    let unexpected = Tally::count(&t.unexpected_errors);
    let expected = Tally::count(&t.expected_errors);
    let shed = Tally::count(&t.shed);
    let rss_growth = match (s.rss.start, s.rss.end) {
        (Some(a), Some(b)) if a > 0 => Some((b as f64 - a as f64) / a as f64 * 100.0),
        _ => None,
    };
    let rss_checked = a.duration >= RSS_CHECK_MIN_SECS;

    if let Some(status) = &s.mesh_exit {
        failures.push(format!("the mesh process exited during the run ({status})"));
    }
    if !t.mismatches.is_empty() {
        failures.push(format!("{} mismatches", t.mismatches.len()));
    }
    if unexpected > 0 {
        failures.push(format!("{unexpected} unexpected errors"));
    }
    if t.completed() == 0 {
        failures.push("no request completed".into());
    }
    if s.mesh_exit.is_none() && (held.is_empty() || !silent.is_empty()) {
        failures.push(format!(
            "pages not reported by {}",
            if held.is_empty() {
                "any node".to_owned()
            } else {
                silent
                    .iter()
                    .map(|n| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    if leaked > 0.0 {
        failures.push(format!(
            "{leaked} pages still held {:.1} s after the load (leaked)",
            (a.lease_ms + a.abort_timeout_ms) as f64 / 1e3 + 5.0
        ));
    }
    if guard_total > t.guard_faults_injected as f64 {
        failures.push(format!(
            "{guard_total} guard violations, more than the {} requests with a fault that corrupts a page table",
            t.guard_faults_injected
        ));
    }
    let harmless_only = t.failing_faults_injected >= 10 && expected == 0;
    if harmless_only {
        failures.push(format!(
            "none of {} failing faults took effect: does the mesh honour {FAULT_HEADER} (serve --fault-injection, a build with fault injection)?",
            t.failing_faults_injected
        ));
    }
    if let Some(g) = rss_growth {
        if rss_checked && g > a.max_rss_growth_pct {
            failures.push(format!(
                "resident memory grew {g:.1} % (over {} %)",
                a.max_rss_growth_pct
            ));
        }
    }

    let mut o = String::new();
    let transport = match (s.started_mesh, a.transport) {
        (false, _) => "as running",
        (true, TransportKind::Tcp) => "tcp",
        (true, TransportKind::Shm) => "shm",
    };
    let _ = writeln!(o, "kvmesh soak summary");
    let _ = writeln!(
        o,
        "  load                {:.1} s, {} streams, transport {transport}, fault rate {}, disconnect rate {}, seed {}",
        s.load_secs, a.streams, a.fault_rate, a.disconnect_rate, s.seed
    );
    if s.started_mesh {
        let _ = writeln!(
            o,
            "  mesh                kv pool {} tokens, {}",
            s.kv_pool_tokens,
            if a.fault_rate > 0.0 {
                format!(
                    "fault injection, lease {} ms, abort timeout {} ms",
                    a.lease_ms, a.abort_timeout_ms
                )
            } else {
                "no fault injection, serve's lease and abort timeout".to_owned()
            } + if a.model.poison || !a.no_poison {
                ", poison"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(o, "  prompts             {}", s.refs.len());
    let _ = writeln!(
        o,
        "  requests            {} ({} streamed)",
        t.requests, t.streamed
    );
    let _ = writeln!(
        o,
        "  completed           {} (equal to the reference {}, failing fault harmless {})",
        t.completed(),
        t.equal,
        t.harmless_fault
    );
    let _ = writeln!(o, "  mismatches          {}", t.mismatches.len());
    let _ = writeln!(o, "  errors as expected  {expected}");
    let _ = writeln!(o, "  unexpected errors   {unexpected}");
    let _ = writeln!(o, "  shed (429/503)      {shed}");
    let _ = writeln!(o, "  disconnected        {}", t.disconnected);
    let _ = writeln!(
        o,
        "  faults injected     {} ({} must fail, {} must recover)",
        t.faults_injected,
        t.failing_faults_injected,
        t.faults_injected - t.failing_faults_injected
    );
    let _ = writeln!(
        o,
        "  pages leaked        {leaked}{}",
        if s.idle {
            ""
        } else {
            " (the mesh did not go idle)"
        }
    );
    let _ = writeln!(
        o,
        "  guard violations    {guard_total} ({} requests with a page-table fault)",
        t.guard_faults_injected
    );
    let fmt_rss =
        |k: Option<u64>| k.map_or("not measured".to_owned(), |k| format!("{:.1} MiB", mib(k)));
    let _ = writeln!(
        o,
        "  rss start           {}{}",
        fmt_rss(s.rss.start),
        s.rss.start_at.map_or(String::new(), |t| format!(
            " (at idle after {t:.0} s of load{})",
            if s.rss.start_idle {
                ""
            } else {
                ", not quite idle"
            }
        ))
    );
    let _ = writeln!(
        o,
        "  rss end             {} (at idle after the load)",
        fmt_rss(s.rss.end)
    );
    let _ = writeln!(o, "  rss peak under load {}", fmt_rss(s.rss.peak));
    let _ = writeln!(
        o,
        "  rss growth          {}",
        match rss_growth {
            None => "not measured".to_owned(),
            Some(g) if rss_checked => format!("{g:.1} % (limit {} %)", a.max_rss_growth_pct),
            Some(g) => format!(
                "{g:.1} % (not checked: runs under {RSS_CHECK_MIN_SECS} s are dominated by allocator warm-up)"
            ),
        }
    );
    if !t.expected_errors.is_empty() || !t.unexpected_errors.is_empty() || !t.shed.is_empty() {
        let _ = writeln!(o, "errors by kind");
        for (what, map) in [
            ("expected", &t.expected_errors),
            ("UNEXPECTED", &t.unexpected_errors),
            ("shed", &t.shed),
        ] {
            for (k, v) in map {
                let _ = writeln!(o, "  {what:<11} {k:<52} {v:>7}");
            }
        }
        for (k, e) in &t.unexpected_examples {
            let _ = writeln!(o, "  example of {k}: {e}");
        }
        if t.unexpected_lease_expired > 0 {
            let _ = writeln!(
                o,
                "  hint: {} requests that should have completed ran out of their lease: prefill under this load takes longer than --lease-ms {} (raise it for a larger model)",
                t.unexpected_lease_expired, a.lease_ms
            );
        }
    }
    let _ = writeln!(
        o,
        "{:<22} {:>6} {:>6} {:>6} {:>10} {:>8} {:>6} {:>5}",
        "fault", "sent", "equal", "error", "unexpected", "mismatch", "disc", "shed"
    );
    for (spec, r) in &t.per_fault {
        let _ = writeln!(
            o,
            "  {spec:<20} {:>6} {:>6} {:>6} {:>10} {:>8} {:>6} {:>5}",
            r.sent, r.equal, r.expected_error, r.unexpected, r.mismatch, r.disconnected, r.shed
        );
    }
    let _ = writeln!(
        o,
        "{:<22} {:>11} {:>6} {:>6}",
        "node", "pages total", "free", "held"
    );
    for (n, (total, free)) in &s.after.pages {
        let f = |v: &Option<f64>| v.map_or("-".to_owned(), |v| v.to_string());
        let h = held.get(n).copied().flatten();
        let _ = writeln!(o, "  {n:<20} {:>11} {:>6} {:>6}", f(total), f(free), f(&h));
    }
    if !reservations.is_empty() {
        let _ = writeln!(o, "reservations ended during the soak");
        for ((n, outcome), v) in &reservations {
            let _ = writeln!(o, "  {n:<20} {outcome:<28} {v:>7}");
        }
    }
    if !requests.is_empty() {
        let _ = writeln!(o, "router requests by outcome during the soak");
        for (outcome, v) in &requests {
            let _ = writeln!(o, "  {outcome:<49} {v:>7}");
        }
    }
    for m in t.mismatches.iter().take(10) {
        let _ = writeln!(
            o,
            "MISMATCH prompt {} ({}, {}), fault {}:\n  expected ({}): {:?}\n  got      ({}): {:?}",
            m.prompt,
            if m.chat { "chat" } else { "completion" },
            if m.stream { "stream" } else { "whole" },
            m.fault,
            m.expected_finish,
            m.expected,
            m.got_finish,
            m.got
        );
    }
    if t.mismatches.len() > 10 {
        let _ = writeln!(o, "({} more mismatches not shown)", t.mismatches.len() - 10);
    }
    if failures.is_empty() {
        let _ = writeln!(o, "result: PASS");
    } else {
        let _ = writeln!(o, "result: FAIL: {}", failures.join("; "));
    }

    let json = json!({
        "load_secs": s.load_secs,
        "streams": a.streams,
        "transport": transport,
        "fault_rate": a.fault_rate,
        "disconnect_rate": a.disconnect_rate,
        "seed": s.seed,
        "kv_pool_tokens": if s.started_mesh { json!(s.kv_pool_tokens) } else { Value::Null },
        "prompts": s.refs.iter().map(|r| json!({
            "name": r.name, "chat": r.chat, "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens, "reference_finish": r.finish,
        })).collect::<Vec<_>>(),
        "requests": t.requests,
        "streamed": t.streamed,
        "completed": t.completed(),
        "equal": t.equal,
        "failing_fault_harmless": t.harmless_fault,
        "mismatches": t.mismatches.iter().map(|m| json!({
            "prompt": m.prompt, "chat": m.chat, "stream": m.stream, "fault": m.fault,
            "expected": m.expected, "expected_finish": m.expected_finish,
            "got": m.got, "got_finish": m.got_finish,
        })).collect::<Vec<_>>(),
        "errors_expected": t.expected_errors,
        "errors_unexpected": t.unexpected_errors,
        "errors_unexpected_examples": t.unexpected_examples,
        "shed": t.shed,
        "disconnected": t.disconnected,
        "faults_injected": t.faults_injected,
        "failing_faults_injected": t.failing_faults_injected,
        "per_fault": t.per_fault.iter().map(|(spec, r)| (spec.to_string(), json!({
            "sent": r.sent, "equal": r.equal, "expected_error": r.expected_error,
            "unexpected": r.unexpected, "mismatch": r.mismatch,
            "disconnected": r.disconnected, "shed": r.shed,
        }))).collect::<serde_json::Map<_, _>>(),
        "pages": s.after.pages.iter().map(|(n, (total, free))| (n.clone(), json!({
            "total": total, "free": free,
        }))).collect::<serde_json::Map<_, _>>(),
        "pages_leaked": leaked,
        "idle": s.idle,
        "guard_violations": guard_total,
        "guard_faults_injected": t.guard_faults_injected,
        "reservations_ended": reservations.iter().map(|((n, o), v)| json!({
            "node": n, "outcome": o, "count": v,
        })).collect::<Vec<_>>(),
        "router_requests": requests,
        "rss_start_kib": s.rss.start,
        "rss_end_kib": s.rss.end,
        "rss_peak_kib": s.rss.peak,
        "rss_start_at_secs": s.rss.start_at,
        "rss_pause_secs": s.rss.pause_secs,
        "rss_samples": s.rss.samples,
        "rss_growth_pct": rss_growth,
        "rss_checked": rss_checked,
        "mesh_exit": s.mesh_exit,
        "failures": failures,
        "pass": failures.is_empty(),
    });
    Report {
        table: o,
        json,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fault_spec_is_accepted_by_the_services_parser() {
        for f in FAULTS {
            let plan = kvmesh_kvxfer::fault::FaultPlan::parse(f.spec)
                .unwrap_or_else(|e| panic!("{}: {e}", f.spec));
            assert!(!plan.is_empty(), "{}", f.spec);
            assert_eq!(plan.to_string(), f.spec);
        }
        assert!(FAULTS.iter().any(|f| f.expect == Expect::Recovers));
        assert!(FAULTS.iter().any(|f| f.expect == Expect::Fails));
    }

    #[test]
    fn metrics_are_parsed_and_leaks_found() {
        let text = "# HELP x\nkvmesh_node_kv_pages_total{node=\"decode-0\",role=\"decode\"} 16\n\
                    kvmesh_node_kv_pages_free{node=\"decode-0\",role=\"decode\"} 14\n\
                    kvmesh_node_kv_pages_total{node=\"prefill-0\",role=\"prefill\"} 16\n\
                    kvmesh_node_kv_pages_free{node=\"prefill-0\",role=\"prefill\"} 16\n\
                    kvmesh_node_reservations_total{node=\"decode-0\",outcome=\"completed\"} 3\n\
                    kvmesh_requests_total{outcome=\"length\"} 3\n";
        let f = MeshFigures::from_text(text);
        assert!(!f.idle());
        assert_eq!(f.held()["decode-0"], Some(2.0));
        assert_eq!(f.held()["prefill-0"], Some(0.0));
        assert_eq!(
            f.reservations[&("decode-0".into(), "completed".into())],
            3.0
        );
        assert_eq!(f.requests["length"], 3.0);
        let whole = MeshFigures::from_text(&text.replace("} 14", "} 16"));
        assert!(whole.idle());
        assert!(!MeshFigures::from_text("").idle());
    }

    fn reference() -> Reference {
        Reference {
            name: "p",
            text: "x".into(),
            chat: false,
            max_tokens: 8,
            prompt_tokens: 1,
            want: "abc".into(),
            finish: "length",
        }
    }

    fn plan(fault: Option<&str>) -> Plan {
        Plan {
            prompt: 0,
            stream: true,
            fault: fault.map(|s| {
                FAULTS
                    .iter()
                    .position(|f| f.spec == s)
                    .expect("a listed fault")
            }),
            disconnect_after: None,
        }
    }

    fn done(text: &str) -> Ending {
        Ending::Completed {
            text: text.into(),
            finish: "length".into(),
        }
    }

    fn err(status: u16) -> Ending {
        Ending::Http {
            status,
            kind: "server_error/decode_failed".into(),
            message: "m".into(),
        }
    }

    #[test]
    fn outcomes_are_classified_against_the_fault() {
        let r = reference();
        let mut t = Tally::default();
        t.record(&r, plan(None), done("abc"));
        t.record(&r, plan(Some("frame:1=reorder")), done("abc"));
        t.record(&r, plan(Some("step:3=corrupt")), done("abc"));
        assert_eq!((t.equal, t.harmless_fault, t.mismatches.len()), (2, 1, 0));
        t.record(&r, plan(Some("step:3=corrupt")), done("abd"));
        t.record(&r, plan(None), done("ab"));
        assert_eq!(t.mismatches.len(), 2);
        t.record(&r, plan(Some("grant=corrupt")), err(502));
        t.record(
            &r,
            plan(Some("done=corrupt")),
            Ending::SseError {
                kind: "server_error/decode_failed".into(),
                message: "m".into(),
            },
        );
        assert_eq!(Tally::count(&t.expected_errors), 2);
        assert_eq!(Tally::count(&t.unexpected_errors), 0);
        t.record(&r, plan(None), err(502));
        t.record(&r, plan(Some("done=duplicate")), err(502));
        t.record(
            &r,
            plan(Some("grant=drop")),
            Ending::Broken("timeout: no end".into()),
        );
        assert_eq!(Tally::count(&t.unexpected_errors), 3);
        t.record(&r, plan(None), err(429));
        t.record(&r, plan(Some("frame:1=drop")), err(503));
        assert_eq!(Tally::count(&t.shed), 2);
        assert_eq!(Tally::count(&t.unexpected_errors), 3);
        t.record(&r, plan(Some("done=drop")), Ending::Disconnected);
        assert_eq!(t.disconnected, 1);
        assert_eq!(t.requests, 13);
        assert_eq!(t.faults_injected, 9);
        assert_eq!(t.per_fault["step:3=corrupt"].mismatch, 1);
        // A finish reason that differs is a mismatch too.
        t.record(
            &r,
            plan(None),
            Ending::Completed {
                text: "abc".into(),
                finish: "stop".into(),
            },
        );
        assert_eq!(t.mismatches.len(), 3);
    }

    #[test]
    fn a_paused_gate_lets_no_request_in() {
        let g = Gate::default();
        g.set_deadline(Duration::from_secs(60));
        let started = Instant::now();
        assert!(g.running(started));
        assert!(g.enter());
        g.paused.store(true, Ordering::SeqCst);
        assert!(!g.enter());
        assert_eq!(g.inflight.load(Ordering::SeqCst), 1);
        g.leave();
        assert_eq!(g.inflight.load(Ordering::SeqCst), 0);
        g.paused.store(false, Ordering::SeqCst);
        assert!(g.enter());
        g.set_deadline(Duration::ZERO);
        assert!(!g.running(started));
        g.set_deadline(Duration::from_secs(60));
        g.stop.store(true, Ordering::SeqCst);
        assert!(!g.running(started));
    }

    #[test]
    fn urls_become_host_port() {
        for u in [
            "http://127.0.0.1:8080",
            "http://127.0.0.1:8080/v1",
            "127.0.0.1:8080/",
        ] {
            assert_eq!(host_port(u), "127.0.0.1:8080");
        }
    }
}
