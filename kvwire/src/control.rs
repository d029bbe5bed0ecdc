//! Control messages after the grant: transfer done, abort, abort confirmed,
//! revoke; and the three that open a transport connection: challenge,
//! hello and welcome (the mesh-authentication handshake, `kvmesh_meshauth::kv`).

use std::fmt;

use super::codec::{fit, seal, Put, Reader};
use super::error::WireError;
use super::first::{FirstToken, FIRST_TOKEN_REPORT_MIN_LEN};
use super::geometry::{Geometry, GEOMETRY_LEN};
use super::ids::{Capability, ReservationId, WriterId, CAPABILITY_LEN};
use super::{MessageType, HEADER_LEN, TRAILER_LEN};

/// Bytes of a `TransferDone` body before the checksum list.
pub const TRANSFER_DONE_FIXED_LEN: usize = 16 + CAPABILITY_LEN + 8 + 4 + 4;

/// Prefill to decode: every frame of the grant is sent. The decode node
/// starts the sequence only if this matches the grant exactly (I4): as many
/// checksums as granted pages, `tokens_written` equal to the grant's
/// `prompt_tokens`, and each checksum equal to
/// [`super::page_checksum`] of the page as it landed.
///
/// It also carries the first token and prefill's report on it
/// ([`FirstToken`]): the decode node hands that to the router on its token
/// stream once the transfer is verified, so whatever the router needs about
/// the first token travels with it.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferDone {
    /// The reservation written.
    pub reservation: ReservationId,
    /// The grant's capability.
    pub capability: Capability,
    /// Prompt tokens written: positions `0..tokens_written`.
    pub tokens_written: u64,
    /// The first token prefill sampled from the last prompt position, and
    /// its report (before the checksums on the wire).
    pub first: FirstToken,
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
        TRANSFER_DONE_FIXED_LEN
            .saturating_add(self.page_checksums.len().saturating_mul(8))
            .saturating_add(self.first.report_len())
    }

    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        let n: u32 = fit(self.page_checksums.len(), "pages_written")?;
        self.first.check()?;
        seal(MessageType::TransferDone, self.body_len(), out, |o| {
            o.put_id(&self.reservation);
            o.put_capability(&self.capability);
            o.put_u64(self.tokens_written);
            o.put_u32(self.first.id);
            o.put_u32(n);
            self.first.put_report(o);
            for &c in &self.page_checksums {
                o.put_u64(c);
            }
        })
    }

    /// Decodes the body. The checksum list ends it, so its declared
    /// length must match the bytes left exactly; it is bounded before the
    /// report's lists are read and checked exactly after, so nothing is
    /// allocated for a body that cannot hold what it declares.
    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let reservation = r.id("reservation")?;
        let capability = r.capability()?;
        let tokens_written = r.u64("tokens_written")?;
        let first_token = r.u32("first_token")?;
        let n = r.u32("pages_written")? as usize;
        let sums = n.checked_mul(8);
        let mismatch = |remaining: usize| WireError::LengthMismatch {
            field: "pages_written",
            declared: n as u64,
            actual: (remaining / 8) as u64,
        };
        if sums.is_none_or(|b| b > r.remaining().saturating_sub(FIRST_TOKEN_REPORT_MIN_LEN)) {
            return Err(mismatch(r.remaining()));
        }
        let first = FirstToken::read_report(first_token, &mut r)?;
        if sums != Some(r.remaining()) {
            return Err(mismatch(r.remaining()));
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
            first,
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

/// Decode to prefill (on the transport connection the reservation is bound
/// to): stop work on this reservation. Prefill answers with
/// [`AbortConfirmed`] once nothing of it is in flight, whatever it knows of
/// the reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Abort {
    /// The reservation to abort.
    pub reservation: ReservationId,
    /// Why.
    pub reason: AbortReason,
}

/// Prefill to decode: prefill has stopped writing this grant and nothing it
/// sent is still in flight; the pages may be released (I5).
///
/// It carries no capability: a writer must confirm an abort even for a
/// grant it never received (the abort overtook the grant), so it may not
/// know the secret. Its authority is the connection: the decode node binds
/// every reservation to one writer's connection when it grants, and accepts
/// a confirmation only on that connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortConfirmed {
    /// The reservation.
    pub reservation: ReservationId,
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
pub const ABORT_CONFIRMED_LEN: usize = 16 + 8;
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
            o.put_u64(self.frames_sent);
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            reservation: r.id("reservation")?,
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

/// Bytes of a handshake nonce ([`Challenge`], [`Hello`]).
pub const NONCE_LEN: usize = 32;
/// Bytes of a handshake proof (HMAC-SHA256; see `kvmesh_meshauth::kv`).
pub const PROOF_LEN: usize = 32;

/// Decode to writer, first on a transport connection: a fresh nonce the
/// writer's [`Hello`] must prove knowledge of the mesh secret over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Random, minted per connection; never all zeros.
    pub nonce: [u8; NONCE_LEN],
}

/// Writer to decode, the answer to [`Challenge`]: who is writing, and the
/// proof that it belongs to this mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The writer process's id, minted at its start.
    pub writer: WriterId,
    /// The writer's own fresh nonce, which the [`Welcome`]'s proof covers;
    /// never all zeros.
    pub nonce: [u8; NONCE_LEN],
    /// HMAC of the mesh secret over the challenge, `nonce` and `writer`.
    pub proof: [u8; PROOF_LEN],
}

/// How a writer's KV data reaches the decode node's pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataPath {
    /// `KvFrame`s on the same connection; the receiver checks each one
    /// against its grant before it lands (TCP). Code 1.
    Frames,
    /// One-sided writes into the pool's shared-memory mapping at this
    /// path, gated per grant by the grant's write key (`kvmesh_kvxfer::shm`).
    /// Code 2.
    SharedMemory {
        /// The mapping's file.
        path: String,
    },
    /// One-sided puts through UCX into the pool's registered region,
    /// through an endpoint bound to the grant's write key
    /// (`kvmesh_kvxfer::transport::ucx`). Code 3. The detail bytes are
    /// `base u64, len u64, address length u16, address (UTF-8), rkey`.
    Ucx {
        /// The decode node's UCX listener, `IP:PORT`; an unspecified IP
        /// means the host the writer dialled for this connection.
        address: String,
        /// The region's address in the decode process.
        base: u64,
        /// The region's size in bytes.
        len: u64,
        /// The packed remote key (`ucp_rkey_pack`); empty when the region
        /// is not registered for remote write (no RDMA device at the
        /// decode node): the writer then sends data messages only.
        rkey: Vec<u8>,
    },
}

/// Decode to writer, the answer to a valid [`Hello`]: the decode node's
/// proof that it belongs to the same mesh, the data path and the shape of
/// the pool's pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// HMAC of the mesh secret over both nonces, the writer and the fields
    /// below ([`Welcome::signed_fields`]).
    pub proof: [u8; PROOF_LEN],
    /// How frames travel.
    pub data_path: DataPath,
    /// The pool's page shape; every grant on this connection has it.
    pub geometry: Geometry,
}

/// Body size of [`Challenge`].
pub const CHALLENGE_LEN: usize = NONCE_LEN;
/// Body size of [`Hello`].
pub const HELLO_LEN: usize = 16 + NONCE_LEN + PROOF_LEN;
/// Body size of [`Welcome`] before the path.
pub const WELCOME_FIXED_LEN: usize = PROOF_LEN + 1 + 1 + 2 + GEOMETRY_LEN;

fn nonce(r: &mut Reader<'_>, field: &'static str) -> Result<[u8; NONCE_LEN], WireError> {
    let n: [u8; NONCE_LEN] = r.array(field)?;
    if n.iter().all(|&b| b == 0) {
        return Err(WireError::InvalidField {
            field,
            value: 0,
            reason: "all zeros: never minted",
        });
    }
    Ok(n)
}

impl Challenge {
    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        seal(MessageType::Challenge, CHALLENGE_LEN, out, |o| {
            o.extend_from_slice(&self.nonce)
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            nonce: nonce(&mut r, "nonce")?,
        };
        r.finish("challenge")?;
        Ok(m)
    }
}

impl Hello {
    /// Appends the encoded message to `out`; returns the bytes appended.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        seal(MessageType::Hello, HELLO_LEN, out, |o| {
            o.put_id(&self.writer);
            o.extend_from_slice(&self.nonce);
            o.extend_from_slice(&self.proof);
        })
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let m = Self {
            writer: r.id("writer")?,
            nonce: nonce(&mut r, "nonce")?,
            proof: r.array("proof")?,
        };
        r.finish("hello")?;
        Ok(m)
    }
}

impl Welcome {
    /// The data path's code and its detail bytes (the mapping's path, the
    /// UCX description); refused: an empty shared-memory path, a UCX path
    /// without a key or address.
    fn code_and_path(&self) -> Result<(u8, std::borrow::Cow<'_, [u8]>), WireError> {
        use std::borrow::Cow;
        match &self.data_path {
            DataPath::Frames => Ok((1, Cow::Borrowed(&[][..]))),
            DataPath::SharedMemory { path } if !path.is_empty() => {
                Ok((2, Cow::Borrowed(path.as_bytes())))
            }
            DataPath::SharedMemory { .. } => Err(WireError::InvalidField {
                field: "path",
                value: 0,
                reason: "a shared-memory data path names its mapping",
            }),
            DataPath::Ucx {
                address,
                base,
                len,
                rkey,
            } => {
                if address.is_empty() {
                    return Err(WireError::InvalidField {
                        field: "path",
                        value: 0,
                        reason: "a UCX data path has an address",
                    });
                }
                let alen: u16 = fit(address.len(), "path.address")?;
                let mut o = Vec::with_capacity(18 + address.len() + rkey.len());
                o.put_u64(*base);
                o.put_u64(*len);
                o.put_u16(alen);
                o.extend_from_slice(address.as_bytes());
                o.extend_from_slice(rkey);
                Ok((3, Cow::Owned(o)))
            }
        }
    }

    /// Writes the fields after the proof, exactly as on the wire.
    fn put_fields(&self, o: &mut Vec<u8>, code: u8, path: &[u8], path_len: u16) {
        o.put_u8(code);
        o.put_u8(0);
        o.put_u16(path_len);
        self.geometry.put(o);
        o.extend_from_slice(path);
    }

    /// The bytes the proof covers besides the nonces and the writer: the
    /// fields after the proof as they are encoded (for a Welcome that does
    /// not encode, its geometry and data path in the same layout, so the
    /// proof still differs from any valid one).
    pub fn signed_fields(&self) -> Vec<u8> {
        let (code, path) = self
            .code_and_path()
            .unwrap_or((0, std::borrow::Cow::Borrowed(&[][..])));
        let path_len = u16::try_from(path.len()).unwrap_or(u16::MAX);
        let mut o = Vec::with_capacity(WELCOME_FIXED_LEN - PROOF_LEN + path.len());
        self.put_fields(&mut o, code, &path, path_len);
        o
    }

    /// Appends the encoded message to `out`; returns the bytes appended.
    /// Refused: an invalid geometry, an empty shared-memory path, a path
    /// over 65,535 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<usize, WireError> {
        self.geometry.validate()?;
        let (code, path) = self.code_and_path()?;
        let path_len: u16 = fit(path.len(), "path")?;
        seal(
            MessageType::Welcome,
            WELCOME_FIXED_LEN + path.len(),
            out,
            |o| {
                o.extend_from_slice(&self.proof);
                self.put_fields(o, code, &path, path_len);
            },
        )
    }

    pub(crate) fn decode_body(body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let proof = r.array("proof")?;
        let code = r.u8("data_path")?;
        let reserved = r.u8("reserved")?;
        if reserved != 0 {
            return Err(WireError::InvalidField {
                field: "reserved",
                value: reserved.into(),
                reason: "must be 0",
            });
        }
        let path_len = usize::from(r.u16("path")?);
        let geometry = Geometry::read(&mut r)?;
        let path = r.take(path_len, "path")?;
        r.finish("welcome")?;
        let utf8 = |b: &[u8], field: &'static str| {
            std::str::from_utf8(b)
                .map(str::to_owned)
                .map_err(|e| WireError::InvalidField {
                    field,
                    value: e.valid_up_to() as u64,
                    reason: "not UTF-8 (value: bytes of valid prefix)",
                })
        };
        let data_path = match (code, path.is_empty()) {
            (1, true) => DataPath::Frames,
            (2, false) => DataPath::SharedMemory {
                path: utf8(path, "path")?,
            },
            (3, false) => {
                let mut d = Reader::new(path);
                let base = d.u64("path.base")?;
                let len = d.u64("path.len")?;
                let alen = usize::from(d.u16("path.address")?);
                let address = utf8(d.take(alen, "path.address")?, "path.address")?;
                let rkey = d.take(d.remaining(), "path.rkey")?.to_vec();
                if address.is_empty() {
                    return Err(WireError::InvalidField {
                        field: "path",
                        value: path_len as u64,
                        reason: "a UCX data path has an address",
                    });
                }
                DataPath::Ucx {
                    address,
                    base,
                    len,
                    rkey,
                }
            }
            (1..=3, _) => {
                return Err(WireError::InvalidField {
                    field: "path",
                    value: path_len as u64,
                    reason: "frames need no path; shared memory and UCX need one",
                })
            }
            (other, _) => {
                return Err(WireError::InvalidField {
                    field: "data_path",
                    value: other.into(),
                    reason: "unknown data path",
                })
            }
        };
        Ok(Self {
            proof,
            data_path,
            geometry,
        })
    }
}
