//! The checked properties, as predicates on one state. The module docs
//! say what each means and which invariant it stands for.

use super::state::{End, Health, Msg, Phase, Rid, State, WriterSide};
use super::HandshakeModel;

/// Property A (I1, I2, I4): no live sequence's read would see a slot that
/// is unwritten for it or holds another reservation's data.
pub const SAFE_READS: &str = "A: a live read sees only its own written slots (I1, I2, I4)";
/// Property B (I5): no page leaves a reservation (freed, or held by
/// another) while that reservation's writer can still write it.
pub const NO_LATE_WRITES: &str =
    "B: no page leaves a reservation while its writer can still write it (I5)";
/// Property C (I7): every reservation ends at most once, and free pages
/// plus held pages always make up the pool.
pub const ENDS_ONCE: &str = "C: every reservation ends at most once, no page leaks (I7)";
/// Property D (I7): every reservation ends, and the pool is whole again.
pub const ALL_END: &str = "D: every reservation ends and the pool is whole again (I7)";
/// Sanity (sometimes): a page is allocated a second time, so the scenario
/// exercises reuse at all.
pub const PAGE_REUSED: &str = "a page is reused";
/// Sanity (sometimes): every request completes, so the scenario is not
/// all aborts.
pub const ALL_COMPLETE: &str = "every reservation completes";

/// Property A. A live sequence's read checks each page's generation and
/// owner against its table (I1) and stays below the page's watermark (I2);
/// a read that fails a check sees nothing (it fails the sequence and
/// raises the alarm). So the property is: every prompt slot that passes
/// both checks holds this reservation's data.
pub(crate) fn safe_reads(m: &HandshakeModel, s: &State) -> bool {
    s.decode.iter().enumerate().all(|(i, d)| {
        let rid = i as Rid;
        d.phase != Phase::Live
            || m.prompt_slots(rid, d).all(|(p, g, slot)| {
                let Some(page) = s.pages.get(p as usize) else {
                    return true;
                };
                let passes =
                    page.generation == g && page.owner == Some(rid) && slot < page.watermark;
                !passes || page.slots.get(slot as usize) == Some(&Some(rid))
            })
    })
}

/// Property B. A reservation's writer can still write a page if its path
/// is not revoked and either
/// - the writer is up and holds the grant without having stopped
///   (`Writing`), or will (`NoGrant` with the grant in flight: the grant
///   would start it): every page of the grant; or
/// - a frame of it is in flight that would land if delivered now: that
///   frame's page. One-sided, any frame of an unrevoked path lands;
///   receiver-checked, only a frame D would accept, which needs the page
///   to still be the reservation's, so only the first clause can fire.
///
/// The first clause is the rule of I5 for every transport: an unconfirmed,
/// unrevoked writer must not lose its pages, even where the receiver's
/// check would refuse its frames.
pub(crate) fn no_late_writes(m: &HandshakeModel, s: &State) -> bool {
    s.decode.iter().enumerate().all(|(i, d)| {
        let rid = i as Rid;
        if d.revoked {
            return true;
        }
        let held = |p: u8| {
            s.pages
                .get(p as usize)
                .is_some_and(|pg| !pg.free && pg.owner == Some(rid))
        };
        let writer_up = d
            .writer
            .and_then(|w| s.health.get(w as usize))
            .is_some_and(|h| *h == Health::Up);
        let holds_grant = match s.writer.get(i) {
            Some(WriterSide::Writing { .. }) => true,
            Some(WriterSide::NoGrant) => s.net.contains(&Msg::Grant { rid }),
            _ => false,
        };
        if writer_up && holds_grant && !d.table.iter().all(|&(p, _)| held(p)) {
            return false;
        }
        s.net.iter().all(|f| match *f {
            Msg::Frame { rid: r, page, .. } if r == rid => held(page) || !m.frame_lands(s, f),
            _ => true,
        })
    })
}

/// Property C. Ends at most once; every page is free exactly when it has
/// no owner; every holding reservation's pages carry its owner and the
/// granted generation; every owner holds; free plus held is the capacity.
pub(crate) fn ends_once(_: &HandshakeModel, s: &State) -> bool {
    let once = s.decode.iter().all(|d| d.ends <= 1);
    let consistent = s
        .pages
        .iter()
        .all(|p| p.free == p.owner.is_none() && p.owner.is_none_or(|o| s.holds(o)));
    let mut held = 0;
    let tables_match = s.decode.iter().enumerate().all(|(i, d)| {
        if !s.holds(i as Rid) {
            return true;
        }
        held += d.table.len();
        d.table.iter().all(|&(p, g)| {
            s.pages
                .get(p as usize)
                .is_some_and(|pg| pg.owner == Some(i as Rid) && pg.generation == g)
        })
    });
    once && consistent && tables_match && s.free_pages() + held == s.pages.len()
}

/// Property D's condition: every reservation ended and every page free.
pub(crate) fn all_ended(_: &HandshakeModel, s: &State) -> bool {
    s.decode.iter().all(|d| matches!(d.phase, Phase::Ended(_))) && s.free_pages() == s.pages.len()
}

pub(crate) fn page_reused(_: &HandshakeModel, s: &State) -> bool {
    // Generations: 1 at the first allocation, 2 on release, 3 at reuse.
    s.pages.iter().any(|p| p.generation >= 3)
}

pub(crate) fn all_complete(_: &HandshakeModel, s: &State) -> bool {
    s.decode
        .iter()
        .all(|d| d.phase == Phase::Ended(End::Completed))
}
