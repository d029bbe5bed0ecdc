//! Typed refusals and outcomes of the decode side's reservation table.

use thiserror::Error;

use kvmesh_kvpool::PoolError;
use kvmesh_kvwire::{AbortReason, FrameReject, MintError, ReservationId, WriterId};

/// Why a Reserve was refused. Nothing was allocated (no partial grants).
#[derive(Debug, Error)]
pub enum ReserveError {
    /// A grant covers at least one prompt token.
    #[error("empty prompt: a reservation needs at least one prompt token")]
    EmptyPrompt,
    /// Prompt plus decode budget exceed the longest sequence this node
    /// serves (the service's own re-check of I3).
    #[error(
        "{prompt_tokens} prompt tokens + {max_new_tokens} new tokens = {requested} exceed the maximum sequence length {max_seq_tokens}"
    )]
    TooLong {
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Decode budget.
        max_new_tokens: usize,
        /// Their sum.
        requested: usize,
        /// The limit.
        max_seq_tokens: usize,
    },
    /// Prompt plus decode budget exceed what the whole pool holds, so no
    /// amount of waiting would make room.
    #[error("{requested} tokens exceed this node's KV pool of {capacity} tokens")]
    OverCapacity {
        /// Tokens asked for.
        requested: usize,
        /// The pool's capacity in tokens.
        capacity: usize,
    },
    /// Not enough free pages now; retry later or elsewhere.
    #[error("KV pool exhausted: {needed_pages} pages needed, {free_pages} free")]
    Exhausted {
        /// Pages the request needs.
        needed_pages: usize,
        /// Pages free now.
        free_pages: usize,
    },
    /// The named writer has no transport connection to this node, so no
    /// grant could be bound to it.
    #[error("writer {writer} is not connected to this decode node")]
    WriterNotConnected {
        /// The writer named in the request.
        writer: WriterId,
    },
    /// The transport could not open a write path (no free lane).
    #[error("transport cannot open a write path: {0}")]
    Transport(String),
    /// The OS random number generator failed.
    #[error(transparent)]
    Mint(#[from] MintError),
    /// Any other pool refusal.
    #[error(transparent)]
    Pool(PoolError),
}

impl ReserveError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::EmptyPrompt => "empty_prompt",
            Self::TooLong { .. } => "too_long",
            Self::OverCapacity { .. } => "over_capacity",
            Self::Exhausted { .. } => "exhausted",
            Self::WriterNotConnected { .. } => "writer_not_connected",
            Self::Transport(_) => "transport",
            Self::Mint(_) => "mint",
            Self::Pool(_) => "pool",
        }
    }
}

/// Why a transfer failed verification (I4). The sequence never went live.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum VerifyError {
    /// `tokens_written` is not the grant's prompt tokens: a short (or long)
    /// transfer, such as one page for a long prompt.
    #[error("transfer wrote {written} tokens, the grant covers {granted}")]
    TokenCount {
        /// Prompt tokens granted.
        granted: u64,
        /// Tokens the writer says it wrote.
        written: u64,
    },
    /// The number of page checksums is not the grant's page count.
    #[error("transfer wrote {written} pages, the grant has {granted}")]
    PageCount {
        /// Pages granted.
        granted: usize,
        /// Pages reported.
        written: usize,
    },
    /// A granted page changed hands or generation before verification.
    #[error("granted page {page} (index {index}) is no longer at generation {granted}: now {now}")]
    PageNotHeld {
        /// Logical index.
        index: usize,
        /// Physical page.
        page: u32,
        /// Generation granted.
        granted: u64,
        /// Generation now.
        now: u64,
    },
    /// A page as it landed does not have the checksum the writer computed:
    /// a frame is missing, corrupt or landed twice differently.
    #[error("page index {index}: landed checksum {landed:016x}, writer says {reported:016x}")]
    Checksum {
        /// Logical index.
        index: usize,
        /// Checksum of the page as it is in the pool.
        landed: u64,
        /// Checksum in `TransferDone`.
        reported: u64,
    },
}

impl VerifyError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TokenCount { .. } => "token_count",
            Self::PageCount { .. } => "page_count",
            Self::PageNotHeld { .. } => "page_not_held",
            Self::Checksum { .. } => "checksum",
        }
    }
}

/// Why a reservation's write path was revoked before it went live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RevokeCause {
    /// The lease ran out before transfer-done.
    LeaseExpired,
    /// The writer did not confirm an abort in time.
    AbortTimedOut,
    /// The writer's connection ended (closed, reset, or its process died).
    WriterLost,
    /// Transfer-done arrived but the transfer was not the grant (I4).
    VerificationFailed(VerifyError),
    /// The writer said done while a one-sided write of it was still
    /// active.
    DoneWhileWriting,
    /// The node is shutting down.
    Shutdown,
}

impl RevokeCause {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::LeaseExpired => "lease_expired",
            Self::AbortTimedOut => "abort_timed_out",
            Self::WriterLost => "writer_lost",
            Self::VerificationFailed(_) => "verification_failed",
            Self::DoneWhileWriting => "done_while_writing",
            Self::Shutdown => "shutdown",
        }
    }
}

/// How a reservation ended. Each reservation has exactly one (I7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Verified and handed to decoding as a live sequence; its pages are
    /// released when that sequence is dropped.
    Completed,
    /// Aborted, and the writer confirmed it had stopped and drained.
    Aborted(AbortReason),
    /// The write path was revoked (and the revocation completed) before
    /// the pages were released.
    Revoked(RevokeCause),
}

impl Outcome {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Aborted(_) => "aborted",
            Self::Revoked(c) => c.kind(),
        }
    }
}

/// A reservation that ended without going live (or whose waiter is told it
/// ended): its id and how.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("reservation {id} ended: {outcome:?}")]
pub struct Ended {
    /// The reservation.
    pub id: ReservationId,
    /// How it ended.
    pub outcome: Outcome,
}

/// A control message or frame the table refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum HandshakeError {
    /// A frame that failed its grant's check (or names no live grant).
    #[error(transparent)]
    Frame(#[from] FrameReject),
    /// No reservation with this id is known (never granted here, or ended
    /// so long ago it was forgotten).
    #[error("unknown reservation {0}")]
    UnknownReservation(ReservationId),
    /// The reservation ended already; this message came late.
    #[error("reservation {id} already ended ({outcome})")]
    AlreadyEnded {
        /// The reservation.
        id: ReservationId,
        /// Label of how it ended.
        outcome: &'static str,
    },
    /// The message came on a connection the reservation is not bound to.
    #[error("reservation {0} is bound to another writer connection")]
    WrongConnection(ReservationId),
    /// The message's capability is not the grant's.
    #[error("bad capability for reservation {0}")]
    BadCapability(ReservationId),
    /// The message is not allowed in the reservation's current phase.
    #[error("{event} is not allowed while reservation {id} is {phase}")]
    IllegalTransition {
        /// The reservation.
        id: ReservationId,
        /// Its phase.
        phase: &'static str,
        /// What arrived.
        event: &'static str,
    },
    /// A frame arrived on a connection whose data path is one-sided.
    #[error("KV frames are not accepted on a shared-memory connection")]
    FramesNotAccepted,
    /// A second connection announced a writer id that is connected already.
    #[error("writer {0} is already connected")]
    DuplicateWriter(WriterId),
    /// The connection is not registered (closed meanwhile).
    #[error("unknown connection")]
    UnknownConnection,
    /// A message a writer never sends, after the connection's handshake
    /// (anything before a valid Hello is refused by the listener itself
    /// and counted in `KvServer::auth_refused`).
    #[error("unexpected {0} message from a writer")]
    UnexpectedMessage(&'static str),
}

impl HandshakeError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Frame(r) => r.kind(),
            Self::UnknownReservation(_) => "unknown_reservation",
            Self::AlreadyEnded { .. } => "already_ended",
            Self::WrongConnection(_) => "wrong_connection",
            Self::BadCapability(_) => "bad_capability",
            Self::IllegalTransition { .. } => "illegal_transition",
            Self::FramesNotAccepted => "frames_not_accepted",
            Self::DuplicateWriter(_) => "duplicate_writer",
            Self::UnknownConnection => "unknown_connection",
            Self::UnexpectedMessage(_) => "unexpected_message",
        }
    }
}
