//! The reservation and abort handshake at run time (design/kv-safety.md
//! section 3), following the rules of the checked model
//! (`protocol_model`).
//!
//! - Decode side: [`ReservationTable`] grants pages ([`ReservationTable::reserve`]:
//!   all pages of prompt plus decode budget, or a typed [`ReserveError`]),
//!   lands frames, verifies transfers (I4) and ends every reservation
//!   exactly once ([`Outcome`], I7), releasing pages only once the
//!   writer's path is closed (I5).
//! - Its phases: granted → writing → (verified) live, or → aborting →
//!   aborted (confirmed), or → revoked (lease expired, abort timed out,
//!   writer lost, verification failed), with a quarantine phase while a
//!   revocation waits for an active one-sided write. The pages move by
//!   value from phase to phase; a verified transfer becomes a
//!   [`LiveSequence`], the only type a decode engine gets pages from, and
//!   it can only be made by verification.
//! - Prefill side: [`crate::transport::client::GrantWriter`], bound to
//!   exactly one grant.

mod error;
mod live;
mod stats;
mod table;
mod verify;

pub use error::{Ended, HandshakeError, Outcome, ReserveError, RevokeCause, VerifyError};
pub use live::{LiveSequence, Pending};
pub use stats::{TableStats, CONTROL_REJECT_KINDS, OUTCOME_KINDS};
pub use table::{
    outbound_capacity, ConnId, Outbound, ReservationTable, ReserveRequest, TableConfig,
};
