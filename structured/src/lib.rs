//! kvmesh structured output: what a request's output must match, compiled
//! by llguidance (the constrained-decoding library vLLM, SGLang and
//! llama.cpp use) into a mask of the tokens that may come next.
//!
//! # Layout
//! - [`Constraint`]: what a request asks for (a JSON schema, any JSON
//!   object, a regex, one of some strings, a Lark grammar), whoever made it
//!   (a client's `response_format` or `structured_outputs`, or the server
//!   itself, say a tool's parameters schema). [`Constraint::grammar`] is its
//!   one wire form: llguidance's grammar JSON, as the router sends it to the
//!   nodes.
//! - [`Vocabulary`]: the model's tokens as bytes (llguidance's token trie)
//!   and the grammar compiler over them; one per process, built from the
//!   model's `TextTokenizer` and its end-of-sequence ids.
//!   [`Vocabulary::compile`] turns a wire grammar into a [`Grammar`] or
//!   refuses it with the library's message ([`StructuredError::Refused`]).
//! - [`Matcher`]: one sequence's place in its grammar: the mask of the
//!   tokens that may come next, advanced by each token drawn.
//!
//! Invariants: a [`Grammar`] only comes from [`Vocabulary::compile`] (so it
//! compiled and its first mask was computed); a [`Matcher`] always allows
//! at least the end-of-sequence tokens once its grammar is complete or
//! broken, so a sampler under it always has a token to draw.
//!
//! JSON is compact (no whitespace between tokens, `,` and `:` separators):
//! a schema with bounded strings, arrays and numbers then has a bounded
//! output, and a model cannot stall in endless whitespace.
#![deny(missing_docs)]

mod matcher;
mod vocabulary;

pub use matcher::{Allowed, Matcher};
pub use vocabulary::{Grammar, Vocabulary};

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// Characters of a library message a refusal carries at most (llguidance's
/// verbose errors can quote a whole grammar).
const MAX_MESSAGE: usize = 800;

/// Why structured output cannot be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StructuredError {
    /// The library refused the grammar or schema: its message.
    #[error("{0}")]
    Refused(String),
    /// This model's vocabulary cannot be read as bytes (a tokenizer that is
    /// neither byte-level nor byte-fallback) or names no end of sequence.
    #[error("structured output is not available for this model: {0}")]
    Unavailable(String),
}

impl StructuredError {
    pub(crate) fn refused(e: impl std::fmt::Display) -> Self {
        Self::Refused(clip(&e.to_string()))
    }
}

fn clip(s: &str) -> String {
    if s.len() <= MAX_MESSAGE {
        return s.to_owned();
    }
    let cut = (0..=MAX_MESSAGE)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}...", &s[..cut])
}

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Constraint {
    /// A JSON value valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A string matching this regex (Rust `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect; `start` is the start rule).
    Lark(String),
}

/// The JSON options the server sets on every schema (see the crate docs):
/// compact output.
fn json_options() -> Value {
    json!({
        "whitespace_flexible": false,
        "item_separator": ",",
        "key_separator": ":",
    })
}

impl Constraint {
    /// The grammar as the nodes get it: llguidance's `TopLevelGrammar` as
    /// JSON text. A schema that is not an object, or that sets llguidance's
    /// own options (`x-guidance`, which the server owns), is refused here.
    pub fn grammar(&self) -> Result<String, StructuredError> {
        let g = match self {
            Self::JsonSchema(schema) => {
                let mut schema = schema.clone();
                match &mut schema {
                    Value::Object(m) => {
                        if m.contains_key("x-guidance") {
                            return Err(StructuredError::Refused(
                                "`x-guidance` is set by the server, not in a request's schema"
                                    .into(),
                            ));
                        }
                        m.insert("x-guidance".into(), json_options());
                    }
                    // `true` is the schema of anything, `false` of nothing.
                    Value::Bool(true) => schema = json!({"x-guidance": json_options()}),
                    _ => {
                        return Err(StructuredError::Refused(
                            "a JSON schema is an object (or `true`)".into(),
                        ))
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Self::JsonObject => TopLevelGrammar::from_json_schema(
                json!({"type": "object", "x-guidance": json_options()}),
            ),
            Self::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Self::Choice(options) => {
                if options.is_empty() {
                    return Err(StructuredError::Refused(
                        "a choice needs at least one option".into(),
                    ));
                }
                // Each option a Lark string literal: JSON string escapes are
                // Lark's, so serde_json writes them.
                let alts: Vec<String> = options
                    .iter()
                    .map(|o| Value::String(o.clone()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        serde_json::to_string(&g).map_err(StructuredError::refused)
    }
}

#[cfg(test)]
mod tests;
