//! A sequence admitted to the engine: its tokens, its pages and what its
//! prefill is asked for (prompt scores).

use kvmesh_kvpool::Reservation;

use super::{invalid, prefix};
use crate::error::Result;
use crate::llama::LogitsWanted;
use crate::sampling::PromptLogprob;

/// A sequence admitted to the engine: its tokens and its pages.
///
/// Dropping it releases its pages (RAII through the reservation).
#[derive(Debug)]
pub struct Sequence {
    pub(super) kv: Reservation,
    pub(super) tokens: Vec<u32>,
    pub(super) prompt_len: usize,
    pub(super) max_len: usize,
    /// Tokens whose K/V are in the cache.
    pub(super) cached: usize,
    /// Its namespace and page keys, when the prefix cache is on and the
    /// sequence was started in a namespace.
    pub(super) prefix: Option<prefix::CachedSeq>,
    /// Score the prompt when it runs, with this many alternatives
    /// ([`Sequence::score_prompt`]).
    pub(super) score: Option<usize>,
    /// The prompt's scores once it ran (position `i` scores token `i + 1`).
    pub(super) prompt_logprobs: Vec<PromptLogprob>,
}

impl Sequence {
    pub(super) fn new(kv: Reservation, tokens: Vec<u32>, max_len: usize, cached: usize) -> Self {
        let prompt_len = tokens.len();
        Self {
            kv,
            tokens,
            prompt_len,
            max_len,
            cached,
            prefix: None,
            score: None,
            prompt_logprobs: Vec::new(),
        }
    }

    /// Asks the prefill of this sequence ([`super::Engine::prefill`],
    /// [`super::Engine::prefill_batch`], [`super::Engine::prefill_batch_streamed`]) for
    /// the prompt's logprobs, with `top` alternatives each
    /// ([`Self::take_prompt_logprobs`]). Only a sequence with nothing
    /// cached can: a cached head is not computed, so its logits do not
    /// exist (admit it with [`super::Engine::admit`], not `admit_in`).
    pub fn score_prompt(&mut self, top: usize) -> Result<()> {
        if self.cached > 0 {
            return Err(invalid(
                "prompt_logprobs",
                &self.cached.to_string(),
                "the sequence's head came from the prefix cache; prompt logprobs need every position computed",
            ));
        }
        if top > crate::sampling::MAX_TOP_LOGPROBS {
            return Err(invalid(
                "prompt_logprobs",
                &top.to_string(),
                &format!("at most {}", crate::sampling::MAX_TOP_LOGPROBS),
            ));
        }
        self.score = Some(top);
        Ok(())
    }

    /// The prompt's logprobs after its prefill, when [`Self::score_prompt`]
    /// asked: entry `i` is prompt token `i + 1`'s (the first token has
    /// none); empty otherwise.
    pub fn take_prompt_logprobs(&mut self) -> Vec<PromptLogprob> {
        std::mem::take(&mut self.prompt_logprobs)
    }

    /// Which logits its prompt chunk asks the forward pass for.
    pub(super) fn prompt_wanted(&self) -> LogitsWanted {
        match self.score {
            Some(top) => LogitsWanted::Prompt { top },
            None => LogitsWanted::Last,
        }
    }
}

impl Drop for Sequence {
    /// Offers the written full pages to the prefix cache (when the
    /// sequence has a namespace); the reservation then ends as always.
    fn drop(&mut self) {
        if let Some(p) = &mut self.prefix {
            p.offer(&mut self.kv, &self.tokens, self.cached);
        }
    }
}

impl Sequence {
    /// All tokens so far (prompt and generated).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Prompt length.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    /// Generated tokens so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
    /// The sequence's reservation (its page table and owner).
    pub fn kv(&self) -> &Reservation {
        &self.kv
    }
    /// Mutable access to the reservation, for tests that forge page tables.
    pub fn kv_mut(&mut self) -> &mut Reservation {
        &mut self.kv
    }
}

impl Sequence {
    /// Tokens whose K/V are in the cache; `tokens().len() - cached_len()`
    /// are still to run.
    pub fn cached_len(&self) -> usize {
        self.cached
    }
}
