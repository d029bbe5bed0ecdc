//! Memory for what every step streams, the quantized weights and the KV
//! pool, in 2 MiB transparent huge pages where the OS gives them.
//!
//! A batch-1 decode step reads every weight byte once, and its attention
//! reads one K and one V block per (KV page, layer), scattered a page
//! apart. In 4 KiB pages each 4 KiB is a TLB miss whose page walk the
//! stream itself has evicted from the caches, and the hardware
//! prefetchers stop at every 4 KiB boundary. In 2 MiB pages both go: on
//! an EPYC Zen 4 host batch-1 decode ran 1.11-1.19x as fast for SmolLM2,
//! 1.08x for Qwen2.5-Coder 0.5B and 1.28x for Gemma 3 270M (medians of
//! alternated pairs, docs/performance.md).
//!
//! # How
//! [`HugeMem`] is an anonymous private mapping aligned to 2 MiB and
//! marked `MADV_HUGEPAGE` before any byte of it is touched: in THP's
//! `madvise` mode (Debian's default) only such ranges get huge pages, and
//! a range touched first gets 4 KiB ones for good. Where the OS has no
//! huge pages (THP `never`, fragmented memory, not Linux) the same memory
//! comes in small pages: the same bytes, so the same results.
//!
//! Weights are small matrices (SmolLM2's 345 KiB QKV) that each would
//! waste most of a huge page, so [`place`] packs them into shared chunks
//! of [`CHUNK`] bytes, written once and only read afterwards; a matrix
//! larger than half a chunk gets a mapping of its own.
//!
//! # Cost
//! One copy of each smaller weight matrix at load (a larger one is read
//! straight into its own mapping, [`OWN_FROM`]); at most one partly used
//! huge page a chunk or large matrix (2 MiB) more than the bytes held; a
//! chunk lives until its last matrix is dropped.

use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// The huge page size this module aligns to (x86-64 and AArch64 Linux).
pub const HUGE: usize = 2 << 20;

/// The smallest mapping advised for huge pages (16 MiB): a buffer is
/// touched a huge page at a time, so a partly used last one adds at most
/// an eighth (a small KV pool of a few MB would grow by up to a fifth).
pub const ADVISE_FROM: usize = 8 * HUGE;

/// Bytes of a chunk [`place`] packs matrices into.
pub const CHUNK: usize = 32 << 20;

/// `len` zeroed bytes, 2 MiB-aligned, in huge pages where the OS gives
/// them (module doc) and `len` is at least [`ADVISE_FROM`]. Raw memory:
/// whoever holds it rules its accesses.
pub struct HugeMem {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes mapped (a whole number of huge pages) or allocated.
    size: usize,
}

// SAFETY: plain memory with no thread affinity; the holder synchronises
// its accesses (`HugeBytes` only reads, after the one write at `place`).
unsafe impl Send for HugeMem {}
// SAFETY: as above.
unsafe impl Sync for HugeMem {}

impl HugeMem {
    /// `len` zeroed bytes, or `None` when the OS refuses the memory.
    pub fn zeroed(len: usize) -> Option<Self> {
        let size = len.max(1).checked_next_multiple_of(HUGE)?;
        // SAFETY: `size` is at least `len.max(1)`; a failed mapping is
        // reported.
        let ptr = unsafe { map(len.max(1), size)? };
        Some(Self { ptr, len, size })
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start of the memory, never null.
    pub fn as_non_null(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, to write (a file's tensor read straight into them).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes of this mapping, zeroed when made (so
        // initialised); `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
}

impl Drop for HugeMem {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`size` are what `map` returned, released once.
        unsafe { unmap(self.ptr, self.size) }
    }
}

impl std::fmt::Debug for HugeMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeMem").field("len", &self.len).finish()
    }
}

/// `size` (a multiple of [`HUGE`]) zeroed bytes at a [`HUGE`]-aligned
/// address, marked for huge pages before anything touches them when
/// `len` (the bytes asked for) is at least [`ADVISE_FROM`].
///
/// # Safety
/// `0 < len <= size`.
#[cfg(target_os = "linux")]
unsafe fn map(len: usize, size: usize) -> Option<NonNull<u8>> {
    let span = size.checked_add(HUGE)?;
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    unsafe {
        let raw = libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE);
        // Return the unaligned head and the tail past `size`.
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        let tail = start + span - (aligned + size);
        if tail > 0 {
            libc::munmap((aligned + size) as *mut libc::c_void, tail);
        }
        // Advice only: without huge pages the memory is the same. Not
        // below `ADVISE_FROM`, where a partly used last huge page would
        // add more than an eighth to what is touched.
        if len >= ADVISE_FROM {
            libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        NonNull::new(aligned as *mut u8)
    }
}

/// # Safety
/// `ptr`, `size` as [`map`] returned them, not used afterwards.
#[cfg(target_os = "linux")]
unsafe fn unmap(ptr: NonNull<u8>, size: usize) {
    // SAFETY: by the caller.
    unsafe { libc::munmap(ptr.as_ptr().cast(), size) };
}

/// # Safety
/// `0 < len <= size`.
#[cfg(not(target_os = "linux"))]
unsafe fn map(_len: usize, size: usize) -> Option<NonNull<u8>> {
    let layout = std::alloc::Layout::from_size_align(size, HUGE).ok()?;
    // SAFETY: non-zero size (caller).
    NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
}

/// # Safety
/// `ptr`, `size` as [`map`] returned them, not used afterwards.
#[cfg(not(target_os = "linux"))]
unsafe fn unmap(ptr: NonNull<u8>, size: usize) {
    // SAFETY: by the caller, with `map`'s layout.
    unsafe {
        std::alloc::dealloc(
            ptr.as_ptr(),
            std::alloc::Layout::from_size_align_unchecked(size, HUGE),
        )
    }
}

/// Hand the C allocator's free memory back to the OS (glibc's
/// `malloc_trim`; nothing elsewhere). A model built from loaded weights
/// frees each layer's loaded blocks once [`place`] has copied them, into
/// free lists that the copies (mapped, not allocated) never reuse: trimmed
/// after each layer, the load's peak is the model and one layer, not the
/// model twice.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: no arguments to uphold; it only releases free pages.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Read-only bytes [`place`]d in huge-page memory.
#[derive(Clone)]
pub struct HugeBytes {
    mem: Arc<HugeMem>,
    at: usize,
    len: usize,
}

impl Deref for HugeBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `at .. at + len` lies inside `mem`, was written once by
        // `place` before this value existed and is never written again.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().add(self.at), self.len) }
    }
}

impl std::fmt::Debug for HugeBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBytes").field("len", &self.len).finish()
    }
}

impl From<HugeMem> for HugeBytes {
    /// All of `mem`'s bytes, read-only from now on.
    fn from(mem: HugeMem) -> Self {
        let len = mem.len();
        Self {
            mem: Arc::new(mem),
            at: 0,
            len,
        }
    }
}

/// Matrices of more bytes than this get a mapping of their own from
/// [`place`]; a loader reads them straight into one ([`HugeMem`]) instead
/// of a buffer that would be copied.
pub const OWN_FROM: usize = CHUNK / 2;

/// The chunk being filled and its first free byte.
static OPEN: Mutex<Option<(Arc<HugeMem>, usize)>> = Mutex::new(None);

/// Alignment of each placed matrix (a cache line).
const ALIGN: usize = 64;

/// A copy of `data` in huge-page memory (module doc), or `None` when the
/// OS refuses the memory.
pub fn place(data: &[u8]) -> Option<HugeBytes> {
    place_all(&[data])
}

/// The concatenation of `parts` placed as by [`place`], with no buffer
/// in between (a stacked projection's matrices).
pub fn place_all(parts: &[&[u8]]) -> Option<HugeBytes> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    // SAFETY (both writes below): `dst` holds at least `len` writable
    // bytes that nothing else refers to.
    let write = |dst: *mut u8| {
        let mut at = 0;
        for p in parts {
            unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), dst.add(at), p.len()) };
            at += p.len();
        }
    };
    if len > OWN_FROM {
        let mem = HugeMem::zeroed(len)?;
        write(mem.as_ptr());
        return Some(mem.into());
    }
    // A poisoned lock still holds a consistent (chunk, offset): every
    // update below is one assignment.
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let fits = |o: &Option<(Arc<HugeMem>, usize)>| {
        o.as_ref()
            .is_some_and(|(m, used)| used.next_multiple_of(ALIGN) + len <= m.len())
    };
    if !fits(&open) {
        *open = Some((Arc::new(HugeMem::zeroed(CHUNK)?), 0));
    }
    let (mem, used) = open.as_mut()?;
    let at = used.next_multiple_of(ALIGN);
    // `at .. at + len` is inside the chunk (checked by `fits`) and past
    // every range handed out from it, so no `HugeBytes` reads it; the
    // lock keeps other placements out.
    // SAFETY: `at` is inside the chunk.
    write(unsafe { mem.as_ptr().add(at) });
    *used = at + len;
    Some(HugeBytes {
        mem: Arc::clone(mem),
        at,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Placed bytes read back as given, whatever their size (empty, a
    /// chunk's worth, more than half a chunk), and ranges placed in one
    /// chunk neither overlap nor move.
    #[test]
    fn placed_bytes_read_back_unchanged_and_apart() {
        let pattern = |n: usize, seed: usize| -> Vec<u8> {
            (0..n).map(|i| (i * 31 + seed * 7) as u8).collect()
        };
        let sizes = [
            0,
            1,
            63,
            64,
            4097,
            345 << 10,
            CHUNK / 2,
            CHUNK / 2 + 1,
            3 << 20,
        ];
        let mut placed = Vec::new();
        for (seed, &n) in sizes.iter().enumerate() {
            let data = pattern(n, seed);
            let p = place(&data).expect("memory");
            assert_eq!(&p[..], &data[..], "{n} bytes");
            assert_eq!(p.as_ptr() as usize % ALIGN, 0, "{n} bytes aligned");
            placed.push((p, data));
        }
        // Every earlier placement is still intact after the later ones.
        for (p, data) in &placed {
            assert_eq!(&p[..], &data[..]);
        }
        for (i, (a, _)) in placed.iter().enumerate() {
            for (b, _) in &placed[i + 1..] {
                let (a0, b0) = (a.as_ptr() as usize, b.as_ptr() as usize);
                assert!(
                    a.is_empty() || b.is_empty() || a0 + a.len() <= b0 || b0 + b.len() <= a0,
                    "placed ranges overlap"
                );
            }
        }
    }

    /// Whether the kernel holds the huge-page advice for the mapping
    /// holding `addr` (`hg` in its smaps flags); `None` without THP.
    #[cfg(target_os = "linux")]
    fn advised(addr: usize) -> Option<bool> {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            return None;
        }
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        // The mapping holding `addr`: its header line, then its fields up
        // to its flags.
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| {
                let (a, b) = r.split_once('-')?;
                Some((
                    usize::from_str_radix(a, 16).ok()?,
                    usize::from_str_radix(b, 16).ok()?,
                ))
            });
            if let Some((a, b)) = range {
                inside = (a..b).contains(&addr);
            } else if inside && line.starts_with("VmFlags:") {
                return Some(line.split_whitespace().any(|f| f == "hg"));
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// A mapping is zeroed and starts on a huge page; on Linux with THP
    /// the kernel holds the advice for one of `ADVISE_FROM` bytes (given
    /// before anything touched it) and not for a smaller one (its partly
    /// used last huge page would be too much waste).
    #[test]
    fn memory_is_zeroed_aligned_and_advised_when_large() {
        let mut mem = HugeMem::zeroed(ADVISE_FROM).expect("memory");
        let mut small = HugeMem::zeroed(ADVISE_FROM - 1).expect("memory");
        for m in [&mut mem, &mut small] {
            assert_eq!(m.as_ptr() as usize % HUGE, 0);
            let bytes = m.as_mut_slice();
            assert!(bytes.iter().all(|&b| b == 0));
            bytes.fill(7);
        }
        #[cfg(target_os = "linux")]
        if let Some(large) = advised(mem.as_ptr() as usize) {
            assert!(large, "16 MiB advised for huge pages");
            assert_eq!(advised(small.as_ptr() as usize), Some(false), "less not");
        }
    }
}
