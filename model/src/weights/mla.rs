//! Latent attention's weights ([`MlaWeights`]) from a `TensorSource`.
//!
//! # Layout
//! Each head's key and value maps come from one of:
//! - `kv_b_proj` (Hugging Face) or `attn_kv_b` (GGUF from llama.cpp's
//!   older converter), `[n_heads * (nope + v), kv_rank]`: head `h`'s rows
//!   `h (nope + v) .. + nope` are its key map (transposed into `k_b[h]`,
//!   `[kv_rank, nope]`), the next `v` rows its value map `v_b[h]`
//!   (`[v, kv_rank]`, as they are);
//! - `attn_k_b` and `attn_v_b` (GGUF from the current converter, which
//!   splits `kv_b_proj` per head and transposes the key half: ggml shapes
//!   `{nope, kv_rank, n_heads}` and `{kv_rank, v, n_heads}`, our
//!   `[n_heads, kv_rank, nope]` and `[n_heads, v, kv_rank]`): head `h`'s
//!   `kv_rank` rows and `v` rows of the stacks, as they are.
//!
//! A file with both reads the split stacks.
//!
//! # Cost
//! Rows move whole, so `v_b` and the split `k_b` keep a quantized file's
//! blocks; the transposed `k_b` is f32 (`n_heads x kv_rank x nope` values
//! per layer: 8 Mi for DeepSeek V3's 128 heads, 32 MiB, where its blocks
//! would be about 8 MiB in Q8_0).

use super::*;

/// Layer `i`'s latent attention projections (see the module docs).
pub(super) fn mla_weights(
    src: &mut dyn TensorSource,
    config: &ModelConfig,
    layout: Layout,
    precision: Precision,
    i: usize,
    mla: &crate::arch::mla::Mla,
) -> Result<MlaWeights> {
    let family = family_of(config)?;
    let path = src.source_path().to_owned();
    let name = |part: Part| layout.layer(family, i, part);
    let shape = |part: Part| part_shape(config, part);
    let bad = |part: Part, e: String| {
        ModelError::malformed(&path, format!("tensor `{}`: {e}", name(part)))
    };
    let vector = |src: &mut dyn TensorSource, part: Part| -> Result<Vec<f32>> {
        to_vec1(&path, &name(part), &src.take(&name(part), &shape(part))?)
    };
    let q = match mla.q_lora_rank {
        None => MlaQuery::Direct(src.take_matrix(&name(Part::Q), &shape(Part::Q), precision)?),
        Some(_) => MlaQuery::LowRank {
            a: src.take_matrix(&name(Part::QA), &shape(Part::QA), precision)?,
            norm: vector(src, Part::QANorm)?,
            b: src.take_matrix(&name(Part::QB), &shape(Part::QB), precision)?,
        },
    };
    let kv_a = src.take_matrix(&name(Part::KvA), &shape(Part::KvA), precision)?;
    let kv_a_norm = vector(src, Part::KvANorm)?;
    let (heads, kv_rank, nope, v) = (
        config.n_heads,
        mla.kv_lora_rank,
        mla.qk_nope_dim,
        mla.v_head_dim,
    );
    let split = layout == Layout::Gguf && src.contains(&name(Part::KB));
    let (k_b, v_b) = if split {
        let per_head = |src: &mut dyn TensorSource, part: Part, rows: usize| {
            let stack = take_stack(src, &name(part), &shape(part), precision)?;
            (0..heads)
                .map(|h| {
                    matrix_rows(&stack, h * rows..(h + 1) * rows)
                        .map_err(|e| bad(part, format!("splitting: {e}")))
                })
                .collect::<Result<Vec<_>>>()
        };
        (
            per_head(src, Part::KB, kv_rank)?,
            per_head(src, Part::VB, v)?,
        )
    } else {
        let kv_b = src.take_matrix(&name(Part::KvB), &shape(Part::KvB), precision)?;
        let stride = nope + v;
        // The key rows, transposed: f32 whatever the source's blocks.
        let dense = kv_b
            .to_dense()
            .and_then(|t| t.reshape((heads, stride, kv_rank)))
            .and_then(|t| t.narrow(1, 0, nope))
            .and_then(|t| t.transpose(1, 2))
            .and_then(|t| t.contiguous())
            .map_err(|e| bad(Part::KvB, format!("transposing the key rows: {e}")))?;
        let k_b = (0..heads)
            .map(|h| {
                dense
                    .get(h)
                    .and_then(|t| t.contiguous())
                    .map(Matrix::Dense)
                    .map_err(|e| bad(Part::KvB, format!("splitting: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let v_b = (0..heads)
            .map(|h| {
                let at = h * stride + nope;
                matrix_rows(&kv_b, at..at + v)
                    .map_err(|e| bad(Part::KvB, format!("splitting: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        (k_b, v_b)
    };
    Ok(MlaWeights {
        q,
        kv_a,
        kv_a_norm,
        k_b,
        v_b,
    })
}
