//! SentencePiece vocabularies (`tokenizer.ggml.model` = `llama`): Llama 2,
//! Mistral (v0.1 to v0.3), Phi-3, Gemma 1 to 3.
//!
//! As transformers builds them: a BPE model with byte fallback (a
//! character the vocabulary lacks becomes its UTF-8 byte tokens `<0xE4>`...)
//! whose merges come from the file's `tokenizer.ggml.merges` or, as such
//! files usually have none, are derived from the vocabulary: every way to
//! cut a token into two tokens is a merge, ranked by the token's score
//! (highest first; ties by the longer left part, then the longer right
//! part, then file order). Around it, per architecture:
//!
//! | architecture | normalizer | pre-tokenizer | decoder |
//! | --- | --- | --- | --- |
//! | Llama, Mistral, others | none | Metaspace: spaces as `▁`, one `▁` prepended at the start of the input | `▁` as space, bytes fused, the prepended space stripped |
//! | `phi3` | `▁` prepended to every piece of text between added tokens, spaces as `▁` | none | as Llama's |
//! | `gemma`, `gemma2`, `gemma3` | spaces as `▁`, nothing prepended | none in effect | `▁` as space, bytes fused |
//!
//! Gemma files differ in two ways transformers corrects for: a token of
//! spaces is stored as real spaces, while Gemma's tokenizer spells it with
//! `▁`, so whitespace tokens holding a space are respelled; and their
//! scores do not follow the merge order, the file order does, so merges
//! are ranked by id (lower first) instead of score.
//!
//! `tokenizer.ggml.add_space_prefix` (default true, as in llama.cpp) says
//! whether the `▁` is prepended; transformers' converter ignores the key
//! and always prepends for Llama and Phi-3, kvmesh honours it (llama.cpp
//! does; a file that says false was converted from a tokenizer without the
//! prefix). Gemma's tokenizer never prepends one, whatever the key says.
//!
//! Where transformers leaves the BPE without an unknown token (all but
//! Gemma), the file's `tokenizer.ggml.unknown_token_id` is used, so a
//! character whose byte tokens the vocabulary lacks becomes that token,
//! as in llama.cpp, instead of vanishing; vocabularies with all 256 byte
//! tokens never need it.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, HashSet};

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab as BpeVocab, BPE};
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{DecoderWrapper, NormalizerWrapper, SplitDelimiterBehavior};

use super::{file_merges, without_special_results, Vocab};
use crate::error::{Result, TokenizerError};
use crate::gguf::GgufHeader;

/// SentencePiece's visible space.
const SPACE: char = '\u{2581}';

/// How the architecture shapes the tokenizer around the BPE model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavour {
    Llama,
    Phi3,
    Gemma,
}

/// The SentencePiece tokenizer of the file (no added tokens yet).
pub(super) fn build(
    g: &GgufHeader,
    vocab: &Vocab<'_>,
    specials: &BTreeSet<u32>,
) -> Result<tokenizers::Tokenizer> {
    let flavour = match g.opt_str("general.architecture")?.unwrap_or("llama") {
        "gemma" | "gemma2" | "gemma3" => Flavour::Gemma,
        "phi3" => Flavour::Phi3,
        _ => Flavour::Llama,
    };
    let prefix = flavour != Flavour::Gemma
        && g.opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);

    let texts: Vec<Cow<'_, str>> = vocab
        .tokens
        .iter()
        .map(|&t| {
            if flavour == Flavour::Gemma && t.contains(' ') && t.chars().all(is_python_space) {
                Cow::Owned(SPACE.to_string().repeat(t.chars().count()))
            } else {
                Cow::Borrowed(t)
            }
        })
        .collect();
    // A repeated text keeps the last id and the place of its first
    // occurrence, as the dictionaries transformers builds do.
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(texts.len());
    let mut order: Vec<&str> = Vec::with_capacity(texts.len());
    for (i, text) in texts.iter().enumerate() {
        if ids.insert(text, i as u32).is_none() {
            order.push(text);
        }
    }

    let special_texts = vocab.special_texts(specials);
    let merges = match file_merges(g)? {
        Some(merges) => without_special_results(merges, &special_texts),
        None if flavour == Flavour::Gemma => {
            derive_merges(&order, &ids, |t| -f64::from(ids[t]), &special_texts)
        }
        None => {
            let scores = g
                .opt_f32_array("tokenizer.ggml.scores")?
                .ok_or_else(|| g.missing_field("tokenizer.ggml.scores"))?;
            if scores.len() != vocab.len() {
                return Err(g.invalid_field(
                    "tokenizer.ggml.scores",
                    format!("an array of {} values", scores.len()),
                    format!("must have one entry per token ({})", vocab.len()),
                ));
            }
            derive_merges(
                &order,
                &ids,
                |t| f64::from(scores[ids[t] as usize]),
                &special_texts,
            )
        }
    };

    let bpe_vocab: BpeVocab = ids.iter().map(|(t, &i)| ((*t).to_owned(), i)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some((_, unk)) = vocab.named(vocab.unk) {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(|e| {
        TokenizerError::malformed(g.path(), format!("SentencePiece vocabulary: {e}"))
    })?;

    let mut inner = tokenizers::Tokenizer::new(bpe);
    let spaces = Replace::new(" ", SPACE.to_string()).map_err(component_err)?;
    match flavour {
        Flavour::Llama => {
            let scheme = if prefix {
                PrependScheme::First
            } else {
                PrependScheme::Never
            };
            inner.with_pre_tokenizer(Some(Metaspace::new(SPACE, scheme, false)));
        }
        Flavour::Phi3 => {
            let mut steps: Vec<NormalizerWrapper> = Vec::new();
            if prefix {
                steps.push(Prepend::new(SPACE.to_string()).into());
            }
            steps.push(spaces.into());
            inner
                .with_normalizer(Some(NormalizerSequence::new(steps)))
                .map_err(component_err)?;
        }
        Flavour::Gemma => {
            inner.with_normalizer(Some(spaces)).map_err(component_err)?;
            // What transformers' Gemma tokenizer sets; after the
            // normalizer there is no space left for it to split at.
            let split = Split::new(
                SplitPattern::String(" ".into()),
                SplitDelimiterBehavior::MergedWithPrevious,
                false,
            )
            .map_err(component_err)?;
            inner.with_pre_tokenizer(Some(split));
        }
    }
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE.to_string(), " ")
            .map_err(component_err)?
            .into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

fn component_err(e: tokenizers::Error) -> TokenizerError {
    TokenizerError::Tokenizer {
        detail: format!("building the SentencePiece tokenizer: {e}"),
    }
}

/// Python's `str.isspace` (what transformers tests Gemma's tokens with):
/// Unicode whitespace plus the four ASCII information separators.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The merges a vocabulary implies: for each token (in `order`, skipping
/// special ones), each cut into two tokens, ranked by the token's
/// `score` (highest first), then the left part's length in characters,
/// then the right part's (longest first); equal keys keep the order of the
/// tokens, and a token's own cuts go by the ids of their parts.
fn derive_merges(
    order: &[&str],
    ids: &HashMap<&str, u32>,
    score: impl Fn(&str) -> f64,
    specials: &HashSet<&str>,
) -> Vec<(String, String)> {
    struct Cut<'a> {
        left: &'a str,
        right: &'a str,
        ids: (u32, u32),
        key: (f64, usize, usize),
    }
    let mut cuts: Vec<Cut<'_>> = Vec::new();
    for &token in order {
        if specials.contains(token) {
            continue;
        }
        let first = cuts.len();
        let token_score = score(token);
        for (at, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                cuts.push(Cut {
                    left,
                    right,
                    ids: (l, r),
                    key: (token_score, left.chars().count(), right.chars().count()),
                });
            }
        }
        cuts[first..].sort_by_key(|c| c.ids);
    }
    // Stable, descending: equal keys keep their order.
    cuts.sort_by(|a, b| {
        b.key
            .partial_cmp(&a.key)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    cuts.into_iter()
        .map(|c| (c.left.to_owned(), c.right.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_merges_rank_by_score_then_lengths_then_order() {
        // ids: a 0, b 1, c 2, ab 3, bc 4, abc 5, ca 6
        let tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"];
        let ids: HashMap<&str, u32> = tokens.iter().zip(0..).map(|(t, i)| (*t, i)).collect();
        let scores: HashMap<&str, f64> = [
            ("ab", -1.0),
            ("bc", -1.0),
            ("abc", -1.0),
            ("ca", -0.5),
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
        ]
        .into_iter()
        .collect();
        let merges = derive_merges(&tokens, &ids, |t| scores[t], &HashSet::new());
        let got: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        // ca (-0.5) first; then score -1: abc's cuts (ab|c has the longer
        // left part, so before a|bc), then ab and bc in token order.
        assert_eq!(
            got,
            [("c", "a"), ("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
        );
        let skip: HashSet<&str> = ["abc"].into_iter().collect();
        let merges = derive_merges(&tokens, &ids, |t| scores[t], &skip);
        assert!(merges.iter().all(|(a, b)| format!("{a}{b}") != "abc"));
        assert_eq!(merges.len(), 3);
    }

    #[test]
    fn python_whitespace_includes_the_information_separators() {
        assert!(is_python_space(' ') && is_python_space('\u{1f}') && is_python_space('\u{3000}'));
        assert!(!is_python_space('\u{200b}') && !is_python_space('a'));
    }
}
