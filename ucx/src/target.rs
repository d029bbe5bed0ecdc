//! The target (decode) side: the registered region, the listener, and one
//! endpoint per grant key.
//!
//! # Key states (shared with callers; the actor owns the endpoints)
//! `Open` (the grant exists, no endpoint yet) -> `Bound` (the actor bound
//! a writer's endpoint to it and acknowledged) -> `Closing` (revoked: the
//! endpoint's close was requested) -> `Closed` (the close completed: no
//! write through it can land). A bind for a key that is not `Open`, or a
//! second bind on one endpoint, closes that endpoint. Revoking an `Open`
//! key completes at once: no endpoint can bind to it afterwards.

use std::collections::HashMap;
use std::fmt;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::core::{connectable, on_conn, socket_addr, Actor, Core, Event, Op, Runner, SockAddr};
use crate::error::UcxError;
use crate::gate::ListenGate;
use crate::sink::{on_data, Extents, HandlerArg, Sink};
use crate::{sys, AM_BIND, AM_BOUND, AM_DATA, AM_FENCE, AM_FENCED};

/// An endpoint that has not bound a key within this long is closed
/// (writers keep spare endpoints connected, renewed well before this).
pub const BIND_TIMEOUT: Duration = Duration::from_secs(60);

/// Endpoints without a bound key a target keeps at once, by default
/// ([`Options`]): a writer keeps two spares per target plus one per bind in
/// flight, so this is room for some 80 prefill writers. One more is closed
/// as soon as it is made ([`TargetStats::crowded`]), so whoever reaches the
/// listener holds at most this many endpoints, each for at most
/// [`BIND_TIMEOUT`].
pub const MAX_UNBOUND: usize = 256;

/// How a target is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Endpoints without a bound key at once.
    pub max_unbound: usize,
    /// Whether the region is registered for remote write (its packed key
    /// then lets writers put).
    pub remote_write: RemoteWrite,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_unbound: MAX_UNBOUND,
            remote_write: RemoteWrite::Auto,
        }
    }
}

/// Whether a context asks for RMA and a target registers its region for
/// remote write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteWrite {
    /// Where puts are hardware RMA ([`crate::rma_possible`]).
    Auto,
    /// Always: puts over UCX's software emulation too (tests of the put
    /// path on hosts without RDMA; never where strangers reach the UCX
    /// network).
    On,
    /// Never: data messages only.
    Off,
}

impl RemoteWrite {
    /// Whether it is on, here.
    pub fn enabled(self) -> bool {
        match self {
            Self::Auto => crate::rma_possible(),
            Self::On => true,
            Self::Off => false,
        }
    }
}

/// At shutdown, once no new connection is answered, how long the worker
/// must see no connection request before the listener may go: one
/// accepted before the door closed arrives within a round trip.
const CONN_QUIET: Duration = Duration::from_millis(20);

/// Where a revocation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revoke {
    /// No write through the key's endpoint can land any more.
    Complete,
    /// The endpoint's close is under way; ask again.
    Pending,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyState {
    Open,
    Bound,
    Closing,
    Closed,
}

/// Counters of a target.
#[derive(Debug, Default)]
pub struct TargetStats {
    /// Connections accepted (endpoints created from requests).
    pub connections: AtomicU64,
    /// Binds acknowledged.
    pub bound: AtomicU64,
    /// Binds refused (unknown, revoked or already bound key; second bind
    /// on an endpoint) and endpoints closed for not binding in time.
    pub refused: AtomicU64,
    /// Endpoints that failed (peer gone, reset).
    pub ep_errors: AtomicU64,
    /// Endpoint closes completed.
    pub closed: AtomicU64,
    /// Endpoints closed as soon as they were made: [`Options::max_unbound`]
    /// endpoints were already waiting for their bind.
    pub crowded: AtomicU64,
    /// Data messages landed (endpoints without an RMA lane).
    pub data_landed: AtomicU64,
    /// Data messages refused: their endpoint was not bound to their key
    /// (revoked: the close under way), or the range left the region or
    /// the key's pages.
    pub data_refused: AtomicU64,
    /// Of those, the ones bound to their key whose range left the key's
    /// pages (the [`Extents`] it was opened with): another grant's page.
    pub data_outside_grant: AtomicU64,
}

/// A key's state and the bytes it may write.
struct Key {
    state: KeyState,
    extents: Arc<Extents>,
}

struct Shared {
    keys: Mutex<HashMap<u64, Key>>,
    changed: Condvar,
    stats: Arc<TargetStats>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Key>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A registered region writers put into, and its listener. Dropping it
/// closes every endpoint, unregisters and unmaps the region (callers must
/// be done with the memory: the pool that lives in it holds the target).
pub struct Target {
    runner: Runner<TargetState>,
    shared: Arc<Shared>,
    address: SocketAddr,
    rkey: Vec<u8>,
    base: NonNull<u8>,
    len: usize,
    // Dropped after `runner` (fields drop in order): the registration is
    // released on the thread before the memory goes.
    _region: MmapRaw,
}

// SAFETY: `base` points into `_region`, which the target owns; the target
// hands the pointer out but never dereferences it.
unsafe impl Send for Target {}
// SAFETY: as above; everything else is Sync.
unsafe impl Sync for Target {}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("address", &self.address)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Maps `len` zeroed bytes, registers them for remote writes, and
    /// listens on `listen` (port 0: any), with the default [`Options`].
    pub fn start(listen: SocketAddr, len: usize) -> Result<Self, UcxError> {
        Self::start_with(listen, len, Options::default())
    }

    /// [`start`](Self::start) with `limits`.
    pub fn start_with(listen: SocketAddr, len: usize, options: Options) -> Result<Self, UcxError> {
        crate::load()?;
        let region = MmapRaw::from(
            memmap2::MmapOptions::new()
                .len(len.max(1))
                .map_anon()
                .map_err(|e| UcxError::os("map the KV region", e))?,
        );
        let base = NonNull::new(region.as_mut_ptr()).ok_or(UcxError::Os {
            op: "map the KV region",
            reason: "null mapping".into(),
        })?;
        let shared = Arc::new(Shared {
            keys: Mutex::default(),
            changed: Condvar::new(),
            stats: Arc::default(),
        });
        // An address, to cross to the thread; its provenance exposed, so
        // the sink's pointer made from it there is the mapping's.
        let (s, addr_of_base) = (Arc::clone(&shared), base.as_ptr().expose_provenance());
        let (info_tx, info_rx) = std::sync::mpsc::sync_channel(1);
        let runner = Runner::spawn("kvmesh-ucx-target", move || {
            let st = TargetState::new(s, listen, addr_of_base, len, options)?;
            let _ = info_tx.send((st.address, st.rkey.clone()));
            Ok(st)
        })?;
        let (address, rkey) = info_rx.recv().map_err(|_| UcxError::Stopped)?;
        Ok(Self {
            runner,
            shared,
            address,
            rkey,
            base,
            len,
            _region: region,
        })
    }

    /// Where writers connect (the listener's address; an unspecified bind
    /// address reads as loopback).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The region's packed remote key (`ucp_rkey_pack`), for writers;
    /// empty where the region is not registered for remote write (no RDMA
    /// device: [`crate::rma_possible`]), and writers send data messages.
    pub fn rkey(&self) -> &[u8] {
        &self.rkey
    }

    /// The region's address in this process (what writers put relative
    /// to).
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// The region's size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never, for a pool).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Counters.
    pub fn stats(&self) -> &TargetStats {
        &self.shared.stats
    }

    /// Accepts a bind for `key` (a fresh, unguessable value: the caller
    /// mints it), whose data messages may land in `extents` only (byte
    /// ranges of the region: the grant's pages). Refused if the key is in
    /// use. Puts (hardware RMA lanes) are bounded by the region's
    /// registration, not by `extents`.
    pub fn open(&self, key: u64, extents: Extents) -> Result<(), UcxError> {
        let mut keys = self.shared.lock();
        if keys.contains_key(&key) {
            return Err(UcxError::Address(format!("key {key:#x} already open")));
        }
        keys.insert(
            key,
            Key {
                state: KeyState::Open,
                extents: Arc::new(extents),
            },
        );
        Ok(())
    }

    /// Test hook: unregisters the region (`ucp_mem_unmap`) while
    /// endpoints stay up, to show that this does not fence writes.
    #[cfg(feature = "testing")]
    pub async fn unregister_region(&self) -> Result<(), UcxError> {
        self.runner
            .call(|s: &mut TargetState| s.unregister())
            .await?
    }

    /// Revokes `key`: closes its endpoint, if one bound, and waits up to
    /// `wait` for the close to complete. `Complete` means no write through
    /// the key can land any more; the key is then forgotten (revoking it
    /// again is `Complete`).
    pub fn revoke(&self, key: u64, wait: Duration) -> Revoke {
        let mut keys = self.shared.lock();
        match keys.get_mut(&key) {
            None => return Revoke::Complete,
            Some(Key {
                state: KeyState::Open | KeyState::Closed,
                ..
            }) => {
                keys.remove(&key);
                return Revoke::Complete;
            }
            Some(k) => {
                k.state = KeyState::Closing;
                // Asked again while closing: the job is idempotent, and
                // resubmitting covers a full queue last time.
                if self
                    .runner
                    .try_submit(Box::new(move |s: &mut TargetState| s.close_key(key)))
                    .is_err()
                {
                    tracing::debug!(key, "UCX job queue full; revocation retried later");
                }
            }
        }
        let (mut keys, _) = self
            .shared
            .changed
            .wait_timeout_while(keys, wait, |k| {
                k.get(&key).map(|k| k.state) == Some(KeyState::Closing)
            })
            .unwrap_or_else(PoisonError::into_inner);
        match keys.get(&key).map(|k| k.state) {
            Some(KeyState::Closing) => Revoke::Pending,
            _ => {
                keys.remove(&key);
                Revoke::Complete
            }
        }
    }
}

mod state;
use state::TargetState;
