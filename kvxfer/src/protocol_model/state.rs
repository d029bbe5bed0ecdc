//! The model's state: the decode node's pool and reservation records, each
//! writer's view of its grants, and the network.
//!
//! Everything is small integers and short vectors so that a state hashes
//! and clones cheaply; the checker stores millions of fingerprints, not
//! states.

/// A reservation (and request) id: the index of its [`Request`] in the
/// scenario. Ids are never reused, as the implementation's 128-bit random
/// ids (I8) are not.
///
/// [`Request`]: super::Request
pub type Rid = u8;
/// A prefill writer's index.
pub type Wid = u8;
/// A page's index in the decode node's pool.
pub type PageId = u8;
/// A page generation. The pool's is a u64; here it counts at most two bumps
/// per reservation, so a u8 cannot wrap.
pub type Generation = u8;

/// One page of the decode node's pool.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Page {
    /// Bumped on every allocation and every release: odd while allocated.
    pub generation: Generation,
    /// The reservation holding the page, if any.
    pub owner: Option<Rid>,
    /// On the free list. Kept apart from `owner`, as in the pool, so that
    /// property C can check the two agree.
    pub free: bool,
    /// Whose data each token slot holds: `None` for never written. Release
    /// does not clear it (pages are not scrubbed by default, I6), so a
    /// reused page still holds its previous owner's data.
    pub slots: Vec<Option<Rid>>,
    /// Slots `0..watermark` are readable by the owner (I2). Set when the
    /// transfer verifies, reset on release.
    pub watermark: u8,
}

/// How a reservation ended (I7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum End {
    /// It was live and finished (decoded to the end, or was aborted while
    /// decoding, which needs no writer: its transfer had already ended).
    Completed,
    /// Aborted, and the writer confirmed that it had stopped.
    AbortConfirmed,
    /// The writer's write path was revoked first: lease or abort timeout,
    /// or a detected writer crash.
    Revoked,
    /// Freed with neither confirmation nor revocation. Only a [`Bug`]
    /// reaches it.
    ///
    /// [`Bug`]: super::Bug
    FreedUnconfirmed,
}

/// The decode node's state for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Not reserved yet: waiting until the pool has room (the router
    /// retries a refused reserve; a refusal changes nothing at D).
    Requested,
    /// Pages held, grant issued, prompt slots being written.
    Granted,
    /// Stopped; pages still held until the writer confirms or is revoked.
    Aborting,
    /// Transfer verified (I4), watermarks set, the sequence decodes.
    Live,
    /// Pages released; the reservation is over.
    Ended(End),
}

/// The decode node's record of one reservation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeSide {
    /// Where the reservation is.
    pub phase: Phase,
    /// The writer the grant went to (chosen when reserving).
    pub writer: Option<Wid>,
    /// The grant's page table: page and the generation it was granted at.
    pub table: Vec<(PageId, Generation)>,
    /// The reservation's write path was torn down: none of its frames lands
    /// any more, in flight or later.
    pub revoked: bool,
    /// How many times it ended (property C: at most once).
    pub ends: u8,
}

/// A writer's state for one reservation. Every state but `NoGrant` is
/// also the writer's memory that the reservation is over for it (a
/// tombstone), so a late or duplicated grant never restarts writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WriterSide {
    /// No grant received and no abort heard.
    NoGrant,
    /// Holding the grant; the first `sent` prompt tokens have been sent.
    Writing {
        /// Tokens sent so far.
        sent: u8,
    },
    /// Sent TransferDone; never writes this reservation again.
    Finished,
    /// Stopped by an abort; never writes this reservation again.
    Stopped {
        /// An AbortConfirmed is still to be sent (once drained).
        owes_confirm: bool,
    },
}

/// A writer process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Health {
    /// Running.
    Up,
    /// Crashed: does nothing more, but frames it had in flight can still
    /// land until D revokes.
    Crashed,
    /// Crashed, and D has seen its connection reset and revoked its grants.
    Detected,
}

/// A message (or, for frames, a write in flight). The network is a
/// multiset of these: any of them can be delivered next (reordering),
/// lost or duplicated within the scenario's budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    /// The grant, on its way to the writer (from D through the router).
    Grant {
        /// Reservation.
        rid: Rid,
    },
    /// A KV frame: one token slot of a prompt, with the writer's data.
    /// Its payload is the reservation's data, so it is not a field.
    Frame {
        /// Reservation (and capability) the writer names.
        rid: Rid,
        /// Destination page.
        page: PageId,
        /// The page's generation in the grant.
        generation: Generation,
        /// Token slot within the page.
        slot: u8,
    },
    /// TransferDone, writer to D.
    Done {
        /// Reservation.
        rid: Rid,
    },
    /// Abort, D to writer.
    Abort {
        /// Reservation.
        rid: Rid,
    },
    /// AbortConfirmed, writer to D: stopped, nothing in flight.
    AbortConfirmed {
        /// Reservation.
        rid: Rid,
    },
}

impl Msg {
    /// The reservation a message is about.
    pub fn rid(&self) -> Rid {
        match *self {
            Msg::Grant { rid }
            | Msg::Frame { rid, .. }
            | Msg::Done { rid }
            | Msg::Abort { rid }
            | Msg::AbortConfirmed { rid } => rid,
        }
    }
}

/// A whole-system state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The decode node's pool.
    pub pages: Vec<Page>,
    /// The decode node's reservations, by [`Rid`].
    pub decode: Vec<DecodeSide>,
    /// The granted writer's view of each reservation, by [`Rid`].
    pub writer: Vec<WriterSide>,
    /// Each writer process, by [`Wid`].
    pub health: Vec<Health>,
    /// Messages and frames in flight, kept sorted so that equal multisets
    /// are equal states.
    pub net: Vec<Msg>,
    /// Losses the network may still cause.
    pub drops_left: u8,
    /// Duplicates the network may still cause.
    pub dups_left: u8,
    /// Writer crashes that may still happen.
    pub crashes_left: u8,
}

impl State {
    /// Adds one copy of `m` to the network.
    pub(crate) fn send(&mut self, m: Msg) {
        let at = self.net.partition_point(|x| *x < m);
        self.net.insert(at, m);
    }

    /// Removes one copy of `m`; false if there is none.
    pub(crate) fn take(&mut self, m: &Msg) -> bool {
        match self.net.binary_search(m) {
            Ok(at) => {
                self.net.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    /// No frame of `rid` is in flight: every write the writer issued has
    /// landed or died. A one-sided writer learns this from its write
    /// completions, which cover every copy of a write.
    pub fn drained(&self, rid: Rid) -> bool {
        !self
            .net
            .iter()
            .any(|m| matches!(m, Msg::Frame { rid: r, .. } if *r == rid))
    }

    /// The reservation holds pages: granted, aborting or live.
    pub fn holds(&self, rid: Rid) -> bool {
        self.decode
            .get(rid as usize)
            .is_some_and(|d| matches!(d.phase, Phase::Granted | Phase::Aborting | Phase::Live))
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.pages.iter().filter(|p| p.free).count()
    }
}
