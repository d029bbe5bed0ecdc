//! The decode node's reservation table: grants, landing, verification,
//! aborts, leases, and revocation, one entry per reservation.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};

use crate::shm::PeerProcess;
use crate::transport::{Landing, Revocation};
use kvmesh_counters::KindCounters;
use kvmesh_kvpool::KvPool;
use kvmesh_kvpool::{Namespace, PageKey, Reservation};
use kvmesh_kvwire::{
    Abort, AbortConfirmed, AbortReason, Capability, FrameReject, Geometry, Grant, KvFrame,
    RejectCounters, ReservationId, Revoke, TransferDone, WriterId,
};

use super::error::{Ended, HandshakeError, Outcome, ReserveError, RevokeCause};
use super::live::{LiveSequence, Pending};
use super::stats::{TableStats, CONTROL_REJECT_KINDS, OUTCOME_KINDS};
use super::verify::verify;

mod ending;
mod landing;

/// How long the table remembers ended reservations (to answer a late
/// message with "already ended" rather than "unknown").
const TOMBSTONES: usize = 4096;

/// The decode side's timing and limits.
#[derive(Clone, Debug)]
pub struct TableConfig {
    /// How long a grant may stay unfinished (no transfer-done) before it
    /// is revoked and freed.
    pub lease: Duration,
    /// How long an abort may wait for the writer's confirmation before the
    /// write path is revoked and the pages freed.
    pub abort_timeout: Duration,
    /// The longest sequence (prompt + new tokens) this node serves: its
    /// own re-check of I3.
    pub max_seq_tokens: usize,
}

/// A request for pages: the prompt's tokens, the decode budget, and the
/// writer (prefill process) that will fill the prompt's pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReserveRequest {
    /// Prompt tokens: the transfer must cover exactly these (less a
    /// cached head).
    pub prompt_tokens: usize,
    /// Tokens to generate: reserved up front, so a live sequence never
    /// waits for pages.
    pub max_new_tokens: usize,
    /// The writer the grant is bound to.
    pub writer: WriterId,
    /// The prompt's namespace and the keys of its full pages, when the
    /// pool's prefix cache may supply a head of them: those pages are
    /// leased, not granted, and the grant's `cached_tokens` says how many
    /// positions the writer skips. The page holding the last prompt token
    /// is always granted (the transfer is never empty).
    pub cached: Option<(Namespace, Vec<PageKey>)>,
}

/// Identifies one writer connection for the life of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

/// Outbound control messages of one connection, encoded. The channel is
/// bounded by the pool's page count plus slack: each reservation sends at
/// most one message (Abort or Revoke) and holds at least one page, so the
/// bound is never reached while the connection is drained.
pub type Outbound = mpsc::Sender<Vec<u8>>;

/// The phase of a reservation. The pages move from variant to variant by
/// value, so exactly one phase holds them; `Ended` holds none.
#[derive(Debug)]
enum Phase {
    /// Granted; nothing landed yet.
    Granted(Reservation),
    /// Frames landing (receiver-checked transports) .
    Writing(Reservation),
    /// Aborted; waiting for the writer's confirmation.
    Aborting {
        res: Reservation,
        reason: AbortReason,
        deadline: Instant,
    },
    /// Ending, but the write path is not closed yet (an active one-sided
    /// write of a live writer): the pages stay held, quarantined.
    Revoking { res: Reservation, outcome: Outcome },
    /// Ended; the pages were released or handed to a live sequence.
    Ended(Outcome),
    /// Only while a transition runs, under the entry lock.
    Moving,
}

impl Phase {
    fn name(&self) -> &'static str {
        match self {
            Self::Granted(_) => "granted",
            Self::Writing(_) => "writing",
            Self::Aborting { .. } => "aborting",
            Self::Revoking { .. } => "revoking",
            Self::Ended(_) => "ended",
            Self::Moving => "moving",
        }
    }
}

#[derive(Debug)]
struct Entry {
    grant: Grant,
    conn: ConnId,
    /// The writer's process, where the transport watches it; kept after
    /// its connection is gone, for revocations still pending then.
    peer: Option<Arc<PeerProcess>>,
    lease_deadline: Instant,
    phase: Phase,
    waiter: Option<oneshot::Sender<Result<LiveSequence, Ended>>>,
    /// Scratch for frame payloads, reused.
    scratch: Vec<f32>,
    /// Receiver-checked transports: per (grant page, layer), the slots
    /// that landed contiguously from slot 0. Publishing never raises a
    /// watermark past what landed, whatever transfer-done claims.
    landed: Vec<u32>,
    /// Injected faults (testing builds).
    faults: kvmesh_faults::FaultPlan,
    /// The span of the request this reservation serves (decode's stream),
    /// parent of the handshake's spans; none unless handed one
    /// ([`ReservationTable::set_span`]).
    span: tracing::Span,
}

/// A span of the handshake: a child of its reservation's span, made only
/// when the reservation has one (so with traces off nothing is made and
/// the check is one branch). The target is `kvmesh_telemetry::TARGET`,
/// spelled out: this crate does not link the telemetry crate.
macro_rules! kv_span {
    ($parent:expr, $($t:tt)*) => {{
        let parent: &tracing::Span = $parent;
        if parent.is_disabled() {
            tracing::Span::none()
        } else {
            tracing::info_span!(target: "kvmesh_trace", parent: parent, $($t)*)
        }
    }};
}
pub(crate) use kv_span;

#[derive(Debug)]
struct Conn {
    writer: WriterId,
    tx: Outbound,
    peer: Option<Arc<PeerProcess>>,
}

#[derive(Debug, Default)]
struct Conns {
    next: u64,
    by_id: HashMap<ConnId, Conn>,
    by_writer: HashMap<WriterId, ConnId>,
}

#[derive(Debug, Default)]
struct Tombstones {
    order: VecDeque<ReservationId>,
    outcome: HashMap<ReservationId, &'static str>,
}

/// The decode node's reservation table. Cheap to clone (shared).
///
/// # Rules it keeps (those of `protocol_model`)
/// - Reserve allocates every page of prompt plus decode budget, or none,
///   and binds the grant to one writer connection.
/// - A frame lands only while its reservation is granted or writing, on
///   the bound connection, and after [`Grant::check_frame`]; it never
///   raises a watermark.
/// - Transfer-done: the write path is revoked first, then I4 is verified;
///   pass makes the sequence live (watermarks set), fail revokes and
///   frees. A transfer-done in any other phase is refused.
/// - Abort before live: the phase becomes aborting, the writer is told,
///   the pages stay held until its confirmation (then revoke, which is
///   immediate, and free) or until the abort timeout (revoke, then free).
/// - Lease expiry: revoke, then free. Never free on a timeout alone.
/// - Connection lost: every reservation bound to it that is not live is
///   revoked and freed.
/// - Revocation that cannot complete (an active one-sided write of a live
///   writer) quarantines the pages; [`Self::tick`] retries.
/// - Every reservation ends exactly once; [`TableStats::ended_by`] counts.
#[derive(Clone, Debug)]
pub struct ReservationTable {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pool: KvPool,
    landing: Arc<dyn Landing>,
    cfg: TableConfig,
    geometry: Geometry,
    /// Where writers reach this node, as written in grants; set by the
    /// listener once bound.
    endpoint: Mutex<String>,
    entries: Mutex<HashMap<ReservationId, Arc<Mutex<Entry>>>>,
    conns: Mutex<Conns>,
    tombstones: Mutex<Tombstones>,
    granted: AtomicU64,
    refused: AtomicU64,
    frames_landed: AtomicU64,
    /// KV bytes of verified transfers (see [`TableStats::kv_bytes_received`]).
    kv_bytes_received: AtomicU64,
    ended: KindCounters<{ OUTCOME_KINDS.len() }>,
    frame_rejects: RejectCounters,
    control_rejects: KindCounters<{ CONTROL_REJECT_KINDS.len() }>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent before anything
    // that could panic, so a poisoned lock is used as is.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unix_ms(at: Instant) -> u64 {
    let now = Instant::now();
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let wall = if at >= now {
        wall.saturating_add(at - now)
    } else {
        wall.saturating_sub(now - at)
    };
    u64::try_from(wall.as_millis()).unwrap_or(u64::MAX)
}

impl ReservationTable {
    /// A table over `pool`, whose writes arrive through `landing`.
    pub fn new(
        pool: KvPool,
        landing: Arc<dyn Landing>,
        cfg: TableConfig,
    ) -> Result<Self, kvmesh_kvwire::WireError> {
        let geometry = crate::landing::pool_geometry(pool.config())?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                landing,
                cfg,
                geometry,
                endpoint: Mutex::new(String::from("unbound:")),
                entries: Mutex::default(),
                conns: Mutex::default(),
                tombstones: Mutex::default(),
                granted: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                frames_landed: AtomicU64::new(0),
                kv_bytes_received: AtomicU64::new(0),
                ended: KindCounters::default(),
                frame_rejects: RejectCounters::default(),
                control_rejects: KindCounters::default(),
            }),
        })
    }

    /// The pool.
    pub fn pool(&self) -> &KvPool {
        &self.inner.pool
    }

    /// The transport's landing side.
    pub fn landing(&self) -> &Arc<dyn Landing> {
        &self.inner.landing
    }

    /// Sets the endpoint written into grants (the listener's address).
    pub fn set_endpoint(&self, endpoint: &str) {
        *lock(&self.inner.endpoint) = endpoint.to_owned();
    }

    /// The endpoint written into grants.
    pub fn endpoint(&self) -> String {
        lock(&self.inner.endpoint).clone()
    }

    /// The pool's page shape on the wire.
    pub fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    /// Reserves pages and issues a grant bound to `req.writer`'s
    /// connection. No partial grants.
    pub fn reserve(&self, req: ReserveRequest) -> Result<(Grant, Pending), ReserveError> {
        let r = self.inner.reserve(req);
        if r.is_err() {
            self.inner.refused.fetch_add(1, Ordering::Relaxed);
        }
        let (grant, rx) = r?;
        let pending = Pending {
            id: grant.reservation,
            rx: Some(rx),
            table: Arc::downgrade(&self.inner),
        };
        Ok((grant, pending))
    }

    /// Registers a writer connection (after its Hello). `tx` carries this
    /// table's messages to it; `peer` is its process where known.
    pub fn register(
        &self,
        writer: WriterId,
        tx: Outbound,
        peer: Option<PeerProcess>,
    ) -> Result<ConnId, HandshakeError> {
        let mut conns = lock(&self.inner.conns);
        if conns.by_writer.contains_key(&writer) {
            self.inner
                .control_rejects
                .bump_label(&CONTROL_REJECT_KINDS, "duplicate_writer");
            return Err(HandshakeError::DuplicateWriter(writer));
        }
        conns.next += 1;
        let id = ConnId(conns.next);
        conns.by_writer.insert(writer, id);
        conns.by_id.insert(
            id,
            Conn {
                writer,
                tx,
                peer: peer.map(Arc::new),
            },
        );
        Ok(id)
    }

    /// Makes `span` (the request's, at decode) the parent of reservation
    /// `id`'s handshake spans: `kv.verify`, `kv.abort`,
    /// `kv.abort_confirmed`, `kv.revoke`. Unknown ids are ignored.
    pub fn set_span(&self, id: ReservationId, span: tracing::Span) {
        if let Ok(entry) = self.inner.entry(id) {
            lock(&entry).span = span;
        }
    }

    /// Attaches a request's injected faults to reservation `id` (testing
    /// builds act on them; see `crate::fault`). Unknown ids are ignored.
    pub fn set_faults(&self, id: ReservationId, faults: kvmesh_faults::FaultPlan) {
        if let Ok(entry) = self.inner.entry(id) {
            lock(&entry).faults = faults;
        }
    }

    /// Writers connected now.
    pub fn connected_writers(&self) -> Vec<WriterId> {
        lock(&self.inner.conns).by_writer.keys().copied().collect()
    }

    /// Lands a frame that arrived on `conn` (receiver-checked transports).
    pub fn land_frame(&self, conn: ConnId, frame: &KvFrame<'_>) -> Result<(), HandshakeError> {
        let r = self.inner.land_frame(conn, frame);
        match &r {
            Ok(()) => {
                self.inner.frames_landed.fetch_add(1, Ordering::Relaxed);
            }
            Err(HandshakeError::Frame(f)) => self.inner.frame_rejects.record_frame(f),
            Err(e) => self
                .inner
                .control_rejects
                .bump_label(&CONTROL_REJECT_KINDS, e.kind()),
        }
        r
    }

    /// Handles a writer's transfer-done: revoke, verify (I4), and either
    /// hand the live sequence to the waiter or free.
    pub fn transfer_done(
        &self,
        conn: ConnId,
        done: &TransferDone,
    ) -> Result<Outcome, HandshakeError> {
        let r = self.inner.transfer_done(conn, done);
        if let Err(e) = &r {
            self.inner
                .control_rejects
                .bump_label(&CONTROL_REJECT_KINDS, e.kind());
        }
        r
    }

    /// Aborts a reservation that is not live yet (client gone, router or
    /// decode error). Idempotent. Returns the phase it is in afterwards
    /// (`"aborting"`, `"revoking"`) or how it had ended.
    pub fn abort(
        &self,
        id: ReservationId,
        reason: AbortReason,
    ) -> Result<&'static str, HandshakeError> {
        self.inner.abort(id, reason)
    }

    /// Handles a writer's abort confirmation.
    pub fn abort_confirmed(
        &self,
        conn: ConnId,
        msg: &AbortConfirmed,
    ) -> Result<Outcome, HandshakeError> {
        let r = self.inner.abort_confirmed(conn, msg);
        if let Err(e) = &r {
            self.inner
                .control_rejects
                .bump_label(&CONTROL_REJECT_KINDS, e.kind());
        }
        r
    }

    /// The connection ended: every reservation bound to it that is not
    /// live is revoked and freed (or quarantined while a one-sided write of
    /// a live process is active).
    pub fn connection_lost(&self, conn: ConnId) {
        self.inner.connection_lost(conn);
    }

    /// Timers: lease expiry, abort timeout, quarantined revocations.
    pub fn tick(&self, now: Instant) {
        self.inner.tick(now);
    }

    /// Ends every open reservation (node shutdown): revoke, then free.
    pub fn shutdown(&self) {
        for entry in self.inner.snapshot() {
            let mut e = lock(&entry);
            let id = e.grant.reservation;
            if matches!(e.phase, Phase::Ended(_)) {
                continue;
            }
            self.inner
                .end(&mut e, Outcome::Revoked(RevokeCause::Shutdown));
            drop(e);
            self.inner.forget_if_ended(id);
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TableStats {
        let entries = self.inner.snapshot();
        let revoking = entries
            .iter()
            .filter(|e| matches!(lock(e).phase, Phase::Revoking { .. }))
            .count();
        TableStats {
            granted: self.inner.granted.load(Ordering::Relaxed),
            refused: self.inner.refused.load(Ordering::Relaxed),
            open: entries.len(),
            revoking,
            frames_landed: self.inner.frames_landed.load(Ordering::Relaxed),
            kv_bytes_received: self.inner.kv_bytes_received.load(Ordering::Relaxed),
            ended_by: self.inner.ended.by_kind(&OUTCOME_KINDS),
            frame_rejects: self.inner.frame_rejects.total(),
            control_rejects: self.inner.control_rejects.by_kind(&CONTROL_REJECT_KINDS),
        }
    }

    /// The frame reject counters, by kind.
    pub fn frame_rejects(&self) -> &RejectCounters {
        &self.inner.frame_rejects
    }

    /// Counts a control-path refusal seen outside the table (the server's
    /// stream handling).
    pub(crate) fn count_control_reject(&self, e: &HandshakeError) {
        match e {
            HandshakeError::Frame(f) => self.inner.frame_rejects.record_frame(f),
            other => self
                .inner
                .control_rejects
                .bump_label(&CONTROL_REJECT_KINDS, other.kind()),
        }
    }
}

impl Inner {
    fn snapshot(&self) -> Vec<Arc<Mutex<Entry>>> {
        lock(&self.entries).values().cloned().collect()
    }

    fn entry(&self, id: ReservationId) -> Result<Arc<Mutex<Entry>>, HandshakeError> {
        if let Some(e) = lock(&self.entries).get(&id) {
            return Ok(Arc::clone(e));
        }
        match lock(&self.tombstones).outcome.get(&id) {
            Some(outcome) => Err(HandshakeError::AlreadyEnded { id, outcome }),
            None => Err(HandshakeError::UnknownReservation(id)),
        }
    }

    fn reserve(
        &self,
        req: ReserveRequest,
    ) -> Result<(Grant, oneshot::Receiver<Result<LiveSequence, Ended>>), ReserveError> {
        let ReserveRequest {
            prompt_tokens,
            max_new_tokens,
            writer,
            cached,
        } = req;
        if prompt_tokens == 0 {
            return Err(ReserveError::EmptyPrompt);
        }
        let requested = prompt_tokens.saturating_add(max_new_tokens);
        if requested > self.cfg.max_seq_tokens {
            return Err(ReserveError::TooLong {
                prompt_tokens,
                max_new_tokens,
                requested,
                max_seq_tokens: self.cfg.max_seq_tokens,
            });
        }
        let capacity = self.pool.capacity_tokens();
        if requested > capacity {
            return Err(ReserveError::OverCapacity {
                requested,
                capacity,
            });
        }
        let (conn, peer) = {
            let conns = lock(&self.conns);
            let id = *conns
                .by_writer
                .get(&writer)
                .ok_or(ReserveError::WriterNotConnected { writer })?;
            (id, conns.by_id.get(&id).and_then(|c| c.peer.clone()))
        };
        let page_size = self.pool.config().page_size;
        let reserved = match cached {
            Some((ns, mut keys)) => {
                // Never the page of the last prompt token.
                keys.truncate((prompt_tokens - 1) / page_size);
                self.pool.reserve_cached(&ns, &keys, requested)
            }
            None => self.pool.reserve(requested),
        };
        let res = reserved.map_err(|e| match e {
            kvmesh_kvpool::PoolError::Exhausted {
                requested_pages,
                free_pages,
            } => ReserveError::Exhausted {
                needed_pages: requested_pages,
                free_pages,
            },
            other => ReserveError::Pool(other),
        })?;
        let reservation = ReservationId::mint()?;
        let capability = Capability::mint()?;
        let cached_tokens = res.cached_tokens();
        let pages = res.held()[..(prompt_tokens - cached_tokens).div_ceil(page_size)].to_vec();
        // The key writes these pages only (one-sided transports check it).
        let write_key = self
            .landing
            .open(&pages)
            .map_err(|e| ReserveError::Transport(e.to_string()))?;
        let lease_deadline = Instant::now() + self.cfg.lease;
        let grant = Grant {
            reservation,
            capability,
            geometry: self.geometry,
            prompt_tokens: prompt_tokens as u64,
            cached_tokens: cached_tokens as u64,
            lease_deadline_unix_ms: unix_ms(lease_deadline),
            write_key,
            pages,
            endpoint: lock(&self.endpoint).clone(),
        };
        let (tx, rx) = oneshot::channel();
        let entry = Entry {
            grant: grant.clone(),
            conn,
            peer,
            lease_deadline,
            phase: Phase::Granted(res),
            waiter: Some(tx),
            scratch: Vec::new(),
            landed: vec![0; grant.pages.len() * usize::from(self.geometry.n_layers)],
            faults: kvmesh_faults::FaultPlan::none(),
            span: tracing::Span::none(),
        };
        lock(&self.entries).insert(reservation, Arc::new(Mutex::new(entry)));
        self.granted.fetch_add(1, Ordering::Relaxed);
        Ok((grant, rx))
    }
}

/// How many control messages a connection's outbound channel holds: one
/// per page (each reservation holds at least one page and sends at most
/// one Abort and one Revoke) plus slack.
pub fn outbound_capacity(pool: &KvPool) -> usize {
    pool.capacity_pages().saturating_mul(2).saturating_add(64)
}
