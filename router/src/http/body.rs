//! A request body's fields: which a body may carry, and reading each on
//! its own so that a refusal names its field. A field not listed is
//! refused, never dropped.

use serde::Deserialize;
use serde_json::Value;

use crate::error::Rejection;
use crate::validate::invalid;

/// Fields a completions or chat body may carry: each is honoured (the
/// README's table says how) and anything else is refused with a 400 that
/// names it, so no client setting is dropped without a word.
pub(super) const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "n",
    "stream",
    "stream_options",
    "cache_salt",
    "user",
    "response_format",
    "structured_outputs",
    "prompt_logprobs",
];

/// Fields only completions bodies carry.
pub(super) const COMPLETION_FIELDS: &[&str] =
    &["prompt", "echo", "max_completion_tokens", "best_of"];

/// Fields only chat bodies carry.
pub(super) const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
];

/// Characters a `user` label may have at most.
pub(super) const MAX_USER: usize = 256;

/// A body's fields, each read on its own so a refusal names its field.
pub(super) struct Body(serde_json::Map<String, Value>);

impl Body {
    pub(super) fn parse(bytes: &[u8], allowed: &[&[&str]]) -> Result<Self, Rejection> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| invalid("body", format!("invalid JSON body: {e}")))?;
        let Value::Object(map) = v else {
            return Err(invalid("body", "the body must be a JSON object"));
        };
        if let Some(k) = map
            .keys()
            .find(|k| !allowed.iter().any(|list| list.contains(&k.as_str())))
        {
            return Err(Rejection::Invalid {
                param: unknown_param(k),
                message: format!(
                    "unsupported field `{}`: this server does not implement it (see the README's table of OpenAI parameters)",
                    k.chars().take(64).collect::<String>()
                ),
            });
        }
        Ok(Self(map))
    }

    /// Field `name` as `T`; absent and `null` are `None`.
    pub(super) fn get<T: for<'de> Deserialize<'de>>(
        &self,
        name: &'static str,
    ) -> Result<Option<T>, Rejection> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => T::deserialize(v)
                .map(Some)
                .map_err(|e| invalid(name, format!("{name}: {e}"))),
        }
    }
}

/// `chat_template_kwargs`: only `enable_thinking` (a boolean) is passed on
/// to the template (and, `false`, turns reasoning parsing off); any other
/// argument is refused by name rather than dropped, as a template
/// argument the gateway does not pass would change nothing.
pub(super) fn enable_thinking(kwargs: Option<Value>) -> Result<Option<bool>, Rejection> {
    const PARAM: &str = "chat_template_kwargs";
    let Some(kwargs) = kwargs else {
        return Ok(None);
    };
    let Value::Object(map) = kwargs else {
        return Err(invalid(PARAM, "chat_template_kwargs must be an object"));
    };
    let mut on = None;
    for (k, v) in map {
        match (k.as_str(), v) {
            ("enable_thinking", Value::Bool(b)) => on = Some(b),
            ("enable_thinking", Value::Null) => {}
            ("enable_thinking", _) => {
                return Err(invalid(
                    PARAM,
                    "chat_template_kwargs.enable_thinking must be true or false",
                ))
            }
            (other, _) => {
                return Err(invalid(
                    PARAM,
                    format!(
                        "chat_template_kwargs.{}: unsupported; only enable_thinking is passed to the template",
                        other.chars().take(64).collect::<String>()
                    ),
                ))
            }
        }
    }
    Ok(on)
}

/// The refusal's `param` for an unknown field: a static name (the one
/// refused, when it is one the gateway knows of, else `body`).
fn unknown_param(k: &str) -> &'static str {
    const KNOWN_UNSUPPORTED: &[&str] = &[
        "suffix",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "guided_json",
        "guided_regex",
        "guided_grammar",
        "guided_choice",
        "id",
        "request_id",
        "audio",
        "modalities",
        "prediction",
        "service_tier",
        "store",
        "metadata",
        "reasoning_effort",
        "web_search_options",
        "use_beam_search",
        "length_penalty",
        "bad_words",
        "allowed_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "priority",
        "logits_processors",
        "messages",
        "prompt",
        "echo",
        "max_completion_tokens",
        "top_logprobs",
    ];
    KNOWN_UNSUPPORTED
        .iter()
        .find(|&&n| n == k)
        .copied()
        .unwrap_or("body")
}
