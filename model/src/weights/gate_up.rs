//! GGUF files whose converter fused each layer's expert gate and up into
//! one stack, `blk.{i}.ffn_gate_up_exps.weight` (llama.cpp's
//! `create_tensor_gate_up_exps`: ggml shape `{hidden, 2 ff, experts}`, our
//! `[experts, 2 ff, hidden]`), read where the separate `ffn_gate_exps` is
//! absent.
//!
//! # Layout
//! Expert `j`'s rows `0 .. ff` are its gate and rows `ff .. 2 ff` its up:
//! llama.cpp's graph multiplies by the whole stack, then views the first
//! `ff` outputs of each expert as the gate and the next `ff` as the up
//! (`build_moe_ffn`). A `ffn_gate_up_exps.bias` `[experts, 2 ff]` splits
//! the same way; without one, the separate `ffn_{gate,up}_exps.bias` are
//! read.
//!
//! llama.cpp's converter writes the fused stack for Qwen3-Next, Qwen3.5
//! MoE, Gemma 4 and some others (gguf-py 0.19.0's tensor lists), not for
//! gpt-oss, whose interleaved `gate_up_proj` it splits; a file that fuses
//! it anyway (other converters, repacking tools) loads the same.
//!
//! # Cost
//! Whole rows move: a quantized stack is split by rows of blocks, never
//! widened (each expert's gate and up are copies of their byte ranges, so
//! the stack's bytes are held twice while a layer loads).

use super::*;

/// The fused stack's name in layer `i`.
pub(super) fn fused_name(i: usize) -> String {
    format!("blk.{i}.ffn_gate_up_exps.weight")
}

/// Each expert's gate and up of layer `i`, split from the fused stack, and
/// their biases when `with_bias` (the fused bias stack, or the separate
/// ones).
pub(super) fn split_gate_up(
    src: &mut dyn TensorSource,
    i: usize,
    (experts, ff, hidden): (usize, usize, usize),
    precision: Precision,
    with_bias: bool,
) -> Result<GateUp> {
    let path = src.source_path().to_owned();
    let name = fused_name(i);
    let bad = |e: candle_core::Error| ModelError::malformed(&path, format!("tensor `{name}`: {e}"));
    let stacked = match src.take_matrix(&name, &[experts, 2 * ff, hidden], precision)? {
        Matrix::Dense(t) => t
            .reshape((experts * 2 * ff, hidden))
            .map(Matrix::Dense)
            .map_err(bad)?,
        q => q,
    };
    let (mut gates, mut ups) = (Vec::with_capacity(experts), Vec::with_capacity(experts));
    for j in 0..experts {
        let at = 2 * ff * j;
        gates.push(matrix_rows(&stacked, at..at + ff).map_err(bad)?);
        ups.push(matrix_rows(&stacked, at + ff..at + 2 * ff).map_err(bad)?);
    }
    let biases = if !with_bias {
        None
    } else if src.contains(&format!("blk.{i}.ffn_gate_up_exps.bias")) {
        let bias_name = format!("blk.{i}.ffn_gate_up_exps.bias");
        let v = to_vec1(
            &path,
            &bias_name,
            &src.take(&bias_name, &[experts, 2 * ff])?,
        )?;
        let (g, u) = v
            .chunks_exact(2 * ff.max(1))
            .map(|e| (e[..ff].to_vec(), e[ff..].to_vec()))
            .unzip();
        Some((g, u))
    } else {
        let mut each = |role: &str| -> Result<ByExpert> {
            let n = format!("blk.{i}.ffn_{role}_exps.bias");
            let v = to_vec1(&path, &n, &src.take(&n, &[experts, ff])?)?;
            Ok(v.chunks_exact(ff.max(1)).map(<[f32]>::to_vec).collect())
        };
        Some((each("gate")?, each("up")?))
    };
    Ok(GateUp { gates, ups, biases })
}

/// A layer's experts' gates and ups (and their biases), in expert order.
pub(super) struct GateUp {
    pub gates: Vec<Matrix>,
    pub ups: Vec<Matrix>,
    pub biases: Option<(ByExpert, ByExpert)>,
}

/// One bias vector per expert.
pub(super) type ByExpert = Vec<Vec<f32>>;
