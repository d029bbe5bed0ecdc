//! Landing a remote transfer in a reservation's pages, and verifying it
//! before anything may read it (I4).
//!
//! A transfer writes the prompt's slots of the granted pages **without**
//! raising their watermarks: until the decode node has verified the whole
//! transfer, the slots count as unwritten and every read of them fails
//! (I2). Verification then compares the generation and owner of every
//! granted page and the checksum of every page as it landed; only if all
//! match does [`Reservation::publish_prompt`] set the watermarks, which is
//! what makes the prompt readable.
//!
//! The one caller is the decode side's reservation table
//! (`kvmesh_kvxfer::handshake`), which holds each reservation under its
//! entry lock while a frame lands and revokes the writer's path before it
//! verifies. [`Reservation::publish_prompt`] is I4's last step: nothing
//! else in kvmesh may call it (it is public because the pool and the
//! handshake are separate crates; `ARCHITECTURE.md` lists it as the I4
//! enforcement point, and a call anywhere else is a review finding).

use std::ops::Range;
use std::sync::atomic::Ordering;

use kvmesh_kernels::{KvValues, PageRef};

use crate::error::PoolError;
use crate::reservation::Reservation;

/// A granted page that no longer has the generation or owner it was
/// granted with: the reservation no longer holds what it was granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotHeld {
    /// Logical index in the grant.
    pub index: usize,
    /// The grant's entry.
    pub granted: PageRef,
    /// The page's generation now.
    pub generation: u64,
}

impl Reservation {
    /// Lands `values` (per layer of `layers`: K of `slots`, then V unless the
    /// pool's entries are latent, as a
    /// `KvFrame`'s payload decodes to) in logical page `index`. Watermarks
    /// are not touched. All checks come first: on error nothing was
    /// written.
    ///
    /// Cost: one copy into the page (a conversion if `values` is not of the
    /// pool's dtype).
    pub fn land(
        &mut self,
        index: usize,
        layers: Range<usize>,
        slots: Range<usize>,
        values: KvValues<'_>,
    ) -> Result<(), PoolError> {
        let cfg = self.shared().cfg();
        let (page_size, n_layers) = (cfg.page_size, cfg.n_layers);
        let kv_dim = cfg.geometry().kv_dim();
        let blocks = cfg.entry.blocks();
        let Some(entry) = self.held().get(index).copied() else {
            return Err(PoolError::PositionOutOfRange {
                position: index.saturating_mul(page_size),
                capacity: self.capacity_tokens(),
            });
        };
        if layers.start >= layers.end || layers.end > n_layers {
            return Err(PoolError::LayerOutOfRange {
                layer: layers.end.max(layers.start),
                n_layers,
            });
        }
        if slots.start >= slots.end || slots.end > page_size {
            return Err(PoolError::PositionOutOfRange {
                position: index * page_size + slots.end.max(slots.start),
                capacity: self.capacity_tokens(),
            });
        }
        let block = slots.len() * kv_dim;
        let expected = layers.len() * blocks * block;
        if values.len() != expected {
            return Err(PoolError::BadLength {
                field: "payload",
                expected,
                got: values.len(),
            });
        }
        let bad = || PoolError::BadLength {
            field: "payload",
            expected,
            got: values.len(),
        };
        let page = entry.page as usize;
        for (i, layer) in layers.enumerate() {
            let base = i * blocks * block;
            if values.len() < base + blocks * block {
                // Unreachable: the length was checked above. Nothing of
                // this layer was written; earlier layers are unverified
                // data, which verification will refuse.
                return Err(bad());
            }
            let (k, v) = (
                values.slice(base..base + block),
                values.slice(base + block..base + blocks * block),
            );
            // SAFETY: the page is on this reservation's table (in range,
            // owned by it); `&mut self` rules out its readers, and no other
            // reservation can reach it (crate::pool). `layer < n_layers` and
            // `slots.end <= page_size` were checked above.
            unsafe {
                self.shared()
                    .storage()
                    .write(page, layer, slots.start, k, v)
            };
        }
        Ok(())
    }

    /// Logical page `index` as it is stored now, over its first `slots`
    /// slots: `visit(k, v)` once per layer, in layer order (what a page
    /// checksum hashes: `kvmesh_kvwire::page_checksum`). `None` if `index`
    /// is past the table or `slots` past the page.
    ///
    /// The caller must make sure no write to the page runs meanwhile: it
    /// holds `&self` (no frame lands through `&mut`), and has revoked the
    /// writer's one-sided path (shared memory).
    pub fn visit_landed(
        &self,
        index: usize,
        slots: usize,
        mut visit: impl FnMut(KvValues<'_>, KvValues<'_>),
    ) -> Option<()> {
        let cfg = self.shared().cfg();
        let entry = self.held().get(index)?;
        if slots > cfg.page_size {
            return None;
        }
        for layer in 0..cfg.n_layers {
            // SAFETY: the page is on this reservation's table; `layer` and
            // `slots` are in range; no write runs during the call (caller's
            // contract above) and the slices die within this iteration.
            let s = unsafe {
                self.shared()
                    .storage()
                    .read(entry.page as usize, layer, slots)
            };
            visit(s.k, s.v);
        }
        Some(())
    }

    /// Whether every page of `granted` is still on this reservation's table
    /// at the granted generation and owned by it.
    pub fn check_held(&self, granted: &[PageRef]) -> Result<(), NotHeld> {
        let shared = self.shared();
        let owner = self.owner().get();
        for (index, g) in granted.iter().enumerate() {
            let p = g.page as usize;
            let generation = shared.generation(p).unwrap_or(u64::MAX);
            let on_table = self.held().get(index) == Some(g);
            if !on_table || generation != g.generation || shared.owner(p) != Some(owner) {
                return Err(NotHeld {
                    index,
                    granted: *g,
                    generation,
                });
            }
        }
        Ok(())
    }

    /// Makes the first `prompt_tokens` positions readable: sets the
    /// watermark of every layer of the owned pages they cover to the
    /// prompt's slots in that page (a cached head is readable already).
    /// Only after verification (I4).
    ///
    /// `landed` (receiver-checked transports, which see every frame land):
    /// per (owned page index, layer), the slots that landed from slot 0; no
    /// watermark goes past it, so even a transfer that verification wrongly
    /// passed leaves its unwritten slots unreadable (I2). One-sided
    /// transports cannot know what landed and pass `None`.
    pub fn publish_prompt(&mut self, prompt_tokens: usize, landed: Option<&[u32]>) {
        let shared = self.shared();
        let page_size = shared.cfg().page_size;
        let n_layers = shared.cfg().n_layers;
        let cached = self.cached_tokens();
        for (i, e) in self.held().iter().enumerate() {
            let before = cached + i * page_size;
            if before >= prompt_tokens {
                break;
            }
            let claimed = (prompt_tokens - before).min(page_size);
            for layer in 0..n_layers {
                let slots = match landed {
                    Some(l) => claimed.min(l.get(i * n_layers + layer).map_or(0, |&s| s as usize)),
                    None => claimed,
                };
                if let Some(w) = shared.watermark(e.page as usize, layer) {
                    w.store(slots, Ordering::Release);
                }
            }
        }
    }

    /// Injected fault (`verify=corrupt`): changes the first value of
    /// logical page `index` (layer 0, slot 0, K) as if the transfer had
    /// damaged it, so verification must refuse the page. Inert outside
    /// testing builds.
    pub fn corrupt_landed_value(&mut self, index: usize) {
        if !kvmesh_faults::enabled() {
            return;
        }
        let Some(entry) = self.held().get(index).copied() else {
            return;
        };
        // SAFETY: the page is on this reservation's table; `&mut self`
        // rules out readers; the write path was revoked by the caller.
        let first = unsafe { self.shared().storage().read(entry.page as usize, 0, 1) };
        let (mut k, mut v) = (Vec::new(), Vec::new());
        first.k.extend_f32(&mut k);
        first.v.extend_f32(&mut v);
        if let Some(x) = k.first_mut() {
            // Both are exact in every dtype.
            *x = if *x == 1.0 { 2.0 } else { 1.0 };
        }
        // SAFETY: as above; slot 0 of layer 0 is in range.
        unsafe {
            self.shared().storage().write(
                entry.page as usize,
                0,
                0,
                KvValues::F32(&k),
                KvValues::F32(&v),
            )
        };
    }
}
