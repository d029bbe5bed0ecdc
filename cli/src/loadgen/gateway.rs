//! The mesh as a target: streamed completions (`/v1/completions`, SSE,
//! greedy, `ignore_eos`) over HTTP/1.1 with one connection per request
//! (the soak's client), driven closed- or open-loop on tokio.
//!
//! A request's time starts just before its connection is opened, so TTFT
//! includes the loopback connect (tens of microseconds). Tokens are timed
//! when their SSE event is read. The gateway sends one event per piece of
//! text; a piece that completes a character split over several tokens
//! carries all of them, so each event counts the tokens its text encodes
//! to (at least 1) for the inter-token gaps, while the output token count
//! is the gateway's own `usage.completion_tokens`. Tokens that decode to
//! no text (special tokens) send no event: TTFT is to the first text.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use kvmesh_model::TextTokenizer;
use serde_json::{json, Value};

use super::stats::{timings, Sample};
use super::workload::{Arrivals, RequestSpec, Workload};
use super::{Load, Mode};
use crate::progress::Ticker;
use kvmesh_client::http::{self, Request};

/// What a stream delivered.
#[derive(Default)]
struct Streamed {
    arrivals: Vec<(Instant, usize)>,
    /// `usage`: prompt and completion tokens.
    usage: Option<(usize, usize)>,
}

/// `type/code` of an OpenAI-style error, for grouping failures.
fn error_code(v: &Value) -> String {
    let e = &v["error"];
    format!(
        "{}/{}",
        e["type"].as_str().unwrap_or("?"),
        e["code"].as_str().unwrap_or("?")
    )
}

async fn stream(
    addr: &str,
    spec: &RequestSpec,
    tok: &TextTokenizer,
    out: &mut Streamed,
) -> Result<(), String> {
    let body = json!({
        "prompt": spec.text,
        "max_tokens": spec.output_len,
        "temperature": 0,
        "stream": true,
        "ignore_eos": true,
    });
    let resp = http::send(addr, &Request::post_json("/v1/completions", &body))
        .await
        .map_err(|e| format!("connection: {e}"))?;
    let status = resp.status;
    if status != 200 {
        let code = match resp.read_all().await.map(|r| r.json()) {
            Ok(Ok(v)) => error_code(&v),
            _ => "?".into(),
        };
        return Err(format!("http {status} {code}"));
    }
    let mut sse = resp.events();
    let mut finished = false;
    while let Some(data) = sse.next().await.map_err(|e| e.to_string())? {
        if data == "[DONE]" {
            return if finished {
                Ok(())
            } else {
                Err("[DONE] without a finish_reason".into())
            };
        }
        let at = Instant::now();
        let v: Value =
            serde_json::from_str(&data).map_err(|_| "an SSE event that is not JSON".to_owned())?;
        if v.get("error").is_some() {
            return Err(format!("sse {}", error_code(&v)));
        }
        let c = &v["choices"][0];
        let text = c["text"].as_str().unwrap_or_default();
        if !text.is_empty() {
            let k = tok.encode_raw(text).map_or(1, |ids| ids.len().max(1));
            out.arrivals.push((at, k));
        }
        if let Some(u) = v.get("usage") {
            let n = |k: &str| u[k].as_u64().map_or(0, |n| n as usize);
            out.usage = Some((n("prompt_tokens"), n("completion_tokens")));
        }
        finished |= c["finish_reason"].is_string();
    }
    Err("the stream ended without [DONE]".into())
}

/// Runs one request to its end (or `timeout`).
async fn one(addr: &str, spec: &RequestSpec, tok: &TextTokenizer, timeout: Duration) -> Sample {
    let sent = Instant::now();
    let mut got = Streamed::default();
    let result = tokio::time::timeout(timeout, stream(addr, spec, tok, &mut got)).await;
    let end = Instant::now();
    let mut error = match result {
        Err(_) => Some("timeout".to_owned()),
        Ok(Err(e)) => Some(e),
        Ok(Ok(())) => None,
    };
    if error.is_none() && got.usage.is_none() {
        error = Some("no usage in the stream".into());
    }
    let (ttft, itl) = timings(sent, &got.arrivals);
    Sample {
        index: spec.index,
        prompt_tokens: spec.prompt_ids.len(),
        output_len: spec.output_len,
        sent,
        ttft,
        itl,
        end,
        output_tokens: got.usage.map_or(0, |u| u.1),
        server_prompt_tokens: got.usage.map(|u| u.0),
        error,
    }
}

/// The warm-up (closed loop; not measured), then the measured requests.
pub(crate) async fn run(addr: &str, load: &Load) -> Result<Vec<Sample>> {
    if load.warmup > 0 {
        let done = Arc::new(AtomicU64::new(0));
        let ticker = Ticker::start("bench warm-up", Arc::clone(&done), Some(load.warmup as u64));
        let r = closed(
            addr,
            load,
            load.warmup_workload(),
            load.warmup_concurrency(),
            None,
            done,
        )
        .await;
        ticker.stop().await;
        r?;
    }
    let deadline = load.deadline();
    let done = Arc::new(AtomicU64::new(0));
    let total = load.spec.requests.map(|n| n as u64);
    let ticker = Ticker::start("bench", Arc::clone(&done), total);
    let r = match load.mode {
        Mode::Closed { concurrency } => {
            closed(addr, load, load.workload(), concurrency, deadline, done).await
        }
        Mode::Open { rate } => open(addr, load, rate, done).await,
    };
    ticker.stop().await;
    r
}

/// `concurrency` clients, each sending its next request when the last one
/// ended, until the workload ends or `deadline` passes.
async fn closed(
    addr: &str,
    load: &Load,
    workload: Workload,
    concurrency: usize,
    deadline: Option<Instant>,
    done: Arc<AtomicU64>,
) -> Result<Vec<Sample>> {
    let workload = Arc::new(Mutex::new(workload));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (workload, addr, tok, timeout, done) = (
            Arc::clone(&workload),
            addr.to_owned(),
            Arc::clone(&load.tok),
            load.timeout,
            Arc::clone(&done),
        );
        clients.spawn(async move {
            let mut samples = Vec::new();
            while deadline.is_none_or(|d| Instant::now() < d) {
                let next = workload
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .next_request()?;
                let Some(spec) = next else { break };
                samples.push(one(&addr, &spec, &tok, timeout).await);
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(samples)
        });
    }
    let mut all = Vec::new();
    while let Some(r) = clients.join_next().await {
        all.extend(r.map_err(|e| anyhow!("a client task failed: {e}"))??);
    }
    Ok(all)
}

/// Requests sent at the workload's Poisson arrival times, whatever is in
/// flight, until the workload ends or the next arrival is past
/// `--duration`.
async fn open(addr: &str, load: &Load, rate: f64, done: Arc<AtomicU64>) -> Result<Vec<Sample>> {
    let mut workload = load.workload();
    let mut arrivals = Arrivals::new(load.spec.seed, rate);
    let start = tokio::time::Instant::now();
    let mut in_flight = tokio::task::JoinSet::new();
    while let Some(spec) = workload.next_request()? {
        let at = arrivals.next_offset();
        if load.duration.is_some_and(|d| at > d.as_secs_f64()) {
            break;
        }
        let Some(due) = super::offset(start.into_std(), at) else {
            break;
        };
        tokio::time::sleep_until(due.into()).await;
        let (addr, tok, timeout, done) = (
            addr.to_owned(),
            Arc::clone(&load.tok),
            load.timeout,
            Arc::clone(&done),
        );
        in_flight.spawn(async move {
            let s = one(&addr, &spec, &tok, timeout).await;
            done.fetch_add(1, Ordering::Relaxed);
            s
        });
    }
    let mut all = Vec::new();
    while let Some(r) = in_flight.join_next().await {
        all.push(r.map_err(|e| anyhow!("a request task failed: {e}"))?);
    }
    Ok(all)
}
