//! The decode pool in a shared-memory file mapping, written one-sided by a
//! prefill process on the same host, and the lanes that gate those writes.
//!
//! # Why lanes
//! A writer on the same host maps the pool and stores into it directly, the
//! way an RDMA write lands: the decode node cannot look at a write before it
//! lands. I5 ("no late writes") therefore needs a way to *revoke* a write
//! path and to know when the revocation has taken hold. A **lane** is that
//! gate, one per grant: a writer may store only while its lane is open at
//! its key's epoch, and the decode node revokes by closing the lane and
//! waiting until no write is inside. That is the shared-memory analogue of
//! invalidating an RDMA memory window, or moving a queue pair to error and
//! flushing it.
//!
//! # File layout (little-endian; native atomics)
//! - Header at offset 0, [`HEADER_LEN`] bytes reserved: magic `KVMSHM01`,
//!   version `u32` = 1, `page_size`, `n_layers`, `n_kv_heads`, `head_dim`,
//!   `dtype` (`u32` each; dtype 1 = f32, 2 = f16), `n_pages`, `n_lanes`,
//!   `lanes_offset`, `data_offset`, `total_len` (`u64` each). [`ShmRegion::open`]
//!   recomputes every derived field from the layout with checked arithmetic
//!   and refuses any difference, and `total_len` must equal the file length.
//!   At +128 of the reserved header bytes, `refused_outside_grant:
//!   AtomicU64`: writes refused for naming a page outside their grant.
//! - Lanes at `lanes_offset` = 4096: `n_lanes` entries of 64 bytes (one
//!   cache line each, so lanes do not false-share): `epoch: AtomicU32` at +0,
//!   `active: AtomicU64` at +8 (high 32 bits: the lane's reset generation;
//!   low 32: writers inside), the rest padding.
//! - Page owners at the end of the lanes: `n_pages` entries of `AtomicU64`,
//!   the key ([`WriteKey::to_u64`]) of the grant whose writer may write the
//!   page, 0 for none.
//! - Page data at `data_offset` (the end of the owners rounded up to 4096):
//!   `n_pages` pages of `n_layers * blocks * page_size * kv_dim` values of
//!   the dtype, page-major
//!   as in the heap pool: page `p`, layer `l` is a K block
//!   `[page_size][kv_dim]` followed by a V block of the same shape (blocks
//!   2), or the K block alone for latent entries (blocks 1).
//!
//! # The lane protocol
//! An epoch is even while the lane is closed and odd while it is open; it
//! only ever moves forward by one (wrapping, which keeps the parity).
//! - Decode opens a lane for a grant ([`ShmRegion::lane_open`]): closed and
//!   no writer inside, it stores the key `{lane, e + 1}` as the owner of
//!   each of the grant's pages, then moves the epoch `e` -> `e + 1`; the key
//!   goes to the writer with the grant.
//! - The writer ([`ShmRegion::write_slots`]): `W1 active.fetch_add(1, SeqCst)`,
//!   `W2 epoch.load(SeqCst)`; only if that equals the key's epoch, and the
//!   page's owner is the key, does it copy, then `W3` leaves (also on
//!   refusal): decrements the count unless the lane was reset since W1.
//!   W2 reads the epoch the opening CAS wrote, so the owners stored before
//!   that CAS are visible to the owner check; a page's owner changes only
//!   when a later grant holds it, after this grant's lane was `Drained`.
//! - Decode closes ([`ShmRegion::lane_close`]): `D1 epoch CAS e -> e + 1
//!   (SeqCst)`, then `D2 active.load(SeqCst)`: `Drained` if 0, else `Busy`
//!   (ask again).
//!
//! **No write lands after a `Drained` close.** All SeqCst operations have
//! one total order S. Take a write that passed its check: its W2 read `e`,
//! so W2 precedes D1 in S (after D1 the lane's epoch is `e + 1` or later and
//! never returns to `e`), hence W1 <S W2 <S D1 <S D2. D2 reads a value of
//! `active` no earlier in its modification order than W1. Every decrement
//! comes after its own increment in that order, so if W3 were not yet in it
//! the value would be at least 1. D2 read 0, so W3 comes before the value D2
//! read; W3 is a Release and D2 an acquire (SeqCst) load reading at or after
//! it in the release sequence, so the copy (sequenced before W3)
//! happens-before D2. A write whose W2 comes after D1 reads an epoch other
//! than `e` and is refused without touching data. So when `Drained` is
//! returned every allowed write has fully landed and none can land later.
//! [`ShmRegion::lane_open`] makes the same check (its active load comes after
//! it saw the closed epoch), which is why a lane that has moved on past a key
//! also counts as drained for that key.
//!
//! **A reset cannot wedge a lane.** [`ShmRegion::lane_force_reset`] (the
//! grant's writer is dead inside the lane) zeroes the count and bumps the
//! reset generation in one atomic step. A live writer that entered before
//! the reset (with a stale key, on its way to a refusal) finds the
//! generation moved when it leaves and does not decrement: its entry was
//! wiped with the dead writer's. A plain store of 0 would let that late
//! decrement wrap the count to 2^32 - 1, and the lane would stay busy for
//! ever (or, one entrant later, read 0 with a writer inside).
//!
//! Page data is read by the decode side only after the grant's lane is
//! `Drained`; that is what makes those plain reads race-free.
//!
//! # Trust
//! The mapping covers the whole pool, like an RDMA memory region registered
//! over the pool: anyone who maps it can write any page, and could forge a
//! key or truncate the file (SIGBUS). Writers are therefore authenticated
//! mesh peers on the same host that run this code; the lanes protect against
//! *late* writes of well-behaved peers (aborts, timeouts, crashes), and the
//! page owners against a peer's write that names another grant's page (a
//! bug, or a key mixed up between grants), not against a hostile process. Finer-grained protection would need a mapping
//! per grant, as per-grant RDMA memory windows give. Cross-process atomics
//! rely on 32-bit lock-free atomics being address-free, as they are on every
//! target kvmesh supports. Epochs wrap after 2^31 grants of one lane; a key
//! held that long could match again, which we accept.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use thiserror::Error;

/// A writer's right to write through one lane at one epoch: what a grant
/// carries for the shared-memory transport. Forgeable by design (see the
/// module's trust section), like an RDMA remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WriteKey {
    /// Lane index.
    pub lane: u32,
    /// The lane's open (odd) epoch this key was issued for.
    pub epoch: u32,
}

impl WriteKey {
    /// `lane << 32 | epoch`, for the wire.
    pub fn to_u64(self) -> u64 {
        u64::from(self.lane) << 32 | u64::from(self.epoch)
    }

    /// The inverse of [`WriteKey::to_u64`].
    pub fn from_u64(v: u64) -> Self {
        // Truncations are the point: the high and the low 32 bits.
        Self {
            lane: (v >> 32) as u32,
            epoch: v as u32,
        }
    }
}

/// Outcome of [`ShmRegion::lane_close`].
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum LaneClose {
    /// The lane is closed and no write with the key can land any more.
    Drained,
    /// The lane is closed but writes admitted before the close are still
    /// copying; ask again.
    Busy {
        /// Writers inside the lane when it was looked at.
        active: u32,
    },
}

/// Why a shared-memory operation was refused. A refused write wrote nothing.
#[derive(Debug, Error)]
pub enum ShmError {
    /// A file system call failed.
    #[error("{what} failed for {}", path.display())]
    Io {
        /// The file (or, when naming it failed, the directory).
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
        /// The step that failed.
        what: &'static str,
    },
    /// The region's header is invalid, or (on create) the layout is.
    #[error("bad shared-memory region header in {}: {reason}", path.display())]
    BadHeader {
        /// The region file (the directory, on create).
        path: PathBuf,
        /// What is wrong, naming the field and its value.
        reason: String,
    },
    /// The region is valid but not the shape the caller expected.
    #[error("shared-memory region layout mismatch: expected {expected:?}, found {found:?}")]
    LayoutMismatch {
        /// The caller's layout.
        expected: ShmLayout,
        /// The header's layout.
        found: ShmLayout,
    },
    /// The layout's byte size overflows the address space.
    #[error("shared-memory region size overflows the address space")]
    TooLarge,
    /// The lane index is beyond the region's lanes.
    #[error("lane {lane} is out of range: the region has {n_lanes} lanes")]
    LaneOutOfRange {
        /// Lane requested.
        lane: u32,
        /// Lanes in the region.
        n_lanes: u64,
    },
    /// The lane cannot be opened or reset: it is open, or closed with
    /// writers still inside.
    #[error("lane {lane} is busy: open, or closed with {active} writers inside")]
    LaneBusy {
        /// Lane requested.
        lane: u32,
        /// Writers inside when it was looked at.
        active: u32,
    },
    /// The key does not name the lane's current open epoch: the grant was
    /// revoked, or the key was never issued.
    #[error("lane {lane} is closed for key epoch {key_epoch} (lane epoch {lane_epoch})")]
    LaneClosed {
        /// Lane of the key.
        lane: u32,
        /// Epoch of the key.
        key_epoch: u32,
        /// The lane's epoch when it was looked at.
        lane_epoch: u32,
    },
    /// The page is not one of the key's grant: the decode node recorded
    /// another grant (or none) as its owner. Counted in the mapping
    /// ([`ShmRegion::refused_outside_grant`]).
    #[error("page {page} is not in the grant of lane {lane} epoch {epoch}")]
    OutsideGrant {
        /// The page named.
        page: u32,
        /// Lane of the key.
        lane: u32,
        /// Epoch of the key.
        epoch: u32,
    },
    /// A page, layer or slot range is outside the pool.
    #[error("{what} {value} is out of bounds (limit {limit})")]
    OutOfBounds {
        /// `"page"`, `"layer"` (must be below `limit`) or `"slot_end"`
        /// (first slot after the write; must be at most `limit`).
        what: &'static str,
        /// The offending value.
        value: u64,
        /// The bound.
        limit: u64,
    },
    /// K and V differ in length, or are not whole slots of `kv_dim` values.
    #[error("bad K/V length: expected {expected} values, got {got}")]
    BadLength {
        /// K's length when V differs; the whole-slot length below K's
        /// length when K is not whole slots.
        expected: usize,
        /// The length given.
        got: usize,
    },
}

impl ShmError {
    /// Short stable label, for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::BadHeader { .. } => "bad_header",
            Self::LayoutMismatch { .. } => "layout_mismatch",
            Self::TooLarge => "too_large",
            Self::LaneOutOfRange { .. } => "lane_out_of_range",
            Self::LaneBusy { .. } => "lane_busy",
            Self::LaneClosed { .. } => "lane_closed",
            Self::OutsideGrant { .. } => "outside_grant",
            Self::OutOfBounds { .. } => "out_of_bounds",
            Self::BadLength { .. } => "bad_length",
        }
    }
}

fn io_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(io::Error) -> ShmError + 'a {
    move |source| ShmError::Io {
        path: path.to_owned(),
        source,
        what,
    }
}

/// A shared-memory pool mapping: header, lanes and page data.
#[derive(Debug)]
pub struct ShmRegion {
    map: MmapRaw,
    /// Start of the page data inside `map`.
    data: NonNull<u8>,
    path: PathBuf,
    layout: ShmLayout,
    sizes: Sizes,
    /// The creator unlinks the file on drop.
    creator: bool,
}

// SAFETY: `data` points into `map`, which lives as long as the region and is
// never remapped. Shared access from any thread goes either through the lane
// atomics or through raw copies under the lane protocol's contract (writers
// write only their grant's slots; decode reads only after `Drained`), which
// is the same contract across threads as across processes.
unsafe impl Send for ShmRegion {}
// SAFETY: as for `Send`: no method hands out a reference to non-atomic
// memory of the mapping.
unsafe impl Sync for ShmRegion {}

impl ShmRegion {
    /// Creates a new file `kvmesh-pool-<pid>-<32 random hex>.shm` in `dir`
    /// (create new, mode 0o600, after removing the files a dead decode
    /// process of this user left there: `leftovers`), sets its length,
    /// writes the header and maps it shared. Lanes start closed at epoch 0 with no writer; page data is
    /// zero. The creator unlinks the file on drop; mappings made by other
    /// processes stay valid.
    ///
    /// An invalid layout is `BadHeader` naming `dir`, or `TooLarge`.
    pub fn create(dir: &Path, layout: ShmLayout) -> Result<Arc<Self>, ShmError> {
        let sizes = layout.sizes().map_err(|f| match f {
            LayoutFault::Overflow => ShmError::TooLarge,
            f => ShmError::BadHeader {
                path: dir.to_owned(),
                reason: f.reason(),
            },
        })?;
        let rnd: [u8; 16] = kvmesh_kvwire::ids::random_nonzero().map_err(|e| ShmError::Io {
            path: dir.to_owned(),
            source: io::Error::other(e),
            what: "random file name",
        })?;
        let hex: String = rnd.iter().map(|b| format!("{b:02x}")).collect();
        for stale in leftovers::sweep(dir) {
            tracing::warn!(
                path = %stale.display(),
                "removed the pool file of a decode process that did not exit cleanly"
            );
        }
        let path = dir.join(leftovers::file_name(std::process::id(), &hex));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err(&path, "create"))?;
        let made = (|| {
            // ftruncate: the lanes (epoch 0, active 0) and the data start as zeros.
            file.set_len(sizes.total_len as u64)
                .map_err(io_err(&path, "set_len"))?;
            file.write_all_at(&encode_header(&layout, &sizes), 0)
                .map_err(io_err(&path, "write header"))?;
            Self::map(&file, path.clone(), layout, sizes, true)
        })();
        if made.is_err() {
            // Best effort: the error being returned matters more.
            let _ = std::fs::remove_file(&path);
        }
        made.map(Arc::new)
    }

    /// Maps an existing region read-write and validates its header; with
    /// `expect`, the header's layout must equal it (else `LayoutMismatch`).
    pub fn open(path: &Path, expect: Option<&ShmLayout>) -> Result<Arc<Self>, ShmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err(path, "open"))?;
        let file_len = file.metadata().map_err(io_err(path, "stat"))?.len();
        let bad = |reason: String| ShmError::BadHeader {
            path: path.to_owned(),
            reason,
        };
        if file_len < HEADER_LEN as u64 {
            return Err(bad(format!(
                "file length {file_len} is shorter than the header"
            )));
        }
        let mut h = [0u8; HEADER_USED];
        file.read_exact_at(&mut h, 0)
            .map_err(io_err(path, "read header"))?;
        let (layout, sizes) = decode_header(&h, file_len).map_err(bad)?;
        if let Some(expected) = expect {
            if *expected != layout {
                return Err(ShmError::LayoutMismatch {
                    expected: *expected,
                    found: layout,
                });
            }
        }
        Self::map(&file, path.to_owned(), layout, sizes, false).map(Arc::new)
    }

    fn map(
        file: &File,
        path: PathBuf,
        layout: ShmLayout,
        sizes: Sizes,
        creator: bool,
    ) -> Result<Self, ShmError> {
        let map = MmapOptions::new()
            .len(sizes.total_len)
            .map_raw(file)
            .map_err(io_err(&path, "mmap"))?;
        let base = map.as_mut_ptr();
        let bad = |reason: &str| ShmError::BadHeader {
            path: path.clone(),
            reason: reason.to_owned(),
        };
        if map.len() != sizes.total_len {
            return Err(bad("mapping length differs from total_len"));
        }
        // mmap returns page-aligned addresses; checked because the lane
        // atomics and the data's alignment rely on it.
        if base.align_offset(LANE_STRIDE) != 0 {
            return Err(bad("mapping is not 64-byte aligned"));
        }
        let data = NonNull::new(base.wrapping_add(sizes.data_offset))
            .ok_or_else(|| bad("null mapping"))?;
        Ok(Self {
            map,
            data,
            path,
            layout,
            sizes,
            creator,
        })
    }

    /// The region's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The region's layout, as validated from its header.
    pub fn layout(&self) -> &ShmLayout {
        &self.layout
    }

    /// Bytes of page data from its start (4096-aligned, `n_pages *
    /// page_values` values of the layout's dtype) to the mapping's end. Read
    /// only pages whose grants' lanes are `Drained` (module doc).
    fn data_len(&self) -> usize {
        self.sizes.total_len - self.sizes.data_offset
    }

    /// The owner entry of `page`, which must be below `n_pages`.
    fn owner(&self, page: u32) -> Result<&AtomicU64, ShmError> {
        if u64::from(page) >= self.layout.n_pages {
            return Err(ShmError::OutOfBounds {
                what: "page",
                value: page.into(),
                limit: self.layout.n_pages,
            });
        }
        // In bounds: owners_offset + n_pages * 8 <= data_offset.
        let at = self
            .map
            .as_mut_ptr()
            .wrapping_add(self.sizes.owners_offset + page as usize * layout::OWNER_STRIDE);
        // SAFETY: inside the mapping (above), which lives as long as
        // `&self`; 8-aligned (a 64-aligned mapping, offsets multiples of 8);
        // these bytes are only ever accessed as this `AtomicU64`, in every
        // process running this code (zeros of ftruncate before).
        Ok(unsafe { AtomicU64::from_ptr(at.cast::<u64>()) })
    }

    /// The count of writes refused for naming a page outside their grant,
    /// in the mapping (header +128).
    fn refused_counter(&self) -> &AtomicU64 {
        let at = self
            .map
            .as_mut_ptr()
            .wrapping_add(layout::REFUSED_OUTSIDE_GRANT);
        // SAFETY: inside the header's reserved bytes (HEADER_LEN <=
        // total_len), 8-aligned, zero from ftruncate and never written as
        // anything but this `AtomicU64` (the header's used bytes end at
        // HEADER_USED, below it).
        unsafe { AtomicU64::from_ptr(at.cast::<u64>()) }
    }

    /// Writes refused so far, by any process mapping this region, because
    /// they named a page outside their key's grant.
    pub fn refused_outside_grant(&self) -> u64 {
        self.refused_counter().load(Ordering::Relaxed)
    }

    /// Writes K and V of consecutive slots from `slot` into (`page`,
    /// `layer`), one-sided, if `key` is still open and `page` is one of its
    /// grant's (else `OutsideGrant`, counted in the mapping): `k` and `v` are the
    /// values encoded in the region's dtype, little-endian, as a frame
    /// carries them ([`kvmesh_kvwire::encode_values`]), whole slots of equal
    /// length (`v` empty for latent entries). Length errors count values.
    /// On any error nothing was written.
    pub fn write_slots(
        &self,
        key: WriteKey,
        page: u32,
        layer: u32,
        slot: u32,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), ShmError> {
        let s = &self.sizes;
        let size = self.layout.dtype.size();
        let oob = |what, value: u64, limit: u64| ShmError::OutOfBounds { what, value, limit };
        if u64::from(page) >= self.layout.n_pages {
            return Err(oob("page", page.into(), self.layout.n_pages));
        }
        if layer >= self.layout.n_layers {
            return Err(oob("layer", layer.into(), self.layout.n_layers.into()));
        }
        let v_len = if s.blocks == 2 { k.len() } else { 0 };
        if v.len() != v_len {
            return Err(ShmError::BadLength {
                expected: v_len / size,
                got: v.len() / size,
            });
        }
        let values = k.len() / size;
        let n = values / s.kv_dim;
        if !values.is_multiple_of(s.kv_dim) || !k.len().is_multiple_of(size) {
            return Err(ShmError::BadLength {
                expected: n * s.kv_dim,
                got: values,
            });
        }
        // n <= k.len() fits u64; the sum cannot overflow u64.
        let slot_end = u64::from(slot) + n as u64;
        if slot_end > u64::from(self.layout.page_size) {
            return Err(oob("slot_end", slot_end, self.layout.page_size.into()));
        }
        // All below page < n_pages, layer < n_layers, slot + n <= page_size,
        // so within n_pages * page_values, which `sizes` checked; checked
        // anyway so that a mistake here is an error, not a wild write.
        // Offsets in bytes.
        let k_off = (page as usize)
            .checked_mul(s.page_values)
            .and_then(|o| {
                o.checked_add(
                    (layer as usize)
                        .checked_mul(s.blocks)?
                        .checked_mul(s.block)?,
                )
            })
            .and_then(|o| o.checked_add((slot as usize).checked_mul(s.kv_dim)?))
            .and_then(|o| o.checked_mul(size))
            .ok_or(ShmError::TooLarge)?;
        let v_off = s
            .block
            .checked_mul(size)
            .and_then(|b| k_off.checked_add(b))
            .ok_or(ShmError::TooLarge)?;

        let l = self.lane(key.lane)?;
        let owner = self.owner(page)?;
        // W1; `_inside` is W3 on every path from here.
        let _inside = l.enter();
        // W2.
        l.admit(key)?;
        // After W2: the owners the lane's opening stored are visible. One
        // more load per write (no fence on x86, where an acquire load is a
        // plain one).
        if owner.load(Ordering::Acquire) != key.to_u64() {
            self.refused_counter().fetch_add(1, Ordering::Relaxed);
            return Err(ShmError::OutsideGrant {
                page,
                lane: key.lane,
                epoch: key.epoch,
            });
        }
        let dst = self.data.as_ptr();
        // SAFETY: both ranges are inside the page data (bounds checked
        // above: the V block of (page, layer) ends within the page; a
        // latent pool's `v` is empty, so nothing is copied at `v_off`), which
        // the mapping covers for as long as `&self`. `k` and `v` are shared
        // references, so nobody may write their memory while they live; we
        // write `dst`, so it cannot overlap them. Concurrent access to these
        // slots is excluded by the lane contract: the grant gives them to one
        // writer, and decode reads them only after `Drained`.
        unsafe {
            std::ptr::copy_nonoverlapping(k.as_ptr(), dst.add(k_off), k.len());
            std::ptr::copy_nonoverlapping(v.as_ptr(), dst.add(v_off), v.len());
        }
        Ok(())
    }
}

// SAFETY: the page data is `data_len()` bytes of the mapping from
// `data_ptr()`, which stays mapped (and never moves) as long as the region
// lives; it is 4096-aligned and zero-filled by `ftruncate` when the file is
// created; this process touches it only through the pool's storage and the
// lane-gated copies of `write_slots`, whose fencing is the lanes' job (the
// module doc).
unsafe impl kvmesh_kvpool::PoolMemory for ShmRegion {
    fn data_ptr(&self) -> NonNull<u8> {
        self.data
    }

    fn len_bytes(&self) -> usize {
        self.data_len()
    }
}

/// A pool whose storage is a new shared-memory mapping in `dir` (e.g.
/// `/dev/shm`) that writer processes on this host map and write one-sided,
/// through one lane per grant ([`crate::transport::shm`]). One lane per
/// page: a grant holds at least one page, so lanes never run out first.
/// Returns the region too, for the KV listener that hands it to writers.
pub fn shared_pool(
    cfg: kvmesh_kvpool::PoolConfig,
    dir: &Path,
) -> Result<(kvmesh_kvpool::KvPool, Arc<ShmRegion>), kvmesh_kvpool::PoolError> {
    use kvmesh_kvpool::PoolError;
    cfg.validate()?;
    let bad = |reason| PoolError::InvalidConfig {
        field: "shared memory",
        value: cfg.n_pages,
        reason,
    };
    let layout = ShmLayout {
        page_size: u32::try_from(cfg.page_size).map_err(|_| bad("page_size over u32"))?,
        n_layers: u32::try_from(cfg.n_layers).map_err(|_| bad("n_layers over u32"))?,
        n_kv_heads: u32::try_from(cfg.n_kv_heads).map_err(|_| bad("n_kv_heads over u32"))?,
        head_dim: u32::try_from(cfg.head_dim).map_err(|_| bad("head_dim over u32"))?,
        dtype: cfg.dtype,
        entry: cfg.entry,
        n_pages: cfg.n_pages as u64,
        n_lanes: cfg.n_pages as u64,
    };
    let region = ShmRegion::create(dir, layout).map_err(|e| match e {
        ShmError::Io { source, .. } if source.kind() == io::ErrorKind::OutOfMemory => {
            PoolError::OutOfMemory { bytes: cfg.bytes() }
        }
        _ => bad("could not create the shared mapping (see logs)"),
    })?;
    let memory: Arc<dyn kvmesh_kvpool::PoolMemory> = region.clone();
    let pool = kvmesh_kvpool::KvPool::new_in(cfg, memory)?;
    Ok((pool, region))
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if self.creator {
            // Best effort: a leftover file in a tmpfs is all that can go wrong.
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

mod lanes;
mod layout;
mod leftovers;
mod peer;
use layout::{decode_header, encode_header, LayoutFault, Sizes, HEADER_USED};
pub use layout::{ShmLayout, HEADER_LEN, LANE_STRIDE};
pub use peer::PeerProcess;

#[cfg(test)]
mod tests;
