//! [`Weights`]: every parameter of the model on the CPU, in Hugging Face
//! orientation (`[out_features, in_features]`) and Hugging Face rotate-half
//! RoPE order, whatever the source format.
//!
//! Matrices are [`Matrix`] values: f32 in the exact mode ([`Precision::Exact`])
//! and for sources without supported blocks; in [`Precision::Quantized`] a
//! GGUF matrix stored in a block format (F16, BF16, Q4_0..Q8_0, Q2_K..Q6_K) keeps its blocks as they are in the file
//! ([`QMatrix`]), read straight from the file without dequantizing. Vectors
//! (norms, biases) are always f32.
//!
//! One assembly path (`assemble`) asks a `TensorSource` for each tensor
//! by logical role and expected shape; the sources are a Hugging Face
//! safetensors directory (`hf`) and a GGUF file (`loader::gguf`). GGUF
//! Q and K projections arrive with their rows permuted for interleaved RoPE
//! and are un-permuted here (`unpermute_qk_rows`), so the forward pass has
//! one RoPE layout to implement.

mod hf;

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kvmesh_kernels::quant::QMatrix;

use crate::arch::{gguf_name, llama_hf_name, Family, Part};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;

pub(crate) use hf::HfTensors;

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
    /// Query projection, `[n_heads * head_dim, hidden]`.
    pub wq: Matrix,
    /// Key projection, `[n_kv_heads * head_dim, hidden]`.
    pub wk: Matrix,
    /// Value projection, `[n_kv_heads * head_dim, hidden]`.
    pub wv: Matrix,
    /// Output projection, `[hidden, n_heads * head_dim]`.
    pub wo: Matrix,
    /// Output projection bias (gpt-oss), `[hidden]`.
    pub bo: Option<Vec<f32>>,
    /// Attention sink logits, one per query head (gpt-oss), `[n_heads]`.
    pub sinks: Option<Vec<f32>>,
    /// Query bias (when `attention_bias`), `[n_heads * head_dim]`.
    pub bq: Option<Vec<f32>>,
    /// Key bias (when `attention_bias`), `[n_kv_heads * head_dim]`.
    pub bk: Option<Vec<f32>>,
    /// Value bias (when `attention_bias`), `[n_kv_heads * head_dim]`.
    pub bv: Option<Vec<f32>>,
    /// RMSNorm weight of each query head (Qwen3, Gemma 3), `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    /// RMSNorm weight of each key head, `[head_dim]`.
    pub k_norm: Option<Vec<f32>>,
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
    /// Every matrix of the layer: attention's four, then the MLP slot's.
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut out = vec![&self.wq, &self.wk, &self.wv, &self.wo];
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
            .chain(
                [
                    &self.bq,
                    &self.bk,
                    &self.bv,
                    &self.bo,
                    &self.sinks,
                    &self.q_norm,
                    &self.k_norm,
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
            layers.push(LayerWeights {
                attn_norm: vec![1.0; h],
                wq: matrix(q, h, salt + 1)?,
                wk: matrix(kv, h, salt + 2)?,
                wv: matrix(kv, h, salt + 3)?,
                wo: matrix(h, q, salt + 4)?,
                bo: config.block.o_bias.then(|| vec![0.01; h]),
                sinks: config.block.attn_sinks.then(|| vec![0.0; config.n_heads]),
                bq: bias(q),
                bk: bias(kv),
                bv: bias(kv),
                q_norm: config.block.qk_norm.then(|| vec![1.0; config.head_dim]),
                k_norm: config.block.qk_norm.then(|| vec![1.0; config.head_dim]),
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

/// Where tensors come from: each call returns the named tensor as a
/// contiguous f32 CPU tensor, after checking its shape is `expected`.
pub(crate) trait TensorSource {
    /// The file or directory, for error messages.
    fn source_path(&self) -> &std::path::Path;
    /// Take tensor `name`; [`ModelError::MissingTensor`] if absent,
    /// [`ModelError::ShapeMismatch`] if its shape is not `expected`.
    fn take(&mut self, name: &str, expected: &[usize]) -> Result<Tensor>;
    /// Take a weight matrix: f32 unless the source keeps supported blocks
    /// and `precision` asks for them.
    fn take_matrix(
        &mut self,
        name: &str,
        expected: &[usize],
        _precision: Precision,
    ) -> Result<Matrix> {
        self.take(name, expected).map(Matrix::Dense)
    }
}

impl TensorSource for GgufFile {
    fn source_path(&self) -> &std::path::Path {
        self.path()
    }

    fn take(&mut self, name: &str, expected: &[usize]) -> Result<Tensor> {
        self.tensor_f32(name, expected)
    }

    fn take_matrix(
        &mut self,
        name: &str,
        expected: &[usize],
        precision: Precision,
    ) -> Result<Matrix> {
        if precision == Precision::Quantized {
            if let Some(q) = self.tensor_blocks(name, expected)? {
                return Ok(Matrix::Quant(Arc::new(q)));
            }
        }
        self.tensor_f32(name, expected).map(Matrix::Dense)
    }
}

/// Tensor naming of a source format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// `model.layers.{i}.self_attn.q_proj.weight` and so on.
    Hf,
    /// llama.cpp names: `blk.{i}.attn_q.weight` and so on.
    Gguf,
}

impl Layout {
    fn embed(self) -> &'static str {
        match self {
            Self::Hf => "model.embed_tokens.weight",
            Self::Gguf => "token_embd.weight",
        }
    }

    fn final_norm(self) -> &'static str {
        match self {
            Self::Hf => "model.norm.weight",
            Self::Gguf => "output_norm.weight",
        }
    }

    fn lm_head(self) -> &'static str {
        match self {
            Self::Hf => "lm_head.weight",
            Self::Gguf => "output.weight",
        }
    }

    fn layer(self, family: &Family, i: usize, part: Part) -> String {
        match self {
            Self::Hf => {
                let name = (family.hf_name)(part).unwrap_or_else(|| llama_hf_name(part));
                format!("model.layers.{i}.{name}")
            }
            Self::Gguf => {
                let name = (family.gguf_name)(part).unwrap_or_else(|| gguf_name(part));
                format!("blk.{i}.{name}")
            }
        }
    }

    /// Layer `i`'s tensors of `part` with their shapes: one, or for an
    /// expert role in a Hugging Face checkpoint one per expert (GGUF
    /// stacks them into one `[experts, rows, cols]` tensor).
    fn layer_tensors(
        self,
        family: &Family,
        config: &ModelConfig,
        i: usize,
        part: Part,
    ) -> Vec<(String, Vec<usize>)> {
        let name = self.layer(family, i, part);
        let shape = part_shape(config, part);
        let n_experts = config.moe.as_ref().map_or(0, |m| m.n_experts);
        match self {
            Self::Hf if part.per_expert() && family.hf_fused_experts => {
                vec![(name, fused_hf_shape(config, part))]
            }
            Self::Hf if part.per_expert() => (0..n_experts)
                .map(|j| (name.replace("{j}", &j.to_string()), shape.clone()))
                .collect(),
            Self::Gguf if part.per_expert() => {
                vec![(name, [vec![n_experts], shape].concat())]
            }
            _ => vec![(name, shape)],
        }
    }
}

/// Shape of each layer part implied by the configuration (one expert's,
/// for the expert roles).
fn part_shape(config: &ModelConfig, part: Part) -> Vec<usize> {
    let (h, q, kv, ff) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
    );
    let moe = config.moe.as_ref();
    let (n_experts, expert_ff, shared_ff) = (
        moe.map_or(0, |m| m.n_experts),
        moe.map_or(0, |m| m.expert_ff),
        moe.and_then(|m| m.shared_ff).unwrap_or(0),
    );
    match part {
        Part::AttnNorm | Part::MlpNorm | Part::PostAttnNorm | Part::PostMlpNorm => vec![h],
        Part::QNorm | Part::KNorm => vec![config.head_dim],
        Part::Q => vec![q, h],
        Part::K | Part::V => vec![kv, h],
        Part::Qkv => vec![q + 2 * kv, h],
        Part::O => vec![h, q],
        Part::QBias => vec![q],
        Part::KBias | Part::VBias => vec![kv],
        Part::Gate | Part::Up => vec![ff, h],
        Part::GateUp => vec![2 * ff, h],
        Part::Down => vec![h, ff],
        Part::Router => vec![n_experts, h],
        Part::RouterBias => vec![n_experts],
        Part::ExpertGate | Part::ExpertUp => vec![expert_ff, h],
        Part::ExpertDown => vec![h, expert_ff],
        Part::SharedGate | Part::SharedUp => vec![shared_ff, h],
        Part::SharedDown => vec![h, shared_ff],
        Part::SharedRouter => vec![1, h],
        Part::OBias => vec![h],
        Part::Sinks => vec![config.n_heads],
        Part::RouterLogitBias => vec![n_experts],
        Part::ExpertGateBias | Part::ExpertUpBias => vec![expert_ff],
        Part::ExpertDownBias => vec![h],
    }
}

/// The shape of a fused expert tensor in a Hugging Face checkpoint
/// ([`Family::hf_fused_experts`]): gate and up share `gate_up_proj`
/// `[experts, hidden, 2 ff]` and its bias `[experts, 2 ff]`; `down_proj`
/// is `[experts, ff, hidden]`, its bias `[experts, hidden]`.
fn fused_hf_shape(config: &ModelConfig, part: Part) -> Vec<usize> {
    let h = config.hidden_size;
    let (e, ff) = config
        .moe
        .as_ref()
        .map_or((0, 0), |m| (m.n_experts, m.expert_ff));
    match part {
        Part::ExpertGate | Part::ExpertUp => vec![e, h, 2 * ff],
        Part::ExpertDown => vec![e, ff, h],
        Part::ExpertGateBias | Part::ExpertUpBias => vec![e, 2 * ff],
        Part::ExpertDownBias => vec![e, h],
        other => part_shape(config, other),
    }
}

/// The family of a configuration (every `ModelConfig` names one).
fn family_of(config: &ModelConfig) -> Result<&'static Family> {
    Family::named(config.family).ok_or_else(|| ModelError::Compute {
        detail: format!("no model family named {:?}", config.family),
    })
}

/// Every tensor the configuration needs, with its expected shape.
pub(crate) fn plan(config: &ModelConfig, layout: Layout) -> Vec<(String, Vec<usize>)> {
    let (v, h) = (config.vocab_size, config.hidden_size);
    let mut out = vec![
        (layout.embed().to_owned(), vec![v, h]),
        (layout.final_norm().to_owned(), vec![h]),
    ];
    if !config.tie_word_embeddings {
        out.push((layout.lm_head().to_owned(), vec![v, h]));
    }
    let Ok(family) = family_of(config) else {
        return out;
    };
    for i in 0..config.n_layers {
        for part in family.layer_parts(config, i) {
            out.extend(layout.layer_tensors(family, config, i, part));
        }
    }
    out
}

/// Rows `range` of a matrix (splitting Phi-3's fused tensors: blocks are
/// whole rows, so a quantized matrix splits without dequantizing).
fn matrix_rows(m: &Matrix, range: std::ops::Range<usize>) -> candle_core::Result<Matrix> {
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
fn assemble(
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
        let mut norm = |part: Part| -> Result<Vec<f32>> {
            let mut w = to_vec1(&path, &name(part), &take(part)?)?;
            if norm_offset != 0.0 {
                w.iter_mut().for_each(|x| *x += norm_offset);
            }
            Ok(w)
        };
        let mut opt_norm = |on: bool, part: Part| on.then(|| norm(part)).transpose();
        let q_norm = opt_norm(config.block.qk_norm, Part::QNorm)?;
        let k_norm = opt_norm(config.block.qk_norm, Part::KNorm)?;
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
            wq,
            wk,
            wv,
            wo,
            bo,
            sinks,
            bq,
            bk,
            bv,
            q_norm,
            k_norm,
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

/// Layer `i`'s router, experts and shared expert. A Hugging Face
/// checkpoint names each expert's matrices; GGUF stacks each role into one
/// `[experts, rows, cols]` tensor, split here into the experts' row ranges
/// (whole rows of blocks, so quantized experts stay quantized).
fn moe_weights(
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
        let stacked = match src.take_matrix(name, shape, precision)? {
            Matrix::Dense(t) => t
                .reshape((moe.n_experts * rows, shape[2]))
                .map(Matrix::Dense)
                .map_err(|e| ModelError::malformed(&path, format!("tensor `{name}`: {e}")))?,
            q => q,
        };
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
        let gates = experts_of(src, Part::ExpertGate)?;
        let ups = experts_of(src, Part::ExpertUp)?;
        let downs = experts_of(src, Part::ExpertDown)?;
        let mut biases: Vec<Option<MlpBias>> = vec![None; moe.n_experts];
        if moe.expert_bias {
            let g = biases_of(src, Part::ExpertGateBias)?;
            let u = biases_of(src, Part::ExpertUpBias)?;
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
fn fused_hf_experts(
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

fn to_vec1(path: &std::path::Path, name: &str, t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|e| ModelError::malformed(path, format!("tensor `{name}`: {e}")))
}

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

fn swap_row_halves(
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

#[cfg(test)]
mod tests;
