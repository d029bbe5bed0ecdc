//! [`Weights`]: every parameter of the model on the CPU, in Hugging Face
//! orientation (`[out_features, in_features]`) and Hugging Face rotate-half
//! RoPE order, whatever the source format.
//!
//! Matrices are [`Matrix`] values: f32 in the exact mode ([`Precision::Exact`])
//! and for sources without supported blocks; in [`Precision::Quantized`] a
//! GGUF matrix stored in a block format (F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K, MXFP4) keeps its blocks as they are in the file
//! ([`QMatrix`]), read straight from the file without dequantizing. Vectors
//! (norms, biases) are always f32.
//!
//! One assembly path (`assemble`) asks a `TensorSource` for each tensor
//! by logical role and expected shape; the sources are a Hugging Face
//! safetensors directory (`hf`) and a GGUF file (`loader::gguf`). GGUF
//! Q and K projections arrive with their rows permuted for interleaved RoPE
//! and are un-permuted here (`unpermute_qk_rows`), so the forward pass has
//! one RoPE layout to implement.

mod assemble;
mod attn;
mod gate_up;
mod hf;
mod layout;
mod mla;
mod permute;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kvmesh_kernels::quant::QMatrix;

use crate::arch::{gguf_name, llama_hf_name, Family, Part};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;

use assemble::*;
pub use attn::{AttnWeights, GqaWeights, MlaQuery, MlaWeights};
pub(crate) use hf::HfTensors;
pub(crate) use layout::*;
pub(crate) use permute::*;

/// How a model's matrices are held and multiplied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 weights and activations: the mode compared against Hugging Face
    /// transformers (GGUF blocks are dequantized at load).
    #[default]
    Exact,
    /// GGUF blocks (every format of `QFormat`) used as stored (dequantized in registers or
    /// in small per-call panels, never whole at load), f32 activations;
    /// other tensors f32. Differs from the exact mode by the weights'
    /// quantization only, and every output is independent of batching (see
    /// `kvmesh_kernels::quant`).
    Quantized,
}

impl Precision {
    /// Name for logs and benchmark output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exact => "exact-f32",
            Self::Quantized => "quantized",
        }
    }
}

/// A weight matrix `[out_features, in_features]`: f32, or quantized blocks.
#[derive(Clone, Debug)]
pub enum Matrix {
    /// Contiguous f32 on the CPU.
    Dense(Tensor),
    /// GGUF blocks (shared, so a tied LM head is the embedding).
    Quant(Arc<QMatrix>),
}

impl Matrix {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Self::Dense(t) => {
                let d = t.dims();
                (
                    d.first().copied().unwrap_or(0),
                    d.get(1).copied().unwrap_or(1),
                )
            }
            Self::Quant(q) => (q.rows(), q.cols()),
        }
    }

    /// Values held (`rows * cols`).
    pub fn elem_count(&self) -> usize {
        let (r, c) = self.shape();
        r * c
    }

    /// The f32 tensor, when dense.
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(t) => Some(t),
            Self::Quant(_) => None,
        }
    }

    /// The matrix as an f32 tensor (dequantizing blocks; tests and tools).
    pub fn to_dense(&self) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(t) => Ok(t.clone()),
            Self::Quant(q) => {
                let mut v = vec![0.0f32; q.rows() * q.cols()];
                for (r, row) in v.chunks_exact_mut(q.cols()).enumerate() {
                    q.dequantize_row(r, row);
                }
                Tensor::from_vec(v, (q.rows(), q.cols()), &Device::Cpu)
            }
        }
    }

    /// Whether both are the same storage (a tied LM head).
    pub fn same_storage(&self, other: &Matrix) -> bool {
        match (self, other) {
            (Self::Dense(a), Self::Dense(b)) => a.id() == b.id(),
            (Self::Quant(a), Self::Quant(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Row `r` as f32 into `out` (embedding lookups).
    pub(crate) fn row_into(&self, r: usize, out: &mut [f32]) -> candle_core::Result<()> {
        match self {
            Self::Dense(t) => {
                let row = t.get(r)?.to_vec1::<f32>()?;
                out.copy_from_slice(&row);
                Ok(())
            }
            Self::Quant(q) => {
                q.dequantize_row(r, out);
                Ok(())
            }
        }
    }
}

/// One decoder layer's parameters.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// Where queries, keys and values come from: q/k/v, or a latent.
    pub attn: AttnWeights,
    /// Output projection, `[hidden, n_heads * head_dim]` (latent
    /// attention: `[hidden, n_heads * v_head_dim]`).
    pub wo: Matrix,
    /// Output projection bias (gpt-oss), `[hidden]`.
    pub bo: Option<Vec<f32>>,
    /// Attention sink logits, one per query head (gpt-oss), `[n_heads]`.
    pub sinks: Option<Vec<f32>>,
    /// RMSNorm weight on the attention output (Gemma), `[hidden]`.
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// RMSNorm weight on the MLP output (Gemma), `[hidden]`.
    pub post_mlp_norm: Option<Vec<f32>>,
    /// The MLP slot: one gated MLP, or a mixture of experts.
    pub ffn: Ffn,
}

/// A gated MLP: `down(act(gate x + b_gate) * (up x + b_up)) + b_down`,
/// the biases where it has them.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Gate projection, `[ff, hidden]`.
    pub gate: Matrix,
    /// Up projection, `[ff, hidden]`.
    pub up: Matrix,
    /// Down projection, `[hidden, ff]`.
    pub down: Matrix,
    /// The three projections' biases (gpt-oss's experts).
    pub bias: Option<MlpBias>,
}

/// The biases of a gated MLP's three projections.
#[derive(Clone, Debug)]
pub struct MlpBias {
    /// Gate bias, `[ff]`.
    pub gate: Vec<f32>,
    /// Up bias, `[ff]`.
    pub up: Vec<f32>,
    /// Down bias, `[hidden]`.
    pub down: Vec<f32>,
}

impl Mlp {
    /// The three matrices, gate, up, down.
    pub fn matrices(&self) -> [&Matrix; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// The biases, gate, up, down (none without).
    pub fn vectors(&self) -> impl Iterator<Item = &Vec<f32>> {
        self.bias.iter().flat_map(|b| [&b.gate, &b.up, &b.down])
    }
}

/// A sparse layer's mixture of experts ([`crate::arch::moe::Moe`]).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// Router, `[experts, hidden]`.
    pub router: Matrix,
    /// The correction bias added to the scores to choose experts,
    /// `[experts]`.
    pub router_bias: Option<Vec<f32>>,
    /// The bias added to the router's logits (gpt-oss), `[experts]`.
    pub logit_bias: Option<Vec<f32>>,
    /// The routed experts, each `[expert_ff, hidden]` (down transposed).
    pub experts: Vec<Mlp>,
    /// The expert every token passes through (Qwen2-MoE).
    pub shared: Option<Mlp>,
    /// The shared expert's sigmoid gate, `[hidden]`.
    pub shared_gate: Option<Vec<f32>>,
}

/// What fills a layer's MLP slot.
#[derive(Clone, Debug)]
pub enum Ffn {
    /// One gated MLP of `intermediate_size`.
    Dense(Mlp),
    /// A router over experts.
    Moe(MoeWeights),
}

impl Ffn {
    /// Every matrix: the dense MLP's, or the router's, each expert's and
    /// the shared expert's.
    pub fn matrices(&self) -> Vec<&Matrix> {
        match self {
            Self::Dense(m) => m.matrices().to_vec(),
            Self::Moe(moe) => std::iter::once(&moe.router)
                .chain(moe.experts.iter().flat_map(Mlp::matrices))
                .chain(moe.shared.iter().flat_map(Mlp::matrices))
                .collect(),
        }
    }

    /// The dense MLP, for a layer that has one.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Self::Dense(m) => Some(m),
            Self::Moe(_) => None,
        }
    }
}

impl LayerWeights {
    /// Every matrix of the layer: attention's ([`AttnWeights::matrices`],
    /// then the output projection), then the MLP slot's.
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut out = self.attn.matrices();
        out.push(&self.wo);
        out.extend(self.ffn.matrices());
        out
    }

    /// Every vector the layer has (norms, then the biases, norms and
    /// sinks its family adds, then the MLP slot's biases).
    pub fn vectors(&self) -> impl Iterator<Item = &Vec<f32>> {
        let (moe, mlps): (Option<&MoeWeights>, Vec<&Mlp>) = match &self.ffn {
            Ffn::Dense(m) => (None, vec![m]),
            Ffn::Moe(m) => (Some(m), m.experts.iter().chain(&m.shared).collect()),
        };
        [&self.attn_norm, &self.mlp_norm]
            .into_iter()
            .chain(self.attn.vectors())
            .chain(
                [
                    &self.bo,
                    &self.sinks,
                    &self.post_attn_norm,
                    &self.post_mlp_norm,
                ]
                .into_iter()
                .flatten(),
            )
            .chain(
                moe.into_iter()
                    .flat_map(|m| [&m.shared_gate, &m.router_bias, &m.logit_bias])
                    .flatten(),
            )
            .chain(mlps.into_iter().flat_map(Mlp::vectors))
    }
}

/// All parameters of a model, on the CPU.
#[derive(Clone, Debug)]
pub struct Weights {
    /// Token embedding, `[vocab, hidden]`.
    pub embed: Matrix,
    /// Decoder layers, in order.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// LM head, `[vocab, hidden]`; a clone of `embed` (sharing its storage)
    /// when the embeddings are tied.
    pub lm_head: Matrix,
}

impl Weights {
    /// Load every `*.safetensors` file of a Hugging Face model directory
    /// (always f32).
    pub fn from_hf_dir(dir: &std::path::Path, config: &ModelConfig) -> Result<Self> {
        let mut source = HfTensors::read_dir(dir, &plan(config, Layout::Hf))?;
        assemble(&mut source, config, Layout::Hf, Precision::Exact)
    }

    /// Load the tensors of an open GGUF file: dequantized to f32, or (in
    /// [`Precision::Quantized`]) every block format kept as stored.
    pub(crate) fn from_gguf(
        file: &mut GgufFile,
        config: &ModelConfig,
        precision: Precision,
    ) -> Result<Self> {
        assemble(file, config, Layout::Gguf, precision)
    }

    /// Weights of `config`'s shape drawn at random (seeded; the same seed
    /// gives the same weights): each matrix uniform in `±1/sqrt(cols)`, so
    /// activations keep their scale through the layers; norms 1; biases
    /// small. For benchmarks of shapes whose weights are not at hand (the
    /// Llama-3-8B shape on a GPU): speed does not depend on the values,
    /// as long as they are not all zeros. Cost: the parameters as f32 in
    /// host memory, drawn in parallel.
    pub fn random(config: &ModelConfig, seed: u64) -> Result<Self> {
        use rand::{Rng, SeedableRng};
        use rayon::prelude::*;
        let matrix = |rows: usize, cols: usize, salt: u64| -> Result<Matrix> {
            let n = rows.checked_mul(cols).ok_or_else(|| ModelError::Compute {
                detail: format!("a {rows} x {cols} matrix overflows"),
            })?;
            let a = 1.0 / (cols.max(1) as f32).sqrt();
            let mut v = vec![0f32; n];
            v.par_chunks_mut(1 << 20)
                .enumerate()
                .for_each(|(i, chunk)| {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(
                        seed ^ salt.rotate_left(17)
                            ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    );
                    chunk.iter_mut().for_each(|x| *x = rng.random_range(-a..a));
                });
            Tensor::from_vec(v, (rows, cols), &Device::Cpu)
                .map(Matrix::Dense)
                .map_err(|e| ModelError::Compute {
                    detail: e.to_string(),
                })
        };
        let (h, q, kv, inter) = (
            config.hidden_size,
            config.q_dim(),
            config.kv_dim(),
            config.intermediate_size,
        );
        let bias = |n: usize| config.attention_bias.then(|| vec![0.01; n]);
        let embed = matrix(config.vocab_size, h, 1)?;
        let expert_bias = config.moe.as_ref().is_some_and(|m| m.expert_bias);
        let mlp = |ff: usize, salt: u64, biased: bool| -> Result<Mlp> {
            Ok(Mlp {
                gate: matrix(ff, h, salt)?,
                up: matrix(ff, h, salt + 1)?,
                down: matrix(h, ff, salt + 2)?,
                bias: biased.then(|| MlpBias {
                    gate: vec![0.01; ff],
                    up: vec![0.01; ff],
                    down: vec![0.01; h],
                }),
            })
        };
        let mut layers = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers as u64 {
            let salt = 16 * (l + 1);
            let ffn = match config.moe.as_ref().filter(|m| m.is_sparse(l as usize)) {
                None => Ffn::Dense(mlp(inter, salt + 5, false)?),
                Some(moe) => {
                    // Experts salted apart from every layer's other matrices.
                    let base = (1 << 32) + (l << 16);
                    Ffn::Moe(MoeWeights {
                        router: matrix(moe.n_experts, h, base)?,
                        router_bias: moe.correction_bias.then(|| vec![0.0; moe.n_experts]),
                        logit_bias: moe.router_bias.then(|| vec![0.0; moe.n_experts]),
                        experts: (0..moe.n_experts as u64)
                            .map(|j| mlp(moe.expert_ff, base + 4 * (j + 1), expert_bias))
                            .collect::<Result<_>>()?,
                        shared: moe
                            .shared_ff
                            .map(|ff| mlp(ff, base + 1, false))
                            .transpose()?,
                        shared_gate: moe.shared_gate.then(|| vec![0.01; h]),
                    })
                }
            };
            let attn = match &config.mla {
                None => AttnWeights::Gqa(GqaWeights {
                    wq: matrix(q, h, salt + 1)?,
                    wk: matrix(kv, h, salt + 2)?,
                    wv: matrix(kv, h, salt + 3)?,
                    bq: bias(q),
                    bk: bias(kv),
                    bv: bias(kv),
                    q_norm: config.block.qk_norm.then(|| vec![1.0; config.head_dim]),
                    k_norm: config.block.qk_norm.then(|| vec![1.0; config.head_dim]),
                }),
                Some(m) => {
                    // Heads salted apart from the layer's other matrices.
                    let base = (1 << 40) + (l << 20);
                    let head = |rows, cols, j: u64| matrix(rows, cols, base + 8 + j);
                    let n = config.n_heads as u64;
                    AttnWeights::Latent(Box::new(MlaWeights {
                        q: match m.q_lora_rank {
                            None => MlaQuery::Direct(matrix(q, h, salt + 1)?),
                            Some(r) => MlaQuery::LowRank {
                                a: matrix(r, h, salt + 1)?,
                                norm: vec![1.0; r],
                                b: matrix(q, r, salt + 2)?,
                            },
                        },
                        kv_a: matrix(m.entry_dim(), h, salt + 3)?,
                        kv_a_norm: vec![1.0; m.kv_lora_rank],
                        k_b: (0..n)
                            .map(|j| head(m.kv_lora_rank, m.qk_nope_dim, j))
                            .collect::<Result<_>>()?,
                        v_b: (0..n)
                            .map(|j| head(m.v_head_dim, m.kv_lora_rank, n + j))
                            .collect::<Result<_>>()?,
                    }))
                }
            };
            layers.push(LayerWeights {
                attn_norm: vec![1.0; h],
                attn,
                wo: matrix(h, config.o_dim(), salt + 4)?,
                bo: config.block.o_bias.then(|| vec![0.01; h]),
                sinks: config.block.attn_sinks.then(|| vec![0.0; config.n_heads]),
                post_attn_norm: config.block.sandwich_norms.then(|| vec![1.0; h]),
                mlp_norm: vec![1.0; h],
                post_mlp_norm: config.block.sandwich_norms.then(|| vec![1.0; h]),
                ffn,
            });
        }
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            matrix(config.vocab_size, h, 2)?
        };
        Ok(Self {
            embed,
            layers,
            final_norm: vec![1.0; h],
            lm_head,
        })
    }

    /// What identifies these weights, whatever file or format they came
    /// from: SHA-256 over the configuration, every vector (norms, biases)
    /// whole, and every matrix's shape and 16 evenly spaced rows as f32
    /// (dequantized: a Q4_K and a Q8_0 file of one model differ, the same
    /// weights renamed or re-read do not). Reading 16 rows per matrix keeps
    /// it a few milliseconds where hashing every weight of an 8B model
    /// would take seconds; a fine-tune changes every row, so it changes the
    /// sampled ones. Hex, 32 digits.
    pub fn fingerprint(&self, config: &ModelConfig) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(format!("{config:?}").as_bytes());
        let floats = |h: &mut Sha256, v: &[f32]| {
            for x in v {
                h.update(x.to_le_bytes());
            }
        };
        let matrix = |h: &mut Sha256, m: &Matrix| {
            let (rows, cols) = m.shape();
            h.update((rows as u64).to_le_bytes());
            h.update((cols as u64).to_le_bytes());
            let mut row = vec![0f32; cols];
            for i in 0..16.min(rows) {
                let r = i * rows / 16.min(rows);
                if m.row_into(r, &mut row).is_ok() {
                    floats(h, &row);
                }
            }
        };
        matrix(&mut h, &self.embed);
        for l in &self.layers {
            for m in l.matrices() {
                matrix(&mut h, m);
            }
            for v in l.vectors() {
                floats(&mut h, v);
            }
        }
        floats(&mut h, &self.final_norm);
        matrix(&mut h, &self.lm_head);
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Bytes the matrices occupy (what a dense model's decode step reads;
    /// a mixture's reads only the experts its tokens chose).
    pub fn matrix_bytes(&self) -> usize {
        let bytes = |m: &Matrix| match m {
            Matrix::Dense(t) => t.elem_count() * 4,
            Matrix::Quant(q) => q.byte_len(),
        };
        let tied = self.lm_head.same_storage(&self.embed);
        self.layers
            .iter()
            .flat_map(LayerWeights::matrices)
            .map(bytes)
            .sum::<usize>()
            + bytes(&self.embed)
            + if tied { 0 } else { bytes(&self.lm_head) }
    }

    /// Parameters held, counting a tied LM head once.
    pub fn parameter_count(&self) -> usize {
        let layer = |l: &LayerWeights| {
            l.matrices().iter().map(|t| t.elem_count()).sum::<usize>()
                + l.vectors().map(Vec::len).sum::<usize>()
        };
        let tied = self.lm_head.same_storage(&self.embed);
        self.embed.elem_count()
            + self.layers.iter().map(layer).sum::<usize>()
            + self.final_norm.len()
            + if tied { 0 } else { self.lm_head.elem_count() }
    }
}

#[cfg(test)]
mod tests;
