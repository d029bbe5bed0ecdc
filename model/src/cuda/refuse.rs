//! What the CUDA forward pass does not run, refused at load by name.

use kvmesh_cuda::CudaError;
use kvmesh_kernels::rope::RopeScaling;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// The CUDA forward pass is the Llama block with q/k/v biases and one
/// window for every layer: a model with any other [`crate::arch::Block`]
/// switch (Gemma 2's attention soft-capping among them), with sliding and
/// full layers mixed, with experts, with latent attention, or with a YaRN
/// rope that scales cos and sin, is
/// refused at load with what is missing named, never run without it.
pub(super) fn refuse_unimplemented(cfg: &ModelConfig) -> Result<()> {
    let mut missing = cfg.block.non_llama_switches(cfg.head_dim);
    let mixed = cfg.layer_types.windows(2).any(|w| w[0] != w[1]);
    if mixed || cfg.local_rope_theta.is_some() {
        missing.push("sliding-window layers mixed with full ones");
    }
    // The device rope takes the frequencies (YaRN's included) but not a
    // magnitude for cos and sin.
    if matches!(cfg.rope_scaling, RopeScaling::Yarn(y) if y.attention_factor != 1.0) {
        missing.push("YaRN's attention factor on cos and sin");
    }
    if cfg.moe.is_some() {
        missing.push("mixture-of-experts MLPs");
    }
    if cfg.mla.is_some() {
        missing.push("latent attention (MLA)");
    }
    if cfg.rotary_dim != cfg.head_dim {
        missing.push("partial rotary embeddings");
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(ModelError::Device(CudaError::Unsupported(format!(
        "the CUDA backend does not run {} models yet ({}): use --device cpu",
        cfg.family,
        missing.join(", ")
    ))))
}
