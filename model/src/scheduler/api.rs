//! What callers exchange with the scheduler: its settings, a request, the
//! events and errors it answers with, the step log's records, and the
//! token budget split of one step (`plan_step`).

use super::*;

/// Scheduler settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of one forward step (decode tokens plus prompt
    /// chunks). At least `max_running`.
    pub step_tokens: usize,
    /// Sequences admitted at once (prefilling or decoding).
    pub max_running: usize,
    /// Requests that may wait for admission; a submission past it is
    /// refused with [`SchedError::QueueFull`].
    pub queue: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            step_tokens: 256,
            max_running: 64,
            queue: 256,
        }
    }
}

impl SchedulerConfig {
    /// Checks the settings; the error names the field, its value and why.
    pub fn validate(&self) -> Result<(), SchedError> {
        let field = |field: &'static str, value: usize, reason: &str| SchedError::Config {
            field,
            value,
            reason: reason.into(),
        };
        if self.max_running == 0 {
            return Err(field("max_running", 0, "must be at least 1"));
        }
        if self.queue == 0 {
            return Err(field("queue", 0, "must be at least 1"));
        }
        if self.step_tokens < self.max_running {
            return Err(field(
                "step_tokens",
                self.step_tokens,
                &format!(
                    "must be at least max_running ({}), so that every decoding sequence gets its \
                     token in every step",
                    self.max_running
                ),
            ));
        }
        Ok(())
    }
}

/// One request.
#[derive(Clone, Debug)]
pub struct SchedRequest {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most; reserved with the prompt at admission.
    pub max_new_tokens: usize,
    /// How to sample.
    pub sampling: SamplingParams,
    /// Generate exactly `max_new_tokens` tokens: end-of-sequence tokens are
    /// sent like any other instead of ending the request (for benchmarks).
    pub ignore_eos: bool,
}

/// What a request's receiver gets, in order: `Token`s, then exactly one
/// `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum SchedEvent {
    /// A generated token, and when the scheduler had it.
    Token {
        /// The token id.
        id: u32,
        /// When it was sampled.
        at: Instant,
    },
    /// Generation ended normally; the pages are already released.
    Finished {
        /// Why.
        reason: FinishReason,
        /// When.
        at: Instant,
    },
    /// The request failed (it can never fit the pool, the context limit,
    /// a compute error); the pages are already released.
    Failed {
        /// What went wrong.
        error: String,
        /// When.
        at: Instant,
    },
}

/// Why a submission was refused (nothing was queued).
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    /// A setting of [`SchedulerConfig`] is out of range.
    #[error("scheduler config: {field} is {value}, which is invalid: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// Its value.
        value: usize,
        /// Why it is refused.
        reason: String,
    },
    /// The request itself is invalid.
    #[error("invalid request: {field}: {reason}")]
    Invalid {
        /// The field of [`SchedRequest`].
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The engine refused the request (the context limit).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// `queue` requests are waiting already.
    #[error("the scheduler's queue is full ({capacity} requests)")]
    QueueFull {
        /// The queue's size.
        capacity: usize,
    },
    /// The scheduler has stopped (or its thread could not start).
    #[error("the scheduler has stopped{0}")]
    Stopped(String),
}

impl SchedError {
    /// A short stable name of the variant, for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Config { .. } => "config",
            Self::Invalid { .. } => "invalid_request",
            Self::Model(e) => e.kind(),
            Self::QueueFull { .. } => "queue_full",
            Self::Stopped(_) => "stopped",
        }
    }
}

/// One step as it was planned: which requests ran what. Requests are
/// numbered from 0 in the order the scheduler took them in (for one
/// submitting thread: the order of its accepted submissions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's number, from 0.
    pub step: u64,
    /// Requests that ran one decode token.
    pub decode: Vec<u64>,
    /// Prompt chunks that ran.
    pub prefill: Vec<ChunkRecord>,
}

/// One prompt chunk of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkRecord {
    /// The request.
    pub request: u64,
    /// Tokens in the chunk.
    pub tokens: usize,
    /// Whether it is the prompt's last chunk (the one that yields the
    /// first generated token).
    pub last: bool,
}

impl StepRecord {
    /// Tokens the step ran.
    pub fn tokens(&self) -> usize {
        self.decode.len() + self.prefill.iter().map(|c| c.tokens).sum::<usize>()
    }
}

/// What a running sequence needs next ([`plan_step`]'s input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// One decode token.
    Decode,
    /// Prompt tokens still to run (at least 1).
    Prefill(usize),
}

/// Tokens each running sequence runs this step, in the order given (the
/// admission order): 1 for each decoding one, then what is left of
/// `step_tokens` to the prefilling ones, oldest first, each up to what it
/// still needs. A 0 means the sequence sits this step out.
///
/// Decode tokens are never cut: with more decoding sequences than
/// `step_tokens` (which a valid config rules out) the step runs over.
pub fn plan_step(needs: &[Need], step_tokens: usize) -> Vec<usize> {
    let decoding = needs.iter().filter(|n| **n == Need::Decode).count();
    let mut left = step_tokens.saturating_sub(decoding);
    needs
        .iter()
        .map(|n| match *n {
            Need::Decode => 1,
            Need::Prefill(uncached) => {
                let take = uncached.min(left);
                left -= take;
                take
            }
        })
        .collect()
}
