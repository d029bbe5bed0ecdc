//! The transitions: which actions are enabled in a state, and what each
//! does. This is the handshake of design/kv-safety.md section 3, one rule
//! per action; every departure a [`Bug`] makes is marked where it happens.

use super::state::{
    DecodeSide, End, Generation, Health, Msg, Page, PageId, Phase, Rid, State, Wid, WriterSide,
};
use super::{Bug, HandshakeModel, Transport};

/// One step of the system. Actors' steps are named after what they do;
/// network steps name the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// D allocates the request's pages (all or nothing) and sends the grant.
    Reserve(Rid),
    /// The writer sends its next prompt token's frame.
    Write(Rid),
    /// The writer, having sent every token and seen every write complete,
    /// sends TransferDone.
    SendDone(Rid),
    /// The writer, stopped and drained, sends AbortConfirmed.
    Confirm(Rid),
    /// Router, client or D aborts a reservation that is not live yet.
    Abort(Rid),
    /// The lease (or the abort's wait for confirmation) times out.
    Expire(Rid),
    /// A live sequence finishes (or is aborted while decoding).
    Finish(Rid),
    /// A writer process crashes.
    Crash(Wid),
    /// D sees the crashed writer's connection reset.
    DetectCrash(Wid),
    /// The network delivers one copy of a message (any one: reordering).
    Deliver(Msg),
    /// The network loses one copy of a message.
    Drop(Msg),
    /// The network delivers one copy of a message and keeps another in
    /// flight, to be delivered again or lost later. (A duplicate made at
    /// any earlier moment behaves the same, so this is the one place it is
    /// made: that keeps the checker off orderings that differ only in when
    /// the copy was made.)
    DeliverDuplicate(Msg),
}

impl HandshakeModel {
    /// Pages request `rid` needs.
    pub(crate) fn pages_needed(&self, rid: Rid) -> usize {
        let tokens = self.tokens(rid) as usize;
        tokens.div_ceil(self.scenario.slots_per_page as usize)
    }

    /// Prompt tokens of request `rid`.
    pub(crate) fn tokens(&self, rid: Rid) -> u8 {
        self.scenario
            .requests
            .get(rid as usize)
            .map_or(0, |r| r.tokens)
    }

    fn writer_up(s: &State, d: &DecodeSide) -> bool {
        d.writer
            .and_then(|w| s.health.get(w as usize))
            .is_some_and(|h| *h == Health::Up)
    }

    pub(crate) fn enabled(&self, s: &State, out: &mut Vec<Action>) {
        let bug = self.scenario.bug;
        let faults = &self.scenario.faults;
        for (i, d) in s.decode.iter().enumerate() {
            let rid = i as Rid;
            match d.phase {
                Phase::Requested => {
                    if s.free_pages() >= self.pages_needed(rid) {
                        out.push(Action::Reserve(rid));
                    }
                }
                Phase::Granted => {
                    if faults.aborts {
                        out.push(Action::Abort(rid));
                    }
                    if faults.lease_expiry {
                        out.push(Action::Expire(rid));
                    }
                }
                Phase::Aborting => {
                    if faults.lease_expiry {
                        out.push(Action::Expire(rid));
                    }
                }
                Phase::Live => out.push(Action::Finish(rid)),
                Phase::Ended(_) => {}
            }
            if !Self::writer_up(s, d) {
                continue;
            }
            match s.writer[i] {
                WriterSide::Writing { sent } if sent < self.tokens(rid) => {
                    out.push(Action::Write(rid));
                }
                WriterSide::Writing { .. } => {
                    if s.drained(rid) || bug == Bug::DoneBeforeDrain {
                        out.push(Action::SendDone(rid));
                    }
                }
                WriterSide::Stopped { owes_confirm: true } => {
                    if s.drained(rid) || bug == Bug::ConfirmBeforeDrain {
                        out.push(Action::Confirm(rid));
                    }
                }
                WriterSide::NoGrant | WriterSide::Finished | WriterSide::Stopped { .. } => {}
            }
        }
        for (i, h) in s.health.iter().enumerate() {
            match h {
                Health::Up if s.crashes_left > 0 => out.push(Action::Crash(i as Wid)),
                Health::Crashed => out.push(Action::DetectCrash(i as Wid)),
                _ => {}
            }
        }
        let mut last = None;
        for m in &s.net {
            if last == Some(m) {
                continue;
            }
            last = Some(m);
            out.push(Action::Deliver(*m));
            if s.drops_left > 0 {
                out.push(Action::Drop(*m));
            }
            if s.dups_left > 0 {
                out.push(Action::DeliverDuplicate(*m));
            }
        }
    }

    /// The state after `a`, or `None` if `a` is not enabled in `s`.
    pub(crate) fn apply(&self, s: &State, a: Action) -> Option<State> {
        let mut n = s.clone();
        let bug = self.scenario.bug;
        match a {
            Action::Reserve(rid) => self.reserve(&mut n, rid)?,
            Action::Write(rid) => {
                let sent = match n.writer.get(rid as usize)? {
                    WriterSide::Writing { sent } => *sent,
                    _ => return None,
                };
                let d = n.decode.get(rid as usize)?;
                let spp = self.scenario.slots_per_page;
                let &(page, generation) = d.table.get((sent / spp) as usize)?;
                // A revoked path: the write fails at the writer's end.
                if !d.revoked {
                    n.send(Msg::Frame {
                        rid,
                        page,
                        generation,
                        slot: sent % spp,
                    });
                }
                n.writer[rid as usize] = WriterSide::Writing { sent: sent + 1 };
            }
            Action::SendDone(rid) => {
                *n.writer.get_mut(rid as usize)? = WriterSide::Finished;
                n.send(Msg::Done { rid });
            }
            Action::Confirm(rid) => {
                *n.writer.get_mut(rid as usize)? = WriterSide::Stopped {
                    owes_confirm: false,
                };
                n.send(Msg::AbortConfirmed { rid });
            }
            Action::Abort(rid) => self.begin_abort(&mut n, rid),
            Action::Expire(rid) => {
                if bug == Bug::FreeOnTimeout {
                    // The bug: a timeout alone frees (SGLang #38961).
                    release(&mut n, rid, End::FreedUnconfirmed);
                } else {
                    revoke(&mut n, rid);
                    release(&mut n, rid, End::Revoked);
                }
            }
            Action::Finish(rid) => release(&mut n, rid, End::Completed),
            Action::Crash(w) => {
                *n.health.get_mut(w as usize)? = Health::Crashed;
                n.crashes_left = n.crashes_left.checked_sub(1)?;
            }
            Action::DetectCrash(w) => {
                *n.health.get_mut(w as usize)? = Health::Detected;
                // The reset tears down the writer's write path: that is the
                // revocation, so everything it held can be freed now. Live
                // sequences no longer need their writer.
                for rid in 0..n.decode.len() as Rid {
                    let d = &n.decode[rid as usize];
                    if d.writer == Some(w) && matches!(d.phase, Phase::Granted | Phase::Aborting) {
                        revoke(&mut n, rid);
                        release(&mut n, rid, End::Revoked);
                    }
                }
            }
            Action::Deliver(m) => {
                if !n.take(&m) {
                    return None;
                }
                self.deliver(&mut n, m);
            }
            Action::Drop(m) => {
                n.drops_left = n.drops_left.checked_sub(1)?;
                if !n.take(&m) {
                    return None;
                }
            }
            Action::DeliverDuplicate(m) => {
                n.dups_left = n.dups_left.checked_sub(1)?;
                if !n.net.contains(&m) {
                    return None;
                }
                self.deliver(&mut n, m);
            }
        }
        debug_assert!(
            self.progress(&n) < self.progress(s),
            "{a:?} did not make progress: the model would have a cycle"
        );
        Some(n)
    }

    /// A measure that every transition strictly decreases
    /// (lexicographically), so the state graph has no cycle and every run
    /// is finite: what makes stateright's `eventually` exact here (see the
    /// module docs). `apply` checks it on every step in debug builds.
    ///
    /// Components, most significant first: fault budgets and writer health
    /// (lose, duplicate and crash spend a budget, crash detection advances
    /// health); D's phases (each moves forward only); writers' phases
    /// (forward only: `NoGrant`, `Writing` by tokens sent, `Finished`,
    /// `Stopped`); Abort messages in flight (delivering one may make its
    /// writer owe a confirmation); owed confirmations (sending one adds an
    /// AbortConfirmed); every other message in flight (delivering one
    /// consumes it, and whatever it adds comes with a move in a more
    /// significant component).
    pub fn progress(&self, s: &State) -> [usize; 6] {
        let health: usize = s
            .health
            .iter()
            .map(|h| match h {
                Health::Up => 2,
                Health::Crashed => 1,
                Health::Detected => 0,
            })
            .sum();
        let budgets = usize::from(s.drops_left)
            + usize::from(s.dups_left)
            + usize::from(s.crashes_left)
            + health;
        let decode: usize = s
            .decode
            .iter()
            .map(|d| match d.phase {
                Phase::Requested => 3,
                Phase::Granted => 2,
                Phase::Aborting | Phase::Live => 1,
                Phase::Ended(_) => 0,
            })
            .sum();
        let writers: usize = s
            .writer
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let tokens = usize::from(self.tokens(i as Rid));
                match *w {
                    WriterSide::NoGrant => tokens + 3,
                    WriterSide::Writing { sent } => (tokens + 2).saturating_sub(usize::from(sent)),
                    WriterSide::Finished => 1,
                    WriterSide::Stopped { .. } => 0,
                }
            })
            .sum();
        let aborts = s
            .net
            .iter()
            .filter(|m| matches!(m, Msg::Abort { .. }))
            .count();
        let owed = s
            .writer
            .iter()
            .filter(|w| **w == WriterSide::Stopped { owes_confirm: true })
            .count();
        [budgets, decode, writers, aborts, owed, s.net.len() - aborts]
    }

    fn reserve(&self, n: &mut State, rid: Rid) -> Option<()> {
        let need = self.pages_needed(rid);
        let free: Vec<usize> = (0..n.pages.len()).filter(|&p| n.pages[p].free).collect();
        if free.len() < need {
            return None;
        }
        // The router sends the request to its preferred writer unless D
        // already knows that writer is dead; `validate` keeps crashes below
        // the writer count, so some writer is never known dead.
        let preferred = self.scenario.requests.get(rid as usize)?.writer;
        let writer = if n.health.get(preferred as usize) == Some(&Health::Detected) {
            n.health.iter().position(|h| *h != Health::Detected)? as Wid
        } else {
            preferred
        };
        // Lowest free pages first. The scenarios size the pool so that the
        // second reservation must reuse a page whatever the order.
        let mut table = Vec::with_capacity(need);
        for &p in free.iter().take(need) {
            let page = &mut n.pages[p];
            page.generation = page.generation.wrapping_add(1);
            page.owner = Some(rid);
            page.free = false;
            table.push((p as u8, page.generation));
        }
        let d = n.decode.get_mut(rid as usize)?;
        d.phase = Phase::Granted;
        d.writer = Some(writer);
        d.table = table;
        n.send(Msg::Grant { rid });
        Some(())
    }

    /// D stops the reservation at once and tells its writer; the pages
    /// stay held until the writer confirms or is revoked.
    fn begin_abort(&self, n: &mut State, rid: Rid) {
        if self.scenario.bug == Bug::FreeOnAbortWithoutConfirm {
            // The bug: free on abort while a write may be in flight
            // (SGLang #24527, #32564).
            release(n, rid, End::FreedUnconfirmed);
        } else if let Some(d) = n.decode.get_mut(rid as usize) {
            d.phase = Phase::Aborting;
        }
        n.send(Msg::Abort { rid });
    }

    fn deliver(&self, n: &mut State, m: Msg) {
        let bug = self.scenario.bug;
        let i = m.rid() as usize;
        let (Some(d), Some(w)) = (n.decode.get(i), n.writer.get(i)) else {
            return;
        };
        let writer_up = Self::writer_up(n, d);
        match m {
            Msg::Grant { .. } => {
                // A crashed writer never reads it; a tombstone ignores it.
                if writer_up && *w == WriterSide::NoGrant {
                    n.writer[i] = WriterSide::Writing { sent: 0 };
                }
            }
            Msg::Frame {
                rid, page, slot, ..
            } => {
                // A refused frame is dropped and counted (the counter is
                // abstracted away). Revoked frames never get here: revoke
                // removes them from the network.
                if self.frame_lands(n, &m) {
                    if let Some(s) = n
                        .pages
                        .get_mut(page as usize)
                        .and_then(|p| p.slots.get_mut(slot as usize))
                    {
                        *s = Some(rid);
                    }
                }
            }
            Msg::Done { rid } => {
                // Done for a reservation that is not being written (ended,
                // aborting, already live) is rejected and counted.
                if d.phase == Phase::Granted {
                    if bug == Bug::SkipVerification || self.verifies(n, rid) {
                        self.go_live(n, rid);
                    } else {
                        self.begin_abort(n, rid);
                    }
                }
            }
            Msg::Abort { .. } => {
                if !writer_up {
                    return;
                }
                let next = match *w {
                    WriterSide::NoGrant if bug == Bug::NoAbortTombstone => {
                        // The bug: confirm without remembering, so a grant
                        // that arrives later starts writing.
                        n.send(Msg::AbortConfirmed { rid: m.rid() });
                        WriterSide::NoGrant
                    }
                    WriterSide::Finished if bug == Bug::IgnoreAbortAfterDone => {
                        WriterSide::Finished
                    }
                    // Answer every abort, also one for a grant never seen
                    // or a transfer already done: D may be waiting on it.
                    _ => WriterSide::Stopped { owes_confirm: true },
                };
                n.writer[i] = next;
            }
            Msg::AbortConfirmed { rid } => match d.phase {
                Phase::Aborting => release(n, rid, End::AbortConfirmed),
                Phase::Ended(end) if bug == Bug::ReleaseOnLateConfirm => {
                    // The bug: the release path does not look at the state,
                    // so a late or duplicated confirmation ends it again.
                    release(n, rid, end);
                }
                // Late or duplicate: rejected and counted.
                _ => {}
            },
        }
    }

    /// I4: the grant's pages still carry the granted generation and owner,
    /// and every prompt slot holds this reservation's data (the model's
    /// checksum compares the actual contents). The writer's Done claims the
    /// grant's page and token counts; what landed is what is checked.
    fn verifies(&self, n: &State, rid: Rid) -> bool {
        let Some(d) = n.decode.get(rid as usize) else {
            return false;
        };
        let pages_ok = d.table.iter().all(|&(p, g)| {
            n.pages
                .get(p as usize)
                .is_some_and(|pg| pg.generation == g && pg.owner == Some(rid))
        });
        pages_ok
            && self
                .prompt_slots(rid, d)
                .all(|(p, _, slot)| slot_holds(n, p, slot) == Some(rid))
    }

    fn go_live(&self, n: &mut State, rid: Rid) {
        let spp = usize::from(self.scenario.slots_per_page);
        let tokens = usize::from(self.tokens(rid));
        let Some(d) = n.decode.get_mut(rid as usize) else {
            return;
        };
        d.phase = Phase::Live;
        for (i, &(p, _)) in d.table.iter().enumerate() {
            // At most `spp`, which is a u8.
            let on_page = tokens.saturating_sub(i * spp).min(spp) as u8;
            if let Some(page) = n.pages.get_mut(p as usize) {
                page.watermark = on_page;
            }
        }
    }

    /// (page, granted generation, slot) of each prompt token of
    /// reservation `rid`, in token order.
    pub(crate) fn prompt_slots<'a>(
        &self,
        rid: Rid,
        d: &'a DecodeSide,
    ) -> impl Iterator<Item = (PageId, Generation, u8)> + 'a {
        let spp = self.scenario.slots_per_page;
        (0..self.tokens(rid)).filter_map(move |t| {
            d.table
                .get((t / spp) as usize)
                .map(|&(p, g)| (p, g, t % spp))
        })
    }

    /// Whether a frame in flight would land if delivered now. One-sided:
    /// always, unless its path was revoked. Receiver-checked: only if D
    /// accepts it: a reservation being written, the page in its grant at
    /// the granted generation, the page still that reservation's.
    pub(crate) fn frame_lands(&self, n: &State, frame: &Msg) -> bool {
        let Msg::Frame {
            rid,
            page,
            generation,
            ..
        } = *frame
        else {
            return false;
        };
        let Some(d) = n.decode.get(rid as usize) else {
            return false;
        };
        if d.revoked {
            return false;
        }
        match self.scenario.transport {
            Transport::OneSided => true,
            Transport::ReceiverChecked => {
                d.phase == Phase::Granted
                    && d.table.contains(&(page, generation))
                    && n.pages
                        .get(page as usize)
                        .is_some_and(|p| p.generation == generation && p.owner == Some(rid))
            }
        }
    }
}

pub(crate) fn slot_holds(n: &State, page: u8, slot: u8) -> Option<Rid> {
    n.pages
        .get(page as usize)
        .and_then(|p| p.slots.get(slot as usize))
        .copied()
        .flatten()
}

/// Tears down the reservation's write path: its frames in flight die, and
/// nothing it sends later lands.
fn revoke(n: &mut State, rid: Rid) {
    if let Some(d) = n.decode.get_mut(rid as usize) {
        d.revoked = true;
    }
    n.net
        .retain(|m| !matches!(m, Msg::Frame { rid: r, .. } if *r == rid));
}

/// The pool's one release path: every page still held by `rid` gets a new
/// generation, loses owner and watermark and rejoins the free list (a page
/// not held by `rid` is left alone, as in `Shared::release`). Counts the end.
fn release(n: &mut State, rid: Rid, end: End) {
    let Some(d) = n.decode.get_mut(rid as usize) else {
        return;
    };
    d.phase = Phase::Ended(end);
    d.ends = d.ends.saturating_add(1);
    for &(p, _) in &d.table {
        if let Some(page) = n.pages.get_mut(p as usize) {
            if page.owner == Some(rid) {
                release_page(page);
            }
        }
    }
}

fn release_page(page: &mut Page) {
    page.generation = page.generation.wrapping_add(1);
    page.owner = None;
    page.free = true;
    page.watermark = 0;
}
