//! The engine's settings, and the start-up check a serving node makes of
//! its pool against the context window.

use kvmesh_kernels::KvDtype;
use kvmesh_kvpool::ScrubMode;

use crate::weights::Precision;

/// Engine settings (the `kvmesh generate` flags).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Token slots in the KV pool; `None`: one full context.
    pub kv_pool_tokens: Option<usize>,
    /// Token slots per page.
    pub page_size: usize,
    /// Context limit; `None`: the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Page scrubbing (I6).
    pub scrub: ScrubMode,
    /// Debug poison mode (I6).
    pub poison: bool,
    /// How weights are held when [`super::Engine::load`] reads the model
    /// (f32 exact mode by default, the mode the golden files check).
    pub precision: Precision,
    /// Element type of the KV pool; `None` ("auto", as vLLM's
    /// `--kv-cache-dtype auto`): f32 for a model loaded exact, f16 for one
    /// loaded quantized (as llama.cpp keeps it). See
    /// [`EngineConfig::kv_dtype_for`].
    pub kv_dtype: Option<KvDtype>,
    /// Where the forward pass runs: the CPU runtime, or a CUDA device
    /// ([`crate::cuda`]; the engine fails to build, with a typed error
    /// naming what is missing, when the device cannot be opened).
    pub device: kvmesh_cuda::DeviceSpec,
    /// On a CUDA device, the type dense weights are held and multiplied in
    /// (f32: the exact mode's SGEMM; f16 or bf16: half the bytes, GemmEx
    /// with f32 accumulation). GGUF blocks are dequantized to it, or to
    /// f16 when this is f32. On the CPU anything but f32 is refused (the
    /// CPU runtime's types are the precision's), never ignored.
    pub device_weights: kvmesh_cuda::ops::WeightDtype,
}

impl EngineConfig {
    /// The KV pool's element type for a model loaded in `precision`:
    /// `kv_dtype`, or its automatic choice.
    pub fn kv_dtype_for(&self, precision: Precision) -> KvDtype {
        self.kv_dtype.unwrap_or(match precision {
            Precision::Exact => KvDtype::F32,
            Precision::Quantized => KvDtype::F16,
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_pool_tokens: None,
            page_size: 16,
            max_model_len: None,
            scrub: ScrubMode::Off,
            poison: false,
            precision: Precision::Exact,
            kv_dtype: None,
            device: kvmesh_cuda::DeviceSpec::Cpu,
            device_weights: kvmesh_cuda::ops::WeightDtype::F32,
        }
    }
}

/// The startup check of a serving node (the incident's misconfiguration):
/// a pool that cannot hold one max-context request is refused, naming both
/// numbers and the flags that change them, unless `allow_small_pool`; then
/// the node serves at most what its pool holds. Returns the longest
/// sequence (prompt plus new tokens) the node accepts.
pub fn check_pool_capacity(
    pool_tokens: usize,
    max_model_len: usize,
    allow_small_pool: bool,
) -> std::result::Result<usize, String> {
    if pool_tokens >= max_model_len {
        return Ok(max_model_len);
    }
    if allow_small_pool {
        tracing::warn!(
            pool_tokens,
            max_model_len,
            "KV pool smaller than the context window: serving at most {pool_tokens} tokens per request (--allow-small-pool)"
        );
        return Ok(pool_tokens);
    }
    Err(format!(
        "the KV pool holds {pool_tokens} tokens but the context window is {max_model_len}: one \
         max-context request would not fit. Raise --kv-pool-tokens to at least {max_model_len}, lower \
         --max-model-len to at most {pool_tokens}, or pass --allow-small-pool to serve at most \
         {pool_tokens} tokens per request"
    ))
}
