//! Little-endian field readers and writers, and the envelope every message
//! shares: header, body, checksum trailer. Every read is bounds-checked and
//! returns an error instead of panicking.

use super::checksum::checksum;
use super::error::WireError;
use super::ids::{Capability, WireId, CAPABILITY_LEN};
use super::{MessageType, HEADER_LEN, MAGIC, TRAILER_LEN, VERSION};

/// A cursor over a message body whose length the header fixed. Running out
/// of body is a [`WireError::LengthMismatch`] (the body is complete, its
/// fields disagree with its length), not `Truncated`.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next `n` bytes, borrowed from the input.
    pub fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end.and_then(|e| self.buf.get(self.pos..e)) {
            Some(s) => {
                self.pos += n;
                Ok(s)
            }
            None => Err(WireError::LengthMismatch {
                field,
                declared: n as u64,
                actual: self.remaining() as u64,
            }),
        }
    }

    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let s = self.take(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A 128-bit id; all zeros is refused (never minted).
    pub fn id<T: WireId>(&mut self, field: &'static str) -> Result<T, WireError> {
        let b: [u8; 16] = self.array(field)?;
        nonzero(&b, field)?;
        Ok(T::from_wire(b))
    }

    /// A capability; all zeros is refused (never minted).
    pub fn capability(&mut self) -> Result<Capability, WireError> {
        let b: [u8; CAPABILITY_LEN] = self.array("capability")?;
        nonzero(&b, "capability")?;
        Ok(Capability::from_wire(b))
    }

    /// Checks the whole body was consumed: trailing bytes are a mismatch
    /// between the declared body length and the fields.
    pub fn finish(self, field: &'static str) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(WireError::LengthMismatch {
                field,
                declared: self.buf.len() as u64,
                actual: (self.buf.len() - extra) as u64,
            }),
        }
    }
}

fn nonzero(b: &[u8], field: &'static str) -> Result<(), WireError> {
    if b.iter().all(|&x| x == 0) {
        return Err(WireError::InvalidField {
            field,
            value: 0,
            reason: "all zeros: never minted",
        });
    }
    Ok(())
}

/// Appending little-endian fields to an output buffer.
pub(crate) trait Put {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    fn put_id<T: WireId>(&mut self, id: &T);
    fn put_capability(&mut self, c: &Capability);
}

impl Put for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_id<T: WireId>(&mut self, id: &T) {
        self.extend_from_slice(&id.wire_bytes());
    }
    fn put_capability(&mut self, c: &Capability) {
        self.extend_from_slice(c.expose());
    }
}

/// A length that must fit a wire field of type `T`.
pub(crate) fn fit<T: TryFrom<usize>>(len: usize, field: &'static str) -> Result<T, WireError> {
    T::try_from(len).map_err(|_| WireError::InvalidField {
        field,
        value: len as u64,
        reason: "too long for its length field",
    })
}

/// Appends one whole message: header, the body `body` writes (exactly
/// `body_len` bytes, which the caller has validated), then the checksum of
/// header and body. Returns the bytes appended. On error nothing is
/// appended.
pub(crate) fn seal(
    ty: MessageType,
    body_len: usize,
    out: &mut Vec<u8>,
    body: impl FnOnce(&mut Vec<u8>),
) -> Result<usize, WireError> {
    let len: u32 = fit(body_len, "body")?;
    let start = out.len();
    out.reserve(HEADER_LEN + body_len + TRAILER_LEN);
    out.extend_from_slice(&MAGIC);
    out.put_u16(VERSION);
    out.put_u16(ty.tag());
    out.put_u32(len);
    body(out);
    debug_assert_eq!(
        out.len() - start,
        HEADER_LEN + body_len,
        "{ty:?} body length"
    );
    let sum = checksum(out.get(start..).unwrap_or_default());
    out.put_u64(sum);
    Ok(out.len() - start)
}
