//! The wire side of landing a transfer in a reservation's pages: a frame's
//! payload bytes as values of the pool's dtype, and the checksum of a page
//! as it landed (`kvmesh_kvpool::staging` does the pool side: writes that
//! raise no watermark, the landed view, publication after I4).

use std::ops::Range;

use kvmesh_kernels::{KvDtype, KvValues};
use kvmesh_kvpool::{PoolConfig, PoolError, Reservation};
use kvmesh_kvwire::{f16s_from_le, f32s_from_le, Checksummer, Geometry, WireError};

/// The wire geometry of a pool's pages; an error names a field the wire
/// cannot carry.
pub fn pool_geometry(cfg: &PoolConfig) -> Result<Geometry, WireError> {
    Geometry::new(
        cfg.page_size,
        cfg.n_layers,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.dtype,
        cfg.entry,
    )
}

/// Lands a frame's payload (per layer of `layers`: K of `slots`, then V,
/// little-endian values of the pool's dtype, as in
/// [`kvmesh_kvwire::KvFrame`]) in logical page `index` of `res`, without
/// raising a watermark. All checks come first: on error nothing was
/// written.
///
/// Cost: one copy into the page. The payload sits at an 8-byte-aligned
/// offset of its message, so on a little-endian host it is used in place;
/// otherwise it is converted into `scratch` (f32) or a fresh buffer (f16)
/// first.
pub(crate) fn land_payload(
    res: &mut Reservation,
    index: usize,
    layers: Range<usize>,
    slots: Range<usize>,
    payload: &[u8],
    scratch: &mut Vec<f32>,
) -> Result<(), PoolError> {
    let dtype = res.dtype();
    let bad = || PoolError::BadLength {
        field: "payload",
        expected: payload.len() - payload.len() % dtype.size(),
        got: payload.len(),
    };
    if !payload.len().is_multiple_of(dtype.size()) {
        return Err(bad());
    }
    let f16_copy: Vec<half::f16>;
    let values: KvValues<'_> = match dtype {
        KvDtype::F32 => match bytemuck::try_cast_slice::<u8, f32>(payload) {
            Ok(v) if cfg!(target_endian = "little") => KvValues::F32(v),
            _ => {
                scratch.clear();
                scratch.resize(payload.len() / 4, 0.0);
                f32s_from_le(payload, scratch).map_err(|_| bad())?;
                KvValues::F32(scratch)
            }
        },
        KvDtype::F16 => match bytemuck::try_cast_slice::<u8, half::f16>(payload) {
            Ok(v) if cfg!(target_endian = "little") => KvValues::F16(v),
            _ => {
                let mut v = vec![half::f16::ZERO; payload.len() / 2];
                f16s_from_le(payload, &mut v).map_err(|_| bad())?;
                f16_copy = v;
                KvValues::F16(&f16_copy)
            }
        },
    };
    res.land(index, layers, slots, values)
}

/// The [`kvmesh_kvwire::page_checksum`] of logical page `index` of `res` as
/// it is stored now, over its first `slots` slots. `None` if `index` is
/// past the table or `slots` past the page. The caller makes sure nothing
/// writes the page meanwhile (see [`Reservation::visit_landed`]).
pub(crate) fn landed_checksum(res: &Reservation, index: usize, slots: usize) -> Option<u64> {
    let mut h = Checksummer::new();
    res.visit_landed(index, slots, |k, v| {
        h.update_values(k);
        h.update_values(v);
    })?;
    Some(h.finish())
}

#[cfg(test)]
mod tests {
    use kvmesh_kernels::{f16_from_f32, KvDtype, KvValues};
    use kvmesh_kvpool::{KvPool, PoolConfig, ScrubMode};
    use kvmesh_kvwire::{page_checksum, Dtype, Geometry};

    use super::*;

    fn cfg(dtype: KvDtype) -> PoolConfig {
        PoolConfig {
            page_size: 4,
            n_pages: 3,
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 2,
            entry: kvmesh_kernels::KvEntry::KeyValue,
            dtype,
            scrub: ScrubMode::Off,
            poison: false,
        }
    }

    fn values(seed: u32, n: usize) -> Vec<f32> {
        (0..n * 2)
            .map(|i| 1.0 + seed as f32 * 0.001 + i as f32 * 0.25)
            .collect()
    }

    #[test]
    fn pool_geometry_matches_the_pool() {
        let cfg = PoolConfig::for_tokens(64, 16, 30, 3, 64);
        let g = pool_geometry(&cfg).expect("fits");
        assert_eq!(
            g.page_bytes(),
            Some(cfg.bytes() as u64 / cfg.n_pages as u64)
        );
        assert_eq!(g.kv_geometry(), cfg.geometry());
        let mut wide = cfg.clone();
        wide.n_layers = 70_000;
        assert!(matches!(
            pool_geometry(&wide),
            Err(WireError::InvalidField {
                field: "geometry.n_layers",
                ..
            })
        ));
    }

    #[test]
    fn the_landed_checksum_covers_the_f16_bytes() {
        let p = KvPool::new(cfg(KvDtype::F16)).expect("pool");
        let geometry = pool_geometry(p.config()).expect("geometry");
        assert_eq!(geometry.dtype.kv(), KvDtype::F16);
        let mut r = p.reserve(3).expect("reserve");
        // The page as the pool stores it: per layer K then V blocks of 4
        // slots, the first 3 written, the rest still zero.
        let mut page = vec![half::f16::ZERO; 2 * 2 * 4 * 2];
        for layer in 0..2usize {
            let (k, v) = (values(7 + layer as u32, 3), values(8 + layer as u32, 3));
            r.write(layer, 0, &k, &v).expect("write");
            let at = layer * 2 * 8;
            for (i, x) in k.iter().enumerate() {
                page[at + i] = f16_from_f32(*x);
            }
            for (i, x) in v.iter().enumerate() {
                page[at + 8 + i] = f16_from_f32(*x);
            }
        }
        let want = page_checksum(&geometry, 3, KvValues::F16(&page));
        assert!(want.is_some());
        assert_eq!(landed_checksum(&r, 0, 3), want);
        // Under an f32 geometry the same page is refused, not misread.
        let g32 = Geometry {
            dtype: Dtype::F32,
            ..geometry
        };
        assert_eq!(page_checksum(&g32, 3, KvValues::F16(&page)), None);
    }

    #[test]
    fn a_payload_lands_without_becoming_readable_and_bad_lengths_write_nothing() {
        let p = KvPool::new(cfg(KvDtype::F32)).expect("pool");
        let mut r = p.reserve(4).expect("reserve");
        let (k, v) = (values(1, 4), values(2, 4));
        let mut payload = Vec::new();
        kvmesh_kvwire::f32s_to_le(&k, &mut payload);
        kvmesh_kvwire::f32s_to_le(&v, &mut payload);
        let mut scratch = Vec::new();
        assert!(land_payload(
            &mut r,
            0,
            0..1,
            0..4,
            &payload[..payload.len() - 1],
            &mut scratch
        )
        .is_err());
        assert!(land_payload(&mut r, 0, 0..1, 0..3, &payload, &mut scratch).is_err());
        land_payload(&mut r, 0, 0..1, 0..4, &payload, &mut scratch).expect("lands");
        // Landed, not published: no read sees it (I2).
        let reader = r.reader();
        assert!(kvmesh_kernels::PagedKv::read_page(&reader, r.table()[0], 0, 1).is_err());
        let mut seen = Vec::new();
        r.visit_landed(0, 4, |k, _| seen.push(k.to_f32()))
            .expect("in range");
        assert_eq!(seen[0], k);
    }
}
