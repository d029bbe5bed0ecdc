use serde_json::{json, Value};

use super::*;
use crate::error::ModelError;

fn parse(value: Value) -> Result<ModelConfig> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, value.to_string()).expect("write config");
    ModelConfig::from_hf_config(&path)
}

fn base(model_type: &str, extra: Value) -> Value {
    let mut v = json!({
        "model_type": model_type,
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256,
    });
    if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
        o.extend(e);
    }
    v
}

#[track_caller]
fn invalid_field(r: Result<ModelConfig>) -> String {
    match r {
        Err(ModelError::InvalidField { field, .. }) => field,
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

#[test]
fn every_family_is_found_by_model_type_class_and_gguf_name() {
    for f in FAMILIES {
        for (mt, class) in f.hf_types {
            assert_eq!(Family::by_hf(Some(mt), None).map(|x| x.name), Some(f.name));
            assert_eq!(
                Family::by_hf(None, Some(class)).map(|x| x.name),
                Some(f.name)
            );
        }
        // Families that share a GGUF architecture (Mixtral's files say
        // `llama`) are read by the first one listed.
        let first = FAMILIES.iter().find(|x| x.gguf_arch == f.gguf_arch);
        assert_eq!(
            Family::by_gguf(f.gguf_arch).map(|x| x.name),
            first.map(|x| x.name)
        );
        assert_eq!(Family::named(f.name).map(|x| x.name), Some(f.name));
    }
    assert_eq!(Family::by_gguf("llama").map(|x| x.name), Some("llama"));
    assert!(Family::by_hf(Some("gpt2"), None).is_none());
    let supported = Family::supported();
    for name in [
        "llama",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "phi3",
        "mistral",
        "mixtral",
        "qwen2_moe",
        "qwen3moe",
    ] {
        assert!(supported.contains(name), "{supported}");
    }
}

#[test]
fn gemma3_derives_its_switches_windows_and_local_rope() {
    let c = parse(base(
        "gemma3_text",
        json!({"sliding_window": 512, "query_pre_attn_scalar": 24, "rope_theta": 1e6}),
    ))
    .expect("gemma3");
    assert_eq!(c.family, "gemma3");
    assert_eq!(c.block.activation, Activation::GeluTanh);
    assert!(c.block.qk_norm && c.block.sandwich_norms);
    assert_eq!(c.block.embed_scale, Some(8.0));
    assert_eq!(c.block.attn_scale, (24f64).powf(-0.5) as f32);
    // Pattern 6: layers 5 and 11 global, the rest sliding.
    let full: Vec<usize> = (0..12)
        .filter(|&i| c.layer_types[i] == LayerType::Full)
        .collect();
    assert_eq!(full, [5, 11]);
    assert_eq!(c.local_rope_theta, Some(10_000.0));
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.sliding_window, Some(512));
    assert!(!c.block.non_llama_switches(c.head_dim).is_empty());

    // transformers 5's per-layer-type rope parameters.
    let c = parse(base(
        "gemma3_text",
        json!({"sliding_window": 512, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    ))
    .expect("gemma3 rope_parameters");
    assert_eq!(
        c.rope_scaling,
        kvmesh_kernels::rope::RopeScaling::Linear { factor: 8.0 }
    );
    assert_eq!(c.local_rope_theta, Some(1e4));
    assert_eq!(
        invalid_field(parse(base(
            "gemma3_text",
            json!({"hidden_activation": "gelu"})
        ))),
        "hidden_activation"
    );
}

#[test]
fn gemma2_reads_its_caps_windows_and_scale_with_transformers_defaults() {
    let c = parse(base(
        "gemma2",
        json!({"sliding_window": 64, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 20.0, "final_logit_softcapping": 15.0}),
    ))
    .expect("gemma2");
    assert_eq!(c.family, "gemma2");
    assert_eq!(c.block.attn_softcap, Some(20.0));
    assert_eq!(c.block.final_softcap, Some(15.0));
    assert_eq!(c.block.attn_scale, (24f64).powf(-0.5) as f32);
    assert_eq!(c.block.activation, Activation::GeluTanh);
    assert!(c.block.sandwich_norms && !c.block.qk_norm);
    assert_eq!(c.block.embed_scale, Some(8.0));
    assert_eq!(c.sliding_window, Some(64));
    // Layer 0 slides, layer 1 attends everything, and so on.
    for (i, t) in c.layer_types.iter().enumerate() {
        let want = if i % 2 == 0 {
            LayerType::Sliding
        } else {
            LayerType::Full
        };
        assert_eq!(*t, want, "layer {i}");
    }
    assert_eq!(c.local_rope_theta, None, "one rope base");
    assert!(c
        .block
        .non_llama_switches(c.head_dim)
        .contains(&"attention logit soft-capping"));

    // Absent keys take Gemma2Config's defaults; null turns a cap off.
    let d = parse(base("gemma2", json!({}))).expect("gemma2 defaults");
    assert_eq!(d.block.attn_softcap, Some(50.0));
    assert_eq!(d.block.final_softcap, Some(30.0));
    assert_eq!(d.sliding_window, Some(4096));
    assert_eq!(d.block.attn_scale, 256f32.powf(-0.5));
    assert_eq!(d.head_dim, 16, "the config's head size");
    // Without head_dim, transformers' default (256), not hidden / heads.
    let mut no_head_dim = base("gemma2", json!({}));
    no_head_dim
        .as_object_mut()
        .expect("object")
        .remove("head_dim");
    let h = parse(no_head_dim).expect("gemma2 without head_dim");
    assert_eq!((h.head_dim, h.q_dim()), (256, 4 * 256));
    let off = parse(base(
        "gemma2",
        json!({"attn_logit_softcapping": null, "final_logit_softcapping": null}),
    ))
    .expect("gemma2 without caps");
    assert_eq!(
        (off.block.attn_softcap, off.block.final_softcap),
        (None, None)
    );
    // transformers 5's explicit layer types win over the alternation.
    let lt = parse(base(
        "gemma2",
        json!({"sliding_window": 8, "layer_types": vec!["full_attention"; 12]}),
    ))
    .expect("gemma2 layer types");
    assert!(lt.layer_types.iter().all(|t| *t == LayerType::Full));
    assert_eq!(lt.sliding_window, None);
}

#[test]
fn what_a_family_cannot_run_is_refused_by_name() {
    // A cap that is not a positive number.
    assert_eq!(
        invalid_field(parse(base(
            "gemma2",
            json!({"attn_logit_softcapping": -1.0})
        ))),
        "attn_logit_softcapping"
    );
    // Qwen3's attention_bias biases o_proj too.
    assert_eq!(
        invalid_field(parse(base("qwen3", json!({"attention_bias": true})))),
        "attention_bias"
    );
    assert!(
        parse(base("qwen3", json!({})))
            .expect("qwen3")
            .block
            .qk_norm
    );
    assert_eq!(
        invalid_field(parse(base(
            "phi3",
            json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}})
        ))),
        "rope_parameters.partial_rotary_factor"
    );
    assert_eq!(
        invalid_field(parse(base(
            "phi3",
            json!({"rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}})
        ))),
        "rope_scaling.type"
    );
    // A list of layer types of the wrong length, or an unknown type.
    assert_eq!(
        invalid_field(parse(base(
            "qwen2",
            json!({"layer_types": ["full_attention"]})
        ))),
        "layer_types"
    );
    assert_eq!(
        invalid_field(parse(base(
            "qwen2",
            json!({"layer_types": vec!["chunked_attention"; 12]})
        ))),
        "layer_types"
    );
    // Sliding layers need a window.
    assert_eq!(
        invalid_field(parse(base(
            "mistral",
            json!({"layer_types": vec!["sliding_attention"; 12], "sliding_window": null})
        ))),
        "sliding_window"
    );
}

#[test]
fn phi3_lists_its_fused_tensors_and_gemma_its_own_norm_names() {
    let phi = parse(base("phi3", json!({}))).expect("phi3");
    let parts = phi3::FAMILY.layer_parts(&phi, 0);
    assert!(parts.contains(&Part::Qkv) && parts.contains(&Part::GateUp));
    assert!(!parts.contains(&Part::Q) && !parts.contains(&Part::Gate));
    assert_eq!(
        (phi3::FAMILY.hf_name)(Part::Qkv),
        Some("self_attn.qkv_proj.weight")
    );
    let gemma = parse(base("gemma3_text", json!({"sliding_window": 8}))).expect("gemma3");
    let parts = gemma3::FAMILY.layer_parts(&gemma, 0);
    for p in [
        Part::QNorm,
        Part::KNorm,
        Part::PostAttnNorm,
        Part::PostMlpNorm,
    ] {
        assert!(parts.contains(&p), "{p:?}");
    }
    // Llama's post_attention_layernorm is the MLP's input norm; Gemma's is
    // the norm after attention.
    assert_eq!(
        llama_hf_name(Part::MlpNorm),
        "post_attention_layernorm.weight"
    );
    assert_eq!(
        (gemma3::FAMILY.hf_name)(Part::PostAttnNorm),
        Some("post_attention_layernorm.weight")
    );
    assert_eq!(
        (gemma3::FAMILY.hf_name)(Part::MlpNorm),
        Some("pre_feedforward_layernorm.weight")
    );
}

/// gpt-oss's config.json: transformers' defaults where keys are absent
/// (window 128, every other layer sliding from 0, YaRN 32 over 4,096 on
/// base 150,000, alpha 1.702, limit 7), its own values where present, and
/// the released MXFP4 checkpoints refused by name.
#[test]
fn gpt_oss_reads_transformers_defaults_and_refuses_mxfp4_safetensors() {
    let experts = json!({"num_local_experts": 4, "num_experts_per_tok": 2});
    let c = parse(base("gpt_oss", experts.clone())).expect("gpt_oss");
    assert_eq!(c.family, "gpt_oss");
    assert_eq!(c.sliding_window, Some(128));
    assert_eq!(c.layer_types[..2], [LayerType::Sliding, LayerType::Full]);
    assert_eq!(c.rope_theta, 150_000.0);
    match c.rope_scaling {
        kvmesh_kernels::rope::RopeScaling::Yarn(y) => {
            assert_eq!((y.factor, y.original_max_position_embeddings), (32.0, 4096));
            assert!(!y.truncate);
        }
        other => panic!("expected YaRN, got {other:?}"),
    }
    assert_eq!(
        c.block.activation,
        Activation::SwigluOai {
            alpha: 1.702,
            limit: 7.0
        }
    );
    assert!(c.attention_bias && c.block.o_bias && c.block.attn_sinks);
    let moe = c.moe.as_ref().expect("experts");
    assert_eq!(moe.scoring, moe::Scoring::TopKSoftmax);
    assert!(moe.router_bias && moe.expert_bias && moe.sparse.iter().all(|&s| s));

    let mut v = base("gpt_oss", experts.clone());
    v["rope_theta"] = json!(10_000.0);
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 64, "truncate": false});
    v["swiglu_limit"] = json!(1.5);
    let c = parse(v).expect("gpt_oss with rope");
    assert_eq!(c.rope_theta, 10_000.0);
    assert!(matches!(c.rope_scaling,
        kvmesh_kernels::rope::RopeScaling::Yarn(y) if y.factor == 4.0 && !y.truncate));
    assert!(matches!(c.block.activation, Activation::SwigluOai { limit, .. } if limit == 1.5));

    let mut v = base("gpt_oss", experts.clone());
    v["swiglu_limit"] = json!(-1.0);
    assert_eq!(invalid_field(parse(v)), "swiglu_limit");
    let mut v = base("gpt_oss", experts);
    v["quantization_config"] = json!({"quant_method": "mxfp4"});
    assert_eq!(invalid_field(parse(v)), "quantization_config");
}
