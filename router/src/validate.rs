//! One validation for every front end. The HTTP gateway and the public
//! gRPC API each turn what they received into a front-end-neutral
//! [`Request`]; [`request`] checks it with one set of defaults and limits
//! and tokenizes it into a [`Valid`], which only this module can make. So a
//! request means the same whichever door it came in by: the same default
//! budget, the same fresh seed when none is given, the same refusal of an
//! empty prompt, the same bound on stop strings, the same model check.

use kvmesh_tokenizer::ChatMessage;

use crate::error::Rejection;
use crate::Router;

/// Completion budget when a request names none (OpenAI's for completions).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Stop strings a request may carry at most (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// Characters a `cache_salt` may have at most.
pub const MAX_CACHE_SALT: usize = 256;

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Raw text (special-token text in it is parsed as special tokens).
    Text(String),
    /// Chat messages, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
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
    /// Sampling temperature; `None`: 1.0. As sent (f64), checked before
    /// narrowing, so 2.0000001 is not rounded into range.
    pub temperature: Option<f64>,
    /// Nucleus mass; `None`: 1.0.
    pub top_p: Option<f64>,
    /// Sampler seed; `None`: a fresh one from the OS for this request.
    pub seed: Option<u64>,
    /// Stop strings (empty ones are dropped).
    pub stop: Vec<String>,
    /// End-of-sequence tokens do not end generation (vLLM's extension).
    pub ignore_eos: bool,
    /// Narrows the prefix cache inside the tenant (vLLM's extension).
    pub cache_salt: Option<String>,
}

/// Checked sampling and budget settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Completion budget, at least 1.
    pub max_tokens: usize,
    /// Temperature in [0, 2].
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Sampler seed.
    pub seed: u64,
    /// Non-empty stop strings, at most [`MAX_STOP_STRINGS`].
    pub stop: Vec<String>,
    /// Generate exactly `max_tokens` tokens: end-of-sequence tokens do not
    /// stop generation (stop strings still do).
    pub ignore_eos: bool,
    /// 1 to [`MAX_CACHE_SALT`] characters: a sub-namespace of the tenant's
    /// prefix cache. It can only narrow what the tenant shares: the
    /// namespace is derived from the authenticated tenant first.
    pub cache_salt: Option<String>,
}

/// A request that passed [`request`]: its prompt's token ids (at least
/// one) and its settings. Nothing else makes one.
#[derive(Debug)]
pub struct Valid {
    ids: Vec<u32>,
    settings: Settings,
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

    /// Both, by value.
    pub fn into_parts(self) -> (Vec<u32>, Settings) {
        (self.ids, self.settings)
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
    if let Some(m) = &req.model {
        if !m.is_empty() && *m != r.config().model_id {
            return Err(Rejection::UnknownModel(m.clone()));
        }
    }
    let settings = settings(&req)?;
    let tokenizer = r.tokenizer();
    let (ids, param) = match &req.prompt {
        Prompt::Text(text) => (tokenizer.encode(text), "prompt"),
        Prompt::Chat(msgs) if msgs.is_empty() => {
            return Err(invalid("messages", "messages must not be empty"))
        }
        Prompt::Chat(msgs) => (tokenizer.encode_chat(msgs), "messages"),
    };
    let ids = ids.map_err(|e| invalid(param, e.to_string()))?;
    // No node can reserve for a prompt of no tokens: refused here.
    if ids.is_empty() {
        return Err(invalid(
            param,
            "the prompt is empty: it encodes to no tokens",
        ));
    }
    Ok(Valid { ids, settings })
}

fn settings(req: &Request) -> Result<Settings, Rejection> {
    if req.max_tokens == Some(0) {
        let param = req.max_tokens_param;
        return Err(invalid(param, format!("{param} must be at least 1")));
    }
    let max_tokens = req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS as u64);
    let max_tokens = usize::try_from(max_tokens).unwrap_or(usize::MAX);
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(invalid(
            "temperature",
            format!("temperature {temperature} is not in [0, 2]"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid("top_p", format!("top_p {top_p} is not in (0, 1]")));
    }
    // In range, so the narrowing only rounds; a top_p below f32's range
    // keeps the smallest positive mass (the most likely token only).
    let (temperature, top_p) = (temperature as f32, (top_p as f32).max(f32::MIN_POSITIVE));
    if req.stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
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
    Ok(Settings {
        max_tokens,
        temperature,
        top_p,
        seed: req.seed.unwrap_or_else(fresh_seed),
        stop: req.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
        ignore_eos: req.ignore_eos,
        cache_salt: req.cache_salt.clone(),
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
mod tests {
    use super::*;

    fn req(prompt: Prompt) -> Request {
        Request {
            model: None,
            prompt,
            max_tokens: None,
            max_tokens_param: "max_tokens",
            temperature: None,
            top_p: None,
            seed: None,
            stop: Vec::new(),
            ignore_eos: false,
            cache_salt: None,
        }
    }

    fn text(t: &str) -> Prompt {
        Prompt::Text(t.into())
    }

    fn param(e: Rejection) -> &'static str {
        match e {
            Rejection::Invalid { param, .. } => param,
            other => panic!("not a field refusal: {other:?}"),
        }
    }

    #[test]
    fn defaults_are_one_set_and_unseeded_requests_get_their_own_seed() {
        let r = crate::openapi::tests::router(false);
        let a = request(&r, req(text("Hello"))).expect("valid");
        let s = a.settings();
        assert_eq!(s.max_tokens, DEFAULT_MAX_TOKENS);
        assert_eq!((s.temperature, s.top_p), (1.0, 1.0));
        assert!(!a.ids().is_empty());
        let seeds: std::collections::HashSet<u64> = (0..8)
            .map(|_| {
                request(&r, req(text("Hello")))
                    .expect("valid")
                    .settings()
                    .seed
            })
            .collect();
        assert_eq!(seeds.len(), 8, "unseeded requests do not share a seed");
        let seeded = Request {
            seed: Some(7),
            ..req(text("Hello"))
        };
        assert_eq!(request(&r, seeded).expect("valid").settings().seed, 7);
    }

    #[test]
    fn refusals_name_their_field() {
        let r = crate::openapi::tests::router(false);
        assert_eq!(
            param(request(&r, req(text(""))).expect_err("empty")),
            "prompt"
        );
        assert_eq!(
            param(request(&r, req(Prompt::Chat(Vec::new()))).expect_err("no messages")),
            "messages"
        );
        let five = Request {
            stop: vec!["a".into(); 5],
            ..req(text("Hello"))
        };
        assert_eq!(param(request(&r, five).expect_err("five stops")), "stop");
        let zero = Request {
            max_tokens: Some(0),
            max_tokens_param: "max_completion_tokens",
            ..req(text("Hello"))
        };
        assert_eq!(
            param(request(&r, zero).expect_err("zero")),
            "max_completion_tokens"
        );
        let hot = Request {
            temperature: Some(2.000_000_1),
            ..req(text("Hello"))
        };
        assert_eq!(param(request(&r, hot).expect_err("too hot")), "temperature");
        let other = Request {
            model: Some("gpt-x".into()),
            ..req(text("Hello"))
        };
        assert!(matches!(
            request(&r, other),
            Err(Rejection::UnknownModel(_))
        ));
        let stops = Request {
            stop: vec![String::new(), "x".into()],
            ..req(text("Hello"))
        };
        assert_eq!(request(&r, stops).expect("valid").settings().stop, ["x"]);
    }
}
