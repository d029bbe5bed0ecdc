//! The engine on a CUDA device against the same engine on the CPU (the
//! oracle), on the committed tiny model: batched prefill and decode give
//! the CPU's logits and greedy tokens; a decode node's adopted prompt
//! (landed in the host pool) reaches the device; forged page tables fail
//! only their own sequence, counted once, as on the CPU; and asking for
//! CUDA where there is none fails at load with the error naming it.
//!
//! The device tests are `#[ignore]`d (reported as ignored, never passed,
//! without a GPU); `scripts/gpu/run.sh` runs them with
//! `KVMESH_REQUIRE_CUDA=1`.

mod common;

use kvmesh_cuda::{CudaError, DeviceSpec};
use kvmesh_kernels::{GuardViolation, PageRef};
use kvmesh_model::engine::{Engine, EngineConfig, Sequence};
use kvmesh_model::sampling::argmax;
use kvmesh_model::ModelError;

use common::{tiny_engine as engine, GUARD_PROMPTS as PROMPTS};

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Admit, prefill as one batch, then `steps` greedy decode steps as one
/// batch: every step's logits of every sequence.
fn run(engine: &Engine, steps: usize) -> Vec<Vec<Vec<f32>>> {
    let mut seqs: Vec<Sequence> = PROMPTS
        .iter()
        .map(|p| {
            let ids = engine.tokenizer().encode(p).expect("encode");
            engine.admit(ids, steps + 1).expect("admit")
        })
        .collect();
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
    let first: Vec<Vec<f32>> = engine
        .prefill_batch(&mut refs)
        .expect("prefill")
        .into_iter()
        .map(|r| r.expect("prefill of each"))
        .collect();
    let mut all = vec![first];
    for _ in 0..steps {
        let next: Vec<u32> = all
            .last()
            .map(|l| l.iter().map(|r| argmax(r)).collect())
            .unwrap_or_default();
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let out = engine
            .decode_step(&mut refs, &next)
            .expect("decode")
            .into_iter()
            .map(|r| r.expect("decode of each"))
            .collect();
        all.push(out);
    }
    all
}

#[test]
fn asking_for_cuda_where_there_is_none_fails_at_load_naming_it() {
    if kvmesh_cuda::toolkit::driver_present() {
        eprintln!("not run: this machine has the NVIDIA driver (the device tests cover it)");
        return;
    }
    let err = Engine::load(
        &common::tiny_model_dir(),
        &EngineConfig {
            device: DeviceSpec::Cuda(0),
            ..EngineConfig::default()
        },
    )
    .expect_err("no driver here");
    match &err {
        ModelError::Device(CudaError::NoDriver { asked }) => assert_eq!(asked, "cuda:0"),
        other => panic!("expected the no-driver error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("libcuda.so.1") && msg.contains("--device cpu"),
        "{msg}"
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn batched_prefill_and_decode_on_cuda_match_the_cpu() {
    let Some(device) = common::cuda_or_skip() else {
        return;
    };
    let cpu = run(&engine(DeviceSpec::Cpu), 12);
    let gpu_engine = engine(device);
    let gpu = run(&gpu_engine, 12);
    let mut worst = 0f32;
    for (step, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        for (i, (c, g)) in c.iter().zip(g).enumerate() {
            let d = max_diff(c, g);
            worst = worst.max(d);
            assert!(d <= 1e-3, "step {step} sequence {i}: logits differ by {d}");
            assert_eq!(
                argmax(c),
                argmax(g),
                "step {step} sequence {i}: greedy token"
            );
        }
    }
    println!("tiny model, 3 sequences x 13 steps: worst |cpu - cuda| logit = {worst:.2e}");
    assert_eq!(
        gpu_engine.pool().free_pages(),
        gpu_engine.pool().capacity_pages(),
        "pages leaked"
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn an_adopted_prompt_reaches_the_device() {
    let Some(device) = common::cuda_or_skip() else {
        return;
    };
    let cpu = engine(DeviceSpec::Cpu);
    let gpu = engine(device);
    let ids = cpu.tokenizer().encode(PROMPTS[0]).expect("encode");
    let n = ids.len();
    // Prefill on the CPU engine; its prompt K/V written into a reservation
    // of the CUDA engine's pool (what landing a verified transfer does).
    let mut seq = cpu.admit(ids.clone(), 4).expect("admit");
    let first = cpu.prefill(&mut seq).expect("prefill");
    let mut kv = gpu.pool().reserve(n + 4).expect("reserve");
    for layer in 0..cpu.model().config().n_layers {
        let (k, v) = cpu.prompt_kv(&seq, layer).expect("prompt kv");
        kv.write(layer, 0, &k, &v).expect("land");
    }
    let mut adopted = gpu.adopt(ids, 4, kv).expect("adopt");
    let token = argmax(&first);
    let want = cpu
        .decode_step(&mut [&mut seq], &[token])
        .expect("cpu step")
        .pop()
        .expect("one")
        .expect("ok");
    let got = gpu
        .decode_step(&mut [&mut adopted], &[token])
        .expect("gpu step")
        .pop()
        .expect("one")
        .expect("ok");
    let d = max_diff(&want, &got);
    println!("adopted prompt, first decode step: |cpu - cuda| = {d:.2e}");
    assert!(d <= 1e-3, "logits differ by {d}");
}

/// [`common::forged_run`] on CUDA device 0.
fn forged_run(
    forge: impl Fn(&[Sequence]) -> Vec<PageRef>,
    expect: impl Fn(&GuardViolation) -> bool,
) {
    let Some(device) = common::cuda_or_skip() else {
        return;
    };
    common::forged_run(device, forge, expect);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn a_stale_generation_fails_only_its_sequence_on_cuda() {
    forged_run(
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0].generation += 2;
            t
        },
        |v| matches!(v, GuardViolation::StaleGeneration { .. }),
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn a_foreign_page_fails_only_its_sequence_on_cuda() {
    forged_run(
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0] = seqs[1].kv().table()[0];
            t
        },
        |v| matches!(v, GuardViolation::ForeignPage { .. }),
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn an_unwritten_page_fails_only_its_sequence_on_cuda() {
    forged_run(
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            let last = *t.last().expect("pages");
            t[0] = last;
            t
        },
        |v| matches!(v, GuardViolation::Unwritten { .. }),
    );
}
