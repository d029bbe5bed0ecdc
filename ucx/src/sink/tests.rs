//! The data handler without UCX: [`on_data`] called as UCX calls it, with
//! a region in plain memory. No FFI, so these run under Miri
//! (`scripts/miri.sh`), which checks the handler's pointer use.
#![allow(clippy::unwrap_used)]

use super::*;

const LEN: usize = 64;

/// Two endpoints: only their addresses matter (they are map keys).
struct Eps {
    a: u8,
    b: u8,
}

impl Eps {
    fn a(&mut self) -> sys::ucp_ep_h {
        (&raw mut self.a).cast()
    }
    fn b(&mut self) -> sys::ucp_ep_h {
        (&raw mut self.b).cast()
    }
}

/// What the target's state holds: the sink's owner, moved about.
struct State {
    _before: u64,
    sink: HandlerArg<Sink>,
}

/// Builds the owner and takes the handler's argument, then moves the
/// owner out, as `TargetState::new` does (returned by value, so its
/// fields are moved and re-asserted).
fn build(base: NonNull<u8>, stats: Arc<TargetStats>) -> (State, *mut c_void) {
    let sink = HandlerArg::new(Sink::new(base, LEN, stats));
    let arg = sink.arg();
    (State { _before: 0, sink }, arg)
}

/// Sends one data message for `key` at `offset` on `ep`, as UCX would.
fn deliver(arg: *mut c_void, ep: sys::ucp_ep_h, key: u64, offset: u64, data: &mut [u8]) {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&key.to_le_bytes());
    header[8..].copy_from_slice(&offset.to_le_bytes());
    let param = sys::ucp_am_recv_param_t {
        recv_attr: u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP),
        reply_ep: ep,
    };
    // SAFETY: `arg` is a live sink's, on this thread; the header, data
    // and param are valid for the call.
    let st = unsafe {
        on_data(
            arg,
            header.as_ptr().cast(),
            header.len(),
            data.as_mut_ptr().cast(),
            data.len(),
            &param,
        )
    };
    assert_eq!(st, sys::UCS_OK);
}

/// A copy of the region's bytes.
fn region(base: NonNull<u8>) -> Vec<u8> {
    // SAFETY: the LEN bytes of the test's buffer, which outlives every
    // use; read between deliveries, never during one.
    unsafe { std::slice::from_raw_parts(base.as_ptr(), LEN) }.to_vec()
}

/// `Sink`'s raw pointer (issue 35 item 6): the argument UCX holds stays
/// valid after the owner moves (out of a function, into a vector and back),
/// with the owner's thread using the sink between messages. With the
/// owner a `Box` and the argument `&*sink` taken before the move, Miri
/// reports the pointer's use as undefined behaviour (Stacked Borrows: the
/// move re-asserts the box's unique ownership).
#[test]
fn the_handler_argument_survives_moves_of_its_owner() {
    let mut buf = [0u8; LEN];
    let base = NonNull::from(&mut buf).cast::<u8>();
    let stats = Arc::new(TargetStats::default());
    let (state, arg) = build(base, Arc::clone(&stats));
    let mut moved = vec![state];
    let state = moved.pop().unwrap();
    let mut eps = Eps { a: 0, b: 0 };
    state
        .sink
        .get()
        .bind(eps.a(), 7, Arc::new(Extents::new(std::iter::once(0..LEN))));
    deliver(arg, eps.a(), 7, 8, &mut [1, 2, 3]);
    assert!(state.sink.get().is_bound(eps.a(), 7));
    deliver(arg, eps.a(), 7, 11, &mut [4]);
    assert_eq!(&region(base)[8..12], &[1, 2, 3, 4]);
    assert_eq!(stats.data_landed.load(Ordering::Relaxed), 2);
    drop(state);
}

/// Issue 35 item 3: a message lands only inside the pages its key was
/// opened for; another key's pages (or pages of no key) are refused and
/// counted, as are unbound endpoints and ranges past the region.
#[test]
fn data_lands_only_inside_its_keys_pages() {
    let mut buf = [0u8; LEN];
    let base = NonNull::from(&mut buf).cast::<u8>();
    let stats = Arc::new(TargetStats::default());
    let (state, arg) = build(base, Arc::clone(&stats));
    let sink = state.sink.get();
    let mut eps = Eps { a: 0, b: 0 };
    // Key 1 holds bytes 0..16 and 32..48; key 2 holds 16..32.
    sink.bind(eps.a(), 1, Arc::new(Extents::new([32..48, 0..16])));
    sink.bind(eps.b(), 2, Arc::new(Extents::new(std::iter::once(16..32))));
    let n = |s: &TargetStats| {
        (
            s.data_landed.load(Ordering::Relaxed),
            s.data_refused.load(Ordering::Relaxed),
            s.data_outside_grant.load(Ordering::Relaxed),
        )
    };
    deliver(arg, eps.a(), 1, 16, &mut [9; 4]); // key 2's page
    deliver(arg, eps.a(), 1, 12, &mut [9; 8]); // straddles into key 2's
    deliver(arg, eps.a(), 1, 48, &mut [9; 4]); // no key's
    assert_eq!(n(&stats), (0, 3, 3));
    deliver(arg, eps.a(), 2, 16, &mut [9; 4]); // key 2, on key 1's endpoint
    deliver(arg, eps.a(), 1, 62, &mut [9; 4]); // past the region
    deliver(arg, eps.a(), 1, u64::MAX, &mut [9; 4]);
    assert_eq!(n(&stats), (0, 6, 3));
    assert!(region(base).iter().all(|&b| b == 0), "nothing landed");
    deliver(arg, eps.a(), 1, 32, &mut [5; 16]);
    deliver(arg, eps.b(), 2, 16, &mut [6; 16]);
    assert_eq!(n(&stats), (2, 6, 3));
    assert_eq!(&region(base)[16..48], &[[6u8; 16], [5u8; 16]].concat()[..]);
    // Unbound (a revocation under way): refused, not outside the grant.
    sink.unbind(eps.b());
    deliver(arg, eps.b(), 2, 16, &mut [7; 4]);
    assert_eq!(n(&stats), (2, 7, 3));
    assert_eq!(region(base)[16], 6);
}

#[test]
fn extents_merge_and_cover_whole_ranges_only() {
    let e = Extents::new([40..50, 0..10, 10..20, 15..18, 30..30]);
    assert_eq!(e, Extents(vec![0..20, 40..50]));
    for (offset, len, covered) in [
        (0, 20, true),
        (5, 10, true),
        (19, 1, true),
        (19, 2, false),
        (20, 1, false),
        (39, 2, false),
        (40, 10, true),
        (45, 6, false),
        (0, 0, false),
        (usize::MAX, 1, false),
    ] {
        assert_eq!(e.covers(offset, len), covered, "{offset}+{len}");
    }
    assert!(!Extents::default().covers(0, 1));
}
