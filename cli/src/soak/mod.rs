//! `kvmesh soak`: soak and chaos test of a running mesh.
//!
//! It starts `kvmesh serve` as a child process (or drives `--url`), computes
//! the reference output of a fixed set of prompts with the in-process
//! reference engine (what `kvmesh generate --temperature 0` prints), then for
//! `--duration` seconds runs `--streams` concurrent clients against the
//! OpenAI gateway: each request a random prompt of the set, streamed or not,
//! greedy; some dropped by the client mid-stream (`--disconnect-rate`), some
//! carrying an injected fault (`--fault-rate`, header `x-kvmesh-fault`, from
//! `kvmesh_faults::CATALOG`). Every completed output is compared with the reference; every
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
use kvmesh_client::http;
use kvmesh_model::default_model;
use kvmesh_model::engine::Engine;
use kvmesh_model::sampling::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::progress::Progress;
use crate::serve::transport_parser;
use crate::ModelArgs;
use kvmesh_kvxfer::transport::TransportKind;

/// Runs shorter than this do not check memory growth: their end-to-start
/// ratio is dominated by allocator and page-cache warm-up.
const RSS_CHECK_MIN_SECS: u64 = 120;

/// How many of each stream's first requests use the largest prompts.
const WARMUP_LONGEST: usize = 3;

/// The fault header of the gateway (honoured by `serve --fault-injection`
/// in a build with fault injection).
const FAULT_HEADER: &str = kvmesh_faults::HEADER;

/// The faults a request may carry, each with the outcome it must have:
/// the one catalogue the fault matrix runs too (`kvmesh_faults::CATALOG`).
/// Every entry is drawn with equal probability. A failing fault
/// (`Expect::fails`) may also end with the reference output here: under
/// load it may fall past a request's end (a step it never reaches, a
/// frame its prompt does not have).
use kvmesh_faults::CATALOG as FAULTS;

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
    #[arg(long, default_value = "tcp", value_parser = transport_parser())]
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
    let greedy = SamplingParams::greedy();
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
        let g =
            crate::reference_generate(engine, &text, p.chat, p.max_tokens, greedy.clone(), |_| {})
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

pub(crate) mod client;
pub(crate) mod mesh;
pub(crate) mod metrics;
mod report;
mod tally;
#[cfg(test)]
mod tests;

use client::*;
use mesh::*;
use metrics::*;
use report::*;
use tally::*;

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
            let flags = soak_serve_flags(&a, kv_pool_tokens);
            let (m, addr) = start_mesh(&model_path, &flags, a.serve_log.clone(), "soak")?;
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
    mesh::wait_healthy(addr, mesh).await?;
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
    // A status line while stderr is a terminal; nothing in a log.
    let mut progress = Progress::stderr();
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
        progress.update(|| {
            let t = tally.lock().unwrap_or_else(PoisonError::into_inner);
            format!(
                "soak: {} of {} s, requests {}, completed {}, mismatches {}, unexpected errors {}, disconnected {}",
                load_started.elapsed().as_secs(),
                duration.as_secs(),
                t.requests,
                t.completed(),
                t.mismatches.len(),
                Tally::count(&t.unexpected_errors),
                t.disconnected
            )
        });
    }
    progress.finish();
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
