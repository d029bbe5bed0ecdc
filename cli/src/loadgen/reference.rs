//! The in-process reference engine as a target, through the chunked-prefill
//! scheduler (`kvmesh_model::scheduler`), driven like the mesh: the same
//! requests, the same closed-loop concurrency or open-loop arrival times.
//!
//! A request's time starts just before it is submitted; its tokens and end
//! are timed by the scheduler's events (`at`, when each was sampled), so
//! when the client thread reads them does not matter.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::scheduler::{SchedEvent, SchedRequest, Scheduler};

use super::stats::{timings, Sample};
use super::workload::{Arrivals, RequestSpec, Workload};
use super::{Load, Mode};

/// A submitted request: its events, or why it was refused.
type Submitted = (RequestSpec, Instant, Result<Receiver<SchedEvent>, String>);

fn submit(s: &Scheduler, spec: RequestSpec) -> Submitted {
    let sent = Instant::now();
    let rx = s
        .submit_request(SchedRequest {
            prompt: spec.prompt_ids.clone(),
            max_new_tokens: spec.output_len,
            sampling: SamplingParams::greedy(),
            ignore_eos: true,
        })
        .map_err(|e| format!("refused {}", e.kind()));
    (spec, sent, rx)
}

/// Reads a request's events to its end (or until `timeout` after `sent`).
fn collect((spec, sent, rx): Submitted, timeout: Duration) -> Sample {
    let mut arrivals = Vec::new();
    let (end, error) = match rx {
        Err(e) => (Instant::now(), Some(e)),
        Ok(rx) => loop {
            let left = super::offset(sent, timeout.as_secs_f64())
                .map_or(timeout, |d| d.saturating_duration_since(Instant::now()));
            match rx.recv_timeout(left) {
                Ok(SchedEvent::Token { at, .. }) => arrivals.push((at, 1)),
                Ok(SchedEvent::Finished { at, .. }) => break (at, None),
                Ok(SchedEvent::Failed { error, at }) => {
                    break (at, Some(format!("failed: {error}")))
                }
                Err(RecvTimeoutError::Timeout) => break (Instant::now(), Some("timeout".into())),
                Err(RecvTimeoutError::Disconnected) => {
                    break (Instant::now(), Some("no final event".into()))
                }
            }
        },
    };
    let (ttft, itl) = timings(sent, &arrivals);
    Sample {
        index: spec.index,
        prompt_tokens: spec.prompt_ids.len(),
        output_len: spec.output_len,
        sent,
        ttft,
        itl,
        end,
        output_tokens: arrivals.len(),
        server_prompt_tokens: None,
        error,
    }
}

/// The warm-up (closed loop; not measured), then the measured requests.
pub(crate) fn run(s: &Scheduler, load: &Load) -> Result<Vec<Sample>> {
    if load.warmup > 0 {
        closed(
            s,
            load,
            load.warmup_workload(),
            load.warmup_concurrency(),
            None,
        )?;
    }
    let deadline = load.deadline();
    match load.mode {
        Mode::Closed { concurrency } => closed(s, load, load.workload(), concurrency, deadline),
        Mode::Open { rate } => open(s, load, rate),
    }
}

/// `concurrency` client threads, each submitting its next request when
/// the last one ended.
fn closed(
    s: &Scheduler,
    load: &Load,
    workload: Workload,
    concurrency: usize,
    deadline: Option<Instant>,
) -> Result<Vec<Sample>> {
    let workload = Mutex::new(workload);
    std::thread::scope(|scope| {
        let clients: Vec<_> = (0..concurrency)
            .map(|_| {
                scope.spawn(|| {
                    let mut samples = Vec::new();
                    while deadline.is_none_or(|d| Instant::now() < d) {
                        let next = workload
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .next_request()?;
                        let Some(spec) = next else { break };
                        samples.push(collect(submit(s, spec), load.timeout));
                    }
                    anyhow::Ok(samples)
                })
            })
            .collect();
        let mut all = Vec::new();
        for c in clients {
            all.extend(
                c.join()
                    .map_err(|_| anyhow!("a client thread panicked"))??,
            );
        }
        Ok(all)
    })
}

/// Submissions at the workload's arrival times; the events are read once
/// all are sent (they carry their own times, and each request's channel
/// holds all of its events).
fn open(s: &Scheduler, load: &Load, rate: f64) -> Result<Vec<Sample>> {
    let mut workload = load.workload();
    let mut arrivals = Arrivals::new(load.spec.seed, rate);
    let start = Instant::now();
    let mut submitted = Vec::new();
    while let Some(spec) = workload.next_request()? {
        let at = arrivals.next_offset();
        if load.duration.is_some_and(|d| at > d.as_secs_f64()) {
            break;
        }
        let Some(due) = super::offset(start, at) else {
            break;
        };
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        submitted.push(submit(s, spec));
    }
    Ok(submitted
        .into_iter()
        .map(|sub| collect(sub, load.timeout))
        .collect())
}
