//! Tools in a conversation: function definitions offered to the model,
//! assistant messages that called them, and `tool` messages answering.
//!
//! A template that reads `tools` (Qwen2.5, Hermes, Llama 3.1...) gets them
//! as transformers passes them: `tools` a list of `{"type": "function",
//! "function": {...}}`, each assistant message's `tool_calls` with the
//! arguments as an object, `tool` messages with `tool_call_id`. Those
//! values are template text, not content, so a string in them holding
//! special-token text is refused ([`template_text`]) rather than let it
//! become a control token.
//!
//! A template that does not read `tools` (SmolLM2's) would drop them
//! without a word, so the conversation is rewritten the way Hermes and
//! Qwen2.5 templates render it ([`hermes`]): a system message listing the
//! tools in `<tools></tools>` and asking for `<tool_call>` blocks, each
//! call of an assistant message as a `<tool_call>` block in its content,
//! and consecutive `tool` messages as one `user` message of
//! `<tool_response>` blocks. All of it is message content, so the
//! placeholder protection of `chat_encode` covers it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ChatMessage;

/// A call an assistant message made, as templates read it (transformers:
/// `{"id", "type": "function", "function": {"name", "arguments"}}`, the
/// arguments an object, not JSON text).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which a `tool` message's `tool_call_id` answers.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function called.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments (a JSON value, usually an object).
    pub arguments: Value,
}

impl ToolCall {
    /// A function call.
    pub fn function(id: impl Into<String>, name: impl Into<String>, arguments: Value) -> Self {
        Self {
            id: id.into(),
            kind: "function".into(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }
}

/// Whether `template` reads the `tools` variable (then it renders tools
/// and tool messages itself).
pub(super) fn template_reads_tools(template: &str) -> bool {
    let env = minijinja::Environment::new();
    env.template_from_str(template)
        .map(|t| t.undeclared_variables(false).contains("tools"))
        .unwrap_or(false)
}

/// Whether a conversation needs tool handling at all.
pub(super) fn involves_tools(messages: &[ChatMessage], tools: &[Value]) -> bool {
    !tools.is_empty()
        || messages
            .iter()
            .any(|m| !m.tool_calls.is_empty() || m.role == "tool")
}

/// The system text that offers `tools` (Qwen2.5's wording).
fn preamble(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// One call as a Hermes block.
fn call_block(c: &ToolCall) -> String {
    // Name first, as Hermes and Qwen2.5 write it (serde_json's maps sort).
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        Value::from(c.function.name.as_str()),
        c.function.arguments
    )
}

/// The conversation rewritten for a template that does not read `tools`
/// (see the module documentation). Messages without tool parts pass as
/// they are.
pub(super) fn hermes(messages: &[ChatMessage], tools: &[Value]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if !tools.is_empty() {
        let system = match messages.first() {
            Some(m) if m.role == "system" => {
                rest = &messages[1..];
                format!("{}\n\n{}", m.content, preamble(tools))
            }
            _ => preamble(tools),
        };
        out.push(ChatMessage::new("system", system));
    }
    for m in rest {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            // Consecutive tool answers share one user turn, as in Qwen2.5.
            match out.last_mut() {
                Some(prev) if prev.role == "user" && prev.content.ends_with("</tool_response>") => {
                    prev.content.push('\n');
                    prev.content.push_str(&block);
                }
                _ => out.push(ChatMessage::new("user", block)),
            }
            continue;
        }
        if m.tool_calls.is_empty() {
            out.push(ChatMessage::new(m.role.clone(), m.content.clone()));
            continue;
        }
        let mut content = m.content.clone();
        for c in &m.tool_calls {
            if !content.is_empty() {
                content.push('\n');
            }
            content.push_str(&call_block(c));
        }
        out.push(ChatMessage::new(m.role.clone(), content));
    }
    out
}

/// Every string a template renders as its own text from the tool parts of
/// a conversation (tool definitions, call names, ids and arguments), for
/// `f` to check; keys of objects included.
pub(super) fn template_text(messages: &[ChatMessage], tools: &[Value], f: &mut impl FnMut(&str)) {
    fn walk(v: &Value, f: &mut impl FnMut(&str)) {
        match v {
            Value::String(s) => f(s),
            Value::Array(a) => a.iter().for_each(|v| walk(v, f)),
            Value::Object(o) => o.iter().for_each(|(k, v)| {
                f(k);
                walk(v, f)
            }),
            _ => {}
        }
    }
    tools.iter().for_each(|t| walk(t, f));
    for m in messages {
        for c in &m.tool_calls {
            f(&c.id);
            f(&c.function.name);
            walk(&c.function.arguments, f);
        }
        if let Some(id) = &m.tool_call_id {
            f(id);
        }
        if let Some(name) = &m.name {
            f(name);
        }
    }
}

#[cfg(test)]
mod tests;
