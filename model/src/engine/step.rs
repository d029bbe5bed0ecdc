//! The continuous-batching step: prompt chunks and decode tokens of many
//! sequences in one forward pass ([`Engine::step`]), what the scheduler
//! runs every iteration.

use super::{Engine, Sequence};
use crate::error::{ModelError, Result};
use crate::llama::{LogitsWanted, SeqChunk};

impl Engine {
    /// Run one mixed step over several sequences as a single batch: each
    /// item either runs the next `n` uncached prompt tokens of its
    /// sequence ([`StepWork::Prefill`], a chunk of a prompt) or appends one
    /// sampled token and runs it ([`StepWork::Decode`]). This is what lets
    /// a scheduler interleave a long prompt's chunks with other sequences'
    /// decode tokens (chunked prefill).
    ///
    /// Per item, in order: `Ok(Some(logits))` for a decode token and for
    /// the chunk that completes the uncached tokens (its last position's
    /// logits); `Ok(None)` for a chunk that leaves tokens uncached (no
    /// vocabulary projection is run for it); `Err` for an item that is
    /// invalid (a chunk of 0 tokens or past the uncached ones, a decode
    /// onto a sequence with uncached tokens or at its budget, a token id
    /// outside the vocabulary) or that failed on its own (a guard
    /// violation or KV write error). An invalid item is not run and does
    /// not stop the others; a sequence whose item failed must be dropped.
    ///
    /// The outer `Err` is a failure of the whole batch (a compute error):
    /// every sequence is then as before the call (a decode token pushed
    /// here is removed again, and the cached count is unchanged; KV slots
    /// past it may hold partial writes, which the next write overwrites).
    ///
    /// Cost: one [`crate::llama::Llama::forward`] over the sum of the items' tokens, and
    /// the vocabulary projection only for the items that return logits.
    pub fn step(&self, work: &mut [StepItem<'_>]) -> Result<Vec<Result<Option<Vec<f32>>>>> {
        let vocab = self.model.config().vocab_size;
        let bad = |field: &str, value: String, reason: String| ModelError::InvalidField {
            path: "<step>".into(),
            field: field.into(),
            value,
            reason,
        };
        // Per item: the span of tokens it runs, or why it is not run.
        let mut plan: Vec<std::result::Result<(usize, usize), ModelError>> =
            Vec::with_capacity(work.len());
        for item in work.iter_mut() {
            let seq = &mut *item.seq;
            let uncached = seq.tokens.len() - seq.cached;
            let span = match item.work {
                StepWork::Prefill(n) if n == 0 || n > uncached => Err(bad(
                    "prefill tokens",
                    n.to_string(),
                    format!(
                        "the sequence has {uncached} uncached tokens; a chunk runs 1 to that many"
                    ),
                )),
                StepWork::Prefill(n) => Ok((seq.cached, seq.cached + n)),
                StepWork::Decode(_) if uncached > 0 => Err(bad(
                    "decode token",
                    String::new(),
                    format!("the sequence still has {uncached} uncached tokens"),
                )),
                StepWork::Decode(_) if seq.tokens.len() >= seq.max_len => {
                    Err(ModelError::ContextLengthExceeded {
                        prompt_tokens: seq.prompt_len,
                        max_new_tokens: seq.max_len - seq.prompt_len,
                        limit: seq.max_len,
                    })
                }
                StepWork::Decode(tok) => {
                    seq.tokens.push(tok);
                    Ok((seq.cached, seq.cached + 1))
                }
            };
            // Checked per item here: the forward pass would refuse the
            // whole batch for one bad id.
            let span = span.and_then(|(a, b)| {
                match seq.tokens[a..b].iter().find(|&&t| t as usize >= vocab) {
                    Some(&t) => {
                        if let StepWork::Decode(_) = item.work {
                            seq.tokens.pop();
                        }
                        Err(bad(
                            "token id",
                            t.to_string(),
                            format!("the vocabulary has {vocab} tokens"),
                        ))
                    }
                    None => Ok((a, b)),
                }
            });
            plan.push(span);
        }
        let forward = {
            let mut batch: Vec<SeqChunk<'_>> = work
                .iter_mut()
                .zip(&plan)
                .filter_map(|(item, span)| {
                    let &(a, b) = span.as_ref().ok()?;
                    let s = &mut *item.seq;
                    Some(SeqChunk {
                        tokens: &s.tokens[a..b],
                        start_pos: a,
                        kv: &mut s.kv,
                        logits: if b == s.tokens.len() {
                            LogitsWanted::Last
                        } else {
                            LogitsWanted::None
                        },
                    })
                })
                .collect();
            self.forward(&mut batch)
        };
        let results = match forward {
            Ok(r) => r,
            Err(e) => {
                for (item, span) in work.iter_mut().zip(&plan) {
                    if let (StepWork::Decode(_), Ok(_)) = (item.work, span) {
                        item.seq.tokens.pop();
                    }
                }
                return Err(e);
            }
        };
        let mut results = results.into_iter();
        Ok(work
            .iter_mut()
            .zip(plan)
            .map(|(item, span)| {
                let (_, end) = span?;
                let out = results.next().unwrap_or_else(|| {
                    Err(ModelError::Compute {
                        detail: "the forward pass returned fewer results than chunks".into(),
                    })
                })?;
                let seq = &mut *item.seq;
                seq.cached = end;
                if end < seq.tokens.len() {
                    return Ok(None);
                }
                out.logits
                    .into_iter()
                    .next()
                    .map(Some)
                    .ok_or_else(|| ModelError::Compute {
                        detail: "step returned no logits".into(),
                    })
            })
            .collect())
    }
}

/// What one sequence does in an [`Engine::step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepWork {
    /// Run the next this-many uncached tokens (a prompt chunk).
    Prefill(usize),
    /// Append this sampled token and run it (the sequence has no uncached
    /// tokens).
    Decode(u32),
}

/// One sequence's share of an [`Engine::step`].
#[derive(Debug)]
pub struct StepItem<'a> {
    /// The sequence.
    pub seq: &'a mut Sequence,
    /// Its work this step.
    pub work: StepWork,
}
