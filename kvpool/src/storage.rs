//! The pool's KV memory: one allocation, addressed by (page, layer, slot).
//!
//! Layout, page-major so a whole page is one contiguous range (a transfer
//! ships a page as one buffer) and each (page, layer) K and V block is
//! contiguous (attention reads a block as one slice):
//!
//! ```text
//! page 0: layer 0: K [page_size][n_kv_heads][head_dim]
//!                  V [page_size][n_kv_heads][head_dim]
//!         layer 1: K ..., V ...
//!         ...
//! page 1: ...
//! ```
//!
//! This is the only module that touches pool memory through raw pointers.
//! Its methods are `unsafe` with one contract: the caller has exclusive
//! access to the page it writes or fills, and nobody writes a page while a
//! slice read from it is alive. The pool upholds it (see [`crate::pool`]):
//! a page is written only through the `&mut Reservation` that owns it,
//! filled only while it is on nobody's table and off the free list, and
//! read only by a checked reader borrowed from the reservation that owns it.
//!
//! The memory comes from this process, in huge pages where the OS gives
//! them ([`Storage::try_new`], `kvmesh_kernels::huge`), or
//! from the caller ([`Storage::try_new_in`], a [`PoolMemory`]: in kvmesh, a
//! shared-memory mapping that a writer process on the same host writes
//! one-sided, made by `kvmesh_kvxfer::shm`; later a registered RDMA region
//! or device staging). Only those two know where the memory
//! comes from. With memory that another process writes, the contract above
//! also binds that process: it writes a page only through a path the
//! transport opened for a grant of that page (a shared-memory lane), and
//! the pool reads or fills such a page only after that path was closed and
//! drained (the transport's revoke, `kvmesh_kvxfer::transport::Landing`).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use kvmesh_kernels::huge::HugeMem;
use kvmesh_kernels::{f16_to_f32_slice, f32_to_f16_slice, KvDtype, KvValues, PageSlices};

use crate::error::PoolError;

/// The pool's shape as the storage sees it. All offsets fit in `usize`
/// because [`crate::PoolConfig::validate`] bounds the total byte size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StorageShape {
    pub n_pages: usize,
    pub n_layers: usize,
    pub page_size: usize,
    pub kv_dim: usize,
    /// Blocks per (page, layer): 2 (K, then V) or 1 (a latent entry).
    pub blocks: usize,
    pub dtype: KvDtype,
}

impl StorageShape {
    /// Values in one K (or V) block of one (page, layer).
    fn block(&self) -> usize {
        self.page_size * self.kv_dim
    }

    /// Values in one page, all layers, K and V.
    pub fn page_values(&self) -> usize {
        self.n_layers * self.blocks * self.block()
    }

    /// Offset, in values, of (`page`, `layer`)'s K block.
    fn k_offset(&self, page: usize, layer: usize) -> usize {
        page * self.page_values() + layer * self.blocks * self.block()
    }

    /// Whether a V block follows each K block.
    fn stores_v(&self) -> bool {
        self.blocks == 2
    }
}

/// What a page is filled with while nobody owns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fill {
    /// Zeros (scrubbing).
    Zero,
    /// The debug canary of the pool's dtype ([`crate::POISON_BITS`] or
    /// [`crate::POISON_BITS_F16`]).
    Canary,
}

/// Memory a pool can live in that the caller provides instead of its
/// own: a shared-memory mapping that writer processes write
/// one-sided (`kvmesh_kvxfer::shm::ShmRegion`), and later a registered
/// RDMA region. The pool keeps the value alive as long as its storage.
///
/// # Safety
/// An implementation promises that, for as long as the value lives,
/// `data_ptr()` is the start of `len_bytes()` bytes of readable and
/// writable memory, 4-byte aligned, zero-filled when the value was made,
/// never moved or unmapped, and that this process makes no Rust references
/// into it except through the pool. Writes by other processes or devices
/// are the transport's to fence (see the module doc).
pub unsafe trait PoolMemory: Send + Sync + fmt::Debug {
    /// Start of the memory.
    fn data_ptr(&self) -> NonNull<u8>;
    /// Its size in bytes.
    fn len_bytes(&self) -> usize;
}

/// Where the memory lives.
enum Memory {
    /// Zeroed huge-page memory of this process (`kvmesh_kernels::huge`):
    /// a step's attention reads a K and a V block a page apart in every
    /// layer, a TLB miss each in 4 KiB pages.
    Huge(HugeMem),
    /// Provided by the caller; kept alive by this reference.
    External(Arc<dyn PoolMemory>),
}

/// Raw KV memory with the layout above, values of `shape.dtype`.
pub(crate) struct Storage {
    base: NonNull<u8>,
    memory: Memory,
    shape: StorageShape,
}

// SAFETY: `Storage` owns its allocation (no thread affinity), so it can move
// between threads. Sharing it is sound because every access goes through the
// `unsafe` methods below, whose contract rules out a write to a page
// concurrent with any other access to that page; disjoint pages are disjoint
// memory ranges.
unsafe impl Send for Storage {}
// SAFETY: see `Send` above.
unsafe impl Sync for Storage {}

impl Storage {
    /// Allocates zeroed memory for `shape`, then fills it with `fill` unless
    /// that is zeros (so a large unpoisoned pool costs no up-front pass: the
    /// OS hands out zero pages lazily). An allocation failure is an error,
    /// not an abort.
    pub fn try_new(shape: StorageShape, fill: Fill) -> Result<Self, PoolError> {
        let values = shape.n_pages * shape.page_values();
        let bytes = values.saturating_mul(shape.dtype.size());
        if bytes == 0 {
            // `validate` rejects every zero dimension.
            return Err(PoolError::OutOfMemory { bytes });
        }
        // Zeroed by the OS lazily, page by page as first touched, and
        // aligned to 2 MiB (so for f32 whatever the dtype).
        let mem = HugeMem::zeroed(bytes).ok_or(PoolError::OutOfMemory { bytes })?;
        let storage = Self {
            base: mem.as_non_null(),
            memory: Memory::Huge(mem),
            shape,
        };
        storage.fill_all(fill);
        Ok(storage)
    }

    /// Storage in `memory`, which must hold at least this shape's bytes
    /// (it is zero-filled when made), then filled with `fill` unless that
    /// is zeros.
    pub fn try_new_in(
        shape: StorageShape,
        fill: Fill,
        memory: Arc<dyn PoolMemory>,
    ) -> Result<Self, PoolError> {
        let bytes = (shape.n_pages * shape.page_values()).saturating_mul(shape.dtype.size());
        let base = memory.data_ptr();
        if memory.len_bytes() < bytes
            || base.as_ptr().align_offset(std::mem::align_of::<f32>()) != 0
        {
            return Err(PoolError::InvalidConfig {
                field: "pool memory",
                value: memory.len_bytes(),
                reason: "smaller than the pool, or not aligned for f32",
            });
        }
        let storage = Self {
            base,
            memory: Memory::External(memory),
            shape,
        };
        storage.fill_all(fill);
        Ok(storage)
    }

    fn fill_all(&self, fill: Fill) {
        if fill != Fill::Zero {
            for page in 0..self.shape.n_pages {
                // SAFETY: `page` is in range and the storage is not shared
                // yet (new external memory has no open write path).
                unsafe { self.fill_page(page, fill) };
            }
        }
    }

    /// The first `n_slots` slots of K and V of (`page`, `layer`); V empty
    /// for a latent pool.
    ///
    /// # Safety
    /// `page < n_pages`, `layer < n_layers`, `n_slots <= page_size`, and no
    /// write to this page happens while the returned slices are alive.
    pub unsafe fn read(&self, page: usize, layer: usize, n_slots: usize) -> PageSlices<'_> {
        let s = &self.shape;
        debug_assert!(page < s.n_pages && layer < s.n_layers && n_slots <= s.page_size);
        let k = s.k_offset(page, layer);
        let n = n_slots * s.kv_dim;
        // SAFETY: both ranges lie inside the allocation (caller's bounds) and
        // are not written while borrowed (caller's contract).
        unsafe {
            PageSlices {
                k: self.values(k, n),
                v: self.values(k + s.block(), if s.stores_v() { n } else { 0 }),
            }
        }
    }

    /// `n` values from value offset `at`.
    ///
    /// # Safety
    /// In range, and not written while the view is alive.
    unsafe fn values(&self, at: usize, n: usize) -> KvValues<'_> {
        let base = self.base.as_ptr();
        // SAFETY: by the caller; the base is f32-aligned, so any value
        // offset is aligned for its type.
        unsafe {
            match self.shape.dtype {
                KvDtype::F32 => {
                    KvValues::F32(std::slice::from_raw_parts(base.cast::<f32>().add(at), n))
                }
                KvDtype::F16 => KvValues::F16(std::slice::from_raw_parts(
                    base.cast::<half::f16>().add(at),
                    n,
                )),
            }
        }
    }

    /// Stores `k` and `v` (whole slots, equal lengths; `v` empty for a
    /// latent pool) into (`page`, `layer`) from `slot` on, converted to the pool's dtype (f16: rounded
    /// to nearest even, saturated; exact for values an f16 pool produced).
    ///
    /// # Safety
    /// `page < n_pages`, `layer < n_layers`, `v.len()` equal to `k.len()`
    /// (0 for a latent pool),
    /// `slot * kv_dim + k.len() <= page_size * kv_dim`, and the caller has
    /// exclusive access to the page: no other read or write of it runs
    /// during the call.
    pub unsafe fn write(
        &self,
        page: usize,
        layer: usize,
        slot: usize,
        k: KvValues<'_>,
        v: KvValues<'_>,
    ) {
        let s = &self.shape;
        let v_len = if s.stores_v() { k.len() } else { 0 };
        debug_assert!(page < s.n_pages && layer < s.n_layers && v.len() == v_len);
        debug_assert!(slot * s.kv_dim + k.len() <= s.block());
        let dst = s.k_offset(page, layer) + slot * s.kv_dim;
        // SAFETY: both destination ranges lie inside the allocation and the
        // page is exclusively ours (caller's contract); sources are
        // caller-owned slices, so they cannot overlap pool memory mutably.
        unsafe {
            self.store(dst, k);
            if s.stores_v() {
                self.store(dst + s.block(), v);
            }
        }
    }

    /// `src` converted into the values from offset `at`.
    ///
    /// # Safety
    /// In range and exclusively the caller's.
    unsafe fn store(&self, at: usize, src: KvValues<'_>) {
        let base = self.base.as_ptr();
        let n = src.len();
        // SAFETY: by the caller; aligned as in `values`.
        unsafe {
            match (self.shape.dtype, src) {
                (KvDtype::F32, KvValues::F32(x)) => {
                    std::ptr::copy_nonoverlapping(x.as_ptr(), base.cast::<f32>().add(at), n)
                }
                (KvDtype::F16, KvValues::F16(x)) => {
                    std::ptr::copy_nonoverlapping(x.as_ptr(), base.cast::<half::f16>().add(at), n)
                }
                (KvDtype::F16, KvValues::F32(x)) => f32_to_f16_slice(
                    x,
                    std::slice::from_raw_parts_mut(base.cast::<half::f16>().add(at), n),
                ),
                (KvDtype::F32, KvValues::F16(x)) => f16_to_f32_slice(
                    x,
                    std::slice::from_raw_parts_mut(base.cast::<f32>().add(at), n),
                ),
            }
        }
    }

    /// Sets every value of `page` (all layers, K and V) to `fill`.
    ///
    /// # Safety
    /// `page < n_pages` and the caller has exclusive access to the page.
    pub unsafe fn fill_page(&self, page: usize, fill: Fill) {
        let s = &self.shape;
        debug_assert!(page < s.n_pages);
        let (at, n) = (page * s.page_values(), s.page_values());
        let base = self.base.as_ptr();
        // SAFETY: the page's range lies inside the allocation and is
        // exclusively ours (caller's contract).
        unsafe {
            match s.dtype {
                KvDtype::F32 => {
                    std::slice::from_raw_parts_mut(base.cast::<f32>().add(at), n).fill(match fill {
                        Fill::Zero => 0.0,
                        Fill::Canary => f32::from_bits(crate::POISON_BITS),
                    })
                }
                KvDtype::F16 => std::slice::from_raw_parts_mut(base.cast::<half::f16>().add(at), n)
                    .fill(match fill {
                        Fill::Zero => half::f16::ZERO,
                        Fill::Canary => half::f16::from_bits(crate::POISON_BITS_F16),
                    }),
            }
        }
    }

    /// A whole page (all layers, K then V per layer) as stored, for tests
    /// that inspect what scrubbing and poisoning left behind.
    ///
    /// # Safety
    /// `page < n_pages` and no write to the page runs while the view lives.
    #[cfg(test)]
    pub unsafe fn page(&self, page: usize) -> KvValues<'_> {
        let s = &self.shape;
        // SAFETY: in range and not written concurrently (caller's contract).
        unsafe { self.values(page * s.page_values(), s.page_values()) }
    }
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Storage")
            .field("shape", &self.shape)
            .field(
                "memory",
                &match &self.memory {
                    Memory::Huge(m) => format!("huge pages, {} bytes", m.len()),
                    Memory::External(m) => format!("{m:?}"),
                },
            )
            .finish()
    }
}
