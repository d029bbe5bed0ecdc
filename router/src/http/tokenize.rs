//! `/tokenize`, `/detokenize` and `/version`, as vLLM serves them; the
//! encoding is [`crate::tokenize`]'s, shared with the gRPC API.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::body::Body;
use super::chat::chat_messages;
use crate::error::{GatewayError, Rejection};
use crate::tokenize::{self, Input};
use crate::validate::invalid;
use crate::Router;

/// Fields a `/tokenize` body may carry (vLLM's, less the chat-template
/// overrides and tools, which are refused by name).
const TOKENIZE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
];

/// Fields a `/detokenize` body may carry.
const DETOKENIZE_FIELDS: &[&str] = &["model", "tokens"];

/// POST /tokenize: `{prompt}` or `{messages}` to `{count, max_model_len,
/// tokens, token_strs}`.
pub(super) async fn tokenize(
    State(r): State<Router>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match tokenize_body(&r, body) {
        Ok(v) => Json(v).into_response(),
        // Not counted as a refused request: nothing was asked to generate.
        Err(e) => e.into_response(),
    }
}

fn tokenize_body(r: &Router, body: Result<Bytes, BytesRejection>) -> Result<Value, GatewayError> {
    let body = body?;
    let b = Body::parse(&body, &[TOKENIZE_FIELDS])?;
    let prompt: Option<String> = b.get("prompt")?;
    let messages = b.get("messages")?;
    let chat_only = |name: &'static str| -> Result<(), Rejection> {
        match (&prompt, b.get::<Value>(name)?) {
            (Some(_), Some(_)) => Err(invalid(
                name,
                format!("{name} applies to messages, not to a prompt"),
            )),
            _ => Ok(()),
        }
    };
    chat_only("add_generation_prompt")?;
    chat_only("continue_final_message")?;
    if b.get::<bool>("continue_final_message")? == Some(true) {
        return Err(invalid(
            "continue_final_message",
            "continue_final_message is not supported: the conversation is rendered with or \
             without the generation prompt (add_generation_prompt)",
        )
        .into());
    }
    let add_special_tokens: Option<bool> = b.get("add_special_tokens")?;
    let input = match (prompt, messages) {
        (Some(text), None) => Input::Prompt {
            text,
            add_special_tokens: add_special_tokens.unwrap_or(true),
        },
        (None, Some(msgs)) => Input::Chat {
            messages: chat_messages(Some(msgs))?,
            add_generation_prompt: b.get("add_generation_prompt")?.unwrap_or(true),
            add_special_tokens: add_special_tokens.unwrap_or(false),
        },
        (Some(_), Some(_)) => {
            return Err(invalid("messages", "send either prompt or messages, not both").into())
        }
        (None, None) => return Err(invalid("prompt", "prompt or messages is required").into()),
    };
    let model: Option<String> = b.get("model")?;
    let with_strs = b.get("return_token_strs")?.unwrap_or(false);
    let tokens = tokenize::tokenize(r, model.as_deref(), input, with_strs)?;
    Ok(json!({
        "count": tokens.ids.len(),
        "max_model_len": r.config().max_model_len,
        "tokens": tokens.ids,
        "token_strs": tokens.strs,
    }))
}

/// POST /detokenize: `{tokens}` to `{prompt}` (special tokens kept).
pub(super) async fn detokenize(
    State(r): State<Router>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let text = body.map_err(GatewayError::from).and_then(|body| {
        let b = Body::parse(&body, &[DETOKENIZE_FIELDS])?;
        let ids: Vec<u32> = b
            .get("tokens")?
            .ok_or_else(|| invalid("tokens", "tokens is required"))?;
        let model: Option<String> = b.get("model")?;
        Ok(tokenize::detokenize(&r, model.as_deref(), &ids, "tokens")?)
    });
    match text {
        Ok(prompt) => Json(json!({ "prompt": prompt })).into_response(),
        Err(e) => e.into_response(),
    }
}

/// GET /version: the kvmesh version serving.
pub(super) async fn version() -> Json<Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

#[cfg(test)]
mod tests;
