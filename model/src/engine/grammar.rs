//! Structured output on an engine: the model's vocabulary as llguidance
//! reads it, built once (serving nodes build it on a blocking thread as
//! they start; `kvmesh generate` on its first constrained request, so a
//! plain run never pays for it), and grammars compiled over it.

use kvmesh_structured::{Grammar, StructuredError, Vocabulary};

use super::Engine;

impl Engine {
    /// The model's vocabulary for structured output; built once, on first
    /// use (tens of milliseconds for a large vocabulary).
    pub fn vocabulary(&self) -> Result<&Vocabulary, StructuredError> {
        self.vocabulary
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let v = Vocabulary::new(&self.tokenizer, self.model.config().vocab_size, &self.eos);
                match &v {
                    Ok(_) => tracing::info!(
                        ms = started.elapsed().as_millis() as u64,
                        "structured output: the vocabulary's token trie is built"
                    ),
                    Err(e) => tracing::warn!(error = %e, "structured output unavailable"),
                }
                v
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// `grammar` (the wire form, `kvmesh_structured::Constraint::grammar`)
    /// compiled for this model, or why not.
    pub fn compile_grammar(&self, grammar: &str) -> Result<Grammar, StructuredError> {
        self.vocabulary()?.compile(grammar)
    }
}
