//! Reasoning formats (vLLM's `--reasoning-parser`): how a model marks the
//! thinking it does before its answer, read by a [`ReasoningParser`] into
//! `reasoning_content` and the rest, the content (which the tool-call
//! parser then reads). One module per format; a new one is one file and
//! one line in [`REASONING_PARSERS`].
//!
//! - `deepseek_r1`: `<think>...</think>`; text before `</think>` is
//!   reasoning even without `<think>` (R1's template opens the block in the
//!   prompt, and R1 may leave it out).
//! - `qwen3`: `<think>...</think>`; the output is reasoning from its start
//!   when it opens with `<think>` or when the prompt left a `<think>` open
//!   (Qwen3 thinking models and Qwen 3.5 put it in the generation prompt),
//!   else content (a Qwen3 model answering with thinking off, or an
//!   instruct model without thinking). `<tool_call>` inside reasoning ends
//!   it, as vLLM's Qwen3 parser has it.
//!
//! Until the block closes, everything is reasoning: a stream cut by the
//! budget has only reasoning, and its content is null. Only the tags held
//! back (a tail that could begin one, at most a tag's length) are kept in
//! memory.

use std::fmt;

mod deepseek_r1;
mod qwen3;
mod think;

pub use deepseek_r1::DeepSeekR1;
pub use qwen3::Qwen3;

/// One reasoning format.
pub trait ReasoningParser: Send + Sync + fmt::Debug {
    /// The name `--reasoning-parser` and `reasoning_parser:` take.
    fn name(&self) -> &'static str;

    /// Whether a chat template uses this format (`auto`'s choice).
    fn speaks(&self, template: &str) -> bool;

    /// Its tags; those that are special tokens are kept in the decoded text
    /// of a request this format reads (they are skipped otherwise).
    fn markers(&self) -> &'static [&'static str];

    /// A reader of one choice's text; `opened`: the prompt ends inside a
    /// reasoning block (see [`prompt_opens`]).
    fn stream(&self, opened: bool) -> Box<dyn ReasoningStream>;
}

/// One choice's text read as it arrives.
pub trait ReasoningStream: Send + fmt::Debug {
    /// Appends `text`; pushes what is now certain onto `out`.
    fn push(&mut self, text: &str, out: &mut Vec<Part>);

    /// The text has ended: pushes everything still held.
    fn finish(&mut self, out: &mut Vec<Part>);
}

/// A piece of a choice's text, sorted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// Thinking: `reasoning_content`.
    Reasoning(String),
    /// The answer: content, and where tool calls are read.
    Content(String),
}

/// Every format, in `auto`'s order of preference.
pub static REASONING_PARSERS: [&dyn ReasoningParser; 2] = [&Qwen3, &DeepSeekR1];

/// The format named `name`.
pub fn by_name(name: &str) -> Option<&'static dyn ReasoningParser> {
    REASONING_PARSERS.iter().copied().find(|p| p.name() == name)
}

/// The format a chat template uses, if any.
pub fn for_template(template: Option<&str>) -> Option<&'static dyn ReasoningParser> {
    let t = template?;
    REASONING_PARSERS.iter().copied().find(|p| p.speaks(t))
}

/// Whether `prompt_tail` (the end of the rendered prompt, special tokens
/// written out) leaves a `<think>` block open: its last `<think>` comes
/// after its last `</think>`. A template that opens the block for the
/// model does so in the generation prompt, so the last few tokens
/// suffice; one that turns thinking off writes an empty, closed block.
pub fn prompt_opens(prompt_tail: &str) -> bool {
    match (
        prompt_tail.rfind(think::OPEN),
        prompt_tail.rfind(think::CLOSE),
    ) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

#[cfg(test)]
mod tests;
