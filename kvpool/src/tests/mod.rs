//! Tests that need the pool's internals (page metadata, raw storage, a
//! simulated watermark bug). The forged-page tests, which need only the
//! public API, are in `tests/forged_pages.rs`.

mod cache;
mod f16_pool;
mod observer;
mod poison_scrub;
mod props;
mod props_cache;
mod reservation;

use kvmesh_kernels::{paged_attention, AttentionShape, GuardViolation, PageRef};

use crate::{PoolConfig, Reservation, ScrubMode};

/// Page size 4, 2 layers, kv_dim 2 (one head of 2).
pub(crate) fn cfg(n_pages: usize) -> PoolConfig {
    PoolConfig {
        page_size: 4,
        n_pages,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 2,
        entry: crate::KvEntry::KeyValue,
        dtype: kvmesh_kernels::KvDtype::F32,
        scrub: ScrubMode::Off,
        poison: false,
    }
}

pub(crate) const KV_DIM: usize = 2;

pub(crate) const SHAPE: AttentionShape = AttentionShape {
    n_heads: 2,
    n_kv_heads: 1,
    head_dim: 2,
    v_dim: 2,
    scale: 0.7,
    window: None,
    softcap: None,
    sinks: None,
};

/// `n` tokens of distinct, non-zero, finite values derived from `seed`.
pub(crate) fn tokens(seed: u32, n: usize) -> Vec<f32> {
    (0..n * KV_DIM)
        .map(|i| 1.0 + seed as f32 * 0.001 + i as f32 * 0.25)
        .collect()
}

/// One query at `pos` against `res`'s reader and `table` at `layer`. On
/// failure, asserts that the output buffer is untouched.
pub(crate) fn attend_at(
    res: &Reservation,
    table: &[PageRef],
    layer: usize,
    pos: usize,
) -> Result<Vec<f32>, GuardViolation> {
    let q = vec![0.5; SHAPE.n_heads * SHAPE.head_dim];
    let mut out = vec![-3.0; q.len()];
    let r = paged_attention(&res.reader(), table, layer, &SHAPE, &q, &[pos], &mut out);
    if r.is_err() {
        assert!(out.iter().all(|&x| x == -3.0), "failed call wrote to out");
    }
    r.map(|()| out)
}
