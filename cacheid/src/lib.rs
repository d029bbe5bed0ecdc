//! kvmesh prefix-cache identities as plain values: whose cache
//! ([`Namespace`]) and what a cached KV page holds ([`PageKey`]), 32 bytes
//! each.
//!
//! # Layout
//! The two types and [`LEN`], nothing else. `kvmesh-prefix` derives them
//! (keyed HMAC-SHA256 under the mesh secret: how they are computed and why
//! they cannot be forged is documented there); `kvmesh-kvpool` indexes its
//! cache by them; the router and the nodes read them from the internal API
//! ([`Namespace::from_slice`]). They live in a crate of their own, below
//! both, so the pool can name them without linking authentication or the
//! wire.
//!
//! # Invariants
//! A value is exactly [`LEN`] bytes; these types never compute one. Equal
//! bytes are equal identities: the pool compares namespaces as well as keys
//! on every lookup (`kvmesh_kvpool::cache`).

#![deny(missing_docs)]

use std::fmt;

/// Bytes of a namespace and of a page key.
pub const LEN: usize = 32;

macro_rules! id32 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name([u8; LEN]);

        impl $name {
            /// The value holding `bytes` (what `kvmesh-prefix` derives).
            pub const fn from_bytes(bytes: [u8; LEN]) -> Self {
                Self(bytes)
            }

            /// The raw bytes (what travels in the internal API).
            pub fn as_bytes(&self) -> &[u8; LEN] {
                &self.0
            }

            /// From the bytes the internal API carries; `None` unless
            /// exactly [`LEN`] of them.
            pub fn from_slice(b: &[u8]) -> Option<Self> {
                <[u8; LEN]>::try_from(b).ok().map(Self)
            }
        }

        impl fmt::Debug for $name {
            /// The first 8 bytes in hex: enough to tell values apart in a
            /// log. These are keyed hashes: they reveal nothing of what
            /// they were computed from.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "("))?;
                for b in &self.0[..8] {
                    write!(f, "{b:02x}")?;
                }
                write!(f, "..)")
            }
        }
    };
}

id32! {
    /// Whose cache: derived by the gateway from the authenticated tenant
    /// (and a client's `cache_salt`, inside that tenant). Two requests can
    /// share cached pages only if their namespaces are equal.
    Namespace
}

id32! {
    /// What a full KV page holds: a keyed hash over its namespace, the key
    /// of the page before it, its token ids and the model tag
    /// (`kvmesh_prefix::ModelTag`).
    PageKey
}

impl PageKey {
    /// The first 8 bytes, as the short id routers index nodes' caches by
    /// (a node reports these, not whole keys: 8 bytes a page). Two pages
    /// share an id with probability 2^-64 per pair; a false match only
    /// sends a request to a node that then misses, since a node looks up
    /// whole keys.
    pub fn routing_id(&self) -> u64 {
        let mut b = [0; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_only_len_bytes_make_a_value() {
        let ns = Namespace::from_bytes([7; LEN]);
        assert_eq!(Namespace::from_slice(ns.as_bytes()), Some(ns));
        assert_eq!(Namespace::from_slice(&[0; LEN - 1]), None);
        assert_eq!(PageKey::from_slice(&[0; LEN + 1]), None);
        assert_eq!(format!("{ns:?}"), "Namespace(0707070707070707..)");
    }

    #[test]
    fn a_routing_id_is_the_first_eight_bytes_little_endian() {
        let mut b = [0; LEN];
        b[0] = 1;
        b[7] = 2;
        b[8] = 0xff;
        assert_eq!(PageKey::from_bytes(b).routing_id(), 1 | (2 << 56));
    }
}
