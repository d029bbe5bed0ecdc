//! One sequence's place in its grammar.

use std::sync::Arc;

/// What a mask left drawable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allowed {
    /// Some token other than end-of-sequence.
    Tokens,
    /// End-of-sequence only: the grammar is complete (or the matcher
    /// failed, which ends the sequence the same way).
    EndOnly,
}

/// The grammar state of one sequence: [`Matcher::mask`] before each draw,
/// [`Matcher::advance`] with the token drawn (a sampler that resumes a
/// sequence advances with the tokens drawn elsewhere).
pub struct Matcher {
    inner: llguidance::Matcher,
    eos: Arc<[u32]>,
    /// The library's error, once it failed (then only end-of-sequence is
    /// allowed).
    failed: Option<String>,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher")
            .field("stopped", &self.inner.is_stopped())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Matcher {
    pub(crate) fn new(inner: llguidance::Matcher, eos: Arc<[u32]>) -> Self {
        Self {
            inner,
            eos,
            failed: None,
        }
    }

    /// Sets to minus infinity the logit of every token the grammar does not
    /// allow next (ids past the grammar's vocabulary included). A complete
    /// grammar allows only end-of-sequence; so does a failed matcher (its
    /// error is logged once and kept in [`Matcher::error`]).
    ///
    /// Cost: llguidance's mask computation (tens of microseconds to a
    /// millisecond for a large vocabulary, depending on the grammar) and
    /// one pass over the row's 32-token words.
    pub fn mask(&mut self, logits: &mut [f32]) -> Allowed {
        let mask = match self.failed {
            Some(_) => None,
            None => match self.inner.compute_mask_or_eos() {
                Ok(m) => Some(m),
                Err(e) => {
                    self.fail(e.to_string());
                    None
                }
            },
        };
        let Some(mask) = mask else {
            for (i, l) in logits.iter_mut().enumerate() {
                if !self.eos.contains(&(i as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
            return Allowed::EndOnly;
        };
        let n = mask.len().min(logits.len());
        mask.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        logits[n..].fill(f32::NEG_INFINITY);
        let eos_allowed = self
            .eos
            .iter()
            .filter(|&&id| (id as usize) < n && mask.is_allowed(id))
            .count();
        if mask.num_set() > eos_allowed {
            Allowed::Tokens
        } else {
            Allowed::EndOnly
        }
    }

    /// Moves past `token`, which the last mask allowed (end-of-sequence
    /// completes the grammar). A token the grammar refuses fails the
    /// matcher: from then on only end-of-sequence is allowed.
    pub fn advance(&mut self, token: u32) {
        if self.failed.is_some() || (self.inner.is_stopped() && self.eos.contains(&token)) {
            return;
        }
        if let Err(e) = self.inner.consume_token(token) {
            self.fail(e.to_string());
        }
    }

    /// Whether the grammar is complete: nothing but end-of-sequence can
    /// follow.
    pub fn is_complete(&self) -> bool {
        self.failed.is_none() && self.inner.is_stopped()
    }

    /// The library's error, if the matcher failed.
    pub fn error(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    fn fail(&mut self, e: String) {
        tracing::warn!(error = %e, "structured output: the grammar matcher failed; the sequence ends");
        self.failed = Some(e);
    }
}
