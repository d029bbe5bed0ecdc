//! Per-call proofs for the internal gRPC services (no gRPC code here: the
//! tonic glue is `grpc`, feature `tonic`, and its clients are
//! `kvmesh_proto::peer`).
//!
//! Every call carries the metadata entry [`CALL_HEADER`]:
//!
//! ```text
//! x-kvmesh-peer: <unix ms, decimal>.<nonce: 32 hex digits>.<MAC: 64 hex digits>
//! MAC = HMAC-SHA256(secret, "kvmesh grpc call v1" | unix ms (u64 LE) | nonce (16 bytes) | method path)
//! ```
//!
//! The method path (`/kvmesh.internal.v1.Decode/Abort`) is covered, so a
//! token seen on a Load poll cannot be replayed as an Abort. The receiver
//! checks, in order: present, well-formed, MAC (constant time), time within
//! [`CALL_WINDOW`] of its own clock either way, nonce not seen before. Only
//! tokens with a valid MAC enter the replay cache, so a peer without the
//! secret cannot fill it. The cache holds at most [`REPLAY_CAPACITY`]
//! nonces; past that the oldest is evicted and every token at or before its
//! time is refused as stale from then on (it can no longer be vouched
//! for), so memory stays bounded and no replay is ever accepted.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use thiserror::Error;

use kvmesh_counters::KindCounters;
use kvmesh_kvwire::ids::random_nonzero;
use kvmesh_kvwire::MintError;

use crate::{hex, MeshSecret, MAC_LEN};

/// The metadata key of the call proof.
pub const CALL_HEADER: &str = "x-kvmesh-peer";
/// How far a token's time may be from the receiver's clock, either way.
pub const CALL_WINDOW: Duration = Duration::from_secs(60);
/// Nonces remembered at most (about 40 bytes each).
pub const REPLAY_CAPACITY: usize = 1 << 17;
/// Bytes of a call nonce.
pub const CALL_NONCE_LEN: usize = 16;
/// Longest well-formed token: 20 digits, 32 and 64 hex digits, two dots.
const MAX_TOKEN_LEN: usize = 20 + 1 + 2 * CALL_NONCE_LEN + 1 + 2 * MAC_LEN;

const CALL_DOMAIN: &str = "kvmesh grpc call v1";

/// Labels of [`CallVerifier::refused`]: every [`CallRefusal::kind`].
pub const CALL_REFUSAL_KINDS: [&str; 5] = ["missing", "malformed", "bad_mac", "stale", "replayed"];

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
    /// The MAC is not this mesh's for this method, time and nonce.
    #[error("{CALL_HEADER} does not prove this mesh's secret for this call")]
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

fn mac_parts<'a>(ms: &'a [u8; 8], nonce: &'a [u8; CALL_NONCE_LEN], path: &'a str) -> [&'a [u8]; 3] {
    [ms, nonce, path.as_bytes()]
}

/// A fresh token for one call of `path` (`/package.Service/Method`) at
/// `now_unix_ms`.
pub fn sign_call(secret: &MeshSecret, path: &str, now_unix_ms: u64) -> Result<String, MintError> {
    let nonce: [u8; CALL_NONCE_LEN] = random_nonzero()?;
    let ms = now_unix_ms.to_le_bytes();
    let mac = secret.mac(CALL_DOMAIN, &mac_parts(&ms, &nonce, path));
    Ok(format!("{now_unix_ms}.{}.{}", hex(&nonce), hex(&mac)))
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

struct Token {
    ms: u64,
    nonce: [u8; CALL_NONCE_LEN],
    mac: [u8; MAC_LEN],
}

fn parse(raw: &[u8]) -> Result<Token, CallRefusal> {
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
    Ok(Token {
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

/// The receiving side: checks tokens, remembers nonces, counts refusals.
#[derive(Debug)]
pub struct CallVerifier {
    secret: MeshSecret,
    replay: Mutex<ReplayCache>,
    capacity: usize,
    refused: KindCounters<{ CALL_REFUSAL_KINDS.len() }>,
}

impl CallVerifier {
    /// A verifier for peers holding `secret`.
    pub fn new(secret: MeshSecret) -> Self {
        Self::with_capacity(secret, REPLAY_CAPACITY)
    }

    /// With a replay cache of `capacity` nonces (tests).
    pub fn with_capacity(secret: MeshSecret, capacity: usize) -> Self {
        Self {
            secret,
            replay: Mutex::default(),
            capacity: capacity.max(1),
            refused: KindCounters::default(),
        }
    }

    /// Checks the call's token (`None`: the entry is absent) for method
    /// `path` at `now_unix_ms`; counts a refusal by kind.
    pub fn check(
        &self,
        token: Option<&[u8]>,
        path: &str,
        now_unix_ms: u64,
    ) -> Result<(), CallRefusal> {
        let r = self.check_uncounted(token, path, now_unix_ms);
        if let Err(e) = &r {
            self.refused.bump(e.index());
        }
        r
    }

    fn check_uncounted(
        &self,
        token: Option<&[u8]>,
        path: &str,
        now: u64,
    ) -> Result<(), CallRefusal> {
        let t = parse(token.ok_or(CallRefusal::Missing)?)?;
        let ms = t.ms.to_le_bytes();
        if !self
            .secret
            .verify(CALL_DOMAIN, &mac_parts(&ms, &t.nonce, path), &t.mac)
        {
            return Err(CallRefusal::BadMac);
        }
        if now.abs_diff(t.ms) > CALL_WINDOW.as_millis() as u64 {
            return Err(CallRefusal::Stale {
                skew_ms: (i128::from(now) - i128::from(t.ms))
                    .clamp(i64::MIN.into(), i64::MAX.into()) as i64,
            });
        }
        self.replay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(t.ms, t.nonce, now, self.capacity)
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
mod tests {
    use super::*;

    const PATH: &str = "/kvmesh.internal.v1.Decode/Reserve";
    const NOW: u64 = 1_700_000_000_000;

    fn secret() -> MeshSecret {
        MeshSecret::generate().expect("rng")
    }

    #[test]
    fn a_fresh_token_passes_once() {
        let s = secret();
        let v = CallVerifier::new(s.clone());
        let t = sign_call(&s, PATH, NOW).expect("sign");
        assert_eq!(t.len(), 13 + 1 + 32 + 1 + 64);
        assert_eq!(v.check(Some(t.as_bytes()), PATH, NOW + 5), Ok(()));
        assert_eq!(
            v.check(Some(t.as_bytes()), PATH, NOW + 6),
            Err(CallRefusal::Replayed)
        );
        // A second token for the same call is fresh.
        let t2 = sign_call(&s, PATH, NOW).expect("sign");
        assert_eq!(v.check(Some(t2.as_bytes()), PATH, NOW), Ok(()));
        assert_eq!(v.refused_of("replayed"), 1);
    }

    #[test]
    fn every_refusal_kind_is_typed_and_counted() {
        let s = secret();
        let v = CallVerifier::new(s.clone());
        let good = sign_call(&s, PATH, NOW).expect("sign");
        let cases: Vec<(Option<Vec<u8>>, &str, u64, &str)> = vec![
            (None, PATH, NOW, "missing"),
            (Some(b"".to_vec()), PATH, NOW, "malformed"),
            (Some(b"1.2".to_vec()), PATH, NOW, "malformed"),
            (Some(b"1.2.3.4".to_vec()), PATH, NOW, "malformed"),
            (
                Some(good.replace('.', ",").into_bytes()),
                PATH,
                NOW,
                "malformed",
            ),
            (
                Some(good.to_uppercase().into_bytes()),
                PATH,
                NOW,
                "malformed",
            ),
            (
                Some(format!("-{good}").into_bytes()),
                PATH,
                NOW,
                "malformed",
            ),
            (
                Some(format!("{good}0").into_bytes()),
                PATH,
                NOW,
                "malformed",
            ),
            (Some(vec![0xff; 40]), PATH, NOW, "malformed"),
            (
                Some(format!("99999999999999999999999.{}", &good[14..]).into_bytes()),
                PATH,
                NOW,
                "malformed",
            ),
            // Another method, another secret, a changed time.
            (
                Some(good.clone().into_bytes()),
                "/kvmesh.internal.v1.Decode/Abort",
                NOW,
                "bad_mac",
            ),
            (
                Some(sign_call(&secret(), PATH, NOW).expect("sign").into_bytes()),
                PATH,
                NOW,
                "bad_mac",
            ),
            (
                Some(
                    good.replacen(&NOW.to_string(), &(NOW + 1).to_string(), 1)
                        .into_bytes(),
                ),
                PATH,
                NOW,
                "bad_mac",
            ),
            (
                Some(
                    sign_call(&MeshSecret::insecure(), PATH, NOW)
                        .expect("sign")
                        .into_bytes(),
                ),
                PATH,
                NOW,
                "bad_mac",
            ),
            // Honest but outside the window, either way.
            (Some(good.clone().into_bytes()), PATH, NOW + 60_001, "stale"),
            (Some(good.clone().into_bytes()), PATH, NOW - 60_001, "stale"),
        ];
        for (i, (token, path, now, kind)) in cases.iter().enumerate() {
            let e = v.check(token.as_deref(), path, *now).expect_err("refused");
            assert_eq!(e.kind(), *kind, "case {i}: {e}");
        }
        let counts = v.refused();
        assert_eq!(
            counts,
            [
                ("missing", 1),
                ("malformed", 9),
                ("bad_mac", 4),
                ("stale", 2),
                ("replayed", 0)
            ]
        );
        // The window's edges are inside it.
        assert_eq!(v.check(Some(good.as_bytes()), PATH, NOW + 60_000), Ok(()));
    }

    #[test]
    fn a_full_replay_cache_stays_bounded_and_never_admits_a_replay() {
        let s = secret();
        let v = CallVerifier::with_capacity(s.clone(), 4);
        let tokens: Vec<String> = (0..8)
            .map(|i| sign_call(&s, PATH, NOW + i).expect("sign"))
            .collect();
        for t in &tokens {
            assert_eq!(v.check(Some(t.as_bytes()), PATH, NOW + 10), Ok(()));
        }
        assert!(v.replay.lock().expect("lock").seen.len() <= 4);
        // Every earlier token is refused: the evicted ones as stale, the
        // remembered ones as replays.
        for (i, t) in tokens.iter().enumerate() {
            let e = v
                .check(Some(t.as_bytes()), PATH, NOW + 10)
                .expect_err("replay");
            let want = if i < 4 { "stale" } else { "replayed" };
            assert_eq!(e.kind(), want, "token {i}");
        }
        // Fresh tokens still pass.
        let fresh = sign_call(&s, PATH, NOW + 20).expect("sign");
        assert_eq!(v.check(Some(fresh.as_bytes()), PATH, NOW + 20), Ok(()));
        // Entries past the window are dropped as time moves on.
        let later = sign_call(&s, PATH, NOW + 200_000).expect("sign");
        assert_eq!(v.check(Some(later.as_bytes()), PATH, NOW + 200_000), Ok(()));
        assert_eq!(v.replay.lock().expect("lock").seen.len(), 1);
    }
}
