//! Token selection from logits, as vLLM's sampler does it: the request's
//! logits processors (`logit_bias`, `min_tokens`), then the penalties
//! (repetition over prompt and output, presence and frequency over the
//! output), then temperature, `min_p`, `top_k` and `top_p`, then a draw
//! from a seeded generator (the same seed gives the same tokens). Greedy
//! decoding takes the largest processed logit.
//!
//! A request's grammar (structured output, [`SamplingParams::grammar`])
//! comes first, as vLLM applies its bitmask before the processors: every
//! token the grammar does not allow next gets minus infinity, and the
//! grammar's matcher moves with each token drawn (and with the token a
//! resumed sampler was given). End-of-sequence is allowed only where the
//! grammar may end; once it is complete, it is the only token allowed, and
//! `min_tokens` no longer holds it off (the grammar wins: its output is
//! whole).
//!
//! One [`Sampler`] follows one sequence: it remembers the prompt and the
//! tokens it produced (for the penalties and `min_tokens`), and a sampler
//! that continues a generation begun elsewhere (decode after prefill's
//! first token) is put in the same state with [`Sampler::resume`].
//!
//! Logprobs ([`SamplingParams::logprobs`]) are those of the distribution
//! the draw saw before truncation: after the processors, the penalties and
//! the temperature (1 when greedy), before `min_p`/`top_k`/`top_p` (so an
//! alternative has a finite logprob). vLLM calls this `processed_logprobs`.
//! With greedy decoding the chosen token is the first of the top entries.
//!
//! Costs: a grammar adds llguidance's mask computation per token (tens of
//! microseconds to about a millisecond, by grammar and vocabulary) and one
//! pass over the row; a plain request (no processors, no logprobs) touches the logits
//! only to pick; penalties touch one logit per distinct prompt or output
//! token; logprobs add one pass over the vocabulary (log-sum-exp) and a
//! selection of the top `k`.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use kvmesh_structured::{Allowed, Grammar, Matcher};

/// Most alternatives a request may ask per token (OpenAI's chat bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Bound of each `logit_bias` value (OpenAI's).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or below [`GREEDY_BELOW`]) is greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// adds up to at least `top_p` (`1.0` keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (`None` keeps all).
    pub top_k: Option<usize>,
    /// Keep only tokens at least `min_p` times as likely as the most
    /// likely one (`0` keeps all).
    pub min_p: f32,
    /// Seed of the sampler; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Subtracted from the logit of every token the output already has
    /// (OpenAI's `presence_penalty`, in [-2, 2]).
    pub presence_penalty: f32,
    /// Subtracted once per occurrence in the output so far (OpenAI's
    /// `frequency_penalty`, in [-2, 2]).
    pub frequency_penalty: f32,
    /// A token of the prompt or the output has its logit divided by this
    /// when positive, multiplied when negative (vLLM's and transformers'
    /// `repetition_penalty`, > 0; `1` is off).
    pub repetition_penalty: f32,
    /// Added to the token's logit (OpenAI's `logit_bias`, values in
    /// [-100, 100]); ids past the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop tokens (see [`Sampler::new`]) cannot be drawn before this
    /// many tokens were.
    pub min_tokens: usize,
    /// Report the drawn token's logprob and the `n` most likely
    /// alternatives' (`Some(0)`: the drawn token's only; `None`: nothing).
    pub logprobs: Option<usize>,
    /// The grammar the output must match (structured output), compiled
    /// for this model's vocabulary; `None`: any text.
    pub grammar: Option<Grammar>,
}

/// Temperatures below this are treated as greedy.
pub const GREEDY_BELOW: f32 = 1e-5;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            logprobs: None,
            grammar: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether the token is the largest logit (no random draw is made).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW || self.top_k == Some(1)
    }

    /// Whether anything changes logits before the choice.
    fn processes(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
    }

    /// Check ranges; the error names the field and value.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k == Some(0) {
            return Err("top_k must be at least 1, got 0".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            ));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
        {
            return Err(format!(
                "logit_bias of token {id} must be in [-100, 100], got {b}"
            ));
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(format!(
                "logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.logprobs.unwrap_or_default()
            ));
        }
        Ok(())
    }
}

/// The drawn token's logprob and the most likely alternatives'.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    /// The drawn token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// When [`SamplingParams::logprobs`] asked for them.
    pub logprobs: Option<Logprobs>,
}

/// A sampler with its own random state and its sequence's history.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(u32, f32)>,
    /// Held off until `min_tokens` were drawn.
    stop_ids: Vec<u32>,
    /// Tokens drawn (or resumed) so far.
    drawn: usize,
    /// Occurrences of each token in the output (presence, frequency).
    counts: HashMap<u32, u32>,
    /// Distinct tokens of the prompt and the output (repetition).
    seen: Vec<u32>,
    /// Where the output is in its grammar, if it has one.
    matcher: Option<Matcher>,
}

/// Index of the largest logit; the first one on ties (as `torch.argmax`).
/// NaNs are passed over, and a NaN first logit gives 0: the index a scan
/// keeping the first strictly larger value gives.
///
/// Two passes that vectorize instead of one scan whose every step waits on
/// the last comparison's branch: each of 16 lanes keeps its largest value
/// (a value replaces only a strictly smaller one, as in the scan), then
/// the first logit equal to the largest of those is found a chunk at a
/// time. Greedy decoding runs it on every token while the pool waits:
/// over Gemma 3's 262144 logits the scan took 275 us a token, this 55.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let Some(&first) = logits.first() else {
        return 0;
    };
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    let mut lanes = [first; LANES];
    for c in chunks {
        for (top, &l) in lanes.iter_mut().zip(c) {
            if l > *top {
                *top = l;
            }
        }
    }
    let mut best = first;
    for &l in lanes.iter().chain(tail) {
        if l > best {
            best = l;
        }
    }
    // The first logit equal to `best` (+0 and -0 are equal, as the scan
    // takes them); none when `best` is a NaN first logit.
    let at = logits
        .chunks(LANES)
        .position(|c| c.iter().fold(false, |hit, &l| hit | (l == best)))
        .and_then(|ci| {
            let from = ci * LANES;
            logits[from..]
                .iter()
                .position(|&l| l == best)
                .map(|i| from + i)
        });
    at.unwrap_or(0) as u32
}

impl Sampler {
    /// A sampler for one sequence with prompt `prompt`, whose generation
    /// ends at any of `stop_ids` (which `min_tokens` holds off).
    pub fn new(params: SamplingParams, prompt: &[u32], stop_ids: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let mut seen = Vec::new();
        if params.repetition_penalty != 1.0 {
            seen.extend_from_slice(prompt);
            seen.sort_unstable();
            seen.dedup();
        }
        Self {
            matcher: params.grammar.as_ref().map(Grammar::matcher),
            params,
            rng,
            scratch: Vec::new(),
            stop_ids: stop_ids.to_vec(),
            drawn: 0,
            counts: HashMap::new(),
            seen,
        }
    }

    /// A sampler with no history (no prompt, no stop tokens).
    pub fn plain(params: SamplingParams) -> Self {
        Self::new(params, &[], &[])
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Puts the sampler where it would be had it drawn `token` itself: the
    /// random state moves past one draw (when not greedy) and the token
    /// joins the history. A sampler continuing a generation whose first
    /// token was drawn elsewhere (by a prefill node with the same seed and
    /// prompt) then draws what one sampler would have drawn.
    pub fn resume(&mut self, token: u32) {
        if !self.params.is_greedy() {
            let _: f32 = self.rng.random();
        }
        if let Some(m) = &mut self.matcher {
            m.advance(token);
        }
        self.record(token);
    }

    fn record(&mut self, token: u32) {
        self.drawn += 1;
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        if self.params.repetition_penalty != 1.0 {
            if let Err(at) = self.seen.binary_search(&token) {
                self.seen.insert(at, token);
            }
        }
    }

    /// Whether the grammar is complete (only end-of-sequence can follow).
    pub fn is_complete(&self) -> bool {
        self.matcher.as_ref().is_some_and(Matcher::is_complete)
    }

    /// The logits processors and penalties, in place; `min_tokens` holds
    /// the stop tokens off only if `hold_stops`.
    fn process(&self, logits: &mut [f32], hold_stops: bool) {
        let p = &self.params;
        let n = logits.len();
        for &(id, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if hold_stops && self.drawn < p.min_tokens {
            for &id in &self.stop_ids {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            for &id in self.seen.iter().filter(|&&id| (id as usize) < n) {
                let l = &mut logits[id as usize];
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in self.counts.iter().filter(|(&id, _)| (id as usize) < n) {
                logits[id as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }

    /// Picks the next token from one row of logits (processed in place:
    /// the row is the sampler's to change) and adds it to the history.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        let mut hold_stops = true;
        if let Some(m) = &mut self.matcher {
            // A complete grammar leaves only the end, which `min_tokens`
            // must not take away (nothing would be left to draw).
            hold_stops = m.mask(logits) == Allowed::Tokens;
        }
        if self.params.processes() {
            self.process(logits, hold_stops);
        }
        let token = self.choose(logits);
        if let Some(m) = &mut self.matcher {
            m.advance(token);
        }
        let logprobs = self
            .params
            .logprobs
            .map(|k| self.logprobs(logits, token, k));
        self.record(token);
        Sampled { token, logprobs }
    }

    fn logprobs(&self, logits: &[f32], token: u32, k: usize) -> Logprobs {
        let t = if self.params.temperature < GREEDY_BELOW {
            1.0
        } else {
            self.params.temperature
        };
        let (lp, top) = scaled_logprobs(logits, token, k, t);
        Logprobs { logprob: lp, top }
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.is_greedy() {
            return argmax(logits);
        }
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        // The one draw every non-greedy choice makes (`resume` relies on
        // it), drawn before any early return.
        let draw = self.rng.random::<f32>();
        if c.is_empty() {
            return argmax(logits);
        }
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let max = c[0].1;
        if p.min_p > 0.0 {
            let floor = max + p.min_p.ln();
            let keep = c.partition_point(|e| e.1 >= floor).max(1);
            c.truncate(keep);
        }
        if let Some(k) = p.top_k {
            c.truncate(k.max(1));
        }
        let mut total = 0.0f32;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            total += e.1;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = c.iter().map(|e| e.1).sum();
        }
        let mut r = draw * total;
        for e in c.iter() {
            if r < e.1 {
                return e.0;
            }
            r -= e.1;
        }
        c[c.len() - 1].0
    }
}

/// `token`'s log-probability under `softmax(logits / t)` and the `k`
/// most likely tokens' (largest first), in one fixed order of operations:
/// the sampler's logprobs (`t`: its temperature) and the prompt's
/// ([`prompt_logprob`], `t = 1`) are the same function.
fn scaled_logprobs(logits: &[f32], token: u32, k: usize, t: f32) -> (f32, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| ((l - max) / t).exp())
        .sum();
    let norm = max / t + sum.ln();
    let lp = |id: u32| {
        let l = logits
            .get(id as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY);
        if l.is_finite() {
            l / t - norm
        } else {
            f32::NEG_INFINITY
        }
    };
    let top = top_k(logits, k)
        .into_iter()
        .map(|id| (id, lp(id)))
        .collect();
    (lp(token), top)
}

/// A prompt token's score under the model, given the tokens before it:
/// the raw distribution (no temperature, penalties or bias: vLLM's
/// default for prompt logprobs).
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// The token's log-probability.
    pub logprob: f32,
    /// Its rank in the distribution: 1 + the tokens with a larger logit.
    pub rank: u32,
    /// The `k` most likely tokens and their log-probabilities, most likely
    /// first (their ranks are 1, 2, ...).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s [`PromptLogprob`] from one position's logits row, with the
/// `k` most likely alternatives. The one definition: the forward pass's
/// chunked scoring (`LogitsWanted::Prompt`) and the reference
/// (`Engine::prompt_logprobs_reference`) both call it.
pub fn prompt_logprob(logits: &[f32], token: u32, k: usize) -> PromptLogprob {
    let (logprob, top) = scaled_logprobs(logits, token, k, 1.0);
    let own = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    let above = logits.iter().filter(|&&l| l > own).count();
    PromptLogprob {
        logprob,
        rank: u32::try_from(above + 1).unwrap_or(u32::MAX),
        top,
    }
}

/// The ids of the `k` largest finite logits, largest first (ties: the
/// smaller id first, as [`argmax`]).
fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    // A small sorted buffer: k is at most MAX_TOP_LOGPROBS, so one pass
    // with insertion beats sorting the vocabulary.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_finite() || (best.len() == k && l <= best[k - 1].1) {
            continue;
        }
        let at = best.partition_point(|e| e.1 >= l);
        best.insert(at, (i as u32, l));
        best.truncate(k);
    }
    best.into_iter().map(|(id, _)| id).collect()
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_grammar;
