//! Mixture-of-experts MLPs: the component that takes a layer's gated MLP
//! slot in Mixtral, Qwen2-MoE and Qwen3-MoE (and, behind the same switch,
//! the next MoE family).
//!
//! A sparse layer's MLP is a router (`[experts, hidden]`, f32 in every
//! GGUF llama.cpp writes), `experts` gated MLPs of `expert_ff` rows each,
//! and optionally one shared expert that every token passes through, scaled
//! by `sigmoid(gate . x)` where the family has that gate (Qwen2-MoE). Each
//! token goes to the `top_k` experts of highest softmax probability, each
//! output weighted by its probability, renormalised over the chosen ones
//! where the family says so (Mixtral and Qwen3-MoE do, Qwen2-MoE does not).
//! Dense layers (Qwen's `mlp_only_layers`, `decoder_sparse_step`) keep the
//! plain MLP of `intermediate_size`.
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

/// A model's mixture-of-experts MLPs (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
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
    let shared_ff = match keys.shared_ff {
        Some(k) => hf.opt_usize(k)?.filter(|&n| n > 0),
        None => None,
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
        shared_ff,
        shared_gate: shared_ff.is_some(),
        sparse: (0..cfg.n_layers)
            .map(|i| !dense_only.contains(&i) && (i + 1) % step == 0)
            .collect(),
    });
    Ok(())
}

/// Read the experts from GGUF metadata as llama.cpp's converter writes
/// them: `{arch}.expert_count`, `.expert_used_count`,
/// `.expert_feed_forward_length` (else `.feed_forward_length`),
/// `.expert_shared_feed_forward_length` and `.expert_weights_norm` (else
/// `norm_default`, llama.cpp's choice for the architecture). A layer is
/// sparse when it has a router tensor (`blk.{i}.ffn_gate_inp.weight`), so
/// leading dense layers need no key. Leaves `cfg.moe` unset when the file
/// has no experts.
pub(crate) fn from_gguf(g: &GgufFile, cfg: &mut ModelConfig, norm_default: bool) -> Result<()> {
    let key = |k: &str| format!("{}.{k}", cfg.architecture);
    let n_experts = g.opt_usize(&key("expert_count"))?.unwrap_or(0);
    if n_experts == 0 {
        return Ok(());
    }
    let shared_ff = g
        .opt_usize(&key("expert_shared_feed_forward_length"))?
        .filter(|&n| n > 0);
    cfg.moe = Some(Moe {
        n_experts,
        top_k: g
            .opt_usize(&key("expert_used_count"))?
            .ok_or_else(|| g.missing_field(&key("expert_used_count")))?,
        expert_ff: g
            .opt_usize(&key("expert_feed_forward_length"))?
            .unwrap_or(cfg.intermediate_size),
        norm_top_k: g
            .opt_bool(&key("expert_weights_norm"))?
            .unwrap_or(norm_default),
        shared_ff,
        shared_gate: shared_ff.is_some()
            && (0..cfg.n_layers)
                .any(|i| g.has_tensor(&format!("blk.{i}.ffn_gate_inp_shexp.weight"))),
        sparse: (0..cfg.n_layers)
            .map(|i| g.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect(),
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
