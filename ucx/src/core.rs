//! What both roles share: a UCP context and single-threaded worker, the
//! events UCX callbacks record, and the progress thread (an actor) that
//! owns them.
//!
//! # Callbacks
//! UCX calls back only from inside `ucp_worker_progress` on the progress
//! thread. Callbacks never touch the actor's state: they push an [`Event`]
//! onto a queue that lives in its own allocation (`arg` of every
//! callback), and the actor handles the events after progress returns. A
//! request's completion carries its [`Op`] (and with it any buffer the
//! operation reads) in a box passed as the request's user data.

use std::cell::RefCell;
use std::ffi::{c_void, CString};
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::ptr;

use tokio::sync::oneshot;

use crate::api::{load, Api};
use crate::error::UcxError;
use crate::sys;
pub(crate) use crate::transports::{check_tls, hardware_rma, DEFAULT_TLS};

pub(crate) use crate::addr::{connectable, socket_addr, SockAddr};
pub(crate) use crate::runner::{Actor, Runner};

/// What a callback recorded.
pub(crate) enum Event {
    /// A connection request on the listener.
    Conn(sys::ucp_conn_request_h),
    /// A control active message: `id`, the key and aux of its header, the
    /// endpoint to reply on (null if the sender asked for none).
    Am {
        id: u32,
        key: u64,
        aux: u64,
        ep: sys::ucp_ep_h,
    },
    /// An endpoint failed (peer gone, connection reset, closed by the
    /// peer).
    EpError {
        ep: sys::ucp_ep_h,
        status: sys::ucs_status_t,
    },
    /// A request completed.
    Done { op: Op, status: sys::ucs_status_t },
}

/// What a request was; owns what the request reads until it completes.
pub(crate) enum Op {
    /// An endpoint close; `id` is the role's name for the endpoint (never
    /// its address: UCX may reuse that for a new endpoint before this
    /// completion is handled).
    Close { id: u64 },
    /// A put of `data` for the grant `key`.
    Put { key: u64, _data: Vec<u8> },
    /// A data message for the grant `key`; its header and data.
    Data {
        key: u64,
        _header: Box<[u8; 16]>,
        _data: Vec<u8>,
    },
    /// A flush of the grant `key`'s endpoint.
    Flush {
        key: u64,
        reply: oneshot::Sender<Result<(), UcxError>>,
    },
    /// A control active message; its header.
    Am { _header: Box<[u8; 16]> },
    /// The close of an endpoint that never bound a key.
    CloseSpare,
}

type Queue = RefCell<Vec<Event>>;

struct OpBox {
    queue: *const Queue,
    op: Op,
}

/// A UCP context and worker with the features kvmesh uses (RMA, active
/// messages, wakeup), the worker single-threaded: only the progress thread
/// touches it.
pub(crate) struct Core {
    pub(crate) api: &'static Api,
    ctx: sys::ucp_context_h,
    pub(crate) worker: sys::ucp_worker_h,
    efd: i32,
    queue: *mut Queue,
    /// Whether the context has `UCP_FEATURE_RMA` ([`crate::rma_possible`]).
    pub(crate) rma: bool,
}

/// Settings kvmesh changes from UCX's defaults unless their variable is set.
/// The tcp transport's segments: 8 KiB by default, so a page write (12-24
/// KB for the default model) took several; with these, puts over loopback
/// went from 0.6-0.9 to 1.3-1.7 GB/s for 12-24 KB puts (the bench note has
/// the run).
const TUNING: &[(&str, &str, &str)] = &[
    // (name for ucp_config_modify: UCT keys go without their transport's
    // prefix, which it rejects; the variable that overrides it; value)
    ("TX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE", "64k"),
    ("RX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "128k"),
];

impl Core {
    /// A context and worker, with `UCP_FEATURE_RMA` when `rma` (see
    /// [`crate::rma_possible`]); `UCX_*` variables apply, `UCX_TLS` defaults to
    /// [`DEFAULT_TLS`] and is checked by [`check_tls`].
    pub(crate) fn with_rma(name: &str, rma: bool) -> Result<Self, UcxError> {
        let api = load()?;
        let tls = std::env::var("UCX_TLS").ok();
        if let Some(t) = &tls {
            check_tls(t)?;
        }
        let ucp = api.ucp();
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix/file mean the environment and defaults.
        let st = unsafe { ucp.ucp_config_read(ptr::null(), ptr::null(), &mut config) };
        UcxError::check(api, "ucp_config_read", st)?;
        if tls.is_none() {
            let (k, v) = (c"TLS", CString::new(DEFAULT_TLS).expect("no NUL"));
            // SAFETY: config is valid; strings are NUL-terminated.
            let st = unsafe { ucp.ucp_config_modify(config, k.as_ptr(), v.as_ptr()) };
            if let Err(e) = UcxError::check(api, "ucp_config_modify(TLS)", st) {
                // SAFETY: read above, released once.
                unsafe { ucp.ucp_config_release(config) };
                return Err(e);
            }
        }
        for (key, var, value) in TUNING {
            if std::env::var_os(var).is_some() {
                continue;
            }
            let (k, v) = (
                CString::new(*key).expect("no NUL"),
                CString::new(*value).expect("no NUL"),
            );
            // SAFETY: config valid; strings NUL-terminated.
            let st = unsafe { ucp.ucp_config_modify(config, k.as_ptr(), v.as_ptr()) };
            if st != sys::UCS_OK {
                // A UCX built without the tcp transport: nothing to tune.
                tracing::debug!(key, value, status = st, "UCX setting not applied");
            }
        }
        let cname = CString::new(name).map_err(|_| UcxError::Address(name.to_owned()))?;
        // SAFETY: all-zero is a valid ucp_params_t (no fields selected).
        let mut params: sys::ucp_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        params.field_mask = u64::from(sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME);
        params.features = u64::from(sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP);
        if rma {
            params.features |= u64::from(sys::UCP_FEATURE_RMA);
        }
        params.name = cname.as_ptr();
        let mut ctx: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config valid for the call; `ucp_init` is this
        // call with the header's version.
        let st = unsafe {
            ucp.ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut ctx,
            )
        };
        // SAFETY: read above, released once, not used after.
        unsafe { ucp.ucp_config_release(config) };
        UcxError::check(api, "ucp_init", st)?;
        // SAFETY: zeroed worker params are valid; the mask selects fields.
        let mut wp: sys::ucp_worker_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        wp.field_mask = u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE);
        wp.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut worker: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: ctx is a live context.
        let st = unsafe { ucp.ucp_worker_create(ctx, &wp, &mut worker) };
        if let Err(e) = UcxError::check(api, "ucp_worker_create", st) {
            // SAFETY: ctx is live and has no workers.
            unsafe { ucp.ucp_cleanup(ctx) };
            return Err(e);
        }
        let queue = Box::into_raw(Box::new(Queue::default()));
        let mut core = Self {
            api,
            ctx,
            worker,
            efd: -1,
            queue,
            rma,
        };
        let mut efd = -1;
        // SAFETY: worker is live; efd is an out-pointer.
        let st = unsafe { ucp.ucp_worker_get_efd(worker, &mut efd) };
        UcxError::check(api, "ucp_worker_get_efd", st)?;
        core.efd = efd;
        Ok(core)
    }

    /// Registers the handler of control messages `id` (any id but
    /// [`crate::AM_DATA`]), the queue as its `arg`.
    pub(crate) fn set_am_handler(&self, id: u32) -> Result<(), UcxError> {
        let cb: sys::ucp_am_recv_callback_t = Some(match id {
            crate::AM_BIND => on_bind,
            crate::AM_BOUND => on_bound,
            crate::AM_FENCE => on_fence,
            _ => on_fenced,
        });
        self.set_handler(id, cb, self.queue.cast())
    }

    /// Registers `cb` for active messages `id`, with `arg` (which must
    /// outlive the worker).
    pub(crate) fn set_handler(
        &self,
        id: u32,
        cb: sys::ucp_am_recv_callback_t,
        arg: *mut c_void,
    ) -> Result<(), UcxError> {
        // SAFETY: zeroed handler params are valid.
        let mut p: sys::ucp_am_handler_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = u64::from(
            sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
        );
        p.id = id;
        p.cb = cb;
        p.arg = arg;
        // SAFETY: worker live; the argument outlives the worker.
        let st = unsafe {
            self.api
                .ucp()
                .ucp_worker_set_am_recv_handler(self.worker, &p)
        };
        UcxError::check(self.api, "ucp_worker_set_am_recv_handler", st)
    }

    /// The error handler every endpoint gets (peer error-handling mode).
    pub(crate) fn ep_params(&self) -> sys::ucp_ep_params_t {
        // SAFETY: zeroed endpoint params are valid.
        let mut p: sys::ucp_ep_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.field_mask = u64::from(
            sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
        );
        p.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        p.err_handler.cb = Some(on_ep_error);
        p.err_handler.arg = self.queue.cast();
        p
    }

    /// Request parameters whose completion pushes `Done(op)`; the box goes
    /// to [`Self::posted`] with the call's return value.
    pub(crate) fn request(&self, op: Op, flags: u32) -> (sys::ucp_request_param_t, *mut c_void) {
        let user = Box::into_raw(Box::new(OpBox {
            queue: self.queue,
            op,
        }));
        // SAFETY: zeroed request params are valid.
        let mut p: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
        p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA;
        if flags != 0 {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = flags;
        }
        p.cb.send = Some(on_done);
        p.user_data = user.cast();
        (p, user.cast())
    }

    /// Accounts for a non-blocking call's return: completed at once (its
    /// `Done` is queued now, with its status) or in flight (the callback
    /// queues it).
    pub(crate) fn posted(&self, ret: sys::ucs_status_ptr_t, user: *mut c_void) {
        let status = if ret.is_null() {
            Some(sys::UCS_OK)
        } else if is_err(ret) {
            // A status in pointer form (UCS_PTR_STATUS).
            Some(ret as isize as sys::ucs_status_t)
        } else {
            None
        };
        if let Some(status) = status {
            // SAFETY: the callback will not run for a request that did
            // not start; the box is ours again.
            let b = unsafe { Box::from_raw(user.cast::<OpBox>()) };
            self.push(Event::Done { op: b.op, status });
        }
    }

    fn push(&self, e: Event) {
        // SAFETY: the queue lives as long as self; single thread.
        unsafe { &*self.queue }.borrow_mut().push(e);
    }

    /// Closes `ep`; `Done(Close { id })` follows. `force`: outstanding
    /// operations are cancelled and the transport connection torn down at
    /// once (the target's revocation). Otherwise (a writer done with a
    /// grant) outstanding puts are flushed first, so none reaches the
    /// target after its endpoint failed: UCX 1.13's software RMA (the
    /// `tcp` transport) aborts the target process when it cannot
    /// acknowledge a put on a failed endpoint.
    pub(crate) fn close_ep(&self, ep: sys::ucp_ep_h, id: u64, force: bool) {
        let flags = if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        let (p, user) = self.request(Op::Close { id }, flags);
        // SAFETY: ep is a live endpoint of this worker, closed once (the
        // callers track it).
        let ret = unsafe { self.api.ucp().ucp_ep_close_nbx(ep, &p) };
        self.posted(ret, user);
    }

    /// Sends control message `id` with header (`key`, `aux`) on `ep`.
    pub(crate) fn send_am(&self, ep: sys::ucp_ep_h, id: u32, key: u64, aux: u64, reply: bool) {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&key.to_le_bytes());
        h[8..].copy_from_slice(&aux.to_le_bytes());
        let header = Box::new(h);
        let hp = header.as_ptr();
        let flags = if reply {
            sys::UCP_AM_SEND_FLAG_REPLY
        } else {
            0
        };
        let (p, user) = self.request(Op::Am { _header: header }, flags);
        // SAFETY: ep live; the header lives in the op box until completion.
        let ret = unsafe {
            self.api
                .ucp()
                .ucp_am_send_nbx(ep, id, hp.cast(), 16, ptr::null(), 0, &p)
        };
        self.posted(ret, user);
    }

    /// Sends `data` for `key` at `offset` as a data message on `ep`
    /// (eager only, so that the target handles it in order with the fence
    /// after it; reply-ep, so that the target knows the endpoint).
    pub(crate) fn send_data(&self, ep: sys::ucp_ep_h, key: u64, offset: u64, data: Vec<u8>) {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&key.to_le_bytes());
        h[8..].copy_from_slice(&offset.to_le_bytes());
        let header = Box::new(h);
        let (hp, dp, len) = (header.as_ptr(), data.as_ptr(), data.len());
        let (p, user) = self.request(
            Op::Data {
                key,
                _header: header,
                _data: data,
            },
            sys::UCP_AM_SEND_FLAG_REPLY | sys::UCP_AM_SEND_FLAG_EAGER,
        );
        // SAFETY: ep live; header and data live in the op box until the
        // request completes.
        let ret = unsafe {
            self.api
                .ucp()
                .ucp_am_send_nbx(ep, crate::AM_DATA, hp.cast(), 16, dp.cast(), len, &p)
        };
        self.posted(ret, user);
    }

    /// Whether `ep`'s puts are hardware RMA (InfiniBand, RoCE: RDMA writes,
    /// no target CPU): it has RMA lanes and none is UCX's `tcp`. Over
    /// `tcp`, puts below the zero-copy size are emulated in software and
    /// acknowledged from the target, and an acknowledgement that fails
    /// (the writer died) aborts the target process inside UCX
    /// (`ucp_request_try_send`: "unexpected error", in 1.13 and upstream);
    /// data then travels as active messages instead. UCX 1.13 has no query
    /// for an endpoint's transports: this reads the lane table
    /// `ucp_ep_print_info` writes ([`hardware_rma`]).
    pub(crate) fn ep_has_rma_lane(&self, ep: sys::ucp_ep_h) -> bool {
        let (mut buf, mut size): (*mut libc::c_char, libc::size_t) = (ptr::null_mut(), 0);
        // SAFETY: out-pointers valid; the stream is closed below.
        let f = unsafe { libc::open_memstream(&mut buf, &mut size) };
        if f.is_null() {
            return false;
        }
        // SAFETY: ep live; `f` is a valid FILE (libc's, the same type).
        unsafe { self.api.ucp().ucp_ep_print_info(ep, f.cast()) };
        // SAFETY: closing flushes into `buf`, which is then ours to free.
        unsafe { libc::fclose(f) };
        if buf.is_null() {
            return false;
        }
        // SAFETY: `size` bytes at `buf`.
        let text = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) };
        let rma = hardware_rma(&String::from_utf8_lossy(text));
        // SAFETY: allocated by open_memstream, freed once.
        unsafe { libc::free(buf.cast()) };
        rma
    }

    /// Runs progress until it has nothing to do; the events recorded.
    pub(crate) fn progress(&self) -> Vec<Event> {
        // SAFETY: single-threaded worker, called from its thread.
        while unsafe { self.api.ucp().ucp_worker_progress(self.worker) } != 0 {}
        std::mem::take(&mut *unsafe { &*self.queue }.borrow_mut())
    }

    /// The context.
    /// `len` bytes at `at`, registered for local access and remote write.
    ///
    /// # Safety
    /// The range is mapped memory that outlives the registration (the
    /// caller unmaps it with `ucp_mem_unmap` first).
    pub(crate) unsafe fn register(
        &self,
        at: *mut c_void,
        len: usize,
    ) -> Result<sys::ucp_mem_h, UcxError> {
        // SAFETY: zeroed mem-map params are valid.
        let mut mp: sys::ucp_mem_map_params_t = unsafe { MaybeUninit::zeroed().assume_init() };
        mp.field_mask = u64::from(
            sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
        );
        mp.address = at;
        mp.length = len;
        mp.prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ
            | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller's range; out-pointer valid.
        let st = unsafe { self.api.ucp().ucp_mem_map(self.ctx, &mp, &mut memh) };
        UcxError::check(self.api, "ucp_mem_map", st)?;
        Ok(memh)
    }

    pub(crate) fn ctx(&self) -> sys::ucp_context_h {
        self.ctx
    }

    /// The `arg` of listener callbacks: the event queue.
    pub(crate) fn queue_arg(&self) -> *mut c_void {
        self.queue.cast()
    }

    /// Arms the worker's event fd; false if events are already pending.
    pub(crate) fn arm(&self) -> bool {
        // SAFETY: worker live.
        let st = unsafe { self.api.ucp().ucp_worker_arm(self.worker) };
        st == sys::UCS_OK
    }

    pub(crate) fn efd(&self) -> BorrowedFd<'_> {
        // SAFETY: the worker owns the fd and outlives the borrow.
        unsafe { BorrowedFd::borrow_raw(self.efd) }
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        let ucp = self.api.ucp();
        // SAFETY: endpoints, listeners and registrations were released by
        // the role before this; nothing uses the worker after.
        unsafe {
            ucp.ucp_worker_destroy(self.worker);
            ucp.ucp_cleanup(self.ctx);
            // Callbacks can no longer run: the queue can go.
            drop(Box::from_raw(self.queue));
        }
    }
}

/// `UCS_PTR_IS_ERR`.
pub(crate) fn is_err(p: sys::ucs_status_ptr_t) -> bool {
    (p as usize) >= (sys::UCS_ERR_LAST as isize as usize)
}

unsafe extern "C" fn on_done(request: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    // SAFETY: `user` is the box `Core::request` made, handed back once.
    let b = unsafe { Box::from_raw(user.cast::<OpBox>()) };
    // SAFETY: the queue outlives the worker that runs this callback.
    unsafe { &*b.queue }
        .borrow_mut()
        .push(Event::Done { op: b.op, status });
    if let Ok(api) = load() {
        // SAFETY: a request handed to its callback is the user's to free.
        unsafe { api.ucp().ucp_request_free(request) };
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the worker's queue.
    unsafe { &*arg.cast::<Queue>() }
        .borrow_mut()
        .push(Event::EpError { ep, status });
}

pub(crate) unsafe extern "C" fn on_conn(req: sys::ucp_conn_request_h, arg: *mut c_void) {
    // SAFETY: `arg` is the worker's queue.
    unsafe { &*arg.cast::<Queue>() }
        .borrow_mut()
        .push(Event::Conn(req));
}

macro_rules! control_handler {
    ($name:ident, $id:expr) => {
        unsafe extern "C" fn $name(
            arg: *mut c_void,
            header: *const c_void,
            header_length: usize,
            _data: *mut c_void,
            _length: usize,
            param: *const sys::ucp_am_recv_param_t,
        ) -> sys::ucs_status_t {
            // SAFETY: as UCX calls it.
            unsafe { record_am($id, arg, header, header_length, param) }
        }
    };
}

control_handler!(on_bind, crate::AM_BIND);
control_handler!(on_bound, crate::AM_BOUND);
control_handler!(on_fence, crate::AM_FENCE);
control_handler!(on_fenced, crate::AM_FENCED);

/// A control message's 16-byte header: key, aux.
pub(crate) unsafe fn header_of(header: *const c_void, header_length: usize) -> Option<(u64, u64)> {
    if header_length != 16 || header.is_null() {
        return None;
    }
    let mut h = [0u8; 16];
    // SAFETY: 16 readable header bytes.
    unsafe { ptr::copy_nonoverlapping(header.cast::<u8>(), h.as_mut_ptr(), 16) };
    let (k, a) = h.split_at(8);
    Some((
        u64::from_le_bytes(k.try_into().ok()?),
        u64::from_le_bytes(a.try_into().ok()?),
    ))
}

/// The reply endpoint of a message, or null.
pub(crate) unsafe fn reply_ep(param: *const sys::ucp_am_recv_param_t) -> sys::ucp_ep_h {
    if param.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: param valid for the call.
    let p = unsafe { &*param };
    if p.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 {
        p.reply_ep
    } else {
        ptr::null_mut()
    }
}

/// Control messages carry a 16-byte header and no data; anything else is
/// dropped (nothing is kept). A bind's or fence's reply endpoint is the
/// target's endpoint of the connection it came on.
unsafe fn record_am(
    id: u32,
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: as UCX passed them.
    let Some((key, aux)) = (unsafe { header_of(header, header_length) }) else {
        return sys::UCS_OK;
    };
    // SAFETY: as UCX passed it.
    let ep = unsafe { reply_ep(param) };
    // SAFETY: `arg` is the worker's queue.
    unsafe { &*arg.cast::<Queue>() }
        .borrow_mut()
        .push(Event::Am { id, key, aux, ep });
    sys::UCS_OK
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn socket_addresses_round_trip_through_sockaddr() {
        for a in ["127.0.0.1:4242", "[::1]:80", "10.1.2.3:65535"] {
            let a: SocketAddr = a.parse().expect("addr");
            let s = SockAddr::new(a);
            // SAFETY: same layout (both are the C sockaddr_storage).
            let st: sys::sockaddr_storage = unsafe { ptr::read(ptr::addr_of!(s.storage).cast()) };
            assert_eq!(socket_addr(&st), Some(a));
        }
        assert_eq!(
            connectable("0.0.0.0:7".parse().expect("addr")),
            "127.0.0.1:7".parse::<SocketAddr>().expect("addr")
        );
    }
}
