//! API keys and tenants (I8: a request's tenant comes only from its
//! credential). When keys are configured, every `/v1` request and every
//! public gRPC call must carry `Authorization: Bearer KEY`; a missing or
//! unknown key is refused with 401 (UNAUTHENTICATED) before the body is
//! read, and nothing else happens. Keys are kept as SHA-256 digests, so
//! the table holds no secret and a lookup compares digests, not keys.
//! Each key has scopes: `inference` (the `/v1` API, tokenize, the public
//! gRPC; every key's default) and `metrics` (the gateway's `/metrics`,
//! which names the nodes, their versions and their caches' counters): with
//! keys configured, `/metrics` needs a key with the `metrics` scope (401
//! without a known key, 403 with a key that lacks it). `/health` stays
//! open (probes).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

/// A tenant, as its key names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

/// What a key may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Completions, chat, models, tokenize, the public gRPC API.
    Inference,
    /// The gateway's `/metrics`.
    Metrics,
}

impl Scope {
    /// Its name in the mesh file.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Inference => "inference",
            Self::Metrics => "metrics",
        }
    }
}

impl std::str::FromStr for Scope {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "inference" => Ok(Self::Inference),
            "metrics" => Ok(Self::Metrics),
            _ => Err(format!(
                "unknown scope {s:?}: expected inference or metrics"
            )),
        }
    }
}

/// One key's tenant and scopes.
#[derive(Clone, Debug)]
struct Entry {
    tenant: Tenant,
    scopes: Vec<Scope>,
}

/// The key table; empty means no authentication (a local, single-tenant
/// server, as `kvmesh serve` runs by default).
#[derive(Clone, Debug, Default)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Entry>,
}

/// Why a request was not authenticated or not allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key this mesh does not know.
    Unknown,
    /// A known key without the scope this needs (403).
    OutOfScope(Scope),
}

impl AuthError {
    /// The message clients see.
    pub fn message(self) -> &'static str {
        match self {
            Self::Missing => "missing API key: send Authorization: Bearer YOUR_KEY",
            Self::Unknown => "incorrect API key provided",
            Self::OutOfScope(Scope::Inference) => "this API key does not have the inference scope",
            Self::OutOfScope(Scope::Metrics) => "this API key does not have the metrics scope",
        }
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// Keys and their tenants, each with the `inference` scope only.
    /// Refused: an empty key or tenant, a key given twice.
    pub fn new(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, String> {
        Self::with_scopes(
            pairs
                .into_iter()
                .map(|(k, t)| (k, t, vec![Scope::Inference])),
        )
    }

    /// Keys, their tenants and their scopes. Refused: an empty key, tenant
    /// or scope list, a key given twice.
    pub fn with_scopes(
        keys: impl IntoIterator<Item = (String, String, Vec<Scope>)>,
    ) -> Result<Self, String> {
        let mut by_digest = HashMap::new();
        for (i, (key, tenant, scopes)) in keys.into_iter().enumerate() {
            if key.is_empty() || tenant.is_empty() {
                return Err(format!("api key {i}: key and tenant must be non-empty"));
            }
            if scopes.is_empty() {
                return Err(format!(
                    "api key {i}: no scope: give it inference, metrics or both"
                ));
            }
            let entry = Entry {
                tenant: Tenant(tenant),
                scopes,
            };
            if by_digest.insert(digest(&key), entry).is_some() {
                return Err(format!("api key {i}: the same key is given twice"));
            }
        }
        Ok(Self { by_digest })
    }

    /// Whether any key is configured.
    pub fn enabled(&self) -> bool {
        !self.by_digest.is_empty()
    }

    /// How many tenants the keys name (1 without keys: `default`).
    pub fn tenants(&self) -> usize {
        let names: std::collections::HashSet<&Tenant> =
            self.by_digest.values().map(|e| &e.tenant).collect();
        names.len().max(1)
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

    /// The tenant of an `Authorization` header value, for an inference
    /// request. With no keys configured every request is the `default`
    /// tenant.
    pub fn check(&self, authorization: Option<&str>) -> Result<Tenant, AuthError> {
        if !self.enabled() {
            return Ok(Tenant("default".into()));
        }
        self.scoped(authorization, Scope::Inference)
            .map(|e| e.tenant.clone())
    }

    /// Whether an `Authorization` header value may read `/metrics`: anyone
    /// with no keys configured, else a key with the `metrics` scope.
    pub fn check_metrics(&self, authorization: Option<&str>) -> Result<(), AuthError> {
        if !self.enabled() {
            return Ok(());
        }
        self.scoped(authorization, Scope::Metrics).map(|_| ())
    }

    fn scoped(&self, authorization: Option<&str>, scope: Scope) -> Result<&Entry, AuthError> {
        let key = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .ok_or(AuthError::Missing)?;
        let entry = self.by_digest.get(&digest(key)).ok_or(AuthError::Unknown)?;
        if entry.scopes.contains(&scope) {
            Ok(entry)
        } else {
            Err(AuthError::OutOfScope(scope))
        }
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
        assert_eq!(open.check_metrics(None), Ok(()));
    }

    #[test]
    fn metrics_need_a_key_with_the_metrics_scope() {
        let keys = ApiKeys::with_scopes([
            ("k-a".to_owned(), "alpha".to_owned(), vec![Scope::Inference]),
            ("k-m".into(), "ops".into(), vec![Scope::Metrics]),
            (
                "k-b".into(),
                "beta".into(),
                vec![Scope::Inference, Scope::Metrics],
            ),
        ])
        .expect("keys");
        assert_eq!(keys.check_metrics(None), Err(AuthError::Missing));
        assert_eq!(
            keys.check_metrics(Some("Bearer k-x")),
            Err(AuthError::Unknown)
        );
        assert_eq!(
            keys.check_metrics(Some("Bearer k-a")),
            Err(AuthError::OutOfScope(Scope::Metrics))
        );
        assert_eq!(keys.check_metrics(Some("Bearer k-m")), Ok(()));
        assert_eq!(keys.check_metrics(Some("Bearer k-b")), Ok(()));
        // A scraper's key runs no inference.
        assert_eq!(
            keys.check(Some("Bearer k-m")),
            Err(AuthError::OutOfScope(Scope::Inference))
        );
        assert_eq!(keys.check(Some("Bearer k-b")), Ok(Tenant("beta".into())));
        assert!(ApiKeys::with_scopes([("k".to_owned(), "t".to_owned(), vec![])]).is_err());
        assert_eq!("metrics".parse(), Ok(Scope::Metrics));
        assert!("admin".parse::<Scope>().is_err());
    }
}
