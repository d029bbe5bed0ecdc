//! The prefill side: one connection to one decode node's pool
//! ([`KvClient`]) and a writer bound to exactly one grant ([`GrantWriter`]).
//!
//! # Rules kept (those of `protocol_model`)
//! - **Done means drained**: transfer-done is sent only after every layer
//!   of every page was written and the data path drained.
//! - **Answer every Abort**: whatever the writer knows of the reservation
//!   (writing, done, never seen), it stops for good and, once nothing of it
//!   is in flight, answers AbortConfirmed. An abort that overtakes its
//!   grant leaves a tombstone, so the grant is refused when it arrives.
//! - **Stop and confirm atomically**: each write and each abort take the
//!   grant's lock, so no write is posted after the abort is noted, and the
//!   confirmation is queued behind every write posted before it.
//! - A Revoke (lease expired, abort timed out) stops the grant without a
//!   confirmation: the decode node has closed the path already.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, Mutex as AsyncMutex};
use tokio::task::JoinHandle;

use kvmesh_faults::{Action, FaultPlan, Point};
use kvmesh_kvwire::{
    decode, encode_values, AbortConfirmed, Checksummer, DecodeLimits, Dtype, FirstToken, Geometry,
    Grant, Message, ReservationId, TransferDone, WireError, WriterId,
};
use kvmesh_meshauth::MeshSecret;

use super::greeting::greet;
use super::kind::Outbound;
use super::stream::{pump, read_message};
use super::{Endpoint, KvAuth, PageWrite, TransportError, TransportKind, WritePath};
use kvmesh_meshauth::tls::Purpose;

/// How long the decode node has to send its Challenge and answer Hello.
pub const WELCOME_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a tombstone of an unknown aborted reservation is kept.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(600);
/// How long past its lease a grant's slot is kept: after the lease the
/// grant itself is refused as expired, and the decode node has ended the
/// reservation (so no Abort for it can still come).
pub const SLOT_GRACE: Duration = Duration::from_secs(30);
/// Outbound queue of a connection, in messages (frames and control).
pub const OUTBOUND_QUEUE: usize = 256;

mod error;
pub use error::WriterError;

/// What the writer side knows of one reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// A [`GrantWriter`] holds the grant.
    Writing,
    /// Transfer-done was sent.
    Done,
    /// Aborted by the decode node: never write again.
    Aborted,
    /// Revoked by the decode node: never write again.
    Revoked,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    frames_sent: u64,
    forget_at: Instant,
}

type SlotRef = Arc<AsyncMutex<Slot>>;

#[derive(Debug)]
struct Shared {
    writer: WriterId,
    geometry: Geometry,
    tx: mpsc::Sender<Vec<u8>>,
    path: Box<dyn WritePath>,
    slots: Mutex<HashMap<ReservationId, SlotRef>>,
    /// Injected faults of grants with a plan (testing builds), for the
    /// abort confirmation, which the connection's reader sends.
    faults: Mutex<HashMap<ReservationId, FaultPlan>>,
}

/// A connection from a writer (prefill process) to one decode node's
/// pool. Cheap to clone.
#[derive(Clone, Debug)]
pub struct KvClient {
    shared: Arc<Shared>,
    tasks: Arc<Tasks>,
}

#[derive(Debug)]
struct Tasks {
    reader: JoinHandle<()>,
    pump: JoinHandle<()>,
}

impl Drop for Tasks {
    fn drop(&mut self) {
        self.reader.abort();
        self.pump.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl KvClient {
    /// Connects to `endpoint` (`tcp://HOST:PORT` or `unix:PATH`) as
    /// `writer`, answers the decode node's Challenge with a Hello proving
    /// `secret`, checks the Welcome's proof (the decode node is of this
    /// mesh: [`kvmesh_meshauth::kv`]), and maps the pool if the data path is
    /// shared memory. On TCP with `auth.tls`, all of it runs inside mutual
    /// TLS (the decode node's certificate must name the endpoint's host).
    pub async fn connect(
        endpoint: &str,
        writer: WriterId,
        auth: impl Into<KvAuth>,
    ) -> Result<Self, TransportError> {
        let auth = auth.into();
        let secret = &auth.secret;
        match Endpoint::parse(endpoint)? {
            Endpoint::Tcp(addr) => {
                let s = TcpStream::connect(&addr)
                    .await
                    .map_err(|source| TransportError::Io {
                        op: "connect tcp",
                        source,
                    })?;
                let _ = s.set_nodelay(true);
                let peer = s.peer_addr().ok().map(|a| a.ip());
                match &auth.tls {
                    None => Self::start(s, writer, secret, peer).await,
                    Some(tls) => {
                        let s = tls.connect(s, &addr, Purpose::Kv).await.map_err(|source| {
                            TransportError::Io {
                                op: "TLS handshake",
                                source,
                            }
                        })?;
                        Self::start(s, writer, secret, peer).await
                    }
                }
            }
            Endpoint::Unix(path) => {
                let s = UnixStream::connect(&path)
                    .await
                    .map_err(|source| TransportError::Io {
                        op: "connect unix socket",
                        source,
                    })?;
                Self::start(s, writer, secret, None).await
            }
        }
    }

    /// `peer`: the IP dialled (a UCX listener on an unspecified IP is
    /// reached there).
    async fn start<S>(
        stream: S,
        writer: WriterId,
        secret: &MeshSecret,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Self, TransportError>
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (mut rd, mut wr) = tokio::io::split(stream);
        let welcome =
            tokio::time::timeout(WELCOME_TIMEOUT, greet(&mut rd, &mut wr, writer, secret))
                .await
                .map_err(|_| TransportError::Timeout("challenge and welcome"))??;
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let path = TransportKind::write_path(&welcome, &Outbound { tx: &tx, peer })?;
        let shared = Arc::new(Shared {
            writer,
            geometry: welcome.geometry,
            tx,
            path,
            slots: Mutex::default(),
            faults: Mutex::default(),
        });
        let pump = tokio::spawn(pump(wr, rx));
        let reader = tokio::spawn(read_loop(Arc::clone(&shared), rd));
        Ok(Self {
            shared,
            tasks: Arc::new(Tasks { reader, pump }),
        })
    }

    /// This writer's id.
    pub fn writer(&self) -> WriterId {
        self.shared.writer
    }

    /// The pool's page shape.
    pub fn geometry(&self) -> Geometry {
        self.shared.geometry
    }

    /// Whether the connection is still up (its reader has not ended).
    pub fn is_connected(&self) -> bool {
        !self.tasks.reader.is_finished()
    }

    /// Takes up `grant`: the one writer for it on this connection.
    /// Refused if the grant was aborted or revoked before it arrived, if a
    /// writer for it exists, if its lease is over, or if its geometry is
    /// not the pool's.
    pub fn begin(&self, grant: Grant) -> Result<GrantWriter, WriterError> {
        let id = grant.reservation;
        if grant.geometry != self.shared.geometry {
            return Err(WriterError::GeometryMismatch {
                grant: grant.geometry,
                pool: self.shared.geometry,
            });
        }
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        if now_ms >= grant.lease_deadline_unix_ms {
            return Err(WriterError::Expired(id));
        }
        let ttl = Duration::from_millis(grant.lease_deadline_unix_ms - now_ms) + SLOT_GRACE;
        let slot = {
            let mut slots = lock(&self.shared.slots);
            let now = Instant::now();
            slots.retain(|_, s| s.try_lock().map_or(true, |s| s.forget_at > now));
            lock(&self.shared.faults).retain(|id, _| slots.contains_key(id));
            if let Some(existing) = slots.get(&id) {
                let state = existing.try_lock().map_or(SlotState::Writing, |s| s.state);
                return Err(match state {
                    SlotState::Aborted => WriterError::Aborted(id),
                    SlotState::Revoked => WriterError::Revoked(id),
                    SlotState::Writing | SlotState::Done => WriterError::DuplicateGrant(id),
                });
            }
            let slot = Arc::new(AsyncMutex::new(Slot {
                state: SlotState::Writing,
                frames_sent: 0,
                forget_at: now + ttl,
            }));
            slots.insert(id, Arc::clone(&slot));
            slot
        };
        let n_pages = grant.pages.len();
        Ok(GrantWriter {
            shared: Arc::clone(&self.shared),
            _tasks: Arc::clone(&self.tasks),
            grant,
            slot,
            next_layer: 0,
            sums: vec![Checksummer::new(); n_pages],
            encoded: Vec::new(),
            faults: FaultPlan::none(),
            frames: 0,
            bytes: 0,
            held_back: None,
        })
    }
}

/// Handles the decode node's messages: Abort (stop, drain, confirm) and
/// Revoke (stop). When the connection ends, every grant stops.
async fn read_loop<R: AsyncRead + Unpin>(shared: Arc<Shared>, mut rd: R) {
    let limits = DecodeLimits::default();
    let mut buf = Vec::new();
    while let Ok(true) = read_message(&mut rd, &mut buf, &limits).await {
        let (id, abort) = match decode(&buf, &limits) {
            Ok((Message::Abort(a), _)) => (a.reservation, true),
            Ok((Message::Revoke(r), _)) => (r.reservation, false),
            _ => continue,
        };
        let slot = {
            let mut slots = lock(&shared.slots);
            Arc::clone(slots.entry(id).or_insert_with(|| {
                // The abort overtook the grant: a tombstone refuses it later.
                Arc::new(AsyncMutex::new(Slot {
                    state: SlotState::Writing,
                    frames_sent: 0,
                    forget_at: Instant::now() + TOMBSTONE_TTL,
                }))
            }))
        };
        // Waits for a write in progress; after this no write of the grant
        // is posted.
        let mut s = slot.lock().await;
        if abort {
            if s.state != SlotState::Revoked {
                s.state = SlotState::Aborted;
            }
            let frames_sent = s.frames_sent;
            if shared.path.drain().await.is_err() {
                break;
            }
            let mut bytes = Vec::new();
            let msg = AbortConfirmed {
                reservation: id,
                frames_sent,
            };
            if msg.encode(&mut bytes).is_err() {
                break;
            }
            let fault = lock(&shared.faults)
                .remove(&id)
                .and_then(|f| f.at(Point::Confirm));
            match fault {
                // Withheld: the decode node must revoke, then free.
                Some(Action::Drop) => continue,
                Some(Action::Delay(d)) => {
                    let tx = shared.tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(d).await;
                        let _ = tx.send(bytes).await;
                    });
                    continue;
                }
                Some(Action::Duplicate) if shared.tx.send(bytes.clone()).await.is_err() => break,
                _ => {}
            }
            if shared.tx.send(bytes).await.is_err() {
                break;
            }
        } else {
            s.state = SlotState::Revoked;
        }
    }
    // The connection is gone: the decode node revokes everything bound to
    // it; stop every grant here too.
    let slots: Vec<SlotRef> = lock(&shared.slots).values().cloned().collect();
    for slot in slots {
        let mut s = slot.lock().await;
        if s.state == SlotState::Writing {
            s.state = SlotState::Revoked;
        }
    }
}

/// Writes one grant's prompt KV, layer by layer, then reports
/// transfer-done. Bound to exactly one grant; consumed by
/// [`GrantWriter::finish`].
#[derive(Debug)]
pub struct GrantWriter {
    shared: Arc<Shared>,
    _tasks: Arc<Tasks>,
    grant: Grant,
    slot: SlotRef,
    next_layer: u16,
    sums: Vec<Checksummer>,
    /// A page's K then V as the grant's dtype encodes them: what is
    /// hashed into `sums` and handed to the path (reused per page).
    encoded: Vec<u8>,
    /// Injected faults (testing builds).
    faults: FaultPlan,
    /// Page writes made so far (the `frame:N` fault index).
    frames: u32,
    /// K and V bytes handed to the path so far ([`GrantWriter::bytes_written`]).
    bytes: u64,
    /// `done=reorder`: the transfer's last page write, sent after
    /// transfer-done.
    held_back: Option<HeldWrite>,
}

impl Drop for GrantWriter {
    fn drop(&mut self) {
        // Finished, aborted or failed: the path's per-grant resources (a
        // UCX endpoint) go. The decode side revokes on its own schedule.
        self.shared.path.release(self.grant.write_key);
    }
}

/// A page write kept back by an injected reorder.
#[derive(Debug)]
struct HeldWrite {
    index: u32,
    layer: u16,
    slots: u32,
    /// K then V, encoded; K is the first `split` bytes.
    kv: Vec<u8>,
    split: usize,
}

impl GrantWriter {
    /// Injects `faults` into this grant's writes, transfer-done and abort
    /// confirmation (testing builds; see `crate::fault`).
    pub fn set_faults(&mut self, faults: FaultPlan) {
        if faults.is_empty() {
            return;
        }
        lock(&self.shared.faults).insert(self.grant.reservation, faults.clone());
        self.faults = faults;
    }

    /// The grant.
    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// Whether the grant may still be written: `Err` once the decode node
    /// aborted or revoked it (or the connection ended). Prefill checks it
    /// between layers to stop computing for a request that is gone.
    pub async fn check(&self) -> Result<(), WriterError> {
        let s = self.slot.lock().await;
        self.check_state(s.state)
    }

    /// Layers written so far.
    pub fn layers_written(&self) -> u16 {
        self.next_layer
    }

    /// K and V bytes written through the path so far (what a transfer
    /// costs the wire, framing aside).
    pub fn bytes_written(&self) -> u64 {
        self.bytes
    }

    /// Writes layer `layer` (the next one, in order) of every prompt
    /// position the grant covers: `k` and `v` hold `prompt_tokens * kv_dim`
    /// values each (`v` empty for latent entries), position-major, of which
    /// the first `cached_tokens` positions (the decode node's cached head)
    /// are skipped. One write per granted page.
    pub async fn write_layer(
        &mut self,
        layer: u16,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), WriterError> {
        if layer != self.next_layer || layer >= self.grant.geometry.n_layers {
            return Err(WriterError::OutOfOrder {
                expected: self.next_layer,
                got: layer,
            });
        }
        let kv_dim = self.grant.geometry.kv_dim() as usize;
        let n = self.grant.prompt_tokens as usize;
        let expected = n.saturating_mul(kv_dim);
        let latent = self.grant.geometry.entry.blocks() == 1;
        let v_expected = if latent { 0 } else { expected };
        for (field, got, expected) in [("k", k.len(), expected), ("v", v.len(), v_expected)] {
            if got != expected {
                return Err(WriterError::BadLength {
                    field,
                    expected,
                    got,
                });
            }
        }
        let page_size = self.grant.geometry.page_size as usize;
        let cached = self.grant.cached_tokens as usize;
        let mut s = self.slot.lock().await;
        self.check_state(s.state)?;
        let n_pages = self.grant.pages.len();
        let mut order: Vec<usize> = (0..n_pages).collect();
        for pos in 0..n_pages {
            if n_pages > 1
                && self.faults.at(Point::Frame(self.frames + pos as u32)) == Some(Action::Reorder)
            {
                let other = if pos + 1 < n_pages { pos + 1 } else { pos - 1 };
                order.swap(pos, other);
            }
        }
        let last_layer = layer + 1 == self.grant.geometry.n_layers;
        for (pos, &index) in order.iter().enumerate() {
            let slots = self.grant.prompt_slots(index).unwrap_or(0);
            // Page 0 of the grant starts after the decode node's cached head.
            let start = (cached + index * page_size) * kv_dim;
            let end = start + slots as usize * kv_dim;
            let (kp, vp) = (&k[start..end], if latent { v } else { &v[start..end] });
            // Encoded once (f32 on a little-endian host is its own
            // encoding, borrowed as is): hashed here, sent or stored as is
            // by the path.
            let dtype = self.grant.geometry.dtype;
            let mut kv = std::mem::take(&mut self.encoded);
            let (kb, vb): (&[u8], &[u8]) = match dtype {
                Dtype::F32 if cfg!(target_endian = "little") => {
                    (bytemuck::cast_slice(kp), bytemuck::cast_slice(vp))
                }
                _ => {
                    kv.clear();
                    encode_values(dtype, kp, &mut kv);
                    let split = kv.len();
                    encode_values(dtype, vp, &mut kv);
                    kv.split_at(split)
                }
            };
            if let Some(h) = self.sums.get_mut(index) {
                if !kvmesh_faults::planted(kvmesh_faults::PlantedBug::NoKvChecks) {
                    h.update(kb);
                    h.update(vb);
                }
            }
            let fault = self.faults.at(Point::Frame(self.frames));
            self.frames += 1;
            if last_layer
                && pos + 1 == n_pages
                && self.faults.at(Point::Done) == Some(Action::Reorder)
            {
                self.held_back = Some(HeldWrite {
                    index: index as u32,
                    layer,
                    slots,
                    kv: [kb, vb].concat(),
                    split: kb.len(),
                });
                continue;
            }
            let corrupted;
            let (kw, times) = match fault {
                Some(Action::Drop) => continue,
                Some(Action::Crash) => kvmesh_faults::crash(Point::Frame(self.frames - 1)),
                Some(Action::Delay(d)) => {
                    tokio::time::sleep(d).await;
                    (kb, 1)
                }
                Some(Action::Duplicate) => (kb, 2),
                Some(Action::Corrupt) => {
                    let mut c = kp.to_vec();
                    if let Some(x) = c.first_mut() {
                        *x = if *x == 1.0 { 2.0 } else { 1.0 };
                    }
                    let mut e = Vec::with_capacity(kb.len());
                    encode_values(dtype, &c, &mut e);
                    corrupted = e;
                    (corrupted.as_slice(), 1)
                }
                Some(Action::Reorder) | None => (kb, 1),
            };
            for _ in 0..times {
                self.shared
                    .path
                    .write(PageWrite {
                        grant: &self.grant,
                        index: index as u32,
                        layer,
                        slots: 0..slots,
                        k: kw,
                        v: vb,
                    })
                    .await?;
                s.frames_sent += 1;
                self.bytes += (kw.len() + vb.len()) as u64;
            }
            self.encoded = std::mem::take(&mut kv);
        }
        self.next_layer += 1;
        Ok(())
    }

    /// Drains and sends transfer-done with the per-page checksums and the
    /// first sampled token with its report. Refused before every layer is
    /// written, if the grant was aborted or revoked meanwhile, or if the
    /// message would be larger than a decode node accepts (prompt scores
    /// of a very long prompt): the decode node would refuse it, so it is
    /// never sent.
    pub async fn finish(self, first: impl Into<FirstToken>) -> Result<(), WriterError> {
        let first = first.into();
        let n_layers = self.grant.geometry.n_layers;
        if self.next_layer != n_layers {
            return Err(WriterError::Incomplete {
                written: self.next_layer,
                n_layers,
            });
        }
        let mut s = self.slot.lock().await;
        self.check_state(s.state)?;
        self.shared.path.drain_grant(self.grant.write_key).await?;
        let fault = self.faults.at(Point::Done);
        let mut page_checksums: Vec<u64> = self.sums.iter().map(Checksummer::finish).collect();
        match fault {
            Some(Action::Crash) => kvmesh_faults::crash(Point::Done),
            Some(Action::Delay(d)) => tokio::time::sleep(d).await,
            Some(Action::Corrupt) => {
                if let Some(c) = page_checksums.first_mut() {
                    *c ^= 1;
                }
            }
            _ => {}
        }
        let done = TransferDone {
            reservation: self.grant.reservation,
            capability: self.grant.capability.clone(),
            tokens_written: self.grant.prompt_tokens,
            first,
            page_checksums,
        };
        let mut bytes = Vec::new();
        done.encode(&mut bytes).map_err(TransportError::from)?;
        let max = DecodeLimits::default().max_message_bytes;
        if bytes.len() > max {
            return Err(TransportError::from(WireError::TooLarge {
                len: bytes.len() as u64,
                max: max as u64,
            })
            .into());
        }
        let times = match fault {
            Some(Action::Drop) => 0,
            Some(Action::Duplicate) => 2,
            _ => 1,
        };
        for _ in 0..times {
            self.shared
                .tx
                .send(bytes.clone())
                .await
                .map_err(|_| TransportError::Closed)?;
        }
        s.state = SlotState::Done;
        if let Some(h) = &self.held_back {
            // `done=reorder`: the last page write goes after transfer-done;
            // the decode node refuses it (path closed) and verification
            // has already failed for want of it.
            let _ = self
                .shared
                .path
                .write(PageWrite {
                    grant: &self.grant,
                    index: h.index,
                    layer: h.layer,
                    slots: 0..h.slots,
                    k: &h.kv[..h.split],
                    v: &h.kv[h.split..],
                })
                .await;
        }
        Ok(())
    }

    fn check_state(&self, state: SlotState) -> Result<(), WriterError> {
        let id = self.grant.reservation;
        match state {
            SlotState::Writing => Ok(()),
            SlotState::Aborted => Err(WriterError::Aborted(id)),
            SlotState::Revoked | SlotState::Done => Err(WriterError::Revoked(id)),
        }
    }
}
