//! What a verified transfer becomes, and the handle a decode service waits
//! on for it.

use std::sync::Weak;

use tokio::sync::oneshot;

use kvmesh_kvpool::Reservation;
use kvmesh_kvwire::{AbortReason, FirstToken, ReservationId};

use super::error::{Ended, Outcome};
use super::table::Inner;

/// A sequence whose prompt KV passed verification (I4): the only way to
/// get one is [`Pending::wait`] after the table verified the transfer, so
/// a sequence that skipped verification cannot be expressed. Its prompt
/// slots are readable (watermarks set), its decode budget is reserved.
/// Dropping it releases every page (no confirmation needed: the writer's
/// transfer-done said it had stopped, and its write path was closed before
/// verification).
#[derive(Debug)]
pub struct LiveSequence {
    pub(super) id: ReservationId,
    pub(super) prompt_tokens: usize,
    pub(super) first: FirstToken,
    pub(super) reservation: Reservation,
}

impl LiveSequence {
    /// The reservation id.
    pub fn id(&self) -> ReservationId {
        self.id
    }

    /// Prompt tokens whose KV was transferred.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The first generated token, sampled by prefill.
    pub fn first_token(&self) -> u32 {
        self.first.id
    }

    /// The first token with prefill's report on it (for the router).
    pub fn first(&self) -> &FirstToken {
        &self.first
    }

    /// The pages: prompt pages verified and readable, then the decode
    /// budget.
    pub fn reservation(&self) -> &Reservation {
        &self.reservation
    }

    /// Mutable access, for decode steps that write generated tokens' KV.
    pub fn reservation_mut(&mut self) -> &mut Reservation {
        &mut self.reservation
    }

    /// The reservation itself, for an engine that owns sequences.
    pub fn into_reservation(self) -> Reservation {
        self.reservation
    }

    /// The first token's report and the reservation, for a decode service
    /// that streams the one and runs the other.
    pub fn into_parts(self) -> (FirstToken, Reservation) {
        (self.first, self.reservation)
    }
}

/// The decode service's handle on a granted reservation: resolves to the
/// live sequence once the transfer is verified, or to how it ended.
/// Dropping it before then aborts the reservation (the client is gone),
/// through the confirmation path.
#[derive(Debug)]
pub struct Pending {
    pub(super) id: ReservationId,
    pub(super) rx: Option<oneshot::Receiver<Result<LiveSequence, Ended>>>,
    pub(super) table: Weak<Inner>,
}

impl Pending {
    /// The reservation id.
    pub fn id(&self) -> ReservationId {
        self.id
    }

    /// Waits for the transfer's verdict. Cancel-safe in the sense that
    /// matters: dropping the future drops `self`, which aborts.
    pub async fn wait(mut self) -> Result<LiveSequence, Ended> {
        let id = self.id;
        let result = match self.rx.as_mut() {
            Some(rx) => rx.await.unwrap_or(Err(Ended {
                id,
                outcome: Outcome::Revoked(super::RevokeCause::Shutdown),
            })),
            None => Err(Ended {
                id,
                outcome: Outcome::Revoked(super::RevokeCause::Shutdown),
            }),
        };
        self.rx = None;
        result
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.rx.is_some() {
            if let Some(inner) = self.table.upgrade() {
                // Ignored result: the reservation may have ended meanwhile.
                let _ = inner.abort(self.id, AbortReason::CANCELLED);
            }
        }
    }
}
