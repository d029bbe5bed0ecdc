//! Continuous batching: one OS thread owns the decode compute. Each step
//! runs every running sequence one token forward as one batch; sequences
//! that arrive (verified transfers) join at the next step, sequences that
//! finish, fail, or whose client is gone leave, releasing their pages.
//! At a drain's deadline ([`crate::run`]) every running sequence and every
//! one that still arrives ends with a terminal error; [`Work::Stop`] ends
//! the thread once nothing runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvmesh_faults::{Action, FaultPlan, Point};
use kvmesh_kvwire::FirstToken;
use kvmesh_model::engine::{Engine, FinishReason as Why, Sequence, Stopping};
use kvmesh_model::sampling::{Logprobs, Sampled, Sampler};
use kvmesh_proto::internal::v1::{
    decode_event, DecodeEvent, FinishReason, Finished, Prefilled, PromptLogprob, Token,
};
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::metrics::StepMetrics;

/// The terminal error of a sequence cut at a drain's deadline.
pub(crate) fn cut_status() -> Status {
    Status::unavailable("decode node shutting down: generation stopped at the drain deadline")
}

/// Events of one sequence's token stream.
pub(crate) type Events = mpsc::Sender<Result<DecodeEvent, Status>>;

/// What the batcher is sent.
pub(crate) enum Work {
    /// A verified sequence to run, its first token sent already (boxed:
    /// the channel holds many).
    Job(Box<Running>),
    /// Return once nothing runs (the node has drained).
    Stop,
}

/// Counts a Generate stream until it ends: the drain waits for none.
#[derive(Debug)]
pub(crate) struct Open(Arc<AtomicUsize>);

impl Open {
    pub(crate) fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A verified sequence ready to decode.
pub(crate) struct Job {
    pub seq: Sequence,
    /// Prefill's token, with its logprobs when asked: emitted first.
    pub first: Sampled,
    pub max_new_tokens: usize,
    pub sampler: Sampler,
    pub stop_ids: Vec<u32>,
    pub events: Events,
    /// Injected faults (testing builds).
    pub faults: FaultPlan,
    /// This stream, counted until it ends.
    pub open: Open,
    /// The `decode.stream` span, ended when the sequence leaves.
    pub span: tracing::Span,
}

/// A sequence in the batch (or on its way there).
pub(crate) struct Running {
    seq: Sequence,
    next: u32,
    /// The stop and budget rule the reference engine applies too.
    stopping: Stopping,
    sampler: Sampler,
    events: Events,
    faults: FaultPlan,
    /// Decode steps taken (the `step:N` fault index).
    steps: u32,
    _open: Open,
    span: tracing::Span,
}

impl Running {
    /// A verified sequence: sends prefill's token at once (the client's
    /// first token does not wait for the batch's step under way) and
    /// returns what joins the batch, or `None` if that token ended it.
    pub(crate) fn start(j: Job) -> Option<Box<Self>> {
        let mut r = Box::new(Self {
            seq: j.seq,
            next: 0,
            stopping: Stopping::new(j.stop_ids, j.max_new_tokens),
            sampler: j.sampler,
            events: j.events,
            faults: j.faults,
            steps: 0,
            _open: j.open,
            span: j.span,
        });
        if r.stopping.spent() {
            r.release(Some(finished(FinishReason::Length)));
            return None;
        }
        match emit(&mut r, j.first) {
            Next::Continue => Some(r),
            Next::Done(last) => {
                r.release(last);
                None
            }
        }
    }

    /// The sequence leaves: its pages go back now (its written full pages
    /// offered to the prefix cache first), or after an injected
    /// `release=delay`; then `last`, the stream's terminal event, is sent.
    /// In that order, a client that sends its next turn as soon as this one
    /// ends finds this turn's answer cached.
    pub(crate) fn release(self, last: Option<Result<DecodeEvent, Status>>) {
        let Self {
            seq,
            events,
            faults,
            steps,
            _open,
            span,
            ..
        } = self;
        span.record("decode_steps", steps);
        match faults.at(Point::Release) {
            Some(Action::Delay(d)) => {
                let _ = std::thread::Builder::new()
                    .name("release-delay".into())
                    .spawn(move || {
                        std::thread::sleep(d);
                        drop(seq);
                    });
            }
            _ => drop(seq),
        }
        if let Some(last) = last {
            let _ = events.try_send(last);
        }
    }

    /// Injected faults before this sequence's next step; `false` if the
    /// sequence leaves (its stream cut).
    fn before_step(&mut self) -> bool {
        let step = self.steps;
        self.steps += 1;
        match self.faults.at(Point::Step(step)) {
            Some(Action::Delay(d)) => std::thread::sleep(d),
            Some(Action::Crash) => kvmesh_faults::crash(Point::Step(step)),
            Some(Action::Corrupt) => {
                self.seq.kv_mut().corrupt_page_table();
            }
            Some(Action::Drop) => {
                let _ = self.events.try_send(Err(Status::aborted(format!(
                    "injected fault: token stream cut at step {step}"
                ))));
                return false;
            }
            _ => {}
        }
        true
    }
}

fn token(id: u32, logprobs: Option<Logprobs>) -> Result<DecodeEvent, Status> {
    Ok(DecodeEvent {
        event: Some(decode_event::Event::Token(Token {
            id,
            logprobs: logprobs.map(kvmesh_node::sampling::logprobs),
        })),
    })
}

/// Splits what prefill sent with the transfer: the first token, which the
/// batcher emits like any other (its logprobs included), and the
/// `prefilled` event (prefill's cached count, the prompt's scores), which
/// goes first.
pub(crate) fn prefilled(first: FirstToken) -> (Sampled, Result<DecodeEvent, Status>) {
    let sampled = Sampled {
        token: first.id,
        logprobs: first.logprobs.map(|l| Logprobs {
            logprob: l.logprob,
            top: l.top,
        }),
    };
    let prompt_logprobs = first
        .prompt_scores
        .into_iter()
        .map(|p| {
            let (top_ids, top_logprobs) = p.top.into_iter().unzip();
            PromptLogprob {
                logprob: p.logprob,
                rank: p.rank,
                top_ids,
                top_logprobs,
            }
        })
        .collect();
    let event = DecodeEvent {
        event: Some(decode_event::Event::Prefilled(Prefilled {
            cached_tokens: first.cached_tokens,
            prompt_logprobs,
        })),
    };
    (sampled, Ok(event))
}

fn finished(reason: FinishReason) -> Result<DecodeEvent, Status> {
    Ok(DecodeEvent {
        event: Some(decode_event::Event::Finished(Finished {
            reason: reason.into(),
        })),
    })
}

/// What happens after a token is sampled.
enum Next {
    Continue,
    /// The sequence leaves; the event, if any, ends its stream once its
    /// pages are released ([`Running::release`]).
    Done(Option<Result<DecodeEvent, Status>>),
}

/// Applies the stop and budget rule to `tok` ([`Stopping`], the reference
/// engine's, so greedy output through the mesh equals `kvmesh
/// generate`'s) and sends what it says. The first token is prefill's, with
/// the logprobs it sent with the transfer.
fn emit(r: &mut Running, s: Sampled) -> Next {
    let tok = s.token;
    let verdict = r.stopping.after(tok);
    if let Some(why) = verdict {
        r.span.record("outcome", why.as_str());
    }
    if verdict == Some(Why::Stop) {
        return Next::Done(Some(finished(FinishReason::Stop)));
    }
    // Bounded channel sized to the budget: never full.
    if r.events.try_send(token(tok, s.logprobs)).is_err() {
        return Next::Done(None);
    }
    if verdict == Some(Why::Length) {
        return Next::Done(Some(finished(FinishReason::Length)));
    }
    r.next = tok;
    Next::Continue
}

/// Runs until [`Work::Stop`] (or every sender is gone) and nothing is
/// running. Once `cut` is set, every sequence ends with [`cut_status`].
pub(crate) fn run(
    engine: Arc<Engine>,
    mut jobs: mpsc::Receiver<Work>,
    depth: Arc<AtomicUsize>,
    cut: watch::Receiver<bool>,
    metrics: Arc<StepMetrics>,
) {
    let mut running: Vec<Running> = Vec::new();
    let mut stopping = false;
    loop {
        // Block only when idle; otherwise take whatever arrived.
        if running.is_empty() {
            if stopping {
                return;
            }
            match jobs.blocking_recv() {
                Some(Work::Job(r)) => running.push(*r),
                Some(Work::Stop) | None => return,
            }
        }
        loop {
            match jobs.try_recv() {
                Ok(Work::Job(r)) => running.push(*r),
                Ok(Work::Stop) => stopping = true,
                Err(_) => break,
            }
        }
        let cutting = *cut.borrow();
        // Clients that went away leave before the step; at the drain
        // deadline everyone does, told why.
        let mut stay = Vec::with_capacity(running.len());
        for mut r in running.drain(..) {
            if cutting {
                r.release(Some(Err(cut_status())));
            } else if !r.events.is_closed() && r.before_step() {
                stay.push(r);
            } else {
                r.release(None);
            }
        }
        running = stay;
        depth.store(running.len(), Ordering::Relaxed);
        if running.is_empty() {
            continue;
        }
        let next: Vec<u32> = running.iter().map(|r| r.next).collect();
        let began = Instant::now();
        let results = {
            let mut seqs: Vec<&mut Sequence> = running.iter_mut().map(|r| &mut r.seq).collect();
            engine.decode_step(&mut seqs, &next)
        };
        let results = match results {
            Ok(r) => r,
            Err(e) => {
                // A batch-wide failure fails every sequence in it, with
                // the reason; their pages go back as they are dropped.
                tracing::error!(error = %e, "decode step failed");
                for r in running.drain(..) {
                    r.release(Some(Err(Status::internal(format!(
                        "decode step failed: {e}"
                    )))));
                }
                continue;
            }
        };
        let mut keep = Vec::with_capacity(running.len());
        let mut sampled = 0;
        for (mut r, res) in running.drain(..).zip(results) {
            match res {
                Ok(mut logits) => {
                    sampled += 1;
                    let sampled = r.sampler.sample(&mut logits);
                    match emit(&mut r, sampled) {
                        Next::Continue => keep.push(r),
                        Next::Done(last) => r.release(last),
                    }
                }
                Err(e) => {
                    // This sequence only (a guard violation, say): it fails
                    // with the reason, the batch goes on.
                    r.release(Some(Err(Status::internal(format!("decode failed: {e}")))));
                }
            }
        }
        metrics.step(next.len(), began.elapsed(), sampled);
        running = keep;
        depth.store(running.len(), Ordering::Relaxed);
    }
}
