//! kvmesh model runtime (Llama family).
//!
//! # Layout
//! - [`error`]: [`ModelError`], the one error type of this layer.
//! - [`config`]: [`ModelConfig`] from a Hugging Face `config.json` or GGUF metadata.
//! - [`weights`]: tensors loaded as f32 (exact mode), GGUF Q/K rows un-permuted.
//! - [`tokenizer`]: [`TextTokenizer`] (tokenizer.json or GGUF vocabulary),
//!   chat templates (minijinja), incremental detokenization.
//! - [`loader`]: [`load`] a model directory or GGUF file.
//! - [`default_model`]: the default model's cache and its fetch through pip.
//! - [`llama`]: the batched forward pass over the paged, checked KV pool.
//! - [`sampling`]: greedy and seeded temperature / top-k / top-p sampling.
//! - [`engine`]: the single-process reference engine (admission, prefill,
//!   batched decode steps, generation).

pub mod config;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod llama;
pub mod loader;
pub mod sampling;
pub mod tokenizer;
pub mod weights;

pub use config::ModelConfig;
pub use error::ModelError;
pub use loader::{load, LoadedModel};
pub use tokenizer::{ChatMessage, StreamDecoder, TextTokenizer};

/// A request id for responses (`cmpl-…`): 128 bits from the OS random
/// number generator, minted by the mesh (I8); `None` if the OS RNG fails.
pub fn request_id() -> Option<String> {
    kvmesh_kvxfer::wire::RequestId::mint()
        .ok()
        .map(|id| id.to_string())
}
