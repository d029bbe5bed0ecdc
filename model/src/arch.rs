//! The decoder families kvmesh runs, each one description over one forward
//! pass.
//!
//! # Why a description, not a forward per model
//! Every family here is the same pre-norm decoder: embed, then per layer
//! `norm -> q/k/v -> rope -> paged attention -> o` and `norm -> gated MLP
//! -> down`, each added to the residual stream, then a final norm and the
//! vocabulary projection. What differs is a handful of switches (biases on
//! q/k/v, an RMSNorm per head on q and k, norms after attention and MLP,
//! the MLP's activation, a scaled embedding, soft-capped attention scores
//! and logits, which
//! layers attend a sliding window and with which rope base) and the tensor
//! names. llama.cpp writes one graph builder per architecture (hundreds of
//! near-copies); mistral.rs and candle-transformers one model file each.
//! Both make a fix to the shared part (the checked paged attention, the
//! batched projections, the CUDA twin) a change to every copy. Here a
//! family is data (`Family`): how its configuration is read (Hugging Face
//! `config.json` and GGUF metadata), which tensors it has and under what
//! names, and the [`Block`] switches; the one forward pass
//! ([`crate::llama::Llama`], and the CUDA backend, which refuses switches it
//! does not implement) reads the switches. A family whose difference is not
//! a switch (mixture-of-experts MLPs, latent attention) adds a component
//! behind a new switch, not a copy of the pass: a mixture of experts is
//! [`moe::Moe`] in the configuration, and takes the MLP's slot; latent
//! attention (DeepSeek V2/V3) is [`mla::Mla`], and takes q/k/v's.
//!
//! # Adding a family
//! One file in this module: a `pub(crate) const FAMILY: Family` with its
//! names and its two configuration hooks, listed in `FAMILIES`; its
//! golden test beside the others (`model/tests/golden.rs`).

mod deepseek;
mod gemma2;
mod gemma3;
mod glm4_moe;
mod gpt_oss;
mod llama;
pub mod mla;
pub mod moe;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen_moe;

use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;

/// Every family, in the order a model type or class is looked up.
pub(crate) const FAMILIES: &[&Family] = &[
    &llama::LLAMA,
    &llama::MISTRAL,
    &qwen2::FAMILY,
    &qwen3::FAMILY,
    &gemma2::FAMILY,
    &gemma3::FAMILY,
    &phi3::FAMILY,
    &llama::MIXTRAL,
    &qwen_moe::QWEN2_MOE,
    &qwen_moe::QWEN3_MOE,
    &glm4_moe::FAMILY,
    &gpt_oss::FAMILY,
    &deepseek::V2,
    &deepseek::V3,
];

/// The MLP's activation on the gate (the up projection multiplies it).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU).
    #[default]
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU with the tanh approximation, Gemma).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`,
    /// `u = clamp(up, -limit, limit)`, then `g * sigmoid(alpha g) * (u + 1)`
    /// ([`kvmesh_kernels::activation::swiglu_oai`]).
    SwigluOai {
        /// Gain inside the sigmoid (1.702).
        alpha: f32,
        /// Clamp of the gate (above) and of up (both sides) (7).
        limit: f32,
    },
}

impl Activation {
    /// The name configuration files use (the clamped SwiGLU: llama.cpp's
    /// name for it; gpt-oss's `config.json` says `silu`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Silu => "silu",
            Self::GeluTanh => "gelu_pytorch_tanh",
            Self::SwigluOai { .. } => "swiglu_oai",
        }
    }
}

/// What one layer's attention reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayerType {
    /// Every earlier position.
    #[default]
    Full,
    /// The last [`ModelConfig::sliding_window`] positions, with the local
    /// rope base where the family has one.
    Sliding,
}

/// The switches of the one forward pass (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// The MLP's activation.
    pub activation: Activation,
    /// RMSNorm over each head of q and of k, after the projection and
    /// before rope (Qwen3, Gemma 3); weights `[head_dim]`.
    pub qk_norm: bool,
    /// RMSNorm on the attention output and on the MLP output before each
    /// is added to the residual stream (Gemma 2/3).
    pub sandwich_norms: bool,
    /// Embedding rows multiplied by this (Gemma: `sqrt(hidden)`, rounded
    /// to f32 as transformers does).
    pub embed_scale: Option<f32>,
    /// Softmax scale of attention (`1/sqrt(head_dim)`, or Gemma's
    /// `query_pre_attn_scalar^-0.5`).
    pub attn_scale: f32,
    /// Attention scores (scaled) become `cap * tanh(score / cap)` before
    /// the softmax (Gemma 2; [`kvmesh_kernels::AttentionShape::softcap`]).
    pub attn_softcap: Option<f32>,
    /// Final logits become `cap * tanh(logits / cap)` (Gemma 2).
    pub final_softcap: Option<f32>,
    /// The output projection has a bias, `[hidden]` (gpt-oss).
    pub o_bias: bool,
    /// Each attention layer has one learned sink logit per query head
    /// that joins its softmax (gpt-oss;
    /// [`kvmesh_kernels::AttentionShape::sinks`]).
    pub attn_sinks: bool,
}

impl Block {
    /// A Llama block: SiLU, no extra norms, `1/sqrt(head_dim)`.
    pub(crate) fn llama(head_dim: usize) -> Self {
        Self {
            activation: Activation::Silu,
            qk_norm: false,
            sandwich_norms: false,
            embed_scale: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            o_bias: false,
            attn_sinks: false,
        }
    }

    /// The switches that differ from a Llama block, by name (for logs and
    /// the CUDA backend's refusal); empty for a Llama block.
    pub fn non_llama_switches(&self, head_dim: usize) -> Vec<&'static str> {
        let base = Self::llama(head_dim);
        let mut out = Vec::new();
        match self.activation {
            Activation::Silu => {}
            Activation::GeluTanh => out.push("gelu-tanh MLP"),
            Activation::SwigluOai { .. } => out.push("clamped SwiGLU MLP (swiglu_oai)"),
        }
        if self.qk_norm {
            out.push("q/k norms");
        }
        if self.sandwich_norms {
            out.push("post-attention and post-MLP norms");
        }
        if self.embed_scale.is_some() {
            out.push("scaled embeddings");
        }
        if self.attn_scale != base.attn_scale {
            out.push("a non-default attention scale");
        }
        if self.attn_softcap.is_some() {
            out.push("attention logit soft-capping");
        }
        if self.final_softcap.is_some() {
            out.push("soft-capped logits");
        }
        if self.o_bias {
            out.push("an output-projection bias");
        }
        if self.attn_sinks {
            out.push("attention sinks");
        }
        out
    }
}

/// Where a tensor role's names differ from Llama's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    AttnNorm,
    Q,
    K,
    V,
    /// q, k and v fused by rows (Phi-3): `[q_dim + 2 kv_dim, hidden]`.
    Qkv,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    PostAttnNorm,
    MlpNorm,
    Gate,
    Up,
    /// Gate and up fused by rows (Phi-3): `[2 intermediate, hidden]`.
    GateUp,
    Down,
    PostMlpNorm,
    /// A sparse layer's router, `[experts, hidden]`.
    Router,
    /// The router's correction bias, `[experts]` (GLM-4.5, DeepSeek V3).
    RouterBias,
    /// Every expert's gate, up and down projections: one tensor per expert
    /// in Hugging Face checkpoints (names with `{j}`), one
    /// `[experts, rows, cols]` tensor per role in GGUF.
    ExpertGate,
    ExpertUp,
    ExpertDown,
    /// The shared expert's projections (Qwen2-MoE).
    SharedGate,
    SharedUp,
    SharedDown,
    /// The shared expert's sigmoid gate, `[1, hidden]`.
    SharedRouter,
    /// The output projection's bias, `[hidden]` (gpt-oss).
    OBias,
    /// One attention sink logit per query head, `[n_heads]` (gpt-oss).
    Sinks,
    /// The bias added to the router's logits, `[experts]` (gpt-oss; unlike
    /// [`Part::RouterBias`] it changes the weights too).
    RouterLogitBias,
    /// Every expert's gate, up and down biases: `[expert_ff]`,
    /// `[expert_ff]` and `[hidden]` per expert (gpt-oss).
    ExpertGateBias,
    ExpertUpBias,
    ExpertDownBias,
    /// Latent attention's low-rank query ([`mla::Mla::q_lora_rank`]):
    /// `[q_rank, hidden]`, its RMSNorm `[q_rank]`, and `[n_heads * (nope +
    /// rope), q_rank]`. The full-rank query is [`Part::Q`].
    QA,
    QANorm,
    QB,
    /// The latent and the rope key, `[kv_rank + rope, hidden]` (rows:
    /// latent, then rope key).
    KvA,
    /// The latent's RMSNorm, `[kv_rank]`.
    KvANorm,
    /// The latent's expansion into each head's `[k_nope | v]`:
    /// `[n_heads * (nope + v), kv_rank]`.
    KvB,
    /// The same split per head as llama.cpp's current converter writes it
    /// (GGUF only): `[n_heads, kv_rank, nope]` (each head's key rows of
    /// [`Part::KvB`], transposed) and `[n_heads, v, kv_rank]` (its value
    /// rows).
    KB,
    VB,
}

impl Part {
    /// One tensor per expert in a Hugging Face checkpoint (names with
    /// `{j}`), one `[experts, ..]` stack in GGUF.
    pub(crate) fn per_expert(self) -> bool {
        matches!(
            self,
            Self::ExpertGate
                | Self::ExpertUp
                | Self::ExpertDown
                | Self::ExpertGateBias
                | Self::ExpertUpBias
                | Self::ExpertDownBias
        )
    }
}

/// One decoder family: its names, how its configuration is read, and its
/// tensors.
pub(crate) struct Family {
    /// Short name (`gemma3`), shown by `--check-config`, `doctor` and
    /// `/v1/models`, and part of the prefix cache's model digest.
    pub name: &'static str,
    /// `(model_type, architectures[0])` pairs of its `config.json`.
    pub hf_types: &'static [(&'static str, &'static str)],
    /// Its `general.architecture` in GGUF (also the metadata key prefix).
    /// Families that share one are read by the first listed in
    /// `FAMILIES` (Mixtral's files say `llama`: the Llama family reads
    /// their experts).
    pub gguf_arch: &'static str,
    /// llama.cpp's converter permuted q/k rows for interleaved rope (only
    /// the `llama` architecture: every other family runs rotate-half).
    pub gguf_qk_permuted: bool,
    /// Added to every RMSNorm weight of a Hugging Face checkpoint (Gemma
    /// stores `w` and multiplies by `1 + w`; its GGUF files store `1 + w`).
    pub hf_norm_offset: f32,
    /// q/k/v and gate/up are fused tensors (Phi-3).
    pub fused: bool,
    /// Reads the family's own `config.json` keys into `cfg` (the common
    /// sizes are already there) and refuses what it cannot run.
    pub hf: fn(&HfConfig<'_>, &mut ModelConfig) -> Result<()>,
    /// The same from GGUF metadata (keys under `{gguf_arch}.`).
    pub gguf: fn(&GgufFile, &mut ModelConfig) -> Result<()>,
    /// Hugging Face tensor names (after `model.layers.{i}.`) that differ
    /// from Llama's.
    pub hf_name: fn(Part) -> Option<&'static str>,
    /// GGUF tensor names (after `blk.{i}.`) that differ from llama.cpp's
    /// usual ones for this architecture.
    pub gguf_name: fn(Part) -> Option<&'static str>,
    /// The family's attention rotates the leading part of each head only
    /// where its config says so (`partial_rotary_factor`,
    /// `rope.dimension_count`); elsewhere that is refused by name.
    pub partial_rotary: bool,
    /// The attention is latent ([`mla::Mla`]): the hooks read its sizes
    /// and restate `head_dim`, `rotary_dim` and `n_kv_heads` from them; the
    /// generic GGUF rule that the value length equals the key length, and
    /// the refusal of a rope narrower than the head, do not apply.
    pub latent_attention: bool,
    /// Hugging Face checkpoints store each layer's experts as transformers
    /// 5 holds them for gpt-oss: `gate_up_proj` `[experts, hidden,
    /// 2 expert_ff]` with gate and up in alternating columns,
    /// `down_proj` `[experts, expert_ff, hidden]` (both the transpose of a
    /// linear layer's weight), and their biases `[experts, 2 expert_ff]`
    /// and `[experts, hidden]`; instead of one tensor per expert and role.
    pub hf_fused_experts: bool,
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Family").field("name", &self.name).finish()
    }
}

impl Family {
    /// The family of a `config.json` `model_type` or class name.
    pub(crate) fn by_hf(model_type: Option<&str>, class: Option<&str>) -> Option<&'static Family> {
        FAMILIES.iter().copied().find(|f| {
            f.hf_types.iter().any(|(mt, cl)| match model_type {
                Some(t) => *mt == t,
                None => Some(*cl) == class,
            })
        })
    }

    /// The family of a GGUF `general.architecture`.
    pub(crate) fn by_gguf(arch: &str) -> Option<&'static Family> {
        FAMILIES.iter().copied().find(|f| f.gguf_arch == arch)
    }

    /// The family named `name` ([`ModelConfig::family`]).
    pub(crate) fn named(name: &str) -> Option<&'static Family> {
        FAMILIES.iter().copied().find(|f| f.name == name)
    }

    /// What is supported, for error messages: every `model_type` and
    /// every GGUF architecture accepted.
    pub(crate) fn supported() -> String {
        let types: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.hf_types.iter().map(|(mt, _)| *mt))
            .collect();
        let mut archs: Vec<&str> = Vec::new();
        for f in FAMILIES {
            if !archs.contains(&f.gguf_arch) {
                archs.push(f.gguf_arch);
            }
        }
        format!(
            "Hugging Face model types {}; GGUF architectures {}",
            types.join(", "),
            archs.join(", ")
        )
    }

    /// The tensor roles of layer `layer` of `cfg`.
    pub(crate) fn layer_parts(&self, cfg: &ModelConfig, layer: usize) -> Vec<Part> {
        let mut parts = vec![Part::AttnNorm, Part::MlpNorm, Part::O];
        match &cfg.mla {
            // GGUF's split `KB`/`VB` are read in place of `KvB` where a
            // file has them.
            Some(mla) => {
                match mla.q_lora_rank {
                    Some(_) => parts.extend([Part::QA, Part::QANorm, Part::QB]),
                    None => parts.push(Part::Q),
                }
                parts.extend([Part::KvA, Part::KvANorm, Part::KvB]);
            }
            None if self.fused => parts.push(Part::Qkv),
            None => parts.extend([Part::Q, Part::K, Part::V]),
        }
        match cfg.moe.as_ref().filter(|m| m.is_sparse(layer)) {
            Some(moe) => {
                parts.extend([
                    Part::Router,
                    Part::ExpertGate,
                    Part::ExpertUp,
                    Part::ExpertDown,
                ]);
                if moe.correction_bias {
                    parts.push(Part::RouterBias);
                }
                if moe.shared_ff.is_some() {
                    parts.extend([Part::SharedGate, Part::SharedUp, Part::SharedDown]);
                }
                if moe.shared_gate {
                    parts.push(Part::SharedRouter);
                }
                if moe.router_bias {
                    parts.push(Part::RouterLogitBias);
                }
                if moe.expert_bias {
                    parts.extend([
                        Part::ExpertGateBias,
                        Part::ExpertUpBias,
                        Part::ExpertDownBias,
                    ]);
                }
            }
            None if self.fused => parts.extend([Part::GateUp, Part::Down]),
            None => parts.extend([Part::Gate, Part::Up, Part::Down]),
        }
        if cfg.attention_bias {
            parts.extend([Part::QBias, Part::KBias, Part::VBias]);
        }
        if cfg.block.qk_norm {
            parts.extend([Part::QNorm, Part::KNorm]);
        }
        if cfg.block.sandwich_norms {
            parts.extend([Part::PostAttnNorm, Part::PostMlpNorm]);
        }
        if cfg.block.o_bias {
            parts.push(Part::OBias);
        }
        if cfg.block.attn_sinks {
            parts.push(Part::Sinks);
        }
        parts
    }
}

/// `{arch}.attention.sliding_window_pattern` of a GGUF file, as llama.cpp
/// writes it: a period `n` (every `n`-th layer global, the others sliding)
/// or one bool per layer (`true`: sliding); `None` when absent.
pub(crate) fn gguf_window_pattern(
    g: &GgufFile,
    arch: &str,
    n_layers: usize,
) -> Result<Option<Vec<LayerType>>> {
    use kvmesh_tokenizer::gguf::GgufValue;
    let key = format!("{arch}.attention.sliding_window_pattern");
    let bad = |reason: &str| crate::error::ModelError::InvalidField {
        path: g.path().to_owned(),
        field: key.clone(),
        value: "(the value in the file)".into(),
        reason: reason.to_owned(),
    };
    match g.get(&key) {
        None => Ok(None),
        Some(GgufValue::Array(flags)) => {
            if flags.len() != n_layers {
                return Err(bad(&format!("must have one entry per layer ({n_layers})")));
            }
            flags
                .iter()
                .map(|f| match f {
                    GgufValue::Bool(true) => Ok(LayerType::Sliding),
                    GgufValue::Bool(false) => Ok(LayerType::Full),
                    _ => Err(bad("expected a period or one bool per layer")),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some)
        }
        Some(_) => match g.opt_usize(&key)? {
            Some(period) if period > 0 => Ok(Some(gemma2::window_pattern(n_layers, period))),
            _ => Err(bad("expected a positive period or one bool per layer")),
        },
    }
}

/// The Llama name of a layer tensor in a Hugging Face checkpoint (after
/// `model.layers.{i}.`).
pub(crate) fn llama_hf_name(part: Part) -> &'static str {
    match part {
        Part::AttnNorm => "input_layernorm.weight",
        Part::Q => "self_attn.q_proj.weight",
        Part::K => "self_attn.k_proj.weight",
        Part::V => "self_attn.v_proj.weight",
        Part::Qkv => "self_attn.qkv_proj.weight",
        Part::O => "self_attn.o_proj.weight",
        Part::QBias => "self_attn.q_proj.bias",
        Part::KBias => "self_attn.k_proj.bias",
        Part::VBias => "self_attn.v_proj.bias",
        Part::QNorm => "self_attn.q_norm.weight",
        Part::KNorm => "self_attn.k_norm.weight",
        Part::PostAttnNorm => "post_attention_layernorm.weight",
        Part::MlpNorm => "post_attention_layernorm.weight",
        Part::Gate => "mlp.gate_proj.weight",
        Part::Up => "mlp.up_proj.weight",
        Part::GateUp => "mlp.gate_up_proj.weight",
        Part::Down => "mlp.down_proj.weight",
        Part::PostMlpNorm => "post_feedforward_layernorm.weight",
        Part::Router => "mlp.gate.weight",
        Part::RouterBias => "mlp.gate.e_score_correction_bias",
        Part::ExpertGate => "mlp.experts.{j}.gate_proj.weight",
        Part::ExpertUp => "mlp.experts.{j}.up_proj.weight",
        Part::ExpertDown => "mlp.experts.{j}.down_proj.weight",
        Part::SharedGate => "mlp.shared_expert.gate_proj.weight",
        Part::SharedUp => "mlp.shared_expert.up_proj.weight",
        Part::SharedDown => "mlp.shared_expert.down_proj.weight",
        Part::SharedRouter => "mlp.shared_expert_gate.weight",
        Part::OBias => "self_attn.o_proj.bias",
        Part::Sinks => "self_attn.sinks",
        Part::RouterLogitBias => "mlp.gate.bias",
        Part::ExpertGateBias => "mlp.experts.{j}.gate_proj.bias",
        Part::ExpertUpBias => "mlp.experts.{j}.up_proj.bias",
        Part::ExpertDownBias => "mlp.experts.{j}.down_proj.bias",
        Part::QA => "self_attn.q_a_proj.weight",
        Part::QANorm => "self_attn.q_a_layernorm.weight",
        Part::QB => "self_attn.q_b_proj.weight",
        Part::KvA => "self_attn.kv_a_proj_with_mqa.weight",
        Part::KvANorm => "self_attn.kv_a_layernorm.weight",
        Part::KvB => "self_attn.kv_b_proj.weight",
        // No checkpoint has these (llama.cpp's converter's names for the
        // halves of `kv_b_proj` before it maps them to GGUF's).
        Part::KB => "self_attn.k_b_proj.weight",
        Part::VB => "self_attn.v_b_proj.weight",
    }
}

/// The name of a layer tensor in GGUF (after `blk.{i}.`): llama.cpp names
/// one role the same in every architecture (a fused gate/up is its
/// `ffn_up`).
pub(crate) fn gguf_name(part: Part) -> &'static str {
    match part {
        Part::AttnNorm => "attn_norm.weight",
        Part::Q => "attn_q.weight",
        Part::K => "attn_k.weight",
        Part::V => "attn_v.weight",
        Part::Qkv => "attn_qkv.weight",
        Part::O => "attn_output.weight",
        Part::QBias => "attn_q.bias",
        Part::KBias => "attn_k.bias",
        Part::VBias => "attn_v.bias",
        Part::QNorm => "attn_q_norm.weight",
        Part::KNorm => "attn_k_norm.weight",
        Part::PostAttnNorm => "post_attention_norm.weight",
        Part::MlpNorm => "ffn_norm.weight",
        Part::Gate => "ffn_gate.weight",
        Part::Up | Part::GateUp => "ffn_up.weight",
        Part::Down => "ffn_down.weight",
        Part::PostMlpNorm => "post_ffw_norm.weight",
        Part::Router => "ffn_gate_inp.weight",
        Part::RouterBias => "exp_probs_b.bias",
        Part::ExpertGate => "ffn_gate_exps.weight",
        Part::ExpertUp => "ffn_up_exps.weight",
        Part::ExpertDown => "ffn_down_exps.weight",
        Part::SharedGate => "ffn_gate_shexp.weight",
        Part::SharedUp => "ffn_up_shexp.weight",
        Part::SharedDown => "ffn_down_shexp.weight",
        Part::SharedRouter => "ffn_gate_inp_shexp.weight",
        Part::OBias => "attn_output.bias",
        Part::Sinks => "attn_sinks.weight",
        Part::RouterLogitBias => "ffn_gate_inp.bias",
        Part::ExpertGateBias => "ffn_gate_exps.bias",
        Part::ExpertUpBias => "ffn_up_exps.bias",
        Part::ExpertDownBias => "ffn_down_exps.bias",
        Part::QA => "attn_q_a.weight",
        Part::QANorm => "attn_q_a_norm.weight",
        Part::QB => "attn_q_b.weight",
        Part::KvA => "attn_kv_a_mqa.weight",
        Part::KvANorm => "attn_kv_a_norm.weight",
        Part::KvB => "attn_kv_b.weight",
        Part::KB => "attn_k_b.weight",
        Part::VB => "attn_v_b.weight",
    }
}

#[cfg(test)]
mod tests;
