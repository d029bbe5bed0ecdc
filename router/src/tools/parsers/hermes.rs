//! Hermes blocks (Hermes 2 Pro, Qwen 2.5, Qwen 3, and the gateway's own
//! rendering of tools for templates that do not read them):
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in
//! the text. Text outside blocks is content; text that could be the start
//! of `<tool_call>` is held back until it cannot be; a block becomes a
//! call when it closes (or, unclosed, when the text ends, as vLLM's Hermes
//! parser also accepts) and stays text, tags and all, when it does not
//! parse.

use super::{call_of, held_tail, text, Found, ToolParser, ToolStream};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The `hermes` format.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hermes;

impl ToolParser for Hermes {
    fn name(&self) -> &'static str {
        "hermes"
    }

    fn speaks(&self, template: &str) -> bool {
        template.contains(OPEN)
    }

    fn stream(&self) -> Box<dyn ToolStream> {
        Box::<Stream>::default()
    }
}

#[derive(Debug, Default)]
struct Stream {
    /// A held-back prefix of `<tool_call>`, or the inside of an open block.
    buf: String,
    inside: bool,
    /// Bytes of `buf` already searched for `</tool_call>` without a match
    /// (less the tag's length, which a later piece could complete), so a
    /// long block is not searched again from its start on every piece.
    searched: usize,
}

impl ToolStream for Stream {
    fn push(&mut self, piece: &str, out: &mut Vec<Found>) {
        self.buf.push_str(piece);
        loop {
            if self.inside {
                let from = floor_boundary(&self.buf, self.searched);
                let Some(p) = self.buf[from..].find(CLOSE).map(|p| p + from) else {
                    self.searched = self.buf.len().saturating_sub(CLOSE.len() - 1);
                    return;
                };
                let body = self.buf[..p].to_owned();
                self.buf.drain(..p + CLOSE.len());
                self.inside = false;
                self.searched = 0;
                block(&body, true, out);
                continue;
            }
            if let Some(p) = self.buf.find(OPEN) {
                text(out, &self.buf[..p]);
                self.buf.drain(..p + OPEN.len());
                self.inside = true;
                self.searched = 0;
                continue;
            }
            let cut = self.buf.len() - held_tail(&self.buf, &[OPEN]);
            text(out, self.buf.drain(..cut).collect::<String>());
            return;
        }
    }

    fn finish(&mut self, out: &mut Vec<Found>) {
        let buf = std::mem::take(&mut self.buf);
        if std::mem::take(&mut self.inside) {
            block(&buf, false, out);
        } else {
            text(out, buf);
        }
        self.searched = 0;
    }
}

/// A block's body: a call, or (not a call) its text back as content.
fn block(body: &str, closed: bool, out: &mut Vec<Found>) {
    match serde_json::from_str(body.trim())
        .ok()
        .as_ref()
        .and_then(call_of)
    {
        Some((name, arguments)) => out.push(Found::Call { name, arguments }),
        None => {
            let close = if closed { CLOSE } else { "" };
            text(out, format!("{OPEN}{body}{close}"));
        }
    }
}

/// The largest character boundary of `s` at or below `i`.
fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
