//! Control messages after the grant: transfer done, abort, abort confirmed,
//! revoke.

use std::fmt;

use super::codec::{fit, seal, Put, Reader};
use super::error::WireError;
use super::ids::{Capability, ReservationId, CAPABILITY_LEN};
use super::{MessageType, HEADER_LEN, TRAILER_LEN};

/// Bytes of a `TransferDone` body before the checksum list.
pub const TRANSFER_DONE_FIXED_LEN: usize = 16 + CAPABILITY_LEN + 8 + 4 + 4;

/// Prefill to decode: every frame of the grant is sent. The decode node
/// starts the sequence only if this matches the grant exactly (I4): as many
/// checksums as granted pages, `tokens_written` equal to the grant's
/// `prompt_tokens`, and each checksum equal to
/// [`super::page_checksum`] of the page as it landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferDone {
    /// The reservation written.
    pub reservation: ReservationId,
    /// The grant's capability.
    pub capability: Capability,
    /// Prompt tokens written: positions `0..tokens_written`.
    pub tokens_written: u64,
    /// The first token prefill sampled from the last prompt position.
    pub first_token: u32,
    /// [`super::page_checksum`] of each written page, in the grant's page
    /// order; its length is the number of pages written.
    pub page_checksums: Vec<u64>,
}

impl TransferDone {
    /// Pages written: the length of [`TransferDone::page_checksums`].
    pub fn pages_written(&self) -> usize {
        self.page_checksums.len()
    }

    /// Bytes this message takes on the wire.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN + self.body_len() + TRAILER_LEN
    }

    fn body_len(&self) -> usize {
        TRANSFER_DONE_FIXED_LEN + self.page_checksums.len().saturating_mul(8)
    }

    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        let n: u32 = fit(self.page_checksums.len(), "pages_written")?;
        seal(MessageType::TransferDone, self.body_len(), out, |o| {
            o.put_id(&self.reservation);
            o.put_capability(&self.capability);
            o.put_u64(self.tokens_written);
            o.put_u32(self.first_token);
            o.put_u32(n);
            for &c in &self.page_checksums {
                o.put_u64(c);
            }
        })
    }

    /// Decodes the body; the checksum list is allocated only after its
    /// declared length is checked against the bytes present.
    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let reservation = r.id("reservation")?;
        let capability = r.capability()?;
        let tokens_written = r.u64("tokens_written")?;
        let first_token = r.u32("first_token")?;
        let n = r.u32("pages_written")? as usize;
        if n.checked_mul(8) != Some(r.remaining()) {
            return Err(WireError::LengthMismatch {
                field: "pages_written",
                declared: n as u64,
                actual: (r.remaining() / 8) as u64,
            });
        }
        let mut page_checksums = Vec::with_capacity(n);
        for _ in 0..n {
            page_checksums.push(r.u64("page_checksums")?);
        }
        r.finish("transfer_done")?;
        Ok(Self {
            reservation,
            capability,
            tokens_written,
            first_token,
            page_checksums,
        })
    }
}

/// Why a reservation is aborted. A code this build does not name still
/// aborts: an abort is never refused for its reason (dropping one would
/// leave pages held until the lease runs out), so new codes need no version
/// bump.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AbortReason(pub u16);

impl AbortReason {
    /// The client went away.
    pub const CLIENT_GONE: Self = Self(1);
    /// Prefill failed (compute error, refused the grant, crashed).
    pub const PREFILL_FAILED: Self = Self(2);
    /// Decode failed or refused the transfer (I4 check failed).
    pub const DECODE_FAILED: Self = Self(3);
    /// A node is shutting down.
    pub const SHUTDOWN: Self = Self(4);
    /// The grant's lease ran out.
    pub const LEASE_EXPIRED: Self = Self(5);
    /// The router cancelled for another reason (deadline, admin).
    pub const CANCELLED: Self = Self(6);

    /// A stable name, for logs and metric labels; `"unknown"` for codes
    /// this build does not name.
    pub fn name(self) -> &'static str {
        match self.0 {
            1 => "client_gone",
            2 => "prefill_failed",
            3 => "decode_failed",
            4 => "shutdown",
            5 => "lease_expired",
            6 => "cancelled",
            _ => "unknown",
        }
    }
}

impl fmt::Debug for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AbortReason({}: {})", self.0, self.name())
    }
}

/// Router to prefill and decode: stop work on this reservation. Prefill
/// answers with [`AbortConfirmed`] once nothing of it is in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The reservation to abort.
    pub reservation: ReservationId,
    /// Why.
    pub reason: AbortReason,
}

/// Prefill to decode: prefill has stopped writing this grant and nothing it
/// sent is still in flight; the pages may be released (I5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortConfirmed {
    /// The reservation.
    pub reservation: ReservationId,
    /// The grant's capability: only the writer can confirm it has stopped.
    pub capability: Capability,
    /// Frames prefill sent for this grant, all told; the receiver can check
    /// it has seen (accepted or refused) that many before releasing.
    pub frames_sent: u64,
}

/// Decode to prefill (or router to prefill): the right to write this grant
/// is withdrawn; any further frame for it is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revoke {
    /// The reservation revoked.
    pub reservation: ReservationId,
}

/// Body sizes of the fixed-size control messages.
pub const ABORT_LEN: usize = 16 + 2;
/// See [`ABORT_LEN`].
pub const ABORT_CONFIRMED_LEN: usize = 16 + CAPABILITY_LEN + 8;
/// See [`ABORT_LEN`].
pub const REVOKE_LEN: usize = 16;

impl Abort {
    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        seal(MessageType::Abort, ABORT_LEN, out, |o| {
            o.put_id(&self.reservation);
            o.put_u16(self.reason.0);
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            reservation: r.id("reservation")?,
            reason: AbortReason(r.u16("reason")?),
        };
        r.finish("abort")?;
        Ok(m)
    }
}

impl AbortConfirmed {
    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        seal(MessageType::AbortConfirmed, ABORT_CONFIRMED_LEN, out, |o| {
            o.put_id(&self.reservation);
            o.put_capability(&self.capability);
            o.put_u64(self.frames_sent);
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            reservation: r.id("reservation")?,
            capability: r.capability()?,
            frames_sent: r.u64("frames_sent")?,
        };
        r.finish("abort_confirmed")?;
        Ok(m)
    }
}

impl Revoke {
    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        seal(MessageType::Revoke, REVOKE_LEN, out, |o| {
            o.put_id(&self.reservation)
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            reservation: r.id("reservation")?,
        };
        r.finish("revoke")?;
        Ok(m)
    }
}
