//! The first token's report: what prefill knows about the first token and
//! the prompt that the router needs, carried at the end of
//! [`TransferDone`](super::TransferDone) so it reaches the decode node with
//! the transfer it describes, and from there the router on the decode
//! node's token stream (one stream per request, no join with prefill's
//! reply).
//!
//! Encoding, between the page count and the page checksums (all
//! little-endian):
//!
//! | size | field |
//! |---|---|
//! | 4 | prefill's cached tokens u32 |
//! | 1 | first-token logprobs present u8 (0 or 1) |
//! | if present: 4 + 1 + 8 k | logprob f32, top count k u8, k x (token id u32, logprob f32) |
//! | 4 | prompt scores m u32 |
//! | m x (4 + 4 + 1 + 8 k) | logprob f32, rank u32, top count k u8, k x (token id u32, logprob f32) |
//!
//! Counts are checked against the bytes present before anything is
//! allocated, as everywhere in this crate.

use super::codec::{fit, Put, Reader};
use super::error::WireError;

/// Bytes of a report with no logprobs and no prompt scores.
pub const FIRST_TOKEN_REPORT_MIN_LEN: usize = 4 + 1 + 4;

/// Bytes of one prompt score before its alternatives.
const PROMPT_SCORE_FIXED_LEN: usize = 4 + 4 + 1;

/// The first generated token, as prefill sampled it from the last prompt
/// position, and what the router reports with it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FirstToken {
    /// The token.
    pub id: u32,
    /// Its logprobs, when the request's sampling asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// Leading prompt tokens prefill took from its own prefix cache
    /// instead of computing them (what the client's usage calls cached).
    pub cached_tokens: u32,
    /// When the request asked to score its prompt: entry `i` scores
    /// prompt token `i + 1` (nothing precedes the first). Empty otherwise.
    pub prompt_scores: Vec<PromptScore>,
}

/// A first token with nothing to report: no logprobs asked, no prompt
/// scores, nothing taken from prefill's cache.
impl From<u32> for FirstToken {
    fn from(id: u32) -> Self {
        Self {
            id,
            ..Self::default()
        }
    }
}

/// A sampled token's log-probability and the most likely alternatives'.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenLogprobs {
    /// The token's.
    pub logprob: f32,
    /// Alternatives, most likely first: token id and logprob.
    pub top: Vec<(u32, f32)>,
}

/// A prompt token's score under the raw model given the tokens before it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptScore {
    /// Its log-probability.
    pub logprob: f32,
    /// 1 + the tokens with a larger logit.
    pub rank: u32,
    /// Alternatives, most likely first (ranks 1, 2, ...).
    pub top: Vec<(u32, f32)>,
}

fn top_len(top: &[(u32, f32)]) -> usize {
    1 + top.len().saturating_mul(8)
}

impl FirstToken {
    /// Bytes of the report (everything but [`FirstToken::id`], which has
    /// its fixed place in the message).
    pub(crate) fn report_len(&self) -> usize {
        let logprobs = self.logprobs.as_ref().map_or(0, |l| 4 + top_len(&l.top));
        let scores = self
            .prompt_scores
            .iter()
            .fold(0usize, |n, s| n.saturating_add(8 + top_len(&s.top)));
        FIRST_TOKEN_REPORT_MIN_LEN
            .saturating_add(logprobs)
            .saturating_add(scores)
    }

    /// Checks what [`FirstToken::put_report`] cannot write: a count too
    /// large for its field.
    pub(crate) fn check(&self) -> Result<(), WireError> {
        if let Some(l) = &self.logprobs {
            fit::<u8>(l.top.len(), "first_logprobs.top")?;
        }
        fit::<u32>(self.prompt_scores.len(), "prompt_scores")?;
        for s in &self.prompt_scores {
            fit::<u8>(s.top.len(), "prompt_scores.top")?;
        }
        Ok(())
    }

    /// Writes the report ([`FirstToken::check`]ed first).
    pub(crate) fn put_report(&self, o: &mut Vec<u8>) {
        o.put_u32(self.cached_tokens);
        match &self.logprobs {
            None => o.put_u8(0),
            Some(l) => {
                o.put_u8(1);
                o.put_u32(l.logprob.to_bits());
                put_top(o, &l.top);
            }
        }
        o.put_u32(self.prompt_scores.len() as u32);
        for s in &self.prompt_scores {
            o.put_u32(s.logprob.to_bits());
            o.put_u32(s.rank);
            put_top(o, &s.top);
        }
    }

    /// Reads the report after the token `id`.
    pub(crate) fn read_report(id: u32, r: &mut Reader<'_>) -> Result<Self, WireError> {
        let cached_tokens = r.u32("first.cached_tokens")?;
        let logprobs = match r.u8("first.logprobs")? {
            0 => None,
            1 => Some(TokenLogprobs {
                logprob: f32::from_bits(r.u32("first.logprob")?),
                top: read_top(r, "first.top")?,
            }),
            other => {
                return Err(WireError::InvalidField {
                    field: "first.logprobs",
                    value: other.into(),
                    reason: "0 (absent) or 1 (present)",
                })
            }
        };
        let m = r.u32("prompt_scores")? as usize;
        if m.checked_mul(PROMPT_SCORE_FIXED_LEN)
            .is_none_or(|n| n > r.remaining())
        {
            return Err(WireError::LengthMismatch {
                field: "prompt_scores",
                declared: m as u64,
                actual: (r.remaining() / PROMPT_SCORE_FIXED_LEN) as u64,
            });
        }
        let mut prompt_scores = Vec::with_capacity(m);
        for _ in 0..m {
            prompt_scores.push(PromptScore {
                logprob: f32::from_bits(r.u32("prompt_scores.logprob")?),
                rank: r.u32("prompt_scores.rank")?,
                top: read_top(r, "prompt_scores.top")?,
            });
        }
        Ok(Self {
            id,
            logprobs,
            cached_tokens,
            prompt_scores,
        })
    }
}

fn put_top(o: &mut Vec<u8>, top: &[(u32, f32)]) {
    o.put_u8(top.len() as u8);
    for &(id, lp) in top {
        o.put_u32(id);
        o.put_u32(lp.to_bits());
    }
}

fn read_top(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<(u32, f32)>, WireError> {
    let k = usize::from(r.u8(field)?);
    if k * 8 > r.remaining() {
        return Err(WireError::LengthMismatch {
            field,
            declared: k as u64,
            actual: (r.remaining() / 8) as u64,
        });
    }
    let mut top = Vec::with_capacity(k);
    for _ in 0..k {
        let id = r.u32(field)?;
        top.push((id, f32::from_bits(r.u32(field)?)));
    }
    Ok(top)
}
