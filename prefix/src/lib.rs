//! kvmesh prefix-cache identities: which tenant's cache a request may use
//! ([`Namespace`]) and what a cached KV page holds ([`PageKey`]).
//!
//! Both are HMAC-SHA256 values under a key derived from the mesh secret
//! ([`CacheKeys::new`]), over length-prefixed fields with a domain label:
//! - nobody without the secret can compute a key, so keys cannot be
//!   pre-computed or forged to collide (GHSA-rm76-4mrf-v9r8);
//! - no two field lists hash alike: ("org_1", "2345") and ("org_12345", "")
//!   give different namespaces (length prefixes), and a salted namespace
//!   never equals an unsalted one (a presence byte);
//! - a page's key covers the namespace, the key of the page before it (so a
//!   key names a whole prefix, not one page's tokens), the page's token ids
//!   and the model and KV geometry ([`ModelTag`]), so pages of another
//!   tenant, prefix, model or layout never share a key.
//!
//! Only the gateway derives a namespace, from the authenticated tenant
//! ([`CacheKeys::namespace`]); a client's `cache_salt` can only narrow it
//! to a sub-namespace inside that tenant. Nodes receive the namespace over
//! the authenticated internal API and never from a request body.
//!
//! The values themselves are plain 32-byte types of `kvmesh-cacheid`,
//! re-exported here: this crate derives them, the pool names them there
//! without linking the mesh secret.
//!
//! The pool's cache (`kvmesh_kvpool::cache`) compares the namespace as well
//! as the key on every lookup: a cross-tenant hit would need two tenants'
//! namespaces to be equal, not only a key collision.
//!
//! Cost: one HMAC-SHA256 over about `page_size * 4 + 120` bytes per full
//! page of a prompt (about a microsecond for pages of 16 tokens).

#![deny(missing_docs)]

use std::fmt;

use hmac::{Hmac, Mac};
use kvmesh_meshauth::MeshSecret;
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// The identities derived here, as plain values in `kvmesh-cacheid` so the
/// pool can name them without linking this crate (the mesh secret).
pub use kvmesh_cacheid::{Namespace, PageKey, LEN};

/// The domain the cache's key is derived under from the mesh secret.
const KEY_DOMAIN: &str = "kvmesh/prefix-cache/key/v1";
const NAMESPACE_DOMAIN: &str = "kvmesh/prefix-cache/namespace/v1";
const PAGE_DOMAIN: &str = "kvmesh/prefix-cache/page/v1";
const MODEL_DOMAIN: &str = "kvmesh/prefix-cache/model/v1";

/// The model and KV layout pages were computed with: pages of another
/// model, precision, page size or geometry never share a key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelTag([u8; LEN]);

impl ModelTag {
    /// A tag from the model's identity (its file's digest or name and
    /// precision, as the node states it) and the KV geometry. Not keyed:
    /// it names public facts; the page keys that include it are.
    pub fn new(identity: &str, geometry: &[(&str, u64)]) -> Self {
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(MODEL_DOMAIN.as_bytes());
        field(identity.as_bytes());
        for (name, value) in geometry {
            field(name.as_bytes());
            field(&value.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// The raw bytes (what travels in the internal API).
    pub fn as_bytes(&self) -> &[u8; LEN] {
        &self.0
    }

    /// From the bytes the internal API carries; `None` unless exactly
    /// [`LEN`] of them.
    pub fn from_slice(b: &[u8]) -> Option<Self> {
        <[u8; LEN]>::try_from(b).ok().map(Self)
    }
}

impl fmt::Debug for ModelTag {
    /// The first 8 bytes in hex: enough to tell values apart in a log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelTag(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The keyed hashes of one mesh's prefix cache. Every node and the gateway
/// of a mesh build it from the same mesh secret, so they compute the same
/// keys for the same tokens (the router's cache-aware routing relies on
/// it). `Debug` hides the key.
#[derive(Clone)]
pub struct CacheKeys {
    mac: HmacSha256,
    insecure: bool,
}

impl fmt::Debug for CacheKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheKeys")
            .field("key", &"<redacted>")
            .field("insecure", &self.insecure)
            .finish()
    }
}

impl CacheKeys {
    /// The cache's key, derived from `secret` under its own domain (so it
    /// is no proof of anything the mesh authenticates).
    ///
    /// On an insecure mesh (`insecure_no_mesh_auth`) the secret is public
    /// and so are the keys: anyone can compute a page's key. Namespaces
    /// still keep tenants apart (lookups compare them); [`Self::is_insecure`]
    /// lets the caller warn.
    pub fn new(secret: &MeshSecret) -> Self {
        let key = secret.derive_key(KEY_DOMAIN);
        #[allow(clippy::expect_used)]
        let mac = HmacSha256::new_from_slice(&key).expect("HMAC accepts keys of any length");
        Self {
            mac,
            insecure: secret.is_insecure(),
        }
    }

    /// Whether the keys come from an insecure mesh's public secret.
    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    fn hash(&self, fields: &[&[u8]]) -> [u8; LEN] {
        let mut m = self.mac.clone();
        for f in fields {
            m.update(&(f.len() as u64).to_le_bytes());
            m.update(f);
        }
        m.finalize().into_bytes().into()
    }

    /// The namespace of `tenant` (the authenticated tenant, never a value
    /// from a request body), narrowed by the client's `salt` if it sent
    /// one. A salted namespace is a sub-namespace of its tenant: another
    /// tenant sending the same salt gets another namespace, and no salt
    /// gives the unsalted namespace.
    pub fn namespace(&self, tenant: &str, salt: Option<&str>) -> Namespace {
        // The planted bug (testing builds): every tenant alike.
        let tenant = if kvmesh_faults::planted(kvmesh_faults::PlantedBug::CacheNoNamespace) {
            ""
        } else {
            tenant
        };
        let (flag, salt): (&[u8], &[u8]) = match salt {
            None => (&[0], &[]),
            Some(s) => (&[1], s.as_bytes()),
        };
        Namespace::from_bytes(self.hash(&[
            NAMESPACE_DOMAIN.as_bytes(),
            tenant.as_bytes(),
            flag,
            salt,
        ]))
    }

    /// The key of the full page holding `tokens` (exactly one page of
    /// them) after the page keyed `parent` (`None` for the first page).
    pub fn page_key(
        &self,
        ns: &Namespace,
        model: &ModelTag,
        parent: Option<&PageKey>,
        tokens: &[u32],
    ) -> PageKey {
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let (flag, parent): (&[u8], &[u8]) = match parent {
            None => (&[0], &[]),
            Some(p) => (&[1], p.as_bytes()),
        };
        PageKey::from_bytes(self.hash(&[
            PAGE_DOMAIN.as_bytes(),
            ns.as_bytes(),
            &model.0,
            flag,
            parent,
            &bytes,
        ]))
    }

    /// The keys of every full page of `tokens` (pages of `page_size`), in
    /// order; the partial last page has none (it is always private to its
    /// sequence). Empty when `page_size` is 0.
    pub fn page_keys(
        &self,
        ns: &Namespace,
        model: &ModelTag,
        page_size: usize,
        tokens: &[u32],
    ) -> Vec<PageKey> {
        if page_size == 0 {
            return Vec::new();
        }
        let mut keys: Vec<PageKey> = Vec::with_capacity(tokens.len() / page_size);
        for page in tokens.chunks_exact(page_size) {
            let key = self.page_key(ns, model, keys.last(), page);
            keys.push(key);
        }
        keys
    }
}

#[cfg(test)]
mod tests;
