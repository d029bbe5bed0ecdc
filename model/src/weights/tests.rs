use super::*;
use crate::loader::test_util::values;
use candle_core::Device;

/// Hugging Face row of GGUF row `r` in a head of `d` rows: GGUF keeps the
/// pair (j, j + d/2) adjacent at rows (2j, 2j + 1).
fn hf_row_of_gguf_row(r: usize, d: usize) -> usize {
    let (head, within) = (r / d, r % d);
    head * d + (within % 2) * (d / 2) + within / 2
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    for (n_head, head_dim, cols) in [(4, 8, 3), (3, 64, 5), (1, 2, 1)] {
        let w = values(&[n_head * head_dim, cols], 7);
        let there_and_back = unpermute_qk_rows(
            &permute_qk_rows(&w, n_head, head_dim).expect("tensor op"),
            n_head,
            head_dim,
        )
        .expect("tensor op");
        assert_eq!(
            there_and_back.to_vec2::<f32>().expect("tensor op"),
            w.to_vec2::<f32>().expect("tensor op")
        );
        let back_and_there = permute_qk_rows(
            &unpermute_qk_rows(&w, n_head, head_dim).expect("tensor op"),
            n_head,
            head_dim,
        )
        .expect("tensor op");
        assert_eq!(
            back_and_there.to_vec2::<f32>().expect("tensor op"),
            w.to_vec2::<f32>().expect("tensor op")
        );
    }
}

#[test]
fn unpermute_matches_the_index_formula() {
    let (n_head, head_dim, cols) = (3, 8, 4);
    let rows = n_head * head_dim;
    // Row r of the GGUF matrix holds the value 1000 r + c.
    let data: Vec<f32> = (0..rows * cols)
        .map(|i| (1000 * (i / cols) + i % cols) as f32)
        .collect();
    let gguf = Tensor::from_vec(data, (rows, cols), &Device::Cpu).expect("tensor op");
    let hf = unpermute_qk_rows(&gguf, n_head, head_dim)
        .expect("tensor op")
        .to_vec2::<f32>()
        .expect("tensor op");
    for r in 0..rows {
        let h = hf_row_of_gguf_row(r, head_dim);
        for (c, &v) in hf[h].iter().enumerate() {
            assert_eq!(
                v,
                (1000 * r + c) as f32,
                "HF row {h} should be GGUF row {r}"
            );
        }
    }
    // Spot check by hand: head 0 of 8 rows, GGUF rows 0..8 are HF rows 0,4,1,5,2,6,3,7.
    let order: Vec<usize> = (0..8).map(|r| hf_row_of_gguf_row(r, 8)).collect();
    assert_eq!(order, [0, 4, 1, 5, 2, 6, 3, 7]);

    // A bias vector is permuted the same way.
    let bias = Tensor::from_vec(
        (0..rows as u32).map(|r| r as f32).collect::<Vec<_>>(),
        rows,
        &Device::Cpu,
    )
    .expect("tensor op");
    let hf_bias = unpermute_qk_rows(&bias, n_head, head_dim)
        .expect("tensor op")
        .to_vec1::<f32>()
        .expect("tensor op");
    for r in 0..rows {
        assert_eq!(hf_bias[hf_row_of_gguf_row(r, head_dim)], r as f32);
    }
}

#[test]
fn unpermute_rejects_a_shape_that_is_not_whole_heads() {
    let w = values(&[10, 4], 1);
    assert!(unpermute_qk_rows(&w, 2, 4).is_err());
    assert!(unpermute_qk_rows(&w, 2, 5).is_err(), "odd head size");
}

#[test]
fn plan_lists_every_tensor_with_its_shape() {
    let config = crate::loader::test_util::tiny_config(Default::default());
    let p = plan(&config, Layout::Hf);
    // embed + final norm + 2 layers x 9, tied: no lm_head.
    assert_eq!(p.len(), 2 + 2 * 9);
    let shape = |n: &str| p.iter().find(|(name, _)| name == n).map(|(_, s)| s.clone());
    assert_eq!(
        shape("model.layers.1.self_attn.k_proj.weight"),
        Some(vec![16, 32])
    );
    assert_eq!(
        shape("model.layers.0.self_attn.o_proj.weight"),
        Some(vec![32, 32])
    );
    assert_eq!(
        shape("model.layers.0.mlp.down_proj.weight"),
        Some(vec![32, 64])
    );
    assert_eq!(shape("lm_head.weight"), None);
    let g = plan(&config, Layout::Gguf);
    assert!(g
        .iter()
        .any(|(n, s)| n == "blk.1.ffn_gate.weight" && s == &vec![64, 32]));
}

#[test]
fn random_weights_have_the_shape_and_repeat_by_seed() {
    let cfg = ModelConfig::from_hf_config(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama/config.json"),
    )
    .expect("config");
    let a = Weights::random(&cfg, 5).expect("weights");
    let b = Weights::random(&cfg, 5).expect("weights");
    let c = Weights::random(&cfg, 6).expect("weights");
    assert_eq!(a.layers.len(), cfg.n_layers);
    assert_eq!(a.embed.shape(), (cfg.vocab_size, cfg.hidden_size));
    assert_eq!(
        a.layers[0].attn.gqa().expect("q/k/v").wk.shape(),
        (cfg.kv_dim(), cfg.hidden_size)
    );
    assert_eq!(
        a.layers[0].ffn.dense().expect("dense MLP").down.shape(),
        (cfg.hidden_size, cfg.intermediate_size)
    );
    let row = |w: &Weights| {
        let mut r = vec![0f32; cfg.hidden_size];
        w.layers[1]
            .attn
            .gqa()
            .expect("q/k/v")
            .wq
            .row_into(3, &mut r)
            .expect("row");
        r
    };
    assert_eq!(row(&a), row(&b), "the same seed draws the same weights");
    assert_ne!(row(&a), row(&c), "another seed draws others");
    let bound = 1.0 / (cfg.hidden_size as f32).sqrt();
    assert!(row(&a).iter().all(|v| v.abs() <= bound) && row(&a).iter().any(|v| *v != 0.0));
    // Layers differ from each other too.
    let mut other = vec![0f32; cfg.hidden_size];
    a.layers[2]
        .attn
        .gqa()
        .expect("q/k/v")
        .wq
        .row_into(3, &mut other)
        .expect("row");
    assert_ne!(row(&a), other);
}

/// Random weights of a latent-attention config (benchmarks of DeepSeek
/// shapes) have the shapes its loaded weights have.
#[test]
fn random_latent_weights_have_the_loaded_shapes() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-deepseek_v2");
    let cfg = ModelConfig::from_hf_config(&dir.join("config.json")).expect("config");
    let random = Weights::random(&cfg, 3).expect("random");
    let loaded = Weights::from_hf_dir(&dir, &cfg).expect("loaded");
    for (r, l) in random.layers.iter().zip(&loaded.layers) {
        let shapes = |w: &LayerWeights| {
            let m: Vec<_> = w.matrices().iter().map(|m| m.shape()).collect();
            let v: Vec<_> = w.vectors().map(Vec::len).collect();
            (m, v)
        };
        assert_eq!(shapes(r), shapes(l));
        assert!(matches!(r.attn, AttnWeights::Latent(_)));
    }
}
