//! The device KV pool: page storage, per-page generations and per-layer
//! watermarks in device memory, mirroring a host [`KvPool`] that keeps
//! owning every page.
//!
//! The host pool decides every allocation, release and eviction, as on the
//! CPU path, and keeps owners, leases, the prefix cache and the free list.
//! It tells this pool of each page change through [`PageEvents`] (its
//! [`PageObserver`]); [`DeviceKvPool::apply_events`] applies the queued
//! events with one `page_events` launch on the compute stream, which the
//! engine calls before every step, so no kernel of the step can run against
//! an older generation. A mirror that is behind fails closed: the table's
//! generation differs from the device's and the kernel refuses the page.
//!
//! Watermarks on the device rise only in the `kv_write` kernel (by the CPU
//! pool's rules: no write above the watermark, raised to the end of what
//! was written) and through [`DeviceKvPool::upload_page`], the landing of a
//! transferred page whose host copy was verified and published first.
//!
//! # Staging
//! Pages move between the device and the KV transports through one pinned
//! host buffer of a page: [`DeviceKvPool::download_page`] (prefill: the
//! device's page to the transport) and [`DeviceKvPool::upload_page`]
//! (decode: a landed, verified page to the device). The page's bytes are the
//! host pool's page layout (page-major, then layer, K then V, each
//! `[page_size][kv_dim]` of the pool's dtype), so the host pool's storage
//! and checksums apply unchanged. GPUDirect RDMA would register the device
//! allocation with the NIC (UCX built with CUDA, `nvidia-peermem`) and skip
//! the staging copy; see `docs/cuda.md`.
//!
//! # Memory
//! `n_pages * page bytes` of KV, `4 * n_pages` of generations,
//! `4 * n_pages * n_layers` of watermarks, and one pinned page on the host.

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaSlice, LaunchConfig, PinnedHostSlice, PushKernelArg};
use kvmesh_kernels::KvDtype;
use kvmesh_kvpool::{KvPool, PageEvent, PageFill, PageObserver, PoolConfig};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::ops::{StepTables, ATTENTION_THREADS, MAX_HEAD_DIM};

/// `FILL_NONE`, `FILL_ZERO`, `FILL_CANARY` and `EVENT_RETAG` of `kv.cu`.
const FILL_NONE: u32 = 0;
const FILL_ZERO: u32 = 1;
const FILL_CANARY: u32 = 2;
const EVENT_RETAG: u32 = 3;

/// The queue of page events between the host pool and the device: the
/// host pool's [`PageObserver`]. Each event is three `u32`s, as the
/// `page_events` kernel reads them.
#[derive(Debug, Default)]
pub struct PageEvents {
    pending: Mutex<Vec<[u32; 3]>>,
}

impl PageEvents {
    /// The device encoding of `event` (generations compare by their low 32
    /// bits, see [`crate::table`]).
    pub fn encode(event: PageEvent) -> [u32; 3] {
        let code = match event {
            PageEvent::Retagged { .. } => EVENT_RETAG,
            PageEvent::Allocated { fill, .. } | PageEvent::Freed { fill, .. } => match fill {
                PageFill::Keep => FILL_NONE,
                PageFill::Zero => FILL_ZERO,
                PageFill::Canary => FILL_CANARY,
            },
        };
        [event.page(), event.generation() as u32, code]
    }

    /// Everything queued so far, in order, leaving the queue empty.
    pub fn take(&self) -> Vec<[u32; 3]> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether none wait.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl PageObserver for PageEvents {
    fn page_event(&self, event: PageEvent) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Self::encode(event));
    }
}

/// The shape of one attention call: which layer, how the heads group,
/// the softmax scale, and the sliding window (0: none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionCall {
    /// Layer read.
    pub layer: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (`n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Head dimension, at most [`MAX_HEAD_DIM`].
    pub head_dim: usize,
    /// Softmax scale (`1 / sqrt(head_dim)` for Llama).
    pub scale: f32,
    /// Keys attended before the query's own position, 0 for all.
    pub window: usize,
    /// Check generations and watermarks (the product path); `false` only
    /// for the benchmark that measures what the checks cost.
    pub checked: bool,
}

/// A device pool mirroring a host pool (see the module docs).
pub struct DeviceKvPool {
    gpu: Arc<Gpu>,
    cfg: PoolConfig,
    host: KvPool,
    events: Arc<PageEvents>,
    kv: CudaSlice<u8>,
    gens: CudaSlice<u32>,
    wm: CudaSlice<u32>,
    staging: Mutex<PinnedHostSlice<u8>>,
}

impl std::fmt::Debug for DeviceKvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvPool")
            .field("cfg", &self.cfg)
            .field("pending_events", &self.events.len())
            .finish_non_exhaustive()
    }
}

fn kv_code(dtype: KvDtype) -> u32 {
    match dtype {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
    }
}

fn bad(op: &'static str, detail: String) -> CudaError {
    CudaError::BadArgument { op, detail }
}

fn u32_of(op: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| bad(op, format!("{n} does not fit the kernel's 32-bit sizes")))
}

impl DeviceKvPool {
    /// A device pool on `gpu` mirroring `host`, which must never have
    /// handed out a page (its observer is set to this pool's event queue;
    /// see [`KvPool::set_observer`]): a pool in plain memory, or the
    /// shared-memory or UCX-registered pool a decode node's transport
    /// lands pages in. The device starts as such a pool is: every generation
    /// 0, every watermark 0, every value zero (or the canary in poison mode).
    pub fn new(gpu: Arc<Gpu>, host: KvPool) -> Result<Self> {
        const OP: &str = "DeviceKvPool::new";
        let cfg = host.config().clone();
        if cfg.entry != kvmesh_kernels::KvEntry::KeyValue {
            // The device kernels read a K and a V block per layer.
            return Err(bad(
                OP,
                format!(
                    "the device pool holds key-value entries; this pool's are {} (latent attention runs on the CPU)",
                    cfg.entry.name()
                ),
            ));
        }
        let events = Arc::new(PageEvents::default());
        host.set_observer(events.clone())
            .map_err(|e| bad(OP, e.to_string()))?;
        let page_bytes = Self::page_bytes_of(&cfg);
        let total = cfg
            .n_pages
            .checked_mul(page_bytes)
            .ok_or_else(|| bad(OP, "the pool's size overflows".into()))?;
        u32_of(OP, cfg.n_pages)?;
        u32_of(OP, cfg.n_layers)?;
        let kv = gpu.zeros::<u8>(total)?;
        let gens = gpu.zeros::<u32>(cfg.n_pages)?;
        let wm = gpu.zeros::<u32>(cfg.n_pages * cfg.n_layers)?;
        // Flags 0: cached (not write-combined) pinned memory, since the
        // host reads what the device copies into it.
        // SAFETY: filled by a copy before every read (download_page), or
        // written whole before every copy out of it (upload_page).
        let staging = unsafe {
            gpu.context()
                .alloc_pinned_with_flags::<u8>(page_bytes.max(1), 0)
        }
        .map_err(|e| CudaError::call("cuMemHostAlloc", e))?;
        let mut pool = Self {
            gpu,
            cfg,
            host,
            events,
            kv,
            gens,
            wm,
            staging: Mutex::new(staging),
        };
        if pool.cfg.poison {
            // The host pool starts filled with the canary: so does this.
            let all: Vec<[u32; 3]> = (0..pool.cfg.n_pages as u32)
                .map(|p| [p, 0, FILL_CANARY])
                .collect();
            pool.launch_events(&all)?;
        }
        Ok(pool)
    }

    fn page_bytes_of(cfg: &PoolConfig) -> usize {
        cfg.n_layers * 2 * cfg.page_size * cfg.geometry().kv_dim() * cfg.dtype.size()
    }

    /// The host pool that owns this pool's pages.
    pub fn host(&self) -> &KvPool {
        &self.host
    }

    /// The pool's shape.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Bytes of one page (all layers, K and V).
    pub fn page_bytes(&self) -> usize {
        Self::page_bytes_of(&self.cfg)
    }

    /// Queue the host pool's pending page events on the stream (one
    /// launch). Every step calls this before its first kernel. Returns how
    /// many events were applied.
    pub fn apply_events(&mut self) -> Result<usize> {
        let events = self.events.take();
        self.launch_events(&events)?;
        Ok(events.len())
    }

    fn launch_events(&mut self, events: &[[u32; 3]]) -> Result<()> {
        const OP: &str = "page_events";
        if events.is_empty() {
            return Ok(());
        }
        let flat: Vec<u32> = events.iter().flatten().copied().collect();
        let dev = self.gpu.upload(&flat)?;
        let n = u32_of(OP, events.len())?;
        let (dt, np, nl) = (
            kv_code(self.cfg.dtype),
            self.cfg.n_pages as u32,
            self.cfg.n_layers as u32,
        );
        let page_values = (self.page_bytes() / self.cfg.dtype.size()) as u64;
        // One block per page touched, at most 1024 blocks (each walks the
        // list and applies the pages it owns, `page % grid == block`).
        let blocks = events.len().min(self.cfg.n_pages).clamp(1, 1024) as u32;
        let f = self.gpu.function(OP)?;
        let stream = self.gpu.stream().clone();
        let mut b = stream.launch_builder(f);
        b.arg(&dev)
            .arg(&n)
            .arg(&mut self.gens)
            .arg(&mut self.wm)
            .arg(&mut self.kv)
            .arg(&dt)
            .arg(&np)
            .arg(&nl)
            .arg(&page_values);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every index is checked against n_pages / n_layers /
        // page_values in the kernel; `dev` lives until the stream is done
        // with it (cudarc records its use on the stream).
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::call(OP, e))?;
        Ok(())
    }

    /// Write the K and V rows of `layer` (`[tables.n_rows, kv_dim]` f32,
    /// after RoPE) into each chunk's pages, by the checks of `kv_write` in
    /// `kv.cu`: a chunk whose table, generations or watermark fail writes
    /// nothing and records why in its violation record.
    pub fn write_kv(
        &mut self,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        tables: &mut StepTables,
    ) -> Result<()> {
        const OP: &str = "kv_write";
        let kv_dim = self.cfg.geometry().kv_dim();
        if layer >= self.cfg.n_layers {
            return Err(bad(OP, format!("layer {layer} of {}", self.cfg.n_layers)));
        }
        if k.len() < tables.n_rows * kv_dim || v.len() < tables.n_rows * kv_dim {
            return Err(bad(
                OP,
                format!("k/v hold fewer than {} rows of {kv_dim}", tables.n_rows),
            ));
        }
        if tables.n_chunks == 0 {
            return Ok(());
        }
        let (dt, nc, l, np, nl, ps, kd) = (
            kv_code(self.cfg.dtype),
            u32_of(OP, tables.n_chunks)?,
            layer as u32,
            self.cfg.n_pages as u32,
            self.cfg.n_layers as u32,
            u32_of(OP, self.cfg.page_size)?,
            u32_of(OP, kv_dim)?,
        );
        let f = self.gpu.function(OP)?;
        let stream = self.gpu.stream().clone();
        let mut b = stream.launch_builder(f);
        b.arg(k)
            .arg(v)
            .arg(&mut self.kv)
            .arg(&dt)
            .arg(&self.gens)
            .arg(&mut self.wm)
            .arg(&tables.entries)
            .arg(&tables.row0)
            .arg(&tables.rows)
            .arg(&tables.start)
            .arg(&tables.offsets)
            .arg(&tables.lens)
            .arg(&mut tables.violations)
            .arg(&nc)
            .arg(&l)
            .arg(&np)
            .arg(&nl)
            .arg(&ps)
            .arg(&kd);
        let cfg = LaunchConfig {
            grid_dim: (nc, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: rows and tables were sized by StepTables::new; every
        // page index is checked against n_pages before use.
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::call(OP, e))?;
        Ok(())
    }

    /// Attention of each of the step's rows (`q`: `[n_rows, n_heads *
    /// head_dim]` f32, after RoPE) over its sequence's keys at positions
    /// up to its own, into `out` (same shape). With `call.checked` every
    /// page is checked before it is read (see `attention.cu`); a chunk
    /// that fails gets zeros and its record says why.
    pub fn attention(
        &self,
        call: AttentionCall,
        q: &CudaSlice<f32>,
        tables: &mut StepTables,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        let g = self.cfg.geometry();
        if call.layer >= self.cfg.n_layers
            || call.n_kv_heads != g.n_kv_heads
            || call.head_dim != g.head_dim
            || call.n_kv_heads == 0
            || !call.n_heads.is_multiple_of(call.n_kv_heads)
            || call.head_dim == 0
            || call.head_dim > MAX_HEAD_DIM
        {
            return Err(bad(
                OP,
                format!(
                    "layer {} of {}, {} heads over {} kv heads of {} (pool: {} of {}; head_dim 1 to {MAX_HEAD_DIM})",
                    call.layer, self.cfg.n_layers, call.n_heads, call.n_kv_heads, call.head_dim, g.n_kv_heads, g.head_dim
                ),
            ));
        }
        let width = call.n_heads * call.head_dim;
        if q.len() < tables.n_rows * width || out.len() < tables.n_rows * width {
            return Err(bad(
                OP,
                format!("q/out hold fewer than {} rows of {width}", tables.n_rows),
            ));
        }
        if tables.n_rows == 0 {
            return Ok(());
        }
        let name = if call.checked {
            OP
        } else {
            "paged_attention_unchecked"
        };
        let (dt, np, nl, l, ps, nh, nkv, hd, win) = (
            kv_code(self.cfg.dtype),
            self.cfg.n_pages as u32,
            self.cfg.n_layers as u32,
            call.layer as u32,
            u32_of(OP, self.cfg.page_size)?,
            u32_of(OP, call.n_heads)?,
            u32_of(OP, call.n_kv_heads)?,
            u32_of(OP, call.head_dim)?,
            u32_of(OP, call.window)?,
        );
        let f = self.gpu.function(name)?;
        let stream = self.gpu.stream().clone();
        let mut b = stream.launch_builder(f);
        b.arg(q)
            .arg(out)
            .arg(&tables.tok_chunk)
            .arg(&tables.tok_pos)
            .arg(&tables.entries)
            .arg(&tables.offsets)
            .arg(&tables.lens)
            .arg(&mut tables.violations)
            .arg(&self.kv)
            .arg(&dt)
            .arg(&self.gens)
            .arg(&self.wm)
            .arg(&np)
            .arg(&nl)
            .arg(&l)
            .arg(&ps)
            .arg(&nh)
            .arg(&nkv)
            .arg(&hd)
            .arg(&call.scale)
            .arg(&win);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, tables.n_rows)?, nh, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: shapes checked above; in the checked kernel every page
        // index is range-checked before use. The unchecked kernel trusts
        // the tables (benchmark only, on tables the host built).
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::call(name, e))?;
        Ok(())
    }

    /// A copy of `page`'s bytes (all layers, K then V, the host layout)
    /// through the pinned staging buffer. Waits for the stream.
    pub fn download_page(&self, page: u32) -> Result<Vec<u8>> {
        const OP: &str = "download_page";
        let (at, n) = self.page_range(OP, page)?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        let stream = self.gpu.stream();
        stream
            .memcpy_dtoh(&self.kv.slice(at..at + n), &mut *staging)
            .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
        self.gpu.sync()?;
        let host = staging
            .as_slice()
            .map_err(|e| CudaError::call("cuEventSynchronize", e))?;
        Ok(host[..n].to_vec())
    }

    /// Land `bytes` (a page in the host layout, verified and published on
    /// the host first) in `page`, with `watermarks` (one per layer: the
    /// host page's published watermarks). Queued after the pending page
    /// events, so the page's generation is the one the host verified.
    pub fn upload_page(&mut self, page: u32, bytes: &[u8], watermarks: &[u32]) -> Result<()> {
        const OP: &str = "upload_page";
        let (at, n) = self.page_range(OP, page)?;
        let nl = self.cfg.n_layers;
        if bytes.len() != n || watermarks.len() != nl {
            return Err(bad(
                OP,
                format!(
                    "{} bytes and {} watermarks, want {n} and {nl}",
                    bytes.len(),
                    watermarks.len()
                ),
            ));
        }
        if let Some(w) = watermarks
            .iter()
            .find(|w| **w as usize > self.cfg.page_size)
        {
            return Err(bad(
                OP,
                format!("watermark {w} past the page's {} slots", self.cfg.page_size),
            ));
        }
        self.apply_events()?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        staging
            .as_mut_slice()
            .map_err(|e| CudaError::call("cuEventSynchronize", e))?[..n]
            .copy_from_slice(bytes);
        let stream = self.gpu.stream().clone();
        let mut dst = self.kv.slice_mut(at..at + n);
        stream
            .memcpy_htod(
                &staging
                    .as_slice()
                    .map_err(|e| CudaError::call("cuEventSynchronize", e))?[..n],
                &mut dst,
            )
            .map_err(|e| CudaError::call("cuMemcpyHtoDAsync", e))?;
        let p = page as usize;
        let mut marks = self.wm.slice_mut(p * nl..(p + 1) * nl);
        stream
            .memcpy_htod(watermarks, &mut marks)
            .map_err(|e| CudaError::call("cuMemcpyHtoDAsync", e))?;
        // The staging buffer is reused by the next call: wait for the copy.
        self.gpu.sync()
    }

    fn page_range(&self, op: &'static str, page: u32) -> Result<(usize, usize)> {
        if page as usize >= self.cfg.n_pages {
            return Err(bad(op, format!("page {page} of {}", self.cfg.n_pages)));
        }
        let n = self.page_bytes();
        Ok((page as usize * n, n))
    }

    /// What a chunk's violation record says, decoded against this pool;
    /// a refused read or write is also counted in the host pool's guard
    /// violations (the one alarm metric, whichever side caught it).
    pub fn outcome(&self, record: &crate::table::Violation) -> crate::table::Decoded {
        let d = record.decode(self.cfg.n_pages as u32);
        if let crate::table::Decoded::Guard(g) = &d {
            self.host.report_guard_violation(g);
        }
        d
    }

    /// Every page's generation on the device (low 32 bits). Waits.
    pub fn generations(&self) -> Result<Vec<u32>> {
        self.gpu.download(&self.gens)
    }

    /// Every watermark on the device, `page * n_layers + layer`. Waits.
    pub fn watermarks(&self) -> Result<Vec<u32>> {
        self.gpu.download(&self.wm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_encode_as_the_kernel_reads_them() {
        let e = PageEvents::default();
        e.page_event(PageEvent::Allocated {
            page: 3,
            generation: 1,
            fill: PageFill::Keep,
        });
        e.page_event(PageEvent::Freed {
            page: 3,
            generation: (7u64 << 32) | 2,
            fill: PageFill::Canary,
        });
        e.page_event(PageEvent::Retagged {
            page: 4,
            generation: 5,
        });
        e.page_event(PageEvent::Allocated {
            page: 9,
            generation: 11,
            fill: PageFill::Zero,
        });
        assert_eq!(e.len(), 4);
        assert_eq!(
            e.take(),
            vec![
                [3, 1, FILL_NONE],
                [3, 2, FILL_CANARY],
                [4, 5, EVENT_RETAG],
                [9, 11, FILL_ZERO]
            ]
        );
        assert!(e.is_empty());
    }

    #[test]
    fn a_host_pool_reports_its_allocations_and_releases_in_order() {
        let events = Arc::new(PageEvents::default());
        let cfg = PoolConfig {
            poison: true,
            ..PoolConfig::for_tokens(32, 4, 2, 1, 32)
        };
        let host = KvPool::new(cfg).expect("pool");
        host.set_observer(events.clone()).expect("observer");
        let r = host.reserve(6).expect("reserve");
        let table = r.table().to_vec();
        drop(r);
        let got = events.take();
        let mut want: Vec<[u32; 3]> = table
            .iter()
            .map(|e| [e.page, e.generation as u32, FILL_NONE])
            .collect();
        want.extend(
            table
                .iter()
                .map(|e| [e.page, e.generation as u32 + 1, FILL_CANARY]),
        );
        assert_eq!(got, want);
    }
}
