//! Llama 3.1 and 3.2 JSON calls: the answer, from its first character
//! (whitespace aside), is `{"name": ..., "parameters": {...}}` (or
//! `arguments`), several separated by `;`; or text, then
//! `<|python_tag|>` and such calls. Text that does not open with `{` is
//! content (a Llama answer that merely mentions JSON is not a call); an
//! object that is not a call, or does not close, is content too, and so
//! is whatever follows it. `<|python_tag|>` itself is a special token the
//! decoded text keeps for this format ([`ToolParser::markers`]); it never
//! reaches the content.

use super::json::{Scan, Step};
use super::{call_of, release_text, text, Found, ToolParser, ToolStream, MAX_GAP};

const TAG: &str = "<|python_tag|>";

/// The `llama3_json` format.
#[derive(Clone, Copy, Debug, Default)]
pub struct Llama3Json;

impl ToolParser for Llama3Json {
    fn name(&self) -> &'static str {
        "llama3_json"
    }

    /// Llama 3.1's template writes `<|python_tag|>`; 3.2's asks for
    /// `{"name": function name, "parameters": dictionary of argument name
    /// and its value}`.
    fn speaks(&self, template: &str) -> bool {
        template.contains(TAG) || template.contains("\"parameters\": dictionary of argument")
    }

    fn markers(&self) -> &'static [&'static str] {
        &[TAG]
    }

    fn stream(&self) -> Box<dyn ToolStream> {
        Box::new(Stream {
            state: State::Lead,
            buf: String::new(),
            gap: String::new(),
        })
    }
}

#[derive(Debug)]
enum State {
    /// Nothing but whitespace yet (in `buf`, with a possible start of the
    /// tag).
    Lead,
    /// Content; `buf` holds a tail that could begin the tag.
    Text,
    /// After the tag or a call, before the next object: `gap` holds the
    /// whitespace (and, after a call, one `;`) seen.
    Gap { after_call: bool, semi: bool },
    /// Inside an object, its text in `buf`.
    Object(Scan),
}

#[derive(Debug)]
struct Stream {
    state: State,
    buf: String,
    gap: String,
}

impl Stream {
    fn step(&mut self, c: char, out: &mut Vec<Found>) {
        match &mut self.state {
            State::Lead => {
                if c.is_whitespace() && self.buf.len() >= MAX_GAP && self.buf.trim().is_empty() {
                    text(out, std::mem::take(&mut self.buf));
                }
                self.buf.push(c);
                let t = self.buf.trim_start();
                if t.is_empty() || (TAG.starts_with(t) && t != TAG) {
                    return;
                }
                if t == TAG {
                    self.buf.clear();
                    self.state = State::Gap {
                        after_call: false,
                        semi: false,
                    };
                } else if t == "{" {
                    let lead = self.buf.len() - 1;
                    self.gap = self.buf.drain(..lead).collect();
                    self.state = State::Object(opened());
                } else {
                    self.state = State::Text;
                }
            }
            State::Text => {
                self.buf.push(c);
                if let Some(before) = self.buf.strip_suffix(TAG) {
                    text(out, before);
                    self.buf.clear();
                    self.state = State::Gap {
                        after_call: false,
                        semi: false,
                    };
                }
            }
            State::Gap { after_call, semi } => match c {
                c if c.is_whitespace() => {
                    if self.gap.len() >= MAX_GAP {
                        text(out, std::mem::take(&mut self.gap));
                    }
                    self.gap.push(c);
                }
                ';' if *after_call && !*semi => {
                    *semi = true;
                    self.gap.push(c);
                }
                '{' => {
                    self.buf.push(c);
                    self.state = State::Object(opened());
                }
                c => {
                    self.buf = std::mem::take(&mut self.gap);
                    self.buf.push(c);
                    self.state = State::Text;
                }
            },
            State::Object(scan) => {
                self.buf.push(c);
                if scan.feed(c) != Step::Closed(0) {
                    return;
                }
                let call = serde_json::from_str(&self.buf)
                    .ok()
                    .as_ref()
                    .and_then(call_of);
                match call {
                    Some((name, arguments)) => {
                        out.push(Found::Call { name, arguments });
                        self.buf.clear();
                        self.gap.clear();
                        self.state = State::Gap {
                            after_call: true,
                            semi: false,
                        };
                    }
                    None => {
                        // Not a call: it and all after it are content.
                        text(out, std::mem::take(&mut self.gap) + &self.buf);
                        self.buf.clear();
                        self.state = State::Text;
                    }
                }
            }
        }
    }
}

/// A scan that has read its opening `{`.
fn opened() -> Scan {
    let mut scan = Scan::default();
    scan.feed('{');
    scan
}

impl ToolStream for Stream {
    fn push(&mut self, piece: &str, out: &mut Vec<Found>) {
        for c in piece.chars() {
            self.step(c, out);
        }
        if let State::Text = self.state {
            release_text(&mut self.buf, TAG, out);
        }
    }

    fn finish(&mut self, out: &mut Vec<Found>) {
        match std::mem::replace(&mut self.state, State::Text) {
            // Markup only (the tag, separators): nothing to show.
            State::Gap { .. } => {}
            // An object cut short: text, with the gap before it.
            State::Object(_) => text(out, std::mem::take(&mut self.gap)),
            State::Lead | State::Text => {}
        }
        self.gap.clear();
        text(out, std::mem::take(&mut self.buf));
    }
}
