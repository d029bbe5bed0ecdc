//! [`Forward`]: the one interface the engine runs a model's pass through,
//! whatever computes it.
//!
//! Two implementations read the same description of a model
//! ([`crate::arch`]'s `Block` switches, layer types and experts): the CPU
//! pass ([`crate::llama::Llama`]) and the CUDA pass
//! ([`crate::cuda::CudaLlama`], which refuses at load the switches it does
//! not implement, by name). The engine, the scheduler and the nodes hold a
//! `dyn Forward` and never ask which one runs: a new family is a new
//! description (one file in `model/src/arch/`), and a new device is a new
//! implementation of this trait, with no change to the callers.

use kvmesh_kernels::PageRef;

use crate::error::Result;
use crate::llama::{ChunkResult, LayerDone, SeqChunk};

/// A model's forward pass on one device.
pub trait Forward: Send + Sync + std::fmt::Debug {
    /// Run a batch of chunks (each a sequence's new tokens at its
    /// positions), calling `layer_done(layer, i, &batch[i])` as soon as
    /// chunk `i`'s K/V of `layer` are in its pages (a prefill node ships
    /// each layer while the next computes). The outer `Err` fails the whole
    /// call; a guard violation or a KV write error fails only its chunk.
    fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        layer_done: &mut LayerDone<'_>,
    ) -> Result<Vec<ChunkResult>>;

    /// [`Self::forward_observed`] without an observer.
    fn forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Vec<ChunkResult>> {
        self.forward_observed(batch, &mut |_, _, _| {})
    }

    /// The kernels this pass computes with and their numerics class
    /// (`("avx512", "x86-fma")`, `("cuda:0", "cuda")`): nodes of one mesh
    /// pair only when the numerics agree.
    fn kernels(&self) -> (&str, &'static str);

    /// Whether the pass reads its KV from a copy of its own (a device's
    /// pages) rather than from the host pool: then an adopted prompt, which
    /// landed and was verified in the host pool, must be copied there with
    /// [`Self::adopt_prompt`].
    fn keeps_own_kv(&self) -> bool {
        false
    }

    /// Write positions `start..start + n` of `layer` (K and V, `n * kv_dim`
    /// values each) of an adopted prompt into `table`'s pages of the pass's
    /// own KV, through its checked write. Nothing to do for a pass that
    /// reads the host pool.
    fn adopt_prompt(
        &self,
        _table: &[PageRef],
        _start: usize,
        _n: usize,
        _layer: usize,
        _k: &[f32],
        _v: &[f32],
    ) -> Result<()> {
        Ok(())
    }
}

impl Forward for crate::llama::Llama {
    fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        layer_done: &mut LayerDone<'_>,
    ) -> Result<Vec<ChunkResult>> {
        crate::llama::Llama::forward_observed(self, batch, layer_done)
    }

    fn kernels(&self) -> (&str, &'static str) {
        (
            kvmesh_kernels::cpu::path().name(),
            kvmesh_kernels::cpu::numerics(),
        )
    }
}

impl Forward for crate::cuda::CudaLlama {
    fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        layer_done: &mut LayerDone<'_>,
    ) -> Result<Vec<ChunkResult>> {
        crate::cuda::CudaLlama::forward_observed(self, batch, layer_done)
    }

    fn kernels(&self) -> (&str, &'static str) {
        (self.device_label(), "cuda")
    }

    fn keeps_own_kv(&self) -> bool {
        true
    }

    fn adopt_prompt(
        &self,
        table: &[PageRef],
        start: usize,
        n: usize,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        self.load_prompt(table, start, n, layer, k, v)
    }
}
