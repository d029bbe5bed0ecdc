//! `tokenizer.ggml.pre`: the name llama.cpp gives the pre-tokenizer of the
//! model's `tokenizer.json`, mapped back to that pre-tokenizer.
//!
//! Each family below is one split; the names are llama.cpp's
//! (`llama-vocab.cpp`). transformers' GGUF converter knows the regex-split
//! families by the same names and treats every other name as GPT-2's
//! byte-level regex. Two things it leaves out, which kvmesh keeps because
//! the model's own tokenizer and llama.cpp do them:
//!
//! - the digit split of the `smollm` family (StarCoder's, SmolLM's and
//!   Command R's `tokenizer.json`: `Sequence[Digits(individual), ByteLevel]`);
//!   without it a run of spaces before a digit and multi-digit tokens
//!   tokenize differently;
//! - Llama 3's and Tekken's whole-word lookup (`ignore_merges`: a
//!   pre-tokenized word that is itself a token is that token, as tiktoken
//!   does), which differs where no merge sequence builds such a word.
//!
//! `default` (and a file without the key) is GPT-2's byte-level regex, as
//! transformers reads it: llama.cpp's own "default" splitting differs in
//! corner cases, but files without a pre-tokenizer name predate the field
//! and came from GPT-2-style tokenizers.
//!
//! Names that need a split this table does not have (`deepseek-llm`,
//! `deepseek-coder`, `falcon`, `stablelm2`, `chameleon`, `bloom`...) are
//! refused rather than tokenized subtly wrong: they could not be checked
//! against a reference here.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Result, TokenizerError};

/// Llama 3's pre-tokenization regex (its `tokenizer.json`).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with one digit at a time.
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's: Qwen2's with combining marks kept in words.
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's Tekken (Nemo, Pixtral 12B): words split at case changes.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (o200k), which Llama 4 uses too.
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a family splits text before the byte-level mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SplitKind {
    /// GPT-2's regex, inside the ByteLevel pre-tokenizer.
    Gpt2,
    /// Each digit alone, then GPT-2's regex.
    DigitsThenGpt2,
    /// This regex (isolated matches), then the byte-level mapping.
    Regex(&'static str),
}

/// One pre-tokenizer and the names that select it.
#[derive(Debug)]
pub(super) struct Family {
    names: &'static [&'static str],
    split: SplitKind,
    /// A word that is a token as a whole is that token (no merging).
    pub(super) ignore_merges: bool,
}

const FAMILIES: [Family; 8] = [
    Family {
        names: &[
            "default",
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "exaone4",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "granite-docling",
        ],
        split: SplitKind::Gpt2,
        ignore_merges: false,
    },
    Family {
        names: &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        split: SplitKind::DigitsThenGpt2,
        ignore_merges: false,
    },
    Family {
        names: &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        split: SplitKind::Regex(LLAMA3),
        ignore_merges: true,
    },
    Family {
        names: &["dbrx", "smaug-bpe"],
        split: SplitKind::Regex(LLAMA3),
        ignore_merges: false,
    },
    Family {
        names: &["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"],
        split: SplitKind::Regex(QWEN2),
        ignore_merges: false,
    },
    Family {
        names: &["qwen35"],
        split: SplitKind::Regex(QWEN35),
        ignore_merges: false,
    },
    Family {
        names: &["tekken"],
        split: SplitKind::Regex(TEKKEN),
        ignore_merges: true,
    },
    Family {
        names: &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        split: SplitKind::Regex(GPT4O),
        ignore_merges: false,
    },
];

/// The family `name` selects.
pub(super) fn family(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.names.contains(&name))
}

/// Every supported name, comma-separated, for the refusal of another.
pub(super) fn supported_names() -> String {
    FAMILIES
        .iter()
        .flat_map(|f| f.names.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Family {
    /// The pre-tokenizer, ending in the byte-level mapping.
    pub(super) fn pre_tokenizer(&self) -> Result<PreTokenizerWrapper> {
        let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
        Ok(match self.split {
            SplitKind::Gpt2 => byte_level(true).into(),
            SplitKind::DigitsThenGpt2 => {
                Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into()
            }
            SplitKind::Regex(regex) => {
                let split = Split::new(
                    SplitPattern::Regex(regex.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| TokenizerError::Tokenizer {
                    detail: format!("the {} pre-tokenizer's regex: {e}", self.names[0]),
                })?;
                Sequence::new(vec![split.into(), byte_level(false).into()]).into()
            }
        })
    }
}
