//! GGUF files in every legacy block format, written by the `gguf` package
//! (`scripts/golden/make_family_ggufs.py`: the tiny Qwen3 in F16, BF16,
//! Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, the other tiny families in Q8_0, the
//! mixtures also in Q4_0, gpt-oss with MXFP4 experts, unfused and with
//! gate and up fused into `ffn_gate_up_exps`),
//! loaded back: the quantized mode keeps each matrix's blocks
//! (`Matrix::Quant`, never widened to f32), and their values equal the
//! exact mode's dequantization of the same file (candle's, an independent
//! decoder) to within one rounding of the format's scale arithmetic.

mod common;

use common::max_rel_diff;

use kvmesh_model::weights::{Ffn, Matrix};
use kvmesh_model::{load_with, Precision};

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
        // Experts in MXFP4, the other matrices BF16 (the exact mode's
        // MXFP4 values are the kernels' dequantization, checked against
        // gguf-py's in kvmesh-kernels).
        ("gpt_oss", "MXFP4"),
        ("gpt_oss", "MXFP4-fused"),
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

/// gpt-oss with each layer's expert gate and up fused into one
/// `ffn_gate_up_exps` stack (and its bias stack) loads to the same weights
/// as the unfused file, to the byte: whole rows of MXFP4 blocks split,
/// never widened, each expert's gate and up in their rows; and the biases
/// to the bit. In the exact mode too.
#[test]
fn fused_expert_gate_up_loads_equal_to_separate_stacks() {
    let fused = common::tiny_family_gguf("gpt_oss", "MXFP4-fused");
    let split = common::tiny_family_gguf("gpt_oss", "MXFP4");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for precision in [Precision::Quantized, Precision::Exact] {
        let (f, s) = (
            load_with(&fused, precision).expect("fused"),
            load_with(&split, precision).expect("split"),
        );
        assert_eq!(f.config, s.config);
        let mut experts = 0;
        for (lf, ls) in f.weights.layers.iter().zip(&s.weights.layers) {
            let (Ffn::Moe(mf), Ffn::Moe(ms)) = (&lf.ffn, &ls.ffn) else {
                panic!("gpt-oss layers are mixtures");
            };
            assert_eq!(mf.experts.len(), ms.experts.len());
            for (ef, es) in mf.experts.iter().zip(&ms.experts) {
                for (a, b) in ef.matrices().into_iter().zip(es.matrices()) {
                    match (a, b) {
                        (Matrix::Quant(a), Matrix::Quant(b)) => {
                            assert_eq!(a.format(), kvmesh_kernels::quant::QFormat::MXFP4);
                            assert_eq!((a.rows(), a.cols()), (b.rows(), b.cols()));
                            assert!(a.bytes() == b.bytes(), "expert blocks differ");
                        }
                        (Matrix::Dense(_), Matrix::Dense(_)) => {
                            assert!(precision == Precision::Exact);
                            assert_eq!(max_rel_diff(a, b), 0.0, "expert values differ");
                        }
                        _ => panic!("{precision:?}: one file's expert is not in its blocks"),
                    }
                }
                let (bf, bs) = (ef.bias.as_ref(), es.bias.as_ref());
                let (bf, bs) = (bf.expect("bias"), bs.expect("bias"));
                assert_eq!(bits(&bf.gate), bits(&bs.gate));
                assert_eq!(bits(&bf.up), bits(&bs.up));
                assert_eq!(bits(&bf.down), bits(&bs.down));
                experts += 1;
            }
        }
        assert_eq!(experts, 4 * 4, "four layers of four experts");
    }
}

/// The MXFP4 file cut short anywhere in its tensor data (the expert
/// stacks among it) is a typed error naming the file in either mode,
/// never a panic or a partial model.
#[test]
fn a_truncated_mxfp4_file_is_malformed() {
    let bytes = std::fs::read(common::tiny_family_gguf("gpt_oss", "MXFP4")).expect("read");
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("cut.gguf");
    for k in 1..8 {
        let cut = bytes.len() * (8 + k) / 16;
        std::fs::write(&bad, &bytes[..cut]).expect("write");
        for precision in [Precision::Quantized, Precision::Exact] {
            let err = load_with(&bad, precision).expect_err("truncated");
            assert_eq!(err.kind(), "malformed", "cut at {cut}: {err}");
            assert!(err.to_string().contains("cut.gguf"), "{err}");
        }
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
