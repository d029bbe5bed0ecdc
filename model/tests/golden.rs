//! The engine against Hugging Face transformers on the same weights.
//!
//! Golden files come from `scripts/golden/make_golden.py` (transformers,
//! float32, eager attention). For each model:
//! - tokenization and chat-template rendering must match exactly;
//! - free-running greedy decoding must produce the reference tokens up to
//!   the first step whose reference top-2 logit gap is below
//!   `gap_tie` (below that, summation-order noise may legitimately flip
//!   the argmax);
//! - teacher-forced on the reference tokens, every step's top logits must be
//!   within the f32 classes' tolerance ([`F32`]) of the reference;
//! - all of that again with the prefix cache on, pages of 4 tokens, every
//!   prompt sent twice: the second time its full pages come from the cache
//!   (issue 16: greedy output with the cache equals output without it).
//!
//! Why that tolerance: both sides compute in f32 but in different summation
//! orders (candle's gemm vs PyTorch's, our attention vs eager), so each
//! layer adds relative noise of a few f32 ulps times sqrt(reduction length);
//! through 30 layers and a 576-wide vocabulary projection that grows to about
//! 1e-4 relative. A stale or foreign KV page, or a wrong RoPE, moves logits by
//! whole units, five orders of magnitude more.

mod common;

use std::path::Path;

use common::golden::{check_tokenizer, read_golden, Golden, F32};
use kvmesh_kernels::cpu::{self, Activations};
use kvmesh_kvpool::Namespace;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::engine::{Engine, EngineConfig};
use kvmesh_prefix::CacheKeys;

/// [`common::golden::check_greedy`] in the f32 class (its tolerance is
/// that module's [`F32`]).
fn check_greedy(engine: &Engine, g: &Golden, ns: Option<Namespace>) -> f32 {
    common::golden::check_greedy(engine, g, ns, &F32)
}

/// This binary compares at the f32 class's tolerance, so every engine it
/// builds runs in that class (selected before any kernel runs; the
/// default is int8, which `golden_int8.rs` compares at its own).
fn f32_class() {
    assert_eq!(
        cpu::select_activations(Activations::F32),
        Ok(Activations::F32)
    );
}

fn quantized_engine_for(path: &Path) -> Engine {
    f32_class();
    common::golden::quantized_engine_for(path)
}

fn engine_for(path: &Path) -> Engine {
    f32_class();
    Engine::load(
        path,
        &EngineConfig {
            kv_pool_tokens: Some(4096),
            ..EngineConfig::default()
        },
    )
    .expect("load model")
}

#[test]
fn tiny_llama_matches_transformers() {
    let engine = engine_for(&common::tiny_model_dir());
    let g = read_golden("tiny-llama.json");
    check_tokenizer(&engine, &g);
    let worst = check_greedy(&engine, &g, None);
    eprintln!("tiny-llama: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// A family's tiny model (`scripts/golden/make_families.py`: each config
/// exercises what its family changes, windows shorter than the long
/// prompt) against transformers, as [`tiny_llama_matches_transformers`].
/// `name` is the family, or the family and a variant (`llama-yarn`).
fn check_family(name: &str) {
    let engine = engine_for(&common::tiny_family_dir(name));
    let family = name.split_once('-').map_or(name, |(family, _)| family);
    assert_eq!(engine.model().config().family, family);
    let g = read_golden(&format!("tiny-{name}.json"));
    check_tokenizer(&engine, &g);
    let worst = check_greedy(&engine, &g, None);
    eprintln!("tiny-{name}: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// The tiny mixture-of-experts families (each also written as GGUFs of
/// F32, Q8_0 and Q4_0 or MXFP4).
const MIXTURES: [&str; 7] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
];

/// The same tiny models written as GGUF by the `gguf` package in f32
/// (`scripts/golden/make_family_ggufs.py`: llama.cpp's names and metadata,
/// q/k permuted for the `llama` architecture, Gemma's norms as `1 + w`,
/// Gemma 2's caps and YaRN's keys as llama.cpp's converter writes them,
/// Phi-3's tensors fused, the vocabulary as GGUF BPE): the same tokens,
/// chat templates, greedy tokens and logits as the safetensors against
/// transformers, and the same configuration as read from `config.json`
/// (but for the architecture's name and the defaults GGUF cannot say).
#[test]
fn tiny_families_from_gguf_match_transformers() {
    let dense = [
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
        "mistral",
        "llama-yarn",
    ];
    for family in dense.into_iter().chain(MIXTURES) {
        let engine = engine_for(&common::tiny_family_gguf(family, "F32"));
        let from_gguf = engine.model().config();
        let hf = kvmesh_model::config::ModelConfig::from_hf_config(
            &common::tiny_family_dir(family).join("config.json"),
        )
        .expect("config.json");
        assert_eq!(from_gguf.block, hf.block, "{family}: switches");
        assert_eq!(from_gguf.moe, hf.moe, "{family}: experts");
        assert_eq!(from_gguf.mla, hf.mla, "{family}: latent attention");
        assert_eq!(from_gguf.rotary_dim, hf.rotary_dim, "{family}: rotary dims");
        assert_eq!(from_gguf.n_layers, hf.n_layers, "{family}: layers");
        assert_eq!(
            (
                from_gguf.rope_theta,
                from_gguf.rope_scaling,
                from_gguf.local_rope_theta
            ),
            (hf.rope_theta, hf.rope_scaling, hf.local_rope_theta),
            "{family}: rope"
        );
        assert_eq!(
            (&from_gguf.layer_types, from_gguf.sliding_window),
            (&hf.layer_types, hf.sliding_window),
            "{family}: windows"
        );
        let g = read_golden(&format!("tiny-{family}.json"));
        check_tokenizer(&engine, &g);
        let worst = check_greedy(&engine, &g, None);
        eprintln!("tiny-{family} from GGUF: worst logit error = {worst:.3} of tolerance");
    }
}

#[test]
fn tiny_mixtral_matches_transformers() {
    check_family("mixtral");
}

#[test]
fn tiny_qwen2_moe_matches_transformers() {
    check_family("qwen2_moe");
}

#[test]
fn tiny_qwen3_moe_matches_transformers() {
    check_family("qwen3_moe");
}

#[test]
fn tiny_glm4_moe_matches_transformers() {
    check_family("glm4_moe");
}

/// DeepSeek V2: latent attention (a low-rank query, the latent cached,
/// the key and value maps absorbed into the query and the output), YaRN
/// with its softmax-scale correction, softmax routing within groups
/// scored by their best expert, two shared experts, a leading dense layer.
#[test]
fn tiny_deepseek_v2_matches_transformers() {
    check_family("deepseek_v2");
}

/// DeepSeek V3: latent attention with a full-rank query, interleaved rope
/// pairs, sigmoid routing with a correction bias within groups scored by
/// their two best experts.
#[test]
fn tiny_deepseek_v3_matches_transformers() {
    check_family("deepseek_v3");
}

/// gpt-oss: sinks, q/k/v/o biases, alternating windows, unrounded YaRN,
/// biased router and experts, the clamped SwiGLU (a limit that clamps).
#[test]
fn tiny_gpt_oss_matches_transformers() {
    check_family("gpt_oss");
}

/// The tiny mixtures written in Q8_0 and Q4_0 (gpt-oss: Q8_0 and MXFP4),
/// run in the quantized mode (experts kept in their blocks), against
/// transformers on the same file's dequantized weights (`tiny-<family>-<type>.json`): a quantized
/// router or expert moves the routing itself, so the f32 model's golden
/// data cannot stand in. Experts must stay quantized.
#[test]
fn tiny_mixtures_quantized_match_transformers_on_their_weights() {
    for family in MIXTURES {
        // gpt-oss: Q8_0, and MXFP4 experts with the other matrices in
        // BF16 (as its MXFP4 release converts), unfused and with gate and
        // up fused into one stack (the same weights, the same golden data).
        let types: &[&str] = if family == "gpt_oss" {
            &["Q8_0", "MXFP4", "MXFP4-fused"]
        } else {
            &["Q8_0", "Q4_0"]
        };
        for &ty in types {
            let engine = quantized_engine_for(&common::tiny_family_gguf(family, ty));
            assert!(engine.model().config().moe.is_some(), "{family} {ty}");
            let golden = ty.trim_end_matches("-fused");
            let g = read_golden(&format!("tiny-{family}-{golden}.json"));
            check_tokenizer(&engine, &g);
            let worst = check_greedy(&engine, &g, None);
            eprintln!("tiny-{family} {ty} quantized: worst logit error = {worst:.3} of tolerance");
            assert_eq!(
                engine.pool().free_pages(),
                engine.pool().capacity_pages(),
                "pages leaked"
            );
        }
    }
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check_family("qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check_family("qwen3");
}

#[test]
fn tiny_gemma3_matches_transformers() {
    check_family("gemma3");
}

#[test]
fn tiny_gemma2_matches_transformers() {
    check_family("gemma2");
}

/// YaRN's frequencies and its scaling of cos and sin, over a prompt that
/// runs past the original context (64 positions) to 144.
#[test]
fn tiny_llama_yarn_matches_transformers() {
    check_family("llama-yarn");
}

#[test]
fn tiny_phi3_matches_transformers() {
    check_family("phi3");
}

#[test]
fn tiny_mistral_matches_transformers() {
    check_family("mistral");
}

#[test]
fn smollm2_matches_transformers() {
    let Some(path) = common::smollm2() else {
        return;
    };
    let engine = engine_for(&path);
    let g = read_golden("smollm2-135m-instruct-q4_1.json");
    check_tokenizer(&engine, &g);
    let worst = check_greedy(&engine, &g, None);
    eprintln!("smollm2: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// The real Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors,
/// a SentencePiece vocabulary of 262,144 tokens), dequantized to f32 at
/// load (the exact mode), against transformers' own GGUF loader on the
/// same file: tokenization and greedy tokens and logits.
#[test]
fn gemma3_270m_gguf_matches_transformers() {
    let Some(path) = common::shipped("gemma3-270m") else {
        return;
    };
    let engine = engine_for(&path);
    assert_eq!(engine.model().config().family, "gemma3");
    // What `/v1/models` and the router's log show, read without weights.
    assert_eq!(
        kvmesh_tokenizer::info::describe(&path).expect("describe"),
        ("gemma3".to_owned(), "Q5_0, Q4_K, Q8_0, Q6_K".to_owned())
    );
    let g = read_golden("gemma-3-270m-q4_k_m.json");
    check_tokenizer(&engine, &g);
    let worst = check_greedy(&engine, &g, None);
    eprintln!("gemma3-270m: worst logit error = {worst:.3} of tolerance");
}

/// The same file in the quantized mode: every matrix stays in its GGUF
/// blocks (Q4_K, Q5_0, Q6_K, Q8_0), dequantized in registers to the same
/// f32 values gguf-py gets (the kernels' ground truth), f32 activations and
/// an f32 KV pool: the same tokens and logits as transformers within the
/// golden tolerance, and at most the blocks' bytes in memory.
#[test]
fn gemma3_270m_gguf_quantized_matches_transformers() {
    let Some(path) = common::shipped("gemma3-270m") else {
        return;
    };
    let engine = quantized_engine_for(&path);
    let g = read_golden("gemma-3-270m-q4_k_m.json");
    let worst = check_greedy(&engine, &g, None);
    eprintln!("gemma3-270m quantized: worst logit error = {worst:.3} of tolerance");
}

/// The real Qwen2.5-Coder 0.5B Instruct GGUF (Q4_K_M: Q5_0, Q8_0, Q4_K and
/// Q6_K tensors; QKV biases; a byte-level BPE vocabulary with the `qwen2`
/// pre-tokenizer; a chat template), dequantized to f32 at load (the exact
/// mode), against transformers' own GGUF loader on the same file:
/// tokenization, the chat template, and greedy tokens and logits.
#[test]
fn qwen25_coder_gguf_matches_transformers() {
    let Some(path) = common::shipped("qwen2.5-coder-0.5b") else {
        return;
    };
    let engine = engine_for(&path);
    assert_eq!(engine.model().config().family, "qwen2");
    assert_eq!(
        kvmesh_tokenizer::info::describe(&path).expect("describe"),
        ("qwen2".to_owned(), "Q5_0, Q8_0, Q4_K, Q6_K".to_owned())
    );
    let g = read_golden("qwen2.5-coder-0.5b-instruct-q4_k_m.json");
    check_tokenizer(&engine, &g);
    let worst = check_greedy(&engine, &g, None);
    eprintln!("qwen2.5-coder-0.5b: worst logit error = {worst:.3} of tolerance");
}

/// The same file in the quantized mode (every matrix in its GGUF blocks).
#[test]
fn qwen25_coder_gguf_quantized_matches_transformers() {
    let Some(path) = common::shipped("qwen2.5-coder-0.5b") else {
        return;
    };
    let engine = quantized_engine_for(&path);
    let g = read_golden("qwen2.5-coder-0.5b-instruct-q4_k_m.json");
    let worst = check_greedy(&engine, &g, None);
    eprintln!("qwen2.5-coder-0.5b quantized: worst logit error = {worst:.3} of tolerance");
}

/// [`engine_for`] on CUDA device 0 (f32 weights through cuBLAS SGEMM,
/// the checked device attention), held to the same reference and the same
/// tolerances as the CPU runtime.
fn cuda_engine_for(path: &Path) -> Option<Engine> {
    f32_class();
    let device = common::cuda_or_skip()?;
    Some(
        Engine::load(
            path,
            &EngineConfig {
                kv_pool_tokens: Some(4096),
                device,
                ..EngineConfig::default()
            },
        )
        .expect("load model on cuda:0"),
    )
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn tiny_llama_on_cuda_matches_transformers() {
    let Some(engine) = cuda_engine_for(&common::tiny_model_dir()) else {
        return;
    };
    let g = read_golden("tiny-llama.json");
    let worst = check_greedy(&engine, &g, None);
    println!("tiny-llama on cuda:0: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// Every tiny family on CUDA device 0: those whose block the CUDA forward
/// implements (Llama's with biases, fused tensors split at load, one window
/// for every layer) match transformers within the CPU runtime's
/// tolerances; the others are refused at load naming the family and what
/// the device lacks, never run to a wrong answer.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn tiny_families_on_cuda_match_transformers_or_are_refused_by_name() {
    let Some(device) = common::cuda_or_skip() else {
        return;
    };
    let runs = ["mistral", "qwen2", "phi3"];
    for family in ["mistral", "qwen2", "phi3", "qwen3", "gemma3", "gpt_oss"] {
        let loaded = Engine::load(
            &common::tiny_family_dir(family),
            &EngineConfig {
                kv_pool_tokens: Some(4096),
                device,
                ..EngineConfig::default()
            },
        );
        match loaded {
            Ok(engine) => {
                assert!(runs.contains(&family), "{family}: loaded on cuda:0");
                let g = read_golden(&format!("tiny-{family}.json"));
                let worst = check_greedy(&engine, &g, None);
                println!("tiny-{family} on cuda:0: worst logit error = {worst:.3} of tolerance");
            }
            Err(kvmesh_model::ModelError::Device(kvmesh_cuda::CudaError::Unsupported(why))) => {
                assert!(!runs.contains(&family), "{family}: refused: {why}");
                assert!(
                    why.contains(family) && why.contains("use --device cpu"),
                    "{family}: {why}"
                );
                println!("tiny-{family} on cuda:0: refused at load: {why}");
            }
            Err(e) => panic!("{family} on cuda:0: {e}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn smollm2_on_cuda_matches_transformers() {
    let Some(path) = common::smollm2() else {
        assert!(
            std::env::var("KVMESH_REQUIRE_MODEL").as_deref() != Ok("1"),
            "KVMESH_REQUIRE_MODEL=1 and the default model is not in the cache"
        );
        return;
    };
    let Some(engine) = cuda_engine_for(&path) else {
        return;
    };
    let g = read_golden("smollm2-135m-instruct-q4_1.json");
    let worst = check_greedy(&engine, &g, None);
    println!("smollm2 on cuda:0: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// The engine of [`engine_for`] with its prefix cache on and pages of 4
/// tokens, so that even the golden files' short prompts have full pages to
/// cache.
fn cached_engine_for(path: &Path) -> Engine {
    f32_class();
    Engine::load(
        path,
        &EngineConfig {
            kv_pool_tokens: Some(4096),
            page_size: 4,
            ..EngineConfig::default()
        },
    )
    .expect("load model")
    .with_prefix_cache(
        CacheKeys::new(&MeshSecret::generate().expect("secret")),
        0.5,
    )
}

/// Every greedy case twice with the cache on: cold, then from the cache.
fn check_greedy_from_the_cache(path: &Path, golden: &str) {
    let engine = cached_engine_for(path);
    let g = read_golden(golden);
    let ns = Namespace::from_slice(&[7; 32]).expect("32 bytes");
    let cold = check_greedy(&engine, &g, Some(ns));
    let hits_before = engine.pool().cache_stats().counters.hit_tokens;
    let warm = check_greedy(&engine, &g, Some(ns));
    let hit = engine.pool().cache_stats().counters.hit_tokens - hits_before;
    // Every prompt of 5 tokens or more has a full page before its last
    // token's: the second pass must have found them all.
    let want: usize = g
        .greedy
        .iter()
        .map(|c| (c.prompt_ids.len() - 1) / 4 * 4)
        .sum();
    assert!(want > 0, "{}: no prompt spans a full page", g.model);
    assert!(
        hit as usize >= want,
        "{}: the second pass found {hit} cached tokens, want at least {want}",
        g.model
    );
    eprintln!(
        "{}: worst logit error cold {cold:.3}, from the cache {warm:.3} of tolerance",
        g.model
    );
    engine.pool().clear_cache();
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
    assert_eq!(engine.pool().stats().guard_violations, 0);
}

#[test]
fn tiny_llama_matches_transformers_from_the_prefix_cache() {
    check_greedy_from_the_cache(&common::tiny_model_dir(), "tiny-llama.json");
}

/// Latent entries from the prefix cache: a cached page holds the latent
/// and the rope key, leased to every later prompt that shares it.
#[test]
fn tiny_deepseek_matches_transformers_from_the_prefix_cache() {
    for family in ["deepseek_v2", "deepseek_v3"] {
        check_greedy_from_the_cache(
            &common::tiny_family_dir(family),
            &format!("tiny-{family}.json"),
        );
    }
}

#[test]
fn smollm2_matches_transformers_from_the_prefix_cache() {
    let Some(path) = common::smollm2() else {
        return;
    };
    check_greedy_from_the_cache(&path, "smollm2-135m-instruct-q4_1.json");
}
