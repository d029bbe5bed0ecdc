//! Shared by the targets: turning arbitrary bytes into a message envelope
//! whose length and checksum are right, so the fuzzer explores the body
//! parsers instead of stopping at the checksum (which no mutation passes).

use kvmesh_kvwire::{checksum, HEADER_LEN, TRAILER_LEN, VERSION};

/// `bytes` with the header's body length set to span them all and the
/// trailer set to their checksum; `None` if too short for an envelope.
pub fn reseal(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < HEADER_LEN + TRAILER_LEN {
        return None;
    }
    let mut m = bytes.to_vec();
    m[..4].copy_from_slice(b"KVMW");
    m[4..6].copy_from_slice(&VERSION.to_le_bytes());
    let body = u32::try_from(m.len() - HEADER_LEN - TRAILER_LEN).ok()?;
    m[8..12].copy_from_slice(&body.to_le_bytes());
    let end = m.len() - TRAILER_LEN;
    let sum = checksum(&m[..end]);
    m[end..].copy_from_slice(&sum.to_le_bytes());
    Some(m)
}

/// Splits `data` into chunks, each prefixed by a u16 length.
#[allow(dead_code)] // used by control_handlers, not wire_decode
pub fn chunks(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while data.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([data[0], data[1]]));
        let take = n.min(data.len() - 2);
        out.push(&data[2..2 + take]);
        data = &data[2 + take..];
    }
    out
}
