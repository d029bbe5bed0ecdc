//! The small elementwise steps of the forward pass around its
//! projections: the MLP's gated activation, the per-head norm, biases, the
//! residual add (normed where the family says so), and logit soft-capping.

use kvmesh_kernels::activation::{geglu_tanh, swiglu, swiglu_oai};
use kvmesh_kernels::norm::rms_norm;
use rayon::prelude::*;

use crate::arch::Activation;

/// Values from which [`gated_rows`] splits its rows across the pool.
pub(super) const SWIGLU_PARALLEL: usize = 1 << 14;

/// The MLP's gated activation ([`swiglu`], [`geglu_tanh`] or
/// [`swiglu_oai`]) over whole
/// rows, in parallel from [`SWIGLU_PARALLEL`] values on (rows are
/// independent, so the bits do not change). Serial, a batch's SwiGLU left
/// the other cores idle long enough to fall asleep (16 sequences: tens of
/// microseconds per layer; a 512-token prompt chunk: a millisecond or more).
pub(crate) fn gated_rows(act: Activation, gate_up: &[f32], width: usize, out: &mut [f32]) {
    let f = |gate_up: &[f32], width: usize, out: &mut [f32]| match act {
        Activation::Silu => swiglu(gate_up, width, out),
        Activation::GeluTanh => geglu_tanh(gate_up, width, out),
        Activation::SwigluOai { alpha, limit } => swiglu_oai(gate_up, width, alpha, limit, out),
    };
    let rows = out.len() / width.max(1);
    if out.len() < SWIGLU_PARALLEL || rows < 2 {
        f(gate_up, width, out);
        return;
    }
    let per = rows.div_ceil(rayon::current_num_threads().max(1));
    gate_up
        .par_chunks(2 * width * per)
        .zip(out.par_chunks_mut(width * per))
        .for_each(|(gu, o)| f(gu, width, o));
}

/// RMSNorm over each head of `x` (rows of `weight.len()` values) in place,
/// when the family has one (Qwen3, Gemma 3); `scratch` is any free buffer.
pub(super) fn head_norm(x: &mut [f32], weight: Option<&[f32]>, eps: f32, scratch: &mut Vec<f32>) {
    if let Some(w) = weight {
        let keep = scratch.len();
        scratch.resize(keep.max(x.len()), 0.0);
        rms_norm(x, w, eps, &mut scratch[..x.len()]);
        x.copy_from_slice(&scratch[..x.len()]);
        scratch.truncate(keep);
    }
}

/// Each row of `x` plus `bias` (a row's width), where there is one.
pub(super) fn add_bias(x: &mut [f32], bias: Option<&Vec<f32>>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

/// `x += out`, or `x += rms_norm(out)` where the family norms a branch's
/// output before the residual (Gemma); `scratch` holds the normed rows.
pub(super) fn add_residual(
    x: &mut [f32],
    out: &[f32],
    norm: Option<&[f32]>,
    eps: f32,
    scratch: &mut Vec<f32>,
) {
    match norm {
        Some(w) => {
            let keep = scratch.len();
            scratch.resize(keep.max(out.len()), 0.0);
            rms_norm(out, w, eps, &mut scratch[..out.len()]);
            x.iter_mut()
                .zip(&scratch[..out.len()])
                .for_each(|(x, o)| *x += o);
            scratch.truncate(keep);
        }
        None => x.iter_mut().zip(out).for_each(|(x, o)| *x += o),
    }
}

/// Logits `l` become `cap * tanh(l / cap)` (Gemma 2's final soft-capping).
pub(super) fn softcap(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
    }
}
