use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as GgufValue;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};

use super::test_util::*;
use super::*;
use crate::weights::LayerWeights;

fn dense(m: &crate::weights::Matrix) -> Tensor {
    m.to_dense().expect("dense")
}

/// The loaded tensor for an HF name.
fn loaded<'a>(w: &'a Weights, name: &str) -> Tensor {
    let layer =
        |i: &str| -> &'a LayerWeights { &w.layers[i.parse::<usize>().expect("layer index")] };
    let vec = |v: &Vec<f32>| Tensor::from_slice(v, v.len(), &Device::Cpu).expect("tensor");
    match name {
        "model.embed_tokens.weight" => dense(&w.embed),
        "lm_head.weight" => dense(&w.lm_head),
        "model.norm.weight" => vec(&w.final_norm),
        _ => {
            let rest = name.strip_prefix("model.layers.").expect("layer tensor");
            let (i, part) = rest.split_once('.').expect("layer part");
            let l = layer(i);
            let a = l.attn.gqa().expect("q/k/v attention");
            let opt = |b: &Option<Vec<f32>>| vec(b.as_ref().expect("bias present"));
            match part {
                "input_layernorm.weight" => vec(&l.attn_norm),
                "post_attention_layernorm.weight" => vec(&l.mlp_norm),
                "self_attn.q_proj.weight" => dense(&a.wq),
                "self_attn.k_proj.weight" => dense(&a.wk),
                "self_attn.v_proj.weight" => dense(&a.wv),
                "self_attn.o_proj.weight" => dense(&l.wo),
                "self_attn.q_proj.bias" => opt(&a.bq),
                "self_attn.k_proj.bias" => opt(&a.bk),
                "self_attn.v_proj.bias" => opt(&a.bv),
                "mlp.gate_proj.weight" => dense(&l.ffn.dense().expect("dense MLP").gate),
                "mlp.up_proj.weight" => dense(&l.ffn.dense().expect("dense MLP").up),
                "mlp.down_proj.weight" => dense(&l.ffn.dense().expect("dense MLP").down),
                other => panic!("unknown part {other}"),
            }
        }
    }
}

#[track_caller]
fn assert_weights_equal(w: &Weights, expected: &HashMap<String, Tensor>, tolerance: f32) {
    for (name, t) in expected {
        let got = loaded(w, name);
        assert_eq!(got.dtype(), DType::F32, "{name}");
        assert!(got.is_contiguous(), "{name} is not contiguous");
        let diff = max_abs_diff(&got, t);
        assert!(diff <= tolerance, "{name} differs by {diff}");
    }
}

fn all_f32_contiguous(w: &Weights) -> bool {
    let mut ts = vec![&w.embed, &w.lm_head];
    for l in &w.layers {
        ts.extend(l.matrices());
    }
    ts.iter().all(|m| {
        m.dense()
            .is_some_and(|t| t.dtype() == DType::F32 && t.is_contiguous() && t.device().is_cpu())
    })
}

#[test]
fn hf_directory_loads_in_each_float_dtype() {
    for (dtype, tolerance) in [(DType::F32, 0.0), (DType::F16, 0.0), (DType::BF16, 0.0)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let expected = write_hf_model(
            dir.path(),
            TinySpec {
                dtype,
                ..TinySpec::default()
            },
        );
        let m = load(dir.path()).expect("load");
        assert_eq!(m.format, ModelFormat::HfSafetensors);
        assert_eq!(m.path, dir.path());
        assert_eq!((m.config.n_layers, m.weights.layers.len()), (2, 2));
        assert!(all_f32_contiguous(&m.weights));
        assert_weights_equal(&m.weights, &expected, tolerance);
        // Tied: the LM head is the embedding.
        assert!(m.weights.lm_head.same_storage(&m.weights.embed));
        assert!(m.weights.layers[0].attn.gqa().expect("q/k/v").bq.is_none());
        assert_eq!(m.tokenizer.bos_token(), Some("<s>"));
        assert_eq!(m.stop_token_ids(), vec![TINY_EOS]);
    }
}

#[test]
fn hf_sharded_untied_and_qwen2_biases() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = TinySpec {
        tie: false,
        qwen2: true,
        shards: 3,
        ..TinySpec::default()
    };
    let expected = write_hf_model(dir.path(), spec);
    assert!(
        expected.contains_key("lm_head.weight")
            && expected.contains_key("model.layers.1.self_attn.v_proj.bias")
    );
    let m = load(dir.path()).expect("load");
    assert!(m.config.attention_bias && !m.config.tie_word_embeddings);
    assert!(!m.weights.lm_head.same_storage(&m.weights.embed));
    assert_weights_equal(&m.weights, &expected, 0.0);
    let l = m.weights.layers[1].attn.gqa().expect("q/k/v attention");
    assert_eq!(
        (l.bq.as_ref().map(Vec::len), l.bk.as_ref().map(Vec::len)),
        (Some(32), Some(16))
    );
}

/// Rewrite `model.safetensors` of a tiny directory with `edit` applied.
fn edit_safetensors(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).expect("reload");
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).expect("save");
}

#[test]
fn hf_errors_name_the_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_model(dir.path(), TinySpec::default());

    edit_safetensors(dir.path(), |t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    match load(dir.path()) {
        Err(ModelError::MissingTensor { tensor, path }) => {
            assert_eq!(tensor, "model.layers.1.mlp.up_proj.weight");
            assert_eq!(path, dir.path());
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }

    edit_safetensors(dir.path(), |t| {
        t.insert(
            "model.layers.1.mlp.up_proj.weight".into(),
            values(&[64, 31], 1),
        );
    });
    match load(dir.path()) {
        Err(ModelError::ShapeMismatch {
            tensor,
            expected,
            got,
            path,
        }) => {
            assert_eq!(tensor, "model.layers.1.mlp.up_proj.weight");
            assert_eq!((expected, got), (vec![64, 32], vec![64, 31]));
            assert!(path.ends_with("model.safetensors"));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }

    edit_safetensors(dir.path(), |t| {
        let ints = Tensor::zeros((64, 32), DType::I64, &Device::Cpu).expect("zeros");
        t.insert("model.layers.1.mlp.up_proj.weight".into(), ints);
    });
    match load(dir.path()) {
        Err(e @ ModelError::UnsupportedDtype { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("I64"),
                "{msg}"
            );
        }
        other => panic!("expected UnsupportedDtype, got {other:?}"),
    }
}

#[test]
fn hf_missing_and_truncated_files_are_typed_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_model(dir.path(), TinySpec::default());
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).expect("read");
    for cut in [0, 5, 8, 40, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&st, &bytes[..cut]).expect("write");
        match load(dir.path()) {
            Err(ModelError::Malformed { path, .. }) => assert_eq!(path, st, "cut at {cut}"),
            other => panic!("cut at {cut}: expected Malformed, got {other:?}"),
        }
    }
    std::fs::remove_file(&st).expect("rm");
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::MissingFile {
            what: "*.safetensors weights",
            ..
        })
    ));

    std::fs::remove_file(dir.path().join("tokenizer.json")).expect("rm");
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::MissingFile {
            what: "tokenizer.json",
            ..
        })
    ));
    std::fs::remove_file(dir.path().join("config.json")).expect("rm");
    assert!(matches!(
        load(dir.path()),
        Err(ModelError::MissingFile {
            what: "config.json",
            ..
        })
    ));
}

#[test]
fn the_tokenizer_must_fit_the_embedding() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_model(dir.path(), TinySpec::default());
    let mut cfg = tiny_config_json(TinySpec::default());
    cfg["vocab_size"] = 200.into();
    cfg["bos_token_id"] = 1.into();
    cfg["eos_token_id"] = 2.into();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).expect("write");
    // Shapes follow the config, so rewrite the embedding to 200 rows first.
    edit_safetensors(dir.path(), |t| {
        t.insert("model.embed_tokens.weight".into(), values(&[200, 32], 3));
    });
    match load(dir.path()) {
        Err(ModelError::InvalidField { field, reason, .. }) => {
            assert_eq!(field, "vocab_size");
            assert!(reason.contains("263"), "{reason}");
        }
        other => panic!("expected InvalidField, got {other:?}"),
    }
}

#[test]
fn gguf_loads_and_unpermutes_q_and_k() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (dtype, tie) in [
        (GgmlDType::F32, true),
        (GgmlDType::F16, false),
        (GgmlDType::Q8_0, true),
        (GgmlDType::Q4_0, false),
        (GgmlDType::Q4_1, true),
    ] {
        let path = dir.path().join(format!("tiny-{dtype:?}.gguf"));
        let expected = write_gguf_model(&path, tie, dtype, |_, _| {});
        let m = load(&path).unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        assert_eq!(m.format, ModelFormat::Gguf);
        assert_eq!(m.config.architecture, "llama");
        assert_eq!(
            (m.config.head_dim, m.config.n_kv_heads, m.config.vocab_size),
            (8, 2, TINY_VOCAB)
        );
        assert_eq!(m.config.tie_word_embeddings, tie);
        assert_eq!(m.weights.lm_head.same_storage(&m.weights.embed), tie);
        assert!(all_f32_contiguous(&m.weights));
        // Exactly the dequantized originals, in HF row order.
        assert_weights_equal(&m.weights, &expected, 0.0);
        // The file's eos, and the ChatML end-of-turn control token.
        let im_end = m.tokenizer.token_to_id("<|im_end|>").expect("<|im_end|>");
        assert_eq!(m.tokenizer.eos_token_ids(), vec![TINY_EOS, im_end]);
        assert_eq!(m.config.eos_token_ids, vec![TINY_EOS]);

        // Quantized: every block format stays blocks (un-permuted by whole
        // rows), f32 stays f32; the values are the same.
        let q = crate::load_with(&path, crate::Precision::Quantized)
            .unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        let kept = dtype != GgmlDType::F32;
        for l in &q.weights.layers {
            for m in l.matrices() {
                assert_eq!(m.dense().is_none(), kept, "{dtype:?}");
            }
        }
        assert_eq!(q.weights.lm_head.same_storage(&q.weights.embed), tie);
        assert_eq!(
            q.precision,
            crate::Precision::Quantized,
            "a GGUF file keeps the precision asked for"
        );
        assert_weights_equal(&q.weights, &expected, 0.0);
    }
}

#[test]
fn gguf_errors_name_the_field_or_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let set = |md: &mut Vec<(String, GgufValue)>, key: &str, v: GgufValue| {
        md.retain(|(k, _)| k != key);
        md.push((key.to_owned(), v));
    };

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(md, "general.architecture", GgufValue::String("gpt2".into()))
    });
    assert!(
        matches!(load(&path), Err(ModelError::UnsupportedArchitecture { ref architecture, .. }) if architecture == "gpt2")
    );

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(md, "tokenizer.ggml.model", GgufValue::String("bert".into()))
    });
    assert!(
        matches!(load(&path), Err(ModelError::InvalidField { ref field, .. }) if field == "tokenizer.ggml.model")
    );

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(
            md,
            "tokenizer.ggml.pre",
            GgufValue::String("deepseek-llm".into()),
        )
    });
    assert!(
        matches!(load(&path), Err(ModelError::InvalidField { ref field, ref value, .. }) if field == "tokenizer.ggml.pre" && value.contains("deepseek-llm"))
    );

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        md.retain(|(k, _)| k != "llama.block_count")
    });
    assert!(
        matches!(load(&path), Err(ModelError::MissingField { ref field, .. }) if field == "llama.block_count")
    );

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(md, "llama.attention.head_count_kv", GgufValue::U32(3))
    });
    assert!(
        matches!(load(&path), Err(ModelError::InvalidField { ref field, .. }) if field == "llama.attention.head_count_kv")
    );

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(md, "llama.embedding_length", GgufValue::String("32".into()))
    });
    assert!(
        matches!(load(&path), Err(ModelError::InvalidField { ref field, .. }) if field == "llama.embedding_length")
    );

    write_gguf_model(&path, true, GgmlDType::F32, |_, ts| {
        ts.retain(|(n, _)| n != "blk.1.attn_v.weight")
    });
    match load(&path) {
        Err(ModelError::MissingTensor { tensor, path: p }) => assert_eq!(
            (tensor.as_str(), p.as_path()),
            ("blk.1.attn_v.weight", path.as_path())
        ),
        other => panic!("expected MissingTensor, got {other:?}"),
    }

    write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
        set(md, "llama.feed_forward_length", GgufValue::U32(96))
    });
    match load(&path) {
        Err(ModelError::ShapeMismatch {
            tensor,
            expected,
            got,
            ..
        }) => {
            assert_eq!(tensor, "blk.0.ffn_gate.weight");
            assert_eq!((expected, got), (vec![96, 32], vec![64, 32]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
}

#[test]
fn truncated_or_garbage_gguf_is_malformed_never_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.gguf");
    write_gguf_model(&good, false, GgmlDType::Q8_0, |_, _| {});
    let bytes = std::fs::read(&good).expect("read");
    let bad = dir.path().join("bad.gguf");
    let mut cuts: Vec<usize> = vec![4, 8, 16, 24, 100, 1000, 3000];
    cuts.extend((1..8).map(|k| bytes.len() * k / 8));
    cuts.push(bytes.len() - 1);
    for cut in cuts {
        std::fs::write(&bad, &bytes[..cut]).expect("write");
        match load(&bad) {
            Err(ModelError::Malformed { path, .. }) => assert_eq!(path, bad, "cut at {cut}"),
            other => panic!(
                "cut at {cut} of {}: expected Malformed, got {other:?}",
                bytes.len()
            ),
        }
    }
    // Corrupt counts in the header: absurd tensor and metadata counts.
    let mut corrupt = bytes.clone();
    corrupt[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&bad, &corrupt).expect("write");
    assert_eq!(
        load(&bad).map(|_| ()).map_err(|e| e.kind()),
        Err("malformed")
    );
    // An alignment of 0 would divide by zero: refused by the header reader.
    write_gguf_model(&bad, true, GgmlDType::F32, |md, _| {
        md.push(("general.alignment".into(), GgufValue::U32(0)))
    });
    assert_eq!(
        load(&bad).map(|_| ()).map_err(|e| e.kind()),
        Err("malformed")
    );

    for (name, content) in [
        ("empty", &b""[..]),
        ("short", &b"GG"[..]),
        ("text.gguf", &b"hello, not a model"[..]),
        ("magic-only", &b"GGUF"[..]),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, content).expect("write");
        match load(&p) {
            Err(ModelError::Malformed { path, .. }) => assert_eq!(path, p),
            other => panic!("{name}: expected Malformed, got {other:?}"),
        }
    }
    let missing = dir.path().join("nope.gguf");
    assert!(
        matches!(load(&missing), Err(ModelError::MissingFile { ref path, .. }) if path == &missing)
    );
}

/// Values of the SmolLM2 GGUF as transformers loads it
/// (`load_gguf_checkpoint`: dequantized, Q/K rows reverse-permuted), for
/// (tensor, row, first column, four values).
const SMOLLM2_REFERENCE: [(&str, usize, usize, [f64; 4]); 8] = [
    (
        "model.embed_tokens.weight",
        504,
        0,
        [0.109603882, 0.0174369812, -0.0946578979, 0.0822029114],
    ),
    (
        "model.layers.0.self_attn.q_proj.weight",
        1,
        0,
        [-0.159179688, 0.397949219, -0.0198974609, -1.2734375],
    ),
    (
        "model.layers.0.self_attn.q_proj.weight",
        33,
        100,
        [0.305725098, 0.588623047, -0.071472168, -0.54296875],
    ),
    (
        "model.layers.0.self_attn.k_proj.weight",
        40,
        7,
        [0.77734375, -0.82421875, -0.0234375, 0.13671875],
    ),
    (
        "model.layers.29.self_attn.v_proj.weight",
        191,
        570,
        [-0.0335083008, -0.0335083008, -0.206970215, -0.206970215],
    ),
    (
        "model.layers.29.mlp.down_proj.weight",
        575,
        1530,
        [-0.08984375, 0.0078125, 0.056640625, 0.203125],
    ),
    (
        "model.layers.3.input_layernorm.weight",
        0,
        10,
        [0.265625, 0.237304688, 0.29296875, 0.23828125],
    ),
    (
        "model.norm.weight",
        0,
        0,
        [1.7578125, 1.8203125, 1.78125, 1.6015625],
    ),
];

#[test]
fn smollm2_gguf_loads_like_transformers() {
    let Some(path) = smollm2_gguf() else { return };
    let started = std::time::Instant::now();
    let m = load(&path).expect("load SmolLM2");
    eprintln!("SmolLM2 GGUF loaded (f32) in {:?}", started.elapsed());
    let c = &m.config;
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.intermediate_size, c.n_layers),
        (49152, 576, 1536, 30)
    );
    assert_eq!(
        (
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.max_position_embeddings
        ),
        (9, 3, 64, 8192)
    );
    assert_eq!((c.rope_theta, c.rms_norm_eps), (100_000.0, 1e-5));
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert!(m.weights.lm_head.same_storage(&m.weights.embed));
    assert!(all_f32_contiguous(&m.weights));
    // transformers counts 134,515,008 parameters with the tied head once.
    assert_eq!(m.weights.parameter_count(), 134_515_008);
    for (name, row, col, want) in SMOLLM2_REFERENCE {
        let t = loaded(&m.weights, name);
        let got: Vec<f32> = if t.rank() == 2 {
            t.get(row)
                .and_then(|r| r.narrow(0, col, 4))
                .and_then(|r| r.to_vec1())
                .expect("slice")
        } else {
            t.narrow(0, col, 4)
                .and_then(|r| r.to_vec1())
                .expect("slice")
        };
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{row}, {col}..]: got {got:?}, want {want:?}"
            );
        }
    }
}

#[test]
fn a_loaded_model_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<LoadedModel>();
}

/// YaRN from GGUF as llama.cpp's converter writes it: the required factor,
/// the original context (else the context length), the betas, and the
/// magnitude from `yarn_attn_factor`, else llama.cpp's default (with
/// `yarn_log_multiplier` as `mscale_all_dim`), times `attn_factor`;
/// what has no transformers counterpart is refused by name.
#[test]
fn gguf_yarn_keys_read_as_llama_cpp_writes_them() {
    use kvmesh_kernels::rope::{yarn_attention_factor, RopeScaling, Yarn};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let with = |keys: &[(&str, GgufValue)]| {
        write_gguf_model(&path, true, GgmlDType::F32, |md, _| {
            md.push((
                "llama.rope.scaling.type".into(),
                GgufValue::String("yarn".into()),
            ));
            for (k, v) in keys {
                md.retain(|(name, _)| name != k);
                md.push(((*k).to_owned(), v.clone()));
            }
        });
        load(&path).map(|m| m.config)
    };
    let yarn = |keys: &[(&str, GgufValue)]| match with(keys).expect("yarn loads").rope_scaling {
        RopeScaling::Yarn(y) => y,
        other => panic!("expected YaRN, got {other:?}"),
    };
    // The tiny metadata's `llama.context_length`.
    let context = 128;
    let factor = ("llama.rope.scaling.factor", GgufValue::F32(8.0));
    assert_eq!(
        yarn(std::slice::from_ref(&factor)),
        Yarn {
            factor: 8.0,
            original_max_position_embeddings: context,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: yarn_attention_factor(8.0, None, None),
        }
    );
    let all = yarn(&[
        factor.clone(),
        (
            "llama.rope.scaling.original_context_length",
            GgufValue::U32(16),
        ),
        ("llama.rope.scaling.yarn_beta_fast", GgufValue::F32(16.0)),
        ("llama.rope.scaling.yarn_beta_slow", GgufValue::F32(2.0)),
        ("llama.rope.scaling.yarn_attn_factor", GgufValue::F32(0.75)),
        ("llama.rope.scaling.attn_factor", GgufValue::F32(2.0)),
        ("llama.rope.scaling.yarn_ext_factor", GgufValue::F32(1.0)),
    ]);
    assert_eq!(
        (
            all.original_max_position_embeddings,
            all.beta_fast,
            all.beta_slow
        ),
        (16, 16.0, 2.0)
    );
    assert_eq!(all.attention_factor, 1.5);
    let log_mul = yarn(&[
        factor.clone(),
        (
            "llama.rope.scaling.yarn_log_multiplier",
            GgufValue::F32(0.5),
        ),
        ("llama.rope.scaling.yarn_ext_factor", GgufValue::F32(-1.0)),
    ]);
    assert_eq!(
        log_mul.attention_factor,
        yarn_attention_factor(8.0, Some(1.0), Some(0.5))
    );

    let invalid = |keys: &[(&str, GgufValue)]| match with(keys) {
        Err(ModelError::InvalidField { field, .. }) => field,
        other => panic!("expected InvalidField, got {other:?}"),
    };
    assert_eq!(
        invalid(&[
            factor.clone(),
            ("llama.rope.scaling.yarn_ext_factor", GgufValue::F32(0.5))
        ]),
        "llama.rope.scaling.yarn_ext_factor"
    );
    assert_eq!(
        invalid(&[("llama.rope.scaling.factor", GgufValue::F32(-4.0))]),
        "llama.rope.scaling.factor"
    );
    assert!(matches!(
        with(&[]),
        Err(ModelError::MissingField { ref field, .. }) if field == "llama.rope.scaling.factor"
    ));
    let refused = with(&[
        factor,
        (
            "llama.rope.scaling.type",
            GgufValue::String("longrope".into()),
        ),
    ])
    .expect_err("longrope");
    assert!(
        matches!(refused, ModelError::InvalidField { ref field, ref value, .. }
            if field == "llama.rope.scaling.type" && value.contains("longrope")),
        "{refused}"
    );
}
