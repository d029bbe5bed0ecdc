//! Every kernel on the device against the CPU runtime (the oracle), on
//! fresh random inputs each run (the seed is printed; `KVMESH_TEST_SEED`
//! repeats one), with every output buffer poisoned with NaN first so an
//! element a kernel failed to write shows as a mismatch. And the page
//! checks: forged tables, stale generations and unwritten slots are caught
//! on the device and decoded into the errors the CPU pool raises.
//!
//! Needs a CUDA device, so every test is `#[ignore]`d: `cargo test`
//! reports them as ignored, never as passed. `scripts/gpu/run.sh` runs them
//! (`--include-ignored`) with `KVMESH_REQUIRE_CUDA=1`; run that way on a
//! machine without a device, each prints "not run: no CUDA device" and
//! fails.

//!
//! `kernels`: each kernel alone; `pool`: the device KV pool, the checked
//! KV write and attention, and the page checks.

use std::sync::Arc;

use kvmesh_cuda::gpu::Gpu;
use kvmesh_cuda::{CudaError, DeviceSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod kernels;
mod pool;

fn gpu() -> Option<Arc<Gpu>> {
    let required = std::env::var("KVMESH_REQUIRE_CUDA").as_deref() == Ok("1");
    match Gpu::open(DeviceSpec::Cuda(0)) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NoDriver { .. } | CudaError::NoDevice { .. })) => {
            assert!(!required, "KVMESH_REQUIRE_CUDA=1: {e}");
            eprintln!("not run: no CUDA device ({e})");
            None
        }
        // A device is there and something else failed: that is a failure.
        Err(e) => panic!("opening cuda:0: {e}"),
    }
}

fn rng() -> StdRng {
    let seed = std::env::var("KVMESH_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("seed {seed} (KVMESH_TEST_SEED={seed} repeats it)");
    StdRng::seed_from_u64(seed)
}

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A device buffer of `n` NaNs: whatever a kernel does not write stays NaN.
fn poisoned(gpu: &Gpu, n: usize) -> cudarc::driver::CudaSlice<f32> {
    gpu.upload(&vec![f32::NAN; n]).expect("upload")
}

/// `max |got - want| / max(max |want|, 1e-6)`; NaN anywhere is infinite.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let mut worst = 0f32;
    for (g, w) in got.iter().zip(want) {
        let d = (g - w).abs();
        if d.is_nan() {
            return f32::INFINITY;
        }
        worst = worst.max(d);
    }
    worst / scale
}

fn close(what: &str, got: &[f32], want: &[f32], bound: f32) {
    let e = rel_err(got, want);
    println!("{what:<40} rel err {e:.2e} (bound {bound:.0e})");
    assert!(e <= bound, "{what}: relative error {e} above {bound}");
}
