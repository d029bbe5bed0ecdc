//! Page events: every change the pool makes to a page's generation,
//! watermarks or contents, reported to an observer in the order the pool
//! makes them.
//!
//! A device KV pool (`kvmesh_cuda::pool`) mirrors the host pool's page
//! generations and watermarks in device memory, where the attention and
//! KV-write kernels check them. The host pool stays the one owner of
//! pages: it decides every allocation, release and eviction, and tells the
//! observer; the device applies the events on its compute stream before the
//! next kernel that could read the page.
//!
//! # Order
//! A page's events are reported by the thread that changes the page, while
//! the page is exclusively that thread's (off the free list, or just taken
//! from its owner) and before it is published to anyone else (the free
//! list, a new owner, the cache). So for any one page the observer sees the
//! events in the order they happened, as long as the observer itself keeps
//! the order of its calls (a queue under a lock does). A mirror that falls
//! behind or loses an event fails closed: its generation differs from the
//! one in the table, and the device refuses the read.

use std::fmt;

/// What the page's contents become with the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageFill {
    /// Left as they are.
    Keep,
    /// Zeros (scrubbing).
    Zero,
    /// The debug canary of the pool's dtype (poison mode).
    Canary,
}

/// One change to one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageEvent {
    /// The page went to a new holder (a reservation) with `generation`;
    /// its watermarks are zero (they were reset when it was last freed).
    Allocated {
        /// Page id.
        page: u32,
        /// Its generation from now on.
        generation: u64,
        /// Zeroed on allocation (scrub on allocate), or kept.
        fill: PageFill,
    },
    /// The page left its holder (release, or eviction from the prefix
    /// cache): new generation, every watermark reset to zero.
    Freed {
        /// Page id.
        page: u32,
        /// Its generation from now on (even: free).
        generation: u64,
        /// The release fill.
        fill: PageFill,
    },
    /// The page changed holder without changing contents or watermarks
    /// (a reservation's page entering the prefix cache).
    Retagged {
        /// Page id.
        page: u32,
        /// Its generation from now on.
        generation: u64,
    },
}

impl PageEvent {
    /// The page the event is about.
    pub fn page(&self) -> u32 {
        match *self {
            Self::Allocated { page, .. }
            | Self::Freed { page, .. }
            | Self::Retagged { page, .. } => page,
        }
    }

    /// The page's generation after the event.
    pub fn generation(&self) -> u64 {
        match *self {
            Self::Allocated { generation, .. }
            | Self::Freed { generation, .. }
            | Self::Retagged { generation, .. } => generation,
        }
    }
}

/// Told of every [`PageEvent`] of a pool (see the module docs for the
/// order). Called on the pool's allocation and release paths, sometimes
/// under the pool's lock: it must be quick (append to a queue) and must not
/// call back into the pool.
pub trait PageObserver: Send + Sync + fmt::Debug {
    /// One event.
    fn page_event(&self, event: PageEvent);
}
