//! [`Weights`] built from a `TensorSource`: the dense parts, the fused
//! tensors split, the mixtures' experts (stacked in GGUF, fused in some
//! Hugging Face checkpoints); latent attention's in `super::mla`.

use super::*;

/// Rows `range` of a matrix (splitting Phi-3's fused tensors: blocks are
/// whole rows, so a quantized matrix splits without dequantizing).
pub(super) fn matrix_rows(
    m: &Matrix,
    range: std::ops::Range<usize>,
) -> candle_core::Result<Matrix> {
    match m {
        Matrix::Dense(t) => t
            .narrow(0, range.start, range.len())
            .and_then(|t| t.contiguous())
            .map(Matrix::Dense),
        Matrix::Quant(q) => {
            let row_bytes = q.byte_len() / q.rows().max(1);
            let bytes = q.bytes()[range.start * row_bytes..range.end * row_bytes].to_vec();
            QMatrix::from_bytes(q.format(), range.len(), q.cols(), bytes)
                .map(|q| Matrix::Quant(Arc::new(q)))
                .map_err(|e| candle_core::Error::Msg(e.to_string()))
        }
    }
}

/// Build [`Weights`] from a source: GGUF's q/k rows un-permuted where the
/// family's converter permuted them, fused tensors split, Gemma's Hugging
/// Face norms offset by one.
pub(super) fn assemble(
    src: &mut dyn TensorSource,
    config: &ModelConfig,
    layout: Layout,
    precision: Precision,
) -> Result<Weights> {
    let family = family_of(config)?;
    let (v, h) = (config.vocab_size, config.hidden_size);
    let path = src.source_path().to_owned();
    let norm_offset = match layout {
        Layout::Hf => family.hf_norm_offset,
        Layout::Gguf => 0.0,
    };
    let embed = src.take_matrix(layout.embed(), &[v, h], precision)?;
    let mut layers = Vec::new();
    for i in 0..config.n_layers {
        let name = |part: Part| layout.layer(family, i, part);
        let malformed = |part: Part, e: String| {
            ModelError::malformed(&path, format!("tensor `{}`: {e}", name(part)))
        };
        let attn = match &config.mla {
            Some(mla) => AttnWeights::Latent(Box::new(super::mla::mla_weights(
                src, config, layout, precision, i, mla,
            )?)),
            None => AttnWeights::Gqa(gqa_weights(src, config, layout, precision, i)?),
        };
        let mut take = |part: Part| src.take(&name(part), &part_shape(config, part));
        let mut norm = |part: Part| -> Result<Vec<f32>> {
            let mut w = to_vec1(&path, &name(part), &take(part)?)?;
            if norm_offset != 0.0 {
                w.iter_mut().for_each(|x| *x += norm_offset);
            }
            Ok(w)
        };
        let mut opt_norm = |on: bool, part: Part| on.then(|| norm(part)).transpose();
        let post_attn_norm = opt_norm(config.block.sandwich_norms, Part::PostAttnNorm)?;
        let post_mlp_norm = opt_norm(config.block.sandwich_norms, Part::PostMlpNorm)?;
        let attn_norm = norm(Part::AttnNorm)?;
        let mlp_norm = norm(Part::MlpNorm)?;
        let mut vector = |on: bool, part: Part| -> Result<Option<Vec<f32>>> {
            if !on {
                return Ok(None);
            }
            to_vec1(&path, &name(part), &take(part)?).map(Some)
        };
        let bo = vector(config.block.o_bias, Part::OBias)?;
        let sinks = vector(config.block.attn_sinks, Part::Sinks)?;
        let mut matrix =
            |part: Part| src.take_matrix(&name(part), &part_shape(config, part), precision);
        let wo = matrix(Part::O)?;
        let ffn = match config.moe.as_ref().filter(|m| m.is_sparse(i)) {
            Some(moe) => Ffn::Moe(moe_weights(src, config, layout, precision, i, moe)?),
            None if family.fused => {
                let ff = config.intermediate_size;
                let gate_up = matrix(Part::GateUp)?;
                let split = |r: std::ops::Range<usize>| {
                    matrix_rows(&gate_up, r)
                        .map_err(|e| malformed(Part::GateUp, format!("splitting: {e}")))
                };
                Ffn::Dense(Mlp {
                    gate: split(0..ff)?,
                    up: split(ff..2 * ff)?,
                    down: matrix(Part::Down)?,
                    bias: None,
                })
            }
            None => Ffn::Dense(Mlp {
                gate: matrix(Part::Gate)?,
                up: matrix(Part::Up)?,
                down: matrix(Part::Down)?,
                bias: None,
            }),
        };
        layers.push(LayerWeights {
            attn_norm,
            attn,
            wo,
            bo,
            sinks,
            post_attn_norm,
            mlp_norm,
            post_mlp_norm,
            ffn,
        });
    }
    let mut final_norm = to_vec1(
        &path,
        layout.final_norm(),
        &src.take(layout.final_norm(), &[h])?,
    )?;
    if norm_offset != 0.0 {
        final_norm.iter_mut().for_each(|x| *x += norm_offset);
    }
    let lm_head = if config.tie_word_embeddings {
        embed.clone()
    } else {
        src.take_matrix(layout.lm_head(), &[v, h], precision)?
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// Layer `i`'s q/k/v projections, their biases and head norms: GGUF's
/// q/k rows (and biases) un-permuted where the family's converter
/// permuted them, Phi-3's fused q/k/v split by rows.
fn gqa_weights(
    src: &mut dyn TensorSource,
    config: &ModelConfig,
    layout: Layout,
    precision: Precision,
    i: usize,
) -> Result<GqaWeights> {
    let family = family_of(config)?;
    let path = src.source_path().to_owned();
    let norm_offset = match layout {
        Layout::Hf => family.hf_norm_offset,
        Layout::Gguf => 0.0,
    };
    let name = |part: Part| layout.layer(family, i, part);
    let malformed = |part: Part, e: String| {
        ModelError::malformed(&path, format!("tensor `{}`: {e}", name(part)))
    };
    let permuted = layout == Layout::Gguf && family.gguf_qk_permuted;
    // GGUF stores Q and K (and their biases) permuted for interleaved
    // rope in the `llama` architecture.
    let qk = |t: Tensor, part: Part, heads: usize| {
        if !permuted {
            return Ok(t);
        }
        unpermute_qk_rows(&t, heads, config.head_dim)
            .map_err(|e| malformed(part, format!("un-permuting: {e}")))
    };
    let qk_matrix = |m: Matrix, part: Part, heads: usize| match m {
        m if !permuted => Ok(m),
        Matrix::Dense(t) => qk(t, part, heads).map(Matrix::Dense),
        Matrix::Quant(q) => {
            let order = unpermute_order(q.rows(), heads, config.head_dim)
                .map_err(|e| malformed(part, format!("un-permuting: {e}")))?;
            Ok(Matrix::Quant(Arc::new(q.permute_rows(&order))))
        }
    };
    let mut take = |part: Part| src.take(&name(part), &part_shape(config, part));
    let (bq, bk, bv) = if config.attention_bias {
        let bq = qk(take(Part::QBias)?, Part::QBias, config.n_heads)?;
        let bk = qk(take(Part::KBias)?, Part::KBias, config.n_kv_heads)?;
        (
            Some(to_vec1(&path, &name(Part::QBias), &bq)?),
            Some(to_vec1(&path, &name(Part::KBias), &bk)?),
            Some(to_vec1(&path, &name(Part::VBias), &take(Part::VBias)?)?),
        )
    } else {
        (None, None, None)
    };
    let mut norm = |on: bool, part: Part| -> Result<Option<Vec<f32>>> {
        if !on {
            return Ok(None);
        }
        let mut w = to_vec1(&path, &name(part), &take(part)?)?;
        if norm_offset != 0.0 {
            w.iter_mut().for_each(|x| *x += norm_offset);
        }
        Ok(Some(w))
    };
    let q_norm = norm(config.block.qk_norm, Part::QNorm)?;
    let k_norm = norm(config.block.qk_norm, Part::KNorm)?;
    let mut matrix =
        |part: Part| src.take_matrix(&name(part), &part_shape(config, part), precision);
    let (wq, wk, wv) = if family.fused {
        let (q, kv) = (config.q_dim(), config.kv_dim());
        let qkv = matrix(Part::Qkv)?;
        let split = |r: std::ops::Range<usize>| {
            matrix_rows(&qkv, r).map_err(|e| malformed(Part::Qkv, format!("splitting: {e}")))
        };
        (split(0..q)?, split(q..q + kv)?, split(q + kv..q + 2 * kv)?)
    } else {
        (
            qk_matrix(matrix(Part::Q)?, Part::Q, config.n_heads)?,
            qk_matrix(matrix(Part::K)?, Part::K, config.n_kv_heads)?,
            matrix(Part::V)?,
        )
    };
    Ok(GqaWeights {
        wq,
        wk,
        wv,
        bq,
        bk,
        bv,
        q_norm,
        k_norm,
    })
}

/// A GGUF stack `[experts, rows, cols]` as one matrix of all its rows
/// (quantized stacks are read that way already; a dense one is reshaped),
/// for splitting by whole rows.
pub(super) fn take_stack(
    src: &mut dyn TensorSource,
    name: &str,
    shape: &[usize],
    precision: Precision,
) -> Result<Matrix> {
    Ok(match src.take_matrix(name, shape, precision)? {
        Matrix::Dense(t) => t
            .reshape((shape[0] * shape[1], shape[2]))
            .map(Matrix::Dense)
            .map_err(|e| {
                ModelError::malformed(src.source_path(), format!("tensor `{name}`: {e}"))
            })?,
        q => q,
    })
}

/// Layer `i`'s router, experts and shared expert. A Hugging Face
/// checkpoint names each expert's matrices; GGUF stacks each role into one
/// `[experts, rows, cols]` tensor (or gate and up into one, `gate_up`),
/// split here into the experts' row ranges (whole rows of blocks, so
/// quantized experts stay quantized).
pub(super) fn moe_weights(
    src: &mut dyn TensorSource,
    config: &ModelConfig,
    layout: Layout,
    precision: Precision,
    i: usize,
    moe: &crate::arch::moe::Moe,
) -> Result<MoeWeights> {
    let family = family_of(config)?;
    let path = src.source_path().to_owned();
    let one = |src: &mut dyn TensorSource, part: Part| -> Result<Matrix> {
        let (name, shape) = layout.layer_tensors(family, config, i, part).remove(0);
        src.take_matrix(&name, &shape, precision)
    };
    let experts_of = |src: &mut dyn TensorSource, part: Part| -> Result<Vec<Matrix>> {
        let tensors = layout.layer_tensors(family, config, i, part);
        if layout == Layout::Hf {
            return tensors
                .iter()
                .map(|(name, shape)| src.take_matrix(name, shape, precision))
                .collect();
        }
        let (name, shape) = &tensors[0];
        let rows = shape[1];
        let stacked = take_stack(src, name, shape, precision)?;
        (0..moe.n_experts)
            .map(|j| {
                matrix_rows(&stacked, j * rows..(j + 1) * rows).map_err(|e| {
                    ModelError::malformed(&path, format!("tensor `{name}`: splitting: {e}"))
                })
            })
            .collect()
    };
    // Each expert's bias of a role: one `[rows]` tensor per expert, or
    // GGUF's `[experts, rows]` stack split by rows.
    let biases_of = |src: &mut dyn TensorSource, part: Part| -> Result<Vec<Vec<f32>>> {
        let tensors = layout.layer_tensors(family, config, i, part);
        let mut out = Vec::with_capacity(moe.n_experts);
        for (name, shape) in &tensors {
            let v = to_vec1(&path, name, &src.take(name, shape)?)?;
            let rows = shape.last().copied().unwrap_or(0).max(1);
            out.extend(v.chunks_exact(rows).map(<[f32]>::to_vec));
        }
        Ok(out)
    };
    let vector = |src: &mut dyn TensorSource, on: bool, part: Part| -> Result<Option<Vec<f32>>> {
        if !on {
            return Ok(None);
        }
        let (name, shape) = layout.layer_tensors(family, config, i, part).remove(0);
        Ok(Some(to_vec1(&path, &name, &src.take(&name, &shape)?)?))
    };
    let router = one(src, Part::Router)?;
    let router_bias = vector(src, moe.correction_bias, Part::RouterBias)?;
    let logit_bias = vector(src, moe.router_bias, Part::RouterLogitBias)?;
    let experts = if layout == Layout::Hf && family.hf_fused_experts {
        fused_hf_experts(src, config, family, i, moe)?
    } else {
        // A GGUF whose converter fused gate and up (see `gate_up`): split
        // by rows, the separate stacks' names unused.
        let fused = layout == Layout::Gguf
            && !src.contains(&layout.layer(family, i, Part::ExpertGate))
            && src.contains(&super::gate_up::fused_name(i));
        let (gates, ups, gate_up_bias) = if fused {
            let dims = (moe.n_experts, moe.expert_ff, config.hidden_size);
            let g = super::gate_up::split_gate_up(src, i, dims, precision, moe.expert_bias)?;
            (g.gates, g.ups, g.biases)
        } else {
            let gates = experts_of(src, Part::ExpertGate)?;
            (gates, experts_of(src, Part::ExpertUp)?, None)
        };
        let downs = experts_of(src, Part::ExpertDown)?;
        let mut biases: Vec<Option<MlpBias>> = vec![None; moe.n_experts];
        if moe.expert_bias {
            let (g, u) = match gate_up_bias {
                Some(gu) => gu,
                None => (
                    biases_of(src, Part::ExpertGateBias)?,
                    biases_of(src, Part::ExpertUpBias)?,
                ),
            };
            let d = biases_of(src, Part::ExpertDownBias)?;
            for (b, ((gate, up), down)) in biases.iter_mut().zip(g.into_iter().zip(u).zip(d)) {
                *b = Some(MlpBias { gate, up, down });
            }
        }
        gates
            .into_iter()
            .zip(ups)
            .zip(downs)
            .zip(biases)
            .map(|(((gate, up), down), bias)| Mlp {
                gate,
                up,
                down,
                bias,
            })
            .collect()
    };
    let shared = match moe.shared_ff {
        Some(_) => Some(Mlp {
            gate: one(src, Part::SharedGate)?,
            up: one(src, Part::SharedUp)?,
            down: one(src, Part::SharedDown)?,
            bias: None,
        }),
        None => None,
    };
    let shared_gate = if moe.shared_gate {
        let name = layout.layer(family, i, Part::SharedRouter);
        let h = config.hidden_size;
        // `[1, hidden]` as transformers saves it; llama.cpp reads it as a
        // vector, and a GGUF may store it as one.
        let t = match src.take(&name, &[1, h]) {
            Err(ModelError::ShapeMismatch { .. }) if layout == Layout::Gguf => {
                src.take(&name, &[h])?
            }
            r => r?,
        };
        Some(to_vec1(&path, &name, &t)?)
    } else {
        None
    };
    Ok(MoeWeights {
        router,
        router_bias,
        logit_bias,
        experts,
        shared,
        shared_gate,
    })
}

/// Layer `i`'s experts from a checkpoint that fuses them
/// ([`Family::hf_fused_experts`]): expert `j`'s gate row `r` is column
/// `2r` of `gate_up_proj[j]`, its up row `r` column `2r + 1`, its down
/// matrix `down_proj[j]` transposed; the biases split the same way. Always
/// f32 (a Hugging Face checkpoint loads in the exact mode).
pub(super) fn fused_hf_experts(
    src: &mut dyn TensorSource,
    config: &ModelConfig,
    family: &Family,
    i: usize,
    moe: &crate::arch::moe::Moe,
) -> Result<Vec<Mlp>> {
    let path = src.source_path().to_owned();
    let (e, h, ff) = (moe.n_experts, config.hidden_size, moe.expert_ff);
    let mut take = |part: Part| -> Result<(String, Vec<f32>)> {
        let (name, shape) = Layout::Hf.layer_tensors(family, config, i, part).remove(0);
        let v = to_vec1(&path, &name, &src.take(&name, &shape)?)?;
        Ok((name, v))
    };
    let (gate_up_name, gate_up) = take(Part::ExpertGate)?;
    let (down_name, down) = take(Part::ExpertDown)?;
    let biases = if moe.expert_bias {
        Some((take(Part::ExpertGateBias)?.1, take(Part::ExpertDownBias)?.1))
    } else {
        None
    };
    let dense = |name: &str, v: Vec<f32>, rows: usize, cols: usize| {
        Tensor::from_vec(v, (rows, cols), &Device::Cpu)
            .map(Matrix::Dense)
            .map_err(|e| ModelError::malformed(&path, format!("tensor `{name}`: {e}")))
    };
    (0..e)
        .map(|j| {
            // Shapes were checked on reading: [e, h, 2 ff] and [e, ff, h].
            let gu = &gate_up[j * h * 2 * ff..(j + 1) * h * 2 * ff];
            let dn = &down[j * ff * h..(j + 1) * ff * h];
            let column = |k: usize| (0..h).map(move |c| gu[c * 2 * ff + k]);
            let gate: Vec<f32> = (0..ff).flat_map(|r| column(2 * r)).collect();
            let up: Vec<f32> = (0..ff).flat_map(|r| column(2 * r + 1)).collect();
            let down_t: Vec<f32> = (0..h)
                .flat_map(|r| (0..ff).map(move |c| dn[c * h + r]))
                .collect();
            let bias = biases.as_ref().map(|(gub, db)| {
                let gub = &gub[j * 2 * ff..(j + 1) * 2 * ff];
                MlpBias {
                    gate: gub.iter().step_by(2).copied().collect(),
                    up: gub.iter().skip(1).step_by(2).copied().collect(),
                    down: db[j * h..(j + 1) * h].to_vec(),
                }
            });
            Ok(Mlp {
                gate: dense(&gate_up_name, gate, ff, h)?,
                up: dense(&gate_up_name, up, ff, h)?,
                down: dense(&down_name, down_t, h, ff)?,
                bias,
            })
        })
        .collect()
}

pub(super) fn to_vec1(path: &std::path::Path, name: &str, t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| ModelError::malformed(path, format!("tensor `{name}`: {e}")))
}
