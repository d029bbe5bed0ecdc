//! [`TextOut`]: generated token ids to the text a client may see, with
//! stop strings.
//!
//! Invariant: no emitted text contains a stop string or any part of one
//! that the next tokens could complete. Text is held back while its tail
//! could begin a stop string; output ends just before the first full match
//! (earliest in the text, whichever stop string it is), and the match and
//! anything after it are never emitted. This is what OpenAI's `stop`
//! promises, and it must hold across token boundaries, because a stop
//! string rarely is one token.

use crate::error::Result;
use crate::text::{StreamDecoder, TextTokenizer};

/// Bytes at the end of `text` that could be the start of `needle`: the
/// longest tail of `text` that `needle` begins with (0 when none, or when
/// `needle` is empty). What a stream holds back until it knows whether
/// `needle` follows (a stop string, a tool call's opening tag).
pub fn partial_tail(text: &str, needle: &str) -> usize {
    if needle.is_empty() {
        return 0;
    }
    text.char_indices()
        .map(|(i, _)| &text[i..])
        .find(|tail| needle.starts_with(tail))
        .map_or(0, str::len)
}

/// Incremental detokenization ([`StreamDecoder`]: whole characters only)
/// followed by stop-string matching.
#[derive(Debug)]
pub struct TextOut<'a> {
    decoder: StreamDecoder<'a>,
    stop: &'a [String],
    held: String,
    /// Ids still to push before stop strings apply (vLLM's `min_tokens`:
    /// no stop string ends generation before that many tokens).
    unarmed: usize,
}

impl<'a> TextOut<'a> {
    /// Decode with `tokenizer`, ending at the first of `stop` (empty
    /// strings are ignored).
    pub fn new(tokenizer: &'a TextTokenizer, stop: &'a [String]) -> Self {
        Self {
            decoder: tokenizer.stream_decoder(),
            stop,
            held: String::new(),
            unarmed: 0,
        }
    }

    /// Writes the special tokens `ids` out as their text instead of
    /// skipping them ([`StreamDecoder::keeping`]): the markers a request's
    /// tool-call or reasoning parser reads.
    pub fn keep(mut self, ids: &[u32]) -> Self {
        self.decoder = self.decoder.keeping(ids);
        self
    }

    /// Stop strings apply only from the `n`-th pushed id on: text before
    /// is emitted as it comes, a stop string in it included.
    pub fn min_tokens(mut self, n: usize) -> Self {
        self.unarmed = n;
        self
    }

    /// Add one generated id: the text to emit now (possibly empty), and
    /// whether a stop string was hit, in which case generation should end
    /// and nothing more be pushed.
    pub fn push(&mut self, id: u32) -> Result<(String, bool)> {
        let piece = self.decoder.push(id)?.unwrap_or_default();
        self.held.push_str(&piece);
        if self.unarmed > 0 {
            self.unarmed -= 1;
            return Ok((std::mem::take(&mut self.held), false));
        }
        Ok(self.release())
    }

    /// Generation ended without a stop string: everything still pending,
    /// text held back included (an incomplete character as U+FFFD), up to
    /// a stop string the flushed tail completes.
    pub fn finish(&mut self) -> Result<String> {
        if let Some(rest) = self.decoder.finish()? {
            self.held.push_str(&rest);
        }
        let (out, hit) = self.release();
        if hit {
            return Ok(out);
        }
        Ok(out + &std::mem::take(&mut self.held))
    }

    fn release(&mut self) -> (String, bool) {
        if let Some(at) = self
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that could begin a stop string.
        let keep = self
            .stop
            .iter()
            .map(|s| partial_tail(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        (out, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tiny_text_tokenizer;

    #[test]
    fn the_partial_tail_is_the_longest_that_could_begin_the_needle() {
        assert_eq!(partial_tail("hello <tool", "<tool_call>"), 5);
        assert_eq!(partial_tail("a <", "<tool_call>"), 1);
        assert_eq!(partial_tail("abc", "xyz"), 0);
        assert_eq!(partial_tail("abc", ""), 0);
        // Whole characters: a tail never starts inside one.
        assert_eq!(partial_tail("aé", "éx"), 2);
    }

    #[test]
    fn min_tokens_holds_stop_strings_off() {
        let t = tiny();
        let ids = t.encode_raw("abab").expect("encode");
        let stop = vec!["b".to_owned()];
        let mut out = TextOut::new(&t, &stop).min_tokens(ids.len() - 1);
        let mut text = String::new();
        let mut hit = false;
        for &id in &ids {
            let (piece, h) = out.push(id).expect("push");
            text.push_str(&piece);
            hit |= h;
            if h {
                break;
            }
        }
        assert!(hit, "the last token's stop string applies");
        assert!(
            text.starts_with("ab"),
            "stops before min_tokens did not apply: {text:?}"
        );
        assert!(
            !text.ends_with('b'),
            "the armed stop string was emitted: {text:?}"
        );
    }

    fn tiny() -> TextTokenizer {
        tiny_text_tokenizer(None, false)
    }

    #[test]
    fn kept_special_tokens_are_written_and_the_others_skipped() {
        let t = tiny();
        let start = t.token_to_id("<|im_start|>").expect("special");
        let end = t.token_to_id("<|im_end|>").expect("special");
        let mut ids = t.encode_raw("ab").expect("encode");
        ids.push(start);
        ids.extend(t.encode_raw("hello").expect("encode"));
        ids.push(end);
        ids.extend(t.encode_raw(" é").expect("encode"));
        let decode = |keep: &[u32]| {
            let mut out = TextOut::new(&t, &[]).keep(keep);
            let mut text = String::new();
            for &id in &ids {
                text.push_str(&out.push(id).expect("push").0);
            }
            text + &out.finish().expect("finish")
        };
        assert_eq!(decode(&[]), "abhello é", "specials skipped by default");
        assert_eq!(decode(&[start]), "ab<|im_start|>hello é");
        assert_eq!(decode(&[start, end]), "ab<|im_start|>hello<|im_end|> é");
        // The marker flushes: it arrives with the text before it, and the
        // text after it is decoded from a fresh window.
        let mut out = TextOut::new(&t, &[]).keep(&[start]);
        let pieces: Vec<String> = ids
            .iter()
            .map(|&id| out.push(id).expect("push").0)
            .collect();
        assert_eq!(pieces[2], "<|im_start|>");
    }

    /// Push every id of `text` (one token per byte or merge), collecting
    /// what is emitted after each, and whether and when a stop hit.
    fn run(t: &TextTokenizer, text: &str, stop: &[String]) -> (Vec<String>, Option<usize>, String) {
        let ids = t.encode_raw(text).expect("encode");
        let mut out = TextOut::new(t, stop);
        let mut pieces = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let (piece, hit) = out.push(id).expect("push");
            pieces.push(piece);
            if hit {
                return (pieces, Some(i), String::new());
            }
        }
        let rest = out.finish().expect("finish");
        (pieces, None, rest)
    }

    #[test]
    fn a_stop_string_across_tokens_ends_output_before_it() {
        let t = tiny();
        let stop = vec!["lo w".to_owned()];
        // "hello world": "hello" is one token, then " ", "w", ...
        let (pieces, hit, rest) = run(&t, "ab hello world", &stop);
        let shown: String = pieces.concat();
        assert_eq!(shown, "ab hel", "text before the match only");
        assert!(hit.is_some(), "the stop string was found");
        assert_eq!(rest, "");
        assert!(!shown.contains("lo w"));
    }

    #[test]
    fn text_that_could_begin_a_stop_string_is_held_back_then_released() {
        let t = tiny();
        let stop = vec!["xyz".to_owned()];
        let ids = t.encode_raw("axyb").expect("encode");
        let mut out = TextOut::new(&t, &stop);
        let emitted: Vec<(String, bool)> =
            ids.iter().map(|&id| out.push(id).expect("push")).collect();
        assert_eq!(
            emitted,
            vec![
                ("a".to_owned(), false),
                (String::new(), false),    // "x" could begin "xyz"
                (String::new(), false),    // "xy" too
                ("xyb".to_owned(), false)  // "xyb" cannot: released whole
            ]
        );
        assert_eq!(out.finish().expect("finish"), "");
    }

    #[test]
    fn finish_flushes_held_text_and_no_stop_means_everything() {
        let t = tiny();
        let stop = vec!["xyz".to_owned(), String::new()];
        let (pieces, hit, rest) = run(&t, "hello xy", &stop);
        assert_eq!(hit, None, "an empty stop string matches nothing");
        assert_eq!(pieces.concat(), "hello ");
        assert_eq!(rest, "xy", "the held-back prefix comes out at the end");

        let (pieces, hit, rest) = run(&t, "hello", &[]);
        assert_eq!(
            (pieces.concat(), hit, rest),
            ("hello".to_owned(), None, String::new())
        );
    }

    #[test]
    fn the_earliest_match_wins_and_multibyte_text_is_whole() {
        let t = tiny();
        let stop = vec!["world".to_owned(), "o w".to_owned()];
        let (pieces, hit, _) = run(&t, "hello world", &stop);
        assert!(hit.is_some());
        assert_eq!(pieces.concat(), "hell", "\"o w\" starts before \"world\"");

        // Byte tokens of "é" and "世": no piece ends inside a character,
        // and a stop string made of one is found.
        let stop = vec!["世".to_owned()];
        let (pieces, hit, _) = run(&t, "é世界", &stop);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        assert_eq!((pieces.concat(), hit.is_some()), ("é".to_owned(), true));
    }

    #[test]
    fn an_incomplete_character_is_flushed_as_a_replacement_that_matches_no_stop() {
        let t = tiny();
        let stop = vec!["é".to_owned()];
        // The first byte of "é" alone: held as an incomplete character by
        // the decoder, flushed by finish as U+FFFD, which is no match.
        let e = t.encode_raw("é").expect("encode");
        let mut out = TextOut::new(&t, &stop);
        assert_eq!(out.push(e[0]).expect("push"), (String::new(), false));
        assert_eq!(out.finish().expect("finish"), "\u{FFFD}");
    }
}
