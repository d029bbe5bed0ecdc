//! How a reservation ends: aborts and their confirmation (I5), lost
//! connections, lease expiry, quarantine until the writer's path is
//! revoked, and the tombstones that answer late messages. The messages the
//! table sends (Abort, Revoke) go out here too.

use std::time::Instant;

use super::*;

impl Inner {
    pub(crate) fn abort(
        &self,
        id: ReservationId,
        reason: AbortReason,
    ) -> Result<&'static str, HandshakeError> {
        let entry = match self.entry(id) {
            Ok(e) => e,
            Err(HandshakeError::AlreadyEnded { outcome, .. }) => return Ok(outcome),
            Err(e) => return Err(e),
        };
        let mut e = lock(&entry);
        let span = kv_span!(
            &e.span,
            "kv.abort",
            reservation.id = %id,
            reason = u64::from(reason.0),
            phase = e.phase.name()
        );
        let _entered = span.enter();
        match std::mem::replace(&mut e.phase, Phase::Moving) {
            Phase::Granted(res) | Phase::Writing(res)
                if kvmesh_faults::planted(kvmesh_faults::PlantedBug::NoConfirmOrRevoke) =>
            {
                // The planted bug: tell the writer, then free at once,
                // neither waiting for its confirmation nor revoking its
                // path.
                self.send(
                    e.conn,
                    &Abort {
                        reservation: id,
                        reason,
                    },
                );
                drop(res);
                self.finish(&mut e, Outcome::Aborted(reason));
                drop(e);
                self.forget_if_ended(id);
                Ok("aborted")
            }
            Phase::Granted(res) | Phase::Writing(res) => {
                e.phase = Phase::Aborting {
                    res,
                    reason,
                    deadline: Instant::now() + self.cfg.abort_timeout,
                };
                self.send(
                    e.conn,
                    &Abort {
                        reservation: id,
                        reason,
                    },
                );
                Ok("aborting")
            }
            Phase::Ended(outcome) => {
                let kind = outcome.kind();
                e.phase = Phase::Ended(outcome);
                Ok(kind)
            }
            other => {
                let name = other.name();
                e.phase = other;
                Ok(name)
            }
        }
    }

    pub(super) fn abort_confirmed(
        &self,
        conn: ConnId,
        msg: &AbortConfirmed,
    ) -> Result<Outcome, HandshakeError> {
        let id = msg.reservation;
        let entry = self.entry(id)?;
        let mut e = lock(&entry);
        if e.conn != conn {
            return Err(HandshakeError::WrongConnection(id));
        }
        let Phase::Aborting { reason, .. } = e.phase else {
            return Err(HandshakeError::IllegalTransition {
                id,
                phase: e.phase.name(),
                event: "abort_confirmed",
            });
        };
        let span = kv_span!(&e.span, "kv.abort_confirmed", reservation.id = %id);
        let _entered = span.enter();
        let outcome = Outcome::Aborted(reason);
        self.end(&mut e, outcome.clone());
        drop(e);
        self.forget_if_ended(id);
        Ok(outcome)
    }

    pub(super) fn connection_lost(&self, conn: ConnId) {
        {
            let mut conns = lock(&self.conns);
            if let Some(c) = conns.by_id.remove(&conn) {
                conns.by_writer.remove(&c.writer);
            }
        }
        for entry in self.snapshot() {
            let mut e = lock(&entry);
            if e.conn != conn {
                continue;
            }
            let id = e.grant.reservation;
            if matches!(
                e.phase,
                Phase::Granted(_) | Phase::Writing(_) | Phase::Aborting { .. }
            ) {
                self.end(&mut e, Outcome::Revoked(RevokeCause::WriterLost));
            } else if let Phase::Revoking { .. } = e.phase {
                self.retry_revoke(&mut e);
            }
            drop(e);
            self.forget_if_ended(id);
        }
    }

    pub(super) fn tick(&self, now: Instant) {
        for entry in self.snapshot() {
            let mut e = lock(&entry);
            let id = e.grant.reservation;
            match e.phase {
                Phase::Granted(_) | Phase::Writing(_) if now >= e.lease_deadline => {
                    self.end(&mut e, Outcome::Revoked(RevokeCause::LeaseExpired));
                    self.send(e.conn, &Revoke { reservation: id });
                }
                Phase::Aborting { deadline, .. } if now >= deadline => {
                    self.end(&mut e, Outcome::Revoked(RevokeCause::AbortTimedOut));
                    self.send(e.conn, &Revoke { reservation: id });
                }
                Phase::Revoking { .. } => self.retry_revoke(&mut e),
                _ => {}
            }
            drop(e);
            self.forget_if_ended(id);
        }
    }

    /// Ends a reservation that is not live: revoke its write path, then
    /// free (or quarantine while the revocation is pending).
    pub(super) fn end(&self, e: &mut Entry, outcome: Outcome) {
        let span = kv_span!(
            &e.span,
            "kv.revoke",
            reservation.id = %e.grant.reservation,
            outcome = outcome.kind(),
            quarantined = tracing::field::Empty
        );
        let _entered = span.enter();
        match self.landing.revoke(e.grant.write_key, e.peer.as_deref()) {
            Revocation::Complete => {
                // Dropping the reservation releases its pages: new
                // generations, owners cleared, watermarks reset.
                e.phase = Phase::Moving;
                self.finish(e, outcome);
            }
            Revocation::Pending { .. } => {
                span.record("quarantined", true);
                self.quarantine(e, outcome);
            }
        }
    }

    pub(super) fn quarantine(&self, e: &mut Entry, outcome: Outcome) {
        match std::mem::replace(&mut e.phase, Phase::Moving) {
            Phase::Granted(res)
            | Phase::Writing(res)
            | Phase::Aborting { res, .. }
            | Phase::Revoking { res, .. } => e.phase = Phase::Revoking { res, outcome },
            other => e.phase = other,
        }
    }

    pub(super) fn retry_revoke(&self, e: &mut Entry) {
        if let Revocation::Complete = self.landing.revoke(e.grant.write_key, e.peer.as_deref()) {
            if let Phase::Revoking { outcome, .. } = std::mem::replace(&mut e.phase, Phase::Moving)
            {
                self.finish(e, outcome);
            }
        }
    }

    /// The one place a reservation ends: records the outcome, tells the
    /// waiter, counts. The pages were released (phase dropped) or handed to
    /// the live sequence by the caller.
    pub(super) fn finish(&self, e: &mut Entry, outcome: Outcome) {
        e.phase = Phase::Ended(outcome.clone());
        self.ended.bump_label(&OUTCOME_KINDS, outcome.kind());
        if let Some(tx) = e.waiter.take() {
            let _ = tx.send(Err(Ended {
                id: e.grant.reservation,
                outcome,
            }));
        }
    }

    pub(super) fn forget_if_ended(&self, id: ReservationId) {
        let mut entries = lock(&self.entries);
        let ended = entries.get(&id).and_then(|e| match &lock(e).phase {
            Phase::Ended(o) => Some(o.kind()),
            _ => None,
        });
        if let Some(kind) = ended {
            entries.remove(&id);
            drop(entries);
            let mut t = lock(&self.tombstones);
            t.order.push_back(id);
            t.outcome.insert(id, kind);
            while t.order.len() > TOMBSTONES {
                if let Some(old) = t.order.pop_front() {
                    t.outcome.remove(&old);
                }
            }
        }
    }

    pub(super) fn send<M: Encode>(&self, conn: ConnId, msg: &M) {
        let mut bytes = Vec::new();
        if msg.encode_into(&mut bytes).is_err() {
            return;
        }
        if let Some(c) = lock(&self.conns).by_id.get(&conn) {
            // Full cannot happen while the connection is drained (see
            // `Outbound`); a closed channel means the connection is going,
            // and `connection_lost` revokes everything bound to it.
            let _ = c.tx.try_send(bytes);
        }
    }
}

/// Messages the table sends.
pub(super) trait Encode {
    fn encode_into(&self, out: &mut Vec<u8>) -> Result<usize, kvmesh_kvwire::WireError>;
}

impl Encode for Abort {
    fn encode_into(&self, out: &mut Vec<u8>) -> Result<usize, kvmesh_kvwire::WireError> {
        self.encode(out)
    }
}

impl Encode for Revoke {
    fn encode_into(&self, out: &mut Vec<u8>) -> Result<usize, kvmesh_kvwire::WireError> {
        self.encode(out)
    }
}
