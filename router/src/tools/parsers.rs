//! Tool-call formats: how one model family writes calls in its text, read
//! by a [`ToolParser`] (vLLM's `--tool-call-parser`). One module per
//! format; a new format is one file and one line in [`TOOL_PARSERS`].
//!
//! - `hermes`: Hermes, Qwen 2.5 and Qwen 3, `<tool_call>{json}</tool_call>`
//!   blocks anywhere in the text.
//! - `llama3_json`: Llama 3.1 and 3.2, the whole answer (optionally after
//!   `<|python_tag|>`) one JSON call or several separated by `;`.
//! - `mistral`: `[TOOL_CALLS]` and a JSON list of calls; ids of 9
//!   alphanumerics, as Mistral's templates require.
//!
//! Every format commits a call only once its JSON has closed and parsed
//! (vLLM streams argument fragments as they are generated and cannot take
//! them back): a call cut short by the budget, or one that does not parse,
//! stays text, and the streamed answer is exactly the whole one for every
//! way the text may be split into pieces (`tests`). Memory outside a call
//! is bounded by the markers held back (at most a marker's length); inside
//! one, by the call's own text.

use std::fmt;

use serde_json::Value;

mod hermes;
mod json;
mod llama3_json;
mod mistral;

pub use hermes::Hermes;
pub use llama3_json::Llama3Json;
pub use mistral::Mistral;

/// One format of tool calls in a model's text.
pub trait ToolParser: Send + Sync + fmt::Debug {
    /// The name `--tool-call-parser` and `tool_call_parser:` take.
    fn name(&self) -> &'static str;

    /// Whether a chat template writes this format (`auto`'s choice).
    fn speaks(&self, template: &str) -> bool;

    /// Special tokens of the format's markup: the decoded text of a request
    /// this format reads keeps them (they are skipped otherwise), so the
    /// parser sees where calls start.
    fn markers(&self) -> &'static [&'static str] {
        &[]
    }

    /// A fresh call id in the form the family's templates accept back.
    fn call_id(&self) -> String {
        super::call_id()
    }

    /// A reader of one choice's text.
    fn stream(&self) -> Box<dyn ToolStream>;
}

/// One choice's text read as it arrives: what each piece makes certain.
pub trait ToolStream: Send + fmt::Debug {
    /// Appends `text`; pushes what is now certain onto `out`.
    fn push(&mut self, text: &str, out: &mut Vec<Found>);

    /// The text has ended: pushes everything still held.
    fn finish(&mut self, out: &mut Vec<Found>);
}

/// What a [`ToolStream`] finds in the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Text for the message's content.
    Text(String),
    /// A whole call.
    Call {
        /// The function.
        name: String,
        /// Its arguments, JSON text of an object.
        arguments: String,
    },
}

/// Whitespace a format holds back at most while it waits to see whether
/// markup follows (before an answer's first `{`, between calls); more is
/// let go as content, so a model that writes only spaces cannot grow the
/// buffer. Decided character by character, so whole and streamed agree.
const MAX_GAP: usize = 64;

/// Every format, in `auto`'s order of preference.
pub static TOOL_PARSERS: [&dyn ToolParser; 3] = [&Hermes, &Llama3Json, &Mistral];

/// The format named `name`.
pub fn by_name(name: &str) -> Option<&'static dyn ToolParser> {
    TOOL_PARSERS.iter().copied().find(|p| p.name() == name)
}

/// The format a chat template writes; Hermes when it names none (the
/// gateway's own rendering of tools for templates that do not read them
/// is Hermes').
pub fn for_template(template: Option<&str>) -> (&'static dyn ToolParser, bool) {
    template
        .and_then(|t| TOOL_PARSERS.iter().copied().find(|p| p.speaks(t)))
        .map_or((&Hermes as &dyn ToolParser, false), |p| (p, true))
}

/// A call object's name and arguments: `{"name": "...", "arguments":
/// {...}}` (or `parameters`, Llama's word). Arguments may be absent (no
/// arguments) or a string holding a JSON object (some models encode them
/// twice); anything else is not a call.
pub(crate) fn call_of(v: &Value) -> Option<(String, String)> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match (o.get("arguments"), o.get("parameters")) {
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => return Some((name.to_owned(), "{}".to_owned())),
        // Both: ambiguous, as vLLM's Llama parser also refuses.
        (Some(_), Some(_)) => return None,
    };
    let args = match args {
        Value::Object(_) => args.to_string(),
        Value::String(s) => match serde_json::from_str::<Value>(s).ok()? {
            a @ Value::Object(_) => a.to_string(),
            _ => return None,
        },
        _ => return None,
    };
    Some((name.to_owned(), args))
}

/// Pushes `text` as content unless it is empty.
fn text(out: &mut Vec<Found>, text: impl Into<String>) {
    let text = text.into();
    if !text.is_empty() {
        out.push(Found::Text(text));
    }
}

/// Pushes all of `buf` as content but a tail that could begin `tag`, which
/// stays in `buf` for the next piece.
fn release_text(buf: &mut String, tag: &str, out: &mut Vec<Found>) {
    let cut = buf.len() - held_tail(buf, &[tag]);
    text(out, buf.drain(..cut).collect::<String>());
}

/// The longest tail of `buf` that could begin any of `tags` (bytes).
fn held_tail(buf: &str, tags: &[&str]) -> usize {
    tags.iter()
        .map(|t| kvmesh_tokenizer::stop::partial_tail(buf, t))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
