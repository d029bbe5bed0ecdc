//! llama.cpp's permutation of the Q and K rows for interleaved RoPE, and
//! its inverse: GGUF rows back into Hugging Face rotate-half order.

use super::*;

/// Undo llama.cpp's permutation of Q (or K) projection rows.
///
/// llama.cpp's converter reorders each head's rows from rotate-half order
/// (`[first halves | second halves]`) to interleaved order (pairs adjacent):
/// it views the rows as `[n_head, 2, head_dim / 2]` and swaps the last two
/// axes. Undoing it views them as `[n_head, head_dim / 2, 2]` and swaps back,
/// so Hugging Face row `h * d + s * d/2 + j` is GGUF row `h * d + 2j + s`.
/// Works on a matrix `[n_head * head_dim, cols]` or a bias `[n_head * head_dim]`.
pub(crate) fn unpermute_qk_rows(
    t: &Tensor,
    n_head: usize,
    head_dim: usize,
) -> candle_core::Result<Tensor> {
    swap_row_halves(t, n_head, head_dim, [head_dim / 2, 2])
}

/// The row order that undoes llama.cpp's permutation on `rows` rows:
/// HF row `h * d + s * d/2 + j` is GGUF row `h * d + 2j + s` (the same map
/// as [`unpermute_qk_rows`], for matrices whose rows are blocks).
pub(crate) fn unpermute_order(
    rows: usize,
    n_head: usize,
    head_dim: usize,
) -> std::result::Result<Vec<usize>, String> {
    if Some(rows) != n_head.checked_mul(head_dim) || !head_dim.is_multiple_of(2) {
        return Err(format!(
            "{rows} rows cannot be {n_head} heads of {head_dim} (even) rows"
        ));
    }
    let half = head_dim / 2;
    Ok((0..rows)
        .map(|hf| {
            let (h, within) = (hf / head_dim, hf % head_dim);
            let (s, j) = (within / half, within % half);
            h * head_dim + 2 * j + s
        })
        .collect())
}

/// llama.cpp's permutation ([`unpermute_qk_rows`]'s inverse), for tests.
#[cfg(test)]
pub(crate) fn permute_qk_rows(
    t: &Tensor,
    n_head: usize,
    head_dim: usize,
) -> candle_core::Result<Tensor> {
    swap_row_halves(t, n_head, head_dim, [2, head_dim / 2])
}

pub(super) fn swap_row_halves(
    t: &Tensor,
    n_head: usize,
    head_dim: usize,
    split: [usize; 2],
) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if Some(rows) != n_head.checked_mul(head_dim) || !head_dim.is_multiple_of(2) {
        candle_core::bail!("{rows} rows cannot be {n_head} heads of {head_dim} (even) rows");
    }
    let cols: usize = dims.get(1..).unwrap_or_default().iter().product();
    t.reshape((n_head, split[0], split[1], cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}
