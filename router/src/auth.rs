//! API keys and tenants (I8: a request's tenant comes only from its
//! credential). When keys are configured, every `/v1` request and every
//! public gRPC call must carry `Authorization: Bearer KEY`; a missing or
//! unknown key is refused with 401 (UNAUTHENTICATED) before the body is
//! read, and nothing else happens. Keys are kept as SHA-256 digests, so
//! the table holds no secret and a lookup compares digests, not keys.
//! `/health` and `/metrics` stay open (probes and scrapers).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

/// A tenant, as its key names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

/// The key table; empty means no authentication (a local, single-tenant
/// server, as `kvmesh serve` runs by default).
#[derive(Clone, Debug, Default)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Tenant>,
}

/// Why a request was not authenticated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key this mesh does not know.
    Unknown,
}

impl AuthError {
    /// The message clients see.
    pub fn message(self) -> &'static str {
        match self {
            Self::Missing => "missing API key: send Authorization: Bearer YOUR_KEY",
            Self::Unknown => "incorrect API key provided",
        }
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// Keys and their tenants. Refused: an empty key or tenant, a key given
    /// twice.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, String> {
        let mut by_digest = HashMap::new();
        for (i, (key, tenant)) in pairs.into_iter().enumerate() {
            if key.is_empty() || tenant.is_empty() {
                return Err(format!("api key {i}: key and tenant must be non-empty"));
            }
            if by_digest.insert(digest(&key), Tenant(tenant)).is_some() {
                return Err(format!("api key {i}: the same key is given twice"));
            }
        }
        Ok(Self { by_digest })
    }

    /// Whether any key is configured.
    pub fn enabled(&self) -> bool {
        !self.by_digest.is_empty()
    }

    /// What a deployment without keys must be told at start: every client
    /// is one tenant, so they share one prefix-cache namespace. `None` when
    /// keys are configured.
    pub fn shared_namespace_warning(&self) -> Option<&'static str> {
        (!self.enabled()).then_some(
            "no API keys configured: every client is the tenant `default` and all share one \
             prefix-cache namespace, so one client's cached prompts speed up (and, by timing, \
             reveal) another's; configure api_keys to give each tenant its own",
        )
    }

    /// The tenant of an `Authorization` header value. With no keys
    /// configured every request is the `default` tenant.
    pub fn check(&self, authorization: Option<&str>) -> Result<Tenant, AuthError> {
        if !self.enabled() {
            return Ok(Tenant("default".into()));
        }
        let key = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::Missing)?;
        self.by_digest
            .get(&digest(key))
            .cloned()
            .ok_or(AuthError::Unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_tenants_and_nothing_else_passes() {
        let keys = ApiKeys::new([
            ("k-a".to_owned(), "alpha".to_owned()),
            ("k-b".into(), "beta".into()),
        ])
        .expect("keys");
        assert_eq!(keys.check(Some("Bearer k-a")), Ok(Tenant("alpha".into())));
        assert_eq!(keys.check(Some("Bearer k-b")), Ok(Tenant("beta".into())));
        assert_eq!(keys.check(None), Err(AuthError::Missing));
        assert_eq!(keys.check(Some("Bearer ")), Err(AuthError::Missing));
        assert_eq!(keys.check(Some("k-a")), Err(AuthError::Missing));
        assert_eq!(keys.check(Some("Bearer k-c")), Err(AuthError::Unknown));
        assert_eq!(keys.check(Some("Bearer k-a2")), Err(AuthError::Unknown));
        assert!(
            ApiKeys::new([("k".to_owned(), "t".to_owned()), ("k".into(), "u".into())]).is_err()
        );
        assert!(ApiKeys::new([(String::new(), "t".to_owned())]).is_err());
        assert!(keys.shared_namespace_warning().is_none());
        let open = ApiKeys::default();
        let warning = open.shared_namespace_warning().expect("no keys: a warning");
        assert!(warning.contains("one prefix-cache namespace"), "{warning}");
        assert_eq!(open.check(None), Ok(Tenant("default".into())));
    }
}
