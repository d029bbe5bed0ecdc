//! The reservation table's counters: ends by outcome, refusals by kind.

/// Labels of [`TableStats::ended_by`]: every `Outcome::kind`.
pub const OUTCOME_KINDS: [&str; 8] = [
    "completed",
    "aborted",
    "lease_expired",
    "abort_timed_out",
    "writer_lost",
    "verification_failed",
    "done_while_writing",
    "shutdown",
];

/// Labels of [`TableStats::control_rejects`]: every `HandshakeError::kind`
/// that is not a frame reject.
pub const CONTROL_REJECT_KINDS: [&str; 9] = [
    "unknown_reservation",
    "already_ended",
    "wrong_connection",
    "bad_capability",
    "illegal_transition",
    "frames_not_accepted",
    "duplicate_writer",
    "unknown_connection",
    "unexpected_message",
];

/// Counters of the table, a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableStats {
    /// Grants issued.
    pub granted: u64,
    /// Reserve requests refused.
    pub refused: u64,
    /// Reservations in the table now (granted, writing, aborting,
    /// revoking).
    pub open: usize,
    /// Of those, quarantined: ending, but the write path is still open.
    pub revoking: usize,
    /// Frames landed.
    pub frames_landed: u64,
    /// KV bytes of the transfers that completed (verified): for each, the
    /// prompt positions the writer had to write (the grant's
    /// `prompt_tokens - cached_tokens`, so decode-side cache hits are not
    /// shipped and not counted) times K and V of every layer. Counted the
    /// same whatever the transport (frames or one-sided writes).
    pub kv_bytes_received: u64,
    /// Ends by outcome ([`OUTCOME_KINDS`]).
    pub ended_by: [(&'static str, u64); OUTCOME_KINDS.len()],
    /// Frames refused, by kind.
    pub frame_rejects: u64,
    /// Control messages refused, by kind ([`CONTROL_REJECT_KINDS`]).
    pub control_rejects: [(&'static str, u64); CONTROL_REJECT_KINDS.len()],
}

impl TableStats {
    /// Ends of one outcome kind.
    pub fn ended(&self, kind: &str) -> u64 {
        self.ended_by
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }

    /// All ends.
    pub fn ended_total(&self) -> u64 {
        self.ended_by.iter().map(|(_, n)| n).sum()
    }

    /// Control rejects of one kind.
    pub fn control_rejected(&self, kind: &str) -> u64 {
        self.control_rejects
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}
