//! A pool of f16 values: what is stored (rounded, saturated), that the
//! checks and the poison canary work the same, and that the landed view
//! (what verification hashes) is the stored values.

use kvmesh_kernels::{f16_from_f32, GuardViolation, KvDtype, KvValues, PagedKv};

use super::{attend_at, cfg, tokens, KV_DIM};
use crate::{KvPool, PoolConfig, POISON_BITS_F16};

fn pool(poison: bool) -> KvPool {
    KvPool::new(PoolConfig {
        poison,
        ..cfg(3).with_dtype(KvDtype::F16)
    })
    .expect("pool")
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| f16_from_f32(x).to_f32()).collect()
}

#[test]
fn an_f16_pool_stores_half_the_bytes_and_reads_back_rounded_values() {
    let f32_pool = KvPool::new(cfg(3)).expect("pool");
    let p = pool(false);
    assert_eq!(p.config().bytes() * 2, f32_pool.config().bytes());
    // Values that f16 cannot hold exactly, and one beyond its range.
    let mut k = tokens(1, 4);
    k[0] = 1.0e-3 + 1.0e-7;
    k[1] = 1.0e6;
    let v: Vec<f32> = tokens(2, 4).iter().map(|x| x * 1.0001).collect();
    let mut r = p.reserve(4).expect("reserve");
    r.write(1, 0, &k, &v).expect("write");
    let reader = r.reader();
    let s = reader.read_page(r.table()[0], 1, 4).expect("written");
    assert!(matches!(s.k, KvValues::F16(_)));
    assert_eq!(s.k.to_f32(), rounded(&k));
    assert_eq!(s.v.to_f32(), rounded(&v));
    assert_eq!(s.k.to_f32()[1], 65504.0, "saturated, not infinite");
    // The watermark check is the same: layer 0 was never written.
    assert!(matches!(
        reader.read_page(r.table()[0], 0, 1),
        Err(GuardViolation::Unwritten { .. })
    ));
}

#[test]
fn attention_over_an_f16_pool_equals_an_f32_pool_holding_the_rounded_values() {
    let (p16, p32) = (pool(false), KvPool::new(cfg(3)).expect("pool"));
    let (k, v) = (tokens(3, 6), tokens(4, 6));
    let (k32, v32) = (rounded(&k), rounded(&v));
    let mut r16 = p16.reserve(6).expect("reserve");
    let mut r32 = p32.reserve(6).expect("reserve");
    for layer in 0..2 {
        r16.write(layer, 0, &k, &v).expect("write");
        r32.write(layer, 0, &k32, &v32).expect("write");
    }
    for pos in 0..6 {
        let a = attend_at(&r16, r16.table(), 1, pos).expect("f16");
        let b = attend_at(&r32, r32.table(), 1, pos).expect("f32");
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "position {pos}"
        );
    }
}

#[test]
fn the_f16_canary_is_caught_on_read() {
    let p = pool(true);
    let page = {
        let r = p.reserve(4).expect("reserve");
        r.table()[0].page as usize
    };
    // Released (never written): every value holds the 16-bit canary.
    let copy = p.shared().page_copy(page);
    assert!(copy.iter().all(|x| x.is_nan()));
    // A reservation that writes two slots and then claims four past the
    // watermark is refused by I2 before the scan; force the scan by
    // publishing the watermark over unwritten slots (the bug poison mode
    // exists to catch).
    let mut r = p.reserve(4).expect("reserve");
    r.write(0, 0, &tokens(5, 2), &tokens(6, 2)).expect("write");
    r.publish_prompt(4, None);
    let err = r
        .reader()
        .read_page(r.table()[0], 0, 4)
        .expect_err("slots 2 and 3 hold the canary");
    assert_eq!(err.kind(), "poisoned");
    assert_eq!(
        f16_from_f32(f32::NAN).to_bits() & 0x0200,
        0x0200,
        "conversions give quiet NaNs"
    );
    assert_eq!(POISON_BITS_F16 & 0x0200, 0, "the canary is signalling");
}

#[test]
fn the_landed_view_is_the_stored_f16_values() {
    // What verification hashes (`kvmesh_kvwire::page_checksum` in
    // kvxfer's landing): per layer, K then V of the landed slots, as stored.
    let p = pool(false);
    let mut r = p.reserve(3).expect("reserve");
    for layer in 0..2 {
        r.write(
            layer,
            0,
            &tokens(7 + layer as u32, 3),
            &tokens(8 + layer as u32, 3),
        )
        .expect("write");
    }
    let page = r.table()[0].page as usize;
    let stored = p.shared().page_copy(page);
    let block = 4 * KV_DIM;
    let mut seen = Vec::new();
    r.visit_landed(0, 3, |k, v| {
        assert!(matches!(k, KvValues::F16(_)) && matches!(v, KvValues::F16(_)));
        seen.push((k.to_f32(), v.to_f32()));
    })
    .expect("in range");
    assert_eq!(seen.len(), 2, "one visit per layer");
    for (layer, (k, v)) in seen.iter().enumerate() {
        let at = layer * 2 * block;
        assert_eq!(k, &stored[at..at + 3 * KV_DIM]);
        assert_eq!(v, &stored[at + block..at + block + 3 * KV_DIM]);
        assert_eq!(k, &rounded(&tokens(7 + layer as u32, 3)));
    }
    assert!(r.visit_landed(0, 5, |_, _| ()).is_none(), "past the page");
    assert!(r.visit_landed(1, 1, |_, _| ()).is_none(), "past the table");
}
