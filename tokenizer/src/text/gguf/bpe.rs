//! Byte-level BPE (`tokenizer.ggml.model` = `gpt2`): Qwen, Llama 3, SmolLM,
//! Mistral's Tekken...
//!
//! The file's tokens are written in GPT-2's byte alphabet (each byte as a
//! printable character, `Ġ` for a space) and its merges are pairs of them,
//! so the vocabulary and merges are used as they are, after the split
//! `tokenizer.ggml.pre` names (submodule `pre`). As transformers does, a
//! normal token written with characters outside the byte alphabet is
//! respelled in it (its UTF-8 bytes, each as its character) so that merges
//! can build it; added tokens (control, user-defined) keep their text, as
//! they are matched on the raw prompt.

use std::collections::BTreeSet;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab as BpeVocab, BPE};

use super::{file_merges, pre, without_special_results, Vocab};
use crate::error::{Result, TokenizerError};
use crate::gguf::GgufHeader;

/// GPT-2's byte-to-character table: printable bytes map to themselves,
/// the rest to code points from 256 up, in byte order.
pub(crate) fn byte_chars() -> [char; 256] {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut table = ['\0'; 256];
    let mut next = 256;
    for (b, slot) in (0u32..).zip(table.iter_mut()) {
        let code = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        // Every code here is below 0x200, a valid scalar value.
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// The byte-level BPE tokenizer of the file (no added tokens yet).
pub(super) fn build(
    g: &GgufHeader,
    vocab: &Vocab<'_>,
    specials: &BTreeSet<u32>,
) -> Result<tokenizers::Tokenizer> {
    let pre_name = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let family = pre::family(pre_name).ok_or_else(|| {
        g.invalid_field(
            "tokenizer.ggml.pre",
            format!("{pre_name:?}"),
            format!(
                "unknown pre-tokenizer for a byte-level BPE vocabulary; supported: {}",
                pre::supported_names()
            ),
        )
    })?;

    let table = byte_chars();
    let in_alphabet = |c: char| table.contains(&c);
    // A repeated text keeps the last id, as the dictionary transformers
    // builds from the list does.
    let mut bpe_vocab = BpeVocab::with_capacity(vocab.len());
    for (i, token) in vocab.tokens.iter().enumerate() {
        let text = if vocab.is_added(i, specials) || token.chars().all(in_alphabet) {
            (*token).to_owned()
        } else {
            token.bytes().map(|b| table[b as usize]).collect()
        };
        bpe_vocab.insert(text, i as u32);
    }
    let merges = file_merges(g)?.ok_or_else(|| g.missing_field("tokenizer.ggml.merges"))?;
    let merges = without_special_results(merges, &vocab.special_texts(specials));
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab, merges)
        .ignore_merges(family.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::malformed(g.path(), format!("tokenizer.ggml.merges: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(family.pre_tokenizer()?));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}
