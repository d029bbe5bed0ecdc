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
//! - Lanes at `lanes_offset` = 4096: `n_lanes` entries of 64 bytes (one
//!   cache line each, so lanes do not false-share): `epoch: AtomicU32` at +0,
//!   `active: AtomicU32` at +4, the rest padding.
//! - Page data at `data_offset` (the end of the lanes rounded up to 4096):
//!   `n_pages` pages of `n_layers * 2 * page_size * kv_dim` values of the
//!   dtype, page-major
//!   as in the heap pool: page `p`, layer `l` is a K block
//!   `[page_size][kv_dim]` followed by a V block of the same shape.
//!
//! # The lane protocol
//! An epoch is even while the lane is closed and odd while it is open; it
//! only ever moves forward by one (wrapping, which keeps the parity).
//! - Decode opens a lane for a grant ([`ShmRegion::lane_open`]): closed and
//!   `active == 0`, epoch `e` -> `e + 1`; the key `{lane, e + 1}` goes to the
//!   writer with the grant.
//! - The writer ([`ShmRegion::write_slots`]): `W1 active.fetch_add(1, SeqCst)`,
//!   `W2 epoch.load(SeqCst)`; only if that equals the key's epoch does it
//!   copy, then `W3 active.fetch_sub(1, Release)` (also on refusal).
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
//! Page data is read by the decode side only after the grant's lane is
//! `Drained`; that is what makes those plain reads race-free.
//!
//! # Trust
//! The mapping covers the whole pool, like an RDMA memory region registered
//! over the pool: anyone who maps it can write any page, and could forge a
//! key or truncate the file (SIGBUS). Writers are therefore authenticated
//! mesh peers on the same host that run this code; the lanes protect against
//! *late* writes of well-behaved peers (aborts, timeouts, crashes), not
//! against a hostile process. Finer-grained protection would need a mapping
//! per grant, as per-grant RDMA memory windows give. Cross-process atomics
//! rely on 32-bit lock-free atomics being address-free, as they are on every
//! target kvmesh supports. Epochs wrap after 2^31 grants of one lane; a key
//! held that long could match again, which we accept.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
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

/// One lane's two atomics, borrowed from the mapping.
struct Lane<'a> {
    epoch: &'a AtomicU32,
    active: &'a AtomicU32,
}

/// A writer inside a lane; leaving is the `Drop`, so every return path of a
/// write leaves (W3 of the protocol).
struct Entered<'a>(&'a AtomicU32);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
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

    fn lane(&self, lane: u32) -> Result<Lane<'_>, ShmError> {
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
        // SAFETY: `at` and `at + 4` are inside the mapping (above), which
        // lives as long as `&self`; they are 4-aligned because the mapping
        // is 64-aligned (checked in `map`) and the offsets are multiples of
        // 4. These bytes are only ever accessed as these two `AtomicU32`s,
        // here and in every process running this code (the header is
        // written through the file before mapping, the lanes start as the
        // zeros of ftruncate), so there is no non-atomic or mixed-size
        // access to them.
        unsafe {
            Ok(Lane {
                epoch: AtomicU32::from_ptr(at.cast::<u32>()),
                active: AtomicU32::from_ptr(at.wrapping_add(4).cast::<u32>()),
            })
        }
    }

    /// Opens `lane` for a new grant and returns its key. The lane must be
    /// closed with no writer inside, else `LaneBusy`.
    pub fn lane_open(&self, lane: u32) -> Result<WriteKey, ShmError> {
        let l = self.lane(lane)?;
        let epoch = l.epoch.load(Ordering::SeqCst);
        let busy = || ShmError::LaneBusy {
            lane,
            active: l.active.load(Ordering::SeqCst),
        };
        if epoch % 2 == 1 {
            return Err(busy());
        }
        // After the load of the closed epoch, as D2 of a close: a 0 here
        // means every write admitted under earlier epochs has landed.
        if l.active.load(Ordering::SeqCst) != 0 {
            return Err(busy());
        }
        // Even + 1 is odd, also across the wrap (2^32 is even).
        let open = epoch.wrapping_add(1);
        l.epoch
            .compare_exchange(epoch, open, Ordering::SeqCst, Ordering::SeqCst)
            .map_err(|_| busy())?;
        Ok(WriteKey { lane, epoch: open })
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
        match l.active.load(Ordering::SeqCst) {
            0 => Ok(LaneClose::Drained),
            active => Ok(LaneClose::Busy { active }),
        }
    }

    /// Sets the lane's writer count to 0 so it can be reopened, after every
    /// process that could enter it is known dead (see [`PeerProcess`]):
    /// their admitted writes can no longer land, but their count was never
    /// given back. The lane must be closed (else `LaneBusy`). Calling this
    /// while a live process can still enter the lane, even to be refused,
    /// corrupts the count.
    pub fn lane_force_reset(&self, lane: u32) -> Result<(), ShmError> {
        let l = self.lane(lane)?;
        if l.epoch.load(Ordering::SeqCst) % 2 == 1 {
            return Err(ShmError::LaneBusy {
                lane,
                active: l.active.load(Ordering::SeqCst),
            });
        }
        l.active.store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Writes K and V of consecutive slots from `slot` into (`page`,
    /// `layer`), one-sided, if `key` is still open: `k` and `v` are the
    /// values encoded in the region's dtype, little-endian, as a frame
    /// carries them ([`kvmesh_kvwire::encode_values`]), whole slots of equal
    /// length. Length errors count values. On any error nothing was written.
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
        if k.len() != v.len() {
            return Err(ShmError::BadLength {
                expected: k.len() / size,
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
            .and_then(|o| o.checked_add((layer as usize).checked_mul(2)?.checked_mul(s.block)?))
            .and_then(|o| o.checked_add((slot as usize).checked_mul(s.kv_dim)?))
            .and_then(|o| o.checked_mul(size))
            .ok_or(ShmError::TooLarge)?;
        let v_off = s
            .block
            .checked_mul(size)
            .and_then(|b| k_off.checked_add(b))
            .ok_or(ShmError::TooLarge)?;

        let l = self.lane(key.lane)?;
        // W1; `_inside` is W3 on every path from here.
        l.active.fetch_add(1, Ordering::SeqCst);
        let _inside = Entered(l.active);
        // W2. An even key epoch never admits: it would match a closed lane.
        let lane_epoch = l.epoch.load(Ordering::SeqCst);
        if lane_epoch != key.epoch || key.epoch.is_multiple_of(2) {
            return Err(ShmError::LaneClosed {
                lane: key.lane,
                key_epoch: key.epoch,
                lane_epoch,
            });
        }
        let dst = self.data.as_ptr();
        // SAFETY: both ranges are inside the page data (bounds checked
        // above: the V block of (page, layer) ends within the page), which
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

impl ShmRegion {
    /// `testing` only: enters the key's lane and never leaves, as a writer
    /// frozen (or killed) in the middle of a one-sided write would. The
    /// lane then stays `Busy` until its process is known dead.
    #[cfg(feature = "testing")]
    pub fn freeze_inside_lane(&self, key: WriteKey) -> Result<(), ShmError> {
        let l = self.lane(key.lane)?;
        l.active.fetch_add(1, Ordering::SeqCst);
        let lane_epoch = l.epoch.load(Ordering::SeqCst);
        if lane_epoch != key.epoch || key.epoch.is_multiple_of(2) {
            l.active.fetch_sub(1, Ordering::Release);
            return Err(ShmError::LaneClosed {
                lane: key.lane,
                key_epoch: key.epoch,
                lane_epoch,
            });
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

mod layout;
mod leftovers;
mod peer;
use layout::{decode_header, encode_header, LayoutFault, Sizes, HEADER_USED};
pub use layout::{ShmLayout, HEADER_LEN, LANE_STRIDE};
pub use peer::PeerProcess;

#[cfg(test)]
mod tests;
