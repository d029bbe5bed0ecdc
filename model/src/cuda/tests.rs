//! What the CUDA backend refuses at load, without a device: every switch
//! it does not run is named, so a model never runs without it.

use serde_json::{json, Value};

use super::refuse_unimplemented;
use crate::config::ModelConfig;
use crate::error::ModelError;

fn config(value: Value) -> ModelConfig {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, value.to_string()).expect("write config");
    ModelConfig::from_hf_config(&path).expect("parse")
}

fn llama(extra: Value) -> Value {
    let mut v = json!({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256,
    });
    if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
        o.extend(e);
    }
    v
}

#[track_caller]
fn refusal(cfg: &ModelConfig) -> String {
    match refuse_unimplemented(cfg) {
        Err(e @ ModelError::Device(_)) => e.to_string(),
        other => panic!("expected a device refusal, got {other:?}"),
    }
}

#[test]
fn gemma2_and_yarn_scaling_are_refused_by_name_and_llama_scalings_run() {
    let mut gemma2 = llama(json!({"sliding_window": 8}));
    gemma2["model_type"] = json!("gemma2");
    let msg = refusal(&config(gemma2));
    assert!(
        msg.contains("gemma2")
            && msg.contains("attention logit soft-capping")
            && msg.contains("soft-capped logits")
            && msg.contains("--device cpu"),
        "{msg}"
    );

    let yarn = json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 64}});
    let msg = refusal(&config(llama(yarn)));
    assert!(msg.contains("YaRN"), "{msg}");

    // A YaRN rope whose magnitude is 1 is only frequencies, which the
    // device rope takes; so are linear and Llama 3 scalings.
    for scaling in [
        json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0,
            "original_max_position_embeddings": 64}),
        json!({"rope_type": "linear", "factor": 2.0}),
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ] {
        let cfg = config(llama(json!({ "rope_scaling": scaling })));
        assert!(refuse_unimplemented(&cfg).is_ok(), "{scaling}");
    }
}

/// gpt-oss is refused by family and by each switch the device pass lacks.
#[test]
fn gpt_oss_is_refused_by_name_with_each_switch() {
    let mut v = llama(json!({"num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 8}));
    v["model_type"] = json!("gpt_oss");
    let msg = refusal(&config(v));
    for part in [
        "gpt_oss",
        "attention sinks",
        "an output-projection bias",
        "clamped SwiGLU",
        "mixture-of-experts",
        "sliding-window layers mixed",
    ] {
        assert!(msg.contains(part), "{part} missing from: {msg}");
    }
}

/// DeepSeek V2 and V3 (the committed tiny models' configs) are refused by
/// family, naming latent attention among what the device pass lacks.
#[test]
fn latent_attention_is_refused_by_name() {
    for family in ["deepseek_v2", "deepseek_v3"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/data/tiny-{family}/config.json"));
        let cfg = ModelConfig::from_hf_config(&path).expect("parse");
        let msg = refusal(&cfg);
        for part in [family, "latent attention (MLA)", "mixture-of-experts"] {
            assert!(msg.contains(part), "{part} missing from: {msg}");
        }
    }
}
