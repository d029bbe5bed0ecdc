//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

pub mod golden;

use std::path::PathBuf;

use kvmesh_model::default_model;
use kvmesh_model::weights::Matrix;

/// The largest difference of two matrices (dequantized), relative to `b`'s
/// largest value.
pub fn max_rel_diff(a: &Matrix, b: &Matrix) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let values = |m: &Matrix| {
        m.to_dense()
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("dense values")
    };
    let (a, b) = (values(a), values(b));
    let scale = b
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

/// The committed tiny random-weight Llama model directory.
pub fn tiny_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama")
}

/// The committed tiny random-weight model of a family
/// (`scripts/golden/make_families.py`): `tiny-qwen3` and so on.
pub fn tiny_family_dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/tiny-{family}"))
}

/// A committed tiny family model written as GGUF
/// (`scripts/golden/make_family_ggufs.py`): `tiny-qwen3-Q8_0.gguf`.
pub fn tiny_family_gguf(family: &str, ty: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/data/gguf/tiny-{family}-{ty}.gguf"))
}

/// A committed golden file.
pub fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/golden")
        .join(name)
}

/// The default model if it is in the cache; tests on it are skipped (with a
/// note on stderr) when it is not. `.ci/run` fetches it first.
pub fn smollm2() -> Option<PathBuf> {
    let found = default_model::cached_default_model();
    if found.is_none() {
        eprintln!(
            "note: {} not in {}; SmolLM2 tests skipped (run `kvmesh fetch-model`)",
            default_model::DEFAULT_MODEL_FILE,
            default_model::cache_dir().display()
        );
    }
    found
}

/// A model shipped in Python packages (`default_model::SHIPPED`) if it is
/// in the cache; tests on it are skipped (with a note on stderr) when it is
/// not. `.ci/run` fetches every one first (`kvmesh fetch-model --all`).
pub fn shipped(name: &str) -> Option<PathBuf> {
    let model = default_model::ShippedModel::named(name)?;
    let found = model.cached();
    if found.is_none() {
        eprintln!(
            "note: {} not in {}; its tests skipped (run `kvmesh fetch-model --all`)",
            model.file,
            default_model::cache_dir().display()
        );
    }
    found
}

/// An engine config on CUDA device 0, if one can be opened; `None` (with
/// "not run: no CUDA device" on stderr) on a machine without the driver or
/// a device, unless `KVMESH_REQUIRE_CUDA=1` (the GPU script), where that
/// fails the test. Any other failure to open the device fails it too.
pub fn cuda_or_skip() -> Option<kvmesh_cuda::DeviceSpec> {
    use kvmesh_cuda::{gpu::Gpu, CudaError, DeviceSpec};
    match Gpu::open(DeviceSpec::Cuda(0)) {
        Ok(_) => Some(DeviceSpec::Cuda(0)),
        Err(e @ (CudaError::NoDriver { .. } | CudaError::NoDevice { .. })) => {
            assert!(
                std::env::var("KVMESH_REQUIRE_CUDA").as_deref() != Ok("1"),
                "KVMESH_REQUIRE_CUDA=1: {e}"
            );
            eprintln!("not run: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("opening cuda:0: {e}"),
    }
}

/// The prompts of the forged-table batches (each spans two pages).
pub const GUARD_PROMPTS: [&str; 3] = [
    "The quick brown fox jumps over the lazy dog again and again",
    "Numbers 1 2 3 and letters a b c",
    "A third prompt that shares the batch",
];

/// The tiny model with a 1024-token pool on `device`.
pub fn tiny_engine(device: kvmesh_cuda::DeviceSpec) -> kvmesh_model::engine::Engine {
    kvmesh_model::engine::Engine::load(
        &tiny_model_dir(),
        &kvmesh_model::engine::EngineConfig {
            kv_pool_tokens: Some(1024),
            device,
            ..kvmesh_model::engine::EngineConfig::default()
        },
    )
    .expect("load tiny model")
}

/// A decode batch of [`GUARD_PROMPTS`] on `device` with sequence 0's table
/// forged by `forge`: only sequence 0 fails, with the violation `expect`
/// accepts, exactly one violation is counted, the other sequences' logits
/// equal a clean run's, and no page leaks.
pub fn forged_run(
    device: kvmesh_cuda::DeviceSpec,
    forge: impl Fn(&[kvmesh_model::engine::Sequence]) -> Vec<kvmesh_kernels::PageRef>,
    expect: impl Fn(&kvmesh_kernels::GuardViolation) -> bool,
) {
    use kvmesh_model::engine::{Engine, Sequence};
    use kvmesh_model::sampling::argmax;
    use kvmesh_model::ModelError;
    let engine = tiny_engine(device);
    let start = |engine: &Engine| -> (Vec<Sequence>, Vec<u32>) {
        let mut seqs = Vec::new();
        let mut next = Vec::new();
        for p in GUARD_PROMPTS {
            let ids = engine.tokenizer().encode(p).expect("encode");
            assert!(ids.len() > 16, "prompt {p:?} must span two pages");
            let mut s = engine.admit(ids, 40).expect("admit");
            next.push(argmax(&engine.prefill(&mut s).expect("prefill")));
            seqs.push(s);
        }
        (seqs, next)
    };
    let step = |engine: &Engine, seqs: &mut [Sequence], next: &[u32]| {
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        engine.decode_step(&mut refs, next).expect("batch runs")
    };
    let clean: Vec<Vec<f32>> = {
        let (mut seqs, next) = start(&engine);
        step(&engine, &mut seqs, &next)
            .into_iter()
            .map(|r| r.expect("clean step"))
            .collect()
    };
    assert_eq!(engine.pool().free_pages(), engine.pool().capacity_pages());

    let (mut seqs, next) = start(&engine);
    let forged = forge(&seqs);
    seqs[0].kv_mut().forge_table(forged);
    let before = engine.pool().guard_violations();
    let results = step(&engine, &mut seqs, &next);
    assert_eq!(
        engine.pool().guard_violations(),
        before + 1,
        "exactly one violation is counted"
    );
    match &results[0] {
        Err(ModelError::Guard(v)) => {
            println!("forged table on {device}: {v}");
            assert!(expect(v), "unexpected violation {v:?}");
        }
        other => panic!("the forged sequence must fail with a guard violation, got {other:?}"),
    }
    for i in 1..GUARD_PROMPTS.len() {
        let got = results[i]
            .as_ref()
            .expect("the other sequences are unaffected");
        let diff = got
            .iter()
            .zip(&clean[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff <= 1e-5,
            "sequence {i} changed by {diff} next to a forged one"
        );
    }
    drop(seqs);
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}
