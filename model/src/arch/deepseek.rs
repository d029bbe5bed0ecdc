//! DeepSeek V2 (`deepseek_v2`) and V3 (`deepseek_v3`): multi-head latent
//! attention ([`super::mla`]) and, from layer `first_k_dense_replace` on,
//! a mixture of experts beside `n_shared_experts` experts' width of
//! ungated shared expert ([`super::moe`]). What the configuration says is
//! read as transformers 5.24 runs it (`modeling_deepseek_v2.py`,
//! `modeling_deepseek_v3.py`), and refused where it cannot be described.
//!
//! # The two routings
//! - V2: softmax scores; `topk_method` `greedy` (the top-k of all experts)
//!   or `group_limited_greedy` (the `topk_group` of `n_group` groups whose
//!   best expert scores highest, then the top-k of those:
//!   [`GroupScore::Max`]); the chosen scores times `routed_scaling_factor`,
//!   never renormalised (transformers drops `norm_topk_prob`; DeepSeek's
//!   own code honours it, so `true` is refused rather than guessed).
//! - V3 (`noaux_tc`): sigmoid scores; experts chosen by score plus
//!   `e_score_correction_bias` within the `topk_group` of `n_group` groups
//!   whose two best score highest ([`GroupScore::TopTwoSum`]), weighted by
//!   their scores, renormalised where `norm_topk_prob` (its default), times
//!   `routed_scaling_factor`.
//!
//! Absent keys take transformers' class defaults (V3: 8 groups of which 4
//! kept, renormalised, scale 2.5, 3 dense layers, 1 shared expert; V2: no
//! groups, scale 1, no dense layers, 2 shared experts); the sizes that
//! define the model (`kv_lora_rank`, `qk_*_head_dim`, `v_head_dim`,
//! `q_lora_rank`, the experts' count and width) are required.
//!
//! # The softmax scale
//! `(qk_nope + qk_rope)^-0.5`, times `mscale^2` where the rope parameters
//! are not `default` and give `mscale_all_dim`: `mscale = 0.1
//! mscale_all_dim ln(factor) + 1` (transformers' `yarn_apply_mscale`;
//! llama.cpp's `kq_scale` in `deepseek2.cpp`). Computed in f64 as Python
//! does, then rounded to f32 as torch multiplies by it.
//!
//! # GGUF (`deepseek2`, both versions)
//! llama.cpp's converter writes `attention.kv_lora_rank`,
//! `attention.q_lora_rank` (the low-rank query; its `attn_q_a` tensors tell
//! it apart), `rope.dimension_count` (the rope part), and the head sizes in
//! one of two forms: the current one (`attention.key_length_mla` and
//! `value_length_mla` per head, `key_length`/`value_length` the latent
//! entry's `kv_lora_rank + rope` and `kv_lora_rank`, `attn_k_b`/`attn_v_b`
//! tensors) or the older one (`key_length`/`value_length` per head, one
//! `attn_kv_b` tensor). A file whose gating is sigmoid (`expert_gating_func`
//! 2) is V3's routing and is named `deepseek_v3`; softmax files are V2's,
//! whose groups score by their best expert as V2's `group_limited_greedy`
//! does (llama.cpp's graph sums a group's two best for every model; the
//! file does not say which V2 used). YaRN: the converter stores `0.1
//! mscale_all_dim` as `rope.scaling.yarn_log_multiplier`; as llama.cpp
//! reads it for `deepseek2`, cos and sin are unscaled where it is given
//! (else scaled by `0.1 ln(factor) + 1`) and the softmax scale is
//! `(magnitude (1 + log_mul ln(factor)))^2 / sqrt(qk_nope + qk_rope)`.
//! Rope pairs are interleaved (llama.cpp's "normal" rope on unpermuted
//! weights), whatever `rope_interleave` the checkpoint had.

use kvmesh_kernels::rope::{RopeLayout, RopeScaling};

use super::mla::Mla;
use super::moe::{GroupScore, Groups, Moe, Scoring};
use super::{Activation, Family, Part};
use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::loader::gguf::GgufFile;

pub(crate) const V2: Family = Family {
    name: "deepseek_v2",
    hf_types: &[("deepseek_v2", "DeepseekV2ForCausalLM")],
    gguf_arch: "deepseek2",
    gguf_qk_permuted: false,
    hf_norm_offset: 0.0,
    fused: false,
    hf: |hf, cfg| hf_config(hf, cfg, Version::V2),
    gguf: gguf_config,
    hf_name,
    gguf_name: |_| None,
    partial_rotary: false,
    hf_fused_experts: false,
    latent_attention: true,
};

pub(crate) const V3: Family = Family {
    name: "deepseek_v3",
    hf_types: &[("deepseek_v3", "DeepseekV3ForCausalLM")],
    // Read through V2's entry (the first listed), which names V3's
    // routing `deepseek_v3`.
    gguf_arch: "deepseek2",
    hf: |hf, cfg| hf_config(hf, cfg, Version::V3),
    ..V2
};

fn hf_name(part: Part) -> Option<&'static str> {
    match part {
        Part::SharedGate => Some("mlp.shared_experts.gate_proj.weight"),
        Part::SharedUp => Some("mlp.shared_experts.up_proj.weight"),
        Part::SharedDown => Some("mlp.shared_experts.down_proj.weight"),
        _ => None,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Version {
    V2,
    V3,
}

/// transformers' class defaults for the routing keys a checkpoint may
/// omit.
struct Defaults {
    shared: usize,
    first_dense: usize,
    routed_scale: f32,
}

impl Version {
    fn defaults(self) -> Defaults {
        match self {
            Self::V2 => Defaults {
                shared: 2,
                first_dense: 0,
                routed_scale: 1.0,
            },
            Self::V3 => Defaults {
                shared: 1,
                first_dense: 3,
                routed_scale: 2.5,
            },
        }
    }
}

fn hf_config(hf: &HfConfig<'_>, cfg: &mut ModelConfig, version: Version) -> Result<()> {
    hf.require_activation(Activation::Silu)?;
    hf.refuse_true("attention_bias", "biases on the attention projections")?;
    hf.refuse_true("mlp_bias", "MLP biases")?;
    // transformers repeats the expanded keys and values by
    // `num_attention_heads / num_key_value_heads`: only equal counts run.
    if let Some(kv) = hf
        .opt_usize("num_key_value_heads")?
        .filter(|&kv| kv != cfg.n_heads)
    {
        return Err(hf.invalid(
            "num_key_value_heads",
            kv.to_string(),
            format!(
                "latent attention expands keys and values for every head: must equal num_attention_heads ({})",
                cfg.n_heads
            ),
        ));
    }
    // Absent is transformers' default of 1536, null the full-rank query:
    // a size that defines the model, so it must be written either way.
    let q_lora_rank = match hf.get("q_lora_rank") {
        None => return Err(hf.missing("q_lora_rank")),
        Some(serde_json::Value::Null) => None,
        Some(_) => Some(hf.req_usize("q_lora_rank")?),
    };
    let rope_layout = match version {
        Version::V2 => RopeLayout::Interleaved,
        Version::V3 => match hf.opt_bool("rope_interleave")?.unwrap_or(true) {
            true => RopeLayout::Interleaved,
            false => RopeLayout::RotateHalf,
        },
    };
    let mla = Mla {
        q_lora_rank,
        kv_lora_rank: hf.req_usize("kv_lora_rank")?,
        qk_nope_dim: hf.req_usize("qk_nope_head_dim")?,
        qk_rope_dim: hf.req_usize("qk_rope_head_dim")?,
        v_head_dim: hf.req_usize("v_head_dim")?,
        rope_layout,
    };
    let mscale_all_dim = rope_param(hf, "mscale_all_dim")?;
    let scale = softmax_scale(
        mla.qk_head_dim(),
        scaling_factor(cfg.rope_scaling)
            .zip(mscale_all_dim)
            .map(|(factor, m)| yarn_mscale(factor, m)),
    );
    set_latent(cfg, mla, scale);
    moe_from_hf(hf, cfg, version)
}

/// The common fields latent attention restates, and the softmax scale.
fn set_latent(cfg: &mut ModelConfig, mla: Mla, scale: f32) {
    cfg.head_dim = mla.qk_head_dim();
    cfg.rotary_dim = mla.qk_rope_dim;
    cfg.n_kv_heads = 1;
    cfg.block.attn_scale = scale;
    cfg.mla = Some(mla);
}

/// `qk_head_dim^-0.5 * mscale^2` in f64, rounded to f32 (see the module
/// docs).
fn softmax_scale(qk_head_dim: usize, mscale: Option<f64>) -> f32 {
    let m = mscale.unwrap_or(1.0);
    ((qk_head_dim as f64).powf(-0.5) * m * m) as f32
}

/// transformers' `yarn_get_mscale(factor, mscale_all_dim)`; 1 where the
/// factor does not extend the context.
fn yarn_mscale(factor: f64, mscale_all_dim: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale_all_dim * factor.ln() + 1.0
    }
}

/// The factor of a rope scaling other than the default (transformers'
/// `yarn_apply_mscale` applies to every non-default type).
fn scaling_factor(scaling: RopeScaling) -> Option<f64> {
    match scaling {
        RopeScaling::None => None,
        RopeScaling::Linear { factor } | RopeScaling::Llama3 { factor, .. } => {
            Some(f64::from(factor))
        }
        RopeScaling::Yarn(y) => Some(y.factor),
    }
}

/// A number of the rope parameters (transformers 5's `rope_parameters`,
/// else the older `rope_scaling`); `None` where absent, null or 0
/// (transformers' `if mscale_all_dim:`).
fn rope_param(hf: &HfConfig<'_>, key: &str) -> Result<Option<f64>> {
    for outer in ["rope_parameters", "rope_scaling"] {
        let Some(serde_json::Value::Object(obj)) = hf.get(outer) else {
            continue;
        };
        return match obj.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(0.0) => Ok(None),
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(hf.invalid(
                    &format!("{outer}.{key}"),
                    v.to_string(),
                    "expected a number".into(),
                )),
            },
        };
    }
    Ok(None)
}

/// The experts, as transformers' `DeepseekV2Moe` and `DeepseekV3MoE` run
/// them (see the module docs).
fn moe_from_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig, version: Version) -> Result<()> {
    let d = version.defaults();
    let n_experts = hf.req_usize("n_routed_experts")?;
    let expert_ff = hf.req_usize("moe_intermediate_size")?;
    let shared = hf.opt_usize("n_shared_experts")?.unwrap_or(d.shared);
    let first_dense = hf
        .opt_usize("first_k_dense_replace")?
        .unwrap_or(d.first_dense);
    if let Some(freq) = hf.opt_usize("moe_layer_freq")?.filter(|&f| f != 1) {
        return Err(hf.invalid(
            "moe_layer_freq",
            freq.to_string(),
            "transformers runs experts on every layer from first_k_dense_replace on: only 1 is implemented".into(),
        ));
    }
    hf.refuse_true("output_router_logits", "router logits as an output")?;
    let (want_scoring, scoring) = match version {
        Version::V2 => ("softmax", Scoring::Softmax),
        Version::V3 => ("sigmoid", Scoring::Sigmoid),
    };
    if let Some(s) = hf.opt_str("scoring_func")?.filter(|&s| s != want_scoring) {
        return Err(hf.invalid(
            "scoring_func",
            format!("{s:?}"),
            format!("transformers' {} scores by {want_scoring} only", cfg.family),
        ));
    }
    let topk_method = hf.opt_str("topk_method")?;
    let (groups, norm_top_k) = match version {
        Version::V2 => {
            if hf.opt_bool("norm_topk_prob")? == Some(true) {
                return Err(hf.invalid(
                    "norm_topk_prob",
                    "true".into(),
                    "transformers' DeepSeek-V2 never renormalises while DeepSeek's own code does; no released V2 sets it".into(),
                ));
            }
            let groups = match topk_method.unwrap_or("greedy") {
                "greedy" => None,
                "group_limited_greedy" => Some(Groups {
                    n_group: hf.req_usize("n_group")?,
                    topk_group: hf.req_usize("topk_group")?,
                    score: GroupScore::Max,
                }),
                other => {
                    return Err(hf.invalid(
                        "topk_method",
                        format!("{other:?}"),
                        "supported for deepseek_v2: greedy, group_limited_greedy".into(),
                    ))
                }
            };
            (groups, false)
        }
        Version::V3 => {
            if let Some(other) = topk_method.filter(|&m| m != "noaux_tc") {
                return Err(hf.invalid(
                    "topk_method",
                    format!("{other:?}"),
                    "transformers' DeepSeek-V3 routes by noaux_tc only".into(),
                ));
            }
            let n_group = hf.opt_usize("n_group")?.unwrap_or(8);
            let groups = (n_group > 1)
                .then(|| -> Result<Groups> {
                    Ok(Groups {
                        n_group,
                        topk_group: hf.opt_usize("topk_group")?.unwrap_or(4),
                        score: GroupScore::TopTwoSum,
                    })
                })
                .transpose()?;
            (groups, hf.opt_bool("norm_topk_prob")?.unwrap_or(true))
        }
    };
    cfg.moe = Some(Moe {
        n_experts,
        top_k: hf.req_usize("num_experts_per_tok")?,
        expert_ff,
        norm_top_k,
        shared_ff: (shared > 0).then(|| shared * expert_ff),
        shared_gate: false,
        sparse: (0..cfg.n_layers).map(|i| i >= first_dense).collect(),
        scoring,
        correction_bias: version == Version::V3,
        groups,
        routed_scale: hf
            .opt_f32("routed_scaling_factor")?
            .unwrap_or(d.routed_scale),
        router_bias: false,
        expert_bias: false,
    });
    Ok(())
}

/// `deepseek2` GGUF metadata (see the module docs).
fn gguf_config(g: &GgufFile, cfg: &mut ModelConfig) -> Result<()> {
    let arch = cfg.architecture.clone();
    let key = |k: &str| format!("{arch}.{k}");
    let kv_lora_rank = g.req_usize(&key("attention.kv_lora_rank"))?;
    let rope = g.req_usize(&key("rope.dimension_count"))?;
    let (qk_head, v_head) = match g.opt_usize(&key("attention.key_length_mla"))? {
        Some(k) => {
            // The current converter: the plain keys give the cache entry.
            for (field, expected) in [
                ("attention.key_length", kv_lora_rank + rope),
                ("attention.value_length", kv_lora_rank),
            ] {
                if let Some(v) = g.opt_usize(&key(field))?.filter(|&v| v != expected) {
                    return Err(g
                        .invalid_field(
                            &key(field),
                            v.to_string(),
                            format!(
                                "with {} given, must be the latent entry's {expected}",
                                key("attention.key_length_mla")
                            ),
                        )
                        .into());
                }
            }
            (k, g.req_usize(&key("attention.value_length_mla"))?)
        }
        None => (
            g.req_usize(&key("attention.key_length"))?,
            g.req_usize(&key("attention.value_length"))?,
        ),
    };
    let qk_nope_dim = qk_head
        .checked_sub(rope)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            g.invalid_field(
                &key("attention.key_length_mla"),
                qk_head.to_string(),
                format!("must exceed {} ({rope})", key("rope.dimension_count")),
            )
        })?;
    let q_lora_rank = if g.has_tensor("blk.0.attn_q_a.weight") {
        Some(g.req_usize(&key("attention.q_lora_rank"))?)
    } else {
        None
    };
    let mla = Mla {
        q_lora_rank,
        kv_lora_rank,
        qk_nope_dim,
        qk_rope_dim: rope,
        v_head_dim: v_head,
        rope_layout: RopeLayout::Interleaved,
    };
    // llama.cpp's deepseek2 YaRN (`llama-context.cpp`, `deepseek2.cpp`).
    let mut mscale = None;
    if let RopeScaling::Yarn(y) = &mut cfg.rope_scaling {
        let log_mul = g
            .opt_f32(&key("rope.scaling.yarn_log_multiplier"))?
            .filter(|&m| m != 0.0)
            .map(f64::from);
        let magnitude = match log_mul {
            Some(_) => 1.0,
            None => yarn_mscale(y.factor, 1.0),
        };
        y.attention_factor = magnitude as f32;
        let ln = if y.factor > 1.0 { y.factor.ln() } else { 0.0 };
        mscale = Some(magnitude * (1.0 + log_mul.unwrap_or(0.0) * ln));
    }
    set_latent(cfg, mla, softmax_scale(qk_head, mscale));
    super::moe::from_gguf(g, cfg, false)?;
    if let Some(moe) = cfg.moe.as_mut() {
        match moe.scoring {
            Scoring::Sigmoid => cfg.family = V3.name,
            _ => {
                if let Some(groups) = moe.groups.as_mut() {
                    groups.score = GroupScore::Max;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
