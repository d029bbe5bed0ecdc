//! I1 and I2 through the whole model: a decode batch in which one sequence's
//! page table is forged (a stale generation, a foreign page, a page whose
//! slots were never written) fails that sequence with a typed error, counts
//! exactly one violation, and leaves the other sequences' logits identical
//! to a clean run. (`model/tests/cuda.rs` runs the same on a CUDA device.)

mod common;

use common::forged_run;
use kvmesh_cuda::DeviceSpec;
use kvmesh_kernels::GuardViolation;

#[test]
fn stale_generation_fails_only_its_sequence() {
    forged_run(
        DeviceSpec::Cpu,
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0].generation += 2;
            t
        },
        |v| matches!(v, GuardViolation::StaleGeneration { .. }),
    );
}

#[test]
fn foreign_page_fails_only_its_sequence() {
    forged_run(
        DeviceSpec::Cpu,
        |seqs| {
            let mut t = seqs[0].kv().table().to_vec();
            t[0] = seqs[1].kv().table()[0];
            t
        },
        |v| matches!(v, GuardViolation::ForeignPage { .. }),
    );
}

#[test]
fn unwritten_page_fails_only_its_sequence() {
    forged_run(
        DeviceSpec::Cpu,
        |seqs| {
            // The sequence's own last page: owned, right generation, but no
            // slot of it was written yet.
            let mut t = seqs[0].kv().table().to_vec();
            let last = *t.last().expect("pages");
            t[0] = last;
            t
        },
        |v| matches!(v, GuardViolation::Unwritten { .. }),
    );
}
