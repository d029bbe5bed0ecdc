//! Where the mesh's etcd is and how its registrations behave, checked once.

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

/// The default lease TTL: a SIGKILLed node leaves every view within about
/// this long (its lease is kept alive every third of it).
pub const DEFAULT_LEASE_TTL_S: u64 = 3;
/// Shortest lease TTL accepted (etcd raises shorter ones to its own
/// minimum, 1.5 election timeouts).
pub const MIN_LEASE_TTL_S: u64 = 2;
/// Longest lease TTL accepted.
pub const MAX_LEASE_TTL_S: u64 = 300;
/// The default bound on one etcd call (and on connecting).
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// A mesh's etcd settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `http://HOST:PORT` of each etcd member.
    pub endpoints: Vec<String>,
    /// The key prefix of this mesh's registrations; starts and ends with `/`.
    pub prefix: String,
    /// Lease TTL of every registration, whole seconds.
    pub lease_ttl: Duration,
    /// Bound on connecting and on each etcd call.
    pub dial_timeout: Duration,
    /// TLS to etcd with a client certificate; `None`: plain HTTP.
    pub tls: Option<EtcdTls>,
}

/// TLS to etcd (`https://` endpoints; etcd started with
/// `--client-cert-auth`): PEM files, read when the client connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA that signed etcd's server certificates.
    pub ca: PathBuf,
    /// This process's client certificate (chained to etcd's
    /// `--trusted-ca-file`).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// A refused etcd setting: its field, value and why.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{field} = {value:?}: {reason}")]
pub struct ConfigError {
    /// The field (`endpoints`, `prefix`, `lease_ttl_s`, `dial_timeout_ms`).
    pub field: &'static str,
    /// Its value.
    pub value: String,
    /// Why.
    pub reason: &'static str,
}

fn refuse(field: &'static str, value: &str, reason: &'static str) -> ConfigError {
    ConfigError {
        field,
        value: value.to_owned(),
        reason,
    }
}

impl EtcdConfig {
    /// Checks and normalizes: endpoints as `HOST:PORT`, or
    /// `http://HOST:PORT` without `tls` and `https://HOST:PORT` with it
    /// (a bare `HOST:PORT` takes the scheme `tls` implies), a prefix starting
    /// with `/` (a `/` is appended if it lacks one, so `/kvmesh/a` cannot
    /// see `/kvmesh/ab`'s nodes), a TTL of [`MIN_LEASE_TTL_S`] to
    /// [`MAX_LEASE_TTL_S`] seconds.
    pub fn new(
        endpoints: &[String],
        prefix: &str,
        lease_ttl_s: u64,
        dial_timeout: Duration,
        tls: Option<EtcdTls>,
    ) -> Result<Self, ConfigError> {
        if endpoints.is_empty() {
            return Err(refuse("endpoints", "[]", "name at least one etcd member"));
        }
        let endpoints = endpoints
            .iter()
            .map(|e| endpoint(e, tls.is_some()))
            .collect::<Result<Vec<_>, _>>()?;
        if !prefix.starts_with('/')
            || prefix.len() > 256
            || prefix.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(refuse(
                "prefix",
                prefix,
                "a key prefix of this mesh such as /kvmesh/prod/: starting with '/', no spaces, at most 256 bytes",
            ));
        }
        let mut prefix = prefix.to_owned();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        if !(MIN_LEASE_TTL_S..=MAX_LEASE_TTL_S).contains(&lease_ttl_s) {
            return Err(refuse(
                "lease_ttl_s",
                &lease_ttl_s.to_string(),
                "2 to 300 seconds",
            ));
        }
        if dial_timeout.is_zero() {
            return Err(refuse("dial_timeout_ms", "0", "must be at least 1"));
        }
        Ok(Self {
            endpoints,
            prefix,
            lease_ttl: Duration::from_secs(lease_ttl_s),
            dial_timeout,
            tls,
        })
    }

    /// The lease TTL in etcd's unit (seconds).
    pub fn ttl_secs(&self) -> i64 {
        self.lease_ttl.as_secs() as i64
    }

    /// One line for `--check-config` and the logs.
    pub fn describe(&self) -> String {
        format!(
            "discovery etcd: {} prefix {}, lease TTL {} s{}",
            self.endpoints.join(","),
            self.prefix,
            self.lease_ttl.as_secs(),
            if self.tls.is_some() {
                ", TLS with a client certificate"
            } else {
                ""
            }
        )
    }
}

fn endpoint(e: &str, tls: bool) -> Result<String, ConfigError> {
    let (scheme, hp) = match (e.split_once("://"), tls) {
        (None, false) => ("http", e),
        (None, true) => ("https", e),
        (Some(("http", hp)), false) => ("http", hp),
        (Some(("https", hp)), true) => ("https", hp),
        (Some(("https", _)), false) => {
            return Err(refuse(
                "endpoints",
                e,
                "https:// needs etcd.tls (the CA, and this node's client certificate and key)",
            ))
        }
        (Some(("http", _)), true) => {
            return Err(refuse(
                "endpoints",
                e,
                "http:// with etcd.tls would send the registrations in the clear: use https://",
            ))
        }
        _ => {
            return Err(refuse(
                "endpoints",
                e,
                "expected HOST:PORT, http://HOST:PORT or (with etcd.tls) https://HOST:PORT",
            ))
        }
    };
    match hp.rsplit_once(':') {
        Some((host, port))
            if !host.is_empty()
                && !host.contains('/')
                && matches!(port.parse::<u16>(), Ok(p) if p > 0) =>
        {
            Ok(format!("{scheme}://{hp}"))
        }
        _ => Err(refuse(
            "endpoints",
            e,
            "expected HOST:PORT or http://HOST:PORT",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(endpoints: &[&str], prefix: &str, ttl: u64) -> Result<EtcdConfig, ConfigError> {
        let e: Vec<String> = endpoints.iter().map(|s| (*s).to_owned()).collect();
        EtcdConfig::new(&e, prefix, ttl, DEFAULT_DIAL_TIMEOUT, None)
    }

    fn tls() -> EtcdTls {
        EtcdTls {
            ca: "ca.pem".into(),
            cert: "c.pem".into(),
            key: "k.pem".into(),
        }
    }

    #[test]
    fn endpoints_and_prefix_are_normalized() {
        let c = cfg(&["etcd:2379", "http://10.0.0.1:2379"], "/kvmesh/a", 3).expect("ok");
        assert_eq!(c.endpoints, ["http://etcd:2379", "http://10.0.0.1:2379"]);
        assert_eq!(c.prefix, "/kvmesh/a/");
        assert_eq!(c.ttl_secs(), 3);
        assert_eq!(cfg(&["h:1"], "/", 2).expect("ok").prefix, "/");
        // With TLS a bare address takes https.
        let e = ["etcd:2379".to_owned(), "https://10.0.0.1:2379".to_owned()];
        let c = EtcdConfig::new(&e, "/k/", 3, DEFAULT_DIAL_TIMEOUT, Some(tls())).expect("ok");
        assert_eq!(c.endpoints, ["https://etcd:2379", "https://10.0.0.1:2379"]);
        assert!(c.describe().contains("TLS with a client certificate"));
    }

    #[test]
    fn bad_settings_name_field_value_and_reason() {
        let cases = [
            (cfg(&[], "/k/", 3), "endpoints = \"[]\": name at least one"),
            (
                cfg(&["h"], "/k/", 3),
                "endpoints = \"h\": expected HOST:PORT",
            ),
            (cfg(&["h:0"], "/k/", 3), "expected HOST:PORT"),
            (cfg(&["https://h:1"], "/k/", 3), "https:// needs etcd.tls"),
            (
                EtcdConfig::new(
                    &["http://h:1".into()],
                    "/k/",
                    3,
                    DEFAULT_DIAL_TIMEOUT,
                    Some(tls()),
                ),
                "in the clear: use https://",
            ),
            (cfg(&["unix://h:1"], "/k/", 3), "expected HOST:PORT"),
            (cfg(&["http://a/b:1"], "/k/", 3), "expected HOST:PORT"),
            (cfg(&["h:1"], "k/", 3), "prefix = \"k/\": a key prefix"),
            (cfg(&["h:1"], "/a b/", 3), "prefix = \"/a b/\""),
            (
                cfg(&["h:1"], "/k/", 1),
                "lease_ttl_s = \"1\": 2 to 300 seconds",
            ),
            (cfg(&["h:1"], "/k/", 301), "lease_ttl_s = \"301\""),
            (
                EtcdConfig::new(&["h:1".into()], "/k/", 3, Duration::ZERO, None),
                "dial_timeout_ms = \"0\"",
            ),
        ];
        for (r, want) in cases {
            let e = r.expect_err(want);
            assert!(e.to_string().contains(want), "{want:?} not in {e}");
        }
    }
}
