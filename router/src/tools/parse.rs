//! A choice's text to its answer: reasoning, content and tool calls,
//! streamed or whole through the one [`Parser`] (the whole answer is the
//! streamed pieces put together, so the two cannot disagree).
//!
//! The text goes through the request's reasoning format first, when it has
//! one ([`crate::reasoning`]): reasoning comes out as such, and only the
//! rest, the content, goes on to the tools. There, by the request's
//! [`Mode`]: `auto` reads calls in the model's format
//! ([`super::parsers`]); a named function's text is that call's
//! arguments, streamed as they come; `required`'s is a JSON array parsed
//! at the end.

use serde_json::Value;

use super::parsers::{Found, Hermes, ToolParser, ToolStream};
use super::Mode;
use crate::reasoning::{Part, ReasoningParser, ReasoningStream};

/// A piece of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// Text for the message's `reasoning_content`.
    Reasoning(String),
    /// Text for the message's content.
    Content(String),
    /// A call begins: its index among the choice's calls, id and name.
    Start {
        /// 0, 1, ... in the order of the calls.
        index: usize,
        /// In the tool format's form (`call_` and random hex, or
        /// Mistral's 9 alphanumerics).
        id: String,
        /// The function.
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Args {
        /// The call.
        index: usize,
        /// The next piece.
        fragment: String,
    },
}

/// How a request's text is read: decided once per request (validation),
/// the same for each of its choices.
#[derive(Clone, Debug)]
pub struct Reading {
    /// What the tools make of the content.
    pub mode: Mode,
    /// The calls' format (for `auto`) and id form (every mode).
    pub tool: &'static dyn ToolParser,
    /// The reasoning format, if the request reads one.
    pub reasoning: Option<Reasoning>,
}

/// A request's reasoning format and where its prompt left it.
#[derive(Clone, Copy, Debug)]
pub struct Reasoning {
    /// The format.
    pub parser: &'static dyn ReasoningParser,
    /// The prompt ends inside a reasoning block
    /// ([`crate::reasoning::prompt_opens`]).
    pub opened: bool,
}

impl Default for Reading {
    /// Text as it is.
    fn default() -> Self {
        Self {
            mode: Mode::Text,
            tool: &Hermes,
            reasoning: None,
        }
    }
}

impl Reading {
    /// Text as it is: nothing to parse.
    pub fn is_plain(&self) -> bool {
        self.mode == Mode::Text && self.reasoning.is_none()
    }
}

/// One choice's text, read as it arrives.
#[derive(Debug)]
pub struct Parser {
    mode: Mode,
    tool: &'static dyn ToolParser,
    reasoning: Option<Box<dyn ReasoningStream>>,
    /// `auto`'s reader of calls.
    calls_in: Option<Box<dyn ToolStream>>,
    /// `required`: everything, parsed at the end.
    buf: String,
    /// Calls emitted.
    calls: usize,
}

impl Parser {
    /// A parser for one choice read as `reading` says.
    pub fn new(reading: &Reading) -> Self {
        Self {
            mode: reading.mode.clone(),
            tool: reading.tool,
            reasoning: reading.reasoning.map(|r| r.parser.stream(r.opened)),
            calls_in: matches!(reading.mode, Mode::Auto { .. }).then(|| reading.tool.stream()),
            buf: String::new(),
            calls: 0,
        }
    }

    /// Calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The answer's pieces that `text`, appended, makes certain.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        let mut out = Vec::new();
        match &mut self.reasoning {
            None => self.content(text, &mut out),
            Some(r) => {
                let mut parts = Vec::new();
                r.push(text, &mut parts);
                self.parts(parts, &mut out);
            }
        }
        out
    }

    /// The rest of the answer, once the text has ended.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        if let Some(r) = &mut self.reasoning {
            let mut parts = Vec::new();
            r.finish(&mut parts);
            self.parts(parts, &mut out);
        }
        match self.mode.clone() {
            Mode::Text => {}
            Mode::Named(name) => {
                if self.calls == 0 {
                    out.push(self.start(name));
                }
            }
            Mode::Required => {
                let buf = std::mem::take(&mut self.buf);
                match required(&buf) {
                    Some(calls) => {
                        for (name, args) in calls {
                            let index = self.calls;
                            out.push(self.start(name));
                            out.push(Out::Args {
                                index,
                                fragment: args,
                            });
                        }
                    }
                    None if buf.is_empty() => {}
                    None => out.push(Out::Content(buf)),
                }
            }
            Mode::Auto { parallel } => {
                let mut found = Vec::new();
                if let Some(s) = &mut self.calls_in {
                    s.finish(&mut found);
                }
                self.found(found, parallel, &mut out);
            }
        }
        out
    }

    fn parts(&mut self, parts: Vec<Part>, out: &mut Vec<Out>) {
        for p in parts {
            match p {
                Part::Reasoning(t) => out.push(Out::Reasoning(t)),
                Part::Content(t) => self.content(&t, out),
            }
        }
    }

    /// Content text through the tools.
    fn content(&mut self, text: &str, out: &mut Vec<Out>) {
        match self.mode.clone() {
            Mode::Text => {
                if !text.is_empty() {
                    out.push(Out::Content(text.to_owned()));
                }
            }
            Mode::Named(name) => {
                if self.calls == 0 {
                    out.push(self.start(name));
                }
                if !text.is_empty() {
                    out.push(Out::Args {
                        index: 0,
                        fragment: text.to_owned(),
                    });
                }
            }
            Mode::Required => self.buf.push_str(text),
            Mode::Auto { parallel } => {
                let mut found = Vec::new();
                if let Some(s) = &mut self.calls_in {
                    s.push(text, &mut found);
                }
                self.found(found, parallel, out);
            }
        }
    }

    /// `auto`'s findings as pieces. Without `parallel`, calls after the
    /// first are dropped (vLLM).
    fn found(&mut self, found: Vec<Found>, parallel: bool, out: &mut Vec<Out>) {
        for f in found {
            match f {
                Found::Text(t) => out.push(Out::Content(t)),
                Found::Call { .. } if !parallel && self.calls > 0 => {}
                Found::Call { name, arguments } => {
                    let index = self.calls;
                    out.push(self.start(name));
                    out.push(Out::Args {
                        index,
                        fragment: arguments,
                    });
                }
            }
        }
    }

    fn start(&mut self, name: String) -> Out {
        let index = self.calls;
        self.calls += 1;
        Out::Start {
            index,
            id: self.tool.call_id(),
            name,
        }
    }
}

/// `required`'s output, `[{"name": ..., "parameters": {...}}, ...]`.
fn required(text: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(text).ok()?;
    v.as_array()?
        .iter()
        .map(|c| {
            let name = c.get("name")?.as_str()?.to_owned();
            Some((name, c.get("parameters")?.to_string()))
        })
        .collect()
}

/// A whole answer, from the pieces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// The reasoning.
    pub reasoning: String,
    /// The content (outside calls and reasoning).
    pub content: String,
    /// Each call: id, name, arguments (JSON text).
    pub calls: Vec<(String, String, String)>,
}

impl Answer {
    /// Adds `pieces`.
    pub fn absorb(&mut self, pieces: Vec<Out>) {
        for p in pieces {
            match p {
                Out::Reasoning(t) => self.reasoning.push_str(&t),
                Out::Content(t) => self.content.push_str(&t),
                Out::Start { id, name, .. } => self.calls.push((id, name, String::new())),
                Out::Args { index, fragment } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.2.push_str(&fragment);
                    }
                }
            }
        }
    }

    /// The content as the message carries it: null when there are calls
    /// and nothing but whitespace around them, or reasoning and no content
    /// (vLLM's).
    pub fn content(&self) -> Option<&str> {
        let blank = self.content.trim().is_empty();
        let none = (blank && !self.calls.is_empty())
            || (self.content.is_empty() && !self.reasoning.is_empty());
        (!none).then_some(&self.content)
    }

    /// The reasoning as the message carries it: null when there was none.
    pub fn reasoning(&self) -> Option<&str> {
        (!self.reasoning.is_empty()).then_some(&self.reasoning)
    }
}

#[cfg(test)]
mod tests;
