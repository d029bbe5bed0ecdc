//! Structured output on an engine: the model's vocabulary as llguidance
//! reads it, built on the first constrained request (a plain engine never
//! pays for it), and grammars compiled over it.

use kvmesh_structured::{Grammar, StructuredError, Vocabulary};

use super::Engine;

impl Engine {
    /// The model's vocabulary for structured output; built once, on first
    /// use (tens of milliseconds for a large vocabulary).
    pub fn vocabulary(&self) -> Result<&Vocabulary, StructuredError> {
        self.vocabulary
            .get_or_init(|| {
                Vocabulary::new(&self.tokenizer, self.model.config().vocab_size, &self.eos)
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
