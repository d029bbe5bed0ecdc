//! Mixture-of-experts MLPs: the component that takes a layer's gated MLP
//! slot in Mixtral, Qwen2-MoE and Qwen3-MoE (and, behind the same switch,
//! the next MoE family).
//!
//! A sparse layer's MLP is a router (`[experts, hidden]`, f32 in every
//! GGUF llama.cpp writes), `experts` gated MLPs of `expert_ff` rows each,
//! and optionally one shared expert that every token passes through, scaled
//! by `sigmoid(gate . x)` where the family has that gate (Qwen2-MoE).
//!
//! Routing: each expert gets a score, the softmax of the router's logits
//! (Mixtral, Qwen) or their sigmoid (GLM-4.5, DeepSeek V3); or (gpt-oss)
//! the experts are chosen by their logits, plus the router's own bias, and
//! weighted by the softmax over the chosen logits only. The experts are
//! *chosen* by score plus a per-expert correction bias where the model has
//! one, first keeping the `topk_group` groups that score highest where
//! experts are grouped (a group's two best experts summed, or DeepSeek
//! V2's best expert alone), then the `top_k` best; each chosen
//! output is *weighted* by its score without the bias, renormalised over
//! the chosen ones where the family says so (Mixtral, Qwen3-MoE and GLM do,
//! Qwen2-MoE does not), times `routed_scale`. Dense layers (Qwen's
//! `mlp_only_layers` and `decoder_sparse_step`, GLM's leading
//! `first_k_dense_replace`) keep the plain MLP of `intermediate_size`.
//! gpt-oss's experts have biases on their gate, up and down projections.
//!
//! What the forward pass does with it is `crate::moe`; this module is the
//! description and how each source format states it.

use crate::config::hf::HfConfig;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::gguf::GgufFile;

/// More experts than any released model has by far (DeepSeek V3: 256);
/// a larger count means a corrupt file.
const MAX_EXPERTS: usize = 4096;

/// How the router's logits become expert scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over the experts.
    #[default]
    Softmax,
    /// Each logit's sigmoid.
    Sigmoid,
    /// The experts are chosen by logit; the chosen ones are weighted by the
    /// softmax over their logits alone (gpt-oss; llama.cpp's
    /// `softmax_weight` gating). Already normalised: `norm_top_k` does not
    /// apply.
    TopKSoftmax,
}

/// Experts chosen within groups (DeepSeek V2 and V3, GLM-4.5): `n_group`
/// equal groups, of which the `topk_group` that score highest are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    /// Groups the experts are split into, in order.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// How a group scores.
    pub score: GroupScore,
}

/// A group's score, from its experts' choice scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GroupScore {
    /// Its two best experts' sum (DeepSeek V3's `noaux_tc`, GLM-4.5; and
    /// what llama.cpp computes for every grouped model).
    #[default]
    TopTwoSum,
    /// Its best expert's (DeepSeek V2's `group_limited_greedy`).
    Max,
}

/// A model's mixture-of-experts MLPs (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Routed experts per sparse layer.
    pub n_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Rows of each expert's gate and up projections.
    pub expert_ff: usize,
    /// The chosen experts' probabilities are divided by their sum.
    pub norm_top_k: bool,
    /// Rows of the shared expert's gate and up projections, where there is
    /// one.
    pub shared_ff: Option<usize>,
    /// The shared expert's output is scaled by `sigmoid(gate . x)` (a
    /// `[hidden]` weight).
    pub shared_gate: bool,
    /// Which layers are sparse (one entry per layer); the others run the
    /// dense MLP of `intermediate_size`.
    pub sparse: Vec<bool>,
    /// How logits become scores.
    pub scoring: Scoring,
    /// A per-expert bias (`[experts]`) added to the scores to choose the
    /// experts, not to weight them.
    pub correction_bias: bool,
    /// Grouped choice, where the experts are grouped.
    pub groups: Option<Groups>,
    /// The chosen experts' weights are multiplied by this.
    pub routed_scale: f32,
    /// The router has a bias (`[experts]`) added to its logits, so to both
    /// the choice and the weights (gpt-oss).
    pub router_bias: bool,
    /// Every expert's gate, up and down projections have biases (gpt-oss).
    pub expert_bias: bool,
}

impl Moe {
    /// Whether layer `i` routes to experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse.get(layer).copied().unwrap_or(false)
    }

    /// The shape invariants the forward pass relies on; `field` names the
    /// source's expert-count key in errors.
    pub(crate) fn validate(&self, path: &std::path::Path, n_layers: usize) -> Result<()> {
        let invalid = |field: &str, value: String, reason: String| ModelError::InvalidField {
            path: path.to_owned(),
            field: field.to_owned(),
            value,
            reason,
        };
        if self.n_experts == 0 || self.n_experts > MAX_EXPERTS {
            return Err(invalid(
                "expert count",
                self.n_experts.to_string(),
                format!("must be between 1 and {MAX_EXPERTS}"),
            ));
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(invalid(
                "experts per token",
                self.top_k.to_string(),
                format!(
                    "must be between 1 and the expert count ({})",
                    self.n_experts
                ),
            ));
        }
        if self.expert_ff == 0 || self.shared_ff == Some(0) {
            return Err(invalid(
                "expert feed-forward length",
                "0".into(),
                "must be positive".into(),
            ));
        }
        if let Some(g) = self.groups {
            let per = self.n_experts / g.n_group.max(1);
            let least = match g.score {
                GroupScore::TopTwoSum => 2,
                GroupScore::Max => 1,
            };
            if g.n_group == 0
                || !self.n_experts.is_multiple_of(g.n_group)
                || per < least
                || g.topk_group == 0
                || g.topk_group > g.n_group
                || self.top_k > g.topk_group * per
            {
                return Err(invalid(
                    "expert groups",
                    format!("{} groups, {} kept", g.n_group, g.topk_group),
                    format!(
                        "must split the {} experts into equal groups of at least {least} and keep enough for {} per token",
                        self.n_experts, self.top_k
                    ),
                ));
            }
        }
        if !(self.routed_scale.is_finite() && self.routed_scale > 0.0) {
            return Err(invalid(
                "routed scaling factor",
                self.routed_scale.to_string(),
                "must be a positive number".into(),
            ));
        }
        if self.sparse.len() != n_layers {
            return Err(invalid(
                "sparse layers",
                format!("{} entries", self.sparse.len()),
                format!("must have one entry per layer ({n_layers})"),
            ));
        }
        Ok(())
    }
}

/// How a family's `config.json` states its experts.
pub(crate) struct HfKeys {
    /// The expert count's keys, the first present wins (`num_experts`,
    /// and `num_local_experts`, which transformers 5 writes for Qwen3-MoE
    /// as it does for Mixtral).
    pub experts: &'static [&'static str],
    /// The expert width's key; `None`: `intermediate_size` (Mixtral).
    pub expert_ff: Option<&'static str>,
    /// The shared expert's width key, where the family has one (with its
    /// sigmoid gate).
    pub shared_ff: Option<&'static str>,
    /// `norm_top_k` when `norm_topk_prob` is absent (Mixtral has no key and
    /// always renormalises).
    pub norm_default: bool,
    /// The shared experts' count key (GLM's `n_shared_experts`: that many
    /// experts' width, ungated), where the family counts them.
    pub shared_count: Option<&'static str>,
    /// The leading dense layers' key (`first_k_dense_replace`).
    pub first_dense: Option<&'static str>,
    /// Sigmoid scores with a correction bias (GLM-4.5, DeepSeek V3), else
    /// softmax.
    pub sigmoid: bool,
}

/// Read the experts from `config.json`: a layer is sparse unless it is in
/// `mlp_only_layers`, or `decoder_sparse_step` skips it (transformers'
/// rule: sparse when `(i + 1) % step == 0`).
pub(crate) fn from_hf(hf: &HfConfig<'_>, cfg: &mut ModelConfig, keys: &HfKeys) -> Result<()> {
    let mut n_experts = None;
    for key in keys.experts {
        if let Some(n) = hf.opt_usize(key)? {
            n_experts = Some(n);
            break;
        }
    }
    let n_experts = n_experts.ok_or_else(|| hf.missing(keys.experts[0]))?;
    let top_k = hf.req_usize("num_experts_per_tok")?;
    let expert_ff = match keys.expert_ff {
        Some(k) => hf.req_usize(k)?,
        None => cfg.intermediate_size,
    };
    let gated_shared = match keys.shared_ff {
        Some(k) => hf.opt_usize(k)?.filter(|&n| n > 0),
        None => None,
    };
    let counted_shared = match keys.shared_count {
        Some(k) => hf.opt_usize(k)?.filter(|&n| n > 0).map(|n| n * expert_ff),
        None => None,
    };
    let first_dense = match keys.first_dense {
        Some(k) => hf.opt_usize(k)?.unwrap_or(0),
        None => 0,
    };
    let groups = match hf.opt_usize("n_group")? {
        Some(n) if n > 1 => Some(Groups {
            n_group: n,
            topk_group: hf.opt_usize("topk_group")?.unwrap_or(n),
            score: GroupScore::TopTwoSum,
        }),
        _ => None,
    };
    let norm_top_k = hf.opt_bool("norm_topk_prob")?.unwrap_or(keys.norm_default);
    let step = hf.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(hf.invalid("decoder_sparse_step", "0".into(), "must be positive".into()));
    }
    let dense_only = match hf.get("mlp_only_layers") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .map(|v| {
                v.as_u64().map(|i| i as usize).ok_or_else(|| {
                    hf.invalid(
                        "mlp_only_layers",
                        v.to_string(),
                        "expected layer indices".into(),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
        Some(v) => {
            return Err(hf.invalid(
                "mlp_only_layers",
                v.to_string(),
                "expected a list of layer indices".into(),
            ))
        }
    };
    hf.refuse_true("output_router_logits", "router logits as an output")?;
    cfg.moe = Some(Moe {
        n_experts,
        top_k,
        expert_ff,
        norm_top_k,
        shared_ff: gated_shared.or(counted_shared),
        shared_gate: gated_shared.is_some(),
        sparse: (0..cfg.n_layers)
            .map(|i| i >= first_dense && !dense_only.contains(&i) && (i + 1) % step == 0)
            .collect(),
        scoring: if keys.sigmoid {
            Scoring::Sigmoid
        } else {
            Scoring::Softmax
        },
        correction_bias: keys.sigmoid,
        groups,
        routed_scale: hf.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
        router_bias: false,
        expert_bias: false,
    });
    Ok(())
}

/// Read the experts from GGUF metadata as llama.cpp's converter writes
/// them: `{arch}.expert_count`, `.expert_used_count`,
/// `.expert_feed_forward_length` (else `.feed_forward_length`), the shared
/// expert's `.expert_shared_feed_forward_length` (gated where the file has
/// `ffn_gate_inp_shexp` tensors) or `.expert_shared_count` experts' width,
/// `.expert_weights_norm` (else `norm_default`, llama.cpp's choice for the
/// architecture), `.expert_gating_func` (1 softmax, 2 sigmoid; else
/// softmax), `.expert_weights_scale`, and `.expert_group_count` with
/// `.expert_group_used_count`. A layer is sparse when it has a router
/// tensor (`blk.{i}.ffn_gate_inp.weight`), so leading dense layers need no
/// key; the correction bias is the `blk.{i}.exp_probs_b.bias` tensor, the
/// router's logit bias `ffn_gate_inp.bias`, the experts' biases
/// `ffn_{gate,up,down}_exps.bias` (gpt-oss).
/// Leaves `cfg.moe` unset when the file has no experts.
pub(crate) fn from_gguf(g: &GgufFile, cfg: &mut ModelConfig, norm_default: bool) -> Result<()> {
    let key = |k: &str| format!("{}.{k}", cfg.architecture);
    let n_experts = g.opt_usize(&key("expert_count"))?.unwrap_or(0);
    if n_experts == 0 {
        return Ok(());
    }
    let expert_ff = g
        .opt_usize(&key("expert_feed_forward_length"))?
        .unwrap_or(cfg.intermediate_size);
    let shared_ff = match g
        .opt_usize(&key("expert_shared_feed_forward_length"))?
        .filter(|&n| n > 0)
    {
        Some(n) => Some(n),
        None => g
            .opt_usize(&key("expert_shared_count"))?
            .filter(|&n| n > 0)
            .map(|n| n * expert_ff),
    };
    let any_layer =
        |suffix: &str| (0..cfg.n_layers).any(|i| g.has_tensor(&format!("blk.{i}.{suffix}")));
    let scoring = match g.opt_usize(&key("expert_gating_func"))? {
        None | Some(1) => Scoring::Softmax,
        Some(2) => Scoring::Sigmoid,
        Some(other) => {
            return Err(g
                .invalid_field(
                    &key("expert_gating_func"),
                    other.to_string(),
                    "supported: 1 (softmax) and 2 (sigmoid)",
                )
                .into())
        }
    };
    let groups = match g.opt_usize(&key("expert_group_count"))? {
        Some(n) if n > 1 => Some(Groups {
            n_group: n,
            topk_group: g.opt_usize(&key("expert_group_used_count"))?.unwrap_or(n),
            // llama.cpp sums a group's two best for every architecture;
            // DeepSeek V2's files are told apart by their family's hook.
            score: GroupScore::TopTwoSum,
        }),
        _ => None,
    };
    cfg.moe = Some(Moe {
        n_experts,
        top_k: g
            .opt_usize(&key("expert_used_count"))?
            .ok_or_else(|| g.missing_field(&key("expert_used_count")))?,
        expert_ff,
        norm_top_k: g
            .opt_bool(&key("expert_weights_norm"))?
            .unwrap_or(norm_default),
        shared_ff,
        shared_gate: shared_ff.is_some() && any_layer("ffn_gate_inp_shexp.weight"),
        sparse: (0..cfg.n_layers)
            .map(|i| g.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect(),
        scoring,
        correction_bias: any_layer("exp_probs_b.bias"),
        groups,
        routed_scale: g.opt_f32(&key("expert_weights_scale"))?.unwrap_or(1.0),
        router_bias: any_layer("ffn_gate_inp.bias"),
        expert_bias: any_layer("ffn_gate_exps.bias"),
    });
    Ok(())
}

/// A GGUF file whose architecture kvmesh reads without experts, but which
/// has them, is refused by name rather than loaded as a dense model.
pub(crate) fn refuse_unread_experts(g: &GgufFile, cfg: &ModelConfig) -> Result<()> {
    let key = format!("{}.expert_count", cfg.architecture);
    if cfg.moe.is_none() && g.opt_usize(&key)?.is_some_and(|n| n > 0) {
        return Err(ModelError::UnsupportedArchitecture {
            path: g.path().to_owned(),
            architecture: format!("{} with experts ({key})", cfg.architecture),
        });
    }
    Ok(())
}
