//! The target's actor: the one thread that makes every UCX call of a
//! [`Target`](super::Target): connection requests, binds, fences,
//! revocations by endpoint close, the unbound-endpoint bound, and the
//! shutdown order UCX 1.13 needs.

use super::*;

struct Conn {
    ep: sys::ucp_ep_h,
    key: Option<u64>,
    since: Instant,
    closing: bool,
}

pub(super) struct TargetState {
    core: Core,
    shared: Arc<Shared>,
    listener: sys::ucp_listener_h,
    /// The listener's socket, closed to new connections at shutdown
    /// before the listener goes (see `gate`).
    gate: Option<ListenGate>,
    /// Set at shutdown: connection requests are no longer taken.
    quiescing: bool,
    memh: sys::ucp_mem_h,
    pub(super) address: SocketAddr,
    pub(super) rkey: Vec<u8>,
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
    /// Test hook: unregisters the region (`ucp_mem_unmap`) while
    /// endpoints stay up.
    #[cfg(feature = "testing")]
    pub(super) fn unregister(&mut self) -> Result<(), UcxError> {
        if self.memh.is_null() {
            return Ok(());
        }
        // SAFETY: the registration is live and released once.
        let st = unsafe {
            self.core
                .api
                .ucp()
                .ucp_mem_unmap(self.core.ctx(), self.memh)
        };
        self.memh = ptr::null_mut();
        UcxError::check(self.core.api, "ucp_mem_unmap", st)
    }

    pub(super) fn new(
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

    pub(super) fn close_key(&mut self, key: u64) {
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
