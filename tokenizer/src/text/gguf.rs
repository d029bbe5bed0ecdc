//! A byte-level BPE [`TextTokenizer`] built from a GGUF file's vocabulary.
//!
//! GGUF keeps the pieces of a Hugging Face `tokenizer.json`, not the file:
//! `tokenizer.ggml.tokens` (id = index), `tokenizer.ggml.merges` (`"a b"`),
//! `tokenizer.ggml.token_type` and a pre-tokenizer *name*
//! (`tokenizer.ggml.pre`). The name is mapped back to the pre-tokenizer the
//! original `tokenizer.json` had:
//!
//! | `tokenizer.ggml.pre` | pre-tokenizer |
//! | --- | --- |
//! | `smollm` | Digits (one per digit), then ByteLevel with its GPT-2 regex |
//! | `gpt2` | ByteLevel with its GPT-2 regex |
//! | `default` or absent | ByteLevel with its GPT-2 regex: llama.cpp's own "default" splitting differs in corner cases, but files without a pre-tokenizer name predate the field and came from GPT-2-style tokenizers |
//! | `llama-bpe`, `llama3` | Llama 3's split regex, then ByteLevel without regex; merges ignored for whole-word tokens, as Llama 3's `tokenizer.json` says |
//!
//! Any other name is refused rather than tokenized subtly wrong.
//! Control tokens (type 3) become special added tokens, user-defined ones
//! (type 4) plain added tokens, so their text in a prompt maps to them.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::TextTokenizer;
use crate::error::{Result, TokenizerError};
use crate::gguf::GgufHeader;

/// Llama 3's pre-tokenization regex (from its `tokenizer.json`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.token_type` of control tokens (`<|im_start|>`, BOS...).
const TOKEN_TYPE_CONTROL: i64 = 3;
/// `tokenizer.ggml.token_type` of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

impl TextTokenizer {
    /// Build the tokenizer of a GGUF file (`tokenizer.ggml.model` = `gpt2`).
    pub fn from_gguf(g: &GgufHeader) -> Result<Self> {
        let model = g
            .opt_str("tokenizer.ggml.model")?
            .ok_or_else(|| g.missing_field("tokenizer.ggml.model"))?;
        if model != "gpt2" {
            return Err(g.invalid_field(
                "tokenizer.ggml.model",
                format!("{model:?}"),
                "only byte-level BPE vocabularies (gpt2) are supported; SentencePiece (llama) and \
                 WordPiece (bert) GGUF vocabularies are not",
            ));
        }
        let tokens = g
            .opt_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| g.missing_field("tokenizer.ggml.tokens"))?;
        let merges = g
            .opt_str_array("tokenizer.ggml.merges")?
            .ok_or_else(|| g.missing_field("tokenizer.ggml.merges"))?;
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
        let id = |i: usize| {
            u32::try_from(i).map_err(|_| {
                g.invalid_field(
                    "tokenizer.ggml.tokens",
                    format!("{} tokens", tokens.len()),
                    "too many",
                )
            })
        };

        // A repeated token string keeps its first id, as a tokenizer.json
        // vocabulary (a map) would have to.
        let mut vocab = Vocab::with_capacity(tokens.len());
        for (i, token) in tokens.iter().enumerate() {
            vocab.entry((*token).to_owned()).or_insert(id(i)?);
        }
        let mut merge_pairs = Vec::with_capacity(merges.len());
        for (i, merge) in merges.iter().enumerate() {
            let (a, b) = merge.split_once(' ').ok_or_else(|| {
                g.invalid_field(
                    &format!("tokenizer.ggml.merges[{i}]"),
                    format!("{merge:?}"),
                    "expected two tokens separated by a space",
                )
            })?;
            merge_pairs.push((a.to_owned(), b.to_owned()));
        }

        let pre = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
        let (pre_tokenizer, ignore_merges): (PreTokenizerWrapper, bool) = match pre {
            "smollm" => (
                Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into(),
                false,
            ),
            "gpt2" | "default" => (byte_level(true).into(), false),
            "llama-bpe" | "llama3" => {
                let split = Split::new(
                    SplitPattern::Regex(LLAMA3_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| TokenizerError::Tokenizer {
                    detail: format!("Llama 3 pre-tokenizer regex: {e}"),
                })?;
                (
                    Sequence::new(vec![split.into(), byte_level(false).into()]).into(),
                    true,
                )
            }
            other => {
                return Err(g.invalid_field(
                    "tokenizer.ggml.pre",
                    format!("{other:?}"),
                    "supported pre-tokenizers are smollm, gpt2, default, llama-bpe and llama3",
                ))
            }
        };

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merge_pairs)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| {
                TokenizerError::malformed(g.path(), format!("tokenizer.ggml.merges: {e}"))
            })?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let added = |kind: i64, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(&types)
                // An empty added token would match everywhere.
                .filter(|(token, &t)| t == kind && !token.is_empty())
                .map(|(token, _)| AddedToken::from((*token).to_owned(), special))
                .collect()
        };
        let tokenizer_err = |e: tokenizers::Error| TokenizerError::Tokenizer {
            detail: format!("adding the GGUF's added tokens: {e}"),
        };
        inner
            .add_special_tokens(added(TOKEN_TYPE_CONTROL, true))
            .map_err(tokenizer_err)?;
        inner
            .add_tokens(added(TOKEN_TYPE_USER_DEFINED, false))
            .map_err(tokenizer_err)?;

        let token_of = |key: &str| -> Result<Option<(u32, String)>> {
            match g.opt_u32(key)? {
                None => Ok(None),
                Some(id) => match tokens.get(id as usize) {
                    Some(t) => Ok(Some((id, (*t).to_owned()))),
                    None => Err(g.invalid_field(
                        key,
                        id.to_string(),
                        format!("not below the vocabulary size ({})", tokens.len()),
                    )),
                },
            }
        };
        let bos = token_of("tokenizer.ggml.bos_token_id")?;
        let eos = token_of("tokenizer.ggml.eos_token_id")?;
        let mut eos_ids: Vec<u32> = eos.iter().map(|(id, _)| *id).collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some((id, _)) = token_of(key)? {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let chat_template = g.opt_str("tokenizer.chat_template")?.map(str::to_owned);
        let (bos_id, bos_token) = bos.map_or((None, None), |(id, t)| (Some(id), Some(t)));
        Self::assemble(
            inner,
            bos_token,
            bos_id,
            eos.map(|(_, t)| t),
            eos_ids,
            add_bos,
            chat_template,
        )
    }
}
