//! `kvmesh bench`: a load generator for the OpenAI-compatible gateway.
//!
//! It starts `kvmesh serve` itself with the model flags (or drives a
//! running gateway, `--url`), and sends streamed, greedy completions with
//! `ignore_eos`, so every request generates exactly its drawn output
//! length. Prompt and output lengths are drawn from `--prompt-len` and
//! `--output-len` (fixed, uniform, normal, log-normal); prompts are built
//! from words to exactly the drawn token count with the model's tokenizer
//! (what the gateway counts). Load is a closed loop (`--concurrency`
//! requests always in flight) or an open loop (`--rate` requests per
//! second, Poisson arrivals), for `--requests` and/or `--duration`, after
//! `--warmup` requests that are not measured. One `--seed` fixes the
//! lengths, the prompts and the arrival times.
//!
//! Per request it records TTFT, the inter-token gaps, end-to-end latency
//! and the output token count; the report gives p50/p90/p99 of each,
//! output tokens/s and requests/s, completed and failed counts, as a table
//! and as JSON (`--json`). With `--reference` the same workload then runs
//! against the in-process reference engine through the chunked-prefill
//! scheduler, after the mesh has been stopped (the two never share the
//! machine's cores), and the report puts the two side by side with the
//! ratio mesh/reference.
//!
//! A benchmark: it asserts no time. It fails (non-zero exit) only when no
//! request completed on a target.
//!
//! Layout: [`dist`] (length distributions, arrival gaps), [`workload`]
//! (requests and arrival times from the seed), [`gateway`] (the mesh:
//! HTTP/SSE client and its closed and open loops), `reference` (the
//! scheduler as a target), [`stats`] (per-request samples, percentiles,
//! table and JSON).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_model::default_model;
use kvmesh_model::scheduler::{Scheduler, SchedulerConfig};
use kvmesh_model::TextTokenizer;
use serde_json::{json, Value};

use crate::soak::mesh::{host_port, start_mesh, wait_healthy};
use crate::ModelArgs;

mod dist;
mod gateway;
mod reference;
mod stats;
#[cfg(test)]
mod tests;
pub(crate) mod workload;

use dist::LenDist;
use stats::{Sample, Summary};
use workload::{check_lengths, one_token_words, Workload, WorkloadSpec};

/// Measured requests when neither `--requests` nor `--duration` is given.
const DEFAULT_REQUESTS: usize = 100;
/// Clients of the closed loop when neither `--concurrency` nor `--rate`.
const DEFAULT_CONCURRENCY: usize = 4;
/// Requests whose lengths are checked (and sized for) before a
/// `--duration` run without `--requests`.
const CHECK_AHEAD: usize = 10_000;
/// Requests the KV pool is sized to hold at once in an open loop (more in
/// flight wait for pages, on both targets alike).
const OPEN_IN_FLIGHT: usize = 64;
/// The longest `--request-timeout-s` honoured (a year).
const MAX_TIMEOUT_S: u64 = 365 * 24 * 3600;
/// The reference scheduler's queue (a submission past it counts failed,
/// like a 429 from the gateway).
const REFERENCE_QUEUE: usize = 4096;

/// `kvmesh bench` flags.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A running gateway (`http://HOST:PORT`) [default: start `kvmesh
    /// serve` with the model flags]. Its model must be --model's: prompts
    /// are sized with that tokenizer.
    #[arg(long)]
    url: Option<String>,
    /// Closed loop: this many requests always in flight [default: 4].
    #[arg(long, conflicts_with = "rate")]
    concurrency: Option<usize>,
    /// Open loop: requests per second, Poisson arrivals (exponential gaps).
    #[arg(long)]
    rate: Option<f64>,
    /// Requests to measure [default: 100, or unlimited with --duration].
    #[arg(long)]
    requests: Option<usize>,
    /// Send no new measured request after this many seconds.
    #[arg(long)]
    duration: Option<f64>,
    /// Requests to send first, not measured (closed loop).
    #[arg(long, default_value_t = 0)]
    warmup: usize,
    /// Prompt tokens: fixed:N, uniform:A-B, normal:MEAN,SD or
    /// lognormal:MEAN,SD (draws clamped to at least 1).
    #[arg(long, default_value = "uniform:16-128")]
    prompt_len: String,
    /// Output tokens, in the same forms; each request generates exactly
    /// its draw (ignore_eos).
    #[arg(long, default_value = "fixed:32")]
    output_len: String,
    /// Seed of the lengths, prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Then run the same workload on the in-process reference engine
    /// (chunked-prefill scheduler) and report both, with ratios.
    #[arg(long)]
    reference: bool,
    /// Targets take turns (the mesh, the mesh with checks off, the
    /// reference) over this many rounds, each running the whole workload
    /// (--requests, after --warmup) every round; a target's figures pool its
    /// rounds. A slow spell of a shared host then falls on every target,
    /// not on whichever ran during it.
    #[arg(long, default_value_t = 1, conflicts_with = "duration")]
    rounds: usize,
    /// The reference scheduler's token budget per step.
    #[arg(long, default_value_t = 256)]
    ref_step_tokens: usize,
    /// The reference scheduler's running sequences at most.
    #[arg(long, default_value_t = 64)]
    ref_max_running: usize,
    /// Seconds a request may take before it counts as failed (at most a
    /// year).
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where the started mesh's log (stderr) goes [default: a file in the
    /// temporary directory].
    #[arg(long)]
    serve_log: Option<PathBuf>,
    /// Cost of safety: run the mesh workload a second time with the KV
    /// checks switched off (`serve --plant-bug no-kv-checks`: no generation
    /// or watermark check on reads, no checksums, no I4 verification; needs a
    /// build with fault injection, `--features fault-injection`) and print
    /// both, with the
    /// ratio checks-on / checks-off.
    #[arg(long, conflicts_with = "url")]
    compare_safety: bool,
    /// One more flag for the started `serve` (repeat: `--serve-arg=--transport=shm`).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    #[command(flatten)]
    model: ModelArgs,
}

/// How requests are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mode {
    /// A fixed number in flight.
    Closed { concurrency: usize },
    /// Poisson arrivals at `rate` per second.
    Open { rate: f64 },
}

/// Everything a target's run needs; both targets get the same.
#[derive(Clone, Debug)]
pub(crate) struct Load {
    pub(crate) mode: Mode,
    pub(crate) duration: Option<Duration>,
    pub(crate) warmup: usize,
    pub(crate) timeout: Duration,
    pub(crate) spec: WorkloadSpec,
    pub(crate) tok: Arc<TextTokenizer>,
    pub(crate) words: Arc<Vec<&'static str>>,
}

impl Load {
    /// The measured requests, from the start.
    pub(crate) fn workload(&self) -> Workload {
        Workload::new(
            Arc::clone(&self.tok),
            Arc::clone(&self.words),
            self.spec.clone(),
        )
    }

    /// The warm-up requests, from the start.
    pub(crate) fn warmup_workload(&self) -> Workload {
        Workload::new(
            Arc::clone(&self.tok),
            Arc::clone(&self.words),
            self.spec.warmup(self.warmup),
        )
    }

    /// When measured requests stop being sent: `--duration` from now.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.duration.and_then(|d| Instant::now().checked_add(d))
    }

    /// Clients of the warm-up: the run's concurrency (closed loop), or 1.
    pub(crate) fn warmup_concurrency(&self) -> usize {
        match self.mode {
            Mode::Closed { concurrency } => concurrency,
            Mode::Open { .. } => 1,
        }
    }

    fn describe(&self) -> String {
        let mode = match self.mode {
            Mode::Closed { concurrency } => format!("closed loop, concurrency {concurrency}"),
            Mode::Open { rate } => format!("open loop, {rate} requests/s (Poisson)"),
        };
        let amount = match (self.spec.requests, self.duration) {
            (Some(n), None) => format!("{n} requests"),
            (None, Some(d)) => format!("{} s", d.as_secs_f64()),
            (Some(n), Some(d)) => format!("{n} requests or {} s", d.as_secs_f64()),
            (None, None) => "unbounded".into(),
        };
        format!(
            "{mode}, {amount} (+{} warm-up), seed {}\nprompt tokens {}, output tokens {} (ignore_eos)",
            self.warmup, self.spec.seed, self.spec.prompt_len, self.spec.output_len
        )
    }
}

/// `secs` after `start`; `None` when that is not representable (an
/// arrival so far away it never comes).
pub(crate) fn offset(start: Instant, secs: f64) -> Option<Instant> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .and_then(|d| start.checked_add(d))
}

/// Parses and checks the flags that shape the load.
fn mode_of(a: &BenchArgs) -> Result<(Mode, Option<usize>, Option<Duration>)> {
    let mode = match (a.concurrency, a.rate) {
        (_, Some(rate)) if !(rate.is_finite() && rate > 0.0) => {
            bail!("--rate {rate} must be a number above 0")
        }
        (_, Some(rate)) => Mode::Open { rate },
        (Some(0), None) => bail!("--concurrency must be at least 1"),
        (c, None) => Mode::Closed {
            concurrency: c.unwrap_or(DEFAULT_CONCURRENCY),
        },
    };
    let duration = match a.duration {
        Some(d) if !(d.is_finite() && d > 0.0) => bail!("--duration {d} must be above 0 seconds"),
        Some(d) => Some(
            Duration::try_from_secs_f64(d)
                .map_err(|_| anyhow::anyhow!("--duration {d} is too long"))?,
        ),
        None => None,
    };
    let requests = match (a.requests, duration) {
        (Some(0), _) => bail!("--requests must be at least 1"),
        (None, None) => Some(DEFAULT_REQUESTS),
        (r, _) => r,
    };
    Ok((mode, requests, duration))
}

/// The `serve` flags of the started mesh: the model flags as given, the
/// pool as sized here, then `--serve-arg`s.
fn serve_flags(a: &BenchArgs, kv_pool_tokens: usize) -> Vec<String> {
    let mut flags = a.model.serve_flags(kv_pool_tokens);
    flags.extend(a.serve_args.iter().cloned());
    flags
}

/// Runs the workload against the gateway (`--url`) or a freshly started
/// `kvmesh serve` with `extra` flags, stopped again before this returns.
fn run_mesh(
    a: &BenchArgs,
    load: &Load,
    model_path: &std::path::Path,
    kv_pool_tokens: usize,
    extra: &[String],
) -> Result<Vec<Sample>> {
    let (mut child, addr) = match &a.url {
        Some(u) => (None, host_port(u)),
        None => {
            let mut flags = serve_flags(a, kv_pool_tokens);
            flags.extend(extra.iter().cloned());
            let (m, addr) = start_mesh(model_path, &flags, a.serve_log.clone(), "bench")?;
            eprintln!("bench: mesh at http://{addr}, log {}", m.log.display());
            (Some(m), addr)
        }
    };
    eprintln!("bench: {}", load.describe().replace('\n', "; "));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let samples = rt.block_on(async {
        wait_healthy(&addr, &mut child).await?;
        gateway::run(&addr, load).await
    })?;
    // The mesh stops before anything else runs: targets never share cores.
    drop(child);
    drop(rt);
    Ok(samples)
}

pub fn run(a: BenchArgs) -> Result<()> {
    let prompt_len = LenDist::parse("--prompt-len", &a.prompt_len).map_err(anyhow::Error::msg)?;
    let output_len = LenDist::parse("--output-len", &a.output_len).map_err(anyhow::Error::msg)?;
    let (mode, requests, duration) = mode_of(&a)?;
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let model_path = match &a.model.model {
        Some(p) => p.clone(),
        None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
    };
    // Only the tokenizer and limits are needed here: load the cheap way.
    let loaded = kvmesh_model::load_with(&model_path, kvmesh_model::Precision::Quantized)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let tok = Arc::new(loaded.tokenizer.clone());
    let max_model_len = a
        .model
        .max_model_len
        .unwrap_or(loaded.config.max_position_embeddings);
    drop(loaded);
    let spec = WorkloadSpec {
        seed: a.seed,
        prompt_len,
        output_len,
        requests,
        max_model_len,
    };
    let load = Load {
        mode,
        duration,
        warmup: a.warmup,
        timeout: Duration::from_secs(a.request_timeout_s.clamp(1, MAX_TIMEOUT_S)),
        words: Arc::new(one_token_words(&tok)?),
        tok,
        spec,
    };
    // Every length fits the context before anything starts; the pool holds
    // what is in flight at once (and one full context, as serve requires).
    let mut longest = check_lengths(&load.spec, requests.unwrap_or(CHECK_AHEAD))?;
    if a.warmup > 0 {
        longest = longest.max(check_lengths(&load.spec.warmup(a.warmup), a.warmup)?);
    }
    let in_flight = match mode {
        Mode::Closed { concurrency } => concurrency,
        Mode::Open { .. } => requests.unwrap_or(OPEN_IN_FLIGHT).min(OPEN_IN_FLIGHT),
    };
    let kv_pool_tokens = a
        .model
        .kv_pool_tokens
        .unwrap_or_else(|| in_flight.saturating_mul(longest).max(max_model_len));

    // The reference engine is loaded once and idles while the mesh runs.
    let sched = if a.reference {
        let mut model = a.model.clone();
        model.model = Some(model_path.clone());
        model.kv_pool_tokens = Some(kv_pool_tokens);
        let engine = Arc::new(model.load_engine()?);
        Some(Scheduler::start(
            engine,
            SchedulerConfig {
                step_tokens: a.ref_step_tokens,
                max_running: a.ref_max_running,
                queue: REFERENCE_QUEUE,
            },
        )?)
    } else {
        None
    };
    let off = ["--plant-bug".to_owned(), "no-kv-checks".to_owned()];
    let (mut mesh, mut unchecked, mut reference) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=a.rounds {
        if a.rounds > 1 {
            eprintln!("bench: round {round} of {}", a.rounds);
        }
        mesh.push(run_mesh(&a, &load, &model_path, kv_pool_tokens, &[])?);
        if a.compare_safety {
            eprintln!("bench: the same workload with the KV checks off (--plant-bug no-kv-checks)");
            unchecked.push(run_mesh(&a, &load, &model_path, kv_pool_tokens, &off)?);
        }
        if let Some(sched) = &sched {
            eprintln!("bench: the same workload on the reference engine");
            reference.push(reference::run(sched, &load)?);
        }
    }
    if let Some(sched) = sched {
        sched.shutdown();
    }
    let mesh = Summary::of_rounds(mesh);
    let unchecked = a.compare_safety.then(|| Summary::of_rounds(unchecked));
    let reference = a.reference.then(|| Summary::of_rounds(reference));

    let name = model_path.file_name().map_or_else(
        || model_path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let rounds = if a.rounds > 1 {
        format!(", {} rounds (targets take turns)", a.rounds)
    } else {
        String::new()
    };
    let title = format!("kvmesh bench: {}{rounds}, model {name}", load.describe());
    print!("{}", stats::table(&title, &mesh, reference.as_ref()));
    if let Some(off) = &unchecked {
        let t = stats::table_of(
            "cost of safety: the mesh with every KV check on, and with them off",
            ("checks on", &mesh),
            Some(("checks off", off)),
            "on/off",
        );
        print!("{t}");
    }
    if let Some(path) = &a.json {
        let mut report = report_json(&load, &name, kv_pool_tokens, &mesh, reference.as_ref());
        if let (Some(off), Some(obj)) = (&unchecked, report.as_object_mut()) {
            obj.insert("checks_off".into(), off.json());
            obj.insert("checks_on_over_off".into(), stats::ratios(&mesh, off));
        }
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    for (target, s) in
        std::iter::once(("mesh", &mesh)).chain(reference.as_ref().map(|r| ("reference", r)))
    {
        if s.completed == 0 {
            bail!("no request completed on the {target}");
        }
    }
    Ok(())
}

fn report_json(
    load: &Load,
    model: &str,
    kv_pool_tokens: usize,
    mesh: &Summary,
    reference: Option<&Summary>,
) -> Value {
    let (mode, concurrency, rate) = match load.mode {
        Mode::Closed { concurrency } => ("closed", Some(concurrency), None),
        Mode::Open { rate } => ("open", None, Some(rate)),
    };
    json!({
        "config": {
            "mode": mode,
            "concurrency": concurrency,
            "rate": rate,
            "requests": load.spec.requests,
            "duration_s": load.duration.map(|d| d.as_secs_f64()),
            "warmup": load.warmup,
            "seed": load.spec.seed,
            "prompt_len": load.spec.prompt_len.to_string(),
            "output_len": load.spec.output_len.to_string(),
            "model": model,
            "kv_pool_tokens": kv_pool_tokens,
        },
        "mesh": mesh.json(),
        "reference": reference.map(Summary::json),
        "ratios": reference.map(|r| stats::ratios(mesh, r)),
    })
}
