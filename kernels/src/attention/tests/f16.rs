//! An f16 KV pool: the bits of an f32 pool holding the same (rounded)
//! values, on every build's head sizes; and the f32-to-f16 conversion's
//! rounding and saturation.

use super::*;

#[test]
fn an_f16_pool_gives_the_bits_of_an_f32_pool_holding_its_values() {
    // Head sizes for every build: the tiled one (multiples of 32) and the
    // eight-lane one; prefill and decode shapes; windows.
    for (nh, nkv, d, ps, ctx, window) in [
        (9, 3, 64, 16, 70usize, None),
        (9, 3, 64, 16, 83, Some(21)),
        (4, 1, 128, 16, 50, None),
        (6, 2, 32, 8, 41, Some(40)),
        (4, 2, 16, 4, 13, None),
        (8, 8, 8, 1, 5, None),
    ] {
        let (shape, table, store, _, _) = setup((nh, nkv, d, ps, ctx, window), 5, 8);
        let (f16, f32) = store.into_f16_pair();
        for positions in [
            (0..ctx).collect::<Vec<_>>(),
            vec![ctx - 1],
            (ctx / 2..ctx).collect(),
        ] {
            let q = noise(9, positions.len() * nh * d);
            let run = |pages: &VecPages| {
                let mut out = vec![0.0; q.len()];
                paged_attention(pages, &table, 0, &shape, &q, &positions, &mut out)
                    .expect("valid read");
                out
            };
            let (a, b) = (run(&f16), run(&f32));
            assert!(
                same_bits(&a, &b),
                "f16 and f32 pools differ ({nh}/{nkv}/{d}, page {ps}, ctx {ctx}, {} queries)",
                positions.len()
            );
            assert!(a.iter().all(|x| x.is_finite()));
        }
    }
}

#[test]
fn f16_conversion_rounds_to_nearest_and_saturates() {
    use crate::f16_from_f32;
    assert_eq!(f16_from_f32(1.0).to_f32(), 1.0);
    // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): to even.
    assert_eq!(f16_from_f32(1.0 + 2f32.powi(-11)).to_f32(), 1.0);
    assert_eq!(
        f16_from_f32(1.0 + 3.0 * 2f32.powi(-11)).to_f32(),
        1.0 + 2.0 * 2f32.powi(-10)
    );
    assert_eq!(f16_from_f32(1.0e6).to_f32(), 65504.0);
    assert_eq!(f16_from_f32(-1.0e6).to_f32(), -65504.0);
    assert_eq!(f16_from_f32(f32::INFINITY).to_f32(), 65504.0);
    assert!(f16_from_f32(f32::NAN).is_nan());
    let src = noise(3, 37);
    let mut dst = vec![half::f16::ZERO; 37];
    crate::f32_to_f16_slice(&src, &mut dst);
    for (s, d) in src.iter().zip(&dst) {
        assert!((s - d.to_f32()).abs() <= s.abs() * 2f32.powi(-11));
    }
}
