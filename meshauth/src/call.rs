//! Per-call proofs for the internal gRPC services, both ways (no gRPC code
//! here: the tonic glue is `grpc`, feature `tonic`, and its clients are
//! `kvmesh_proto::peer`).
//!
//! Every call carries the metadata entry [`CALL_HEADER`]:
//!
//! ```text
//! x-kvmesh-peer: <unix ms, decimal>.<nonce: 32 hex digits>.<MAC: 64 hex digits>
//! MAC = HMAC-SHA256(secret, "kvmesh grpc call v2" | unix ms (u64 LE) | nonce (16 bytes)
//!                   | method path | recipient node name | SHA-256 of the request body)
//! ```
//!
//! and every answer (the response headers: a unary reply's, a stream's
//! before its first message, a refusal's) carries [`REPLY_HEADER`]:
//!
//! ```text
//! x-kvmesh-node: <MAC: 64 hex digits>
//! MAC = HMAC-SHA256(secret, "kvmesh grpc reply v1" | recipient node name | the call's MAC)
//! ```
//!
//! What each part stops:
//! - the method path: a token seen on a Load poll cannot be replayed as an
//!   Abort;
//! - the recipient's name: a call captured at (or relayed by) one node is
//!   refused by every other, so a process answering on a registered address
//!   cannot pass the router's call on to a real node of another name, and a
//!   replay to a sibling node (a `cached_tokens` oracle) fails;
//! - the body's digest: the request cannot be altered or swapped under a
//!   valid proof;
//! - the reply: a node proves it holds the secret *and* is the node the
//!   caller named, over this very call, before the caller uses a byte of
//!   its answer, so anything that answers on a registered address without
//!   the secret (a key written into an unauthenticated etcd, a process that
//!   took a dead node's port) is refused and never chosen. A node signs a
//!   reply only to a call whose proof it accepted, so it is no oracle for
//!   replies to calls it never checked.
//!
//! The receiver checks, in order: present, well-formed, time within
//! [`CALL_WINDOW`] of its own clock either way (these before the body is
//! read), MAC (constant time), nonce not seen before. Only tokens with a
//! valid MAC enter the replay cache, so a peer without the secret cannot
//! fill it. The cache holds at most [`REPLAY_CAPACITY`] nonces; past that
//! the oldest is evicted and every token at or before its time is refused
//! as stale from then on (it can no longer be vouched for), so memory stays
//! bounded and no replay is ever accepted.
//!
//! Cost: two HMAC-SHA256 and one SHA-256 of the body per call on each side
//! (a few microseconds for a prompt of thousands of tokens).

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use sha2::{Digest, Sha256};
use thiserror::Error;

use kvmesh_counters::KindCounters;
use kvmesh_kvwire::ids::random_nonzero;
use kvmesh_kvwire::MintError;

use crate::{hex, MeshSecret, MAC_LEN};

/// The metadata key of the call proof.
pub const CALL_HEADER: &str = "x-kvmesh-peer";
/// The metadata key of the reply proof.
pub const REPLY_HEADER: &str = "x-kvmesh-node";
/// How far a token's time may be from the receiver's clock, either way.
pub const CALL_WINDOW: Duration = Duration::from_secs(60);
/// Nonces remembered at most (about 40 bytes each).
pub const REPLAY_CAPACITY: usize = 1 << 17;
/// Bytes of a call nonce.
pub const CALL_NONCE_LEN: usize = 16;
/// Longest well-formed token: 20 digits, 32 and 64 hex digits, two dots.
const MAX_TOKEN_LEN: usize = 20 + 1 + 2 * CALL_NONCE_LEN + 1 + 2 * MAC_LEN;

const CALL_DOMAIN: &str = "kvmesh grpc call v2";
const REPLY_DOMAIN: &str = "kvmesh grpc reply v1";

/// Labels of [`CallVerifier::refused`]: every [`CallRefusal::kind`].
pub const CALL_REFUSAL_KINDS: [&str; 5] = ["missing", "malformed", "bad_mac", "stale", "replayed"];
/// Labels of the reply checks' counters: every [`ReplyRefusal::kind`].
pub const REPLY_REFUSAL_KINDS: [&str; 3] = ["missing", "malformed", "bad_mac"];

/// SHA-256 of a request body: what a proof binds the request's bytes by.
pub type BodyDigest = [u8; 32];

/// The SHA-256 digest of a request body.
pub fn body_digest(body: &[u8]) -> BodyDigest {
    Sha256::digest(body).into()
}

/// Why a call was refused (as UNAUTHENTICATED). The messages name no
/// secret and nothing the caller could use to guess one.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum CallRefusal {
    /// No [`CALL_HEADER`] entry.
    #[error("missing {CALL_HEADER}: the internal services accept only peers of this mesh")]
    Missing,
    /// The entry is not `MS.NONCE.MAC`.
    #[error("malformed {CALL_HEADER}: {0}")]
    Malformed(&'static str),
    /// The MAC is not this mesh's for this method, recipient, body, time
    /// and nonce.
    #[error("{CALL_HEADER} does not prove this mesh's secret for this call to this node")]
    BadMac,
    /// The time is outside the window (or too old for the replay cache).
    #[error("{CALL_HEADER} is stale: {skew_ms} ms from this node's clock")]
    Stale {
        /// Receiver's clock minus the token's time.
        skew_ms: i64,
    },
    /// This exact token was accepted before.
    #[error("{CALL_HEADER} was used before")]
    Replayed,
}

impl CallRefusal {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        CALL_REFUSAL_KINDS[self.index()]
    }

    fn index(&self) -> usize {
        match self {
            Self::Missing => 0,
            Self::Malformed(_) => 1,
            Self::BadMac => 2,
            Self::Stale { .. } => 3,
            Self::Replayed => 4,
        }
    }
}

/// Why a node's answer was refused before any of it was used: the node did
/// not prove that it holds the mesh secret and is the node that was called.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ReplyRefusal {
    /// No [`REPLY_HEADER`] in the answer's headers.
    #[error("the node's answer carries no {REPLY_HEADER}: it did not prove this mesh's secret")]
    Missing,
    /// The entry is not 64 lowercase hex digits.
    #[error("malformed {REPLY_HEADER} in the node's answer")]
    Malformed,
    /// The proof is not this mesh's for this node and this call.
    #[error("{REPLY_HEADER} does not prove this mesh's secret for this node and call")]
    BadMac,
}

impl ReplyRefusal {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        REPLY_REFUSAL_KINDS[self.index()]
    }

    /// Its position in [`REPLY_REFUSAL_KINDS`].
    pub fn index(&self) -> usize {
        match self {
            Self::Missing => 0,
            Self::Malformed => 1,
            Self::BadMac => 2,
        }
    }
}

/// One call as its proof names it.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// The method path, `/package.Service/Method`.
    pub path: &'a str,
    /// The name of the node called (as the caller's membership has it).
    pub recipient: &'a str,
    /// [`body_digest`] of the request body's bytes.
    pub body: &'a BodyDigest,
}

fn mac_parts<'a>(
    ms: &'a [u8; 8],
    nonce: &'a [u8; CALL_NONCE_LEN],
    call: &Call<'a>,
) -> [&'a [u8]; 5] {
    [
        ms,
        nonce,
        call.path.as_bytes(),
        call.recipient.as_bytes(),
        call.body,
    ]
}

/// A signed call: the token to send, and its MAC, which the answer's proof
/// must cover ([`check_reply`]).
#[derive(Clone, Debug)]
pub struct SignedCall {
    /// The [`CALL_HEADER`] value.
    pub token: String,
    /// The token's MAC.
    pub mac: [u8; MAC_LEN],
}

/// A fresh token for one call at `now_unix_ms`.
pub fn sign_call(
    secret: &MeshSecret,
    call: &Call<'_>,
    now_unix_ms: u64,
) -> Result<SignedCall, MintError> {
    let nonce: [u8; CALL_NONCE_LEN] = random_nonzero()?;
    let ms = now_unix_ms.to_le_bytes();
    let mac = secret.mac(CALL_DOMAIN, &mac_parts(&ms, &nonce, call));
    Ok(SignedCall {
        token: format!("{now_unix_ms}.{}.{}", hex(&nonce), hex(&mac)),
        mac,
    })
}

/// The [`REPLY_HEADER`] value node `name` answers a call whose proof had
/// MAC `call_mac` with.
fn reply_proof(secret: &MeshSecret, name: &str, call_mac: &[u8; MAC_LEN]) -> String {
    hex(&secret.mac(REPLY_DOMAIN, &[name.as_bytes(), call_mac]))
}

/// Checks an answer's [`REPLY_HEADER`] (`None`: absent) from node
/// `recipient` to the call signed as `call`.
pub fn check_reply(
    secret: &MeshSecret,
    recipient: &str,
    call: &SignedCall,
    header: Option<&[u8]>,
) -> Result<(), ReplyRefusal> {
    let raw = header.ok_or(ReplyRefusal::Missing)?;
    let s = std::str::from_utf8(raw).map_err(|_| ReplyRefusal::Malformed)?;
    let tag: [u8; MAC_LEN] = unhex(s, "").map_err(|_| ReplyRefusal::Malformed)?;
    if secret.verify(REPLY_DOMAIN, &[recipient.as_bytes(), &call.mac], &tag) {
        Ok(())
    } else {
        Err(ReplyRefusal::BadMac)
    }
}

fn unhex<const N: usize>(s: &str, what: &'static str) -> Result<[u8; N], CallRefusal> {
    let b = s.as_bytes();
    if b.len() != 2 * N {
        return Err(CallRefusal::Malformed(what));
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(CallRefusal::Malformed(what)),
    };
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Ok(out)
}

/// A call's token that passed the checks possible before its body is read
/// ([`CallVerifier::admit_header`]); [`CallVerifier::admit_body`] finishes.
#[derive(Debug)]
#[must_use = "a call is admitted only once its body is checked"]
pub struct PendingCall {
    ms: u64,
    nonce: [u8; CALL_NONCE_LEN],
    mac: [u8; MAC_LEN],
}

/// A call that proved the mesh secret; its answer carries
/// [`CallVerifier::reply_proof`].
#[derive(Debug)]
pub struct AdmittedCall {
    mac: [u8; MAC_LEN],
}

fn parse(raw: &[u8]) -> Result<PendingCall, CallRefusal> {
    if raw.len() > MAX_TOKEN_LEN {
        return Err(CallRefusal::Malformed("too long"));
    }
    let s = std::str::from_utf8(raw).map_err(|_| CallRefusal::Malformed("not ASCII"))?;
    let mut it = s.split('.');
    let (Some(ms), Some(nonce), Some(mac), None) = (it.next(), it.next(), it.next(), it.next())
    else {
        return Err(CallRefusal::Malformed("expected MS.NONCE.MAC"));
    };
    if ms.is_empty() || !ms.bytes().all(|c| c.is_ascii_digit()) {
        return Err(CallRefusal::Malformed("time: decimal unix milliseconds"));
    }
    let ms = ms
        .parse()
        .map_err(|_| CallRefusal::Malformed("time: decimal unix milliseconds"))?;
    Ok(PendingCall {
        ms,
        nonce: unhex(nonce, "nonce: 32 lowercase hex digits")?,
        mac: unhex(mac, "MAC: 64 lowercase hex digits")?,
    })
}

/// The nonces accepted within the window, oldest first, and the time at or
/// below which nothing can be vouched for any more.
#[derive(Debug, Default)]
struct ReplayCache {
    seen: BTreeSet<(u64, [u8; CALL_NONCE_LEN])>,
    floor: Option<u64>,
}

impl ReplayCache {
    /// Admits `(ms, nonce)` once; `Err` for a replay, or for a time the
    /// cache can no longer vouch for.
    fn admit(
        &mut self,
        ms: u64,
        nonce: [u8; CALL_NONCE_LEN],
        now: u64,
        capacity: usize,
    ) -> Result<(), CallRefusal> {
        let oldest = now.saturating_sub(CALL_WINDOW.as_millis() as u64);
        // Entries older than the window can only be replayed as stale.
        while self.seen.first().is_some_and(|(t, _)| *t < oldest) {
            self.seen.pop_first();
        }
        if self.floor.is_some_and(|f| ms <= f) {
            return Err(CallRefusal::Stale {
                skew_ms: now as i64 - ms as i64,
            });
        }
        if !self.seen.insert((ms, nonce)) {
            return Err(CallRefusal::Replayed);
        }
        if self.seen.len() > capacity {
            if let Some((t, _)) = self.seen.pop_first() {
                self.floor = Some(self.floor.map_or(t, |f| f.max(t)));
            }
        }
        Ok(())
    }
}

/// The receiving side of node `name`: checks tokens, remembers nonces,
/// counts refusals, signs the answers to the calls it admitted.
#[derive(Debug)]
pub struct CallVerifier {
    secret: MeshSecret,
    name: String,
    replay: Mutex<ReplayCache>,
    capacity: usize,
    refused: KindCounters<{ CALL_REFUSAL_KINDS.len() }>,
}

impl CallVerifier {
    /// A verifier for node `name` of the mesh holding `secret`.
    pub fn new(secret: MeshSecret, name: impl Into<String>) -> Self {
        Self::with_capacity(secret, name, REPLAY_CAPACITY)
    }

    /// With a replay cache of `capacity` nonces (tests).
    pub fn with_capacity(secret: MeshSecret, name: impl Into<String>, capacity: usize) -> Self {
        Self {
            secret,
            name: name.into(),
            replay: Mutex::default(),
            capacity: capacity.max(1),
            refused: KindCounters::default(),
        }
    }

    /// The node name calls must be addressed to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The checks of a call's token (`None`: the entry is absent) possible
    /// before its body is read: present, well-formed, fresh at
    /// `now_unix_ms`. Counts a refusal by kind.
    pub fn admit_header(
        &self,
        token: Option<&[u8]>,
        now_unix_ms: u64,
    ) -> Result<PendingCall, CallRefusal> {
        let r = token
            .ok_or(CallRefusal::Missing)
            .and_then(parse)
            .and_then(|t| {
                if now_unix_ms.abs_diff(t.ms) > CALL_WINDOW.as_millis() as u64 {
                    Err(CallRefusal::Stale {
                        skew_ms: (i128::from(now_unix_ms) - i128::from(t.ms))
                            .clamp(i64::MIN.into(), i64::MAX.into())
                            as i64,
                    })
                } else {
                    Ok(t)
                }
            });
        self.count(r)
    }

    /// The rest: the MAC over method `path`, this node's name and the
    /// body's `digest`, then the replay cache. Counts a refusal by kind.
    pub fn admit_body(
        &self,
        pending: PendingCall,
        path: &str,
        digest: &BodyDigest,
        now_unix_ms: u64,
    ) -> Result<AdmittedCall, CallRefusal> {
        let r = self.finish(pending, path, digest, now_unix_ms);
        self.count(r)
    }

    fn finish(
        &self,
        t: PendingCall,
        path: &str,
        digest: &BodyDigest,
        now: u64,
    ) -> Result<AdmittedCall, CallRefusal> {
        let ms = t.ms.to_le_bytes();
        let call = Call {
            path,
            recipient: &self.name,
            body: digest,
        };
        if !self
            .secret
            .verify(CALL_DOMAIN, &mac_parts(&ms, &t.nonce, &call), &t.mac)
        {
            return Err(CallRefusal::BadMac);
        }
        self.replay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(t.ms, t.nonce, now, self.capacity)?;
        Ok(AdmittedCall { mac: t.mac })
    }

    /// Both steps at once, for a body already in hand.
    pub fn check(
        &self,
        token: Option<&[u8]>,
        path: &str,
        digest: &BodyDigest,
        now_unix_ms: u64,
    ) -> Result<AdmittedCall, CallRefusal> {
        let pending = self.admit_header(token, now_unix_ms)?;
        self.admit_body(pending, path, digest, now_unix_ms)
    }

    /// The [`REPLY_HEADER`] value for the answer to `call`.
    pub fn reply_proof(&self, call: &AdmittedCall) -> String {
        reply_proof(&self.secret, &self.name, &call.mac)
    }

    fn count<T>(&self, r: Result<T, CallRefusal>) -> Result<T, CallRefusal> {
        if let Err(e) = &r {
            self.refused.bump(e.index());
        }
        r
    }

    /// Refusals by kind, zeros included, in [`CALL_REFUSAL_KINDS`] order.
    pub fn refused(&self) -> [(&'static str, u64); CALL_REFUSAL_KINDS.len()] {
        self.refused.by_kind(&CALL_REFUSAL_KINDS)
    }

    /// Refusals of one kind.
    pub fn refused_of(&self, kind: &str) -> u64 {
        self.refused.get(&CALL_REFUSAL_KINDS, kind)
    }
}

#[cfg(test)]
mod tests;
