//! Identities and the write capability (I8).
//!
//! [`ReservationId`], [`RequestId`] and [`TransferId`] are 128-bit values
//! drawn from the OS random number generator by the mesh. The only ways to
//! get one are [`mint`](ReservationId::mint) and decoding a message the mesh
//! sent ([`super::decode`]): there is no `From<[u8; 16]>`, no `FromStr`, no
//! public byte constructor, so nothing a client sends becomes an id by
//! accident. Ids are not secrets: they are printed in full (32 hex digits)
//! and may be logged.
//!
//! A [`Capability`] is a secret: 256 random bits minted with one grant and
//! shown by whoever writes into that grant's pages. Knowing the reservation
//! id is not enough to write. It compares in constant time, does not print
//! (its `Debug` is `Capability(<redacted>)`, and it has no `Display`), and
//! has no `Hash` or `Ord` (both would look at it byte by byte with early
//! exits). Memory holding a dropped capability is not zeroed.
//!
//! All-zero values are never minted (a draw of zeros is redrawn,
//! probability 2^-128) and are refused on decode: zeros on the wire mean an
//! uninitialised buffer at the sender, not an id.

use std::fmt;

use thiserror::Error;

/// The OS random number generator failed; no id was minted. Callers refuse
/// the operation that needed the id (a reservation, a request) with this
/// error rather than continue with a weaker one.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("the OS random number generator failed: {0}")]
pub struct MintError(getrandom::Error);

/// `N` random bytes from the OS, never all zero: what every id, nonce and
/// minted secret of the mesh is made of.
pub fn random_nonzero<const N: usize>() -> Result<[u8; N], MintError> {
    let mut b = [0u8; N];
    loop {
        getrandom::fill(&mut b).map_err(MintError)?;
        if b.iter().any(|&x| x != 0) {
            return Ok(b);
        }
    }
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

/// A 128-bit id as it travels: what the decoder needs to build one and the
/// encoder to write one. Crate-private, so only this crate's decoder can
/// turn bytes into an id.
pub(crate) trait WireId: Sized {
    /// Builds the id from wire bytes (the caller has refused all-zero).
    fn from_wire(bytes: [u8; 16]) -> Self;
    /// The bytes written on the wire.
    fn wire_bytes(&self) -> [u8; 16];
}

macro_rules! id128 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name([u8; 16]);

        impl $name {
            /// A fresh id: 128 bits from the OS random number generator.
            pub fn mint() -> Result<Self, MintError> {
                random_nonzero().map(Self)
            }

            /// The id's bytes, as written on the wire.
            pub fn to_bytes(self) -> [u8; 16] {
                self.0
            }

            /// An id the mesh minted, back from its bytes (as an internal
            /// service carries it); `None` for all zeros, which is never
            /// minted. The gateway never builds one from client input (I8).
            pub fn from_bytes(bytes: [u8; 16]) -> Option<Self> {
                bytes.iter().any(|&b| b != 0).then_some(Self(bytes))
            }
        }

        impl WireId for $name {
            fn from_wire(bytes: [u8; 16]) -> Self {
                Self(bytes)
            }
            fn wire_bytes(&self) -> [u8; 16] {
                self.0
            }
        }

        /// 32 lowercase hex digits, the wire bytes in order.
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self})", stringify!($name))
            }
        }
    };
}

id128! {
    /// Names one reservation of pages on a decode node; minted by the decode
    /// node that owns the pages, when it grants them.
    ReservationId
}

id128! {
    /// Names one client request across the mesh; minted by the router.
    RequestId
}

id128! {
    /// Names one KV transfer (one prefill node writing one grant); minted by
    /// the mesh, never taken from a client.
    TransferId
}

id128! {
    /// Names one writer process (a prefill node's incarnation); minted when
    /// the process starts and sent in `Hello`. Grants are bound to it, so a
    /// restarted writer cannot use grants issued to its predecessor.
    WriterId
}

/// Bytes in a [`Capability`].
pub const CAPABILITY_LEN: usize = 32;

/// The secret that authorises writes into one grant's pages.
///
/// 256 bits: a forger must guess it online, one rejected (and counted) frame
/// per guess, so 128 bits would do against one grant; 256 keeps that margin
/// against guesses spread over many live grants at once, for 16 bytes more
/// per frame.
#[derive(Clone)]
pub struct Capability([u8; CAPABILITY_LEN]);

impl Capability {
    /// A fresh capability from the OS random number generator.
    pub fn mint() -> Result<Self, MintError> {
        random_nonzero().map(Self)
    }

    pub(crate) fn from_wire(bytes: [u8; CAPABILITY_LEN]) -> Self {
        Self(bytes)
    }

    /// The secret, for the encoder only.
    pub(crate) fn expose(&self) -> &[u8; CAPABILITY_LEN] {
        &self.0
    }
}

/// Compares every byte whatever the first difference, so the time taken
/// does not say how much of a guess was right. `black_box` on each step
/// keeps the optimiser from turning the fold into an early exit.
pub(crate) fn ct_eq(a: &[u8; CAPABILITY_LEN], b: &[u8; CAPABILITY_LEN]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff = std::hint::black_box(diff | (x ^ y));
    }
    diff == 0
}

/// Constant time: every byte is compared whatever the first difference.
impl PartialEq for Capability {
    fn eq(&self, other: &Self) -> bool {
        ct_eq(&self.0, &other.0)
    }
}

impl Eq for Capability {}

impl fmt::Debug for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Capability(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn minted_ids_differ_and_print_as_32_hex_digits() {
        let n = 1000;
        let r: HashSet<_> = (0..n)
            .map(|_| ReservationId::mint().expect("rng"))
            .collect();
        let q: HashSet<_> = (0..n).map(|_| RequestId::mint().expect("rng")).collect();
        let t: HashSet<_> = (0..n).map(|_| TransferId::mint().expect("rng")).collect();
        assert_eq!((r.len(), q.len(), t.len()), (n, n, n));
        for id in &r {
            let s = id.to_string();
            assert_eq!(s.len(), 32);
            assert!(
                s.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)),
                "{s}"
            );
            let hex: String = id.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(s, hex);
            assert_eq!(format!("{id:?}"), format!("ReservationId({s})"));
            assert_ne!(id.to_bytes(), [0; 16]);
        }
        let caps: Vec<_> = (0..n).map(|_| Capability::mint().expect("rng")).collect();
        let distinct: HashSet<_> = caps.iter().map(|c| *c.expose()).collect();
        assert_eq!(distinct.len(), n);
    }

    #[test]
    fn capability_debug_shows_no_secret() {
        for _ in 0..100 {
            let c = Capability::mint().expect("rng");
            let dbg = format!("{c:?} {:#?}", c.clone());
            assert_eq!(dbg, "Capability(<redacted>) Capability(<redacted>)");
            let hex: String = c.expose().iter().map(|b| format!("{b:02x}")).collect();
            assert!(!dbg.contains(&hex[..8]));
            assert!(!dbg.contains(&format!("{:?}", c.expose())));
        }
    }

    #[test]
    fn capability_equality_sees_every_byte() {
        let c = Capability::mint().expect("rng");
        assert_eq!(c, c.clone());
        for i in 0..CAPABILITY_LEN {
            for bit in [0x01u8, 0x80] {
                let mut b = *c.expose();
                b[i] ^= bit;
                assert_ne!(c, Capability::from_wire(b), "byte {i} bit {bit:#x}");
            }
        }
    }
}
