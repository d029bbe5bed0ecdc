//! `kvmesh bench-router --fairness`: the noisy neighbour (per-tenant
//! admission, `kvmesh_router::admission`).
//!
//! Two tenants on one `kvmesh serve` mesh: `noisy` keeps `--noisy`
//! requests of `--noisy-n` choices (`n`) always in flight, each choice
//! generating `--noisy-tokens` tokens; `probe` sends one short streamed
//! request at a time. The probe's TTFT (request sent to its first SSE
//! chunk) is timed `--probes` times alone, then as many times under the
//! noisy load, on a fresh mesh per admission setup: `fifo` (arrival
//! order, the router before per-tenant admission), `fair` with no reserve
//! (work-conserving), `fair` as configured by default (a reserve of an
//! eighth of the slots, the keys naming two tenants), and with
//! `--noisy-cap N` a mesh where the noisy key is capped at N slots. The report gives p50/p90 of each phase and the
//! ratio loaded/alone; the goal is fair admission keeping the probe's TTFT
//! under load within 2x its TTFT alone.
//!
//! A benchmark: nothing here asserts a time. The run fails only when a
//! probe fails or no noisy request completes.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvmesh_client::http::{self, Request};
use serde_json::{json, Value};

use super::report::{round1, Percentiles};
use super::BenchRouterArgs;
use crate::soak::mesh::{start_mesh, wait_healthy};

const NOISY_KEY: &str = "sk-bench-noisy";
const PROBE_KEY: &str = "sk-bench-probe";

/// One mesh's figures.
#[derive(Debug)]
struct Row {
    setup: String,
    alone_ms: Percentiles,
    loaded_ms: Percentiles,
    /// Noisy choices completed per second during the loaded phase.
    noisy_choices_per_s: f64,
    noisy_failed: usize,
}

impl Row {
    fn ratio(&self) -> (f64, f64) {
        (
            self.loaded_ms.p50 / self.alone_ms.p50,
            self.loaded_ms.p90 / self.alone_ms.p90,
        )
    }
}

/// One mesh's admission: policy, reserve (`None`: the default), the
/// noisy key's cap.
type Setup = (&'static str, Option<usize>, Option<usize>);

/// The meshes to run.
fn setups(a: &BenchRouterArgs) -> Vec<Setup> {
    let mut s = vec![
        ("fifo", None, None),
        ("fair", Some(0), None),
        ("fair", None, None),
    ];
    if let Some(cap) = a.noisy_cap {
        s.push(("fair", Some(0), Some(cap)));
    }
    s
}

pub(super) fn run(a: &BenchRouterArgs, model: &Path) -> Result<()> {
    if a.probes == 0 || a.noisy == 0 || a.noisy_n == 0 || a.fair_slots == 0 {
        bail!("--probes, --noisy, --noisy-n and --fair-slots must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    // Every sequence fits: the slots' worth of prompts and completions.
    let per_seq = 64 + a.noisy_tokens;
    let pool = (a.fair_slots + 1) * per_seq.max(a.max_model_len);
    let mut rows = Vec::new();
    for (policy, reserve, cap) in setups(a) {
        let mut flags: Vec<String> = [
            "--max-model-len",
            &a.max_model_len.to_string(),
            "--kv-pool-tokens",
            &pool.to_string(),
            "--api-key",
            &format!("{NOISY_KEY}=noisy"),
            "--api-key",
            &format!("{PROBE_KEY}=probe"),
            "--max-running",
            &a.fair_slots.to_string(),
            "--max-queued",
            &(a.noisy * a.noisy_n + 16).to_string(),
            "--admission",
            policy,
        ]
        .map(str::to_owned)
        .to_vec();
        let mut setup = policy.to_owned();
        if let Some(r) = reserve {
            flags.extend(["--reserve".into(), r.to_string()]);
            setup += &format!(", reserve {r}");
        } else if policy == "fair" {
            setup += &format!(
                ", reserve {} (default)",
                kvmesh_router::admission::default_reserve(a.fair_slots, 2)
            );
        }
        if let Some(c) = cap {
            flags.extend(["--tenant-share".into(), format!("noisy:max_running={c}")]);
            setup += &format!(", noisy capped at {c}");
        }
        let (m, addr) = start_mesh(model, &flags, a.serve_log.clone(), "bench-fairness")?;
        eprintln!(
            "bench-router --fairness: {setup}: mesh at http://{addr}, log {}",
            m.log.display()
        );
        let mut mesh = Some(m);
        rt.block_on(wait_healthy(&addr, &mut mesh))?;
        let row = rt.block_on(one_mesh(a, &addr, setup))?;
        drop(mesh);
        rows.push(row);
    }
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    print!("{}", table(a, model, &cpu, threads, &rows));
    if let Some(path) = &a.json {
        let v = json!({
            "model": model.display().to_string(),
            "cpu": cpu,
            "threads": threads,
            "slots": a.fair_slots,
            "noisy": {"requests": a.noisy, "n": a.noisy_n, "tokens": a.noisy_tokens},
            "probes": a.probes,
            "rows": rows.iter().map(|r| {
                let (p50, p90) = r.ratio();
                json!({
                    "setup": r.setup,
                    "alone_ms": {"p50": round1(r.alone_ms.p50), "p90": round1(r.alone_ms.p90)},
                    "loaded_ms": {"p50": round1(r.loaded_ms.p50), "p90": round1(r.loaded_ms.p90)},
                    "ratio": {"p50": round1(p50 * 10.0) / 10.0, "p90": round1(p90 * 10.0) / 10.0},
                    "noisy_choices_per_s": round1(r.noisy_choices_per_s),
                    "noisy_failed": r.noisy_failed,
                })
            }).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn table(a: &BenchRouterArgs, model: &Path, cpu: &str, threads: usize, rows: &[Row]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let name = model.file_name().map_or_else(
        || model.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let _ = writeln!(
        s,
        "kvmesh bench-router --fairness  ({name}; {cpu}, {threads} threads)\n\
         {} slots; noisy: {} requests of n={} x {} tokens in flight; probe: TTFT of one \
         streamed request at a time, {} per phase",
        a.fair_slots, a.noisy, a.noisy_n, a.noisy_tokens, a.probes
    );
    let _ = writeln!(
        s,
        "{:<34} {:>10} {:>10} {:>11} {:>11} {:>9} {:>9} {:>12} {:>7}",
        "admission",
        "alone p50",
        "alone p90",
        "loaded p50",
        "loaded p90",
        "x p50",
        "x p90",
        "noisy ch/s",
        "failed"
    );
    for r in rows {
        let (p50, p90) = r.ratio();
        let _ = writeln!(
            s,
            "{:<34} {:>8.1}ms {:>8.1}ms {:>9.1}ms {:>9.1}ms {:>8.2}x {:>8.2}x {:>12.1} {:>7}",
            r.setup,
            r.alone_ms.p50,
            r.alone_ms.p90,
            r.loaded_ms.p50,
            r.loaded_ms.p90,
            p50,
            p90,
            r.noisy_choices_per_s,
            r.noisy_failed
        );
    }
    s
}

/// The probe's request: short, streamed, greedy.
fn probe_body() -> Value {
    json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": true})
}

/// The noisy tenant's request: `n` sampled choices of a fixed length.
fn noisy_body(a: &BenchRouterArgs, i: usize) -> Value {
    json!({
        "prompt": format!("The noisy tenant's request number {i} asks for many samples of a story"),
        "n": a.noisy_n,
        "max_tokens": a.noisy_tokens,
        "temperature": 0.8,
        "ignore_eos": true,
    })
}

fn post(key: &str, body: &Value) -> Request {
    Request::post_json("/v1/completions", body).header("authorization", &format!("Bearer {key}"))
}

/// One probe: milliseconds from sending to the first SSE chunk.
async fn probe(addr: &str) -> Result<f64> {
    let sent = Instant::now();
    let resp = http::send(addr, &post(PROBE_KEY, &probe_body())).await?;
    if resp.status != 200 {
        let status = resp.status;
        let body = resp.read_all().await.map(|r| r.text()).unwrap_or_default();
        bail!("probe: HTTP {status}: {body}");
    }
    let mut sse = resp.events();
    let mut first = None;
    while let Some(data) = sse.next().await? {
        if data == "[DONE]" {
            break;
        }
        if data.contains("\"error\"") {
            bail!("probe: {data}");
        }
        first.get_or_insert_with(|| sent.elapsed().as_secs_f64() * 1e3);
    }
    first.context("probe: no chunk before [DONE]")
}

async fn probes(addr: &str, n: usize) -> Result<Percentiles> {
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        ms.push(probe(addr).await?);
    }
    Percentiles::of(ms).context("no probe")
}

/// The noisy tenant's closed loop, until `stop`; counts choices and
/// failures.
async fn noisy_loop(
    addr: String,
    body: Value,
    choices: usize,
    done: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
) {
    loop {
        let ok = match http::send(&addr, &post(NOISY_KEY, &body)).await {
            Ok(r) => r.status == 200 && r.read_all().await.is_ok(),
            Err(_) => false,
        };
        if ok {
            done.fetch_add(choices, Ordering::Relaxed);
        } else {
            failed.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn one_mesh(a: &BenchRouterArgs, addr: &str, setup: String) -> Result<Row> {
    // Warm-up: both tenants' paths once.
    probes(addr, 3).await?;
    let r = http::send(addr, &post(NOISY_KEY, &noisy_body(a, 0))).await?;
    if r.status != 200 {
        bail!("the noisy warm-up request: HTTP {}", r.status);
    }
    r.read_all().await?;
    let alone_ms = probes(addr, a.probes).await?;
    let (done, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut load = tokio::task::JoinSet::new();
    for i in 0..a.noisy {
        load.spawn(noisy_loop(
            addr.to_owned(),
            noisy_body(a, i + 1),
            a.noisy_n,
            Arc::clone(&done),
            Arc::clone(&failed),
        ));
    }
    // Steady state: the first noisy requests have run to their end.
    let waited = Instant::now();
    while done.load(Ordering::Relaxed) < a.noisy_n {
        if waited.elapsed() > Duration::from_secs(300) {
            bail!("no noisy request completed in 300 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (started, before) = (Instant::now(), done.load(Ordering::Relaxed));
    let loaded_ms = probes(addr, a.probes).await?;
    let noisy_choices_per_s =
        (done.load(Ordering::Relaxed) - before) as f64 / started.elapsed().as_secs_f64();
    // Dropping the clients' connections aborts their requests.
    load.shutdown().await;
    Ok(Row {
        setup,
        alone_ms,
        loaded_ms,
        noisy_choices_per_s,
        noisy_failed: failed.load(Ordering::Relaxed),
    })
}
