//! A choice's text to its answer: content and tool calls, streamed or
//! whole through the one [`Parser`] (the whole answer is the streamed
//! pieces put together, so the two cannot disagree).
//!
//! `auto` reads Hermes blocks, `<tool_call>{"name": ..., "arguments":
//! ...}</tool_call>`: text outside blocks is content; text that could be
//! the start of `<tool_call>` is held back until it cannot (as stop
//! strings are); a block is emitted when it closes (or, unclosed, when the
//! text ends, as vLLM's Hermes parser also accepts), and a block that does
//! not parse stays text. A named function's text is that call's arguments,
//! streamed as they come; `required`'s is a JSON array parsed at the end.

use serde_json::Value;

use super::{call_id, Mode};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A piece of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// Text for the message's content.
    Content(String),
    /// A call begins: its index among the choice's calls, id and name.
    Start {
        /// 0, 1, ... in the order of the calls.
        index: usize,
        /// `call_` and random hex.
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

/// One choice's text, read as it arrives.
#[derive(Debug)]
pub struct Parser {
    mode: Mode,
    /// Text not yet emitted: a held-back prefix of `<tool_call>`, the
    /// inside of an open block, or (`required`) everything.
    buf: String,
    /// Inside a `<tool_call>` block.
    inside: bool,
    /// Calls emitted.
    calls: usize,
}

impl Parser {
    /// A parser for `mode`.
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            buf: String::new(),
            inside: false,
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
                self.buf.push_str(text);
                self.scan(parallel, &mut out);
            }
        }
        out
    }

    /// The rest of the answer, once the text has ended.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let buf = std::mem::take(&mut self.buf);
        match self.mode.clone() {
            Mode::Text => {}
            Mode::Named(name) => {
                if self.calls == 0 {
                    out.push(self.start(name));
                }
            }
            Mode::Required => match required(&buf) {
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
            },
            Mode::Auto { parallel } => {
                if self.inside {
                    self.inside = false;
                    self.block(&buf, false, parallel, &mut out);
                } else if !buf.is_empty() {
                    out.push(Out::Content(buf));
                }
            }
        }
        out
    }

    fn start(&mut self, name: String) -> Out {
        let index = self.calls;
        self.calls += 1;
        Out::Start {
            index,
            id: call_id(),
            name,
        }
    }

    /// `auto`: emits what `buf` makes certain.
    fn scan(&mut self, parallel: bool, out: &mut Vec<Out>) {
        loop {
            if self.inside {
                let Some(p) = self.buf.find(CLOSE) else {
                    return;
                };
                let body: String = self.buf[..p].to_owned();
                self.buf.drain(..p + CLOSE.len());
                self.inside = false;
                self.block(&body, true, parallel, out);
                continue;
            }
            if let Some(p) = self.buf.find(OPEN) {
                if p > 0 {
                    out.push(Out::Content(self.buf[..p].to_owned()));
                }
                self.buf.drain(..p + OPEN.len());
                self.inside = true;
                continue;
            }
            // Hold back a tail that `<tool_call>` could start with.
            let keep = kvmesh_tokenizer::stop::partial_tail(&self.buf, OPEN);
            let cut = self.buf.len() - keep;
            if cut > 0 {
                out.push(Out::Content(self.buf[..cut].to_owned()));
                self.buf.drain(..cut);
            }
            return;
        }
    }

    /// A block's body: a call, or (not a call) its text back as content.
    /// Without `parallel`, calls after the first are dropped (vLLM).
    fn block(&mut self, body: &str, closed: bool, parallel: bool, out: &mut Vec<Out>) {
        match call(body) {
            Some(_) if !parallel && self.calls > 0 => {}
            Some((name, args)) => {
                let index = self.calls;
                out.push(self.start(name));
                out.push(Out::Args {
                    index,
                    fragment: args,
                });
            }
            None => {
                let close = if closed { CLOSE } else { "" };
                out.push(Out::Content(format!("{OPEN}{body}{close}")));
            }
        }
    }
}

/// A Hermes block's body, `{"name": "...", "arguments": {...}}`: the name
/// and the arguments as JSON text.
fn call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let args = v.get("arguments")?;
    Some((name, args.to_string()))
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
    /// The content (outside calls).
    pub content: String,
    /// Each call: id, name, arguments (JSON text).
    pub calls: Vec<(String, String, String)>,
}

impl Answer {
    /// Adds `pieces`.
    pub fn absorb(&mut self, pieces: Vec<Out>) {
        for p in pieces {
            match p {
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
    /// and nothing but whitespace around them.
    pub fn content(&self) -> Option<&str> {
        (self.calls.is_empty() || !self.content.trim().is_empty()).then_some(&self.content)
    }
}

#[cfg(test)]
mod tests;
