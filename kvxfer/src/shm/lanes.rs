//! The lanes: each grant's write gate in the mapping (the protocol and
//! its proof are in the module doc of [`super`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::{LaneClose, ShmError, ShmRegion, WriteKey, HEADER_LEN, LANE_STRIDE};

/// One lane's two atomics, borrowed from the mapping.
pub(super) struct Lane<'a> {
    pub(super) epoch: &'a AtomicU32,
    /// Reset generation (high 32 bits) and writers inside (low 32).
    pub(super) active: &'a AtomicU64,
}

/// Writers inside, from a lane's `active` word.
pub(super) fn inside(word: u64) -> u32 {
    // Truncation is the point: the low 32 bits.
    word as u32
}

/// The reset generation, from a lane's `active` word.
fn reset_generation(word: u64) -> u32 {
    (word >> 32) as u32
}

impl<'a> Lane<'a> {
    /// W1: enters the lane. Leaving is the guard's `Drop`, so every return
    /// path of a write leaves (W3 of the protocol).
    pub(super) fn enter(&self) -> Entered<'a> {
        let word = self.active.fetch_add(1, Ordering::SeqCst);
        Entered {
            active: self.active,
            generation: reset_generation(word),
        }
    }

    /// W2, after entering: the lane is open at the key's epoch. An even
    /// key epoch never admits: it would match a closed lane.
    pub(super) fn admit(&self, key: WriteKey) -> Result<(), ShmError> {
        let lane_epoch = self.epoch.load(Ordering::SeqCst);
        if lane_epoch != key.epoch || key.epoch.is_multiple_of(2) {
            return Err(ShmError::LaneClosed {
                lane: key.lane,
                key_epoch: key.epoch,
                lane_epoch,
            });
        }
        Ok(())
    }
}

/// A writer inside a lane, entered at reset generation `generation`.
pub(super) struct Entered<'a> {
    active: &'a AtomicU64,
    generation: u32,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        // A CAS instead of `fetch_sub`: after a reset (the generation
        // moved) this writer's entry is already gone from the count.
        let mut word = self.active.load(Ordering::Relaxed);
        while reset_generation(word) == self.generation && inside(word) > 0 {
            match self.active.compare_exchange_weak(
                word,
                word - 1,
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => word = now,
            }
        }
    }
}

impl ShmRegion {
    pub(super) fn lane(&self, lane: u32) -> Result<Lane<'_>, ShmError> {
        if u64::from(lane) >= self.layout.n_lanes {
            return Err(ShmError::LaneOutOfRange {
                lane,
                n_lanes: self.layout.n_lanes,
            });
        }
        // In bounds: HEADER_LEN + n_lanes * 64 <= data_offset <= total_len.
        let at = self
            .map
            .as_mut_ptr()
            .wrapping_add(HEADER_LEN + lane as usize * LANE_STRIDE);
        // SAFETY: `at` and `at + 8..16` are inside the mapping (above),
        // which lives as long as `&self`; they are 4- and 8-aligned because
        // the mapping is 64-aligned (checked in `map`) and the offsets are
        // multiples of 8. These bytes are only ever accessed as this
        // `AtomicU32` and this `AtomicU64`, here and in every process
        // running this code (the header is written through the file before
        // mapping, the lanes start as the zeros of ftruncate; the version
        // check keeps out processes with another lane layout), so there is
        // no non-atomic or mixed-size access to them.
        unsafe {
            Ok(Lane {
                epoch: AtomicU32::from_ptr(at.cast::<u32>()),
                active: AtomicU64::from_ptr(at.wrapping_add(8).cast::<u64>()),
            })
        }
    }

    /// Opens `lane` for a new grant of `pages` and returns its key: the
    /// key's writes land only in those pages. The lane must be closed with
    /// no writer inside, else `LaneBusy`; a page past the pool is
    /// `OutOfBounds`. The pages must be free of any other writable grant
    /// (the pool hands a page out again only after its grant's revocation
    /// completed), since they become this key's.
    pub fn lane_open(&self, lane: u32, pages: &[u32]) -> Result<WriteKey, ShmError> {
        let l = self.lane(lane)?;
        let owners = pages
            .iter()
            .map(|&p| self.owner(p))
            .collect::<Result<Vec<_>, _>>()?;
        let epoch = l.epoch.load(Ordering::SeqCst);
        let busy = || ShmError::LaneBusy {
            lane,
            active: inside(l.active.load(Ordering::SeqCst)),
        };
        if epoch % 2 == 1 {
            return Err(busy());
        }
        // After the load of the closed epoch, as D2 of a close: a 0 here
        // means every write admitted under earlier epochs has landed.
        if inside(l.active.load(Ordering::SeqCst)) != 0 {
            return Err(busy());
        }
        // Even + 1 is odd, also across the wrap (2^32 is even).
        let key = WriteKey {
            lane,
            epoch: epoch.wrapping_add(1),
        };
        // Before the CAS that opens: a writer admitted at W2 read that CAS,
        // so it sees these. If the CAS fails they name a key never issued,
        // which no write carries.
        for o in owners {
            o.store(key.to_u64(), Ordering::Relaxed);
        }
        l.epoch
            .compare_exchange(epoch, key.epoch, Ordering::SeqCst, Ordering::SeqCst)
            .map_err(|_| busy())?;
        Ok(key)
    }

    /// Closes the key's lane if it is still open at the key's epoch, then
    /// reports whether writes are still inside. Idempotent: call again while
    /// `Busy`. Once `Drained` is returned no write with this key can land
    /// (proof in the module doc); a lane that has since moved on (reopened
    /// for a later grant) reports `Drained` for an old key, because reopening
    /// required the same drain. A key that was never issued (even epoch, or
    /// one the lane has not reached) is `LaneClosed`.
    pub fn lane_close(&self, key: WriteKey) -> Result<LaneClose, ShmError> {
        let l = self.lane(key.lane)?;
        let closed = key.epoch.wrapping_add(1);
        let bogus = |lane_epoch| ShmError::LaneClosed {
            lane: key.lane,
            key_epoch: key.epoch,
            lane_epoch,
        };
        if key.epoch.is_multiple_of(2) {
            return Err(bogus(l.epoch.load(Ordering::SeqCst)));
        }
        // D1.
        match l
            .epoch
            .compare_exchange(key.epoch, closed, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {}
            Err(cur) if cur == closed => {}
            Err(cur) => {
                let ahead = cur.wrapping_sub(key.epoch);
                return if (2..1 << 31).contains(&ahead) {
                    Ok(LaneClose::Drained)
                } else {
                    Err(bogus(cur))
                };
            }
        }
        // D2.
        match inside(l.active.load(Ordering::SeqCst)) {
            0 => Ok(LaneClose::Drained),
            active => Ok(LaneClose::Busy { active }),
        }
    }

    /// Sets the lane's writer count to 0 so it can be reopened, after the
    /// process that holds the lane's key is known dead (see
    /// [`super::PeerProcess`]): its admitted writes can no longer land, but its
    /// count was never given back. The lane must be closed (else
    /// `LaneBusy`). Writers of other processes inside at that moment (stale
    /// keys, on their way to a refusal) leave without touching the new
    /// count (the reset generation moves; module doc), so the lane is
    /// never left wedged.
    pub fn lane_force_reset(&self, lane: u32) -> Result<(), ShmError> {
        let l = self.lane(lane)?;
        if l.epoch.load(Ordering::SeqCst) % 2 == 1 {
            return Err(ShmError::LaneBusy {
                lane,
                active: inside(l.active.load(Ordering::SeqCst)),
            });
        }
        let mut word = l.active.load(Ordering::SeqCst);
        loop {
            let next = u64::from(reset_generation(word).wrapping_add(1)) << 32;
            match l
                .active
                .compare_exchange_weak(word, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
    }

    /// `testing` only: enters the key's lane and never leaves, as a writer
    /// frozen (or killed) in the middle of a one-sided write would. The
    /// lane then stays `Busy` until its process is known dead.
    #[cfg(feature = "testing")]
    pub fn freeze_inside_lane(&self, key: WriteKey) -> Result<(), ShmError> {
        let l = self.lane(key.lane)?;
        let inside = l.enter();
        l.admit(key)?;
        std::mem::forget(inside);
        Ok(())
    }
}
