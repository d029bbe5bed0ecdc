//! A [`TextTokenizer`] built from a GGUF file's vocabulary, equal to what
//! transformers builds from the same file
//! (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), except where
//! transformers' converter loses what the model's own tokenizer does (the
//! submodules say where, and why).
//!
//! GGUF keeps the pieces of a tokenizer, not a `tokenizer.json`:
//! `tokenizer.ggml.tokens` (id = index), `token_type` (1 normal, 2 unknown,
//! 3 control, 4 user-defined, 5 unused, 6 byte), `scores`, `merges`, the
//! ids of BOS, EOS, UNK and padding, and names where Hugging Face has
//! components: `tokenizer.ggml.model` and `tokenizer.ggml.pre`.
//!
//! | `tokenizer.ggml.model` | built as | submodule |
//! | --- | --- | --- |
//! | `gpt2` | byte-level BPE over the file's merges, split by the pre-tokenizer `tokenizer.ggml.pre` names | `bpe`, `pre` |
//! | `llama` | SentencePiece: BPE with byte fallback over merges derived from the scores, shaped per architecture (Llama and Mistral, Phi-3, Gemma) | `spm` |
//!
//! Any other model, and a pre-tokenizer name not in `pre`'s table, is
//! refused with an `InvalidField` error naming it and what is supported,
//! rather than tokenized subtly wrong.
//!
//! Added tokens, as transformers adds them: control tokens (type 3) and the
//! tokens the file names as BOS, EOS, UNK and padding are special (their
//! text in a prompt becomes the token; chat content never does, see
//! `chat_encode`), user-defined tokens (type 4) are plain added tokens, all
//! matched on the raw text. A merge that would build a special token is
//! dropped, so that text can reach a special token only through the
//! added-token match.
//!
//! BOS and EOS: `tokenizer.ggml.add_bos_token` and `add_eos_token`, as
//! llama.cpp defaults them when absent (BOS for SentencePiece vocabularies,
//! neither for BPE); `encode` adds them, `encode_raw` and chat encoding
//! never (chat templates write their own BOS).

mod bpe;
mod pre;
mod spm;

#[cfg(any(test, feature = "testing"))]
pub(crate) use bpe::byte_chars;

use std::collections::{BTreeSet, HashSet};

use tokenizers::AddedToken;

use super::{Specials, TextTokenizer};
use crate::error::{Result, TokenizerError};
use crate::gguf::GgufHeader;

/// `tokenizer.ggml.token_type` values.
const TYPE_CONTROL: i64 = 3;
/// Control tokens that end a turn in the chat formats of the supported
/// families (ChatML's, Llama 3's, Phi-3's, Gemma's), besides the file's
/// end-of-sequence, end-of-turn and end-of-message ids.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
];
const TYPE_USER_DEFINED: i64 = 4;

/// The vocabulary-wide part of a GGUF tokenizer that every model kind
/// reads the same way.
pub(super) struct Vocab<'g> {
    tokens: Vec<&'g str>,
    /// One per token; empty when the file has none (all normal).
    types: Vec<i64>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
}

impl<'g> Vocab<'g> {
    fn read(g: &'g GgufHeader) -> Result<Self> {
        let tokens = g
            .opt_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| g.missing_field("tokenizer.ggml.tokens"))?;
        if u32::try_from(tokens.len()).is_err() {
            return Err(g.invalid_field(
                "tokenizer.ggml.tokens",
                format!("{} tokens", tokens.len()),
                "too many for 32-bit token ids",
            ));
        }
        let types = g
            .opt_int_array("tokenizer.ggml.token_type")?
            .unwrap_or_default();
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(g.invalid_field(
                "tokenizer.ggml.token_type",
                format!("an array of {} values", types.len()),
                format!("must have one entry per token ({})", tokens.len()),
            ));
        }
        let id = |key: &str| -> Result<Option<u32>> {
            match g.opt_u32(key)? {
                Some(id) if id as usize >= tokens.len() => Err(g.invalid_field(
                    key,
                    id.to_string(),
                    format!("not below the vocabulary size ({})", tokens.len()),
                )),
                other => Ok(other),
            }
        };
        Ok(Self {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            unk: id("tokenizer.ggml.unknown_token_id")?,
            pad: id("tokenizer.ggml.padding_token_id")?,
            tokens,
            types,
        })
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    fn token_type(&self, id: usize) -> i64 {
        self.types.get(id).copied().unwrap_or(1)
    }

    /// Ids of the special added tokens: control tokens and the named ones.
    fn special_ids(&self) -> BTreeSet<u32> {
        let named = [self.bos, self.eos, self.unk, self.pad];
        (0..self.len())
            .filter(|&i| self.token_type(i) == TYPE_CONTROL)
            .map(|i| i as u32)
            .chain(named.into_iter().flatten())
            .filter(|&i| !self.tokens[i as usize].is_empty())
            .collect()
    }

    /// Whether a token is an added token (matched on the raw prompt text,
    /// so kept as the file writes it).
    fn is_added(&self, id: usize, specials: &BTreeSet<u32>) -> bool {
        self.token_type(id) == TYPE_USER_DEFINED || specials.contains(&(id as u32))
    }

    /// The texts of the special tokens.
    fn special_texts(&self, specials: &BTreeSet<u32>) -> HashSet<&'g str> {
        specials.iter().map(|&i| self.tokens[i as usize]).collect()
    }

    /// `(id, text)` of a token the file names (BOS, EOS, UNK).
    fn named(&self, id: Option<u32>) -> Option<(u32, String)> {
        id.map(|id| (id, self.tokens[id as usize].to_owned()))
    }
}

/// `merges` without those that build a special token.
fn without_special_results(
    merges: Vec<(String, String)>,
    specials: &HashSet<&str>,
) -> Vec<(String, String)> {
    let mut joined = String::new();
    merges
        .into_iter()
        .filter(|(a, b)| {
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            !specials.contains(joined.as_str())
        })
        .collect()
}

/// The file's `tokenizer.ggml.merges` as pairs, if it has them.
fn file_merges(g: &GgufHeader) -> Result<Option<Vec<(String, String)>>> {
    let Some(merges) = g.opt_str_array("tokenizer.ggml.merges")? else {
        return Ok(None);
    };
    merges
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            merge
                .split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    g.invalid_field(
                        &format!("tokenizer.ggml.merges[{i}]"),
                        format!("{merge:?}"),
                        "expected two tokens separated by a space",
                    )
                })
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

impl TextTokenizer {
    /// Build the tokenizer of a GGUF file: `tokenizer.ggml.model` `gpt2`
    /// (byte-level BPE) or `llama` (SentencePiece).
    pub fn from_gguf(g: &GgufHeader) -> Result<Self> {
        let model = g
            .opt_str("tokenizer.ggml.model")?
            .ok_or_else(|| g.missing_field("tokenizer.ggml.model"))?;
        let vocab = Vocab::read(g)?;
        let specials = vocab.special_ids();
        let (mut inner, add_bos_default) = match model {
            "gpt2" => (bpe::build(g, &vocab, &specials)?, false),
            "llama" => (spm::build(g, &vocab, &specials)?, true),
            other => {
                return Err(g.invalid_field(
                    "tokenizer.ggml.model",
                    format!("{other:?}"),
                    "supported tokenizer models are gpt2 (byte-level BPE) and llama \
                     (SentencePiece); WordPiece (bert), Unigram (t5) and others are not",
                ))
            }
        };

        // Empty texts are skipped: an empty added token would match
        // everywhere.
        let special_tokens: Vec<AddedToken> = specials
            .iter()
            .map(|&i| AddedToken::from(vocab.tokens[i as usize], true).normalized(false))
            .collect();
        // A user-defined token is added only if the vocabulary holds its
        // text as written (Gemma's whitespace tokens are respelled there).
        let user_defined: Vec<AddedToken> = (0..vocab.len())
            .filter(|&i| {
                vocab.token_type(i) == TYPE_USER_DEFINED && !specials.contains(&(i as u32))
            })
            .map(|i| vocab.tokens[i])
            .filter(|t| !t.is_empty() && inner.token_to_id(t).is_some())
            .map(|t| AddedToken::from(t, false).normalized(false))
            .collect();
        let tokenizer_err = |e: tokenizers::Error| TokenizerError::Tokenizer {
            detail: format!("adding the GGUF's added tokens: {e}"),
        };
        inner
            .add_special_tokens(special_tokens)
            .map_err(tokenizer_err)?;
        inner.add_tokens(user_defined).map_err(tokenizer_err)?;

        let bos = vocab.named(vocab.bos);
        let eos = vocab.named(vocab.eos);
        let mut eos_ids: Vec<u32> = eos.iter().map(|(id, _)| *id).collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = g.opt_u32(key)? {
                if id as usize >= vocab.len() {
                    return Err(g.invalid_field(
                        key,
                        id.to_string(),
                        format!("not below the vocabulary size ({})", vocab.len()),
                    ));
                }
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        // A GGUF names one end-of-sequence token; the models' generation
        // configs (which vLLM and transformers' generate() read) also end
        // a turn at their chat formats' end-of-turn control tokens. As
        // llama.cpp does, those are found by their text.
        for (i, text) in vocab.tokens.iter().enumerate() {
            if END_OF_TURN.contains(text) && vocab.token_type(i) == TYPE_CONTROL {
                let id = i as u32;
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        let add_bos = g
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(add_bos_default);
        let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let chat_template = g.opt_str("tokenizer.chat_template")?.map(str::to_owned);
        let specials = Specials {
            bos_id: bos.as_ref().map(|(id, _)| *id),
            bos_token: bos.map(|(_, t)| t),
            add_eos: eos.as_ref().map(|(id, _)| *id).filter(|_| add_eos),
            eos_token: eos.map(|(_, t)| t),
            eos_ids,
            add_bos,
        };
        Self::assemble(inner, specials, chat_template)
    }
}

#[cfg(test)]
mod tests;
