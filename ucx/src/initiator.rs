//! The initiator (prefill) side: per grant key, an endpoint to the
//! target's listener, bound by an acknowledged bind, puts, flushes.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::core::{Actor, Core, Event, Op, Runner, SockAddr};
use crate::error::UcxError;
use crate::{sys, AM_BIND, AM_BOUND, AM_FENCE, AM_FENCED};

/// Endpoints kept connected to each target, ready to bind.
const SPARES: usize = 2;
/// A spare older than this is closed (the target closes endpoints that
/// stay unbound for [`crate::target::BIND_TIMEOUT`]).
const SPARE_AGE: Duration = Duration::from_secs(30);

/// What a writer needs to reach a target: from the target's
/// [`crate::Target`], carried on kvmesh's authenticated control
/// connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    /// The target's listener.
    pub address: SocketAddr,
    /// The region's address in the target process.
    pub base: u64,
    /// The region's size in bytes.
    pub len: u64,
    /// The packed remote key.
    pub rkey: Vec<u8>,
}

/// A writer's UCX worker: one progress thread, any number of grants.
pub struct Initiator {
    runner: Runner<InitiatorState>,
    path: DataPath,
}

impl fmt::Debug for Initiator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Initiator")
    }
}

impl Initiator {
    /// Starts the worker, data path [`DataPath::Auto`].
    pub fn start() -> Result<Self, UcxError> {
        Self::with_path(DataPath::Auto)
    }

    /// Starts the worker with data path `path`.
    pub fn with_path(path: DataPath) -> Result<Self, UcxError> {
        crate::load()?;
        let runner = Runner::spawn("kvmesh-ucx-writer", move || {
            // RMA only for a path that may put: on this host's RDMA
            // device (`Auto`), or when asked (`Puts`).
            let rma = match path {
                DataPath::Puts => true,
                DataPath::Messages => false,
                DataPath::Auto => crate::rma_possible(),
            };
            let core = Core::with_rma("kvmesh-writer", rma)?;
            core.set_am_handler(AM_BOUND)?;
            core.set_am_handler(AM_FENCED)?;
            Ok(InitiatorState {
                core,
                path,
                grants: HashMap::new(),
                spares: HashMap::new(),
                by_ep: HashMap::new(),
            })
        })?;
        Ok(Self { runner, path })
    }

    /// Whether `key`'s endpoint sends puts (`Some(true)`) or data messages
    /// (`Some(false)`); `None` before it is bound.
    pub async fn uses_puts(&self, key: u64) -> Result<Option<bool>, UcxError> {
        self.runner
            .call(move |s: &mut InitiatorState| {
                s.grants.get(&key).and_then(|g| match g.path {
                    Path::Undecided => None,
                    Path::Puts => Some(true),
                    Path::Messages => Some(false),
                })
            })
            .await
    }

    /// The data path asked for at start.
    pub fn data_path(&self) -> DataPath {
        self.path
    }

    /// Connects an endpoint for `key` to `remote` and binds it: returns
    /// once the target acknowledged, so puts through it may start.
    /// Refused (the endpoint closed) if the target does not know the key
    /// or revoked it. On error or timeout the endpoint is released.
    pub async fn bind(
        &self,
        key: u64,
        remote: Arc<Remote>,
        timeout: Duration,
    ) -> Result<(), UcxError> {
        let (tx, rx) = oneshot::channel();
        self.runner
            .submit(Box::new(move |s: &mut InitiatorState| {
                s.bind(key, remote, tx)
            }))
            .await?;
        let r = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(UcxError::Stopped),
            Err(_) => Err(UcxError::Timeout("UCX bind acknowledgement")),
        };
        if r.is_err() {
            self.release(key);
        }
        r
    }

    /// Connects spare endpoints to `address` ahead of the first bind.
    pub fn prepare(&self, address: SocketAddr) {
        let job = Box::new(move |s: &mut InitiatorState| s.top_up(address));
        if self.runner.try_submit(job).is_err() {
            tracing::debug!(%address, "UCX spare endpoints not prepared: job queue full");
        }
    }

    /// Posts a put of `data` at `offset` in the target's region through
    /// `key`'s endpoint. It may land after this returns, or fail: only
    /// [`Self::flush`] tells.
    pub async fn put(&self, key: u64, offset: u64, data: Vec<u8>) -> Result<(), UcxError> {
        self.runner
            .submit(Box::new(move |s: &mut InitiatorState| {
                s.put(key, offset, data)
            }))
            .await
    }

    /// Returns once every put posted through `key` completed at the
    /// target (`ucp_ep_flush_nbx`). An error if any put failed, or the
    /// endpoint was closed (revoked): then some writes may not have
    /// landed, and the transfer must not be reported complete.
    pub async fn flush(&self, key: u64) -> Result<(), UcxError> {
        let (tx, rx) = oneshot::channel();
        self.runner
            .submit(Box::new(move |s: &mut InitiatorState| s.flush(key, tx)))
            .await?;
        rx.await.map_err(|_| UcxError::Stopped)?
    }

    /// Releases `key`'s endpoint (force close; nothing left to wait for
    /// after a flush). Fire and forget.
    pub fn release(&self, key: u64) {
        let job = Box::new(move |s: &mut InitiatorState| s.release(key));
        if self.runner.try_submit(job).is_err() {
            tracing::debug!(
                key,
                "UCX release not queued; the endpoint closes with the worker"
            );
        }
    }

    /// Endpoints open now (bound or binding), from the worker.
    pub async fn open_endpoints(&self) -> Result<usize, UcxError> {
        self.runner
            .call(|s: &mut InitiatorState| s.grants.len())
            .await
    }
}

struct GrantEp {
    ep: sys::ucp_ep_h,
    remote: Arc<Remote>,
    rkey: sys::ucp_rkey_h,
    /// How data travels on this endpoint (decided once bound).
    path: Path,
    failed: Option<UcxError>,
    bind: Option<oneshot::Sender<Result<(), UcxError>>>,
    /// Fences sent and not yet answered, by sequence number.
    fences: HashMap<u64, oneshot::Sender<Result<(), UcxError>>>,
    next_fence: u64,
    /// Data messages were sent since the last fence: a flush needs a
    /// fence. Without, it completes at once, as `ucp_ep_flush_nbx` does
    /// with nothing outstanding (so draining a grant the target has
    /// already revoked, whose endpoint it closed, does not wait on an
    /// answer that cannot come).
    unfenced: bool,
    closing: bool,
}

/// How a writer's data reaches the target's region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DataPath {
    /// Puts where the endpoint has an RMA lane (RDMA), data messages
    /// otherwise: UCX's software puts (its `tcp`) acknowledge each put from
    /// the target, and a failed acknowledgement (the writer died) aborts
    /// the target process inside UCX.
    #[default]
    Auto,
    /// Always one-sided puts (`ucp_put_nbx`; flushed by `ucp_ep_flush_nbx`).
    Puts,
    /// Always data messages (active messages the target lands only while
    /// the endpoint is bound to the key; flushed by a fence round trip).
    Messages,
}

/// What an endpoint uses, once decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Undecided,
    Puts,
    Messages,
}

/// An endpoint connected ahead of need, not yet bound to a key.
struct Spare {
    ep: sys::ucp_ep_h,
    born: Instant,
}

/// Who an endpoint belongs to.
#[derive(Clone, Copy)]
enum Owner {
    Grant(u64),
    Spare(SocketAddr),
}

struct InitiatorState {
    core: Core,
    path: DataPath,
    grants: HashMap<u64, GrantEp>,
    /// Connected endpoints per target, ready to bind: connecting (wire-up)
    /// takes milliseconds, binding a round trip.
    spares: HashMap<SocketAddr, VecDeque<Spare>>,
    /// Owners of live endpoints by address; an endpoint leaves when its
    /// close is requested (addresses are reused).
    by_ep: HashMap<usize, Owner>,
}

impl InitiatorState {
    /// A new endpoint to `address` (client-server, peer error mode).
    fn connect(&self, address: SocketAddr) -> Result<sys::ucp_ep_h, UcxError> {
        let sa = SockAddr::new(address);
        let mut p = self.core.ep_params();
        p.field_mask |=
            u64::from(sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR);
        p.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        p.sockaddr = sa.as_ucs();
        let mut ep: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: worker live; the address lives for the call.
        let st = unsafe {
            self.core
                .api
                .ucp()
                .ucp_ep_create(self.core.worker, &p, &mut ep)
        };
        UcxError::check(self.core.api, "ucp_ep_create", st)?;
        Ok(ep)
    }

    /// Keeps [`SPARES`] connected endpoints to `address`.
    fn top_up(&mut self, address: SocketAddr) {
        let have = self.spares.get(&address).map_or(0, VecDeque::len);
        for _ in have..SPARES {
            match self.connect(address) {
                Ok(ep) => {
                    self.by_ep.insert(ep as usize, Owner::Spare(address));
                    self.spares.entry(address).or_default().push_back(Spare {
                        ep,
                        born: Instant::now(),
                    });
                }
                Err(e) => {
                    tracing::debug!(%address, error = %e, "UCX spare endpoint not connected");
                    break;
                }
            }
        }
    }

    fn close_spare(&mut self, ep: sys::ucp_ep_h) {
        self.by_ep.remove(&(ep as usize));
        let (p, user) = self
            .core
            .request(Op::CloseSpare, sys::UCP_EP_CLOSE_FLAG_FORCE);
        // SAFETY: a live endpoint of this worker, closed once (it left
        // `spares` and `by_ep`).
        let ret = unsafe { self.core.api.ucp().ucp_ep_close_nbx(ep, &p) };
        self.core.posted(ret, user);
    }

    fn bind(
        &mut self,
        key: u64,
        remote: Arc<Remote>,
        reply: oneshot::Sender<Result<(), UcxError>>,
    ) {
        if self.grants.contains_key(&key) {
            let _ = reply.send(Err(UcxError::Address(format!(
                "key {key:#x} already bound"
            ))));
            return;
        }
        let spare = self
            .spares
            .get_mut(&remote.address)
            .and_then(VecDeque::pop_front);
        let ep = match spare {
            Some(s) => s.ep,
            None => match self.connect(remote.address) {
                Ok(ep) => ep,
                Err(e) => {
                    let _ = reply.send(Err(e));
                    return;
                }
            },
        };
        let address = remote.address;
        self.grants.insert(
            key,
            GrantEp {
                ep,
                remote,
                rkey: ptr::null_mut(),
                path: Path::Undecided,
                failed: None,
                bind: Some(reply),
                fences: HashMap::new(),
                next_fence: 0,
                unfenced: false,
                closing: false,
            },
        );
        self.by_ep.insert(ep as usize, Owner::Grant(key));
        self.core.send_am(ep, AM_BIND, key, 0, true);
        self.top_up(address);
    }

    fn bound(&mut self, key: u64) {
        let Some(g) = self.grants.get_mut(&key) else {
            return;
        };
        let Some(reply) = g.bind.take() else {
            return;
        };
        // A target without a remote-write registration (no RDMA device
        // there) sends no key: data messages only.
        if g.remote.rkey.is_empty() {
            if self.path == DataPath::Puts {
                let e = UcxError::Address(
                    "the target registered nothing for remote write: puts are refused".into(),
                );
                g.failed = Some(e.clone());
                let _ = reply.send(Err(e));
                return;
            }
            g.path = Path::Messages;
            let _ = reply.send(Ok(()));
            return;
        }
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: ep live and connected (the target answered through it);
        // the packed key is read for the call only.
        let st = unsafe {
            self.core
                .api
                .ucp()
                .ucp_ep_rkey_unpack(g.ep, g.remote.rkey.as_ptr().cast(), &mut rkey)
        };
        match UcxError::check(self.core.api, "ucp_ep_rkey_unpack", st) {
            Ok(()) => {
                g.rkey = rkey;
                // Wire-up is done (the target answered through it): the
                // lanes are final.
                g.path = match self.path {
                    DataPath::Puts => Path::Puts,
                    DataPath::Messages => Path::Messages,
                    DataPath::Auto if self.core.rma && self.core.ep_has_rma_lane(g.ep) => {
                        Path::Puts
                    }
                    DataPath::Auto => Path::Messages,
                };
                let _ = reply.send(Ok(()));
            }
            Err(e) => {
                g.failed = Some(e.clone());
                let _ = reply.send(Err(e));
            }
        }
    }

    fn put(&mut self, key: u64, offset: u64, data: Vec<u8>) {
        let Some(g) = self.grants.get_mut(&key) else {
            return;
        };
        let unbound = match g.path {
            Path::Undecided => true,
            Path::Puts => g.rkey.is_null(),
            Path::Messages => false,
        };
        if g.failed.is_some() || unbound || g.closing {
            g.failed.get_or_insert(UcxError::NotBound(key));
            return;
        }
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > g.remote.len) {
            g.failed = Some(UcxError::OutOfRange {
                offset,
                len: data.len(),
                region: g.remote.len,
            });
            return;
        }
        if g.path == Path::Messages {
            g.unfenced = true;
            let ep = g.ep;
            self.core.send_data(ep, key, offset, data);
            return;
        }
        let (ptr_, len) = (data.as_ptr(), data.len());
        let remote = g.remote.base + offset;
        let (ep, rkey) = (g.ep, g.rkey);
        let (p, user) = self.core.request(Op::Put { key, _data: data }, 0);
        // SAFETY: ep and rkey live; the data lives in the op box until
        // the request completes; the range is inside the region.
        let ret = unsafe {
            self.core
                .api
                .ucp()
                .ucp_put_nbx(ep, ptr_.cast(), len, remote, rkey, &p)
        };
        self.core.posted(ret, user);
    }

    fn flush(&mut self, key: u64, reply: oneshot::Sender<Result<(), UcxError>>) {
        let Some(g) = self.grants.get(&key) else {
            let _ = reply.send(Err(UcxError::NotBound(key)));
            return;
        };
        if let Some(e) = &g.failed {
            let _ = reply.send(Err(e.clone()));
            return;
        }
        if g.path == Path::Messages {
            // Answered once the target handled every data message before
            // it (one lane, eager: in order).
            let Some(g) = self.grants.get_mut(&key) else {
                return;
            };
            if !g.unfenced {
                let _ = reply.send(Ok(()));
                return;
            }
            // Covers every data message sent before it (one lane, in
            // order); later ones set `unfenced` again.
            g.unfenced = false;
            let seq = g.next_fence;
            g.next_fence += 1;
            g.fences.insert(seq, reply);
            let ep = g.ep;
            self.core.send_am(ep, AM_FENCE, key, seq, true);
            return;
        }
        let ep = g.ep;
        let (p, user) = self.core.request(Op::Flush { key, reply }, 0);
        // SAFETY: ep live.
        let ret = unsafe { self.core.api.ucp().ucp_ep_flush_nbx(ep, &p) };
        self.core.posted(ret, user);
    }

    fn release(&mut self, key: u64) {
        let Some(g) = self.grants.get_mut(&key) else {
            return;
        };
        if g.closing {
            return;
        }
        g.closing = true;
        if !g.rkey.is_null() {
            // SAFETY: unpacked once, destroyed once, before the endpoint.
            unsafe { self.core.api.ucp().ucp_rkey_destroy(g.rkey) };
            g.rkey = ptr::null_mut();
        }
        if let Some(reply) = g.bind.take() {
            let _ = reply.send(Err(UcxError::Closed(key)));
        }
        for (_, reply) in g.fences.drain() {
            let _ = reply.send(Err(UcxError::Closed(key)));
        }
        // Later events about this address are not this endpoint's.
        self.by_ep.remove(&(g.ep as usize));
        // Flushed, not forced, unless the endpoint already failed (then
        // nothing more reaches the target through it).
        let force = g.failed.is_some();
        self.core.close_ep(g.ep, key, force);
    }

    fn fail(&mut self, key: u64, e: UcxError) {
        if let Some(g) = self.grants.get_mut(&key) {
            if let Some(reply) = g.bind.take() {
                let _ = reply.send(Err(e.clone()));
            }
            for (_, reply) in g.fences.drain() {
                let _ = reply.send(Err(e.clone()));
            }
            g.failed.get_or_insert(e);
        }
    }

    fn fenced(&mut self, key: u64, seq: u64) {
        if let Some(g) = self.grants.get_mut(&key) {
            if let Some(reply) = g.fences.remove(&seq) {
                let _ = reply.send(match &g.failed {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                });
            }
        }
    }
}

impl Actor for InitiatorState {
    fn core(&self) -> &Core {
        &self.core
    }

    fn handle(&mut self, events: Vec<Event>) {
        for e in events {
            match e {
                Event::Am { id, key, .. } if id == AM_BOUND => self.bound(key),
                Event::Am { id, key, aux, .. } if id == AM_FENCED => self.fenced(key, aux),
                Event::Am { .. } | Event::Conn(_) => {}
                Event::EpError { ep, status } => match self.by_ep.get(&(ep as usize)) {
                    Some(&Owner::Grant(key)) => {
                        tracing::debug!(key, status, "UCX writer endpoint failed");
                        self.fail(key, UcxError::Closed(key));
                        // An endpoint in error is still the user's to close.
                        self.release(key);
                    }
                    Some(&Owner::Spare(address)) => {
                        if let Some(q) = self.spares.get_mut(&address) {
                            q.retain(|s| s.ep != ep);
                        }
                        self.close_spare(ep);
                    }
                    None => {}
                },
                Event::Done { op, status } => match op {
                    Op::Put { key, .. } if status != sys::UCS_OK => {
                        let e = UcxError::status(self.core.api, "ucp_put_nbx", status);
                        self.fail(key, e);
                    }
                    Op::Data { key, .. } if status != sys::UCS_OK => {
                        let e = UcxError::status(self.core.api, "ucp_am_send_nbx", status);
                        self.fail(key, e);
                    }
                    Op::Flush { key, reply } => {
                        let failed = self.grants.get(&key).and_then(|g| g.failed.clone());
                        let r = match (status, failed) {
                            (_, Some(e)) => Err(e),
                            (sys::UCS_OK, None) => Ok(()),
                            (st, None) => {
                                Err(UcxError::status(self.core.api, "ucp_ep_flush_nbx", st))
                            }
                        };
                        let _ = reply.send(r);
                    }
                    Op::Close { id: key } => {
                        self.grants.remove(&key);
                    }
                    Op::Put { .. } | Op::Data { .. } | Op::Am { .. } | Op::CloseSpare => {}
                },
            }
        }
    }

    fn housekeeping(&mut self, now: Instant) {
        // The target closes endpoints that stay unbound for its bind
        // timeout: renew spares well before.
        let mut old = Vec::new();
        for q in self.spares.values_mut() {
            while q
                .front()
                .is_some_and(|s| now.duration_since(s.born) > SPARE_AGE)
            {
                if let Some(s) = q.pop_front() {
                    old.push(s.ep);
                }
            }
        }
        for ep in old {
            self.close_spare(ep);
        }
    }

    fn shutdown(&mut self) {
        let keys: Vec<u64> = self.grants.keys().copied().collect();
        for k in keys {
            self.release(k);
        }
        let spares: Vec<sys::ucp_ep_h> = self
            .spares
            .drain()
            .flat_map(|(_, q)| q.into_iter().map(|s| s.ep))
            .collect();
        for ep in spares {
            self.close_spare(ep);
        }
        let end = Instant::now() + Duration::from_secs(2);
        while !self.grants.is_empty() && Instant::now() < end {
            let ev = self.core.progress();
            if ev.is_empty() {
                std::thread::sleep(Duration::from_micros(200));
            } else {
                self.handle(ev);
            }
        }
    }
}
