//! Continuous batching with chunked prefill over the reference engine, in
//! one process: a long prompt is run in chunks between decode steps, so it
//! does not stall the sequences that are already generating.
//!
//! One thread (the actor) owns the running sequences and the queue; a
//! [`Scheduler`] handle sends it requests over a bounded channel and gets a
//! bounded event channel back per request. Each step of the actor:
//!
//! 1. takes new requests off the channel into its queue (up to `queue`
//!    of them; past that they stay in the channel, which holds `queue`
//!    more, and then [`Scheduler::submit`] answers
//!    [`SchedError::QueueFull`]), failing at once any request that could
//!    never fit the pool even when it is empty;
//! 2. admits waiting requests in arrival order while fewer than
//!    `max_running` run, through [`Engine::admit`], which reserves the
//!    whole budget (prompt plus `max_new_tokens`) up front; when the pool
//!    is full, the head of the queue waits (and so does everything behind
//!    it: admission is first come, first served);
//! 3. plans the step ([`plan_step`]): every decoding sequence contributes
//!    exactly one token, and what is left of `step_tokens` goes to prompt
//!    chunks of the admitted sequences that are still prefilling, oldest
//!    first;
//! 4. runs it as one [`Engine::step`] and samples a token for every
//!    sequence that returned logits (a decode token, or the final chunk of
//!    a prompt: that is the first generated token).
//!
//! Invariants:
//! - Every decoding sequence gets a token in every step (no stall): the
//!   config requires `step_tokens >= max_running`, so the decode tokens
//!   always fit the budget and a prefilling sequence always gets at least
//!   one token of what is left.
//! - A request ends with exactly one `Finished` or `Failed` event, sent
//!   after its pages are released, so a client that saw its end sees the
//!   pool without it. After it, nothing more is sent.
//! - The actor never blocks on a client: the event channel holds
//!   `max_new_tokens + 2` events, more than a request ever gets. A send
//!   that fails means the receiver is gone: the request is cancelled and
//!   its pages released at that step. A request whose receiver is dropped
//!   before its first token is noticed when that token is sent.
//! - Stop rules are the reference engine's ([`Engine::generate`]): an
//!   end-of-sequence token ends generation without being sent (unless
//!   `ignore_eos`), and `max_new_tokens` counts sent tokens. Greedy output
//!   equals `generate`'s token for token (tested in exact mode, where a
//!   row's arithmetic does not depend on the rest of the batch).
//!
//! Cost per step: one forward pass over at most `step_tokens` tokens, plus
//! one vocabulary projection and one sampling per sequence that returns
//! logits; O(running) bookkeeping.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::engine::{Engine, FinishReason, StepItem, StepWork, Stopping};
use crate::error::ModelError;
use crate::sampling::{Sampler, SamplingParams};

/// Steps kept in the step log ([`Scheduler::step_log`]); older ones are
/// dropped.
pub const STEP_LOG_LEN: usize = 1024;

/// How long the actor waits before trying again to admit the head of the
/// queue when nothing runs and the pool is full anyway (its pages are held
/// outside this scheduler, e.g. by a test or another user of the engine).
const RETRY_ADMISSION: Duration = Duration::from_millis(2);

/// A request on its way to the actor.
#[derive(Debug)]
struct Submission {
    req: SchedRequest,
    events: SyncSender<SchedEvent>,
}

/// State the handle and the actor share.
#[derive(Debug, Default)]
struct Shared {
    /// Set by dropping the handle: fail everything and exit.
    stop: AtomicBool,
    steps: AtomicU64,
    /// Requests in the actor's queue (admission waits), after its last
    /// admission pass.
    waiting: AtomicUsize,
    log: Mutex<VecDeque<StepRecord>>,
}

/// The handle: submits requests to the actor thread. Dropping it stops the
/// actor at its next step boundary (running and waiting requests get
/// `Failed`) and joins it; [`Scheduler::shutdown`] lets them finish.
#[derive(Debug)]
pub struct Scheduler {
    engine: Arc<Engine>,
    cfg: SchedulerConfig,
    tx: Option<SyncSender<Submission>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Scheduler {
    /// Starts the actor thread over `engine`.
    pub fn start(engine: Arc<Engine>, cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        let (tx, rx) = mpsc::sync_channel(cfg.queue);
        let shared = Arc::new(Shared::default());
        let actor = Actor {
            engine: Arc::clone(&engine),
            cfg,
            rx,
            shared: Arc::clone(&shared),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            open: true,
        };
        let thread = std::thread::Builder::new()
            .name("kvmesh-scheduler".into())
            .spawn(move || actor.run())
            .map_err(|e| SchedError::Stopped(format!(": cannot start its thread: {e}")))?;
        Ok(Self {
            engine,
            cfg,
            tx: Some(tx),
            shared,
            thread: Some(thread),
        })
    }

    /// The engine it runs.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Its settings.
    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }

    /// Submits a request that stops at an end-of-sequence token.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        sampling: SamplingParams,
    ) -> Result<Receiver<SchedEvent>, SchedError> {
        self.submit_request(SchedRequest {
            prompt,
            max_new_tokens,
            sampling,
            ignore_eos: false,
        })
    }

    /// Submits a request; its events arrive on the receiver, and dropping
    /// the receiver cancels it. Refused at once when the request is invalid
    /// (empty prompt, a token id outside the vocabulary, sampling out of
    /// range), over the context limit, or the queue is full. Whether the
    /// pool can hold it is the actor's to say (`Failed`).
    pub fn submit_request(&self, req: SchedRequest) -> Result<Receiver<SchedEvent>, SchedError> {
        let invalid = |field, reason: String| SchedError::Invalid { field, reason };
        req.sampling
            .validate()
            .map_err(|reason| invalid("sampling", reason))?;
        if req.prompt.is_empty() {
            return Err(ModelError::EmptyPrompt.into());
        }
        let vocab = self.engine.model().config().vocab_size;
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                "prompt",
                format!("token id {t} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let limit = self.engine.max_model_len();
        if req.prompt.len().saturating_add(req.max_new_tokens) > limit {
            return Err(ModelError::ContextLengthExceeded {
                prompt_tokens: req.prompt.len(),
                max_new_tokens: req.max_new_tokens,
                limit,
            }
            .into());
        }
        // Bounded by the context limit just checked: at most one token per
        // generated position, and the one final event.
        let (events, rx) = mpsc::sync_channel(req.max_new_tokens + 2);
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| SchedError::Stopped(String::new()))?;
        match tx.try_send(Submission { req, events }) {
            Ok(()) => Ok(rx),
            Err(TrySendError::Full(_)) => Err(SchedError::QueueFull {
                capacity: self.cfg.queue,
            }),
            Err(TrySendError::Disconnected(_)) => Err(SchedError::Stopped(String::new())),
        }
    }

    /// The last [`STEP_LOG_LEN`] steps, oldest first.
    pub fn step_log(&self) -> Vec<StepRecord> {
        let log = self
            .shared
            .log
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        log.iter().cloned().collect()
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.shared.steps.load(Ordering::Relaxed)
    }

    /// Requests taken off the channel and waiting for admission, as of the
    /// actor's last admission pass (requests still in the channel are not
    /// counted).
    pub fn queued(&self) -> usize {
        self.shared.waiting.load(Ordering::Relaxed)
    }

    /// Stops taking requests, lets every queued and running one finish,
    /// and joins the actor.
    pub fn shutdown(mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A request waiting for admission.
#[derive(Debug)]
struct Waiting {
    id: u64,
    req: SchedRequest,
    events: SyncSender<SchedEvent>,
}

/// The actor's state.
struct Actor {
    engine: Arc<Engine>,
    cfg: SchedulerConfig,
    rx: Receiver<Submission>,
    shared: Arc<Shared>,
    waiting: VecDeque<Waiting>,
    /// In admission order.
    running: Vec<Active>,
    next_id: u64,
    /// Whether the handle may still send.
    open: bool,
}

impl Actor {
    fn run(mut self) {
        loop {
            if self.shared.stop.load(Ordering::Relaxed) {
                self.fail_all("the scheduler was stopped");
                return;
            }
            self.intake();
            if !self.open && self.running.is_empty() && self.waiting.is_empty() {
                return;
            }
            self.admit();
            self.shared
                .waiting
                .store(self.waiting.len(), Ordering::Relaxed);
            if !self.step() && !self.waiting.is_empty() {
                // Nothing runs and the head still cannot be admitted: its
                // pages are held outside this scheduler. Wait for them (or
                // for a new request).
                if self.open {
                    match self.rx.recv_timeout(RETRY_ADMISSION) {
                        Ok(s) => self.take(s),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => self.open = false,
                    }
                } else {
                    std::thread::sleep(RETRY_ADMISSION);
                }
            }
        }
    }

    /// Moves submissions off the channel (blocking when there is nothing
    /// else to do), up to `queue` waiting.
    fn intake(&mut self) {
        if !self.open {
            return;
        }
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.rx.recv() {
                Ok(s) => self.take(s),
                Err(_) => {
                    self.open = false;
                    return;
                }
            }
        }
        while self.waiting.len() < self.cfg.queue {
            match self.rx.try_recv() {
                Ok(s) => self.take(s),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.open = false;
                    break;
                }
            }
        }
    }

    /// Queues a submission, or fails it when it could never fit the pool.
    fn take(&mut self, s: Submission) {
        let id = self.next_id;
        self.next_id += 1;
        let pool = self.engine.pool();
        let page_size = pool.config().page_size.max(1);
        let tokens = s.req.prompt.len().saturating_add(s.req.max_new_tokens);
        let pages = tokens.div_ceil(page_size);
        if pages > pool.capacity_pages() {
            let error = format!(
                "the request needs {pages} KV pages ({tokens} tokens) and the pool has {} in all: \
                 it can never be admitted",
                pool.capacity_pages()
            );
            let _ = send(
                &s.events,
                SchedEvent::Failed {
                    error,
                    at: Instant::now(),
                },
            );
            return;
        }
        self.waiting.push_back(Waiting {
            id,
            req: s.req,
            events: s.events,
        });
    }

    /// Admits waiting requests in order while there is room.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(w) = self.waiting.front() else {
                return;
            };
            let page_size = self.engine.pool().config().page_size.max(1);
            let tokens = w.req.prompt.len() + w.req.max_new_tokens;
            if tokens.div_ceil(page_size) > self.engine.pool().free_pages() {
                return;
            }
            let admitted = self
                .engine
                .admit(w.req.prompt.clone(), w.req.max_new_tokens);
            if let Err(ModelError::Kv(kvmesh_kvpool::PoolError::Exhausted { .. })) = admitted {
                // Taken meanwhile by another user of the pool.
                return;
            }
            let Some(w) = self.waiting.pop_front() else {
                return;
            };
            match admitted {
                Ok(seq) if w.req.max_new_tokens == 0 => {
                    drop(seq);
                    let _ = send(&w.events, finished(FinishReason::Length));
                }
                Ok(seq) => {
                    let stop_ids = if w.req.ignore_eos {
                        Vec::new()
                    } else {
                        self.engine.eos_token_ids().to_vec()
                    };
                    self.running.push(Active {
                        id: w.id,
                        sampler: Sampler::new(w.req.sampling, seq.tokens(), &stop_ids),
                        seq,
                        events: w.events,
                        stopping: Stopping::new(stop_ids, w.req.max_new_tokens),
                        next: None,
                    })
                }
                Err(e) => {
                    let _ = send(
                        &w.events,
                        SchedEvent::Failed {
                            error: e.to_string(),
                            at: Instant::now(),
                        },
                    );
                }
            }
        }
    }

    /// Plans and runs one step; `false` if there was nothing to run.
    fn step(&mut self) -> bool {
        let needs: Vec<Need> = self.running.iter().map(Active::need).collect();
        let plan = plan_step(&needs, self.cfg.step_tokens);
        if plan.iter().all(|&n| n == 0) {
            return false;
        }
        let step = self.shared.steps.fetch_add(1, Ordering::Relaxed);
        let mut record = StepRecord {
            step,
            decode: Vec::new(),
            prefill: Vec::new(),
        };
        for ((a, need), &n) in self.running.iter().zip(&needs).zip(&plan) {
            match (*need, n) {
                (_, 0) => {}
                (Need::Decode, _) => record.decode.push(a.id),
                (Need::Prefill(uncached), n) => record.prefill.push(ChunkRecord {
                    request: a.id,
                    tokens: n,
                    last: n == uncached,
                }),
            }
        }
        {
            let mut log = self
                .shared
                .log
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if log.len() >= STEP_LOG_LEN {
                log.pop_front();
            }
            log.push_back(record);
        }

        let ran: Vec<usize> = (0..plan.len()).filter(|&i| plan[i] > 0).collect();
        let results = {
            let mut items: Vec<StepItem<'_>> = self
                .running
                .iter_mut()
                .zip(&plan)
                .filter(|(_, &n)| n > 0)
                .map(|(a, &n)| StepItem {
                    work: match a.next {
                        Some(tok) => StepWork::Decode(tok),
                        None => StepWork::Prefill(n),
                    },
                    seq: &mut a.seq,
                })
                .collect();
            self.engine.step(&mut items)
        };
        let mut ends: Vec<Option<End>> = self.running.iter().map(|_| None).collect();
        match results {
            Err(e) => {
                let error = format!("the step failed: {e}");
                for &i in &ran {
                    ends[i] = Some(End::Failed(error.clone()));
                }
            }
            Ok(results) => {
                for (&i, r) in ran.iter().zip(results) {
                    let a = &mut self.running[i];
                    ends[i] = match r {
                        Err(e) => Some(End::Failed(e.to_string())),
                        Ok(None) => None,
                        Ok(Some(mut logits)) => a.sampled(&mut logits),
                    };
                }
            }
        }
        if ends.iter().any(Option::is_some) {
            let running = std::mem::take(&mut self.running);
            for (a, end) in running.into_iter().zip(ends) {
                match end {
                    None => self.running.push(a),
                    Some(end) => {
                        let Active { seq, events, .. } = a;
                        // Pages first, then the event (the invariant).
                        drop(seq);
                        if let Some(ev) = end_event(end) {
                            let _ = send(&events, ev);
                        }
                    }
                }
            }
        }
        true
    }

    /// Ends every request with `Failed`.
    fn fail_all(&mut self, why: &str) {
        for a in self.running.drain(..) {
            let Active { seq, events, .. } = a;
            drop(seq);
            let _ = send(
                &events,
                SchedEvent::Failed {
                    error: why.into(),
                    at: Instant::now(),
                },
            );
        }
        for w in self.waiting.drain(..) {
            let _ = send(
                &w.events,
                SchedEvent::Failed {
                    error: why.into(),
                    at: Instant::now(),
                },
            );
        }
    }
}

mod active;
mod api;
pub use api::*;

use active::{end_event, finished, send, Active, End};

#[cfg(test)]
mod tests;
