//! The engine's side of the prefix cache (`kvmesh_kvpool::cache`): the
//! keyed hashes of this model's pages, the sequences that start from cached
//! pages, and the naming of a sequence's pages when it ends so that the
//! next request with the same prefix finds them.
//!
//! A sequence started in a [`Namespace`] leases the longest cached run of
//! its prompt's full pages, but never the page holding the prompt's last
//! token: its logits are what the first generated token is sampled from,
//! so at least that position is computed. A sequence adopted from a
//! transfer shares its prompt's full pages at once (still leased by it);
//! when a sequence is dropped,
//! every full page it wrote (prompt and generated tokens alike) is offered
//! to the cache under its key; the pool takes the ones it lacks while it
//! has room.

use std::sync::Arc;

use kvmesh_kvpool::{CacheIndex, Namespace, PageKey, Reservation};
use kvmesh_prefix::{CacheKeys, ModelTag};

use super::{Engine, Sequence};
use crate::error::Result;

/// The share of a serving node's pool its prefix cache may hold. Cached
/// pages no sequence leases are evicted on demand, so the bound limits how
/// much of other requests' KV stays in memory, not how many requests fit.
pub const PREFIX_CACHE_SHARE: f64 = 0.5;

/// The keys of one engine's cached pages: the mesh's keyed hashes and the
/// tag of this model and KV layout.
#[derive(Debug)]
pub struct PrefixCache {
    keys: CacheKeys,
    model: ModelTag,
    page_size: usize,
}

impl PrefixCache {
    /// The key of every full page of `tokens`, in `ns`.
    pub fn page_keys(&self, ns: &Namespace, tokens: &[u32]) -> Vec<PageKey> {
        self.keys.page_keys(ns, &self.model, self.page_size, tokens)
    }

    /// The tag this engine's keys are computed with.
    pub fn model_tag(&self) -> ModelTag {
        self.model
    }

    /// Extends `keys` (those of the first pages of `tokens`) to every full
    /// page of `tokens`, hashing only the new pages.
    fn extend(&self, ns: &Namespace, keys: &mut Vec<PageKey>, tokens: &[u32]) {
        let full = tokens.len() / self.page_size;
        while keys.len() < full {
            let i = keys.len();
            let page = &tokens[i * self.page_size..(i + 1) * self.page_size];
            let key = self.keys.page_key(ns, &self.model, keys.last(), page);
            keys.push(key);
        }
    }
}

/// A sequence's place in the cache: its namespace and the keys of its
/// full pages computed so far.
#[derive(Debug)]
pub(super) struct CachedSeq {
    cache: Arc<PrefixCache>,
    ns: Namespace,
    keys: Vec<PageKey>,
}

impl CachedSeq {
    /// Names the written full pages of `tokens[..written]` for the cache;
    /// the reservation offers them to it when it is released.
    pub(super) fn offer(&mut self, kv: &mut Reservation, tokens: &[u32], written: usize) {
        let written = written.min(tokens.len());
        self.cache
            .extend(&self.ns, &mut self.keys, &tokens[..written]);
        kv.cache_as(self.ns, self.keys.clone());
    }
}

impl Engine {
    /// Turns the prefix cache on: up to `share` (between 0 and 1) of the
    /// pool's pages may hold cached pages, found by keys from `keys`. The
    /// model tag is the engine's identity (weights and precision) plus the
    /// KV geometry, so no other model's or layout's pages ever match.
    pub fn with_prefix_cache(mut self, keys: CacheKeys, share: f64) -> Self {
        let cfg = self.pool.config().clone();
        let identity = self.identity.clone();
        let model = ModelTag::new(
            &identity,
            &[
                ("n_layers", cfg.n_layers as u64),
                ("n_kv_heads", cfg.n_kv_heads as u64),
                ("head_dim", cfg.head_dim as u64),
                ("page_size", cfg.page_size as u64),
                ("kv_dtype_bytes", cfg.dtype.size() as u64),
                ("kv_blocks_per_layer", cfg.entry.blocks() as u64),
            ],
        );
        let share = share.clamp(0.0, 1.0);
        let pages = (cfg.n_pages as f64 * share).floor() as usize;
        self.pool.set_cache_pages(pages);
        self.prefix = Some(Arc::new(PrefixCache {
            keys,
            model,
            page_size: cfg.page_size,
        }));
        self
    }

    /// The prefix cache, when on.
    pub fn prefix_cache(&self) -> Option<&Arc<PrefixCache>> {
        self.prefix.as_ref()
    }

    /// What this node tells routers of its cache: the model tag its keys
    /// are computed with and the pool's [`CacheIndex`] (page ids unless
    /// `known` is the current epoch). `None` with the cache off.
    pub fn cache_advert(&self, known: u64) -> Option<(ModelTag, CacheIndex)> {
        let cache = self.prefix.as_ref()?;
        Some((cache.model, self.pool.cache_index(known)))
    }

    /// Keys of the prompt's pages that may come from the cache: every full
    /// page before the one holding the last token (whose logits must be
    /// computed). Empty with the cache off.
    pub fn cacheable_keys(&self, ns: &Namespace, prompt_ids: &[u32]) -> Vec<PageKey> {
        let Some(cache) = &self.prefix else {
            return Vec::new();
        };
        let usable = prompt_ids.len().saturating_sub(1);
        cache.page_keys(ns, &prompt_ids[..usable])
    }

    /// [`Engine::admit`] in namespace `ns`: the prompt's cached head is
    /// leased, not computed ([`Sequence::cached_len`] starts there), and the
    /// sequence's pages are offered to the cache when it ends. With the
    /// cache off, this is `admit`.
    pub fn admit_in(
        &self,
        ns: Namespace,
        prompt_ids: Vec<u32>,
        max_new_tokens: usize,
    ) -> Result<Sequence> {
        let Some(cache) = &self.prefix else {
            return self.admit(prompt_ids, max_new_tokens);
        };
        let total = self.check_admission(&prompt_ids, max_new_tokens)?;
        let keys = self.cacheable_keys(&ns, &prompt_ids);
        let kv = self.pool.reserve_cached(&ns, &keys, total)?;
        let cached = kv.cached_tokens();
        let mut keys = keys;
        keys.truncate(cached / cache.page_size);
        let mut seq = Sequence::new(kv, prompt_ids, total, cached);
        seq.prefix = Some(CachedSeq {
            cache: Arc::clone(cache),
            ns,
            keys,
        });
        Ok(seq)
    }

    /// [`Engine::adopt`] in namespace `ns`: the prompt's full pages are
    /// shared at once ([`Reservation::share`]), so a request for the same
    /// prompt in `ns` leases them while this one still runs (the samples
    /// of one prompt fork from the pages the first one received, and only
    /// the last partial page travels again); the rest of its pages are
    /// offered to the cache when it ends.
    pub fn adopt_in(
        &self,
        ns: Namespace,
        prompt_ids: Vec<u32>,
        max_new_tokens: usize,
        kv: Reservation,
    ) -> Result<Sequence> {
        let mut seq = self.adopt(prompt_ids, max_new_tokens, kv)?;
        if let Some(cache) = &self.prefix {
            let keys = cache.page_keys(&ns, &seq.tokens[..seq.prompt_len]);
            seq.kv.cache_as(ns, keys.clone());
            seq.kv.share();
            seq.prefix = Some(CachedSeq {
                cache: Arc::clone(cache),
                ns,
                keys,
            });
        }
        Ok(seq)
    }
}
