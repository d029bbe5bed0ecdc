//! The relay and finish phases: decode's stream, the one the answer comes
//! from, turned into the gateway's events. Its order is the protocol's:
//! `prefilled` (prefill's report: the prompt's scores go out at once, the
//! cached count into the end), then tokens (the first one prefill's, with
//! its logprobs), then one `finished`. Prefill's reply is watched until
//! then only for a failure: nothing waits for it.

use std::time::Instant;

use kvmesh_proto::internal::v1::{
    decode_event, DecodeEvent, FinishReason, Finished, Logprobs, Prefilled, PromptLogprob, Token,
};
use kvmesh_tokenizer::TextOut;
use tonic::Streaming;

use super::prefill::Prefilling;
use super::{node_err, ProtocolViolation, Route, Stop};
use crate::error::DispatchError;
use crate::mesh::{Event, Finish, PromptScore, PromptToken, TokenLogprob};
use crate::nodes::{Node, Role};

/// How an answer ended, for the finish phase.
pub(super) struct Ending {
    finish: Finish,
    completion_tokens: usize,
    /// Prompt tokens prefill took from its prefix cache.
    cached_tokens: usize,
}

/// The relay's state between events.
struct Relay<'t> {
    text: TextOut<'t>,
    /// Tokens generated so far.
    completion: usize,
    /// When the last token came (inter-token latency).
    last: Option<Instant>,
    /// Prefill's cached count, once its report came.
    cached: Option<usize>,
}

impl Route<'_> {
    /// Reads `stream` to its end. Returns with the stream dropped, which
    /// ends the sequence at decode when the answer stopped early (a stop
    /// string).
    pub(super) async fn relay(
        &self,
        decode: &Node,
        mut stream: Streaming<DecodeEvent>,
        mut prefilling: Prefilling,
    ) -> Result<Ending, Stop> {
        let job = self.job;
        let mut relay = Relay {
            text: TextOut::new(&self.mesh.tokenizer, &job.stop)
                .min_tokens(job.sampling.min_tokens as usize)
                .keep(&job.keep_special),
            completion: 0,
            last: None,
            cached: None,
        };
        loop {
            let ev = tokio::select! {
                res = &mut prefilling.call, if !prefilling.answered => {
                    prefilling.answered = true;
                    self.prefill_answered(res, &mut prefilling, relay.cached.is_some())?;
                    continue;
                }
                () = self.tx.closed() => return Err(Stop::ClientGone),
                ev = stream.message() => ev,
            };
            let ev = match ev {
                Ok(Some(ev)) => ev.event,
                Ok(None) => {
                    return Err(self.violation(ProtocolViolation::EndedWithoutFinish, decode))
                }
                Err(s) => return Err(node_err(Role::Decode, decode, s).into()),
            };
            let step = match ev {
                Some(decode_event::Event::Prefilled(p)) => {
                    // The transfer was verified: prefill's work is over.
                    prefilling.guard.disarm();
                    self.prefilled(&mut relay, p).await.map(|()| None)
                }
                Some(decode_event::Event::Token(t)) => self.token(&mut relay, t).await,
                Some(decode_event::Event::Finished(f)) => self.finished(&mut relay, f).await,
                Some(decode_event::Event::Granted(_) | decode_event::Event::Refused(_)) => {
                    Err(ProtocolViolation::GrantAfterGrant.into())
                }
                None => Err(ProtocolViolation::EmptyEvent.into()),
            };
            match step {
                Ok(None) => {}
                Ok(Some(end)) => return Ok(end),
                Err(Relayed::Violation(v)) => return Err(self.violation(v, decode)),
                Err(Relayed::Stop(stop)) => return Err(stop),
            }
        }
    }

    /// Prefill's reply: its call is over either way (nothing to abort).
    /// Until decode has verified the transfer, a failure fails the request
    /// (decode would only learn of it by its lease); afterwards it changes
    /// nothing.
    fn prefill_answered(
        &self,
        res: Result<(), tonic::Status>,
        prefilling: &mut Prefilling,
        verified: bool,
    ) -> Result<(), Stop> {
        prefilling.guard.disarm();
        let Err(status) = res else {
            return Ok(());
        };
        // Another copy of this grant is being written (a duplicated
        // delivery): that writer's transfer is what decode verifies; the
        // token stream tells how it ends.
        if verified || status.code() == tonic::Code::AlreadyExists {
            tracing::debug!(status = %status, "prefill's failure changes nothing");
            return Ok(());
        }
        if kvmesh_proto::refusal::is_draining(&status) {
            // Told to stop before our poll saw it: out of the choice; the
            // client may retry (503).
            self.prefill.mark_down();
            return Err(DispatchError::NoHealthyNode {
                role: Role::Prefill,
            }
            .into());
        }
        Err(node_err(Role::Prefill, self.prefill, status).into())
    }

    /// Prefill's report: the prompt's scores go out before anything else
    /// (when asked), the cached count is kept for the end.
    async fn prefilled(&self, relay: &mut Relay<'_>, p: Prefilled) -> Result<(), Relayed> {
        if relay.cached.replace(p.cached_tokens as usize).is_some() {
            return Err(ProtocolViolation::PrefilledTwice.into());
        }
        if self.job.prompt_logprobs.is_some() {
            let ev = prompt_event(&self.job.prompt_ids, p.prompt_logprobs)?;
            self.send(ev).await?;
        }
        Ok(())
    }

    /// One token: its text (and logprobs, when asked) goes out; `Some` when
    /// a stop string ended the answer.
    async fn token(&self, relay: &mut Relay<'_>, t: Token) -> Result<Option<Ending>, Relayed> {
        let Some(cached_tokens) = relay.cached else {
            return Err(ProtocolViolation::BeforePrefilled("token").into());
        };
        let logprobs = match (self.job.sampling.logprobs, t.logprobs) {
            (None, _) => Vec::new(),
            (Some(_), Some(lp)) => vec![token_logprob(t.id, lp)],
            (Some(_), None) => {
                let first = relay.completion == 0;
                return Err(ProtocolViolation::MissingLogprobs { first }.into());
            }
        };
        let now = Instant::now();
        match relay.last {
            None => self.mesh.metrics.ttft(now - self.started),
            Some(prev) => self.mesh.metrics.itl(now - prev),
        }
        relay.last = Some(now);
        relay.completion += 1;
        let (text, hit_stop) = relay.text.push(t.id).map_err(tokenizer)?;
        if !text.is_empty() || !logprobs.is_empty() {
            self.send(Event::Text { text, logprobs }).await?;
        }
        Ok(hit_stop.then_some(Ending {
            finish: Finish::Stop,
            completion_tokens: relay.completion,
            cached_tokens,
        }))
    }

    /// Decode's end: the text held back (an incomplete character, a
    /// possible stop string that was not one) goes out, then the end.
    async fn finished(
        &self,
        relay: &mut Relay<'_>,
        f: Finished,
    ) -> Result<Option<Ending>, Relayed> {
        let Some(cached_tokens) = relay.cached else {
            return Err(ProtocolViolation::BeforePrefilled("finish").into());
        };
        let text = relay.text.finish().map_err(tokenizer)?;
        if !text.is_empty() {
            // A client gone now still has its outcome recorded at the end.
            let _ = self
                .tx
                .send(Event::Text {
                    text,
                    logprobs: Vec::new(),
                })
                .await;
        }
        let finish = match f.reason() {
            FinishReason::Length => Finish::Length,
            FinishReason::Stop | FinishReason::Unspecified => Finish::Stop,
        };
        Ok(Some(Ending {
            finish,
            completion_tokens: relay.completion,
            cached_tokens,
        }))
    }

    /// The finish phase: the outcome, then the terminal event.
    pub(super) async fn finish(&self, end: Ending) {
        self.outcome.finish(end.finish, end.completion_tokens);
        let _ = self
            .tx
            .send(Event::Done {
                finish: end.finish,
                completion_tokens: end.completion_tokens,
                cached_tokens: end.cached_tokens,
            })
            .await;
    }
}

/// Why a relayed event ends the request: a violation (whose node is known
/// only to the relay) or a stop.
enum Relayed {
    Violation(ProtocolViolation),
    Stop(Stop),
}

impl From<ProtocolViolation> for Relayed {
    fn from(v: ProtocolViolation) -> Self {
        Self::Violation(v)
    }
}

impl From<Stop> for Relayed {
    fn from(s: Stop) -> Self {
        Self::Stop(s)
    }
}

impl From<DispatchError> for Relayed {
    fn from(e: DispatchError) -> Self {
        Self::Stop(Stop::Failed(e))
    }
}

fn tokenizer(e: impl std::fmt::Display) -> DispatchError {
    DispatchError::Tokenizer(e.to_string())
}

/// Prefill's prompt scores (entry `i` for token `i + 1`) with the prompt's
/// tokens as one [`Event::Prompt`]; any other count is prefill's fault.
fn prompt_event(prompt: &[u32], scores: Vec<PromptLogprob>) -> Result<Event, ProtocolViolation> {
    if scores.len() + 1 != prompt.len() {
        return Err(ProtocolViolation::PromptScores {
            scores: scores.len(),
            prompt: prompt.len(),
        });
    }
    let rest = prompt[1..].iter().zip(scores).map(|(&id, s)| PromptToken {
        id,
        score: Some(PromptScore {
            logprob: s.logprob,
            rank: s.rank,
            top: s.top_ids.into_iter().zip(s.top_logprobs).collect(),
        }),
    });
    let first = PromptToken {
        id: prompt[0],
        score: None,
    };
    Ok(Event::Prompt(std::iter::once(first).chain(rest).collect()))
}

/// A node's report of a token's logprobs as the gateway's.
fn token_logprob(id: u32, lp: Logprobs) -> TokenLogprob {
    TokenLogprob {
        id,
        logprob: lp.logprob,
        top: lp.top_ids.into_iter().zip(lp.top_logprobs).collect(),
    }
}
