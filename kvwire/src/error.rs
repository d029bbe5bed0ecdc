//! Why a message or a frame was refused, and the counters of refusals.
//!
//! Two layers: [`WireError`] is what the decoder refuses (the bytes are not a
//! well-formed message of a version this build knows); [`FrameReject`] is
//! what a receiver refuses after decoding (a well-formed frame that names a
//! reservation it does not hold, shows the wrong capability, or points at a
//! page or generation outside the grant). Neither ever touches a page.
//! Every refusal is counted in [`RejectCounters`] under its `kind()`.

use kvmesh_counters::KindCounters;

use thiserror::Error;

use super::geometry::Geometry;
use super::ids::ReservationId;

/// Bytes that are not a well-formed message this build accepts.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WireError {
    /// The first four bytes are not [`super::MAGIC`].
    #[error("bad magic {got:02x?}: not a kvmesh wire message")]
    BadMagic {
        /// The four bytes found.
        got: [u8; 4],
    },
    /// A version this build does not know; it refuses rather than guess.
    #[error("unsupported wire version {got}: this build speaks version {supported}")]
    UnsupportedVersion {
        /// Version in the header.
        got: u16,
        /// The version this build speaks.
        supported: u16,
    },
    /// A message type tag this build does not know.
    #[error("unknown message type tag {tag}")]
    UnknownType {
        /// Tag in the header.
        tag: u16,
    },
    /// The input ends before the message does: not an error on a stream
    /// (read more, up to `needed` bytes in all), an error on a datagram.
    #[error("truncated: the message needs {needed} bytes, {got} available")]
    Truncated {
        /// Bytes needed (the whole message once the header is readable).
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A length or count disagrees with the body or with the geometry.
    #[error(
        "length mismatch in {field}: declared {declared}, the rest of the message implies {actual}"
    )]
    LengthMismatch {
        /// The field whose length is wrong.
        field: &'static str,
        /// What the message declares (a length field or the body's size).
        declared: u64,
        /// What the rest of the message implies.
        actual: u64,
    },
    /// The declared length exceeds the receiver's limit; nothing is read
    /// or allocated past the header.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Bytes the header declares (header, body and trailer).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The trailer checksum does not match the bytes it covers.
    #[error("bad checksum: trailer says {declared:#018x}, the bytes give {computed:#018x}")]
    BadChecksum {
        /// Checksum in the trailer.
        declared: u64,
        /// Checksum computed over header and body.
        computed: u64,
    },
    /// A field holds a value no valid message has.
    #[error("invalid {field} = {value}: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value (a length for variable-size fields).
        value: u64,
        /// Why it is refused.
        reason: &'static str,
    },
}

impl WireError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        REJECT_KINDS[wire_index(self)]
    }
}

/// A well-formed frame that the grant it names does not authorise.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FrameReject {
    /// No live grant has this reservation id (never granted, already ended,
    /// or a frame for another grant).
    #[error("unknown reservation {got}")]
    UnknownReservation {
        /// Reservation the frame names.
        got: ReservationId,
    },
    /// The capability is not the grant's: the writer is not authorised.
    #[error("bad capability for reservation {reservation}")]
    BadCapability {
        /// Reservation the frame names.
        reservation: ReservationId,
    },
    /// The frame's page shape is not the grant's.
    #[error("geometry mismatch: the grant has {expected:?}, the frame {got:?}")]
    GeometryMismatch {
        /// The grant's geometry.
        expected: Geometry,
        /// The frame's.
        got: Geometry,
    },
    /// The logical page index is past the grant's page list.
    #[error("page index {index} is outside the grant's {n_pages} pages")]
    PageOutOfGrant {
        /// Logical index in the frame.
        index: u32,
        /// Pages in the grant.
        n_pages: usize,
    },
    /// The physical page differs from the grant's page at that index.
    #[error("page index {index} is page {expected} in the grant, the frame says {got}")]
    WrongPage {
        /// Logical index.
        index: u32,
        /// Physical page the grant lists there.
        expected: u32,
        /// Physical page the frame names.
        got: u32,
    },
    /// Right page, wrong generation: a frame from an earlier (or forged)
    /// reservation of the same physical page.
    #[error("stale generation for page {page}: granted {expected}, the frame says {got}")]
    StaleGeneration {
        /// Physical page.
        page: u32,
        /// Generation in the grant.
        expected: u64,
        /// Generation in the frame.
        got: u64,
    },
    /// The slots reach past the prompt's slots in that page: nobody may
    /// write decode slots (or slots of no token) through a transfer.
    #[error(
        "page index {index}: slots up to {end} exceed the {prompt_slots} prompt slots of that page"
    )]
    SlotsOutOfPrompt {
        /// Logical index.
        index: u32,
        /// End of the frame's slot range.
        end: u32,
        /// Prompt slots the grant covers in that page.
        prompt_slots: u32,
    },
}

impl FrameReject {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        REJECT_KINDS[frame_index(self)]
    }
}

/// Every [`WireError::kind`] then every [`FrameReject::kind`], in the order of
/// [`RejectCounters::by_kind`].
pub const REJECT_KINDS: [&str; 15] = [
    "bad_magic",
    "unsupported_version",
    "unknown_type",
    "truncated",
    "length_mismatch",
    "too_large",
    "bad_checksum",
    "invalid_field",
    "unknown_reservation",
    "bad_capability",
    "geometry_mismatch",
    "page_out_of_grant",
    "wrong_page",
    "stale_generation",
    "slots_out_of_prompt",
];

/// Exhaustive, so a new variant fails to compile instead of going uncounted.
fn wire_index(e: &WireError) -> usize {
    match e {
        WireError::BadMagic { .. } => 0,
        WireError::UnsupportedVersion { .. } => 1,
        WireError::UnknownType { .. } => 2,
        WireError::Truncated { .. } => 3,
        WireError::LengthMismatch { .. } => 4,
        WireError::TooLarge { .. } => 5,
        WireError::BadChecksum { .. } => 6,
        WireError::InvalidField { .. } => 7,
    }
}

fn frame_index(r: &FrameReject) -> usize {
    match r {
        FrameReject::UnknownReservation { .. } => 8,
        FrameReject::BadCapability { .. } => 9,
        FrameReject::GeometryMismatch { .. } => 10,
        FrameReject::PageOutOfGrant { .. } => 11,
        FrameReject::WrongPage { .. } => 12,
        FrameReject::StaleGeneration { .. } => 13,
        FrameReject::SlotsOutOfPrompt { .. } => 14,
    }
}

/// Refusals by kind, lock-free so a receive loop never blocks on them. A
/// receiver keeps one and records every message or frame it refuses.
#[derive(Debug, Default)]
pub struct RejectCounters(KindCounters<{ REJECT_KINDS.len() }>);

impl RejectCounters {
    /// Counts one message the decoder refused.
    pub fn record_wire(&self, e: &WireError) {
        self.0.bump(wire_index(e));
    }

    /// Counts one frame its grant did not authorise.
    pub fn record_frame(&self, r: &FrameReject) {
        self.0.bump(frame_index(r));
    }

    /// Refusals of all kinds.
    pub fn total(&self) -> u64 {
        self.0.total()
    }

    /// Refusals of one kind (0 for a name that is not a kind).
    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(&REJECT_KINDS, kind)
    }

    /// Every kind with its count, zeros included, in [`REJECT_KINDS`] order.
    /// Each count is read atomically, the array as a whole is not.
    pub fn by_kind(&self) -> [(&'static str, u64); REJECT_KINDS.len()] {
        self.0.by_kind(&REJECT_KINDS)
    }
}
