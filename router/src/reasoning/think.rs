//! The `<think>...</think>` reader both formats share, set by two rules:
//! whether an answer that does not open with `<think>` is reasoning all
//! the same, and whether `<tool_call>` ends reasoning.
//!
//! Reasoning is passed through verbatim (its tags dropped); the content
//! after `</think>` loses its leading whitespace (models write a blank
//! line there, which is layout, not answer).

use super::{Part, ReasoningStream};

/// Opens a reasoning block.
pub(super) const OPEN: &str = "<think>";
/// Closes it.
pub(super) const CLOSE: &str = "</think>";
/// Opens a Hermes call (Qwen's), which `tool_call_ends` makes an end of
/// reasoning too.
const TOOL_CALL: &str = "<tool_call>";
/// Leading whitespace after which `<think>` is no longer looked for: the
/// lead is held while it could still open the block, and no longer. A
/// function of the text alone, so whole and streamed agree.
pub(super) const MAX_LEAD: usize = 64;

/// How a format reads its tags.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rules {
    /// Text not opened by `<think>` is reasoning (until `</think>`).
    pub(super) implicit: bool,
    /// `<tool_call>` in reasoning ends it; the tag starts the content.
    pub(super) tool_call_ends: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace and maybe part of `<think>` yet; `opened`:
    /// the prompt opened the block.
    Lead {
        opened: bool,
    },
    Reasoning,
    /// Just after `</think>`: whitespace is dropped.
    ContentStart,
    Content,
}

/// One choice's reader.
#[derive(Debug)]
pub(super) struct Think {
    rules: Rules,
    state: State,
    /// Text not yet sorted: the lead, or a tail that could begin a tag.
    buf: String,
}

impl Think {
    pub(super) fn new(rules: Rules, opened: bool) -> Self {
        Self {
            rules,
            state: State::Lead { opened },
            buf: String::new(),
        }
    }

    /// The tags that end reasoning.
    fn ends(&self) -> &'static [&'static str] {
        if self.rules.tool_call_ends {
            &[CLOSE, TOOL_CALL]
        } else {
            &[CLOSE]
        }
    }
}

fn part(out: &mut Vec<Part>, p: fn(String) -> Part, text: &str) {
    if !text.is_empty() {
        out.push(p(text.to_owned()));
    }
}

impl ReasoningStream for Think {
    fn push(&mut self, text: &str, out: &mut Vec<Part>) {
        self.buf.push_str(text);
        loop {
            match self.state {
                State::Lead { opened } => {
                    let t = self.buf.trim_start();
                    let lead = self.buf.len() - t.len();
                    if lead > MAX_LEAD {
                        self.state = if opened || self.rules.implicit {
                            State::Reasoning
                        } else {
                            State::Content
                        };
                    } else if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_owned();
                        self.state = State::Reasoning;
                    } else if t.is_empty() || OPEN.starts_with(t) {
                        return;
                    } else if opened || self.rules.implicit {
                        self.state = State::Reasoning;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    let end = self
                        .ends()
                        .iter()
                        .filter_map(|tag| self.buf.find(tag).map(|p| (p, *tag)))
                        .min();
                    match end {
                        Some((p, CLOSE)) => {
                            part(out, Part::Reasoning, &self.buf[..p]);
                            self.buf.drain(..p + CLOSE.len());
                            self.state = State::ContentStart;
                        }
                        Some((p, _)) => {
                            // `<tool_call>`: the tag is the content's.
                            part(out, Part::Reasoning, &self.buf[..p]);
                            self.buf.drain(..p);
                            self.state = State::Content;
                        }
                        None => {
                            let held = self
                                .ends()
                                .iter()
                                .map(|t| kvmesh_tokenizer::stop::partial_tail(&self.buf, t))
                                .max()
                                .unwrap_or(0);
                            let cut = self.buf.len() - held;
                            part(out, Part::Reasoning, &self.buf[..cut]);
                            self.buf.drain(..cut);
                            return;
                        }
                    }
                }
                State::ContentStart => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        self.buf.clear();
                        return;
                    }
                    self.buf = t.to_owned();
                    self.state = State::Content;
                }
                State::Content => {
                    part(out, Part::Content, &self.buf);
                    self.buf.clear();
                    return;
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<Part>) {
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::Lead { opened } if opened || self.rules.implicit => {
                part(out, Part::Reasoning, &buf);
            }
            State::Lead { .. } | State::Content => part(out, Part::Content, &buf),
            State::Reasoning => part(out, Part::Reasoning, &buf),
            State::ContentStart => {}
        }
    }
}
