//! A writer outside the mesh, for tests: its own context with RMA, an
//! endpoint to a target's listener, a remote key packed from a buffer of
//! its own (any well-formed key unpacks on the writer's side), and a put
//! to any address it likes, with no bind. What UCX's software RMA does
//! with that put at the target is what the test of [`crate::RemoteWrite`]
//! pins down.

use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::ptr;
use std::time::{Duration, Instant};

use crate::core::{is_err, Core, SockAddr};
use crate::error::UcxError;
use crate::sys;

/// Puts `data` at `remote` (an address in the target's process) through
/// an endpoint to `target`, and flushes; `Ok` once the flush completed,
/// the error UCX gave otherwise, [`UcxError::Stopped`] after `wait`.
pub fn put_uninvited(
    target: SocketAddr,
    remote: u64,
    data: &[u8],
    wait: Duration,
) -> Result<(), UcxError> {
    let core = Core::with_rma("kvmesh-rogue", true)?;
    let ucp = core.api.ucp();
    let sa = SockAddr::new(target);
    let mut p = core.ep_params();
    p.field_mask |= u64::from(sys::UCP_EP_PARAM_FIELD_FLAGS | sys::UCP_EP_PARAM_FIELD_SOCK_ADDR);
    p.flags = sys::UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr = sa.as_ucs();
    let mut ep: sys::ucp_ep_h = ptr::null_mut();
    // SAFETY: worker live; the address lives for the call.
    let st = unsafe { ucp.ucp_ep_create(core.worker, &p, &mut ep) };
    UcxError::check(core.api, "ucp_ep_create", st)?;
    let mut own = vec![0u8; 4096];
    // SAFETY: `own` outlives the registration (unmapped below).
    let memh = unsafe { core.register(own.as_mut_ptr().cast(), own.len()) }?;
    let (mut buf, mut size): (*mut std::ffi::c_void, usize) = (ptr::null_mut(), 0);
    // SAFETY: memh live; out-pointers valid.
    let st = unsafe { ucp.ucp_rkey_pack(core.ctx(), memh, &mut buf, &mut size) };
    UcxError::check(core.api, "ucp_rkey_pack", st)?;
    let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
    // SAFETY: ep live; the packed key is read for the call.
    let st = unsafe { ucp.ucp_ep_rkey_unpack(ep, buf, &mut rkey) };
    // SAFETY: the buffer ucp_rkey_pack returned, released once.
    unsafe { ucp.ucp_rkey_buffer_release(buf) };
    UcxError::check(core.api, "ucp_ep_rkey_unpack", st)?;
    // SAFETY: zeroed request params (no callback) are valid.
    let rp: sys::ucp_request_param_t = unsafe { MaybeUninit::zeroed().assume_init() };
    // SAFETY: ep and rkey live; `data` outlives the wait below.
    let put = unsafe { ucp.ucp_put_nbx(ep, data.as_ptr().cast(), data.len(), remote, rkey, &rp) };
    let put = wait_request(&core, put, wait);
    // SAFETY: ep live.
    let flush = unsafe { ucp.ucp_ep_flush_nbx(ep, &rp) };
    let flush = wait_request(&core, flush, wait);
    // SAFETY: live handles, released once each; the endpoint is closed
    // (force) and the worker progressed before the context goes.
    unsafe {
        ucp.ucp_rkey_destroy(rkey);
        let close = ucp.ucp_ep_close_nbx(ep, &rp);
        let _ = wait_request(&core, close, Duration::from_secs(2));
        ucp.ucp_mem_unmap(core.ctx(), memh);
    }
    drop(own);
    put.and(flush)
}

/// Progresses until the request `r` (as a `*_nbx` call returned it)
/// completes; its status.
fn wait_request(core: &Core, r: sys::ucs_status_ptr_t, wait: Duration) -> Result<(), UcxError> {
    let ucp = core.api.ucp();
    if r.is_null() {
        return Ok(());
    }
    if is_err(r) {
        // `UCS_PTR_STATUS`: the pointer is the status.
        return UcxError::check(core.api, "request", r as isize as sys::ucs_status_t);
    }
    let end = Instant::now() + wait;
    loop {
        let _ = core.progress();
        // SAFETY: a live request this function frees once.
        let st = unsafe { ucp.ucp_request_check_status(r) };
        if st != sys::UCS_INPROGRESS {
            // SAFETY: completed; freed once.
            unsafe { ucp.ucp_request_free(r) };
            return UcxError::check(core.api, "request", st);
        }
        if Instant::now() >= end {
            // SAFETY: freed once; UCX completes it when the worker goes.
            unsafe { ucp.ucp_request_free(r) };
            return Err(UcxError::Stopped);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
