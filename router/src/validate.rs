//! One validation for every front end. The HTTP gateway and the public
//! gRPC API each turn what they received into a front-end-neutral
//! [`Request`]; [`request`] checks it with one set of defaults and limits
//! and tokenizes it into a [`Valid`], which only this module can make. So a
//! request means the same whichever door it came in by: the same default
//! budget, the same fresh seed when none is given, the same refusal of an
//! empty prompt, the same bound on stop strings, the same model check.

use kvmesh_proto::internal::v1::Sampling;
use kvmesh_tokenizer::{ChatMessage, ChatOptions};

use crate::error::Rejection;
use crate::structured::{self, Structured};
use crate::tools::parse::Reading;
use crate::tools::{Mode, Tools};
use crate::Router;

/// Completion budget when a request names none (OpenAI's for completions).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Stop strings a request may carry at most (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// Characters a `cache_salt` may have at most.
pub const MAX_CACHE_SALT: usize = 256;

/// Roles a chat message may have (`developer` is OpenAI's newer name for
/// `system`, and is rendered as one).
pub const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// `logit_bias` entries a request may carry at most.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Alternatives per prompt position a request may ask for at most
/// (vLLM's `prompt_logprobs` limit, and the sampler's).
pub const MAX_PROMPT_LOGPROBS: u64 = 20;

/// `stop_token_ids` a request may carry at most.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Raw text (special-token text in it is parsed as special tokens).
    Text(String),
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Token ids, as they are (each inside the vocabulary).
    Ids(Vec<u32>),
}

/// A request as a front end parsed it, not yet checked.
#[derive(Clone, Debug)]
pub struct Request {
    /// The model named, if any (empty or absent: the served model).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Completion budget; `None`: [`DEFAULT_MAX_TOKENS`]; `Some(0)` is
    /// refused.
    pub max_tokens: Option<u64>,
    /// The field `max_tokens` came from, for the refusal's `param`.
    pub max_tokens_param: &'static str,
    /// How to draw tokens.
    pub sampling: SamplingIn,
    /// Stop strings (empty ones are dropped).
    pub stop: Vec<String>,
    /// Token ids that end generation, besides end-of-sequence (vLLM's
    /// `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// End-of-sequence tokens do not end generation (vLLM's extension).
    pub ignore_eos: bool,
    /// Narrows the prefix cache inside the tenant (vLLM's extension).
    pub cache_salt: Option<String>,
    /// What the output must match (structured output), and the field it
    /// came from.
    pub structured: Option<Structured>,
    /// Functions the model may call, and how (chat only).
    pub tools: Option<Tools>,
    /// Score the prompt with this many alternatives per position (vLLM's
    /// `prompt_logprobs`, or what `echo` with `logprobs` needs), 0 to
    /// [`MAX_PROMPT_LOGPROBS`]; `None`: no scores.
    pub prompt_logprobs: Option<u64>,
    /// `chat_template_kwargs.enable_thinking` (chat only): passed to the
    /// template; `false` also turns reasoning parsing off for the request.
    pub enable_thinking: Option<bool>,
}

impl Request {
    /// A request for `prompt` with every setting at its default.
    pub fn new(prompt: Prompt) -> Self {
        Self {
            model: None,
            prompt,
            max_tokens: None,
            max_tokens_param: "max_tokens",
            sampling: SamplingIn::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            cache_salt: None,
            structured: None,
            tools: None,
            prompt_logprobs: None,
            enable_thinking: None,
        }
    }
}

/// Sampling as sent: wide types (f64, i64), checked before narrowing, so
/// 2.0000001 is not rounded into range and -1 is not wrapped. `None` is
/// the default.
#[derive(Clone, Debug, Default)]
pub struct SamplingIn {
    /// Temperature; default 1.0; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass; default 1.0.
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; -1 or 0 (vLLM's spellings) keep all.
    pub top_k: Option<i64>,
    /// Relative probability floor in [0, 1]; default 0.
    pub min_p: Option<f64>,
    /// In [-2, 2]; default 0.
    pub presence_penalty: Option<f64>,
    /// In [-2, 2]; default 0.
    pub frequency_penalty: Option<f64>,
    /// Greater than 0; default 1 (off).
    pub repetition_penalty: Option<f64>,
    /// Token id and bias in [-100, 100].
    pub logit_bias: Vec<(u32, f64)>,
    /// The stop tokens cannot end generation before this many tokens.
    pub min_tokens: Option<u64>,
    /// Sampler seed; `None`: a fresh one from the OS for this request.
    pub seed: Option<u64>,
    /// Logprobs of each token and this many alternatives'; `None`: none.
    pub logprobs: Option<u64>,
    /// The field `logprobs` came from (`logprobs`, `top_logprobs`).
    pub logprobs_param: &'static str,
    /// The most alternatives that field allows (5 for completions, 20 for
    /// chat, as OpenAI).
    pub logprobs_max: u64,
}

/// Checked sampling and budget settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Completion budget, at least 1.
    pub max_tokens: usize,
    /// The sampling, checked, as the nodes get it (they check it again):
    /// temperature in [0, 2], top_p in (0, 1], every other field in
    /// kvmesh-model's ranges, logit-bias ids inside the vocabulary, a seed
    /// always set.
    pub sampling: Sampling,
    /// Non-empty stop strings, at most [`MAX_STOP_STRINGS`].
    pub stop: Vec<String>,
    /// Token ids (inside the vocabulary) that end generation besides
    /// end-of-sequence.
    pub stop_token_ids: Vec<u32>,
    /// Generate exactly `max_tokens` tokens: end-of-sequence tokens do not
    /// stop generation (stop strings and `stop_token_ids` still do).
    pub ignore_eos: bool,
    /// 1 to [`MAX_CACHE_SALT`] characters: a sub-namespace of the tenant's
    /// prefix cache. It can only narrow what the tenant shares: the
    /// namespace is derived from the authenticated tenant first.
    pub cache_salt: Option<String>,
    /// Score the prompt with this many alternatives per position (at most
    /// [`MAX_PROMPT_LOGPROBS`]).
    pub prompt_logprobs: Option<u32>,
    /// Special tokens the decoded text keeps: the markers the request's
    /// tool-call and reasoning parsers read
    /// ([`crate::parsing::Parsers::keep`]).
    pub keep_special: Vec<u32>,
}

/// A request that passed [`request`]: its prompt's token ids (at least
/// one) and its settings. Nothing else makes one.
#[derive(Debug)]
pub struct Valid {
    ids: Vec<u32>,
    settings: Settings,
    reading: Reading,
}

impl Valid {
    /// The prompt's token ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// How the output is read: text, or reasoning and tool calls out of
    /// it.
    pub fn reading(&self) -> &Reading {
        &self.reading
    }

    /// Both, by value.
    pub fn into_parts(self) -> (Vec<u32>, Settings) {
        (self.ids, self.settings)
    }

    /// Sample `i` of `n` of this request (OpenAI's `n`): the same prompt
    /// and settings, drawing with seed `seed + i` (wrapping), so each
    /// sample has its own random stream and sample `i` of a seeded request
    /// is what one request seeded `seed + i` gives. Sample 0 is `self`'s.
    /// Only sample 0 scores the prompt: the prompt is the same for every
    /// sample, so the front end gives sample 0's scores to all of them,
    /// and the later samples still find the prompt in prefill's cache.
    pub fn sample(&self, i: u64) -> Valid {
        let mut settings = self.settings.clone();
        settings.sampling.seed = settings.sampling.seed.wrapping_add(i);
        if i > 0 {
            settings.prompt_logprobs = None;
        }
        Valid {
            ids: self.ids.clone(),
            settings,
            reading: self.reading.clone(),
        }
    }
}

/// A refusal of `param`.
pub fn invalid(param: &'static str, message: impl Into<String>) -> Rejection {
    Rejection::Invalid {
        param,
        message: message.into(),
    }
}

/// Checks `req` against the router's model and limits and tokenizes it:
/// the one way to a [`Valid`]. Refusals are typed and name the field.
pub fn request(r: &Router, req: Request) -> Result<Valid, Rejection> {
    model(r, req.model.as_deref())?;
    let tokenizer = r.tokenizer();
    let mut settings = settings(&req, tokenizer.vocab_size())?;
    let tools = req.tools.as_ref();
    let tool_mode = tools.map(Tools::mode).unwrap_or_default();
    let mut structured = req.structured.clone();
    if let Some(t) = tools {
        if !matches!(req.prompt, Prompt::Chat(_)) {
            return Err(invalid(
                "tools",
                "tools need a chat (messages), not a prompt",
            ));
        }
        if tool_mode != Mode::Text {
            if let Some(s) = &structured {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "tools (tool_choice {}) cannot be combined with {}: both constrain the \
                         output; send one, or tool_choice none",
                        match &t.choice {
                            crate::tools::Choice::Named(_) => "a named function",
                            crate::tools::Choice::Required => "required",
                            _ => "auto",
                        },
                        s.param
                    ),
                ));
            }
        }
        if let Some(constraint) = t.constraint() {
            structured = Some(Structured {
                constraint,
                param: "tool_choice",
            });
        }
    }
    let constrained = structured.is_some();
    if let Some(s) = &structured {
        if req.ignore_eos {
            return Err(invalid(
                "ignore_eos",
                format!(
                    "ignore_eos cannot be combined with {}: the constraint ends the output",
                    s.param
                ),
            ));
        }
        settings.sampling.grammar = structured::compile(r, s)?;
    }
    let (ids, param) = match &req.prompt {
        Prompt::Text(text) => (tokenizer.encode(text), "prompt"),
        Prompt::Chat(msgs) if msgs.is_empty() => {
            return Err(invalid("messages", "messages must not be empty"))
        }
        Prompt::Chat(msgs) => {
            let rendered = tools.map(Tools::rendered).unwrap_or_default();
            let msgs = roles(msgs)?;
            let opts = ChatOptions {
                add_generation_prompt: true,
                enable_thinking: req.enable_thinking,
            };
            (
                tokenizer.encode_chat_opts(&msgs, &rendered, opts),
                "messages",
            )
        }
        Prompt::Ids(ids) => {
            in_vocabulary(r, ids, "prompt")?;
            (Ok(ids.clone()), "prompt")
        }
    };
    let ids = ids.map_err(|e| invalid(param, e.to_string()))?;
    // A constrained output is all answer: reasoning is not read out of it.
    let reading = r.parsers().reading(
        tool_mode,
        matches!(req.prompt, Prompt::Chat(_)),
        constrained,
        req.enable_thinking,
        &ids,
        tokenizer,
    );
    settings.keep_special = r.parsers().keep_for(&reading);
    // No node can reserve for a prompt of no tokens: refused here.
    if ids.is_empty() {
        return Err(invalid(
            param,
            "the prompt is empty: it encodes to no tokens",
        ));
    }
    Ok(Valid {
        ids,
        settings,
        reading,
    })
}

/// Refuses (naming `param`) the first id outside the model's vocabulary.
pub fn in_vocabulary(r: &Router, ids: &[u32], param: &'static str) -> Result<(), Rejection> {
    let vocab = r.tokenizer().vocab_size();
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(invalid(
            param,
            format!("token id {id} is outside the vocabulary of {vocab} tokens"),
        )),
        None => Ok(()),
    }
}

/// A request's `model`: absent or empty means the served model; any other
/// name is refused (404).
pub fn model(r: &Router, model: Option<&str>) -> Result<(), Rejection> {
    match model {
        Some(m) if !m.is_empty() && m != r.config().model_id => {
            Err(Rejection::UnknownModel(m.to_owned()))
        }
        _ => Ok(()),
    }
}

/// The messages with their roles checked (unknown roles are refused, not
/// passed to a template that might render them as anything).
pub fn roles(msgs: &[ChatMessage]) -> Result<std::borrow::Cow<'_, [ChatMessage]>, Rejection> {
    let mut out = std::borrow::Cow::Borrowed(msgs);
    for (i, m) in msgs.iter().enumerate() {
        match m.role.as_str() {
            "developer" => out.to_mut()[i].role = "system".into(),
            "tool" if m.tool_call_id.as_deref().unwrap_or_default().is_empty() => {
                return Err(invalid(
                    "messages",
                    format!("messages[{i}]: a tool message needs tool_call_id"),
                ))
            }
            r if r != "assistant" && !m.tool_calls.is_empty() => {
                return Err(invalid(
                    "messages",
                    format!("messages[{i}]: only assistant messages carry tool_calls"),
                ))
            }
            r if r != "tool" && (m.tool_call_id.is_some() || m.name.is_some()) => {
                return Err(invalid(
                    "messages",
                    format!("messages[{i}]: tool_call_id and name are for tool messages"),
                ))
            }
            r if ROLES.contains(&r) => {}
            "function" => {
                return Err(invalid(
                    "messages",
                    "role `function` (OpenAI's deprecated function calling) is not supported; \
                     use tool messages",
                ))
            }
            _ => {
                return Err(invalid(
                    "messages",
                    format!(
                        "unknown role `{}`: one of {}",
                        m.role.chars().take(32).collect::<String>(),
                        ROLES.join(", ")
                    ),
                ))
            }
        }
    }
    Ok(out)
}

fn settings(req: &Request, vocab: usize) -> Result<Settings, Rejection> {
    if req.max_tokens == Some(0) {
        let param = req.max_tokens_param;
        return Err(invalid(param, format!("{param} must be at least 1")));
    }
    let max_tokens = req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS as u64);
    let max_tokens = usize::try_from(max_tokens).unwrap_or(usize::MAX);
    if req.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }
    if req.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid(
            "stop_token_ids",
            format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
        ));
    }
    if let Some(id) = req.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(invalid(
            "stop_token_ids",
            format!("token id {id} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    if let Some(salt) = &req.cache_salt {
        if salt.is_empty() || salt.chars().count() > MAX_CACHE_SALT {
            return Err(invalid(
                "cache_salt",
                format!("cache_salt must have 1 to {MAX_CACHE_SALT} characters"),
            ));
        }
    }
    // After sampling's checks: `echo` with too many `logprobs` is refused
    // naming `logprobs`, not the prompt_logprobs it implies.
    let sampling = sampling(&req.sampling, max_tokens, vocab)?;
    let prompt_logprobs = match req.prompt_logprobs {
        Some(k) if k > MAX_PROMPT_LOGPROBS => {
            return Err(invalid(
                "prompt_logprobs",
                format!("prompt_logprobs must be 0 to {MAX_PROMPT_LOGPROBS}, got {k}"),
            ))
        }
        k => k.map(|k| k as u32),
    };
    Ok(Settings {
        prompt_logprobs,
        max_tokens,
        sampling,
        stop: req.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
        stop_token_ids: req.stop_token_ids.clone(),
        ignore_eos: req.ignore_eos,
        cache_salt: req.cache_salt.clone(),
        keep_special: Vec::new(),
    })
}

/// `v` (default `default`) if it lies in `range`, else the refusal of
/// `param`; `range` is written out for the message.
fn in_range(
    param: &'static str,
    v: Option<f64>,
    default: f64,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<f32, Rejection> {
    let v = v.unwrap_or(default);
    if !(v.is_finite() && ok(v)) {
        return Err(invalid(param, format!("{param} {v} is not in {range}")));
    }
    Ok(v as f32)
}

fn sampling(s: &SamplingIn, max_tokens: usize, vocab: usize) -> Result<Sampling, Rejection> {
    let temperature = in_range(
        "temperature",
        s.temperature,
        1.0,
        |v| (0.0..=2.0).contains(&v),
        "[0, 2]",
    )?;
    // A top_p below f32's range keeps the smallest positive mass (the most
    // likely token only).
    let top_p =
        in_range("top_p", s.top_p, 1.0, |v| v > 0.0 && v <= 1.0, "(0, 1]")?.max(f32::MIN_POSITIVE);
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(invalid(
                "top_k",
                format!("top_k {k} must be -1 (all), 0 (all) or at least 1"),
            ))
        }
    };
    let min_p = in_range(
        "min_p",
        s.min_p,
        0.0,
        |v| (0.0..=1.0).contains(&v),
        "[0, 1]",
    )?;
    let penalty = |param, v| in_range(param, v, 0.0, |v| (-2.0..=2.0).contains(&v), "[-2, 2]");
    let presence_penalty = penalty("presence_penalty", s.presence_penalty)?;
    let frequency_penalty = penalty("frequency_penalty", s.frequency_penalty)?;
    let repetition_penalty = in_range(
        "repetition_penalty",
        s.repetition_penalty,
        1.0,
        |v| v > 0.0 && v <= 1e4,
        "(0, 10000]",
    )?;
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} logit_bias entries"),
        ));
    }
    let mut logit_bias = std::collections::HashMap::with_capacity(s.logit_bias.len());
    for &(id, b) in &s.logit_bias {
        if id as usize >= vocab {
            return Err(invalid(
                "logit_bias",
                format!("token id {id} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let b = in_range(
            "logit_bias",
            Some(b),
            0.0,
            |v| (-100.0..=100.0).contains(&v),
            "[-100, 100]",
        )?;
        logit_bias.insert(id, b);
    }
    let min_tokens = s.min_tokens.unwrap_or(0);
    if min_tokens > max_tokens as u64 {
        return Err(invalid(
            "min_tokens",
            format!("min_tokens {min_tokens} is more than the budget of {max_tokens} tokens"),
        ));
    }
    let logprobs = match s.logprobs {
        Some(n) if n > s.logprobs_max => {
            let (param, max) = (s.logprobs_param, s.logprobs_max);
            return Err(invalid(param, format!("{param} {n} is more than {max}")));
        }
        n => n.map(|n| n as u32),
    };
    Ok(Sampling {
        temperature,
        top_p,
        seed: s.seed.unwrap_or_else(fresh_seed),
        top_k,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logit_bias,
        min_tokens: u32::try_from(min_tokens).unwrap_or(u32::MAX),
        logprobs,
        grammar: String::new(),
    })
}

/// A seed for a request that named none: 64 bits from the OS random
/// number generator (the clock if it fails: a seed is not a secret, and
/// unseeded requests must not all share one).
fn fresh_seed() -> u64 {
    kvmesh_kvwire::ids::random_nonzero::<8>()
        .map(u64::from_le_bytes)
        .unwrap_or_else(|_| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0x9E37_79B9_7F4A_7C15, |d| d.as_nanos() as u64)
        })
}

#[cfg(test)]
mod tests;
