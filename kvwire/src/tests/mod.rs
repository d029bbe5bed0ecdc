//! Codec tests: round trips (proptest), truncation, corruption, absurd
//! lengths, typed errors, the frame check against a grant, and counters.

mod alloc;
mod corruption;
mod grant_check;
mod roundtrip;

use kvmesh_kernels::PageRef;

use super::codec::Put;
use super::ids::WireId;
use super::*;

/// Geometry with f32 values.
pub(super) fn geo(page_size: u32, n_layers: u16, n_kv_heads: u16, head_dim: u16) -> Geometry {
    Geometry {
        page_size,
        n_layers,
        n_kv_heads,
        head_dim,
        dtype: Dtype::F32,
        entry: kvmesh_kernels::KvEntry::KeyValue,
    }
}

/// The default model's page: SmolLM2, 30 layers, 3 KV heads of 64, 16 slots.
pub(super) fn smollm2() -> Geometry {
    geo(16, 30, 3, 64)
}

pub(super) fn rid(seed: u8) -> ReservationId {
    ReservationId::from_wire([seed.max(1); 16])
}

pub(super) fn cap(seed: u8) -> Capability {
    let mut b = [seed.max(1); 32];
    b[31] = 0xA5;
    Capability::from_wire(b)
}

/// Deterministic non-trivial bytes.
pub(super) fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A frame of layers 1..3, slots 1..3 of page index 1 in [`grant`].
pub(super) fn frame(payload: &[u8]) -> KvFrame<'_> {
    KvFrame {
        reservation: rid(7),
        capability: cap(9),
        page_index: 1,
        page: PageRef {
            page: 42,
            generation: 5,
        },
        geometry: geo(4, 3, 1, 2),
        layers: 1..3,
        slots: 1..3,
        payload,
    }
}

/// Payload length of [`frame`]: 2 layers * (K + V) * 2 slots * 2 values * 4.
pub(super) const FRAME_PAYLOAD: usize = 64;

/// A grant of 10 tokens in pages of 4: three pages, the last with 2 slots.
pub(super) fn grant() -> Grant {
    Grant {
        reservation: rid(7),
        capability: cap(9),
        geometry: geo(4, 3, 1, 2),
        prompt_tokens: 10,
        cached_tokens: 0,
        lease_deadline_unix_ms: 1_700_000_000_000,
        write_key: 0x0000_0003_0000_0007,
        pages: vec![
            PageRef {
                page: 3,
                generation: 1,
            },
            PageRef {
                page: 42,
                generation: 5,
            },
            PageRef {
                page: 8,
                generation: 9,
            },
        ],
        endpoint: "tcp://127.0.0.1:7000".into(),
    }
}

/// A first token with logprobs (two alternatives) and one prompt score
/// (one alternative): its report is [`FIRST_REPORT_LEN`] bytes, at body
/// offset 64 of a TransferDone (prefill's cached count, then the logprobs'
/// flag at 68, top count at 73, the prompt scores' count at 90, the score's
/// top count at 102).
pub(super) fn first_token() -> FirstToken {
    FirstToken {
        id: 1234,
        logprobs: Some(TokenLogprobs {
            logprob: -0.5,
            top: vec![(1234, -0.5), (7, -1.5)],
        }),
        cached_tokens: 16,
        prompt_scores: vec![PromptScore {
            logprob: -2.0,
            rank: 3,
            top: vec![(5, -0.25)],
        }],
    }
}

/// See [`first_token`]: 4 + (1 + 4 + 1 + 2 * 8) + 4 + (4 + 4 + 1 + 8).
pub(super) const FIRST_REPORT_LEN: usize = 47;

/// One small encoded message of every type.
pub(super) fn samples() -> Vec<(MessageType, Vec<u8>)> {
    let payload = bytes(FRAME_PAYLOAD, 1);
    let msgs = [
        Message::KvFrame(frame(&payload)),
        Message::Grant(grant()),
        Message::TransferDone(TransferDone {
            reservation: rid(7),
            capability: cap(9),
            tokens_written: 10,
            first: first_token(),
            page_checksums: vec![1, 2, 3],
        }),
        Message::Abort(Abort {
            reservation: rid(7),
            reason: AbortReason::CLIENT_GONE,
        }),
        Message::AbortConfirmed(AbortConfirmed {
            reservation: rid(7),
            frames_sent: 17,
        }),
        Message::Revoke(Revoke {
            reservation: rid(7),
        }),
        Message::Hello(Hello {
            writer: WriterId::from_wire([3; 16]),
            nonce: [4; NONCE_LEN],
            proof: [5; PROOF_LEN],
        }),
        Message::Welcome(Welcome {
            proof: [6; PROOF_LEN],
            data_path: DataPath::SharedMemory {
                path: "/dev/shm/kvmesh-pool-1.shm".into(),
            },
            geometry: geo(4, 3, 1, 2),
        }),
        Message::Challenge(Challenge {
            nonce: [7; NONCE_LEN],
        }),
    ];
    msgs.iter()
        .map(|m| {
            let mut out = Vec::new();
            m.encode(&mut out).expect("valid sample");
            (m.message_type(), out)
        })
        .collect()
}

/// Recomputes the trailer after a test patched header or body bytes, so the
/// patch reaches the field checks instead of stopping at the checksum.
pub(super) fn reseal(msg: &mut Vec<u8>) {
    msg.truncate(msg.len() - TRAILER_LEN);
    let sum = checksum(msg);
    msg.put_u64(sum);
}

/// Overwrites `value` at body offset `off` (little-endian) and reseals.
pub(super) fn patch(msg: &[u8], off: usize, value: &[u8]) -> Vec<u8> {
    let mut m = msg.to_vec();
    m[HEADER_LEN + off..HEADER_LEN + off + value.len()].copy_from_slice(value);
    reseal(&mut m);
    m
}

pub(super) fn err(bytes: &[u8]) -> WireError {
    decode_message(bytes).expect_err("must be refused")
}

/// The sizes and offsets in the module doc's tables.
#[test]
fn layout_sizes_match_the_doc_tables() {
    assert_eq!(frame::FRAME_FIXED_LEN, 92);
    assert_eq!(grant::GRANT_FIXED_LEN, 98);
    assert_eq!(control::TRANSFER_DONE_FIXED_LEN, 64);
    assert_eq!(first::FIRST_TOKEN_REPORT_MIN_LEN, 9);
    assert_eq!(
        (
            control::ABORT_LEN,
            control::ABORT_CONFIRMED_LEN,
            control::REVOKE_LEN
        ),
        (18, 24, 16)
    );
    assert_eq!(
        (
            control::CHALLENGE_LEN,
            control::HELLO_LEN,
            control::WELCOME_FIXED_LEN
        ),
        (32, 80, 48)
    );
    assert_eq!(HEADER_LEN + frame::FRAME_FIXED_LEN, 104);
    let s = samples();
    let lens: Vec<usize> = s.iter().map(|(_, m)| m.len()).collect();
    let endpoint = grant().endpoint.len();
    assert_eq!(
        lens,
        [
            20 + 92 + FRAME_PAYLOAD,
            20 + 98 + 3 * 12 + endpoint,
            20 + 64 + FIRST_REPORT_LEN + 3 * 8,
            20 + 18,
            20 + 24,
            20 + 16,
            20 + 80,
            20 + 48 + "/dev/shm/kvmesh-pool-1.shm".len(),
            20 + 32,
        ]
    );
    for (ty, m) in &s {
        assert_eq!(m[..4], *b"KVMW");
        assert_eq!(u16::from_le_bytes([m[4], m[5]]), 4);
        assert_eq!(u16::from_le_bytes([m[6], m[7]]), ty.tag());
        assert_eq!(MessageType::from_tag(ty.tag()), Ok(*ty));
    }
    let tags: Vec<u16> = MessageType::ALL.iter().map(|t| t.tag()).collect();
    assert_eq!(tags, [1, 2, 3, 4, 5, 6, 7, 8, 9]);
}
