//! What a node writes into etcd about itself, and the one way to read it
//! back.
//!
//! Key: `<prefix><role>/<name>` (`/kvmesh/prod/decode/decode-0`). Value: a
//! small JSON object (readable with `etcdctl get --prefix`):
//!
//! ```json
//! {"format":1,"name":"decode-0","role":"decode","grpc":"10.0.0.7:7201",
//!  "kv":"tcp://10.0.0.7:7301","version":"0.1.0"}
//! ```
//!
//! It carries what the router and the prefill nodes need to reach the node
//! and nothing else: no secret, no token. Whoever can write under the
//! prefix can add an entry, so an entry is only an address to try: every
//! call to it still has to pass mesh authentication (the secret), which a
//! node without it cannot (`docs/membership.md`, "Why etcd is not an auth
//! boundary").
//!
//! etcd's content is network input: [`Member::decode`] refuses, with a
//! typed [`MemberError`], anything that is not such an object or whose
//! fields are not what they claim (bounded size, names and addresses of a
//! restricted alphabet, the key agreeing with the value). Fields it does
//! not know are ignored, so a newer node's entry still reads; a `format`
//! other than [`FORMAT`] is refused.

use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The value format this code writes and reads.
pub const FORMAT: u32 = 1;

/// Largest value read (a real one is about 150 bytes).
pub const MAX_VALUE_BYTES: usize = 4096;

/// Longest node name (a DNS label, so a pod name fits).
pub const MAX_NAME: usize = 63;

/// Longest address (a DNS name of 253 bytes, a port, a scheme).
const MAX_ADDR: usize = 300;

/// Longest version string.
const MAX_VERSION: usize = 64;

/// A node's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts and writes their KV into decode nodes' pools.
    Prefill,
    /// Holds KV pages and generates.
    Decode,
}

impl Role {
    /// Its name in keys and values.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "prefill" => Some(Self::Prefill),
            "decode" => Some(Self::Decode),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One node's registration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// [`FORMAT`].
    pub format: u32,
    /// The node's name, unique in the mesh.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// `HOST:PORT` of its internal gRPC service (what the router dials).
    pub grpc: String,
    /// Decode only: its KV transport endpoint as grants name it
    /// (`tcp://HOST:PORT` or `unix:/path`), which prefill nodes dial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<String>,
    /// The kvmesh version the node runs (shown, never trusted).
    #[serde(default)]
    pub version: String,
}

/// Why an entry under the prefix is not a usable registration.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MemberError {
    /// The value is larger than [`MAX_VALUE_BYTES`].
    #[error("{key}: value of {len} bytes, at most {MAX_VALUE_BYTES}")]
    TooLarge {
        /// The key.
        key: String,
        /// Its value's length.
        len: usize,
    },
    /// The value is not the JSON object of a registration.
    #[error("{key}: not a registration: {reason}")]
    Malformed {
        /// The key.
        key: String,
        /// What serde_json said.
        reason: String,
    },
    /// A `format` this code does not read.
    #[error("{key}: format {format}, this node reads format {FORMAT}")]
    Format {
        /// The key.
        key: String,
        /// The format it names.
        format: u32,
    },
    /// The key is not `<prefix><role>/<name>`.
    #[error("{key}: not <prefix><prefill|decode>/<name> under {prefix:?}")]
    Key {
        /// The key (lossy UTF-8).
        key: String,
        /// The mesh's prefix.
        prefix: String,
    },
    /// The key and the value disagree on the name or the role.
    #[error("{key}: the value says {field} {value:?}, the key says {in_key:?}")]
    Mismatch {
        /// The key.
        key: String,
        /// `name` or `role`.
        field: &'static str,
        /// The value's.
        value: String,
        /// The key's.
        in_key: String,
    },
    /// A field's value is refused.
    #[error("{field} = {value:?}: {reason}")]
    Field {
        /// Which field.
        field: &'static str,
        /// Its value (cut to a readable length).
        value: String,
        /// Why.
        reason: &'static str,
    },
}

fn field(field: &'static str, value: &str, reason: &'static str) -> MemberError {
    let value = match value.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &value[..i]),
        None => value.to_owned(),
    };
    MemberError::Field {
        field,
        value,
        reason,
    }
}

/// Checks a node name: 1 to [`MAX_NAME`] of `a-z A-Z 0-9 . _ -`, not
/// starting with `.` or `-` (it is a path segment of the key, a metric
/// label and a log field).
pub fn check_name(name: &str) -> Result<(), MemberError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(field("name", name, "1 to 63 characters"));
    }
    if !name.chars().all(ok_char) || name.starts_with(['.', '-']) {
        return Err(field(
            "name",
            name,
            "letters, digits, '.', '_' and '-' only, not starting with '.' or '-'",
        ));
    }
    Ok(())
}

/// `HOST:PORT`: a host of letters, digits, `.`, `-`, `_` (or a bracketed
/// IPv6 address) and a port 1-65535.
fn check_host_port(name: &'static str, v: &str) -> Result<(), MemberError> {
    let bad = |reason| Err(field(name, v, reason));
    if v.len() > MAX_ADDR {
        return bad("too long");
    }
    let Some((host, port)) = v.rsplit_once(':') else {
        return bad("expected HOST:PORT");
    };
    if !matches!(port.parse::<u16>(), Ok(p) if p > 0) {
        return bad("expected HOST:PORT with a port 1-65535");
    }
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        !inner.is_empty() && inner.chars().all(|c| c.is_ascii_hexdigit() || c == ':')
    } else {
        !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    if !host_ok {
        return bad("the host must be a DNS name or an IP address");
    }
    Ok(())
}

/// A KV endpoint as grants name it: `tcp://HOST:PORT` or `unix:/path`.
fn check_kv(v: &str) -> Result<(), MemberError> {
    if let Some(hp) = v.strip_prefix("tcp://") {
        return check_host_port("kv", hp).map_err(|_| {
            field(
                "kv",
                v,
                "expected tcp://HOST:PORT or unix:/absolute/socket/path",
            )
        });
    }
    match v.strip_prefix("unix:") {
        Some(p)
            if p.starts_with('/')
                && p.len() < MAX_ADDR
                && !p.chars().any(|c| c.is_control() || c == '\0') =>
        {
            Ok(())
        }
        _ => Err(field(
            "kv",
            v,
            "expected tcp://HOST:PORT or unix:/absolute/socket/path",
        )),
    }
}

impl Member {
    /// A registration of the current format (checked: see [`Member::check`]).
    pub fn new(
        name: &str,
        role: Role,
        grpc: &str,
        kv: Option<&str>,
        version: &str,
    ) -> Result<Self, MemberError> {
        let m = Self {
            format: FORMAT,
            name: name.to_owned(),
            role,
            grpc: grpc.to_owned(),
            kv: kv.map(str::to_owned),
            version: version.to_owned(),
        };
        m.check()?;
        Ok(m)
    }

    /// Every field as [`Member::decode`] requires it: a valid name, a
    /// `HOST:PORT` gRPC address, a KV endpoint for a decode node and none
    /// for a prefill node, a short printable version.
    pub fn check(&self) -> Result<(), MemberError> {
        check_name(&self.name)?;
        check_host_port("grpc", &self.grpc)?;
        match (self.role, &self.kv) {
            (Role::Decode, Some(kv)) => check_kv(kv)?,
            (Role::Decode, None) => {
                return Err(field("kv", "", "a decode node needs a KV endpoint"))
            }
            (Role::Prefill, Some(kv)) => {
                return Err(field("kv", kv, "only decode nodes have a KV endpoint"))
            }
            (Role::Prefill, None) => {}
        }
        if self.version.len() > MAX_VERSION || self.version.chars().any(char::is_control) {
            return Err(field(
                "version",
                &self.version,
                "at most 64 printable characters",
            ));
        }
        Ok(())
    }

    /// Its key under `prefix` (which ends with `/`).
    pub fn key(&self, prefix: &str) -> String {
        key(prefix, self.role, &self.name)
    }

    /// The value written to etcd.
    pub fn encode(&self) -> Vec<u8> {
        // A struct of strings and an enum: serialization cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads the entry `key` = `value` found under `prefix`, refusing
    /// anything that is not a well-formed registration whose name and
    /// role are the key's.
    pub fn decode(prefix: &str, key: &[u8], value: &[u8]) -> Result<Self, MemberError> {
        let key_text = String::from_utf8_lossy(key).into_owned();
        let bad_key = || MemberError::Key {
            key: key_text.clone(),
            prefix: prefix.to_owned(),
        };
        let (role, name) = std::str::from_utf8(key)
            .ok()
            .and_then(|k| k.strip_prefix(prefix))
            .and_then(|rest| rest.split_once('/'))
            .and_then(|(role, name)| Some((Role::parse(role)?, name)))
            .ok_or_else(bad_key)?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(MemberError::TooLarge {
                key: key_text,
                len: value.len(),
            });
        }
        let m: Self = serde_json::from_slice(value).map_err(|e| MemberError::Malformed {
            key: key_text.clone(),
            reason: e.to_string(),
        })?;
        if m.format != FORMAT {
            return Err(MemberError::Format {
                key: key_text,
                format: m.format,
            });
        }
        m.check()?;
        if m.name != name {
            return Err(MemberError::Mismatch {
                key: key_text,
                field: "name",
                value: m.name,
                in_key: name.to_owned(),
            });
        }
        if m.role != role {
            return Err(MemberError::Mismatch {
                key: key_text,
                field: "role",
                value: m.role.to_string(),
                in_key: role.to_string(),
            });
        }
        Ok(m)
    }
}

/// The key of `role` node `name` under `prefix` (which ends with `/`).
pub fn key(prefix: &str, role: Role, name: &str) -> String {
    format!("{prefix}{}/{name}", role.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "/kvmesh/t/";

    fn decode_member() -> Member {
        Member::new(
            "decode-0",
            Role::Decode,
            "10.0.0.7:7201",
            Some("tcp://10.0.0.7:7301"),
            "0.1.0",
        )
        .expect("valid")
    }

    #[test]
    fn a_registration_round_trips_through_its_key_and_value() {
        let m = decode_member();
        let key = m.key(P);
        assert_eq!(key, "/kvmesh/t/decode/decode-0");
        let back = Member::decode(P, key.as_bytes(), &m.encode()).expect("decodes");
        assert_eq!(back, m);
        let p = Member::new("p.1_a", Role::Prefill, "[::1]:7101", None, "").expect("valid");
        assert_eq!(
            Member::decode(P, p.key(P).as_bytes(), &p.encode()),
            Ok(p.clone())
        );
        let shm = Member::new(
            "d",
            Role::Decode,
            "h:1",
            Some("unix:/run/kvmesh/d.sock"),
            "",
        )
        .expect("valid");
        assert_eq!(
            Member::decode(P, shm.key(P).as_bytes(), &shm.encode()),
            Ok(shm.clone())
        );
    }

    #[test]
    fn the_value_carries_no_secret_only_addresses() {
        let text = String::from_utf8(decode_member().encode()).expect("utf8");
        assert_eq!(
            text,
            r#"{"format":1,"name":"decode-0","role":"decode","grpc":"10.0.0.7:7201","kv":"tcp://10.0.0.7:7301","version":"0.1.0"}"#
        );
    }

    #[test]
    fn unknown_fields_are_ignored_and_another_format_is_refused() {
        let key = b"/kvmesh/t/prefill/p";
        let newer = br#"{"format":1,"name":"p","role":"prefill","grpc":"h:1","zone":"b"}"#;
        assert_eq!(Member::decode(P, key, newer).expect("reads").name, "p");
        let v2 = br#"{"format":2,"name":"p","role":"prefill","grpc":"h:1"}"#;
        assert!(matches!(
            Member::decode(P, key, v2),
            Err(MemberError::Format { format: 2, .. })
        ));
    }

    /// etcd's content is network input: every bad entry is a typed error,
    /// never a panic or a member.
    #[test]
    fn bad_entries_are_typed_errors() {
        let d = decode_member();
        let good_key = d.key(P);
        let cases: Vec<(Vec<u8>, Vec<u8>, &str)> = vec![
            (good_key.clone().into(), b"".to_vec(), "not a registration"),
            (good_key.clone().into(), b"\xff\xfe".to_vec(), "not a registration"),
            (good_key.clone().into(), b"[1,2]".to_vec(), "not a registration"),
            (good_key.clone().into(), b"{\"format\":1}".to_vec(), "missing field"),
            (
                good_key.clone().into(),
                vec![b' '; MAX_VALUE_BYTES + 1],
                "at most 4096",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"router","grpc":"h:1"}"#.to_vec(),
                "unknown variant",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"decode","grpc":"h:0","kv":"tcp://h:2"}"#
                    .to_vec(),
                "grpc = \"h:0\"",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"decode","grpc":"h:1"}"#.to_vec(),
                "a decode node needs a KV endpoint",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"decode","grpc":"h:1","kv":"http://h:2"}"#
                    .to_vec(),
                "kv = \"http://h:2\"",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"decode","grpc":"h:1","kv":"unix:rel"}"#
                    .to_vec(),
                "kv = \"unix:rel\"",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-0","role":"decode","grpc":"a b:1","kv":"tcp://h:2"}"#
                    .to_vec(),
                "the host must be",
            ),
            (
                good_key.clone().into(),
                br#"{"format":1,"name":"decode-1","role":"decode","grpc":"h:1","kv":"tcp://h:2"}"#
                    .to_vec(),
                "the value says name \"decode-1\"",
            ),
            (
                b"/kvmesh/t/prefill/decode-0".to_vec(),
                d.encode(),
                "the value says role \"decode\"",
            ),
            (b"/kvmesh/t/router/r".to_vec(), d.encode(), "not <prefix>"),
            (b"/kvmesh/t/decode".to_vec(), d.encode(), "not <prefix>"),
            (b"/other/decode/decode-0".to_vec(), d.encode(), "not <prefix>"),
            (b"/kvmesh/t/decode/\xff".to_vec(), d.encode(), "not <prefix>"),
            (
                b"/kvmesh/t/prefill/x".to_vec(),
                br#"{"format":1,"name":"x","role":"prefill","grpc":"h:1","kv":"tcp://h:2"}"#
                    .to_vec(),
                "only decode nodes have a KV endpoint",
            ),
            (
                b"/kvmesh/t/prefill/-x".to_vec(),
                br#"{"format":1,"name":"-x","role":"prefill","grpc":"h:1"}"#.to_vec(),
                "not starting with",
            ),
            (
                b"/kvmesh/t/prefill/x".to_vec(),
                br#"{"format":1,"name":"x","role":"prefill","grpc":"h:1","version":"a\nb"}"#
                    .to_vec(),
                "printable",
            ),
        ];
        for (key, value, want) in cases {
            let e = Member::decode(P, &key, &value).expect_err(want);
            assert!(e.to_string().contains(want), "{want:?} not in {e}");
        }
    }

    #[test]
    fn names_are_path_segments_and_labels() {
        for ok in ["decode-0", "a", "pod.x_1", &"a".repeat(63)] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a/b", "a b", "-a", ".a", "a\"b", "é", &"a".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        // A long bad value is cut in the message.
        let e = check_name(&"/".repeat(500)).expect_err("bad");
        assert!(e.to_string().len() < 200, "{e}");
    }
}
