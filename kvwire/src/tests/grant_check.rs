//! The frame check against a grant, the reject counters, the page checksum
//! and payload helpers.

use kvmesh_kernels::PageRef;

use super::super::*;
use super::{bytes, cap, frame, geo, grant, rid, smollm2, FRAME_PAYLOAD};

#[test]
fn matching_frames_pass() {
    let g = grant();
    let payload = bytes(FRAME_PAYLOAD, 1);
    assert_eq!(g.check_frame(&frame(&payload)), Ok(()));
    // The last page holds 10 - 8 = 2 prompt slots: 0..2 may be written.
    let last = vec![0u8; 2 * 2 * 2 * 2 * 4];
    let f = KvFrame {
        page_index: 2,
        page: g.pages[2],
        slots: 0..2,
        ..frame(&last)
    };
    assert_eq!(g.check_frame(&f), Ok(()));
    assert_eq!(
        (0..4).map(|i| g.prompt_slots(i)).collect::<Vec<_>>(),
        [Some(4), Some(4), Some(2), None]
    );
}

#[test]
fn a_cached_head_shifts_the_grant_and_is_checked() {
    // 10 tokens in pages of 4, the first 4 cached at decode: the grant's
    // two pages hold positions 4..8 and 8..10.
    let mut g = grant();
    g.cached_tokens = 4;
    g.pages.truncate(2);
    g.validate().expect("valid");
    assert_eq!(
        (0..3).map(|i| g.prompt_slots(i)).collect::<Vec<_>>(),
        [Some(4), Some(2), None]
    );
    let mut out = Vec::new();
    g.encode(&mut out).expect("encode");
    assert_eq!(
        decode_message(&out).expect("decode").0,
        Message::Grant(g.clone())
    );
    // Three slots into the last page are beyond the prompt.
    let last = vec![0u8; 2 * 2 * 3 * 2 * 4];
    let f = KvFrame {
        page_index: 1,
        page: g.pages[1],
        slots: 0..3,
        ..frame(&last)
    };
    assert!(matches!(
        g.check_frame(&f),
        Err(FrameReject::SlotsOutOfPrompt {
            prompt_slots: 2,
            ..
        })
    ));
    // Not whole pages, the whole prompt, or a page list of the wrong size.
    for (cached, pages) in [(3, 2), (12, 0), (8, 2), (0, 2)] {
        let bad = Grant {
            cached_tokens: cached,
            pages: grant().pages[..pages].to_vec(),
            ..grant()
        };
        assert!(bad.validate().is_err(), "cached {cached}, {pages} pages");
    }
}

#[test]
fn each_refusal_is_typed_and_counted() {
    let g = grant();
    let payload = bytes(FRAME_PAYLOAD, 1);
    let ok = || frame(&payload);
    let counters = RejectCounters::default();
    let cases: Vec<(KvFrame<'_>, &str)> = vec![
        (
            KvFrame {
                reservation: rid(8),
                ..ok()
            },
            "unknown_reservation",
        ),
        (
            KvFrame {
                capability: cap(10),
                ..ok()
            },
            "bad_capability",
        ),
        (
            KvFrame {
                geometry: geo(4, 3, 2, 1),
                ..ok()
            },
            "geometry_mismatch",
        ),
        (
            KvFrame {
                page_index: 3,
                ..ok()
            },
            "page_out_of_grant",
        ),
        (
            KvFrame {
                page_index: u32::MAX,
                ..ok()
            },
            "page_out_of_grant",
        ),
        (
            KvFrame {
                page: PageRef {
                    page: 43,
                    generation: 5,
                },
                ..ok()
            },
            "wrong_page",
        ),
        (
            KvFrame {
                page: PageRef {
                    page: 42,
                    generation: 7,
                },
                ..ok()
            },
            "stale_generation",
        ),
        (
            KvFrame {
                page_index: 2,
                page: g.pages[2],
                slots: 1..3,
                ..ok()
            },
            "slots_out_of_prompt",
        ),
    ];
    for (f, kind) in &cases {
        let r = g.check_frame(f).expect_err(kind);
        assert_eq!(r.kind(), *kind, "{r}");
        counters.record_frame(&r);
    }
    // A capability differing only in its last byte is still refused.
    let mut last = *g.capability.expose();
    last[31] ^= 1;
    let f = KvFrame {
        capability: super::super::ids::Capability::from_wire(last),
        ..ok()
    };
    assert!(matches!(
        g.check_frame(&f),
        Err(FrameReject::BadCapability { .. })
    ));

    for (_, msg) in super::corruption::absurd_bodies() {
        if let Err(e) = decode_message(&msg) {
            counters.record_wire(&e);
        }
    }
    counters.record_wire(&decode_message(b"nope, not a message").expect_err("garbage"));
    assert_eq!(counters.total(), cases.len() as u64 + 5 + 1);
    assert_eq!(counters.get("page_out_of_grant"), 2);
    assert_eq!(counters.get("length_mismatch"), 5);
    assert_eq!(counters.get("bad_magic"), 1);
    assert_eq!(counters.get("no_such_kind"), 0);
    let by_kind = counters.by_kind();
    assert_eq!(
        by_kind.iter().map(|(_, n)| n).sum::<u64>(),
        counters.total()
    );
    assert!(by_kind.iter().all(|(k, _)| REJECT_KINDS.contains(k)));
}

#[test]
fn every_kind_name_is_listed_once() {
    let wire = [
        WireError::BadMagic { got: [0; 4] },
        WireError::UnsupportedVersion {
            got: 0,
            supported: 1,
        },
        WireError::UnknownType { tag: 0 },
        WireError::Truncated { needed: 0, got: 0 },
        WireError::LengthMismatch {
            field: "x",
            declared: 0,
            actual: 0,
        },
        WireError::TooLarge { len: 0, max: 0 },
        WireError::BadChecksum {
            declared: 0,
            computed: 0,
        },
        WireError::InvalidField {
            field: "x",
            value: 0,
            reason: "x",
        },
    ];
    let frame = [
        FrameReject::UnknownReservation { got: rid(1) },
        FrameReject::BadCapability {
            reservation: rid(1),
        },
        FrameReject::GeometryMismatch {
            expected: smollm2(),
            got: smollm2(),
        },
        FrameReject::PageOutOfGrant {
            index: 0,
            n_pages: 0,
        },
        FrameReject::WrongPage {
            index: 0,
            expected: 0,
            got: 0,
        },
        FrameReject::StaleGeneration {
            page: 0,
            expected: 0,
            got: 0,
        },
        FrameReject::SlotsOutOfPrompt {
            index: 0,
            end: 0,
            prompt_slots: 0,
        },
    ];
    let names: Vec<&str> = wire
        .iter()
        .map(WireError::kind)
        .chain(frame.iter().map(FrameReject::kind))
        .collect();
    assert_eq!(names, REJECT_KINDS);
    let c = RejectCounters::default();
    wire.iter().for_each(|e| c.record_wire(e));
    frame.iter().for_each(|r| c.record_frame(r));
    assert!(c.by_kind().iter().all(|&(_, n)| n == 1));
}

/// The per-page checksum equals the checksum of a whole-page frame's
/// payload and of per-layer frame payloads fed in order.
#[test]
fn page_checksum_matches_frame_payloads() {
    let g = geo(4, 3, 2, 3);
    let kv_dim = 6;
    let page: Vec<f32> = (0..3 * 2 * 4 * kv_dim)
        .map(|i| i as f32 * 0.5 - 7.0)
        .collect();
    for written in 1..=4u32 {
        let w = written as usize * kv_dim;
        let mut whole = Vec::new();
        let mut by_layer = Checksummer::new();
        for layer in page.chunks_exact(2 * 4 * kv_dim) {
            let (k, v) = layer.split_at(4 * kv_dim);
            let mut one = Vec::new();
            f32s_to_le(&k[..w], &mut one);
            f32s_to_le(&v[..w], &mut one);
            by_layer.update(&one);
            whole.extend_from_slice(&one);
        }
        let f = KvFrame {
            geometry: g,
            layers: 0..3,
            slots: 0..written,
            ..frame(&whole)
        };
        f.validate().expect("a whole-page frame");
        let want =
            page_checksum(&g, written, kvmesh_kernels::KvValues::F32(&page)).expect("valid page");
        assert_eq!(checksum(f.payload), want);
        assert_eq!(by_layer.finish(), want);
        // And the receiver can turn the payload back into the page's values.
        for block in f.layer_blocks() {
            let mut k = vec![0f32; w];
            f32s_from_le(block.k, &mut k).expect("length");
            let base = usize::from(block.layer) * 2 * 4 * kv_dim;
            assert_eq!(k, page[base..base + w]);
        }
    }
    assert!(f32s_from_le(&[0; 7], &mut [0f32; 2]).is_err());
}

#[test]
fn geometry_from_shape_and_page_sizes() {
    let g = Geometry::new(
        16,
        30,
        3,
        64,
        kvmesh_kernels::KvDtype::F32,
        kvmesh_kernels::KvEntry::KeyValue,
    )
    .expect("fits");
    assert_eq!(g, smollm2());
    assert_eq!(g.page_bytes(), Some(737_280));
    assert_eq!(
        g.kv_geometry(),
        kvmesh_kernels::KvGeometry {
            page_size: 16,
            n_kv_heads: 3,
            head_dim: 64,
            entry: kvmesh_kernels::KvEntry::KeyValue,
        }
    );
    assert!(matches!(
        Geometry::new(
            16,
            70_000,
            3,
            64,
            kvmesh_kernels::KvDtype::F32,
            kvmesh_kernels::KvEntry::KeyValue
        ),
        Err(WireError::InvalidField {
            field: "geometry.n_layers",
            value: 70_000,
            ..
        })
    ));
    // The largest geometry the wire can name overflows u64: refused, not
    // wrapped, and a frame claiming it is a length mismatch.
    let max = geo(u32::MAX, u16::MAX, u16::MAX, u16::MAX);
    assert_eq!(max.page_bytes(), None);
    let f = KvFrame {
        geometry: max,
        layers: 0..u16::MAX,
        slots: 0..u32::MAX,
        ..frame(&[])
    };
    assert!(matches!(
        f.validate(),
        Err(WireError::LengthMismatch {
            field: "payload",
            ..
        })
    ));
}

#[test]
fn abort_reasons_have_names_and_unknown_codes_still_decode() {
    assert_eq!(AbortReason::LEASE_EXPIRED.name(), "lease_expired");
    assert_eq!(AbortReason(999).name(), "unknown");
    let mut out = Vec::new();
    Abort {
        reservation: rid(3),
        reason: AbortReason(999),
    }
    .encode(&mut out)
    .expect("encodes");
    let (m, _) = decode_message(&out).expect("an unknown reason still aborts");
    assert_eq!(
        m,
        Message::Abort(Abort {
            reservation: rid(3),
            reason: AbortReason(999)
        })
    );
}
