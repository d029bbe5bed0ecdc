//! Mistral calls: `[TOOL_CALLS]` and a JSON list, `[{"name": ...,
//! "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo, Small up to 3.1);
//! or, as the v11 tokenizers write them (Small 3.2, Devstral),
//! `[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the marker is
//! content. A list becomes calls when it closes and every element is a
//! call; otherwise (or cut short) its text is content. The markers are
//! special tokens the decoded text keeps for this format; they never reach
//! the content. Call ids are 9 letters and digits: Mistral's templates
//! refuse any other id when the call comes back in the conversation.

use super::json::{Scan, Step};
use super::{call_of, release_text, text, Found, ToolParser, ToolStream, MAX_GAP};

const TAG: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
/// A v11 function name longer than this is not one.
const MAX_NAME: usize = 256;

/// The `mistral` format.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mistral;

impl ToolParser for Mistral {
    fn name(&self) -> &'static str {
        "mistral"
    }

    fn speaks(&self, template: &str) -> bool {
        template.contains(TAG)
    }

    fn markers(&self) -> &'static [&'static str] {
        &[TAG, ARGS]
    }

    fn call_id(&self) -> String {
        mistral_id()
    }

    fn stream(&self) -> Box<dyn ToolStream> {
        Box::new(Stream {
            state: State::Text,
            buf: String::new(),
            gap: String::new(),
        })
    }
}

/// 9 characters of a-z, A-Z, 0-9 (from the OS RNG; the clock if it
/// fails: an id names a call, it is not a secret).
pub(crate) fn mistral_id() -> String {
    const ALNUM: &[u8; 62] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let bytes = kvmesh_kvwire::ids::random_nonzero::<9>().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut b = [0u8; 9];
        b.copy_from_slice(&t.to_le_bytes()[..9]);
        b
    });
    bytes
        .iter()
        .map(|b| char::from(ALNUM[usize::from(*b) % ALNUM.len()]))
        .collect()
}

#[derive(Debug)]
enum State {
    /// Content; `buf` holds a tail that could begin the marker.
    Text,
    /// After the marker: `gap` holds the whitespace seen.
    Open,
    /// Inside the list, its text in `buf`.
    List(Scan),
    /// v11: the function's name so far in `buf`, maybe part of `[ARGS]`.
    Name,
    /// v11: after `name[ARGS]` (in `buf`), before the arguments' `{`.
    ArgsOpen,
    /// v11: inside the arguments (`buf`: `name[ARGS]{...`).
    Args(Scan),
}

#[derive(Debug)]
struct Stream {
    state: State,
    buf: String,
    gap: String,
}

impl Stream {
    /// What was taken for markup was not: it is content, and so is what
    /// follows until the next marker.
    fn fail(&mut self, out: &mut Vec<Found>) {
        text(out, std::mem::take(&mut self.gap) + &self.buf);
        self.buf.clear();
        self.state = State::Text;
    }

    fn step(&mut self, c: char, out: &mut Vec<Found>) {
        match &mut self.state {
            State::Text => {
                self.buf.push(c);
                if let Some(before) = self.buf.strip_suffix(TAG) {
                    text(out, before);
                    self.buf.clear();
                    self.state = State::Open;
                }
            }
            State::Open => match c {
                c if c.is_whitespace() => {
                    if self.gap.len() >= MAX_GAP {
                        text(out, std::mem::take(&mut self.gap));
                    }
                    self.gap.push(c);
                }
                '[' => {
                    self.buf.push(c);
                    let mut scan = Scan::default();
                    scan.feed(c);
                    self.state = State::List(scan);
                }
                c if name_char(c) => {
                    self.buf.push(c);
                    self.state = State::Name;
                }
                c => {
                    self.buf.push(c);
                    self.fail(out);
                }
            },
            State::List(scan) => {
                self.buf.push(c);
                if scan.feed(c) != Step::Closed(0) {
                    return;
                }
                let calls: Option<Vec<(String, String)>> =
                    match serde_json::from_str(&self.buf).ok() {
                        Some(serde_json::Value::Array(items)) if !items.is_empty() => {
                            items.iter().map(call_of).collect()
                        }
                        _ => None,
                    };
                match calls {
                    Some(calls) => {
                        for (name, arguments) in calls {
                            out.push(Found::Call { name, arguments });
                        }
                        self.buf.clear();
                        self.gap.clear();
                        self.state = State::Text;
                    }
                    None => self.fail(out),
                }
            }
            State::Name => {
                self.buf.push(c);
                if self.buf.ends_with(ARGS) {
                    self.state = State::ArgsOpen;
                    return;
                }
                let (name, rest) = self
                    .buf
                    .split_at(self.buf.find('[').unwrap_or(self.buf.len()));
                let fits =
                    name.len() <= MAX_NAME && name.chars().all(name_char) && ARGS.starts_with(rest);
                if !fits {
                    self.fail(out);
                }
            }
            State::ArgsOpen => {
                self.buf.push(c);
                if c == '{' {
                    let mut scan = Scan::default();
                    scan.feed(c);
                    self.state = State::Args(scan);
                } else if !c.is_whitespace() {
                    self.fail(out);
                }
            }
            State::Args(scan) => {
                self.buf.push(c);
                if scan.feed(c) != Step::Closed(0) {
                    return;
                }
                let call =
                    self.buf
                        .split_once(ARGS)
                        .and_then(|(name, args)| {
                            match serde_json::from_str(args.trim_start()).ok()? {
                                v @ serde_json::Value::Object(_) => {
                                    Some((name.to_owned(), v.to_string()))
                                }
                                _ => None,
                            }
                        });
                match call {
                    Some((name, arguments)) => {
                        out.push(Found::Call { name, arguments });
                        self.buf.clear();
                        self.gap.clear();
                        self.state = State::Text;
                    }
                    None => self.fail(out),
                }
            }
        }
    }
}

/// What a v11 function name is made of.
fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
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
            // The marker and nothing after it: nothing to show.
            State::Open => {}
            State::Text => text(out, std::mem::take(&mut self.buf)),
            // Cut short: the text, as content.
            State::List(_) | State::Name | State::ArgsOpen | State::Args(_) => {
                text(out, std::mem::take(&mut self.gap) + &self.buf);
            }
        }
        self.buf.clear();
        self.gap.clear();
    }
}
