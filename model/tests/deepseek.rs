//! DeepSeek V2 and V3 (latent attention) from the committed tiny models
//! (`scripts/golden/make_families.py`, `make_family_ggufs.py`): their
//! weights load from safetensors and from every GGUF conversion with the
//! shapes `kvmesh_model::weights::MlaWeights` documents; each head's key
//! and value maps split from Hugging Face's `kv_b_proj` equal those the
//! GGUF files hold (V2's as one `attn_kv_b`, V3's split per head into
//! `attn_k_b`/`attn_v_b` by llama.cpp's current converter), value by
//! value in f32 and within the format's rounding when quantized; and the
//! engine caches their latent entries (their logits: `golden.rs`).

mod common;

use common::max_rel_diff;

use kvmesh_kernels::quant::QFormat;
use kvmesh_kvpool::KvEntry;
use kvmesh_model::engine::{Engine, EngineConfig};
use kvmesh_model::weights::{AttnWeights, Ffn, Matrix, MlaQuery, Weights};
use kvmesh_model::{load, load_with, Precision};

const FAMILIES: [&str; 2] = ["deepseek_v2", "deepseek_v3"];

fn values(m: &Matrix) -> Vec<f32> {
    m.to_dense()
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("dense values")
}

/// Every layer's attention is latent, with the documented shapes: the tiny
/// configs have 4 heads, hidden 64, nope 16, rope 8, v 16, a 32-wide
/// latent, V2's low-rank query of rank 32 and V3's full-rank one; layer 0
/// is dense, layers 1 and 2 route to 8 experts beside a shared one.
fn check_shapes(w: &Weights, family: &str) {
    let (h, heads, kv_rank, nope, rope, v) = (64, 4, 32, 16, 8, 16);
    let q_rows = heads * (nope + rope);
    assert_eq!(w.layers.len(), 3);
    for (i, l) in w.layers.iter().enumerate() {
        let AttnWeights::Latent(m) = &l.attn else {
            panic!("{family} layer {i}: q/k/v attention");
        };
        match (&m.q, family) {
            (MlaQuery::LowRank { a, norm, b }, "deepseek_v2") => {
                assert_eq!(
                    (a.shape(), norm.len(), b.shape()),
                    ((32, h), 32, (q_rows, 32))
                );
            }
            (MlaQuery::Direct(q), "deepseek_v3") => assert_eq!(q.shape(), (q_rows, h)),
            (q, _) => panic!("{family}: query {q:?}"),
        }
        assert_eq!(m.kv_a.shape(), (kv_rank + rope, h));
        assert_eq!(m.kv_a_norm.len(), kv_rank);
        assert_eq!((m.k_b.len(), m.v_b.len()), (heads, heads));
        assert!(m.k_b.iter().all(|k| k.shape() == (kv_rank, nope)));
        assert!(m.v_b.iter().all(|x| x.shape() == (v, kv_rank)));
        assert_eq!(l.wo.shape(), (h, heads * v));
        assert!(l.bo.is_none() && l.sinks.is_none() && l.post_attn_norm.is_none());
        match (&l.ffn, i) {
            (Ffn::Dense(mlp), 0) => assert_eq!(mlp.gate.shape(), (160, h)),
            (Ffn::Moe(moe), 1 | 2) => {
                assert_eq!(moe.experts.len(), 8);
                assert_eq!(moe.router.shape(), (8, h));
                let shared = moe.shared.as_ref().expect("shared expert");
                let width = if family == "deepseek_v2" { 64 } else { 32 };
                assert_eq!(shared.gate.shape(), (width, h));
                assert!(moe.shared_gate.is_none());
                assert_eq!(moe.router_bias.is_some(), family == "deepseek_v3");
            }
            _ => panic!("{family} layer {i}: unexpected MLP"),
        }
    }
}

#[test]
fn safetensors_weights_have_the_documented_shapes() {
    for family in FAMILIES {
        let m = load(&common::tiny_family_dir(family)).expect("load");
        assert_eq!(m.config.family, family);
        check_shapes(&m.weights, family);
    }
}

/// Each F32 GGUF loads to exactly the safetensors' weights, matrix by
/// matrix and vector by vector in the layers' order: the names, the
/// stacks split per expert and per head, and V3's per-head `attn_k_b`
/// (transposed back by the converter's inverse) and `attn_v_b` equal the
/// key and value rows of `kv_b_proj` to the bit.
#[test]
fn f32_gguf_weights_equal_the_safetensors_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for family in FAMILIES {
        let hf = load(&common::tiny_family_dir(family)).expect("safetensors");
        let gguf = load(&common::tiny_family_gguf(family, "F32")).expect("gguf");
        check_shapes(&gguf.weights, family);
        assert_eq!(
            bits(&values(&gguf.weights.embed)),
            bits(&values(&hf.weights.embed))
        );
        assert_eq!(
            bits(&values(&gguf.weights.lm_head)),
            bits(&values(&hf.weights.lm_head))
        );
        for (i, (g, h)) in gguf
            .weights
            .layers
            .iter()
            .zip(&hf.weights.layers)
            .enumerate()
        {
            let (mg, mh) = (g.matrices(), h.matrices());
            assert_eq!(mg.len(), mh.len(), "{family} layer {i}");
            for (j, (a, b)) in mg.into_iter().zip(mh).enumerate() {
                assert_eq!(a.shape(), b.shape(), "{family} layer {i} matrix {j}");
                assert!(
                    bits(&values(a)) == bits(&values(b)),
                    "{family} layer {i}: matrix {j} differs"
                );
            }
            let (vg, vh): (Vec<_>, Vec<_>) = (g.vectors().collect(), h.vectors().collect());
            assert_eq!(vg.len(), vh.len());
            for (a, b) in vg.into_iter().zip(vh) {
                assert_eq!(bits(a), bits(b), "{family} layer {i}: a vector differs");
            }
        }
    }
}

/// The quantized files: in the quantized mode every matrix keeps its
/// blocks but the f32 routers and the per-head key maps `k_b`: from V2's
/// one `attn_kv_b` they are transposes, which rows of blocks cannot
/// express; V3's `attn_k_b` rows (nope = 16 values) are too narrow for a
/// 32-value block, so llama.cpp's converter (and the writer) stored them
/// in F16, read as f32 (a real V3's 128-wide rows keep their blocks). The
/// file's F16 fallback is checked too. Each matrix equals the exact mode's
/// dequantization of the same file, and the safetensors' values within
/// the format's rounding: so the per-head split of a quantized file's
/// `kv_b` (V2) and its `attn_k_b`/`attn_v_b` (V3) are the same maps as
/// Hugging Face's.
#[test]
fn quantized_ggufs_keep_their_blocks_and_split_kv_b_as_hugging_face_does() {
    for family in FAMILIES {
        let hf = load(&common::tiny_family_dir(family)).expect("safetensors");
        for (ty, format, tolerance) in
            [("Q8_0", QFormat::Q8_0, 0.01), ("Q4_0", QFormat::Q4_0, 0.15)]
        {
            let path = common::tiny_family_gguf(family, ty);
            let q = load_with(&path, Precision::Quantized).expect("quantized");
            let e = load_with(&path, Precision::Exact).expect("exact");
            assert_eq!(q.config, e.config);
            check_shapes(&q.weights, family);
            for (i, ((lq, le), lh)) in q
                .weights
                .layers
                .iter()
                .zip(&e.weights.layers)
                .zip(&hf.weights.layers)
                .enumerate()
            {
                let (mq, me, mh) = (lq.matrices(), le.matrices(), lh.matrices());
                let routers: Vec<*const Matrix> = match &lq.ffn {
                    Ffn::Moe(m) => vec![&m.router as *const Matrix],
                    Ffn::Dense(_) => Vec::new(),
                };
                let latent = lq.attn.latent().expect("latent");
                for ((a, b), h) in mq.into_iter().zip(me).zip(mh) {
                    let what = format!("{family} {ty} layer {i} {:?}", a.shape());
                    let is_k_b = latent.k_b.iter().any(|k| std::ptr::eq(k, a));
                    match a {
                        Matrix::Quant(blocks) => {
                            assert!(!is_k_b, "{what}: k_b in blocks");
                            assert_eq!(blocks.format(), format, "{what}");
                        }
                        Matrix::Dense(_) => assert!(
                            is_k_b || routers.contains(&(a as *const Matrix)),
                            "{what}: f32"
                        ),
                    }
                    assert!(max_rel_diff(a, b) <= 1e-6, "{what}: quantized vs exact");
                    let d = max_rel_diff(b, h);
                    assert!(d <= tolerance, "{what}: {d} from the safetensors");
                }
            }
        }
    }
}

/// V3's quantized files hold `attn_k_b` in F16 (too narrow for Q8_0 and
/// Q4_0 blocks, as llama.cpp's converter falls back) and `attn_v_b` in the
/// file's type; the exact mode reads the F16 values to the bit.
#[test]
fn narrow_f16_key_maps_are_read_exactly() {
    for ty in ["Q8_0", "Q4_0"] {
        let path = common::tiny_family_gguf("deepseek_v3", ty);
        let header = kvmesh_tokenizer::gguf::GgufHeader::read(&path).expect("header");
        let ty_of = |name: &str| header.tensor(name).map(|t| t.ggml_type);
        assert_eq!(ty_of("blk.0.attn_k_b.weight"), Some(1), "{ty}: F16");
        assert_ne!(ty_of("blk.0.attn_v_b.weight"), Some(1), "{ty}: quantized");
        let q = load_with(&path, Precision::Quantized).expect("quantized");
        let hf = load(&common::tiny_family_dir("deepseek_v3")).expect("safetensors");
        let (kq, kh) = (
            &q.weights.layers[0].attn.latent().expect("latent").k_b[0],
            &hf.weights.layers[0].attn.latent().expect("latent").k_b[0],
        );
        // F16 rounding of the safetensors' f32 values.
        let rounded: Vec<f32> = values(kh)
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert_eq!(values(kq), rounded, "{ty}");
    }
}

/// The engine's pool holds what latent attention caches: one latent
/// entry of `kv_lora_rank + qk_rope_dim` values per token and layer, no V
/// block; a prompt's KV read back through the checked reader is keys only.
#[test]
fn the_engine_caches_one_latent_entry_per_token_and_layer() {
    for family in FAMILIES {
        let engine = Engine::load(
            &common::tiny_family_dir(family),
            &EngineConfig {
                kv_pool_tokens: Some(64),
                ..EngineConfig::default()
            },
        )
        .expect("load");
        let mla = engine.model().config().mla.clone().expect("latent");
        let pool = engine.pool().config();
        assert_eq!(pool.entry, KvEntry::Latent, "{family}");
        assert_eq!((pool.n_kv_heads, pool.head_dim), (1, mla.entry_dim()));
        let mut seq = engine.admit(vec![5, 6, 7, 8, 9], 1).expect("admit");
        engine.prefill(&mut seq).expect("prefill");
        let (k, v) = engine.prompt_kv(&seq, 0).expect("read back");
        assert_eq!(k.len(), 5 * mla.entry_dim(), "{family}");
        assert!(v.is_empty(), "{family}");
    }
}
