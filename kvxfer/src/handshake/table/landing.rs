//! The transfer half of a reservation: frames landing over a
//! receiver-checked transport, and the writer's TransferDone, which I4
//! verifies (page count, checksums) before the pages are adopted.

use super::*;

impl Inner {
    pub(super) fn land_frame(
        &self,
        conn: ConnId,
        frame: &KvFrame<'_>,
    ) -> Result<(), HandshakeError> {
        if !self.landing.receiver_checked() {
            return Err(HandshakeError::FramesNotAccepted);
        }
        let unknown = || FrameReject::UnknownReservation {
            got: frame.reservation,
        };
        let entry = self.entry(frame.reservation).map_err(|_| unknown())?;
        let mut e = lock(&entry);
        if e.conn != conn {
            return Err(unknown().into());
        }
        e.grant.check_frame(frame)?;
        let prompt_slots = e.grant.prompt_slots(frame.page_index as usize).unwrap_or(0);
        let Entry { phase, scratch, .. } = &mut *e;
        let res = match phase {
            Phase::Granted(r) | Phase::Writing(r) => r,
            // Aborting, revoking or ended: the write path is closed. A late
            // frame is refused on arrival (the TCP receiver check).
            _ => return Err(unknown().into()),
        };
        let layers = usize::from(frame.layers.start)..usize::from(frame.layers.end);
        let slots = frame.slots.start as usize..frame.slots.end as usize;
        crate::landing::land_payload(
            res,
            frame.page_index as usize,
            layers,
            slots,
            frame.payload,
            scratch,
        )
        .map_err(|_| {
            HandshakeError::Frame(FrameReject::SlotsOutOfPrompt {
                index: frame.page_index,
                end: frame.slots.end,
                prompt_slots,
            })
        })?;
        let n_layers = usize::from(self.geometry.n_layers);
        for layer in frame.layers.clone() {
            let at = frame.page_index as usize * n_layers + usize::from(layer);
            if let Some(l) = e.landed.get_mut(at) {
                if frame.slots.start <= *l {
                    *l = (*l).max(frame.slots.end);
                }
            }
        }
        if let Phase::Granted(_) = e.phase {
            if let Phase::Granted(r) = std::mem::replace(&mut e.phase, Phase::Moving) {
                e.phase = Phase::Writing(r);
            }
        }
        Ok(())
    }

    pub(super) fn transfer_done(
        &self,
        conn: ConnId,
        done: &TransferDone,
    ) -> Result<Outcome, HandshakeError> {
        let id = done.reservation;
        let entry = self.entry(id)?;
        let mut e = lock(&entry);
        if e.conn != conn {
            return Err(HandshakeError::WrongConnection(id));
        }
        if done.capability != e.grant.capability {
            return Err(HandshakeError::BadCapability(id));
        }
        if !matches!(e.phase, Phase::Granted(_) | Phase::Writing(_)) {
            return Err(HandshakeError::IllegalTransition {
                id,
                phase: e.phase.name(),
                event: "transfer_done",
            });
        }
        let written = e.grant.prompt_tokens.saturating_sub(e.grant.cached_tokens);
        let span = kv_span!(
            &e.span,
            "kv.verify",
            reservation.id = %id,
            pages = e.grant.pages.len() as u64,
            tokens = written,
            outcome = tracing::field::Empty
        );
        let _entered = span.enter();
        // Close the write path before looking at the pages: what is
        // verified can no longer change.
        if let Revocation::Pending { .. } =
            self.landing.revoke(e.grant.write_key, e.peer.as_deref())
        {
            let outcome = Outcome::Revoked(RevokeCause::DoneWhileWriting);
            span.record("outcome", outcome.kind());
            self.quarantine(&mut e, outcome.clone());
            return Ok(outcome);
        }
        let (Phase::Granted(mut res) | Phase::Writing(mut res)) =
            std::mem::replace(&mut e.phase, Phase::Moving)
        else {
            return Err(HandshakeError::IllegalTransition {
                id,
                phase: "moving",
                event: "transfer_done",
            });
        };
        if e.faults.at(kvmesh_faults::Point::Verify) == Some(kvmesh_faults::Action::Corrupt) {
            res.corrupt_landed_value(0);
        }
        let checked = if kvmesh_faults::planted(kvmesh_faults::PlantedBug::NoVerification)
            || kvmesh_faults::planted(kvmesh_faults::PlantedBug::NoKvChecks)
        {
            Ok(())
        } else {
            verify(&e.grant, &res, done)
        };
        let outcome = match checked {
            Ok(()) => {
                let landed = self
                    .landing
                    .receiver_checked()
                    .then_some(e.landed.as_slice());
                res.publish_prompt(e.grant.prompt_tokens as usize, landed);
                let bytes = u32::try_from(written)
                    .ok()
                    .and_then(|n| {
                        e.grant
                            .geometry
                            .payload_len(&(0..e.grant.geometry.n_layers), n)
                    })
                    .unwrap_or(u64::MAX);
                self.kv_bytes_received.fetch_add(bytes, Ordering::Relaxed);
                let live = LiveSequence {
                    id,
                    prompt_tokens: e.grant.prompt_tokens as usize,
                    // A copy: the message is the connection's reader's
                    // (the prompt's scores, when asked, are the bulk).
                    first: done.first.clone(),
                    reservation: res,
                };
                if let Some(tx) = e.waiter.take() {
                    // A waiter that is gone drops the sequence: its pages
                    // are released (the writer has stopped and drained).
                    let _ = tx.send(Ok(live));
                }
                Outcome::Completed
            }
            Err(v) => {
                drop(res);
                Outcome::Revoked(RevokeCause::VerificationFailed(v))
            }
        };
        span.record("outcome", outcome.kind());
        self.finish(&mut e, outcome.clone());
        drop(e);
        self.forget_if_ended(id);
        Ok(outcome)
    }
}
