//! The DeepSeek families' configurations, from the committed tiny models
//! (`scripts/golden/make_families.py`, `make_family_ggufs.py`): what
//! config.json and GGUF metadata say, and what is refused by name.

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use serde_json::{json, Value};

use super::*;
use crate::error::ModelError;
use crate::loader::gguf::GgufFile;

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel)
}

fn hf(family: &str) -> ModelConfig {
    ModelConfig::from_hf_config(&data(&format!("tiny-{family}/config.json"))).expect("config.json")
}

fn gguf(path: &Path) -> Result<ModelConfig> {
    ModelConfig::from_gguf(&mut GgufFile::open(path)?)
}

fn tiny_gguf(family: &str) -> PathBuf {
    data(&format!("gguf/tiny-{family}-F32.gguf"))
}

/// The tiny family's `config.json` with `edit` applied, parsed.
fn hf_edited(
    family: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(data(&format!("tiny-{family}/config.json"))).expect("read");
    let mut v: Value = serde_json::from_str(&text).expect("json");
    edit(v.as_object_mut().expect("object"));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, v.to_string()).expect("write");
    ModelConfig::from_hf_config(&path)
}

/// The tiny family's F32 GGUF with its metadata edited (tensors as they
/// are), parsed.
fn gguf_edited(
    family: &str,
    edit: impl FnOnce(&mut std::collections::HashMap<String, gguf_file::Value>),
) -> Result<ModelConfig> {
    let src = tiny_gguf(family);
    let mut f = std::fs::File::open(&src).expect("open");
    let content = gguf_file::Content::read(&mut f).expect("read");
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            let t = content.tensor(&mut f, n, &candle_core::Device::Cpu);
            (n.clone(), t.expect("tensor"))
        })
        .collect();
    let mut metadata = content.metadata;
    edit(&mut metadata);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("edited.gguf");
    let md: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &candle_core::quantized::QTensor)> =
        tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).expect("create"), &md, &ts).expect("write");
    gguf(&path)
}

#[track_caller]
fn invalid_field(r: Result<ModelConfig>) -> (String, String) {
    match r {
        Err(ModelError::InvalidField { field, reason, .. }) => (field, reason),
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

/// transformers' softmax scale: `24^-0.5 * (0.1 m ln 4 + 1)^2`, computed
/// as Python does.
fn scale(mscale_all_dim: f64) -> f32 {
    let m = 0.1 * mscale_all_dim * 4f64.ln() + 1.0;
    (24f64.powf(-0.5) * m * m) as f32
}

#[test]
fn deepseek_v2_reads_its_latent_attention_and_v2_routing() {
    let c = hf("deepseek_v2");
    assert_eq!(
        (c.family, c.architecture.as_str()),
        ("deepseek_v2", "DeepseekV2ForCausalLM")
    );
    assert_eq!(
        c.mla,
        Some(Mla {
            q_lora_rank: Some(32),
            kv_lora_rank: 32,
            qk_nope_dim: 16,
            qk_rope_dim: 8,
            v_head_dim: 16,
            rope_layout: RopeLayout::Interleaved,
        })
    );
    assert_eq!(c.mla.as_ref().map(Mla::entry_dim), Some(40));
    // config.json's `head_dim` is the rope part (transformers sets it so);
    // the query head is nope + rope, one shared latent entry.
    assert_eq!(
        (c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim),
        (4, 1, 24, 8)
    );
    assert_eq!(c.o_dim(), 4 * 16);
    assert_eq!(c.block.attn_scale, scale(0.707));
    // mscale == mscale_all_dim: cos and sin unscaled.
    let RopeScaling::Yarn(y) = c.rope_scaling else {
        panic!("yarn: {:?}", c.rope_scaling)
    };
    assert_eq!((y.factor, y.attention_factor), (4.0, 1.0));
    let moe = c.moe.expect("experts");
    assert_eq!(moe.scoring, Scoring::Softmax);
    assert_eq!(
        moe.groups,
        Some(Groups {
            n_group: 2,
            topk_group: 1,
            score: GroupScore::Max
        })
    );
    assert!(!moe.norm_top_k && !moe.correction_bias && !moe.shared_gate);
    assert_eq!((moe.n_experts, moe.top_k, moe.expert_ff), (8, 2, 32));
    assert_eq!((moe.shared_ff, moe.routed_scale), (Some(64), 2.0));
    assert_eq!(moe.sparse, vec![false, true, true]);
}

#[test]
fn deepseek_v3_reads_its_full_rank_query_and_noaux_tc_routing() {
    let c = hf("deepseek_v3");
    assert_eq!(c.family, "deepseek_v3");
    let mla = c.mla.clone().expect("latent attention");
    assert_eq!(mla.q_lora_rank, None);
    assert_eq!(mla.rope_layout, RopeLayout::Interleaved);
    assert_eq!((c.head_dim, c.rotary_dim, c.n_kv_heads), (24, 8, 1));
    assert_eq!(c.block.attn_scale, scale(1.0));
    let moe = c.moe.expect("experts");
    assert_eq!(moe.scoring, Scoring::Sigmoid);
    assert!(moe.correction_bias && moe.norm_top_k);
    assert_eq!(
        moe.groups,
        Some(Groups {
            n_group: 2,
            topk_group: 1,
            score: GroupScore::TopTwoSum
        })
    );
    assert_eq!((moe.shared_ff, moe.routed_scale), (Some(32), 2.5));

    // rope_interleave false: V3 rotates halves.
    let halves = hf_edited("deepseek_v3", |o| {
        o.insert("rope_interleave".into(), json!(false));
    })
    .expect("parse");
    assert_eq!(
        halves.mla.map(|m| m.rope_layout),
        Some(RopeLayout::RotateHalf)
    );
    // Without rope scaling: the plain 24^-0.5, no YaRN factor.
    let plain = hf_edited("deepseek_v3", |o| {
        o.insert(
            "rope_parameters".into(),
            json!({"rope_type": "default", "rope_theta": 10000.0}),
        );
    })
    .expect("parse");
    assert_eq!(plain.block.attn_scale, (24f64.powf(-0.5)) as f32);
    // transformers' defaults for absent routing keys.
    let defaults = hf_edited("deepseek_v3", |o| {
        for k in [
            "n_group",
            "topk_group",
            "norm_topk_prob",
            "routed_scaling_factor",
            "rope_interleave",
        ] {
            o.remove(k);
        }
        o.insert("n_routed_experts".into(), json!(16));
    })
    .expect("parse");
    let moe = defaults.moe.expect("experts");
    assert_eq!(
        (
            moe.groups.map(|g| (g.n_group, g.topk_group)),
            moe.norm_top_k,
            moe.routed_scale
        ),
        (Some((8, 4)), true, 2.5)
    );
}

/// Both tiny models read from their GGUF conversions give the same
/// configuration as from config.json, in every field the weights and the
/// forward pass read (the architecture's name aside: `deepseek2`); V3's
/// file (sigmoid gating) is named deepseek_v3, V2's groups score by their
/// best expert. V2's file is in the older converter's form (per-head
/// sizes under the plain keys), V3's in the current one (`_mla` keys).
#[test]
fn gguf_metadata_gives_the_same_configuration_as_config_json() {
    for family in ["deepseek_v2", "deepseek_v3"] {
        let (h, g) = (hf(family), gguf(&tiny_gguf(family)).expect("gguf"));
        assert_eq!(g.architecture, "deepseek2");
        assert_eq!(g.family, h.family, "{family}");
        assert_eq!(g.mla, h.mla, "{family}: latent attention");
        assert_eq!(g.block, h.block, "{family}: switches (softmax scale)");
        assert_eq!(g.moe, h.moe, "{family}: experts");
        assert_eq!(
            (g.rope_theta, g.rope_scaling),
            (h.rope_theta, h.rope_scaling),
            "{family}: rope"
        );
        assert_eq!(
            (g.n_heads, g.n_kv_heads, g.head_dim, g.rotary_dim, g.o_dim()),
            (h.n_heads, h.n_kv_heads, h.head_dim, h.rotary_dim, h.o_dim()),
            "{family}: heads"
        );
        assert_eq!(
            (g.vocab_size, g.hidden_size, g.intermediate_size, g.n_layers),
            (h.vocab_size, h.hidden_size, h.intermediate_size, h.n_layers),
            "{family}: sizes"
        );
        assert_eq!(
            (
                g.rms_norm_eps,
                g.max_position_embeddings,
                g.tie_word_embeddings
            ),
            (
                h.rms_norm_eps,
                h.max_position_embeddings,
                h.tie_word_embeddings
            ),
            "{family}: the rest"
        );
        assert_eq!(g.layer_types, h.layer_types);
    }
}

#[test]
fn what_cannot_be_described_is_refused_by_field() {
    let set = |k: &'static str, v: Value| {
        move |o: &mut serde_json::Map<String, Value>| {
            o.insert(k.into(), v);
        }
    };
    for (family, key, value, field) in [
        ("deepseek_v2", "kv_lora_rank", json!(0), "kv_lora_rank"),
        (
            "deepseek_v3",
            "qk_rope_head_dim",
            json!(7),
            "qk_rope_head_dim",
        ),
        (
            "deepseek_v2",
            "qk_nope_head_dim",
            json!(0),
            "qk_nope_head_dim",
        ),
        ("deepseek_v2", "q_lora_rank", json!(0), "q_lora_rank"),
        (
            "deepseek_v2",
            "topk_method",
            json!("noaux_tc"),
            "topk_method",
        ),
        ("deepseek_v3", "topk_method", json!("greedy"), "topk_method"),
        (
            "deepseek_v2",
            "norm_topk_prob",
            json!(true),
            "norm_topk_prob",
        ),
        (
            "deepseek_v3",
            "scoring_func",
            json!("softmax"),
            "scoring_func",
        ),
        (
            "deepseek_v2",
            "num_key_value_heads",
            json!(2),
            "num_key_value_heads",
        ),
        ("deepseek_v3", "moe_layer_freq", json!(2), "moe_layer_freq"),
        (
            "deepseek_v3",
            "attention_bias",
            json!(true),
            "attention_bias",
        ),
        ("deepseek_v2", "hidden_act", json!("gelu"), "hidden_act"),
        // 8 experts cannot split into 3 equal groups.
        ("deepseek_v3", "n_group", json!(3), "expert groups"),
    ] {
        let (f, reason) = invalid_field(hf_edited(family, set(key, value.clone())));
        assert_eq!(f, field, "{family} {key} = {value}: {reason}");
    }
    let missing = hf_edited("deepseek_v3", |o| {
        o.remove("q_lora_rank");
    });
    assert!(
        matches!(missing, Err(ModelError::MissingField { ref field, .. }) if field == "q_lora_rank"),
        "{missing:?}"
    );
    // group_limited_greedy needs its groups.
    let groupless = hf_edited("deepseek_v2", |o| {
        o.remove("n_group");
    });
    assert!(
        matches!(groupless, Err(ModelError::MissingField { ref field, .. }) if field == "n_group"),
        "{groupless:?}"
    );
}

#[test]
fn bad_gguf_metadata_is_refused_by_key() {
    use gguf_file::Value as V;
    let (field, _) = invalid_field(gguf_edited("deepseek_v2", |m| {
        m.insert("deepseek2.attention.kv_lora_rank".into(), V::U32(0));
    }));
    assert_eq!(field, "deepseek2.attention.kv_lora_rank");
    let (field, _) = invalid_field(gguf_edited("deepseek_v3", |m| {
        m.insert("deepseek2.rope.dimension_count".into(), V::U32(7));
        // Keep the entry's sizes consistent so the rope dim is what fails.
        m.insert("deepseek2.attention.key_length".into(), V::U32(39));
        m.insert("deepseek2.attention.key_length_mla".into(), V::U32(23));
    }));
    assert_eq!(field, "deepseek2.rope.dimension_count");
    let (field, reason) = invalid_field(gguf_edited("deepseek_v3", |m| {
        m.insert("deepseek2.attention.value_length".into(), V::U32(16));
    }));
    assert_eq!(field, "deepseek2.attention.value_length", "{reason}");
    let (field, _) = invalid_field(gguf_edited("deepseek_v3", |m| {
        m.insert("deepseek2.expert_gating_func".into(), V::U32(3));
    }));
    assert_eq!(field, "deepseek2.expert_gating_func");
    let missing = gguf_edited("deepseek_v2", |m| {
        m.remove("deepseek2.attention.q_lora_rank");
    });
    assert!(
        matches!(missing, Err(ModelError::MissingField { ref field, .. }) if field == "deepseek2.attention.q_lora_rank"),
        "{missing:?}"
    );
}

/// llama.cpp's deepseek2 YaRN arithmetic, by hand: the stored log
/// multiplier is `0.1 mscale_all_dim`; with one, cos and sin are unscaled
/// and the scale is `(1 + log_mul ln f)^2 / sqrt(d)`; without, both carry
/// `0.1 ln f + 1`.
#[test]
fn gguf_yarn_follows_llama_cpps_deepseek2_reading() {
    use gguf_file::Value as V;
    let c = gguf_edited("deepseek_v3", |m| {
        m.insert("deepseek2.rope.scaling.factor".into(), V::F32(40.0));
        m.insert(
            "deepseek2.rope.scaling.yarn_log_multiplier".into(),
            V::F32(0.0707),
        );
    })
    .expect("parse");
    let m = 1.0 + f64::from(0.0707f32) * 40f64.ln();
    assert_eq!(c.block.attn_scale, (24f64.powf(-0.5) * m * m) as f32);
    let RopeScaling::Yarn(y) = c.rope_scaling else {
        panic!("yarn")
    };
    assert_eq!(y.attention_factor, 1.0);
    let c = gguf_edited("deepseek_v3", |m| {
        m.remove("deepseek2.rope.scaling.yarn_log_multiplier");
    })
    .expect("parse");
    let a = 0.1 * 4f64.ln() + 1.0;
    let RopeScaling::Yarn(y) = c.rope_scaling else {
        panic!("yarn")
    };
    assert_eq!(y.attention_factor, a as f32);
    assert_eq!(c.block.attn_scale, (24f64.powf(-0.5) * a * a) as f32);
}
