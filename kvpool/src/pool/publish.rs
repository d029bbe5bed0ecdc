//! How a reservation's pages become prefix-cache entries: `finish` (a
//! reservation's end with the cache in play), `enter_cache`, and `share`
//! (a decode node's adopted prompt, published while it runs). Every page
//! still leaves through the one release path, [`Shared::release`].

use super::*;

impl Shared {
    /// A reservation's end with the cache in play: its full, written pages
    /// whose keys the cache lacks enter the cache (while it has room, and
    /// only as a run from the first page, since a page after a gap could
    /// never be found), its leases end, and every page it still owns goes
    /// through [`Self::release`]. `keys[i]` is logical page `i`'s key;
    /// `table` holds the leased pages first.
    pub(crate) fn finish(
        &self,
        owner: OwnerTag,
        table: &mut Vec<PageRef>,
        leases: &[Lease],
        cache_as: Option<(Namespace, Vec<PageKey>)>,
    ) {
        {
            let mut st = self.lock();
            let mut victims = Vec::new();
            if let Some((ns, keys)) = cache_as.filter(|_| st.cache.enabled()) {
                let mut chain = leases.len();
                for (i, key) in keys.iter().enumerate().skip(leases.len()) {
                    let Some(entry) = table.get(i).copied() else {
                        break;
                    };
                    if !self.holds_full(owner, entry) {
                        break;
                    }
                    if st.cache.contains(key) {
                        // Another sequence cached these tokens first: this
                        // copy is released; the run goes on through it.
                        chain = i + 1;
                        continue;
                    }
                    if self
                        .enter_cache(&mut st, &mut victims, owner, entry, *key, ns, i, 0)
                        .is_none()
                    {
                        break;
                    }
                    chain = i + 1;
                }
                st.cache.unlease(leases);
                st.cache.touch_chain(&keys[..chain]);
            } else {
                st.cache.unlease(leases);
            }
            // A bound lowered while these leases held entries above it.
            victims.extend(st.cache.trim());
            drop(st);
            self.free_evicted(victims);
        }
        // Pages that entered the cache have a new owner: release skips them.
        self.release(owner, table);
        table.clear();
    }

    /// Moves `entry` (logical page `depth` of `owner`'s table, full and
    /// owned by `owner`) into the cache under `key` with `leases` leases:
    /// a new owner tag, generation +2. Makes room by evicting an unleased
    /// entry (into `victims`) when the cache is at its bound. `None` (the
    /// page left as it was) when there is no room, tags are exhausted or
    /// the page is not `owner`'s. Returns the entry's tag and generation.
    #[allow(clippy::too_many_arguments)]
    fn enter_cache(
        &self,
        st: &mut FreeState,
        victims: &mut Vec<Entry>,
        owner: OwnerTag,
        entry: PageRef,
        key: PageKey,
        ns: Namespace,
        depth: usize,
        leases: u32,
    ) -> Option<(u64, u64)> {
        if !st.cache.has_room() {
            victims.push(st.cache.evict_one()?);
        }
        let tag = st.mint().ok()?;
        let p = entry.page as usize;
        // Only the holding reservation could touch the page, and it is
        // either being dropped or borrowed mutably by this call's caller.
        self.owner[p]
            .compare_exchange(owner.get(), tag.get(), Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let generation = self.generation[p]
            .fetch_add(2, Ordering::AcqRel)
            .wrapping_add(2);
        self.tell(PageEvent::Retagged {
            page: entry.page,
            generation,
        });
        let stamp = st.cache.now();
        st.cache.insert(
            key,
            Entry {
                ns,
                page: entry.page,
                tag: tag.get(),
                generation,
                leases,
                stamp,
                depth: u32::try_from(depth).unwrap_or(u32::MAX),
            },
        );
        Some((tag.get(), generation))
    }

    /// A live reservation shares its full pages now instead of when it
    /// ends: each full page of `table` after its `leases`, in order, whose
    /// key (`keys[i]` for logical page `i`) the cache lacks, becomes a
    /// cache entry that this reservation leases, so other reservations in
    /// `ns` can lease it while this one still runs. The run stops at the
    /// first page that is not full, already cached (the chain must stay
    /// one run of leases from the first page), or finds no room. `table`'s
    /// entries get the new generations; returns the leases added.
    pub(crate) fn share(
        &self,
        owner: OwnerTag,
        table: &mut [PageRef],
        leases: usize,
        ns: Namespace,
        keys: &[PageKey],
    ) -> Vec<Lease> {
        let mut added = Vec::new();
        let mut victims = Vec::new();
        {
            let mut st = self.lock();
            if !st.cache.enabled() {
                return added;
            }
            for (i, key) in keys.iter().enumerate().skip(leases) {
                let Some(entry) = table.get(i).copied() else {
                    break;
                };
                if !self.holds_full(owner, entry) || st.cache.contains(key) {
                    break;
                }
                // The planted bug counts no lease here either, as in
                // `CacheState::lease_prefix`.
                let counted = u32::from(!planted(PlantedBug::CacheNoLeaseCheck));
                let Some((tag, generation)) =
                    self.enter_cache(&mut st, &mut victims, owner, entry, *key, ns, i, counted)
                else {
                    break;
                };
                table[i].generation = generation;
                added.push(Lease {
                    key: *key,
                    page: entry.page,
                    tag,
                });
            }
        }
        self.free_evicted(victims);
        added
    }
}
