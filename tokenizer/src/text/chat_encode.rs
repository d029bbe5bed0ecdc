//! Chat messages to token ids such that message content never becomes a
//! control token: only the special tokens the template itself writes do.
//!
//! Encoding the rendered template as one string would parse special-token
//! text anywhere in it, so a message whose content says
//! `hi<|im_end|>\n<|im_start|>system\n...` would forge a system turn. Here
//! instead:
//!
//! 1. The template is rendered twice: with the real messages, and with each
//!    non-empty content replaced by a placeholder `\u{E000}i\u{E001}` (`i`
//!    the message's index, in private-use characters no template writes),
//!    kept between the content's own leading and trailing whitespace so
//!    that `trim`, `strip` and the like act on it as on the content.
//!    Substituting each placeholder by the content it stands for (whitespace
//!    trimmed) must give back the real rendering exactly; a template that
//!    slices, re-cases or inspects the content fails that check (or mangles
//!    the placeholder) and the conversation is refused with a
//!    `ChatTemplate` error, never encoded the unsafe way. A template may
//!    drop or repeat messages: placeholders may appear any number of times.
//! 2. The text outside content (and outside the whitespace next to it) is
//!    scanned for the tokenizer's special added tokens as the `tokenizers`
//!    crate scans an input (leftmost-longest over all unnormalized added
//!    tokens, honouring `single_word`, `lstrip` and `rstrip`); those become
//!    their ids.
//! 3. The text between two such tokens, template text and content
//!    together, is one run, encoded by the tokenizer's own normalizer,
//!    pre-tokenizer and model behind a copy of its added vocabulary that
//!    treats special-token text as ordinary text (`set_encode_special_tokens`):
//!    the steps `Tokenizer::encode` takes, without a second copy of the
//!    vocabulary and merges (for a 262k-token vocabulary, ~50 MB each).
//!    Runs are exactly the pieces the `tokenizers` crate encodes separately
//!    when it splits a whole string at its special tokens, so for content
//!    without special-token text the ids equal `encode_raw` of the
//!    rendering. Position matters to one pre-tokenizer only, Metaspace with
//!    `prepend_scheme: first` (a `▁` only at the start of the input): runs
//!    after the start use a copy with `never`, as the whole-string encoding
//!    does for its later pieces (a copy of the pre-tokenizer only).
//!
//! Roles are rendered by the template as its own text, so a role containing
//! special-token text (or a placeholder character) is refused.
//!
//! Known approximations, none of which can turn content into a control
//! token: special tokens marked `normalized` are matched on the raw text
//! (the `tokenizers` crate matches them after normalization), and
//! `single_word` tells word characters by `char::is_alphanumeric` and `_`.

use std::collections::HashMap;

use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::{AddedVocabulary, Model, OffsetType, PreTokenizer, PreTokenizerWrapper};

use super::chat::Compiled;
use super::{ChatMessage, ChatOptions};
use crate::error::{Result, TokenizerError};

/// Opens a content placeholder (a private-use character).
const OPEN: char = '\u{E000}';
/// Closes a content placeholder.
const CLOSE: char = '\u{E001}';

/// The added vocabularies and pre-tokenizer [`encode`](ChatEncoder::encode)
/// needs, built once per tokenizer.
pub(super) struct ChatEncoder {
    /// The tokenizer's added vocabulary with special-token text encoded as
    /// ordinary text (its other added tokens still split the run).
    text_added: AddedVocabulary,
    /// The tokenizer's pre-tokenizer with Metaspace's `first` prepend
    /// scheme set to `never`, for runs that do not start the input; `None`
    /// when it has no such pre-tokenizer.
    pre_after_start: Option<PreTokenizerWrapper>,
    added: AddedTokens,
}

impl std::fmt::Debug for ChatEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatEncoder")
            .field("added_tokens", &self.added.len)
            .field("metaspace_first", &self.pre_after_start.is_some())
            .finish_non_exhaustive()
    }
}

impl ChatEncoder {
    pub(super) fn new(inner: &tokenizers::Tokenizer) -> Self {
        let mut text_added = inner.get_added_vocabulary().clone();
        text_added.set_encode_special_tokens(true);
        Self {
            text_added,
            pre_after_start: inner.get_pre_tokenizer().and_then(without_first_prepend),
            added: AddedTokens::new(inner),
        }
    }

    /// `messages` rendered through `template` (with the generation prompt
    /// if `add_generation_prompt`), as token ids by `tokenizer` (the one
    /// this encoder was built from); see the module documentation.
    pub(super) fn encode(
        &self,
        tokenizer: &super::TextTokenizer,
        template: &str,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        opts: ChatOptions,
    ) -> Result<Vec<u32>> {
        let inner = &tokenizer.inner;
        let (bos_token, eos_token) = (tokenizer.bos_token(), tokenizer.eos_token());
        // Tool parts a template reads are its own text: refused if they
        // hold special-token text (or a placeholder character).
        if let Some(tools) = tools {
            let mut bad = None;
            super::tools::template_text(messages, tools, &mut |s| {
                if bad.is_none() {
                    if s.contains([OPEN, CLOSE]) {
                        bad = Some("a private-use character (U+E000 or U+E001)".to_owned());
                    } else if let Some(token) = self.added.special_in(s) {
                        bad = Some(format!("the special token {token:?}"));
                    }
                }
            });
            if let Some(what) = bad {
                return Err(chat_error(format!(
                    "a tool definition or tool call contains {what}; the template writes tools \
                     as its own text, where it would become a control token"
                )));
            }
        }
        for (i, m) in messages.iter().enumerate() {
            if m.role.contains([OPEN, CLOSE]) {
                return Err(chat_error(format!(
                    "message {i}'s role contains a private-use character (U+E000 or U+E001) \
                     reserved for marking message content"
                )));
            }
            if let Some(token) = self.added.special_in(&m.role) {
                return Err(chat_error(format!(
                    "message {i}'s role contains the special token {token:?}; roles are written \
                     by the template, where it would become a control token"
                )));
            }
            // Reasoning a template reads back is its own text too.
            if let Some(r) = &m.reasoning_content {
                let bad = if r.contains([OPEN, CLOSE]) {
                    Some("a private-use character (U+E000 or U+E001)".to_owned())
                } else {
                    self.added
                        .special_in(r)
                        .map(|token| format!("the special token {token:?}"))
                };
                if let Some(what) = bad {
                    return Err(chat_error(format!(
                        "message {i}'s reasoning_content contains {what}; the template writes \
                         reasoning as its own text, where it would become a control token"
                    )));
                }
            }
        }

        let compiled = Compiled::new(template)?;
        let real = compiled.render(messages, tools, opts, bos_token, eos_token)?;
        let masked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: placeholder(i, &m.content),
                ..m.clone()
            })
            .collect();
        let rendered = compiled.render(&masked, tools, opts, bos_token, eos_token)?;

        // The rendering with content substituted back, and the byte ranges
        // of content in it (with the whitespace around the content).
        let mut full = String::with_capacity(real.len());
        let mut content: Vec<(usize, usize, &str)> = Vec::new();
        for piece in split_placeholders(&rendered, messages)? {
            match piece {
                Piece::Text(t) => full.push_str(t),
                Piece::Content(i) => {
                    let (lead, core, trail) = split_whitespace(&messages[i].content);
                    let start = if full.ends_with(lead) {
                        full.len() - lead.len()
                    } else {
                        full.len()
                    };
                    full.push_str(core);
                    content.push((start, full.len(), trail));
                }
            }
        }
        if full != real {
            return Err(chat_error(
                "the template inspects or transforms message content (its output changes when \
                 the content is replaced by a placeholder), so the content cannot be kept apart \
                 from the template's special tokens; the conversation is refused rather than \
                 encoded with content's special-token text as control tokens"
                    .into(),
            ));
        }
        let protected: Vec<(usize, usize)> = content
            .into_iter()
            .map(|(start, end, trail)| {
                let end = if full[end..].starts_with(trail) {
                    end + trail.len()
                } else {
                    end
                };
                (start, end)
            })
            .collect();

        // Special tokens of the template's own text, in order.
        let mut specials: Vec<(usize, usize, &Added)> = Vec::new();
        let mut from = 0;
        for (start, end) in protected
            .iter()
            .copied()
            .chain(std::iter::once((full.len(), full.len())))
        {
            if from < start {
                self.added.scan(&full, from, start, &mut specials);
            }
            from = from.max(end);
        }

        let mut ids = Vec::new();
        let mut prev = 0;
        for (k, &(start, end, token)) in specials.iter().enumerate() {
            let start = if token.lstrip {
                prev.max(start - trailing_whitespace(&full[..start]))
            } else {
                start
            };
            let end = if token.rstrip {
                let limit = specials.get(k + 1).map_or(full.len(), |next| next.0);
                limit.min(end + leading_whitespace(&full[end..]))
            } else {
                end
            };
            self.encode_run(inner, &full[prev..start], prev == 0, &mut ids)?;
            ids.push(token.id);
            prev = end;
        }
        self.encode_run(inner, &full[prev..], prev == 0, &mut ids)?;
        Ok(ids)
    }

    /// Append the ids of `text` by `inner`, special-token text included as
    /// ordinary text; `at_start` if it begins the input. No truncation,
    /// padding or post-processing: each run is a fragment of one input.
    fn encode_run(
        &self,
        inner: &tokenizers::Tokenizer,
        text: &str,
        at_start: bool,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let failed = |e: tokenizers::Error| TokenizerError::Tokenizer {
            detail: format!("cannot encode the chat: {e}"),
        };
        let mut pieces = self
            .text_added
            .extract_and_normalize(inner.get_normalizer(), text);
        let pre = match &self.pre_after_start {
            Some(p) if !at_start => Some(p),
            _ => inner.get_pre_tokenizer(),
        };
        if let Some(pre) = pre {
            pre.pre_tokenize(&mut pieces).map_err(failed)?;
        }
        let model = inner.get_model();
        pieces
            .tokenize(|n| model.tokenize(n.get()))
            .map_err(failed)?;
        let encoding = pieces
            .into_encoding(None, 0, OffsetType::Byte)
            .map_err(failed)?;
        ids.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}

fn chat_error(detail: String) -> TokenizerError {
    TokenizerError::ChatTemplate { detail }
}

/// What the template sees as message `i`'s content: nothing for empty
/// content (so `{% if content %}` still tests false), else the content's
/// leading whitespace, the placeholder, and its trailing whitespace.
fn placeholder(i: usize, content: &str) -> String {
    if content.is_empty() {
        return String::new();
    }
    let (lead, _, trail) = split_whitespace(content);
    format!("{lead}{OPEN}{i}{CLOSE}{trail}")
}

/// `s` as (leading whitespace, the rest trimmed, trailing whitespace);
/// all-whitespace text is all leading.
fn split_whitespace(s: &str) -> (&str, &str, &str) {
    let rest = s.trim_start();
    let lead = &s[..s.len() - rest.len()];
    let core = rest.trim_end();
    (lead, core, &rest[core.len()..])
}

enum Piece<'a> {
    /// The template's own text.
    Text(&'a str),
    /// The content of the message with this index.
    Content(usize),
}

/// `rendered` cut at its placeholders; a placeholder that is not exactly
/// one this module wrote is an error.
fn split_placeholders<'a>(rendered: &'a str, messages: &[ChatMessage]) -> Result<Vec<Piece<'a>>> {
    let mangled = || {
        chat_error(
            "the template rewrites message content (a placeholder standing for a message's \
             content came out altered: the template slices, re-cases or otherwise transforms \
             the content), so the content cannot be kept apart from the template's special \
             tokens"
                .into(),
        )
    };
    let mut pieces = Vec::new();
    let mut rest = rendered;
    while let Some(at) = rest.find([OPEN, CLOSE]) {
        if at > 0 {
            pieces.push(Piece::Text(&rest[..at]));
        }
        let body = rest[at..].strip_prefix(OPEN).ok_or_else(mangled)?;
        let digits = body.bytes().take_while(u8::is_ascii_digit).count();
        let index: usize = body[..digits].parse().map_err(|_| mangled())?;
        let tail = body[digits..].strip_prefix(CLOSE).ok_or_else(mangled)?;
        let valid = index.to_string() == body[..digits]
            && messages.get(index).is_some_and(|m| !m.content.is_empty());
        if !valid {
            return Err(mangled());
        }
        pieces.push(Piece::Content(index));
        rest = tail;
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// A copy of `pre` with every Metaspace `first` prepend scheme set to
/// `never`; `None` if it has none.
fn without_first_prepend(pre: &PreTokenizerWrapper) -> Option<PreTokenizerWrapper> {
    match pre {
        PreTokenizerWrapper::Metaspace(m) if m.get_prepend_scheme() == PrependScheme::First => {
            let mut m = m.clone();
            m.set_prepend_scheme(PrependScheme::Never);
            Some(PreTokenizerWrapper::Metaspace(m))
        }
        PreTokenizerWrapper::Sequence(seq) => {
            let mut seq = seq.clone();
            let mut changed = false;
            for p in seq.as_mut() {
                if let Some(new) = without_first_prepend(p) {
                    *p = new;
                    changed = true;
                }
            }
            changed.then_some(PreTokenizerWrapper::Sequence(seq))
        }
        _ => None,
    }
}

/// Bytes of whitespace that `s` ends with.
fn trailing_whitespace(s: &str) -> usize {
    s.len() - s.trim_end().len()
}

/// Bytes of whitespace that `s` starts with.
fn leading_whitespace(s: &str) -> usize {
    s.len() - s.trim_start().len()
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// An added token the scan looks for.
struct Added {
    text: String,
    id: u32,
    special: bool,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
}

/// The added tokens the `tokenizers` crate matches on the raw input
/// (unnormalized ones, special or not) plus normalized special ones, by
/// first byte, longest first.
struct AddedTokens {
    by_first_byte: HashMap<u8, Vec<Added>>,
    len: usize,
}

impl AddedTokens {
    fn new(inner: &tokenizers::Tokenizer) -> Self {
        let mut by_first_byte: HashMap<u8, Vec<Added>> = HashMap::new();
        let mut len = 0;
        for (id, token) in inner.get_added_tokens_decoder() {
            let Some(&first) = token.content.as_bytes().first() else {
                continue;
            };
            if !token.special && token.normalized {
                // Matched after normalization, inside a run, by `plain`.
                continue;
            }
            len += 1;
            by_first_byte.entry(first).or_default().push(Added {
                // A text two tokens share maps to the id the tokenizer uses.
                id: inner.token_to_id(&token.content).unwrap_or(id),
                text: token.content,
                special: token.special,
                single_word: token.single_word,
                lstrip: token.lstrip,
                rstrip: token.rstrip,
            });
        }
        for list in by_first_byte.values_mut() {
            list.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        }
        Self { by_first_byte, len }
    }

    /// The longest token `s` starts with.
    fn longest_prefix_of(&self, s: &str) -> Option<&Added> {
        let first = s.as_bytes().first()?;
        self.by_first_byte
            .get(first)?
            .iter()
            .find(|t| s.starts_with(&t.text))
    }

    /// The text of a special token occurring anywhere in `s`.
    fn special_in(&self, s: &str) -> Option<&str> {
        s.char_indices().find_map(|(i, _)| {
            let first = s.as_bytes()[i];
            self.by_first_byte
                .get(&first)?
                .iter()
                .find_map(|t| (t.special && s[i..].starts_with(&t.text)).then_some(t.text.as_str()))
        })
    }

    /// Push the special tokens of `full[from..to]`, found as the `tokenizers`
    /// crate finds added tokens: leftmost-longest, each match (kept or not)
    /// consuming its text; `single_word` looks at the neighbours in `full`.
    fn scan<'s>(
        &'s self,
        full: &str,
        from: usize,
        to: usize,
        out: &mut Vec<(usize, usize, &'s Added)>,
    ) {
        let mut pos = from;
        while pos < to {
            let rest = &full[pos..to];
            match self.longest_prefix_of(rest) {
                Some(token) => {
                    let end = pos + token.text.len();
                    let whole_word = !token.single_word
                        || (!full[..pos].ends_with(is_word_char)
                            && !full[end..].starts_with(is_word_char));
                    if token.special && whole_word {
                        out.push((pos, end, token));
                    }
                    pos = end;
                }
                None => pos += rest.chars().next().map_or(1, char::len_utf8),
            }
        }
    }
}

#[cfg(test)]
mod tests;
