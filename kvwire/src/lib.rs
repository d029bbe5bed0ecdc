//! kvmesh's KV wire format: what crosses between a decode and a prefill
//! node, as bytes, and nothing else. No async runtime, no pool, no
//! transport: a fuzzer, a future transport or a client in another
//! language can use it as it is (its dependencies: `kvmesh-kernels` for
//! the value types, `half`, `bytemuck`, `getrandom`, `xxhash-rust`).
//!
//! The versioned wire format of KV transfers: data frames (a slot range of
//! some layers of one granted page) and the control messages of the
//! handshake in `design/kv-safety.md` section 3 (grant, transfer done,
//! abort, abort confirmed, revoke), and the mesh-authenticated opening of a
//! transport connection (challenge, hello, welcome).
//!
//! Hand-written little-endian encoding with a fixed header, no serde: every
//! byte below is checked on decode, and [`decode`] never panics, never reads
//! past its input, and allocates only after a declared length has been
//! checked against the bytes actually present (so at most the message's
//! own size, itself capped by [`DecodeLimits`]). Frame payloads are
//! borrowed from the input buffer, not copied.
//!
//! # Envelope
//!
//! Every message is `header | body | trailer`; all integers little-endian.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `KVMW` (`4b 56 4d 57`) |
//! | 4 | 2 | version u16, [`VERSION`] = 4 |
//! | 6 | 2 | message type tag u16 ([`MessageType`]) |
//! | 8 | 4 | body length u32 (bytes between header and trailer) |
//! | 12 | body length | body, per type below |
//! | 12 + body length | 8 | checksum u64: [`checksum()`] of bytes `0 .. 12 + body length` |
//!
//! The trailer covers the header and the whole body, not only a frame's
//! payload: a flipped destination page, generation or slot would otherwise
//! land good KV in the wrong place, and a flipped `first_token` would
//! silently change the answer. So every corrupted byte is refused.
//!
//! # Bodies (offsets within the body)
//!
//! Ids are 16 bytes, the [`Capability`] 32; [`Geometry`] is 12 bytes:
//! page_size u32, n_layers u16, n_kv_heads u16, head_dim u16, dtype u8
//! (1 = f32, 2 = f16: the pool's dtype), entry u8 (0 = K and V blocks, 1 =
//! one latent block per layer).
//!
//! **KvFrame** (tag 1), 92 bytes + payload:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 16 | reservation id |
//! | 16 | 32 | capability |
//! | 48 | 4 | page index in the grant (logical) u32 |
//! | 52 | 4 | physical page id u32 |
//! | 56 | 8 | page generation u64 |
//! | 64 | 12 | geometry |
//! | 76 | 2 | first layer u16 |
//! | 78 | 2 | end layer u16 (exclusive) |
//! | 80 | 4 | first slot u32 |
//! | 84 | 4 | slot count u32 |
//! | 88 | 4 | payload length u32 = layers * blocks * slots * kv_dim * dtype size (blocks: 2, or 1 for latent entries) |
//! | 92 | payload length | per layer: K of the slots, then V (key-value entries), little-endian values of the geometry's dtype, each `[slots][n_kv_heads][head_dim]` |
//!
//! The payload starts at byte 104 of the message, a multiple of 8.
//!
//! **Grant** (tag 2), 98 bytes + 12 per page + endpoint:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 16 | reservation id |
//! | 16 | 32 | capability |
//! | 48 | 12 | geometry |
//! | 60 | 8 | prompt tokens u64 (the prompt's length) |
//! | 68 | 8 | cached tokens u64 (whole pages decode has; not written) |
//! | 76 | 8 | lease deadline, unix milliseconds u64 |
//! | 84 | 8 | write key u64 (transport's key for this grant's write path) |
//! | 92 | 4 | page count n u32 = ceil((prompt - cached) / page_size) |
//! | 96 | 2 | endpoint length e u16 |
//! | 98 | 12 n | pages: page id u32, generation u64; page 0 at position `cached` |
//! | 98 + 12 n | e | endpoint, UTF-8, non-empty |
//!
//! **TransferDone** (tag 3), 73 bytes + 8 per page + the first token's
//! logprobs and the prompt's scores when asked:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 16 | reservation id |
//! | 16 | 32 | capability |
//! | 48 | 8 | tokens written u64 |
//! | 56 | 4 | first sampled token id u32 |
//! | 60 | 4 | pages written n u32 |
//! | 64 | r = 9 + ... | the first token's report ([`first`]: prefill's cached tokens, the token's logprobs, the prompt's scores) |
//! | 64 + r | 8 n | [`page_checksum`] of each page, grant order, u64 |
//!
//! **Abort** (tag 4), 18 bytes: reservation id (16), reason code u16
//! ([`AbortReason`]; unknown codes still abort).
//!
//! **AbortConfirmed** (tag 5), 24 bytes: reservation id (16), frames sent
//! u64.
//!
//! **Revoke** (tag 6), 16 bytes: reservation id.
//!
//! A connection opens with three messages (the mesh-authentication
//! handshake of `kvmesh_meshauth::kv`; proofs are HMAC-SHA256 under the
//! per-mesh secret, nonces 32 random bytes, never all zeros):
//!
//! **Challenge** (tag 9), 32 bytes: the decode node's nonce, fresh per
//! connection, the first message on it.
//!
//! **Hello** (tag 7), 80 bytes: writer id (16), the writer's nonce (32),
//! proof (32) over the challenge, the writer's nonce and the writer id. The
//! first message a prefill node sends; anything else first, or a proof
//! that does not verify, closes the connection before any of it is read
//! further (counted by kind). The id is minted once per writer process, so
//! a restarted writer is a new writer and grants bound to the old one never
//! work for it.
//!
//! **Welcome** (tag 8), 48 bytes + path: the decode node's answer to a
//! valid Hello: proof (32) over the writer's nonce, the challenge, the
//! writer id and the bytes after the proof; then data path u8 (1 = frames
//! on this connection, checked by the receiver; 2 = one-sided writes into
//! a shared-memory mapping), reserved u8 = 0, path length u16, geometry
//! (12), then the mapping's path (UTF-8; empty for data path 1, non-empty
//! for 2). A writer whose check of the proof fails hangs up.
//!
//! # Version policy
//!
//! A receiver refuses any version it does not know
//! ([`WireError::UnsupportedVersion`]); it never guesses at a layout.
//! Changing the layout or meaning of any existing message (a field, its
//! size, the checksum algorithm) bumps [`VERSION`]. Adding a message type
//! bumps nothing: it gets a new tag, and an older receiver refuses it as
//! [`WireError::UnknownType`] (the header still says how long it is, so a
//! stream can skip it). Tags are never reused. New abort reason and dtype
//! codes are additions too; unknown dtypes are refused, unknown abort
//! reasons are honoured. History: version 2 added the proofs to Hello and
//! Welcome (and the Challenge before them); version 3 added the Grant's
//! `cached_tokens` (the decode node's prefix-cache hit); version 4 added
//! the first token's report to TransferDone; older peers are refused.
//!
//! # What is authenticated
//!
//! The [`Capability`] (256 random bits, minted by the decode node with the
//! grant) authorises writes into that one grant's pages and is shown by
//! every frame and `TransferDone`; [`Grant::check_frame`] compares it in
//! constant time, along with the reservation, geometry, page id, generation
//! and slot range. On top of it the decode node binds each reservation to
//! the transport connection of the writer named at reserve time and
//! accepts frames, `TransferDone` and `AbortConfirmed` (which carries no
//! capability: the writer may never have seen the grant) only on that
//! connection. Who may open a connection to a pool at all is the
//! per-connection mesh authentication above (Challenge, Hello, Welcome):
//! only a peer that holds the mesh secret gets past Hello. Messages after
//! the handshake carry no MAC: integrity against an attacker on the path
//! is mutual TLS's, which wraps every TCP KV connection when the mesh file
//! names certificates (`mesh.tls`). The checksum only detects corruption.
//!
//! # Checksum
//!
//! xxh3-64, chosen by `cargo bench -p kvmesh-kvwire --bench checksum`:
//! tied with CRC-32C (SSE4.2) on page- and layer-sized data in cache (about
//! 22 GB/s each here), CRC-32C about 15% ahead on data from memory, xxh3
//! 2-4x ahead on control messages and 2x ahead on cached pages in an AVX2
//! build; the tie goes to xxh3 for its 64-bit value. Numbers, reasoning and
//! the price paid in [`checksum`](mod@checksum).
//!
//! # Files
//! - `codec`: field readers and writers, the envelope.
//! - [`ids`]: ids and the capability (I8).
//! - [`first`]: the first token's report inside TransferDone.
//! - [`geometry`]: the page shape on the wire.
//! - [`frame`]: [`KvFrame`]. [`grant`]: [`Grant`] and the frame check.
//!   [`control`]: the other control messages.
//! - [`checksum`](mod@checksum): the checksum, its measurement, the page checksum.
//! - [`error`]: [`WireError`], [`FrameReject`], [`RejectCounters`].

#![deny(missing_docs)]

mod codec;

pub mod checksum;
pub mod control;
pub mod error;
pub mod first;
pub mod frame;
pub mod geometry;
pub mod grant;
pub mod ids;

#[cfg(test)]
mod tests;

pub use checksum::{checksum, page_checksum, Checksummer};
pub use control::{
    Abort, AbortConfirmed, AbortReason, Challenge, DataPath, Hello, Revoke, TransferDone, Welcome,
    NONCE_LEN, PROOF_LEN,
};
pub use error::{FrameReject, RejectCounters, WireError, REJECT_KINDS};
pub use first::{FirstToken, PromptScore, TokenLogprobs};
pub use frame::{encode_values, f16s_from_le, f32s_from_le, f32s_to_le, KvFrame, LayerKv};
pub use geometry::{Dtype, Geometry};
pub use grant::Grant;
pub use ids::{Capability, MintError, RequestId, ReservationId, TransferId, WriterId};
pub use kvmesh_kernels::KvEntry;

/// The first four bytes of every message.
pub const MAGIC: [u8; 4] = *b"KVMW";
/// The one version this build speaks. Version 2: Hello and Welcome carry
/// the mesh-authentication proofs, after a Challenge (tag 9); version 3:
/// the Grant's `cached_tokens`; version 4: TransferDone's first-token
/// report ([`FirstToken`]).
pub const VERSION: u16 = 4;
/// Bytes of the header: magic, version, type, body length.
pub const HEADER_LEN: usize = 12;
/// Bytes of the trailer: the checksum.
pub const TRAILER_LEN: usize = 8;
/// Default [`DecodeLimits::max_message_bytes`]: 16 MiB, a whole-page frame
/// of a model with a 10 MiB f32 page (80 layers, 8 KV heads of 128, 16
/// slots) with room to spare, and a grant of about a million pages.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The message types and their stable tags. Tags are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MessageType {
    /// KV data, tag 1.
    KvFrame,
    /// Tag 2.
    Grant,
    /// Tag 3.
    TransferDone,
    /// Tag 4.
    Abort,
    /// Tag 5.
    AbortConfirmed,
    /// Tag 6.
    Revoke,
    /// Tag 7.
    Hello,
    /// Tag 8.
    Welcome,
    /// Tag 9.
    Challenge,
}

impl MessageType {
    /// Every type, in tag order.
    pub const ALL: [Self; 9] = [
        Self::KvFrame,
        Self::Grant,
        Self::TransferDone,
        Self::Abort,
        Self::AbortConfirmed,
        Self::Revoke,
        Self::Hello,
        Self::Welcome,
        Self::Challenge,
    ];

    /// The tag on the wire.
    pub fn tag(self) -> u16 {
        match self {
            Self::KvFrame => 1,
            Self::Grant => 2,
            Self::TransferDone => 3,
            Self::Abort => 4,
            Self::AbortConfirmed => 5,
            Self::Revoke => 6,
            Self::Hello => 7,
            Self::Welcome => 8,
            Self::Challenge => 9,
        }
    }

    /// The type of a tag; [`WireError::UnknownType`] for tags this build
    /// does not know.
    pub fn from_tag(tag: u16) -> Result<Self, WireError> {
        Self::ALL
            .into_iter()
            .find(|t| t.tag() == tag)
            .ok_or(WireError::UnknownType { tag })
    }
}

/// A receiver's bounds on what it decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest whole message (header, body, trailer) accepted; a header
    /// declaring more is refused as [`WireError::TooLarge`] before anything
    /// else is read. Senders size frames (layer ranges) to fit the peer's
    /// limit.
    pub max_message_bytes: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

/// A decoded message. Frames borrow their payload from the input.
#[derive(Clone, Debug, PartialEq)]
pub enum Message<'a> {
    /// KV data.
    KvFrame(KvFrame<'a>),
    /// Decode node's grant.
    Grant(Grant),
    /// Prefill's completion report.
    TransferDone(TransferDone),
    /// Stop work on a reservation.
    Abort(Abort),
    /// Prefill stopped writing.
    AbortConfirmed(AbortConfirmed),
    /// Write right withdrawn.
    Revoke(Revoke),
    /// A writer opens a transport connection.
    Hello(Hello),
    /// The decode node's answer: how writes reach its pool.
    Welcome(Welcome),
    /// The decode node opens a transport connection with a nonce.
    Challenge(Challenge),
}

impl Message<'_> {
    /// The type of this message.
    pub fn message_type(&self) -> MessageType {
        match self {
            Self::KvFrame(_) => MessageType::KvFrame,
            Self::Grant(_) => MessageType::Grant,
            Self::TransferDone(_) => MessageType::TransferDone,
            Self::Abort(_) => MessageType::Abort,
            Self::AbortConfirmed(_) => MessageType::AbortConfirmed,
            Self::Revoke(_) => MessageType::Revoke,
            Self::Hello(_) => MessageType::Hello,
            Self::Welcome(_) => MessageType::Welcome,
            Self::Challenge(_) => MessageType::Challenge,
        }
    }

    /// The reservation the message names (connection messages name none).
    pub fn reservation(&self) -> Option<ReservationId> {
        match self {
            Self::KvFrame(m) => Some(m.reservation),
            Self::Grant(m) => Some(m.reservation),
            Self::TransferDone(m) => Some(m.reservation),
            Self::Abort(m) => Some(m.reservation),
            Self::AbortConfirmed(m) => Some(m.reservation),
            Self::Revoke(m) => Some(m.reservation),
            Self::Hello(_) | Self::Welcome(_) | Self::Challenge(_) => None,
        }
    }

    /// Appends the encoded message to `out`; returns the bytes appended. On
    /// error (a message the decoder would refuse) nothing is appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        match self {
            Self::KvFrame(m) => m.encode(out),
            Self::Grant(m) => m.encode(out),
            Self::TransferDone(m) => m.encode(out),
            Self::Abort(m) => m.encode(out),
            Self::AbortConfirmed(m) => m.encode(out),
            Self::Revoke(m) => m.encode(out),
            Self::Hello(m) => m.encode(out),
            Self::Welcome(m) => m.encode(out),
            Self::Challenge(m) => m.encode(out),
        }
    }
}

/// A checked header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The version, always [`VERSION`] once checked.
    pub version: u16,
    /// The type tag, not yet checked against [`MessageType`] (so a stream
    /// can skip a type it does not know).
    pub tag: u16,
    /// Body bytes.
    pub body_len: u32,
}

impl Header {
    /// Bytes of the whole message: header, body, trailer.
    pub fn message_len(&self) -> usize {
        (HEADER_LEN + TRAILER_LEN).saturating_add(self.body_len as usize)
    }
}

/// Reads and checks the header at the start of `bytes`: magic, version,
/// and declared size against `limits`. For stream readers: read
/// [`HEADER_LEN`] bytes, call this, then read exactly
/// [`Header::message_len`] bytes in all, a bounded amount.
pub fn peek_header(bytes: &[u8], limits: &DecodeLimits) -> Result<Header, WireError> {
    let head = bytes.get(..HEADER_LEN).ok_or(WireError::Truncated {
        needed: HEADER_LEN,
        got: bytes.len(),
    })?;
    let mut r = codec::Reader::new(head);
    let magic: [u8; 4] = r.array("magic")?;
    if magic != MAGIC {
        return Err(WireError::BadMagic { got: magic });
    }
    let version = r.u16("version")?;
    if version != VERSION {
        return Err(WireError::UnsupportedVersion {
            got: version,
            supported: VERSION,
        });
    }
    let tag = r.u16("type")?;
    let body_len = r.u32("body_len")?;
    let len = (HEADER_LEN + TRAILER_LEN) as u64 + u64::from(body_len);
    if len > limits.max_message_bytes as u64 {
        return Err(WireError::TooLarge {
            len,
            max: limits.max_message_bytes as u64,
        });
    }
    Ok(Header {
        version,
        tag,
        body_len,
    })
}

/// Decodes the message at the start of `bytes`; returns it and the bytes it
/// used (bytes after it are left for the next call). Checks, in order:
/// header ([`peek_header`]), type tag, that the whole message is present,
/// the checksum, then every field of the body. Never panics.
pub fn decode<'a>(
    bytes: &'a [u8],
    limits: &DecodeLimits,
) -> Result<(Message<'a>, usize), WireError> {
    let header = peek_header(bytes, limits)?;
    let ty = MessageType::from_tag(header.tag)?;
    let len = header.message_len();
    let msg = bytes.get(..len).ok_or(WireError::Truncated {
        needed: len,
        got: bytes.len(),
    })?;
    let (covered, trailer) =
        msg.split_at_checked(len - TRAILER_LEN)
            .ok_or(WireError::Truncated {
                needed: len,
                got: bytes.len(),
            })?;
    let declared = codec::Reader::new(trailer).u64("checksum")?;
    let computed = checksum(covered);
    if declared != computed {
        return Err(WireError::BadChecksum { declared, computed });
    }
    let body = covered.get(HEADER_LEN..).unwrap_or_default();
    let message = match ty {
        MessageType::KvFrame => Message::KvFrame(KvFrame::decode_body(body)?),
        MessageType::Grant => Message::Grant(Grant::decode_body(body)?),
        MessageType::TransferDone => Message::TransferDone(TransferDone::decode_body(body)?),
        MessageType::Abort => Message::Abort(Abort::decode_body(body)?),
        MessageType::AbortConfirmed => Message::AbortConfirmed(AbortConfirmed::decode_body(body)?),
        MessageType::Revoke => Message::Revoke(Revoke::decode_body(body)?),
        MessageType::Hello => Message::Hello(Hello::decode_body(body)?),
        MessageType::Welcome => Message::Welcome(Welcome::decode_body(body)?),
        MessageType::Challenge => Message::Challenge(Challenge::decode_body(body)?),
    };
    Ok((message, len))
}

/// [`decode`] with [`DecodeLimits::default`]: the entry point for fuzzing.
pub fn decode_message(bytes: &[u8]) -> Result<(Message<'_>, usize), WireError> {
    decode(bytes, &DecodeLimits::default())
}
