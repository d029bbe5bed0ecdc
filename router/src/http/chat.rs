//! A chat body's `messages`, read into the tokenizer's [`ChatMessage`]s:
//! roles and content as OpenAI sends them, an assistant's calls (arguments
//! as JSON text) and reasoning, a tool's answer. Unknown fields are
//! refused.

use kvmesh_tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::Value;

use crate::error::Rejection;
use crate::validate::invalid;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ChatIn {
    role: String,
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallIn>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// An assistant message's reasoning, as a reasoning model's answer
    /// carried it (`reasoning` is vLLM's newer name for it).
    #[serde(default, alias = "reasoning")]
    reasoning_content: Option<String>,
}

/// A call of an assistant message, as OpenAI sends it back: the arguments
/// are JSON text.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolCallIn {
    id: String,
    #[serde(rename = "type")]
    kind: String,
    function: FunctionIn,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionIn {
    name: String,
    arguments: String,
}

/// The messages, checked; absent: refused.
pub(super) fn chat_messages(msgs: Option<Vec<ChatIn>>) -> Result<Vec<ChatMessage>, Rejection> {
    let msgs = msgs.ok_or_else(|| invalid("messages", "messages is required"))?;
    msgs.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s,
                // The array form: text parts concatenated.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => Ok(t.to_owned()),
                            _ => Err(invalid("messages", "only text content parts are supported")),
                        }
                    })
                    .collect::<Result<String, _>>()?,
                Some(_) => {
                    return Err(invalid(
                        "messages",
                        "content must be a string or text parts",
                    ))
                }
            };
            let tool_calls = m
                .tool_calls
                .unwrap_or_default()
                .into_iter()
                .map(|c| {
                    if c.kind != "function" {
                        return Err(invalid(
                            "messages",
                            format!("messages[{i}].tool_calls: type must be function"),
                        ));
                    }
                    // Templates get the arguments as an object
                    // (transformers' convention).
                    let arguments: Value =
                        serde_json::from_str(&c.function.arguments).map_err(|e| {
                            invalid(
                                "messages",
                                format!("messages[{i}].tool_calls: arguments is not JSON: {e}"),
                            )
                        })?;
                    Ok(kvmesh_tokenizer::ToolCall::function(
                        c.id,
                        c.function.name,
                        arguments,
                    ))
                })
                .collect::<Result<_, _>>()?;
            Ok(ChatMessage {
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
                reasoning_content: m.reasoning_content,
                ..ChatMessage::new(m.role, content)
            })
        })
        .collect()
}
