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
            .call(|s: &mut TargetState| {
                if s.memh.is_null() {
                    return Ok(());
                }
                // SAFETY: the registration is live and released once.
                let st = unsafe { s.core.api.ucp().ucp_mem_unmap(s.core.ctx(), s.memh) };
                s.memh = ptr::null_mut();
                UcxError::check(s.core.api, "ucp_mem_unmap", st)
            })
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

struct Conn {
    ep: sys::ucp_ep_h,
    key: Option<u64>,
    since: Instant,
    closing: bool,
}

struct TargetState {
    core: Core,
    shared: Arc<Shared>,
    listener: sys::ucp_listener_h,
    /// The listener's socket, closed to new connections at shutdown
    /// before the listener goes (see `gate`).
    gate: Option<ListenGate>,
    /// Set at shutdown: connection requests are no longer taken.
    quiescing: bool,
    memh: sys::ucp_mem_h,
    address: SocketAddr,
    rkey: Vec<u8>,
    /// Endpoints by id (a serial: addresses are reused).
    eps: HashMap<u64, Conn>,
    /// Ids of live endpoints by address; an endpoint leaves when its
    /// close is requested, so later events about the address are not its.
    ids: HashMap<usize, u64>,
    by_key: HashMap<u64, u64>,
    next_id: u64,
    /// Where data messages land; after `core`, so it outlives the worker
    /// whose handler points at it. Unbound before an endpoint's close is
    /// asked for, so a data message of a revoked key is refused even
    /// before the close completes.
    sink: HandlerArg<Sink>,
    options: Options,
}

impl TargetState {
    fn new(
        shared: Arc<Shared>,
        listen: SocketAddr,
        base: usize,
        len: usize,
        options: Options,
    ) -> Result<Self, UcxError> {
        let core = Core::with_rma("kvmesh-target", options.remote_write.enabled())?;
        core.set_am_handler(AM_BIND)?;
        core.set_am_handler(AM_FENCE)?;
        let region = NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(base)).ok_or(
            UcxError::Os {
                op: "map the KV region",
                reason: "null mapping".into(),
            },
        )?;
        // The sink stays where it is allocated when `state` moves (see
        // `sink`'s module doc): UCX holds this pointer until the worker goes.
        let sink = HandlerArg::new(Sink::new(region, len, Arc::clone(&shared.stats)));
        core.set_handler(AM_DATA, Some(on_data), sink.arg())?;
        // Registered for remote write only where puts are hardware RMA
        // (`rma_possible`); elsewhere nothing but the sink writes here.
        let memh = if core.rma {
            // SAFETY: the range is a live mapping the Target owns and
            // drops only after this thread has unmapped the registration.
            unsafe { core.register(base as *mut _, len.max(1)) }?
        } else {
            ptr::null_mut()
        };
        let mut state = Self {
            core,
            shared,
            listener: ptr::null_mut(),
            gate: None,
            quiescing: false,
            memh,
            address: listen,
            rkey: Vec::new(),
            eps: HashMap::new(),
            ids: HashMap::new(),
            by_key: HashMap::new(),
            next_id: 0,
            sink,
            options,
        };
        match state.listen(listen) {
            Ok(()) => Ok(state),
            Err(e) => {
                state.shutdown();
                Err(e)
            }
        }
    }

    /// Packs the remote key (none without a registration: writers then
    /// send data messages) and starts the listener.
    fn listen(&mut self, listen: SocketAddr) -> Result<(), UcxError> {
        let state = self;
        let ucp = state.core.api.ucp();
        let memh = state.memh;
        if !memh.is_null() {
            let (mut buf, mut size): (*mut std::ffi::c_void, usize) = (ptr::null_mut(), 0);
            // SAFETY: memh is a live registration; out-pointers valid.
            let st = unsafe { ucp.ucp_rkey_pack(state.core.ctx(), memh, &mut buf, &mut size) };
            UcxError::check(state.core.api, "ucp_rkey_pack", st)?;
            // SAFETY: `size` bytes at `buf`, released right after the copy.
            state.rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
            // SAFETY: the buffer ucp_rkey_pack returned, released once.
            unsafe { ucp.ucp_rkey_buffer_release(buf) };
        }

        let sa = SockAddr::new(listen);
        // SAFETY: zeroed listener params are valid.
        let mut lp: sys::ucp_listener_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        lp.field_mask = u64::from(
            sys::UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | sys::UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        );
        lp.sockaddr = sa.as_ucs();
        lp.conn_handler.cb = Some(on_conn);
        lp.conn_handler.arg = state.core.queue_arg();
        // SAFETY: worker live; the address lives for the call.
        let st = unsafe { ucp.ucp_listener_create(state.core.worker, &lp, &mut state.listener) };
        UcxError::check(state.core.api, "ucp_listener_create", st)?;
        // SAFETY: zeroed attributes are valid; the mask selects the field.
        let mut attr: sys::ucp_listener_attr_t = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.field_mask = u64::from(sys::UCP_LISTENER_ATTR_FIELD_SOCKADDR);
        // SAFETY: listener live.
        let st = unsafe { ucp.ucp_listener_query(state.listener, &mut attr) };
        UcxError::check(state.core.api, "ucp_listener_query", st)?;
        let bound = socket_addr(&attr.sockaddr)
            .ok_or_else(|| UcxError::Address("listener has no IP address".into()))?;
        state.gate = ListenGate::find(bound);
        if state.gate.is_none() {
            tracing::warn!(%bound, "UCX listener's socket not found; its shutdown cannot close it first");
        }
        state.address = connectable(bound);
        Ok(())
    }

    fn close(&mut self, id: u64) {
        if let Some(c) = self.eps.get_mut(&id) {
            if !c.closing {
                c.closing = true;
                self.ids.remove(&(c.ep as usize));
                // Its data messages are refused from now on.
                self.sink.get().unbind(c.ep);
                self.core.close_ep(c.ep, id, true);
            }
        }
    }

    fn close_key(&mut self, key: u64) {
        if let Some(&ep) = self.by_key.get(&key) {
            self.close(ep);
        }
    }

    fn bind(&mut self, ep: sys::ucp_ep_h, key: u64) {
        let Some(&id) = self.ids.get(&(ep as usize)) else {
            return;
        };
        let Some(conn) = self.eps.get_mut(&id) else {
            return;
        };
        if conn.closing {
            return;
        }
        let accepted = conn
            .key
            .is_none()
            .then(|| {
                let mut keys = self.shared.lock();
                match keys.get_mut(&key) {
                    Some(k) if k.state == KeyState::Open => {
                        k.state = KeyState::Bound;
                        Some(Arc::clone(&k.extents))
                    }
                    _ => None,
                }
            })
            .flatten();
        if let Some(extents) = accepted {
            self.sink.get().bind(ep, key, extents);
            conn.key = Some(key);
            self.by_key.insert(key, id);
            self.shared.stats.bound.fetch_add(1, Ordering::Relaxed);
            self.core.send_am(ep, AM_BOUND, key, 0, false);
        } else {
            self.shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            self.close(id);
        }
    }

    fn closed(&mut self, id: u64) {
        let Some(conn) = self.eps.remove(&id) else {
            return;
        };
        self.shared.stats.closed.fetch_add(1, Ordering::Relaxed);
        if let Some(key) = conn.key {
            self.by_key.remove(&key);
            let mut keys = self.shared.lock();
            if let Some(k) = keys.get_mut(&key) {
                k.state = KeyState::Closed;
            }
            drop(keys);
            self.shared.changed.notify_all();
        }
    }
}

impl Actor for TargetState {
    fn core(&self) -> &Core {
        &self.core
    }

    fn handle(&mut self, events: Vec<Event>) {
        for e in events {
            match e {
                // Shutting down: a request taken before the door closed
                // is rejected. One left unanswered would keep its socket
                // in UCX's process-wide handler table after the worker is
                // gone, and crash the async thread when the peer closes.
                Event::Conn(req) if self.quiescing => {
                    // SAFETY: the listener is live until the end of
                    // shutdown; the request is answered exactly once.
                    let st = unsafe { self.core.api.ucp().ucp_listener_reject(self.listener, req) };
                    if st != sys::UCS_OK {
                        tracing::debug!(status = st, "UCX connection request not rejected");
                    }
                }
                Event::Conn(req) => {
                    let mut p = self.core.ep_params();
                    p.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_CONN_REQUEST);
                    p.conn_request = req;
                    let mut ep: sys::ucp_ep_h = ptr::null_mut();
                    // SAFETY: worker live; the request is handed to
                    // ep_create exactly once (or rejected below).
                    let st = unsafe {
                        self.core
                            .api
                            .ucp()
                            .ucp_ep_create(self.core.worker, &p, &mut ep)
                    };
                    if st == sys::UCS_OK {
                        self.shared
                            .stats
                            .connections
                            .fetch_add(1, Ordering::Relaxed);
                        let id = self.next_id;
                        self.next_id += 1;
                        self.ids.insert(ep as usize, id);
                        self.eps.insert(
                            id,
                            Conn {
                                ep,
                                key: None,
                                since: Instant::now(),
                                closing: false,
                            },
                        );
                        // Strangers may hold only so many endpoints that
                        // bound nothing: one more goes at once.
                        let unbound = self
                            .eps
                            .values()
                            .filter(|c| c.key.is_none() && !c.closing)
                            .count();
                        if unbound > self.options.max_unbound {
                            self.shared.stats.crowded.fetch_add(1, Ordering::Relaxed);
                            self.close(id);
                        }
                    } else {
                        // ucp_ep_create owns the request now: UCX 1.13
                        // rejects it on most failures (rejecting again
                        // would touch freed memory) and leaks it on a
                        // malformed one (an unknown `sa_data` version;
                        // docs/security.md).
                        tracing::debug!(
                            status = st,
                            "UCX endpoint from a connection request failed"
                        );
                    }
                }
                Event::Am { id, key, ep, .. } if id == AM_BIND && !ep.is_null() => {
                    self.bind(ep, key)
                }
                // Every data message before the fence was handled (one
                // lane, eager, in order): answer, if the key is still
                // bound here. A revoked one gets no answer; its close
                // fails the writer's fence.
                Event::Am { id, key, aux, ep } if id == AM_FENCE && !ep.is_null() => {
                    if self.sink.get().is_bound(ep, key) {
                        self.core.send_am(ep, AM_FENCED, key, aux, false);
                    }
                }
                Event::Am { .. } => {}
                Event::EpError { ep, status } => {
                    self.shared.stats.ep_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(status, "UCX endpoint failed");
                    if let Some(&id) = self.ids.get(&(ep as usize)) {
                        self.close(id);
                    }
                }
                Event::Done {
                    op: Op::Close { id },
                    ..
                } => self.closed(id),
                Event::Done { .. } => {}
            }
        }
    }

    fn housekeeping(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .eps
            .iter()
            .filter(|(_, c)| {
                c.key.is_none() && !c.closing && now.duration_since(c.since) > BIND_TIMEOUT
            })
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            self.shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            self.close(id);
        }
    }

    fn shutdown(&mut self) {
        let ucp = self.core.api.ucp();
        // UCX 1.13 crashes when a request it accepted arrives after the
        // listener is destroyed (see `gate`). So: no new connection is
        // answered from here on, the requests already accepted are drawn
        // out (and left to UCX, `handle`), the endpoints close, and the
        // listener goes last, right before the worker.
        self.quiescing = true;
        let door_closed = self.gate.as_ref().is_some_and(ListenGate::close);
        let ids: Vec<u64> = self.eps.keys().copied().collect();
        for id in ids {
            self.close(id);
        }
        let start = Instant::now();
        let end = start + Duration::from_secs(2);
        let mut last_conn = start;
        loop {
            let now = Instant::now();
            let drained = self.eps.is_empty()
                && (!door_closed || now.duration_since(last_conn) >= CONN_QUIET);
            if drained || now >= end {
                break;
            }
            let ev = self.core.progress();
            if ev.is_empty() {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                if ev.iter().any(|e| matches!(e, Event::Conn(_))) {
                    last_conn = Instant::now();
                }
                self.handle(ev);
            }
        }
        // SAFETY: the registration is live and released once; the worker
        // is destroyed after (Core's drop).
        unsafe {
            if !self.memh.is_null() {
                ucp.ucp_mem_unmap(self.core.ctx(), self.memh);
                self.memh = ptr::null_mut();
            }
        }
        // Every key that had an endpoint: nothing writes any more.
        let mut keys = self.shared.lock();
        for k in keys.values_mut() {
            if k.state != KeyState::Open {
                k.state = KeyState::Closed;
            }
        }
        drop(keys);
        self.shared.changed.notify_all();
        // SAFETY: the listener is live and destroyed once; the worker
        // (Core's drop) goes right after.
        unsafe {
            if !self.listener.is_null() {
                ucp.ucp_listener_destroy(self.listener);
                self.listener = ptr::null_mut();
            }
        }
    }
}
