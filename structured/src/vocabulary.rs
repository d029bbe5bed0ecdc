//! The model's tokens as llguidance sees them, and grammars compiled over
//! them.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use kvmesh_tokenizer::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::ParserFactory;

use crate::{Matcher, StructuredError};

/// The grammar compiler over one model's vocabulary. Building it reads
/// every token's bytes and precomputes llguidance's token slices (tens of
/// milliseconds for a 150k vocabulary): done once per process, on the
/// first constrained request.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer` over logits rows of `vocab_size`
    /// entries (the model's, at least the tokenizer's; ids without a token
    /// are never allowed), ending at any of `eos` (the model's stop ids;
    /// at least one).
    pub fn new(
        tokenizer: &TextTokenizer,
        vocab_size: usize,
        eos: &[u32],
    ) -> Result<Self, StructuredError> {
        let unavailable = |m: String| StructuredError::Unavailable(m);
        let json = tokenizer
            .to_json()
            .map_err(|e| unavailable(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&json).map_err(|e| unavailable(e.to_string()))?;
        // The library's reader asserts on shapes it does not expect; a
        // model it cannot read has no structured output, and no panic.
        let mut words =
            std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
                .map_err(|_| unavailable("its tokenizer.json cannot be read as bytes".into()))?
                .map_err(|e| unavailable(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(unavailable(format!(
                "the tokenizer has {} tokens, more than the {vocab_size} logits",
                words.len()
            )));
        }
        words.resize(vocab_size, Vec::new());
        let Some(&first) = eos.first() else {
            return Err(unavailable("it names no end-of-sequence token".into()));
        };
        if let Some(&id) = eos.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(unavailable(format!(
                "end-of-sequence id {id} is outside the vocabulary"
            )));
        }
        let factory = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let info = TokRxInfo::new(vocab_size as u32, first);
            let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
            let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            ParserFactory::new_simple(&env).map(|mut f| {
                // Refusals reach the client; nothing goes to stderr.
                f.quiet();
                f
            })
        }))
        .map_err(|_| unavailable("its token trie cannot be built".into()))?
        .map_err(|e| unavailable(e.to_string()))?;
        Ok(Self {
            factory: Arc::new(factory),
            eos: eos.into(),
        })
    }

    /// The end-of-sequence ids (the first is the trie's own).
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// `grammar` (the wire form, [`crate::Constraint::grammar`]) compiled,
    /// its first mask computed; or the library's refusal.
    pub fn compile(&self, grammar: &str) -> Result<Grammar, StructuredError> {
        let top: TopLevelGrammar =
            serde_json::from_str(grammar).map_err(StructuredError::refused)?;
        let start = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let parser = self.factory.create_parser(top);
            let mut m = llguidance::Matcher::new(parser);
            m.compute_mask().map(|_| m)
        }))
        .map_err(|_| StructuredError::Refused("the grammar could not be compiled".into()))?
        .map_err(StructuredError::refused)?;
        Ok(Grammar {
            text: grammar.into(),
            start: Arc::new(start),
            eos: Arc::clone(&self.eos),
        })
    }
}

/// A compiled grammar: where every sequence under it starts. Cheap to
/// clone; equal when compiled from the same text.
#[derive(Clone)]
pub struct Grammar {
    text: Arc<str>,
    start: Arc<llguidance::Matcher>,
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("bytes", &self.text.len())
            .finish_non_exhaustive()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Grammar {
    /// The wire form it was compiled from.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// A sequence at the grammar's start.
    pub fn matcher(&self) -> Matcher {
        Matcher::new((*self.start).clone(), Arc::clone(&self.eos))
    }
}
