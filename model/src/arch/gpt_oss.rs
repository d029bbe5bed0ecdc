//! gpt-oss (`gpt_oss`; GGUF `gpt-oss`): attention sinks (one learned logit
//! per query head in every softmax), biases on q, k, v and o, sliding and
//! full layers alternating (layer 0 sliding), YaRN rope without rounding
//! the ramp's bounds (`truncate: false`), and in every layer a mixture of
//! experts: chosen by the router's logits plus its bias, weighted by the
//! softmax over the chosen logits ([`moe::Scoring::TopKSoftmax`]), each
//! expert's projections biased, with the clamped SwiGLU
//! ([`Activation::SwigluOai`]).
//!
//! transformers 5 saves the experts fused ([`Family::hf_fused_experts`]);
//! llama.cpp's converter splits gate and up into `ffn_gate_exps` and
//! `ffn_up_exps` with their `.bias` stacks, and names the pre-MLP norm
//! `post_attention_norm`. Converted from the MXFP4 release, its expert
//! stacks are MXFP4 (kept in their blocks in the quantized mode) and the
//! other matrices BF16. A GGUF whose experts' gate and up are one
//! `ffn_gate_up_exps` stack loads too (`weights::gate_up`).
//!
//! Where a file leaves a key out, the reference that reads the format
//! decides: transformers' `GptOssConfig` (window 128, alpha 1.702, limit
//! 7, q/k/v/o biases) for `config.json`; llama.cpp for GGUF, which writes
//! neither alpha nor the limit (it fixes the same two) nor the window
//! pattern (every other layer, from 0) nor the gating (softmax over the
//! chosen). Two departures from llama.cpp, both to equal the model as
//! trained (OpenAI's reference and transformers): YaRN's ramp is not
//! rounded (ggml rounds it), and a file may state the SwiGLU's
//! `{arch}.swiglu_alpha` and `{arch}.swiglu_limit` (kvmesh's own test
//! files do; llama.cpp's have neither).

use super::gemma2::window_pattern;
use super::moe::{self, HfKeys, Scoring};
use super::{Activation, Family, Part};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;
use kvmesh_kernels::rope::{yarn_attention_factor, RopeScaling, Yarn};

/// `GptOssConfig`'s defaults.
const DEFAULT_WINDOW: usize = 128;
const DEFAULT_THETA: f32 = 150_000.0;
/// Its YaRN when `rope_parameters` is absent: factor 32 over 4,096
/// positions, betas 32 and 1, unrounded.
const DEFAULT_YARN_FACTOR: f64 = 32.0;
const DEFAULT_YARN_ORIGINAL: usize = 4096;
const DEFAULT_ALPHA: f32 = 1.702;
const DEFAULT_LIMIT: f32 = 7.0;

pub(crate) const FAMILY: Family = Family {
    name: "gpt_oss",
    hf_types: &[("gpt_oss", "GptOssForCausalLM")],
    gguf_arch: "gpt-oss",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: gpt_oss_hf,
    gguf: gpt_oss_gguf,
    hf_name: |part| match part {
        Part::Router => Some("mlp.router.weight"),
        Part::RouterLogitBias => Some("mlp.router.bias"),
        Part::ExpertGate | Part::ExpertUp => Some("mlp.experts.gate_up_proj"),
        Part::ExpertGateBias | Part::ExpertUpBias => Some("mlp.experts.gate_up_proj_bias"),
        Part::ExpertDown => Some("mlp.experts.down_proj"),
        Part::ExpertDownBias => Some("mlp.experts.down_proj_bias"),
        _ => None,
    },
    gguf_name: |part| match part {
        Part::MlpNorm => Some("post_attention_norm.weight"),
        _ => None,
    },
    partial_rotary: false,
    hf_fused_experts: true,
    latent_attention: false,
};

fn gpt_oss_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig) -> Result<()> {
    hf.require_activation(Activation::Silu)?;
    if let Some(q) = hf.get("quantization_config").filter(|v| !v.is_null()) {
        // The released checkpoints keep their experts in MXFP4 blocks
        // (`*_blocks`, `*_scales`), in another nibble order than GGUF's and
        // with gate and up rows interleaved: this reader does not repack
        // them (their GGUF conversion's MXFP4 experts are read).
        return Err(hf.invalid(
            "quantization_config",
            q.to_string().chars().take(80).collect(),
            "quantized safetensors are not read: use a bf16/f32 checkpoint or a GGUF file".into(),
        ));
    }
    // One switch biases q, k, v and o.
    let bias = hf.opt_bool("attention_bias")?.unwrap_or(true);
    cfg.attention_bias = bias;
    cfg.block.o_bias = bias;
    cfg.block.attn_sinks = true;
    cfg.block.activation = Activation::SwigluOai {
        alpha: positive(hf.opt_f32("swiglu_alpha")?, "swiglu_alpha", hf.path)?
            .unwrap_or(DEFAULT_ALPHA),
        limit: positive(hf.opt_f32("swiglu_limit")?, "swiglu_limit", hf.path)?
            .unwrap_or(DEFAULT_LIMIT),
    };
    if hf.get("sliding_window").is_none() {
        cfg.sliding_window = Some(DEFAULT_WINDOW);
    }
    // Without any rope keys transformers runs its default YaRN on base
    // 150,000, not unscaled rope on 10,000 (the generic reader's default).
    let absent = |k: &str| hf.get(k).is_none_or(serde_json::Value::is_null);
    if absent("rope_parameters") && absent("rope_scaling") {
        if absent("rope_theta") {
            cfg.rope_theta = DEFAULT_THETA;
        }
        cfg.rope_scaling = RopeScaling::Yarn(Yarn {
            factor: DEFAULT_YARN_FACTOR,
            original_max_position_embeddings: DEFAULT_YARN_ORIGINAL,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            attention_factor: yarn_attention_factor(DEFAULT_YARN_FACTOR, None, None),
        });
    }
    if cfg.layer_types.is_empty() {
        cfg.layer_types = window_pattern(cfg.n_layers, 2);
    }
    moe::from_hf(
        hf,
        cfg,
        &HfKeys {
            experts: &["num_local_experts", "num_experts"],
            expert_ff: None,
            shared_ff: None,
            norm_default: false,
            shared_count: None,
            first_dense: None,
            sigmoid: false,
        },
    )?;
    gpt_oss_routing(cfg);
    Ok(())
}

fn gpt_oss_gguf(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    let arch = cfg.architecture.clone();
    let key = |k: &str| format!("{arch}.{k}");
    cfg.attention_bias = g.has_tensor("blk.0.attn_q.bias");
    cfg.block.o_bias = g.has_tensor("blk.0.attn_output.bias");
    cfg.block.attn_sinks = true;
    let stated = |k: &str| -> Result<Option<f32>> {
        match g.opt_f32(&key(k))? {
            Some(x) if !(x.is_finite() && x > 0.0) => Err(g
                .invalid_field(&key(k), x.to_string(), "must be positive")
                .into()),
            x => Ok(x),
        }
    };
    cfg.block.activation = Activation::SwigluOai {
        alpha: stated("swiglu_alpha")?.unwrap_or(DEFAULT_ALPHA),
        limit: stated("swiglu_limit")?.unwrap_or(DEFAULT_LIMIT),
    };
    if cfg.sliding_window.is_some() {
        cfg.layer_types = super::gguf_window_pattern(g, &cfg.architecture, cfg.n_layers)?
            .unwrap_or_else(|| window_pattern(cfg.n_layers, 2));
    }
    if let RopeScaling::Yarn(y) = &mut cfg.rope_scaling {
        y.truncate = false;
    }
    moe::from_gguf(g, cfg, false)?;
    if cfg.moe.is_none() {
        return Err(ModelError::UnsupportedArchitecture {
            path: g.path().to_owned(),
            architecture: format!(
                "{} without experts ({})",
                cfg.architecture,
                key("expert_count")
            ),
        });
    }
    gpt_oss_routing(cfg);
    Ok(())
}

/// The routing every gpt-oss file has, whatever its keys say: chosen by
/// biased logit, weighted by the softmax over the chosen, every layer's
/// router and experts biased.
fn gpt_oss_routing(cfg: &mut ModelConfig) {
    if let Some(m) = cfg.moe.as_mut() {
        m.scoring = Scoring::TopKSoftmax;
        m.norm_top_k = false;
        m.router_bias = true;
        m.expert_bias = true;
    }
}

/// `value` where it is a positive finite number; `field` names it.
fn positive(value: Option<f32>, field: &str, path: &std::path::Path) -> Result<Option<f32>> {
    match value {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value: x.to_string(),
            reason: "must be a positive number".into(),
        }),
        x => Ok(x),
    }
}
