//! kvmesh tokenizer: text to token ids and back, chat templates, stop
//! strings, and a model's metadata read without its weights. It links no
//! tensor library, no KV code and no async runtime, so the gateway can
//! tokenize without linking the model runtime.
//!
//! # Layout
//! - [`error`]: [`TokenizerError`], the one error type of this crate.
//! - [`gguf`]: [`GgufHeader`], the workspace's one GGUF parser: header,
//!   key/value metadata and tensor directory, never tensor data (the model
//!   crate reads that through the directory). Owns the invariant that no
//!   file content panics it or makes it allocate past the file's size.
//! - [`text`]: [`TextTokenizer`] (`tokenizer.json`, or built from a GGUF
//!   vocabulary: byte-level BPE with its named pre-tokenizer, or
//!   SentencePiece with scores and byte fallback, as transformers builds
//!   them), chat templates (minijinja, as transformers renders them),
//!   [`StreamDecoder`] (incremental detokenization: whole characters only). Owns the invariant that chat message content never
//!   becomes control tokens: only the special tokens a chat template itself
//!   writes do ([`TextTokenizer::encode_chat`]).
//! - [`stop`]: [`TextOut`], generated ids to client text with stop
//!   strings; owns the invariant that no emitted text contains a stop
//!   string or a prefix of one the next tokens could complete.
//! - [`info`]: [`ModelInfo::read`], what a gateway needs (tokenizer,
//!   context length, chat template, stop ids) from a GGUF header or a
//!   Hugging Face directory's JSON files, and the one definition of a
//!   model's stop ids ([`stop_token_ids`]) that the model crate uses too.
//! - `testing` (feature `testing`): fixtures for tests here and in the
//!   model crate.
#![deny(missing_docs)]

pub mod error;
pub mod gguf;
pub mod info;
pub mod stop;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod text;

pub use error::{Result, TokenizerError};
pub use gguf::{GgufHeader, GgufValue};
pub use info::{stop_token_ids, ModelInfo};
pub use stop::TextOut;
pub use text::{ChatMessage, ChatOptions, FunctionCall, StreamDecoder, TextTokenizer, ToolCall};
