//! The forward pass's activation buffers ([`Workspace`]).

use crate::mla::MlaScratch;
use crate::moe::MoeScratch;

/// A forward pass's activation buffers, kept by the model between passes so
/// a steady stream of batches allocates nothing (a fresh multi-megabyte
/// buffer per projection cost a page fault per 4 KiB: on this project's
/// virtual machines, as much time as the prompt's MLP multiply-adds). A
/// workspace is sized for the largest batch it has run: 8,448 floats per
/// token for SmolLM2 (the residual, normed, q/k/v, attention, output,
/// SwiGLU, down and stacked gate|up rows), 17 MiB for a 512-token prompt,
/// 66 MiB for a full 2,048-token prefill batch.
///
/// They belong to the model, not to the pool thread that ran the pass: kept
/// per thread, every pool thread came to hold buffers for the largest
/// prefill batch it had happened to run, one thread after another (a step
/// of resident memory each time, up to one full workspace per core), and
/// the decode node's passes kept prefill-sized buffers too.
#[derive(Default)]
pub(super) struct Workspace {
    pub(super) x: Vec<f32>,
    pub(super) xn: Vec<f32>,
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) attn: Vec<f32>,
    pub(super) o: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) down: Vec<f32>,
    pub(super) stacked: Vec<f32>,
    pub(super) logits: Vec<f32>,
    pub(super) moe: MoeScratch,
    /// Latent attention's buffers, and its mapped-out output (`o_proj`'s
    /// input).
    pub(super) mla: MlaScratch,
    pub(super) o_in: Vec<f32>,
}

impl Workspace {
    pub(super) fn floats(&self) -> usize {
        [
            &self.x,
            &self.xn,
            &self.q,
            &self.k,
            &self.v,
            &self.attn,
            &self.o,
            &self.gate,
            &self.down,
            &self.stacked,
            &self.logits,
            &self.o_in,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum::<usize>()
            + self.moe.floats()
            + self.mla.floats()
    }
}
