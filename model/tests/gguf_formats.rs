//! GGUF files in every legacy block format, written by the `gguf` package
//! (`scripts/golden/make_family_ggufs.py`: the tiny Qwen3 in F16, BF16,
//! Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, the other tiny families in Q8_0, the
//! mixtures also in Q4_0),
//! loaded back: the quantized mode keeps each matrix's blocks
//! (`Matrix::Quant`, never widened to f32), and their values equal the
//! exact mode's dequantization of the same file (candle's, an independent
//! decoder) to within one rounding of the format's scale arithmetic.

mod common;

use kvmesh_model::weights::{Ffn, Matrix};
use kvmesh_model::{load_with, Precision};

fn max_rel_diff(a: &Matrix, b: &Matrix) -> f32 {
    let (a, b) = (
        a.to_dense()
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>()),
        b.to_dense()
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>()),
    );
    let (a, b) = (a.expect("dense"), b.expect("dense"));
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

#[test]
fn every_legacy_format_loads_back_to_its_dequantized_values() {
    let cases = [
        ("qwen3", "F16"),
        ("qwen3", "BF16"),
        ("qwen3", "Q8_0"),
        ("qwen3", "Q4_0"),
        ("qwen3", "Q4_1"),
        ("qwen3", "Q5_0"),
        ("qwen3", "Q5_1"),
        ("qwen2", "Q8_0"),
        ("gemma2", "Q8_0"),
        ("gemma3", "Q8_0"),
        ("phi3", "Q8_0"),
        ("mistral", "Q8_0"),
        ("mixtral", "Q8_0"),
        ("mixtral", "Q4_0"),
        ("qwen2_moe", "Q8_0"),
        ("qwen2_moe", "Q4_0"),
        ("qwen3_moe", "Q8_0"),
        ("qwen3_moe", "Q4_0"),
        ("glm4_moe", "Q8_0"),
        ("glm4_moe", "Q4_0"),
    ];
    for (family, ty) in cases {
        let path = common::tiny_family_gguf(family, ty);
        let q = load_with(&path, Precision::Quantized).expect("load quantized");
        let e = load_with(&path, Precision::Exact).expect("load exact");
        assert_eq!(q.config, e.config, "{family} {ty}");
        let mut routers = 0;
        let mut pairs = vec![
            (&q.weights.embed, &e.weights.embed),
            (&q.weights.lm_head, &e.weights.lm_head),
        ];
        for (lq, le) in q.weights.layers.iter().zip(&e.weights.layers) {
            // llama.cpp keeps an expert router in f32 (so does the writer).
            routers += usize::from(matches!(lq.ffn, Ffn::Moe(_)));
            let (mq, me) = (lq.matrices(), le.matrices());
            assert_eq!(mq.len(), me.len(), "{family} {ty}: matrices per layer");
            pairs.extend(mq.into_iter().zip(me));
        }
        let total = pairs.len();
        let mut quant = 0;
        for (mq, me) in pairs {
            assert!(matches!(me, Matrix::Dense(_)), "the exact mode is f32");
            quant += usize::from(matches!(mq, Matrix::Quant(_)));
            let d = max_rel_diff(mq, me);
            assert!(
                d <= 1e-6,
                "{family} {ty}: a matrix differs by {d} of its largest value"
            );
        }
        assert_eq!(
            quant + routers,
            total,
            "{family} {ty}: every matrix but the f32 routers stays in its blocks"
        );
    }
}

/// A type kvmesh does not run is refused at load in either mode, naming
/// the tensor and the type, never widened or skipped.
#[test]
fn an_unsupported_tensor_type_is_refused_by_name() {
    let path = common::tiny_family_gguf("qwen3", "IQ4_NL");
    for precision in [Precision::Quantized, Precision::Exact] {
        let err = load_with(&path, precision).expect_err("IQ4_NL is not run");
        let msg = err.to_string();
        assert_eq!(err.kind(), "unsupported_dtype", "{msg}");
        assert!(
            msg.contains("blk.1.attn_v.weight") && msg.contains("IQ4_NL"),
            "{msg}"
        );
    }
}
