//! Where a model's tensors come from: the `TensorSource` each format
//! implements, the naming `Layout` of a format, and the shape every tensor
//! must have (`plan`).

use super::*;

/// Where tensors come from: each call returns the named tensor as a
/// contiguous f32 CPU tensor, after checking its shape is `expected`.
pub(crate) trait TensorSource {
    /// The file or directory, for error messages.
    fn source_path(&self) -> &std::path::Path;
    /// Take tensor `name`; [`ModelError::MissingTensor`] if absent,
    /// [`ModelError::ShapeMismatch`] if its shape is not `expected`.
    fn take(&mut self, name: &str, expected: &[usize]) -> Result<Tensor>;
    /// Whether the source has tensor `name` (a variant layout's tensor,
    /// such as a fused expert stack, is looked for before it is taken).
    fn contains(&self, _name: &str) -> bool {
        false
    }
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

    fn contains(&self, name: &str) -> bool {
        self.header().tensor(name).is_some()
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
    pub(super) fn embed(self) -> &'static str {
        match self {
            Self::Hf => "model.embed_tokens.weight",
            Self::Gguf => "token_embd.weight",
        }
    }

    pub(super) fn final_norm(self) -> &'static str {
        match self {
            Self::Hf => "model.norm.weight",
            Self::Gguf => "output_norm.weight",
        }
    }

    pub(super) fn lm_head(self) -> &'static str {
        match self {
            Self::Hf => "lm_head.weight",
            Self::Gguf => "output.weight",
        }
    }

    pub(super) fn layer(self, family: &Family, i: usize, part: Part) -> String {
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
    pub(super) fn layer_tensors(
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
pub(super) fn part_shape(config: &ModelConfig, part: Part) -> Vec<usize> {
    let (h, q, kv, ff) = (
        config.hidden_size,
        config.q_dim(),
        config.kv_dim(),
        config.intermediate_size,
    );
    let moe = config.moe.as_ref();
    // Latent attention's sizes (zeros without: its parts are not asked for).
    let (q_rank, kv_rank, nope, rope, v) = config.mla.as_ref().map_or((0, 0, 0, 0, 0), |m| {
        (
            m.q_lora_rank.unwrap_or(0),
            m.kv_lora_rank,
            m.qk_nope_dim,
            m.qk_rope_dim,
            m.v_head_dim,
        )
    });
    let n_heads = config.n_heads;
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
        Part::O => vec![h, config.o_dim()],
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
        Part::QA => vec![q_rank, h],
        Part::QANorm => vec![q_rank],
        Part::QB => vec![q, q_rank],
        Part::KvA => vec![kv_rank + rope, h],
        Part::KvANorm => vec![kv_rank],
        Part::KvB => vec![n_heads * (nope + v), kv_rank],
        Part::KB => vec![n_heads, kv_rank, nope],
        Part::VB => vec![n_heads, v, kv_rank],
    }
}

/// The shape of a fused expert tensor in a Hugging Face checkpoint
/// ([`Family::hf_fused_experts`]): gate and up share `gate_up_proj`
/// `[experts, hidden, 2 ff]` and its bias `[experts, 2 ff]`; `down_proj`
/// is `[experts, ff, hidden]`, its bias `[experts, hidden]`.
pub(super) fn fused_hf_shape(config: &ModelConfig, part: Part) -> Vec<usize> {
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
pub(super) fn family_of(config: &ModelConfig) -> Result<&'static Family> {
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
