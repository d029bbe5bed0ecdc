//! One admitted request of the scheduler: its sequence, sampler, event
//! channel and stop rule, and how it ends.

use std::sync::mpsc::SyncSender;
use std::time::Instant;

use super::{Need, SchedEvent};
use crate::engine::{FinishReason, Sequence, Stopping};
use crate::sampling::Sampler;

/// An admitted request.
#[derive(Debug)]
pub(super) struct Active {
    pub(super) id: u64,
    pub(super) seq: Sequence,
    pub(super) sampler: Sampler,
    pub(super) events: SyncSender<SchedEvent>,
    /// The stop and budget rule (no stop ids with `ignore_eos`).
    pub(super) stopping: Stopping,
    /// The token to decode next; `None` while the prompt is prefilling.
    pub(super) next: Option<u32>,
}

impl Active {
    pub(super) fn need(&self) -> Need {
        match self.next {
            Some(_) => Need::Decode,
            None => Need::Prefill(self.seq.tokens().len() - self.seq.cached_len()),
        }
    }
}

/// How a request ends this step.
pub(super) enum End {
    Finished(FinishReason),
    Failed(String),
    /// The receiver is gone: nothing to send.
    Cancelled,
}

/// Sends `ev` without blocking; `false` if the receiver is gone (a full
/// channel cannot happen by its sizing, and is treated the same).
pub(super) fn send(events: &SyncSender<SchedEvent>, ev: SchedEvent) -> bool {
    events.try_send(ev).is_ok()
}

pub(super) fn end_event(end: End) -> Option<SchedEvent> {
    let at = Instant::now();
    match end {
        End::Finished(reason) => Some(SchedEvent::Finished { reason, at }),
        End::Failed(error) => Some(SchedEvent::Failed { error, at }),
        End::Cancelled => None,
    }
}

pub(super) fn finished(reason: FinishReason) -> SchedEvent {
    SchedEvent::Finished {
        reason,
        at: Instant::now(),
    }
}

impl Active {
    /// Samples from `logits` and applies the stop rules; `Some` when the
    /// request ends.
    pub(super) fn sampled(&mut self, logits: &mut [f32]) -> Option<End> {
        let tok = self.sampler.sample(logits).token;
        let verdict = self.stopping.after(tok);
        if verdict == Some(FinishReason::Stop) {
            return Some(End::Finished(FinishReason::Stop));
        }
        let at = Instant::now();
        if !send(&self.events, SchedEvent::Token { id: tok, at }) {
            return Some(End::Cancelled);
        }
        if let Some(reason) = verdict {
            return Some(End::Finished(reason));
        }
        self.next = Some(tok);
        None
    }
}
