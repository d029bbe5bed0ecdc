//! Truncation, corruption, typed errors for every malformed field, and
//! encoders refusing what decoders would refuse.

use super::super::*;
use super::{bytes, err, frame, grant, patch, reseal, samples, smollm2, FRAME_PAYLOAD};

#[test]
fn every_truncation_point_is_truncated() {
    for (ty, msg) in samples() {
        for k in 0..msg.len() {
            let needed = if k < HEADER_LEN {
                HEADER_LEN
            } else {
                msg.len()
            };
            assert_eq!(
                err(&msg[..k]),
                WireError::Truncated { needed, got: k },
                "{ty:?} cut at {k}"
            );
        }
        assert!(decode_message(&msg).is_ok(), "{ty:?} whole");
    }
}

/// Flipping any bit pattern of any byte of any message is refused: the
/// trailer covers everything, so no flip decodes to another valid message.
#[test]
fn every_byte_flip_is_refused() {
    for (ty, msg) in samples() {
        for i in 0..msg.len() {
            for mask in [0x01u8, 0x80, 0xFF, 0x5A] {
                let mut m = msg.clone();
                m[i] ^= mask;
                let e = err(&m);
                let ok = match i {
                    0..4 => matches!(e, WireError::BadMagic { .. }),
                    4..6 => matches!(e, WireError::UnsupportedVersion { .. }),
                    6..8 => matches!(
                        e,
                        WireError::UnknownType { .. } | WireError::BadChecksum { .. }
                    ),
                    8..12 => matches!(
                        e,
                        WireError::Truncated { .. }
                            | WireError::TooLarge { .. }
                            | WireError::BadChecksum { .. }
                    ),
                    _ => matches!(e, WireError::BadChecksum { .. }),
                };
                assert!(ok, "{ty:?} byte {i} ^ {mask:#04x}: {e:?}");
            }
        }
    }
}

/// Payload corruption of a real-sized frame (one layer of a SmolLM2 page)
/// is caught wherever it lands.
#[test]
fn payload_corruption_is_always_detected() {
    let g = smollm2();
    let len = g.payload_len(&(0..1), g.page_size).expect("fits") as usize;
    assert_eq!(len, 24_576);
    let payload = bytes(len, 3);
    let mut f = frame(&payload);
    f.geometry = g;
    f.layers = 4..5;
    f.slots = 0..16;
    let mut msg = Vec::new();
    f.encode(&mut msg).expect("valid");
    let start = HEADER_LEN + frame::FRAME_FIXED_LEN;
    for i in (start..start + len)
        .step_by(37)
        .chain([start, start + len - 1])
    {
        for bit in 0..8 {
            let mut m = msg.clone();
            m[i] ^= 1 << bit;
            assert!(
                matches!(err(&m), WireError::BadChecksum { .. }),
                "byte {i} bit {bit}"
            );
        }
    }
}

#[test]
fn header_errors_are_typed() {
    let (_, msg) = samples().swap_remove(3);
    let mut m = msg.clone();
    m[..4].copy_from_slice(b"HTTP");
    assert_eq!(err(&m), WireError::BadMagic { got: *b"HTTP" });
    // Versions 1 (before mesh authentication), 2 (before the Grant's
    // cached head) and 3 (before TransferDone's first-token report) are
    // refused like any other.
    for v in [0u16, 1, 2, 3, 5, u16::MAX] {
        let mut m = msg.clone();
        m[4..6].copy_from_slice(&v.to_le_bytes());
        reseal(&mut m);
        assert_eq!(
            err(&m),
            WireError::UnsupportedVersion {
                got: v,
                supported: VERSION
            }
        );
    }
    for tag in [0u16, 10, u16::MAX] {
        let mut m = msg.clone();
        m[6..8].copy_from_slice(&tag.to_le_bytes());
        reseal(&mut m);
        assert_eq!(err(&m), WireError::UnknownType { tag });
        assert_eq!(err(&m).kind(), "unknown_type");
    }
    let limits = DecodeLimits {
        max_message_bytes: msg.len() - 1,
    };
    assert_eq!(
        decode(&msg, &limits),
        Err(WireError::TooLarge {
            len: msg.len() as u64,
            max: msg.len() as u64 - 1
        })
    );
    // An unknown type is reported with its length, so a stream can skip it.
    let mut m = msg.clone();
    m[6..8].copy_from_slice(&99u16.to_le_bytes());
    let h = peek_header(&m, &DecodeLimits::default()).expect("header is fine");
    assert_eq!((h.tag, h.message_len()), (99, msg.len()));
}

/// Declared lengths far beyond the input are refused from the header or by
/// comparing with the bytes present; see `alloc.rs` for "without
/// allocating".
#[test]
fn absurd_lengths_are_refused() {
    let (_, abort) = samples().swap_remove(3);
    let mut m = abort.clone();
    m[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(err(&m), WireError::TooLarge { .. }));
    // With no limit to speak of, the same header asks for bytes that are
    // not there: truncated, not allocated.
    let huge = DecodeLimits {
        max_message_bytes: usize::MAX,
    };
    assert!(
        matches!(decode(&m, &huge), Err(WireError::Truncated { needed, .. }) if needed > 1 << 32)
    );

    for (field, msg) in absurd_bodies() {
        assert!(
            matches!(err(&msg), WireError::LengthMismatch { .. }),
            "{field}: {:?}",
            err(&msg)
        );
    }
}

/// Messages whose checksums are right but whose inner length fields claim
/// about 4 GiB of content.
pub(super) fn absurd_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let s = samples();
    let max = u32::MAX.to_le_bytes();
    vec![
        ("frame payload_len", patch(&s[0].1, 88, &max)),
        ("grant pages", patch(&s[1].1, 92, &max)),
        (
            "grant endpoint",
            patch(&s[1].1, 96, &u16::MAX.to_le_bytes()),
        ),
        ("transfer_done pages_written", patch(&s[2].1, 60, &max)),
        ("transfer_done first.top", patch(&s[2].1, 73, &[u8::MAX])),
    ]
}

#[test]
fn invalid_fields_are_named() {
    let s = samples();
    let (f, g, d, a) = (&s[0].1, &s[1].1, &s[2].1, &s[3].1);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (patch(f, 0, &[0; 16]), "reservation"),
        (patch(f, 16, &[0; 32]), "capability"),
        (patch(a, 0, &[0; 16]), "reservation"),
        (patch(d, 16, &[0; 32]), "capability"),
        (patch(f, 64, &0u32.to_le_bytes()), "geometry.page_size"),
        (patch(f, 68, &0u16.to_le_bytes()), "geometry.n_layers"),
        (patch(g, 54, &0u16.to_le_bytes()), "geometry.n_kv_heads"),
        (patch(f, 74, &[3]), "geometry.dtype"),
        (patch(f, 75, &[2]), "geometry.entry"),
        (patch(f, 76, &3u16.to_le_bytes()), "layers.end"), // start 3 >= end 3
        (patch(f, 78, &4u16.to_le_bytes()), "layers.end"), // past n_layers 3
        (patch(f, 84, &0u32.to_le_bytes()), "slots.n"),
        (patch(f, 80, &3u32.to_le_bytes()), "slots.end"), // 3 + 2 > page_size 4
        (patch(f, 80, &u32::MAX.to_le_bytes()), "slots.n"), // overflow
        (patch(g, 60, &0u64.to_le_bytes()), "prompt_tokens"),
        (patch(g, 98 + 3 * 12, b"\xff"), "endpoint"),
        (patch(g, 68, &3u64.to_le_bytes()), "cached_tokens"), // not whole pages
        (patch(g, 68, &12u64.to_le_bytes()), "cached_tokens"), // the whole prompt
        (patch(d, 68, &[2]), "first.logprobs"),               // neither absent nor present
        // The connection's opening: zero nonces were never minted, the
        // Welcome's fields after its proof are checked as before.
        (patch(&s[6].1, 0, &[0; 16]), "writer"),
        (patch(&s[6].1, 16, &[0; NONCE_LEN]), "nonce"),
        (patch(&s[8].1, 0, &[0; NONCE_LEN]), "nonce"),
        (patch(&s[7].1, PROOF_LEN, &[4]), "data_path"),
        (patch(&s[7].1, PROOF_LEN + 1, &[1]), "reserved"),
        (patch(&s[7].1, PROOF_LEN, &[1]), "path"),
    ];
    for (msg, field) in cases {
        match err(&msg) {
            WireError::InvalidField { field: got, .. } => assert_eq!(got, field),
            e => panic!("{field}: {e:?}"),
        }
    }
    // Counts that disagree with the geometry or the body.
    let mismatches: Vec<(Vec<u8>, &str)> = vec![
        // Payload length that the body holds but the geometry does not imply.
        (patch(f, 84, &1u32.to_le_bytes()), "payload"),
        // 10 prompt tokens need 3 pages of 4; 13 would need 4.
        (patch(g, 60, &13u64.to_le_bytes()), "pages"),
        (patch(d, 60, &2u32.to_le_bytes()), "pages_written"),
        // The report's lists (checked before they are allocated; the
        // logprobs' list before them is, so these are not absurd_bodies).
        (patch(d, 90, &u32::MAX.to_le_bytes()), "prompt_scores"),
        (patch(d, 102, &[u8::MAX]), "prompt_scores.top"),
        // One score fewer: the checksums' count no longer matches.
        (patch(d, 90, &0u32.to_le_bytes()), "pages_written"),
    ];
    for (msg, field) in mismatches {
        match err(&msg) {
            WireError::LengthMismatch { field: got, .. } => assert_eq!(got, field),
            e => panic!("{field}: {e:?}"),
        }
    }
    // A body longer than its fields: the envelope says 19 bytes, Abort has 18.
    let mut m = a[..a.len() - TRAILER_LEN].to_vec();
    m.push(0);
    m[8..12].copy_from_slice(&19u32.to_le_bytes());
    m.extend_from_slice(&[0; 8]);
    reseal(&mut m);
    assert!(matches!(
        err(&m),
        WireError::LengthMismatch { field: "abort", .. }
    ));
    // An empty endpoint: drop its bytes, zero its length, fix the body
    // length, reseal. The encoder refuses the same grant.
    let ep = grant().endpoint.len();
    let mut m = g[..g.len() - TRAILER_LEN - ep].to_vec();
    m[HEADER_LEN + 96..HEADER_LEN + 98].copy_from_slice(&0u16.to_le_bytes());
    let body = (m.len() - HEADER_LEN) as u32;
    m[8..12].copy_from_slice(&body.to_le_bytes());
    m.extend_from_slice(&[0; TRAILER_LEN]);
    reseal(&mut m);
    assert!(matches!(
        err(&m),
        WireError::InvalidField {
            field: "endpoint",
            value: 0,
            ..
        }
    ));
    let mut e = grant();
    e.endpoint.clear();
    assert!(matches!(
        e.encode(&mut Vec::new()),
        Err(WireError::InvalidField {
            field: "endpoint",
            ..
        })
    ));
}

#[test]
fn encoders_refuse_what_decoders_refuse_and_append_nothing() {
    let payload = bytes(FRAME_PAYLOAD, 1);
    let mut out = vec![1, 2, 3];
    let mut bad: Vec<KvFrame<'_>> = Vec::new();
    let short = &payload[..FRAME_PAYLOAD - 4];
    bad.push(KvFrame {
        payload: short,
        ..frame(&payload)
    });
    bad.push(KvFrame {
        layers: 2..2,
        ..frame(&payload)
    });
    bad.push(KvFrame {
        slots: 3..5,
        ..frame(&payload)
    });
    let mut g = frame(&payload);
    g.geometry.head_dim = 0;
    bad.push(g);
    for f in &bad {
        assert!(f.encode(&mut out).is_err(), "{f:?}");
        assert_eq!(out, [1, 2, 3]);
    }
    let mut gr = grant();
    gr.pages.pop();
    assert!(matches!(
        gr.encode(&mut out),
        Err(WireError::LengthMismatch { field: "pages", .. })
    ));
    let mut gr = grant();
    gr.endpoint = "x".repeat(70_000);
    assert!(matches!(
        gr.encode(&mut out),
        Err(WireError::InvalidField {
            field: "endpoint",
            ..
        })
    ));
    assert_eq!(out, [1, 2, 3]);
}
