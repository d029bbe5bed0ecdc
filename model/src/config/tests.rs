use super::*;
use crate::arch::LayerType;
use serde_json::json;

fn write_config(value: &Value) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, value.to_string()).expect("write config");
    (dir, path)
}

fn parse(value: Value) -> Result<ModelConfig> {
    let (_dir, path) = write_config(&value);
    ModelConfig::from_hf_config(&path)
}

/// SmolLM2-135M-Instruct's config.json, abridged to what is read.
fn smollm2() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-05,
        "rope_scaling": null,
        "rope_theta": 100000,
        "tie_word_embeddings": true,
        "vocab_size": 49152,
        "torch_dtype": "bfloat16"
    })
}

fn with(mut base: Value, key: &str, v: Value) -> Value {
    if let Value::Object(obj) = &mut base {
        obj.insert(key.to_owned(), v);
    }
    base
}

fn without(mut base: Value, key: &str) -> Value {
    if let Value::Object(obj) = &mut base {
        obj.remove(key);
    }
    base
}

#[track_caller]
fn assert_invalid(r: Result<ModelConfig>, field: &str, value_part: &str) {
    match r {
        Err(ModelError::InvalidField {
            field: f, value, ..
        }) => {
            assert_eq!(f, field);
            assert!(
                value.contains(value_part),
                "value {value:?} lacks {value_part:?}"
            );
        }
        other => panic!("expected InvalidField for {field}, got {other:?}"),
    }
}

#[test]
fn smollm2_config_parses() {
    let c = parse(smollm2()).expect("parse");
    assert_eq!(c.architecture, "LlamaForCausalLM");
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.intermediate_size),
        (49152, 576, 1536)
    );
    assert_eq!(
        (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
        (30, 9, 3, 64)
    );
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 100_000.0));
    assert_eq!(c.rope_scaling, RopeScaling::None);
    assert!(c.tie_word_embeddings && !c.attention_bias);
    assert_eq!(
        (c.sliding_window, c.bos_token_id, c.eos_token_ids.clone()),
        (None, Some(1), vec![2])
    );
    assert_eq!((c.q_dim(), c.kv_dim()), (576, 192));
}

#[test]
fn defaults_apply_to_omitted_fields() {
    let minimal = json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4});
    let c = parse(minimal).expect("parse");
    assert_eq!(c.architecture, "llama");
    assert_eq!(
        (c.n_kv_heads, c.head_dim, c.max_position_embeddings),
        (4, 16, 2048)
    );
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-6, 10_000.0));
    assert!(!c.tie_word_embeddings);
    assert_eq!((c.bos_token_id, c.eos_token_ids.len()), (None, 0));

    // architectures alone identifies the model type.
    let c = parse(without(
        with(smollm2(), "architectures", json!(["MistralForCausalLM"])),
        "model_type",
    ))
    .expect("parse");
    assert_eq!(c.architecture, "MistralForCausalLM");
    // An explicit head_dim need not be hidden / heads.
    let c = parse(with(smollm2(), "head_dim", json!(128))).expect("parse");
    assert_eq!((c.head_dim, c.q_dim()), (128, 1152));
}

#[test]
fn eos_token_id_may_be_a_list_or_null() {
    let c = parse(with(
        smollm2(),
        "eos_token_id",
        json!([128001, 128008, 128009]),
    ))
    .expect_err("ids beyond vocab");
    assert!(
        matches!(c, ModelError::InvalidField { ref field, .. } if field == "eos_token_id"),
        "{c}"
    );
    let c = parse(with(smollm2(), "eos_token_id", json!([0, 2, 2]))).expect("parse");
    assert_eq!(c.eos_token_ids, vec![0, 2]);
    let c = parse(with(smollm2(), "eos_token_id", Value::Null)).expect("parse");
    assert!(c.eos_token_ids.is_empty());
    assert_invalid(
        parse(with(smollm2(), "eos_token_id", json!("2"))),
        "eos_token_id",
        "\"2\"",
    );
    assert_invalid(
        parse(with(smollm2(), "eos_token_id", json!([-1]))),
        "eos_token_id",
        "-1",
    );
}

#[test]
fn rope_scaling_variants() {
    let parse_rs = |rs: Value| parse(with(smollm2(), "rope_scaling", rs));
    assert_eq!(
        parse_rs(json!({"rope_type": "default"}))
            .expect("default")
            .rope_scaling,
        RopeScaling::None
    );
    assert_eq!(
        parse_rs(json!({"type": "linear", "factor": 2.0}))
            .expect("linear")
            .rope_scaling,
        RopeScaling::Linear { factor: 2.0 }
    );
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    assert_eq!(
        parse_rs(llama3).expect("llama3").rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    // Every variant still not implemented is refused, naming it.
    for kind in ["dynamic", "longrope", "su", "mrope"] {
        let err = parse_rs(json!({"type": kind, "factor": 4.0})).expect_err(kind);
        assert!(
            err.to_string()
                .contains(&format!("{kind} RoPE scaling is not implemented")),
            "{err}"
        );
        assert_invalid(Err(err), "rope_scaling.type", kind);
    }
    assert_invalid(
        parse_rs(json!({"type": "linear", "factor": -1})),
        "rope_scaling.factor",
        "-1",
    );
    assert_invalid(parse_rs(json!("linear")), "rope_scaling", "linear");
    assert!(matches!(
        parse_rs(json!({"type": "linear"})),
        Err(ModelError::MissingField { ref field, .. }) if field == "rope_scaling.factor"
    ));
    assert!(matches!(
        parse_rs(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
        Err(ModelError::MissingField { ref field, .. }) if field == "rope_scaling.original_max_position_embeddings"
    ));
}

/// YaRN read as transformers 5 reads it: from `rope_scaling` and from
/// `rope_parameters`, with its defaults (betas 32 and 1, truncation, the
/// attention factor from `factor` or from `mscale`/`mscale_all_dim`, the
/// original context from a top-level key, the parameters', or
/// `max_position_embeddings`), and what it cannot be refused by name.
#[test]
fn yarn_scaling_as_transformers_reads_it() {
    use kvmesh_kernels::rope::{yarn_attention_factor, Yarn};
    let yarn = |c: Result<ModelConfig>| match c.expect("yarn parses").rope_scaling {
        RopeScaling::Yarn(y) => y,
        other => panic!("expected YaRN, got {other:?}"),
    };
    let base = Yarn {
        factor: 4.0,
        original_max_position_embeddings: 2048,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: yarn_attention_factor(4.0, None, None),
    };
    // The classic key and transformers 5's give the same.
    let classic = with(
        smollm2(),
        "rope_scaling",
        json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
    );
    assert_eq!(yarn(parse(classic.clone())), base);
    let params = with(
        without(smollm2(), "rope_scaling"),
        "rope_parameters",
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
               "rope_theta": 100000}),
    );
    assert_eq!(yarn(parse(params.clone())), base);
    assert!((base.attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-7);

    // Every knob.
    let all = with(
        smollm2(),
        "rope_scaling",
        json!({"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 1024,
               "beta_fast": 16, "beta_slow": 2.5, "truncate": false, "attention_factor": 0.75}),
    );
    assert_eq!(
        yarn(parse(all)),
        Yarn {
            factor: 8.0,
            original_max_position_embeddings: 1024,
            beta_fast: 16.0,
            beta_slow: 2.5,
            truncate: false,
            attention_factor: 0.75,
        }
    );
    let deepseek = with(
        smollm2(),
        "rope_scaling",
        json!({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
               "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 0}),
    );
    let y = yarn(parse(deepseek));
    assert_eq!(
        y.attention_factor,
        yarn_attention_factor(40.0, Some(1.0), Some(0.707))
    );
    assert_eq!(
        y.beta_fast, 32.0,
        "0 takes the default, as transformers' `or`"
    );

    // The original context: a top-level key wins, else max_position_embeddings.
    let top = with(
        classic.clone(),
        "original_max_position_embeddings",
        json!(512),
    );
    assert_eq!(yarn(parse(top)).original_max_position_embeddings, 512);
    let none = with(
        smollm2(),
        "rope_scaling",
        json!({"type": "yarn", "factor": 2.0}),
    );
    assert_eq!(yarn(parse(none)).original_max_position_embeddings, 8192);
    // factor null: the ratio of the two context lengths.
    let ratio = with(
        smollm2(),
        "rope_scaling",
        json!({"type": "yarn", "factor": null, "original_max_position_embeddings": 1024}),
    );
    assert_eq!(yarn(parse(ratio)).factor, 8.0);
    // Per-layer-type parameters: truncation is read from the outer object
    // (so it stays on), the top-level original context is not consulted.
    let nested = with(
        without(
            with(smollm2(), "original_max_position_embeddings", json!(512)),
            "rope_scaling",
        ),
        "rope_parameters",
        json!({"full_attention": {"rope_type": "yarn", "factor": 4.0, "truncate": false,
               "original_max_position_embeddings": 2048}}),
    );
    assert_eq!(yarn(parse(nested)), base);

    // Refusals name the key.
    let bad = |extra: Value| {
        let mut rs =
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048});
        if let (Value::Object(o), Value::Object(e)) = (&mut rs, extra) {
            o.extend(e);
        }
        parse(with(smollm2(), "rope_scaling", rs))
    };
    assert_invalid(bad(json!({"factor": -2})), "rope_scaling.factor", "-2");
    assert_invalid(
        bad(json!({"beta_fast": "fast"})),
        "rope_scaling.beta_fast",
        "fast",
    );
    assert_invalid(
        bad(json!({"attention_factor": 0})),
        "rope_scaling.attention_factor",
        "0",
    );
    assert_invalid(bad(json!({"truncate": 1})), "rope_scaling.truncate", "1");
    assert_invalid(
        bad(json!({"original_max_position_embeddings": 0})),
        "rope_scaling.original_max_position_embeddings",
        "0",
    );
    assert!(matches!(
        parse(with(smollm2(), "rope_scaling", json!({"type": "yarn"}))),
        Err(ModelError::MissingField { ref field, .. }) if field == "rope_scaling.factor"
    ));
    // Partial rotary embeddings, with any scaling or none, in either place.
    assert_invalid(
        bad(json!({"partial_rotary_factor": 0.5})),
        "rope_scaling.partial_rotary_factor",
        "0.5",
    );
    assert_invalid(
        parse(with(smollm2(), "partial_rotary_factor", json!(0.25))),
        "partial_rotary_factor",
        "0.25",
    );
    assert!(parse(with(smollm2(), "partial_rotary_factor", json!(1.0))).is_ok());
}

#[test]
fn qwen2_and_mistral_specifics() {
    let qwen = with(
        with(smollm2(), "model_type", json!("qwen2")),
        "architectures",
        json!(["Qwen2ForCausalLM"]),
    );
    let qwen = with(
        with(qwen, "sliding_window", json!(4096)),
        "use_sliding_window",
        json!(false),
    );
    let c = parse(qwen.clone()).expect("qwen2");
    assert!(c.attention_bias);
    assert_eq!(c.sliding_window, None);
    let windowed = with(
        with(qwen.clone(), "use_sliding_window", json!(true)),
        "max_window_layers",
        json!(0),
    );
    assert_eq!(
        parse(windowed).expect("qwen2 windowed").sliding_window,
        Some(4096)
    );
    // Windows from layer `max_window_layers` on (transformers' rule): a
    // mix of windowed and full layers.
    let mixed = with(
        with(qwen, "use_sliding_window", json!(true)),
        "max_window_layers",
        json!(21),
    );
    let c = parse(mixed).expect("qwen2 mixed");
    assert_eq!(c.sliding_window, Some(4096));
    assert!(c.layer_types[..21].iter().all(|t| *t == LayerType::Full));
    assert!(c.layer_types[21..].iter().all(|t| *t == LayerType::Sliding));

    let mistral = with(
        with(smollm2(), "model_type", json!("mistral")),
        "architectures",
        json!(["MistralForCausalLM"]),
    );
    assert_eq!(
        parse(with(mistral.clone(), "sliding_window", json!(4096)))
            .expect("mistral")
            .sliding_window,
        Some(4096)
    );
    assert_eq!(
        parse(with(mistral.clone(), "sliding_window", Value::Null))
            .expect("mistral")
            .sliding_window,
        None
    );
    assert_invalid(
        parse(with(mistral, "sliding_window", json!(0))),
        "sliding_window",
        "0",
    );
}

#[test]
fn unsupported_architectures_are_named() {
    for (cfg, name) in [
        (with(smollm2(), "model_type", json!("gpt2")), "gpt2"),
        (
            with(
                smollm2(),
                "architectures",
                json!(["LlamaForSequenceClassification"]),
            ),
            "LlamaForSequenceClassification",
        ),
    ] {
        match parse(cfg) {
            Err(ModelError::UnsupportedArchitecture { architecture, .. }) => {
                assert_eq!(architecture, name)
            }
            other => panic!("expected UnsupportedArchitecture, got {other:?}"),
        }
    }
    assert!(matches!(
        parse(without(without(smollm2(), "model_type"), "architectures")),
        Err(ModelError::MissingField { ref field, .. }) if field == "model_type"
    ));
    assert_invalid(
        parse(with(smollm2(), "attention_bias", json!(true))),
        "attention_bias",
        "true",
    );
    assert_invalid(
        parse(with(smollm2(), "mlp_bias", json!(true))),
        "mlp_bias",
        "true",
    );
    assert_invalid(
        parse(with(smollm2(), "hidden_act", json!("gelu"))),
        "hidden_act",
        "gelu",
    );
}

#[test]
fn inconsistent_sizes_are_refused() {
    assert_invalid(
        parse(with(smollm2(), "num_key_value_heads", json!(4))),
        "num_key_value_heads",
        "4",
    );
    assert_invalid(
        parse(with(smollm2(), "head_dim", json!(63))),
        "head_dim",
        "63",
    );
    assert_invalid(
        parse(with(smollm2(), "num_attention_heads", json!(7))),
        "num_attention_heads",
        "7",
    );
    assert_invalid(
        parse(with(smollm2(), "num_hidden_layers", json!(0))),
        "num_hidden_layers",
        "0",
    );
    assert_invalid(
        parse(with(smollm2(), "num_attention_heads", json!(0))),
        "num_attention_heads",
        "0",
    );
    assert_invalid(
        parse(with(smollm2(), "hidden_size", json!("576"))),
        "hidden_size",
        "\"576\"",
    );
    assert_invalid(
        parse(with(smollm2(), "vocab_size", json!(-5))),
        "vocab_size",
        "-5",
    );
    assert_invalid(
        parse(with(smollm2(), "rms_norm_eps", json!(0.0))),
        "rms_norm_eps",
        "0",
    );
    assert_invalid(
        parse(with(smollm2(), "bos_token_id", json!(49152))),
        "bos_token_id",
        "49152",
    );
    assert_invalid(
        parse(with(
            smollm2(),
            "num_hidden_layers",
            json!(1_000_000_000_000u64),
        )),
        "num_hidden_layers",
        "1000000000000",
    );
    assert_invalid(
        parse(with(smollm2(), "vocab_size", json!(1u64 << 62))),
        "vocab_size",
        "4611686018427387904",
    );
    assert_invalid(
        parse(with(
            with(smollm2(), "head_dim", json!(1u64 << 60)),
            "num_attention_heads",
            json!(1u64 << 10),
        )),
        "num_attention_heads",
        "1024",
    );
    for field in [
        "hidden_size",
        "vocab_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ] {
        match parse(without(smollm2(), field)) {
            Err(ModelError::MissingField { field: f, path }) => {
                assert_eq!(f, field);
                assert!(path.ends_with("config.json"));
            }
            other => panic!("expected MissingField {field}, got {other:?}"),
        }
    }
}

#[test]
fn unreadable_files_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("config.json");
    assert!(matches!(
        ModelConfig::from_hf_config(&missing),
        Err(ModelError::MissingFile {
            what: "config.json",
            ..
        })
    ));
    std::fs::write(&missing, "{\"model_type\": \"llama\",").expect("write");
    let err = ModelConfig::from_hf_config(&missing).expect_err("truncated JSON");
    assert_eq!(err.kind(), "malformed");
    assert!(err.to_string().contains("config.json"), "{err}");
    std::fs::write(&missing, "[1, 2]").expect("write");
    assert_eq!(
        ModelConfig::from_hf_config(&missing)
            .map_err(|e| e.kind())
            .err(),
        Some("malformed")
    );
}
