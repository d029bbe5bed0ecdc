//! Where data messages land (endpoints without an RMA lane): the target's
//! region, the key each endpoint is bound to, and the byte ranges (the
//! grant's pages) each key may write. [`on_data`] is the handler UCX calls
//! for each message, on the target's progress thread.
//!
//! # The handler's argument
//! UCX keeps the `arg` pointer it was given for as long as the worker
//! lives, so the sink must stay at one address and that pointer must stay
//! valid while the owner of the sink moves (the target's state is built in
//! one function and moved into its actor). [`HandlerArg`] owns the sink
//! through a raw pointer (`Box::into_raw`), as `core`'s event queue is
//! owned: moving a raw pointer asserts nothing about the value. A `Box`
//! would: moving it (into a struct, out of a function) re-asserts unique
//! ownership, which under Rust's aliasing rules invalidates a pointer
//! taken from it earlier; that pointer was what UCX held before this
//! module existed. `tests::the_handler_argument_survives_moves_of_its_owner`
//! pins it down, under Miri (`scripts/miri.sh`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::ptr::{self, NonNull};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::core::{header_of, reply_ep};
use crate::sys;
use crate::target::TargetStats;

/// The byte ranges of the region one key may write: its grant's pages.
/// Sorted, and merged where they touch, so a lookup is a binary search.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Extents(Vec<Range<usize>>);

impl Extents {
    /// The union of `ranges` (empty ones are dropped).
    pub fn new(ranges: impl IntoIterator<Item = Range<usize>>) -> Self {
        let mut v: Vec<Range<usize>> = ranges.into_iter().filter(|r| r.start < r.end).collect();
        v.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(v.len());
        for r in v {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        Self(merged)
    }

    /// Whether `offset..offset + len` lies inside one of the ranges (an
    /// empty write lies nowhere: a data message always carries bytes).
    pub fn covers(&self, offset: usize, len: usize) -> bool {
        let Some(end) = offset.checked_add(len).filter(|_| len > 0) else {
            return false;
        };
        // The last range starting at or before `offset`.
        let i = self.0.partition_point(|r| r.start <= offset);
        i > 0 && self.0[i - 1].end >= end
    }
}

/// Why a data message was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not a well-formed eager data message on a known endpoint.
    Malformed,
    /// The endpoint is not bound to the message's key (never bound, or
    /// unbound by a revocation whose close is under way).
    NotBound,
    /// The range leaves the region.
    OutsideRegion,
    /// The range is inside the region but not inside the key's pages.
    OutsideGrant,
}

/// The landing side of data messages. Lives on the target's progress
/// thread; [`on_data`] and the actor both reach it there.
pub(crate) struct Sink {
    base: NonNull<u8>,
    len: usize,
    bound: RefCell<HashMap<usize, (u64, Arc<Extents>)>>,
    stats: Arc<TargetStats>,
}

impl Sink {
    /// A sink over `len` bytes at `base`, which must stay writable (and
    /// written by nothing else while a bound key's messages land) as long
    /// as the sink can receive messages.
    pub(crate) fn new(base: NonNull<u8>, len: usize, stats: Arc<TargetStats>) -> Self {
        Self {
            base,
            len,
            bound: RefCell::default(),
            stats,
        }
    }

    /// Data from `ep` for `key` lands in `extents` from now on.
    pub(crate) fn bind(&self, ep: sys::ucp_ep_h, key: u64, extents: Arc<Extents>) {
        self.bound.borrow_mut().insert(ep as usize, (key, extents));
    }

    /// Data from `ep` is refused from now on.
    pub(crate) fn unbind(&self, ep: sys::ucp_ep_h) {
        self.bound.borrow_mut().remove(&(ep as usize));
    }

    /// Whether `ep` is bound to `key`.
    pub(crate) fn is_bound(&self, ep: sys::ucp_ep_h, key: u64) -> bool {
        self.bound
            .borrow()
            .get(&(ep as usize))
            .is_some_and(|(k, _)| *k == key)
    }

    /// Where a message of `length` bytes for `key` at `offset` lands, or
    /// why it does not.
    fn check(
        &self,
        ep: sys::ucp_ep_h,
        key: u64,
        offset: u64,
        length: usize,
    ) -> Result<usize, Refusal> {
        let bound = self.bound.borrow();
        let extents = match bound.get(&(ep as usize)) {
            Some((k, extents)) if *k == key => extents,
            _ => return Err(Refusal::NotBound),
        };
        let offset = usize::try_from(offset).map_err(|_| Refusal::OutsideRegion)?;
        match offset.checked_add(length) {
            Some(end) if end <= self.len => {}
            _ => return Err(Refusal::OutsideRegion),
        }
        if extents.covers(offset, length) {
            Ok(offset)
        } else {
            Err(Refusal::OutsideGrant)
        }
    }
}

/// A value at a fixed address, owned through a raw pointer, for a C
/// callback's `arg` (module doc). Dropping it frees the value: only after
/// nothing can call the callback any more (the worker is gone).
pub(crate) struct HandlerArg<T>(NonNull<T>);

impl<T> HandlerArg<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(NonNull::from(Box::leak(Box::new(value))))
    }

    /// The value, for the owner's thread.
    pub(crate) fn get(&self) -> &T {
        // SAFETY: allocated in `new`, freed only in `drop`; only shared
        // references are ever made from it (here and in the callback).
        unsafe { self.0.as_ref() }
    }

    /// The pointer to hand to C as the callback's `arg`.
    pub(crate) fn arg(&self) -> *mut c_void {
        self.0.as_ptr().cast()
    }
}

impl<T> Drop for HandlerArg<T> {
    fn drop(&mut self) {
        // SAFETY: from `Box::leak` in `new`, freed once, here.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

/// A data message: lands only if its endpoint is bound to its key and the
/// range lies inside that key's extents (its grant's pages, inside the
/// region); otherwise it is dropped and counted (the transfer's checksums
/// then fail). Eager data is handed whole to the callback and valid only
/// during it: copied here.
///
/// # Safety
/// `arg` is a live [`HandlerArg<Sink>`]'s `arg()`, on the thread that owns
/// it; the other arguments are as UCX passes them (`header_length` bytes
/// at `header`, `length` at `data`, `param` valid for the call or null).
pub(crate) unsafe extern "C" fn on_data(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is the target's sink, which outlives its worker.
    let sink = unsafe { &*arg.cast::<Sink>() };
    // SAFETY: as UCX passed them.
    let (head, ep) = unsafe { (header_of(header, header_length), reply_ep(param)) };
    // SAFETY: param valid for the call.
    let rndv = !param.is_null()
        && unsafe { &*param }.recv_attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let verdict = match head {
        Some((key, offset)) if !ep.is_null() && !data.is_null() && !rndv => {
            sink.check(ep, key, offset, length)
        }
        _ => Err(Refusal::Malformed),
    };
    let stats = &sink.stats;
    match verdict {
        Ok(offset) => {
            // SAFETY: `length` readable bytes at `data`; the destination is
            // inside the region and inside the pages of the key this
            // endpoint is bound to (checked above), which the pool lets
            // only this key's writer write while it is bound.
            unsafe {
                ptr::copy_nonoverlapping(data.cast::<u8>(), sink.base.as_ptr().add(offset), length)
            };
            stats.data_landed.fetch_add(1, Ordering::Relaxed);
        }
        Err(why) => {
            stats.data_refused.fetch_add(1, Ordering::Relaxed);
            if why == Refusal::OutsideGrant {
                stats.data_outside_grant.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    sys::UCS_OK
}

#[cfg(test)]
mod tests;
