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
//! read as in any GGUF (`moe_weights`).
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

/// Each expert's gate and up of layer `i`, split from the fused stack,
/// and their biases when `with_bias` and the file has the fused bias stack
/// (`None` otherwise: the caller reads the separate ones as for any GGUF).
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
    let stacked = take_stack(src, &name, &[experts, 2 * ff, hidden], precision)?;
    let (mut gates, mut ups) = (Vec::with_capacity(experts), Vec::with_capacity(experts));
    for j in 0..experts {
        let at = 2 * ff * j;
        gates.push(matrix_rows(&stacked, at..at + ff).map_err(bad)?);
        ups.push(matrix_rows(&stacked, at + ff..at + 2 * ff).map_err(bad)?);
    }
    let bias_name = format!("blk.{i}.ffn_gate_up_exps.bias");
    let biases = if with_bias && src.contains(&bias_name) {
        let v = to_vec1(
            &path,
            &bias_name,
            &src.take(&bias_name, &[experts, 2 * ff])?,
        )?;
        Some(
            v.chunks_exact(2 * ff.max(1))
                .map(|e| (e[..ff].to_vec(), e[ff..].to_vec()))
                .unzip(),
        )
    } else {
        None
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
