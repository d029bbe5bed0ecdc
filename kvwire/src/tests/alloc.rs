//! "Absurd lengths are refused without allocating", measured: this test
//! binary's global allocator counts allocations made by the current thread
//! (a thread-local counter, so tests running in parallel do not disturb
//! each other; everything else passes straight to the system allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use super::super::*;
use super::corruption::absurd_bodies;
use super::samples;

struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: never panic inside the allocator, even during thread exit.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; the only addition is a thread-local counter that does not
// allocate (const-initialised, no destructor).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Runs `f`; returns its result and the allocations this thread made.
fn allocations<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCATIONS.with(Cell::get);
    let out = f();
    (out, ALLOCATIONS.with(Cell::get) - before)
}

#[test]
fn the_counter_sees_allocations() {
    let (v, n) = allocations(|| vec![1u8; 10]);
    assert_eq!((v.len(), n), (10, 1));
}

#[test]
fn absurd_lengths_are_refused_without_allocating() {
    let (_, abort) = samples().swap_remove(3);
    let mut huge = abort.clone();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let no_limit = DecodeLimits {
        max_message_bytes: usize::MAX,
    };
    let (r, n) = allocations(|| decode_message(&huge).map(|_| ()));
    assert!(matches!(r, Err(WireError::TooLarge { .. })));
    assert_eq!(n, 0);
    let (r, n) = allocations(|| decode(&huge, &no_limit).map(|_| ()));
    assert!(matches!(r, Err(WireError::Truncated { .. })));
    assert_eq!(n, 0);
    for (field, msg) in absurd_bodies() {
        let (r, n) = allocations(|| decode_message(&msg).map(|_| ()));
        assert!(
            matches!(r, Err(WireError::LengthMismatch { .. })),
            "{field}: {r:?}"
        );
        assert_eq!(n, 0, "{field}");
    }
}

/// Decoding a frame allocates nothing (the payload is borrowed); a grant
/// allocates its page list and endpoint, once each.
#[test]
fn decoding_allocates_only_owned_fields() {
    let s = samples();
    let (r, n) = allocations(|| decode_message(&s[0].1).map(|(m, _)| m.message_type()));
    assert_eq!((r, n), (Ok(MessageType::KvFrame), 0));
    let (r, n) = allocations(|| decode_message(&s[1].1).map(|(m, _)| m.message_type()));
    assert_eq!((r, n), (Ok(MessageType::Grant), 2));
}
