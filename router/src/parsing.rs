//! Which parsers a router reads answers with: the settings
//! (`--tool-call-parser`, `--reasoning-parser`, or the mesh file's
//! `tool_call_parser:` / `reasoning_parser:`), and [`Parsers`], what they
//! resolve to for the served model once its chat template is known.
//!
//! `auto`, the default of both, reads the chat template: `<tool_call>`
//! means Hermes, `<|python_tag|>` or Llama 3's `"parameters"` instruction
//! `llama3_json`, `[TOOL_CALLS]` Mistral, none of them Hermes (the
//! gateway writes tools the Hermes way for a template that does not read
//! them); `<think>` means the `qwen3` reasoning format, its absence none.

use std::fmt;
use std::str::FromStr;

use kvmesh_tokenizer::TextTokenizer;

use crate::reasoning::{self, ReasoningParser};
use crate::tools::parse::{Reading, Reasoning};
use crate::tools::parsers::{self as tool_formats, ToolParser};
use crate::tools::Mode;

/// Prompt tokens read for where the generation prompt leaves reasoning
/// ([`reasoning::prompt_opens`]): a generation prompt is a few tokens.
const PROMPT_TAIL: usize = 32;

/// An unknown parser name: a startup error that lists the names known.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} parser {name:?}: expected one of {known}")]
pub struct UnknownParser {
    /// `tool-call` or `reasoning`.
    pub what: &'static str,
    /// The name given.
    pub name: String,
    /// The names known, comma-separated.
    pub known: String,
}

/// `--tool-call-parser`: `auto` or a format's name.
#[derive(Clone, Copy, Debug, Default)]
pub enum ToolParserSetting {
    /// From the chat template.
    #[default]
    Auto,
    /// This format.
    Named(&'static dyn ToolParser),
}

/// `--reasoning-parser`: `auto`, `none` or a format's name.
#[derive(Clone, Copy, Debug, Default)]
pub enum ReasoningParserSetting {
    /// From the chat template.
    #[default]
    Auto,
    /// Reasoning is not parsed: it stays in the content.
    None,
    /// This format.
    Named(&'static dyn ReasoningParser),
}

impl ToolParserSetting {
    /// Every name the setting takes.
    pub fn names() -> Vec<&'static str> {
        std::iter::once("auto")
            .chain(tool_formats::TOOL_PARSERS.iter().map(|p| p.name()))
            .collect()
    }
}

impl ReasoningParserSetting {
    /// Every name the setting takes.
    pub fn names() -> Vec<&'static str> {
        ["auto", "none"]
            .into_iter()
            .chain(reasoning::REASONING_PARSERS.iter().map(|p| p.name()))
            .collect()
    }
}

impl FromStr for ToolParserSetting {
    type Err = UnknownParser;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            _ => tool_formats::by_name(s)
                .map(Self::Named)
                .ok_or_else(|| UnknownParser {
                    what: "tool-call",
                    name: s.chars().take(64).collect(),
                    known: Self::names().join(", "),
                }),
        }
    }
}

impl FromStr for ReasoningParserSetting {
    type Err = UnknownParser;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            _ => reasoning::by_name(s)
                .map(Self::Named)
                .ok_or_else(|| UnknownParser {
                    what: "reasoning",
                    name: s.chars().take(64).collect(),
                    known: Self::names().join(", "),
                }),
        }
    }
}

impl fmt::Display for ToolParserSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Named(p) => f.write_str(p.name()),
        }
    }
}

impl fmt::Display for ReasoningParserSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::None => f.write_str("none"),
            Self::Named(p) => f.write_str(p.name()),
        }
    }
}

/// The parsers of the served model, resolved once at start.
#[derive(Clone, Debug)]
pub struct Parsers {
    /// How `tool_choice: auto` reads calls, and the form of call ids.
    pub tool: &'static dyn ToolParser,
    /// How reasoning is read out of chat answers, if at all.
    pub reasoning: Option<&'static dyn ReasoningParser>,
    /// How each was chosen, for the log.
    why: (&'static str, &'static str),
    /// The tool format's markers that are special tokens of this
    /// tokenizer: kept in the decoded text of requests that read calls.
    tool_keep: Vec<u32>,
    /// The same for the reasoning format's tags.
    reasoning_keep: Vec<u32>,
}

impl Parsers {
    /// The settings resolved against the served model's tokenizer (its
    /// chat template for `auto`, its special tokens for the markers).
    pub fn resolve(
        tool: ToolParserSetting,
        reasoning: ReasoningParserSetting,
        tokenizer: &TextTokenizer,
    ) -> Self {
        let template = tokenizer.chat_template();
        let (tool, tool_why) = match tool {
            ToolParserSetting::Named(p) => (p, "set"),
            ToolParserSetting::Auto => match tool_formats::for_template(template) {
                (p, true) => (p, "auto: the chat template writes it"),
                (p, false) => (p, "auto: the chat template names no format; the default"),
            },
        };
        let (reasoning, reasoning_why) = match reasoning {
            ReasoningParserSetting::Named(p) => (Some(p), "set"),
            ReasoningParserSetting::None => (None, "set"),
            ReasoningParserSetting::Auto => match reasoning::for_template(template) {
                Some(p) => (Some(p), "auto: the chat template has <think>"),
                None => (None, "auto: the chat template has no <think>"),
            },
        };
        Self {
            tool_keep: special_ids(tokenizer, tool.markers()),
            reasoning_keep: reasoning
                .map_or_else(Vec::new, |r| special_ids(tokenizer, r.markers())),
            tool,
            reasoning,
            why: (tool_why, reasoning_why),
        }
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        format!(
            "tool-call parser {} ({}); reasoning parser {} ({})",
            self.tool.name(),
            self.why.0,
            self.reasoning.map_or("none", |r| r.name()),
            self.why.1
        )
    }

    /// How one request's text is read: its tools' `mode` with the tool
    /// format; and, for a chat whose output is not constrained by a
    /// grammar (a constrained answer is all answer: the grammar holds from
    /// its first token) and that did not set `enable_thinking: false`, the
    /// reasoning format, told whether the end of `prompt` opened a block.
    pub fn reading(
        &self,
        mode: Mode,
        chat: bool,
        constrained: bool,
        enable_thinking: Option<bool>,
        prompt: &[u32],
        tokenizer: &TextTokenizer,
    ) -> Reading {
        let reasoning = self
            .reasoning
            .filter(|_| chat && !constrained && enable_thinking != Some(false))
            .map(|parser| {
                let tail = &prompt[prompt.len().saturating_sub(PROMPT_TAIL)..];
                let text = tokenizer.decode(tail, false).unwrap_or_default();
                Reasoning {
                    parser,
                    opened: reasoning::prompt_opens(&text),
                }
            });
        Reading {
            mode,
            tool: self.tool,
            reasoning,
        }
    }

    /// [`Parsers::keep`] for `reading`.
    pub fn keep_for(&self, reading: &Reading) -> Vec<u32> {
        self.keep(
            matches!(reading.mode, Mode::Auto { .. }),
            reading.reasoning.is_some(),
        )
    }

    /// Special tokens a request's decoded text keeps: the tool format's
    /// markers when it reads calls, the reasoning tags when it reads
    /// reasoning.
    pub fn keep(&self, calls: bool, reasoning: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        if calls {
            ids.extend_from_slice(&self.tool_keep);
        }
        if reasoning {
            for id in &self.reasoning_keep {
                if !ids.contains(id) {
                    ids.push(*id);
                }
            }
        }
        ids
    }
}

/// The ids of those `markers` that are one special token of `tokenizer`
/// (a token whose text decoding skips). Markers that are ordinary text
/// (Qwen's `<tool_call>`, `<think>`) decode as they are and need nothing.
fn special_ids(tokenizer: &TextTokenizer, markers: &[&str]) -> Vec<u32> {
    markers
        .iter()
        .filter_map(|m| {
            let id = tokenizer.token_to_id(m)?;
            let skipped = tokenizer.decode(&[id], true).ok()?.is_empty();
            let written = tokenizer.decode(&[id], false).ok()? == *m;
            (skipped && written).then_some(id)
        })
        .collect()
}

#[cfg(test)]
mod tests;
