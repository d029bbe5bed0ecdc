//! Every message survives encode then decode, over random fields and
//! payload sizes; decoding is canonical and streams.

use kvmesh_kernels::PageRef;
use proptest::collection::vec;
use proptest::prelude::*;

use super::super::ids::WireId;
use super::super::*;
use super::geo;

fn arb_rid() -> impl Strategy<Value = ReservationId> {
    any::<[u8; 16]>()
        .prop_filter("minted ids are never zero", |b| b.iter().any(|&x| x != 0))
        .prop_map(ReservationId::from_wire)
}

fn arb_cap() -> impl Strategy<Value = Capability> {
    any::<[u8; 32]>()
        .prop_filter("minted capabilities are never zero", |b| {
            b.iter().any(|&x| x != 0)
        })
        .prop_map(Capability::from_wire)
}

fn arb_nonce() -> impl Strategy<Value = [u8; NONCE_LEN]> {
    any::<[u8; NONCE_LEN]>().prop_filter("nonces are never zero", |b| b.iter().any(|&x| x != 0))
}

fn arb_geo() -> impl Strategy<Value = Geometry> {
    (1u32..=32, 1u16..=6, 1u16..=3, 1u16..=8, any::<bool>()).prop_map(|(p, l, h, d, latent)| {
        let entry = if latent {
            kvmesh_kernels::KvEntry::Latent
        } else {
            kvmesh_kernels::KvEntry::KeyValue
        };
        Geometry {
            entry,
            ..geo(p, l, h, d)
        }
    })
}

fn arb_page() -> impl Strategy<Value = PageRef> {
    (any::<u32>(), any::<u64>()).prop_map(|(page, generation)| PageRef { page, generation })
}

/// A frame's fields and a payload of exactly the length its geometry needs.
#[derive(Debug, Clone)]
struct FrameCase {
    reservation: ReservationId,
    capability: Capability,
    page_index: u32,
    page: PageRef,
    geometry: Geometry,
    layers: std::ops::Range<u16>,
    slots: std::ops::Range<u32>,
    payload: Vec<u8>,
}

impl FrameCase {
    fn frame(&self) -> KvFrame<'_> {
        KvFrame {
            reservation: self.reservation,
            capability: self.capability.clone(),
            page_index: self.page_index,
            page: self.page,
            geometry: self.geometry,
            layers: self.layers.clone(),
            slots: self.slots.clone(),
            payload: &self.payload,
        }
    }
}

fn arb_frame() -> impl Strategy<Value = FrameCase> {
    (arb_rid(), arb_cap(), any::<u32>(), arb_page(), arb_geo())
        .prop_flat_map(|(reservation, capability, page_index, page, geometry)| {
            let layers =
                (0..geometry.n_layers).prop_flat_map(move |a| (Just(a), a + 1..=geometry.n_layers));
            let slots = (0..geometry.page_size)
                .prop_flat_map(move |a| (Just(a), a + 1..=geometry.page_size));
            (
                Just((reservation, capability, page_index, page, geometry)),
                layers,
                slots,
            )
        })
        .prop_flat_map(|(fixed, (l0, l1), (s0, s1))| {
            let len = fixed.4.payload_len(&(l0..l1), s1 - s0).expect("small") as usize;
            (
                Just(fixed),
                Just(l0..l1),
                Just(s0..s1),
                vec(any::<u8>(), len),
            )
        })
        .prop_map(
            |((reservation, capability, page_index, page, geometry), layers, slots, payload)| {
                FrameCase {
                    reservation,
                    capability,
                    page_index,
                    page,
                    geometry,
                    layers,
                    slots,
                    payload,
                }
            },
        )
}

fn arb_grant() -> impl Strategy<Value = Grant> {
    (
        arb_rid(),
        arb_cap(),
        arb_geo(),
        1u64..=400,
        (any::<u64>(), any::<u64>()),
        "\\PC{1,40}",
        any::<u16>(),
    )
        .prop_flat_map(
            |(reservation, capability, geometry, prompt_tokens, deadline, endpoint, head)| {
                // A cached head of whole pages, shorter than the prompt.
                let page_size = u64::from(geometry.page_size);
                let cached = (u64::from(head) % prompt_tokens.div_ceil(page_size)) * page_size;
                let n = (prompt_tokens - cached).div_ceil(page_size) as usize;
                (
                    Just((
                        reservation,
                        capability,
                        geometry,
                        (prompt_tokens, cached),
                        deadline,
                        endpoint,
                    )),
                    vec(arb_page(), n),
                )
            },
        )
        .prop_map(
            |(
                (
                    reservation,
                    capability,
                    geometry,
                    (prompt_tokens, cached_tokens),
                    (lease_deadline_unix_ms, write_key),
                    endpoint,
                ),
                pages,
            )| Grant {
                reservation,
                capability,
                geometry,
                prompt_tokens,
                cached_tokens,
                lease_deadline_unix_ms,
                write_key,
                pages,
                endpoint,
            },
        )
}

/// Alternatives: ids and logprobs. Logprobs are drawn from the numbers
/// that compare equal to themselves (any bits round-trip, but NaN would
/// fail the equality the property checks).
fn arb_top() -> impl Strategy<Value = Vec<(u32, f32)>> {
    vec((any::<u32>(), -1e30f32..=0.0), 0..=20)
}

fn arb_first() -> impl Strategy<Value = FirstToken> {
    (
        any::<u32>(),
        proptest::option::of((-1e30f32..=0.0, arb_top())),
        any::<u32>(),
        vec((-1e30f32..=0.0, any::<u32>(), arb_top()), 0..40),
    )
        .prop_map(|(id, logprobs, cached_tokens, scores)| FirstToken {
            id,
            logprobs: logprobs.map(|(logprob, top)| TokenLogprobs { logprob, top }),
            cached_tokens,
            prompt_scores: scores
                .into_iter()
                .map(|(logprob, rank, top)| PromptScore { logprob, rank, top })
                .collect(),
        })
}

fn arb_control() -> impl Strategy<Value = Message<'static>> {
    prop_oneof![
        arb_grant().prop_map(Message::Grant),
        (
            arb_rid(),
            arb_cap(),
            any::<u64>(),
            arb_first(),
            vec(any::<u64>(), 0..300)
        )
            .prop_map(
                |(reservation, capability, tokens_written, first, page_checksums)| {
                    Message::TransferDone(TransferDone {
                        reservation,
                        capability,
                        tokens_written,
                        first,
                        page_checksums,
                    })
                }
            ),
        (arb_rid(), any::<u16>()).prop_map(|(reservation, r)| Message::Abort(Abort {
            reservation,
            reason: AbortReason(r),
        })),
        (arb_rid(), any::<u64>()).prop_map(|(reservation, frames_sent)| {
            Message::AbortConfirmed(AbortConfirmed {
                reservation,
                frames_sent,
            })
        }),
        arb_rid().prop_map(|reservation| Message::Revoke(Revoke { reservation })),
        (
            any::<[u8; 16]>().prop_filter("ids are never zero", |b| b.iter().any(|&x| x != 0)),
            arb_nonce(),
            any::<[u8; PROOF_LEN]>()
        )
            .prop_map(|(b, nonce, proof)| Message::Hello(Hello {
                writer: WriterId::from_wire(b),
                nonce,
                proof,
            })),
        (
            any::<[u8; PROOF_LEN]>(),
            arb_geo(),
            proptest::option::of("\\PC{1,60}")
        )
            .prop_map(|(proof, geometry, path)| {
                Message::Welcome(Welcome {
                    proof,
                    data_path: path
                        .map_or(DataPath::Frames, |path| DataPath::SharedMemory { path }),
                    geometry,
                })
            }),
        (
            any::<[u8; PROOF_LEN]>(),
            arb_geo(),
            "[0-9a-f:.\\[\\]]{1,60}",
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 1..300)
        )
            .prop_map(|(proof, geometry, address, base, len, rkey)| {
                Message::Welcome(Welcome {
                    proof,
                    data_path: DataPath::Ucx {
                        address,
                        base,
                        len,
                        rkey,
                    },
                    geometry,
                })
            }),
        arb_nonce().prop_map(|nonce| Message::Challenge(Challenge { nonce })),
    ]
}

/// Encodes, checks the length reported, decodes, checks equality and that
/// exactly the message's bytes were used.
fn round_trip(m: &Message<'_>) -> Vec<u8> {
    let mut out = vec![0xEE; 3]; // encode appends: leave something before it
    let n = m.encode(&mut out).expect("valid message encodes");
    assert_eq!(n, out.len() - 3);
    let (back, used) = decode_message(&out[3..]).expect("decodes");
    assert_eq!(used, n);
    assert_eq!(&back, m);
    out.split_off(3)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn frames_round_trip(case in arb_frame()) {
        let f = case.frame();
        let bytes = round_trip(&Message::KvFrame(f.clone()));
        prop_assert_eq!(bytes.len(), f.encoded_len());
        let Ok((Message::KvFrame(back), _)) = decode_message(&bytes) else {
            panic!("not a frame");
        };
        // Zero-copy: the payload points into the input.
        prop_assert_eq!(back.payload.as_ptr(), bytes[HEADER_LEN + frame::FRAME_FIXED_LEN..].as_ptr());
        prop_assert_eq!(back.layer_blocks().count(), f.layers.len());
        let joined: Vec<u8> = back.layer_blocks().flat_map(|b| [b.k, b.v]).flatten().copied().collect();
        prop_assert_eq!(joined, case.payload.clone());
    }

    #[test]
    fn control_messages_round_trip(m in arb_control()) {
        let bytes = round_trip(&m);
        let len = match &m {
            Message::Grant(g) => g.encoded_len(),
            Message::TransferDone(d) => d.encoded_len(),
            _ => bytes.len(),
        };
        prop_assert_eq!(bytes.len(), len);
    }

    /// A stream of messages decodes one by one, each reporting its length;
    /// a partial last message is `Truncated`.
    #[test]
    fn streams_decode_in_order(ms in vec(arb_control(), 1..6), case in arb_frame(), cut in 1usize..20) {
        let mut all: Vec<Message<'_>> = ms;
        all.insert(all.len() / 2, Message::KvFrame(case.frame()));
        let mut stream = Vec::new();
        for m in &all {
            m.encode(&mut stream).expect("encodes");
        }
        let mut tail = Vec::new();
        all[0].encode(&mut tail).expect("encodes");
        let cut = cut.min(tail.len() - 1);
        stream.extend_from_slice(&tail[..cut]);
        let mut at = 0;
        for m in &all {
            let (back, used) = decode_message(&stream[at..]).expect("decodes");
            prop_assert_eq!(&back, m);
            at += used;
        }
        let truncated = matches!(decode_message(&stream[at..]), Err(WireError::Truncated { .. }));
        prop_assert!(truncated);
    }

    /// Mutated bodies, resealed so they pass the checksum, reach every field
    /// check: the decoder never panics, and anything it accepts re-encodes
    /// to the same bytes (the encoding is canonical).
    #[test]
    fn resealed_mutations_never_panic(
        m in arb_control(),
        case in arb_frame(),
        use_frame: bool,
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut bytes = Vec::new();
        if use_frame {
            case.frame().encode(&mut bytes).expect("encodes");
        } else {
            m.encode(&mut bytes).expect("encodes");
        }
        let body = HEADER_LEN..bytes.len() - TRAILER_LEN;
        for (i, v) in edits {
            let at = body.start + i.index(body.len());
            bytes[at] = v;
        }
        super::reseal(&mut bytes);
        match decode_message(&bytes) {
            Ok((back, used)) => {
                prop_assert_eq!(used, bytes.len());
                let mut again = Vec::new();
                back.encode(&mut again).expect("a decoded message encodes");
                prop_assert_eq!(again, bytes);
            }
            Err(e) => prop_assert!(REJECT_KINDS.contains(&e.kind())),
        }
    }

    /// Arbitrary bytes, with or without a valid header in front, never
    /// panic the decoder.
    #[test]
    fn garbage_never_panics(tail in vec(any::<u8>(), 0..300), tag in 0u16..8, len in any::<u32>(), header: bool) {
        let mut bytes = Vec::new();
        if header {
            bytes.extend_from_slice(&MAGIC);
            bytes.extend_from_slice(&VERSION.to_le_bytes());
            bytes.extend_from_slice(&tag.to_le_bytes());
            bytes.extend_from_slice(&(len % 400).to_le_bytes());
        }
        bytes.extend_from_slice(&tail);
        if let Ok((_, used)) = decode_message(&bytes) {
            prop_assert!(used <= bytes.len());
        }
    }
}
