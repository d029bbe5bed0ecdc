//! The KV reservation and abort handshake (design/kv-safety.md section 3)
//! as a model, checked exhaustively with [stateright] by
//! `tests/protocol_model.rs`. It is the design the implementation follows:
//! each rule below is one the code must keep, and each [`Bug`] is a way to
//! break one that the checker is shown to catch.
//!
//! # What is modeled
//! - **D**, one decode node, owns a pool of [`Scenario::pages`] pages of
//!   [`Scenario::slots_per_page`] token slots. Per page: a generation
//!   (bumped on every allocation and every release), an owner, the free
//!   flag, whose data each slot holds (a reservation id, or never
//!   written), and a written-slot watermark. One allocation path (all or
//!   nothing, lowest free pages first) and one release path (pages still
//!   held by the reservation get a new generation, lose owner and
//!   watermark, rejoin the free list), as in `pool.rs`. Per reservation: a
//!   [`Phase`], the writer, the grant's page table with generations, a
//!   revoked flag, and how often it ended.
//! - **Writers** (prefill nodes, [`Scenario::writers`]): per reservation a
//!   [`WriterSide`], per process a [`Health`].
//! - **The router** is folded into the environment: it sends each request
//!   to its writer ([`Request::writer`], or the first writer not known dead
//!   once D has detected that one's crash), and its aborts are D's
//!   [`Action::Abort`].
//! - **The network** is a multiset of [`Msg`]: any message may be
//!   delivered next (reordering), lost ([`Faults::drops`] in all) or
//!   delivered while a copy stays in flight ([`Faults::duplicates`]).
//!   Frames are messages too: for the one-sided transport "in flight" means
//!   a posted write that has not landed yet.
//!
//! # The rules, one per action ([`Action`])
//! 1. `Reserve`: when the pool has room, D allocates every page the request
//!    needs, sets owner and generation, and sends the grant (page table
//!    with generations). No partial grants; while the pool is short the
//!    request waits (a refused reserve changes nothing at D; the router
//!    retries).
//! 2. `Write`: a writer holding a grant sends its next token's frame,
//!    naming reservation, page, generation and slot; it carries that
//!    reservation's data. Delivery: [`Transport::ReceiverChecked`] writes
//!    the slot only if D accepts the frame (reservation being written, page
//!    in its grant at the granted generation and still its own), else drops
//!    it; [`Transport::OneSided`] writes whatever slot the frame names,
//!    unchecked. A frame of a revoked reservation never lands.
//! 3. `SendDone`: once every token is sent **and drained** (no frame of it
//!    in flight: one-sided, every write completion seen; over TCP the
//!    stream's order gives the same), the writer sends TransferDone and
//!    never writes that reservation again. On delivery D verifies (I4):
//!    every page still at the granted generation and owner, every prompt
//!    slot holding this reservation's data (the model's checksum compares
//!    the contents). Pass: `Live`, watermarks set to the tokens on each
//!    page. Fail: abort, as in 5. A Done in any other phase is rejected.
//! 4. `Finish`: a live sequence ends (decoded, or aborted while decoding)
//!    and its pages are released at once. No confirmation is needed: its
//!    writer's Done already said it had stopped and drained.
//! 5. `Abort` (not yet live): D stops the reservation (`Aborting`), keeps
//!    the pages and sends Abort. The writer, whatever it knows of the
//!    reservation (writing, done, or no grant seen yet), stops for good
//!    and, **once drained**, answers AbortConfirmed (`Confirm`); it
//!    answers every Abort, duplicates too. D releases on AbortConfirmed
//!    while `Aborting`; a late or duplicate one is rejected.
//! 6. `Expire` (lease or abort timeout, at any moment while `Granted` or
//!    `Aborting`): D **revokes first** (the reservation's frames in flight
//!    die, later ones never land), then releases.
//! 7. `Crash` / `DetectCrash`: a crashed writer does nothing more, but its
//!    frames in flight can still land until D sees the connection reset;
//!    that revokes, and D releases every reservation of that writer that is
//!    not live.
//!
//! # Where the implementation keeps each rule
//! 1. `Reserve`: `handshake::ReservationTable::reserve` (all pages of prompt
//!    and budget or a typed refusal; the grant bound to the writer's
//!    connection).
//! 2. `Write`: receiver-checked, `ReservationTable::land_frame` (phase, bound
//!    connection, `Grant::check_frame`, then the page); one-sided,
//!    `shm::ShmRegion::write_slots` through the grant's lane, or over UCX
//!    `ucp_put_nbx` through the endpoint bound to the grant's key (bound by
//!    `ucp_ep_create` to the decode listener, an acknowledged BIND active
//!    message, `ucp_ep_rkey_unpack`; `transport::ucx`).
//! 3. `SendDone`: `transport::client::GrantWriter::finish` drains first
//!    (UCX: `ucp_ep_flush_nbx` of the grant's endpoint must succeed; a put
//!    may report success after a revocation, a flush may not); the table
//!    revokes the path, then verifies; pass sets watermarks.
//! 4. `Finish`: dropping a `handshake::LiveSequence`.
//! 5. `Abort`: `ReservationTable::abort` and `abort_confirmed`; the writer
//!    side answers every Abort under the grant's lock, with a tombstone for
//!    grants not yet seen (`transport::client`).
//! 6. `Expire`: `ReservationTable::tick`: revoke (`transport::Landing::revoke`:
//!    UCX closes the key's endpoint with `ucp_ep_close_nbx`, force, peer
//!    error mode, and completes when that request completes), then release;
//!    a revocation that cannot complete quarantines.
//! 7. `Crash` / `DetectCrash`: `ReservationTable::connection_lost` revokes
//!    every reservation of the connection that is not live (the whole-
//!    connection path the model leaves out); a one-sided writer's death is
//!    seen through its pidfd (shm) or its endpoint's error callback (UCX,
//!    peer error-handling mode), and the revocation is the same endpoint
//!    close.
//!
//! # What is abstracted away
//! - Data: a slot holds the id of the reservation whose data it is.
//!   Layers, K and V, payload bytes and real checksums are gone; the
//!   checksum comparison is exact.
//! - Identities and capabilities: a reservation id is its index, never
//!   reused (as 128-bit random ids are not, I8). Writers are honest: they
//!   write only their grant's pages and slots. Forged frames and
//!   authentication are not modeled.
//! - Revocation takes effect at once: once D has revoked, no frame of that
//!   path lands, so the implementation may free only after the teardown
//!   has completed (queue pair in error and flushed, key invalidation
//!   completed, connection closed and drained).
//! - Revocation is per reservation (a per-grant key or queue pair).
//!   Tearing down a whole connection revokes every reservation on it: at
//!   least as strong for safety, but then every other not-yet-live
//!   reservation on that connection must be aborted too, a path the model
//!   does not contain.
//! - Crashes are permanent. A restarted writer is a new writer on a new
//!   connection; grants issued before the crash must not work on it (bind
//!   grants to the connection, or persist the writer's tombstones).
//! - Decode steps (generated tokens and the decode budget), TransferDone's
//!   first sampled token, scrubbing and poison (I6: pages are never
//!   scrubbed here, the worst case for reuse), rejection counters, and the
//!   order in which a writer sends its tokens (it sends them in order; the
//!   network reorders).
//! - Time: lease expiry and abort timeouts can fire at any moment; every
//!   interleaving is explored, so no timing assumption is made.
//! - A duplicate is made only at a delivery ([`Action::DeliverDuplicate`]):
//!   making it earlier changes nothing but the interleaving.
//!
//! # Properties (`HandshakeModel::properties`)
//! - **A, [`SAFE_READS`]** (I1, I2, I4), `always`: no reachable state has a
//!   live sequence whose read of a prompt slot passes the read checks
//!   (page generation and owner equal to its table, slot below the
//!   watermark) and sees a slot that is unwritten or holds another
//!   reservation's data. A read that fails a check sees nothing.
//! - **B, [`NO_LATE_WRITES`]** (I5), `always`: no reachable state has a page
//!   that is free or held by another reservation while the writer of a
//!   reservation that held it can still write it: its path is not revoked
//!   and either the writer is up and holds the grant without having
//!   stopped (or the grant is in flight to it and would start it), or a
//!   frame of it that would land is in flight. The first clause holds the
//!   receiver-checked transport to I5's rule too, though its frames would
//!   be refused on arrival.
//! - **C, [`ENDS_ONCE`]** (I7), `always`: every reservation ends at most
//!   once; a page is free exactly when it has no owner, every owner holds,
//!   every holder's pages carry its owner and granted generation, and free
//!   plus held pages is the capacity.
//! - **D, [`ALL_END`]** (I7), `eventually`: every reservation ends and every
//!   page is free again. See below for exactly what that checks.
//! - Sanity, `sometimes`: [`PAGE_REUSED`] (a page is allocated a second
//!   time) and [`ALL_COMPLETE`] (both requests complete), so a pass is not
//!   vacuous.
//!
//! A with C is "every reservation ends at most once and reads only its
//! own data"; C with D is I7's "exactly once, and the pool whole when idle".
//!
//! # What the liveness check means
//! Stateright checks an `eventually` property on terminal paths: it
//! reports a path from the start to a state with no successor along which
//! the condition never held. States where the path re-joins a known state
//! are not terminal, so on a graph with cycles it can miss counterexamples.
//! This model has no cycles: [`HandshakeModel::progress`] strictly
//! decreases on every step (asserted on every step in debug builds), so
//! every run is finite and ends in a terminal state, and since the
//! condition is stable (once everything has ended, nothing changes it) the
//! per-path bookkeeping is exact. So D holds exactly when **every maximal
//! run ends with every reservation ended and the pool whole**. A terminal
//! state has nothing enabled: no message in flight, no writer step, no
//! timeout, so a maximal run is one where every message is eventually
//! delivered or lost within the budget and every enabled step eventually
//! happens (weak fairness).
//!
//! Checked twice: [`Scenario::standard`] (loss, duplicates, crashes,
//! timeouts), where the timeouts alone could end everything, so D there
//! shows that nothing leaks or gets stuck in a state without a timeout
//! (`Requested`, `Live`); and [`Scenario::fair_delivery`] (no loss, no
//! timeouts), where only the handshake can end a reservation, so D shows
//! that the handshake itself always terminates. Only the second finds
//! [`Bug::IgnoreAbortAfterDone`]: a timeout masks it.
//!
//! # Bounds
//! [`Scenario::standard`]: 2 writers; 2 requests, r0 of 1 token (1 page) to
//! writer 0 and r1 of 2 tokens (2 pages) to writer 1; a pool of 2 one-slot
//! pages, so the two never hold pages at once and whichever comes second
//! reuses the first's page; 1 loss, 1 duplicate, 1 writer crash; aborts and
//! timeouts at any moment. A crash of writer 1 detected before r1 is
//! reserved reroutes r1 to writer 0, which covers one writer serving both.
//! [`Scenario::partial_pages`] has 2 slots per page and a partly filled
//! last page. The test file prints each check's state count and time.
//!
//! # Rules the checks show to be necessary
//! Each is a [`Bug`] that the checker catches, so the implementation must
//! keep it:
//! - Timeouts revoke before they free ([`Bug::FreeOnTimeout`]), aborts wait
//!   for confirm-or-revoke ([`Bug::FreeOnAbortWithoutConfirm`]): otherwise
//!   a one-sided writer's late frame lands in the next owner's page and a
//!   live read returns another request's data (A and B).
//! - The writer drains before AbortConfirmed ([`Bug::ConfirmBeforeDrain`])
//!   **and before TransferDone** ([`Bug::DoneBeforeDrain`]): completion
//!   frees pages without a confirmation, so Done must carry the same
//!   promise as a confirmation.
//! - The writer remembers every reservation it was told to abort, even
//!   one whose grant it has not seen, and ignores a grant for it that
//!   arrives later ([`Bug::NoAbortTombstone`]): the abort can overtake the
//!   grant. It may forget after the grant's lease deadline.
//! - The writer answers an Abort even after its Done
//!   ([`Bug::IgnoreAbortAfterDone`]): D may have aborted before the Done
//!   arrived, and then rejects it and waits.
//! - Only `Aborting` plus AbortConfirmed releases; a late or duplicated
//!   confirmation is rejected ([`Bug::ReleaseOnLateConfirm`]).
//! - With the receiver-checked transport, D's check on arrival keeps the
//!   timeout and early-free bugs from reaching a read (A holds, B does
//!   not): the check is what protects TCP, and confirm-or-revoke is what
//!   protects the one-sided transports.
//!
//! [stateright]: https://docs.rs/stateright

mod properties;
mod state;
mod step;

use stateright::{Model, Property};

pub use properties::{ALL_COMPLETE, ALL_END, ENDS_ONCE, NO_LATE_WRITES, PAGE_REUSED, SAFE_READS};
pub use state::{
    DecodeSide, End, Generation, Health, Msg, Page, PageId, Phase, Rid, State, Wid, WriterSide,
};
pub use step::Action;

/// How KV frames reach the decode node's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP: D checks every frame on arrival (known reservation, capability,
    /// a state that accepts writes, the page in the grant at the granted
    /// generation) and drops it otherwise.
    ReceiverChecked,
    /// Shared memory or UCX (RDMA): a frame lands in the page and slot it
    /// names, unchecked, unless its write path was revoked (lane closed;
    /// UCX endpoint closed).
    OneSided,
}

/// A deliberate protocol fault, to show that the checker finds it. Each
/// names the rule it breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bug {
    /// The protocol as designed.
    None,
    /// Lease expiry frees the pages without revoking the writer.
    FreeOnTimeout,
    /// An abort frees the pages at once, without waiting for the writer's
    /// confirmation or revoking it.
    FreeOnAbortWithoutConfirm,
    /// TransferDone makes the sequence live without verifying coverage,
    /// checksums and generations (I4).
    SkipVerification,
    /// The writer confirms an abort while its frames are still in flight.
    ConfirmBeforeDrain,
    /// The writer sends TransferDone while its frames are still in flight.
    DoneBeforeDrain,
    /// A writer that gets an abort for a grant it has not seen confirms it
    /// but does not remember it, so the grant, arriving later, starts
    /// writing.
    NoAbortTombstone,
    /// An AbortConfirmed for a reservation that already ended releases it
    /// again.
    ReleaseOnLateConfirm,
    /// A writer that has sent TransferDone ignores a later abort, so D,
    /// which aborted first, waits for a confirmation that never comes.
    IgnoreAbortAfterDone,
}

/// One request to reserve and transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    /// Prompt tokens (slots) the grant covers.
    pub tokens: u8,
    /// The writer the router sends it to, unless D knows that one is dead
    /// (then the first writer not known dead).
    pub writer: Wid,
}

/// What the environment may do, and how often.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Faults {
    /// Messages (or frames) the network may lose, in all.
    pub drops: u8,
    /// Messages (or frames) the network may duplicate, in all.
    pub duplicates: u8,
    /// Writer crashes, in all. Below the writer count.
    pub crashes: u8,
    /// Leases (and the wait for an abort confirmation) may time out, at
    /// any moment.
    pub lease_expiry: bool,
    /// A reservation may be aborted (client gone, D error) before it is
    /// live, at any moment.
    pub aborts: bool,
}

/// A model instance: the protocol variant and the bounds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scenario {
    /// How frames land.
    pub transport: Transport,
    /// The protocol variant.
    pub bug: Bug,
    /// Pages in D's pool.
    pub pages: u8,
    /// Token slots per page.
    pub slots_per_page: u8,
    /// Prefill writers.
    pub writers: u8,
    /// The requests, by [`Rid`].
    pub requests: Vec<Request>,
    /// The environment's faults.
    pub faults: Faults,
}

impl Scenario {
    /// The standard scenario: two writers, a pool of two one-slot pages,
    /// request 0 (one page) to writer 0 and request 1 (two pages) to
    /// writer 1, so the two never hold pages at once and the second
    /// always reuses the first's page. Faults: one loss, one duplicate,
    /// one writer crash, aborts and lease expiry at any moment.
    pub fn standard(transport: Transport, bug: Bug) -> Self {
        Self {
            transport,
            bug,
            pages: 2,
            slots_per_page: 1,
            writers: 2,
            requests: vec![
                Request {
                    tokens: 1,
                    writer: 0,
                },
                Request {
                    tokens: 2,
                    writer: 1,
                },
            ],
            faults: Faults {
                drops: 1,
                duplicates: 1,
                crashes: 1,
                lease_expiry: true,
                aborts: true,
            },
        }
    }

    /// The standard scenario with fair delivery and no timeouts: no loss,
    /// no lease expiry, so reservations can end only through the handshake
    /// itself (completion, abort and confirmation, or a detected crash).
    pub fn fair_delivery(transport: Transport, bug: Bug) -> Self {
        let mut s = Self::standard(transport, bug);
        s.faults.drops = 0;
        s.faults.lease_expiry = false;
        s
    }

    /// Pages of 2 slots: r0 of 1 token (half a page) and r1 of 3 tokens
    /// (one and a half pages) in a pool of 2 pages, so r1's second page is
    /// partly filled and the reused page keeps stale data past the new
    /// owner's watermark. No crash, to keep it small; loss, duplicates,
    /// aborts and timeouts as in [`Scenario::standard`].
    pub fn partial_pages(transport: Transport, bug: Bug) -> Self {
        let mut s = Self::standard(transport, bug);
        s.slots_per_page = 2;
        s.requests[1].tokens = 3;
        s.faults.crashes = 0;
        s
    }

    /// Checks the bounds the model relies on.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |why: &'static str| Err(ScenarioError(why));
        if self.pages == 0 || self.slots_per_page == 0 || self.writers == 0 {
            return bad("pages, slots_per_page and writers must be at least 1");
        }
        if self.faults.crashes >= self.writers {
            return bad("crashes must be below writers, so some writer is alive");
        }
        if self.requests.is_empty() || self.requests.len() > usize::from(Rid::MAX) {
            return bad("requests must number 1..=255");
        }
        for r in &self.requests {
            let pages = usize::from(r.tokens).div_ceil(usize::from(self.slots_per_page));
            if r.tokens == 0 || pages > usize::from(self.pages) {
                return bad("every request needs 1..=pages pages");
            }
            if r.writer >= self.writers {
                return bad("a request names a writer that does not exist");
            }
        }
        Ok(())
    }
}

/// A [`Scenario`] outside the model's bounds; names the bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid protocol model scenario: {0}")]
pub struct ScenarioError(&'static str);

/// The handshake as a stateright [`Model`].
#[derive(Clone, Debug)]
pub struct HandshakeModel {
    scenario: Scenario,
}

impl HandshakeModel {
    /// A model of `scenario`, if it is within the bounds.
    pub fn new(scenario: Scenario) -> Result<Self, ScenarioError> {
        scenario.validate()?;
        Ok(Self { scenario })
    }

    /// The scenario it models.
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    fn initial(&self) -> State {
        let sc = &self.scenario;
        let page = Page {
            generation: 0,
            owner: None,
            free: true,
            slots: vec![None; usize::from(sc.slots_per_page)],
            watermark: 0,
        };
        let decode = DecodeSide {
            phase: Phase::Requested,
            writer: None,
            table: Vec::new(),
            revoked: false,
            ends: 0,
        };
        State {
            pages: vec![page; usize::from(sc.pages)],
            decode: vec![decode; sc.requests.len()],
            writer: vec![WriterSide::NoGrant; sc.requests.len()],
            health: vec![Health::Up; usize::from(sc.writers)],
            net: Vec::new(),
            drops_left: sc.faults.drops,
            dups_left: sc.faults.duplicates,
            crashes_left: sc.faults.crashes,
        }
    }
}

impl Model for HandshakeModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        self.enabled(state, actions);
    }

    fn next_state(&self, state: &State, action: Action) -> Option<State> {
        self.apply(state, action)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(SAFE_READS, properties::safe_reads),
            Property::always(NO_LATE_WRITES, properties::no_late_writes),
            Property::always(ENDS_ONCE, properties::ends_once),
            Property::eventually(ALL_END, properties::all_ended),
            Property::sometimes(PAGE_REUSED, properties::page_reused),
            Property::sometimes(ALL_COMPLETE, properties::all_complete),
        ]
    }
}
