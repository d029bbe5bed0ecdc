//! The workload: a deterministic stream of requests (prompt of an exact
//! token count, output length) and of arrival times, from the seed. Both
//! targets build it afresh from the same settings and so run the same
//! requests in the same order at the same offsets.

use std::sync::Arc;

use anyhow::{bail, Result};
use kvmesh_model::TextTokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::dist::{exponential_gap, LenDist};

/// Words a prompt is made of. Each is one pre-token (a leading space, no
/// digits or punctuation), so in byte-level BPE and SentencePiece
/// vocabularies alike each usually encodes to exactly one token, whatever
/// its neighbours: a prompt of `n` words is then about `n` tokens. Only
/// those that encode to one token alone and twice in a row are used.
const WORDS: &[&str] = &[
    " the", " and", " of", " to", " a", " in", " is", " it", " that", " for", " on", " with",
    " as", " was", " at", " by", " be", " this", " from", " or", " b", " c", " d", " f", " h",
    " l", " m", " o", " p", " s", " t", " w",
];

/// Salts that give warm-up requests and arrival times generators of their
/// own, so neither shifts the measured requests' draws.
const WARMUP_SALT: u64 = 0x5741_524D_5550_0001;
const ARRIVAL_SALT: u64 = 0x4152_5249_5645_0002;
/// The prompts' words have a generator of their own too, so the lengths
/// can be drawn (and checked) without building prompts.
const WORDS_SALT: u64 = 0x574F_5244_5300_0003;

/// One request of the workload.
#[derive(Clone, Debug)]
pub(crate) struct RequestSpec {
    /// Its place in the workload (from 0; warm-up requests have their own
    /// numbering).
    pub(crate) index: usize,
    /// The prompt as sent to the gateway.
    pub(crate) text: String,
    /// Its token ids as the gateway computes them (exactly the drawn
    /// length): what the reference is given.
    pub(crate) prompt_ids: Vec<u32>,
    /// Tokens to generate (exactly: `ignore_eos`).
    pub(crate) output_len: usize,
}

/// What a workload is drawn from.
#[derive(Clone, Debug)]
pub(crate) struct WorkloadSpec {
    pub(crate) seed: u64,
    pub(crate) prompt_len: LenDist,
    pub(crate) output_len: LenDist,
    /// Requests in all; `None`: unbounded (a `--duration` run).
    pub(crate) requests: Option<usize>,
    /// Prompt plus output must fit this.
    pub(crate) max_model_len: usize,
}

/// The stream of requests.
#[derive(Debug)]
pub(crate) struct Workload {
    tok: Arc<TextTokenizer>,
    words: Arc<Vec<&'static str>>,
    spec: WorkloadSpec,
    lengths: StdRng,
    word_rng: StdRng,
    next: usize,
}

/// The [`WORDS`] that are one token each with this tokenizer, alone and
/// repeated.
pub(crate) fn one_token_words(tok: &TextTokenizer) -> Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for &w in WORDS {
        if tok.encode_raw(w)?.len() == 1 && tok.encode_raw(&w.repeat(2))?.len() == 2 {
            out.push(w);
        }
    }
    if out.is_empty() {
        bail!("none of the prompt words is a single token with this tokenizer");
    }
    Ok(out)
}

impl Workload {
    /// The measured requests.
    pub(crate) fn new(
        tok: Arc<TextTokenizer>,
        words: Arc<Vec<&'static str>>,
        spec: WorkloadSpec,
    ) -> Self {
        Self {
            tok,
            words,
            lengths: StdRng::seed_from_u64(spec.seed),
            word_rng: StdRng::seed_from_u64(spec.seed ^ WORDS_SALT),
            spec,
            next: 0,
        }
    }

    /// The next request, `None` after the last. Fails when a draw does not
    /// fit the context or no prompt of the drawn length can be built.
    pub(crate) fn next_request(&mut self) -> Result<Option<RequestSpec>> {
        if self.spec.requests.is_some_and(|n| self.next >= n) {
            return Ok(None);
        }
        let index = self.next;
        self.next += 1;
        let (prompt_len, output_len) = draw_lengths(&self.spec, &mut self.lengths, index)?;
        let (text, prompt_ids) =
            build_prompt(&self.tok, &self.words, prompt_len, &mut self.word_rng)?;
        Ok(Some(RequestSpec {
            index,
            text,
            prompt_ids,
            output_len,
        }))
    }
}

impl WorkloadSpec {
    /// `n` warm-up requests: the same distributions, a seed of their own.
    pub(crate) fn warmup(&self, n: usize) -> Self {
        Self {
            seed: self.seed ^ WARMUP_SALT,
            requests: Some(n),
            ..self.clone()
        }
    }
}

/// The next request's prompt and output lengths; an error when they do
/// not fit the context.
fn draw_lengths(spec: &WorkloadSpec, rng: &mut StdRng, index: usize) -> Result<(usize, usize)> {
    let prompt_len = spec.prompt_len.sample(rng);
    let output_len = spec.output_len.sample(rng);
    if prompt_len + output_len > spec.max_model_len {
        bail!(
            "request {index} drew {prompt_len} prompt and {output_len} output tokens, over the \
             context of {} tokens: lower --prompt-len or --output-len, or raise --max-model-len",
            spec.max_model_len
        );
    }
    Ok((prompt_len, output_len))
}

/// Checks that the first `n` requests' lengths fit the context, before
/// anything runs; returns the most prompt plus output tokens among them.
pub(crate) fn check_lengths(spec: &WorkloadSpec, n: usize) -> Result<usize> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut longest = 0;
    for index in 0..n {
        let (p, o) = draw_lengths(spec, &mut rng, index)?;
        longest = longest.max(p + o);
    }
    Ok(longest)
}

/// A text that the tokenizer (as the gateway calls it, BOS included when
/// the model adds one) encodes to exactly `n` tokens, made of random
/// [`one_token_words`], and its ids.
pub(crate) fn build_prompt(
    tok: &TextTokenizer,
    words: &[&str],
    n: usize,
    rng: &mut StdRng,
) -> Result<(String, Vec<u32>)> {
    let mut chosen: Vec<&str> = (0..n)
        .map(|_| words[rng.random_range(0..words.len())])
        .collect();
    // Each word is about one token; what the tokenizer adds (BOS) or
    // merges is corrected by adding or removing words.
    for _ in 0..16 {
        let text = chosen.concat();
        let ids = tok.encode(&text)?;
        match ids.len().cmp(&n) {
            std::cmp::Ordering::Equal => return Ok((text, ids)),
            std::cmp::Ordering::Less => {
                let more = n - ids.len();
                chosen.extend((0..more).map(|_| words[rng.random_range(0..words.len())]));
            }
            std::cmp::Ordering::Greater => {
                let fewer = ids.len() - n;
                if fewer >= chosen.len() {
                    bail!(
                        "no prompt of {n} tokens: one word already encodes to {} (the tokenizer \
                         adds tokens of its own); draw longer prompts",
                        tok.encode(words[0])?.len()
                    );
                }
                chosen.truncate(chosen.len() - fewer);
            }
        }
    }
    bail!("could not build a prompt of exactly {n} tokens with this tokenizer")
}

/// Arrival offsets of the open loop, seconds from the start: a Poisson
/// process of `rate` per second (the first request at its first gap).
#[derive(Debug)]
pub(crate) struct Arrivals {
    rng: StdRng,
    rate: f64,
    at: f64,
}

impl Arrivals {
    pub(crate) fn new(seed: u64, rate: f64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed ^ ARRIVAL_SALT),
            rate,
            at: 0.0,
        }
    }

    /// The next arrival's offset.
    pub(crate) fn next_offset(&mut self) -> f64 {
        self.at += exponential_gap(&mut self.rng, self.rate);
        self.at
    }
}
