//! [`StreamDecoder`]: incremental detokenization.
//!
//! A token may end in the middle of a UTF-8 character (byte-level BPE
//! splits multi-byte characters), and decoders may treat a token
//! differently at the start of a text (SentencePiece's leading space). So
//! each step decodes a small window of recent ids twice, with and without
//! the newest ones, and emits the difference only when it is complete text,
//! i.e. does not end in U+FFFD.
//!
//! Offsets: `ids[prefix..read]` were already emitted and serve as context;
//! `ids[read..]` are pending. After an emission the window slides to
//! `prefix = read, read = len`, and ids before `prefix` are dropped, so
//! memory and the cost per step stay bounded by the window.
//!
//! Special tokens are skipped, except those the caller asks to keep
//! ([`StreamDecoder::keeping`]: the markers a tool-call or reasoning
//! parser reads, such as Llama's `<|python_tag|>`). A kept token ends a
//! character for certain, so it flushes what is pending, is written as
//! its text, and starts a fresh window: the text after it is decoded as
//! the start of a text (a SentencePiece decoder may then drop the space
//! that opens it, which is layout next to a marker).

use super::TextTokenizer;
use crate::error::Result;

/// Turns generated ids into text pieces as they arrive. Special tokens are
/// skipped (except those kept). The pieces concatenate to the decoding of
/// all ids.
pub struct StreamDecoder<'a> {
    tokenizer: &'a TextTokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Special tokens written out instead of skipped.
    keep: Vec<u32>,
}

impl std::fmt::Debug for StreamDecoder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("window", &self.ids)
            .field("prefix_offset", &self.prefix_offset)
            .field("read_offset", &self.read_offset)
            .field("keep", &self.keep)
            .finish()
    }
}

impl<'a> StreamDecoder<'a> {
    pub(super) fn new(tokenizer: &'a TextTokenizer) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            keep: Vec::new(),
        }
    }

    /// Writes the special tokens `ids` out as their text instead of
    /// skipping them.
    pub fn keeping(mut self, ids: &[u32]) -> Self {
        self.keep = ids.to_vec();
        self
    }

    /// Add one id; returns the new text if it completes any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        if self.keep.contains(&id) {
            let mut text = self.emit(true)?.unwrap_or_default();
            text.push_str(&self.tokenizer.decode(&[id], false)?);
            self.ids.clear();
            self.prefix_offset = 0;
            self.read_offset = 0;
            return Ok((!text.is_empty()).then_some(text));
        }
        self.ids.push(id);
        self.emit(false)
    }

    /// Flush what is pending at the end of generation, even an incomplete
    /// character (as U+FFFD).
    pub fn finish(&mut self) -> Result<Option<String>> {
        self.emit(true)
    }

    fn emit(&mut self, flush: bool) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let prefix = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], true)?;
        if full.len() <= prefix.len() || (!flush && full.ends_with('\u{FFFD}')) {
            return Ok(None);
        }
        // The longer window normally extends the shorter one. If a decoder
        // rewrote the context, cut at the same byte length (where that is
        // a character boundary) rather than stall.
        let Some(new_text) = full.get(prefix.len()..) else {
            return Ok(None);
        };
        let new_text = new_text.to_owned();
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        Ok(Some(new_text))
    }
}
