//! The Llama forward pass on a CUDA device: the engine's CUDA backend.
//!
//! Same contract as [`crate::llama::Llama::forward_observed`]: a batch of
//! chunks in, per chunk its logits rows (or its own error) out, each
//! chunk's K/V written into its reservation's pages. The CPU runtime stays
//! the oracle (`cuda/tests/device.rs`, `model/tests/cuda.rs` compare the two).
//!
//! # KV and its checks
//! The engine's KV pool is a [`DeviceKvPool`]: the host pool keeps owners,
//! leases, generations and watermarks; the device mirrors generations and
//! watermarks through the host pool's page events, and the `kv_write` and
//! paged-attention kernels check them (I1, I2) before any write or read.
//! After each pass, every K/V row the device wrote is also written into the
//! host pool through `Reservation::write`, so the host pool holds the
//! same values under the same watermarks: a prefill node ships from it
//! (`Engine::prompt_kv`, the transports, unchanged), a decode node's
//! adoption and the prefix cache read it, and the host's own checks keep
//! running. Cost: one device-to-host copy of the pass's K/V (what the
//! transports ship anyway on a prefill node; `2 * rows * kv_dim * 4` bytes
//! per layer on a decode node) into pinned memory, queued per layer and
//! waited for once per pass. A chunk whose device record or host write
//! fails is failed as on the CPU path; its output is never used.
//!
//! # Weights
//! Dense (f32, the exact mode) weights run through cuBLAS SGEMM; GGUF
//! blocks are dequantized on the device to f16 once at load and run through
//! cuBLAS GemmEx (f16 in, f32 accumulation). Q, K and V are three GEMMs;
//! gate and up are one, stacked. The host keeps its copy of the weights
//! (the CPU runtime beside this one, used for metadata and as the oracle):
//! a later step drops it for device-only engines.

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use kvmesh_cuda::cudarc::driver::{CudaSlice, PinnedHostSlice};

use kvmesh_cuda::gpu::Gpu;
use kvmesh_cuda::ops::{self, ChunkSpec, StepTables, WeightDtype};
use kvmesh_cuda::pool::{AttentionCall, DeviceKvPool};
use kvmesh_cuda::table::Decoded;
use kvmesh_cuda::CudaError;
use kvmesh_kernels::rope::{Rope, RopeLayout};
use kvmesh_kvpool::PoolError;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::llama::{ChunkOut, ChunkResult, LayerDone, LogitsWanted, SeqChunk, SCORE_ROWS};
use crate::sampling::prompt_logprob;
use crate::weights::Weights;

mod refuse;
#[cfg(test)]
mod tests;
mod weights;
use refuse::refuse_unimplemented;
use weights::{upload_stacked, upload_vec, DevLayer, DevMatrix};

/// Activation buffers, grown to the largest pass so far.
#[derive(Default)]
struct Buffers {
    rows: usize,
    x: Option<CudaSlice<f32>>,
    xn: Option<CudaSlice<f32>>,
    q: Option<CudaSlice<f32>>,
    k: Option<CudaSlice<f32>>,
    v: Option<CudaSlice<f32>>,
    attn: Option<CudaSlice<f32>>,
    o: Option<CudaSlice<f32>>,
    gate_up: Option<CudaSlice<f32>>,
    h: Option<CudaSlice<f32>>,
    half: Option<CudaSlice<u16>>,
    /// [`SCORE_ROWS`] rows of hidden states, and their logits.
    sel: Option<CudaSlice<f32>>,
    logits: Option<CudaSlice<f32>>,
}

/// What one pass holds exclusively: the device pool and the buffers.
struct State {
    pool: DeviceKvPool,
    buf: Buffers,
    /// Each layer's K then V rows, copied back for the host mirror.
    pinned: Option<PinnedHostSlice<f32>>,
}

/// A model on a CUDA device.
pub struct CudaLlama {
    gpu: Arc<Gpu>,
    cfg: ModelConfig,
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: DevMatrix,
    inv_freq: CudaSlice<f32>,
    label: String,
    state: Mutex<State>,
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama")
            .field("device", self.gpu.info())
            .field("weight_bytes", &self.weight_bytes())
            .finish_non_exhaustive()
    }
}

fn take(b: &mut Option<CudaSlice<f32>>) -> Result<&mut CudaSlice<f32>> {
    b.as_mut().ok_or_else(|| ModelError::Compute {
        detail: "device buffer not allocated".into(),
    })
}

impl CudaLlama {
    /// Upload `w` to `pool`'s device. `pool` is the engine's KV pool (its
    /// host side is the engine's [`kvmesh_kvpool::KvPool`]).
    pub fn new(
        cfg: &ModelConfig,
        w: &Weights,
        pool: DeviceKvPool,
        dense: WeightDtype,
    ) -> Result<Self> {
        let gpu = pool.gpu().clone();
        let c = pool.config();
        if (c.n_layers, c.n_kv_heads, c.head_dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim) {
            return Err(ModelError::Compute {
                detail: "the device pool's shape is not the model's KV shape".into(),
            });
        }
        refuse_unimplemented(cfg)?;
        if cfg.head_dim > ops::MAX_HEAD_DIM || !cfg.head_dim.is_multiple_of(2) {
            return Err(ModelError::Device(CudaError::Unsupported(format!(
                "head_dim {} (the CUDA kernels take even head sizes up to {})",
                cfg.head_dim,
                ops::MAX_HEAD_DIM
            ))));
        }
        // Read by rows (the embedding kernel takes f32, f16 and bf16).
        let embed = upload_stacked(&gpu, &[&w.embed], dense)?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            // refuse_unimplemented turned every mixture away before this.
            let mlp = l.ffn.dense().ok_or_else(|| ModelError::Compute {
                detail: "a mixture-of-experts layer reached the CUDA upload".into(),
            })?;
            // ... and every latent attention.
            let a = l.attn.gqa().ok_or_else(|| ModelError::Compute {
                detail: "a latent attention layer reached the CUDA upload".into(),
            })?;
            let opt = |b: &Option<Vec<f32>>| b.as_deref().map(|b| upload_vec(&gpu, b)).transpose();
            layers.push(DevLayer {
                attn_norm: upload_vec(&gpu, &l.attn_norm)?,
                wq: upload_stacked(&gpu, &[&a.wq], dense)?,
                wk: upload_stacked(&gpu, &[&a.wk], dense)?,
                wv: upload_stacked(&gpu, &[&a.wv], dense)?,
                bq: opt(&a.bq)?,
                bk: opt(&a.bk)?,
                bv: opt(&a.bv)?,
                wo: upload_stacked(&gpu, &[&l.wo], dense)?,
                mlp_norm: upload_vec(&gpu, &l.mlp_norm)?,
                gate_up: upload_stacked(&gpu, &[&mlp.gate, &mlp.up], dense)?,
                down: upload_stacked(&gpu, &[&mlp.down], dense)?,
            });
        }
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            RopeLayout::RotateHalf,
        );
        let model = Self {
            embed,
            layers,
            final_norm: upload_vec(&gpu, &w.final_norm)?,
            lm_head: upload_stacked(&gpu, &[&w.lm_head], dense)?,
            inv_freq: upload_vec(&gpu, rope.inv_freq())?,
            cfg: cfg.clone(),
            label: gpu.info().spec.to_string(),
            state: Mutex::new(State {
                pool,
                buf: Buffers::default(),
                pinned: None,
            }),
            gpu,
        };
        model.gpu.sync()?;
        tracing::info!(
            device = %model.gpu.info().spec,
            name = %model.gpu.info().name,
            weight_mib = model.weight_bytes() >> 20,
            "model on the device"
        );
        Ok(model)
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `cuda:N`, for load reports and logs.
    pub fn device_label(&self) -> &str {
        &self.label
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.embed.bytes()
            + self.lm_head.bytes()
            + self
                .layers
                .iter()
                .map(|l| {
                    l.wq.bytes()
                        + l.wk.bytes()
                        + l.wv.bytes()
                        + l.wo.bytes()
                        + l.gate_up.bytes()
                        + l.down.bytes()
                })
                .sum::<usize>()
    }

    fn grow(&self, buf: &mut Buffers, rows: usize) -> Result<()> {
        if rows <= buf.rows && buf.x.is_some() {
            return Ok(());
        }
        let cfg = &self.cfg;
        let rows = rows.max(buf.rows).next_power_of_two();
        let (q_dim, kv_dim) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        let widest_in = cfg.hidden_size.max(q_dim).max(cfg.intermediate_size);
        let g = &self.gpu;
        buf.x = Some(g.zeros(rows * cfg.hidden_size)?);
        buf.xn = Some(g.zeros(rows * cfg.hidden_size)?);
        buf.q = Some(g.zeros(rows * q_dim)?);
        buf.k = Some(g.zeros(rows * kv_dim)?);
        buf.v = Some(g.zeros(rows * kv_dim)?);
        buf.attn = Some(g.zeros(rows * q_dim)?);
        buf.o = Some(g.zeros(rows * cfg.hidden_size)?);
        buf.gate_up = Some(g.zeros(rows * 2 * cfg.intermediate_size)?);
        buf.h = Some(g.zeros(rows * cfg.intermediate_size)?);
        buf.half = Some(g.zeros(rows * widest_in)?);
        if buf.logits.is_none() {
            buf.sel = Some(g.zeros(SCORE_ROWS * cfg.hidden_size)?);
            buf.logits = Some(g.zeros(SCORE_ROWS * cfg.vocab_size)?);
        }
        buf.rows = rows;
        Ok(())
    }

    /// Run a batch (see the module docs and [`crate::llama::Llama::forward_observed`]).
    /// `layer_done` is called for every layer of every chunk that did not
    /// fail, after the pass, once the host mirror holds the layer.
    pub fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        layer_done: &mut LayerDone<'_>,
    ) -> Result<Vec<ChunkResult>> {
        use kvmesh_kernels::PagedKv;
        let cfg = &self.cfg;
        for chunk in batch.iter() {
            if let Some(&bad) = chunk.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::InvalidField {
                    path: "<request>".into(),
                    field: "token id".into(),
                    value: bad.to_string(),
                    reason: format!("the vocabulary has {} tokens", cfg.vocab_size),
                });
            }
        }
        // I1's owner half, on the host: every entry of every table is held
        // by the chunk's reservation (or a cache page it leases) at the
        // generation the table names. The device then checks that the
        // generation is still that one when it reads or writes, and a page
        // changes owner only with a new generation, so the pair is the CPU
        // reader's check. A chunk that fails leaves the batch here.
        let mut failed: Vec<Option<ModelError>> = batch
            .iter()
            .map(|c| {
                let reader = c.kv.reader();
                c.kv.table()
                    .iter()
                    .find_map(|e| reader.read_page(*e, 0, 0).err())
                    .map(ModelError::Guard)
            })
            .collect();
        let mut ids = Vec::new();
        let mut spans: Vec<Range<usize>> = Vec::with_capacity(batch.len());
        // The device's chunk index of each batch chunk that runs.
        let mut slot: Vec<Option<usize>> = Vec::with_capacity(batch.len());
        let mut specs: Vec<ChunkSpec> = Vec::new();
        for (i, chunk) in batch.iter().enumerate() {
            if failed[i].is_some() || chunk.tokens.is_empty() {
                spans.push(ids.len()..ids.len());
                slot.push(None);
                continue;
            }
            spans.push(ids.len()..ids.len() + chunk.tokens.len());
            ids.extend_from_slice(chunk.tokens);
            slot.push(Some(specs.len()));
            specs.push(ChunkSpec {
                table: chunk.kv.table().to_vec(),
                start: chunk.start_pos,
                rows: chunk.tokens.len(),
                cached: chunk.kv.cached_tokens(),
            });
        }
        let rows = ids.len();
        if rows == 0 {
            return Ok(failed
                .into_iter()
                .map(|f| f.map_or_else(|| Ok(ChunkOut::default()), Err))
                .collect());
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let st = &mut *st;
        let gpu = &*self.gpu;
        st.pool.apply_events()?;
        let mut tables = StepTables::new(gpu, &specs)?;
        self.grow(&mut st.buf, rows)?;
        let (q_dim, kv_dim) = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim);
        let n_layers = self.layers.len();
        let mirror = n_layers * 2 * rows * kv_dim;
        if st.pinned.as_ref().is_none_or(|p| p.len() < mirror) {
            // SAFETY: every value read back is first written by the
            // device-to-host copies below (waited for before reading).
            st.pinned = Some(
                unsafe {
                    gpu.context()
                        .alloc_pinned_with_flags::<f32>(mirror.next_power_of_two(), 0)
                }
                .map_err(|e| CudaError::call("cuMemHostAlloc", e))?,
            );
        }
        let ids_d = gpu.upload(&ids)?;
        let Buffers {
            x,
            xn,
            q,
            k,
            v,
            attn,
            o,
            gate_up,
            h,
            half,
            sel,
            logits: logits_d,
            ..
        } = &mut st.buf;
        let (x, xn, q, k, v, attn, o, gate_up, h) = (
            take(x)?,
            take(xn)?,
            take(q)?,
            take(k)?,
            take(v)?,
            take(attn)?,
            take(o)?,
            take(gate_up)?,
            take(h)?,
        );
        let half = half.as_mut().ok_or_else(|| ModelError::Compute {
            detail: "no scratch".into(),
        })?;
        let hidden = cfg.hidden_size;
        self.embed_rows(&ids_d, rows, x)?;
        let pinned = st.pinned.as_mut().ok_or_else(|| ModelError::Compute {
            detail: "no pinned buffer".into(),
        })?;
        // Waits for the previous pass's copies (already read), then the raw
        // pointer the copies below write through.
        let base = pinned
            .as_mut_ptr()
            .map_err(|e| CudaError::call("cuEventSynchronize", e))?;
        for (layer, lw) in self.layers.iter().enumerate() {
            ops::rms_norm(gpu, x, &lw.attn_norm, rows, hidden, cfg.rms_norm_eps, xn)?;
            lw.wq.apply(gpu, xn, rows, half, q)?;
            lw.wk.apply(gpu, xn, rows, half, k)?;
            lw.wv.apply(gpu, xn, rows, half, v)?;
            if let Some(b) = &lw.bq {
                ops::add_bias(gpu, q, b, rows, q_dim)?;
            }
            if let Some(b) = &lw.bk {
                ops::add_bias(gpu, k, b, rows, kv_dim)?;
            }
            if let Some(b) = &lw.bv {
                ops::add_bias(gpu, v, b, rows, kv_dim)?;
            }
            ops::rope(
                gpu,
                q,
                &tables.tok_pos,
                &self.inv_freq,
                rows,
                cfg.n_heads,
                cfg.head_dim,
                false,
            )?;
            ops::rope(
                gpu,
                k,
                &tables.tok_pos,
                &self.inv_freq,
                rows,
                cfg.n_kv_heads,
                cfg.head_dim,
                false,
            )?;
            st.pool.write_kv(layer, k, v, &mut tables)?;
            // K then V of this layer into the pinned mirror buffer (queued).
            let at = layer * 2 * rows * kv_dim;
            let n = rows * kv_dim;
            // SAFETY: `pinned` holds n_layers * 2 * rows * kv_dim values
            // and is read only after the `sync` below.
            unsafe {
                copy_back(gpu, k, n, base, at)?;
                copy_back(gpu, v, n, base, at + n)?;
            }
            let call = AttentionCall {
                layer,
                n_heads: cfg.n_heads,
                n_kv_heads: cfg.n_kv_heads,
                head_dim: cfg.head_dim,
                scale: 1.0 / (cfg.head_dim as f32).sqrt(),
                window: cfg.sliding_window.unwrap_or(0),
                checked: true,
            };
            st.pool.attention(call, q, &mut tables, attn)?;
            lw.wo.apply(gpu, attn, rows, half, o)?;
            ops::add_into(gpu, x, o, rows * hidden)?;
            ops::rms_norm(gpu, x, &lw.mlp_norm, rows, hidden, cfg.rms_norm_eps, xn)?;
            lw.gate_up.apply(gpu, xn, rows, half, gate_up)?;
            ops::swiglu(gpu, gate_up, rows, cfg.intermediate_size, h)?;
            lw.down.apply(gpu, h, rows, half, o)?;
            ops::add_into(gpu, x, o, rows * hidden)?;
        }

        // Which rows get logits.
        let mut want: Vec<u32> = Vec::new();
        for (chunk, span) in batch.iter().zip(&spans) {
            if span.is_empty() {
                continue;
            }
            match chunk.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => want.push(span.end as u32 - 1),
                LogitsWanted::All | LogitsWanted::Prompt { .. } => {
                    want.extend(span.start as u32..span.end as u32)
                }
            }
        }
        let logits = self.logits_of(x, &want, xn, half, take(sel)?, take(logits_d)?)?;

        // One wait for the pass: records, mirror, logits.
        gpu.sync()?;
        let records = tables.violations(gpu)?;
        // SAFETY: the copies into it are done (synchronized above).
        let mirror =
            unsafe { std::slice::from_raw_parts(base.cast_const(), n_layers * 2 * rows * kv_dim) };
        for (i, s) in slot.iter().enumerate() {
            if let Some(r) = s.and_then(|s| records.get(s)) {
                failed[i] = chunk_error(st.pool.outcome(r));
            }
        }
        // The host mirror, layer by layer, then the observer.
        for layer in 0..n_layers {
            let at = layer * 2 * rows * kv_dim;
            for (i, chunk) in batch.iter_mut().enumerate() {
                if failed[i].is_some() || slot[i].is_none() {
                    continue;
                }
                let s = &spans[i];
                let ks = &mirror[at + s.start * kv_dim..at + s.end * kv_dim];
                let vs = &mirror
                    [at + rows * kv_dim + s.start * kv_dim..at + rows * kv_dim + s.end * kv_dim];
                if let Err(e) = chunk.kv.write(layer, chunk.start_pos, ks, vs) {
                    failed[i] = Some(e.into());
                }
            }
            for (i, chunk) in batch.iter().enumerate() {
                if failed[i].is_none() && slot[i].is_some() {
                    layer_done(layer, i, chunk);
                }
            }
        }

        let vocab = cfg.vocab_size;
        let mut row_of = want.iter().zip(logits.chunks_exact(vocab.max(1)));
        let mut results = Vec::with_capacity(batch.len());
        for (i, chunk) in batch.iter().enumerate() {
            let span = &spans[i];
            let n = match chunk.logits {
                _ if span.is_empty() => 0,
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All | LogitsWanted::Prompt { .. } => span.len(),
            };
            let mine: Vec<&[f32]> = (0..n)
                .filter_map(|_| row_of.next().map(|(_, r)| r))
                .collect();
            if let Some(e) = failed[i].take() {
                results.push(Err(e));
                continue;
            }
            results.push(Ok(match chunk.logits {
                LogitsWanted::Prompt { top } => ChunkOut {
                    logits: mine.last().map(|r| r.to_vec()).into_iter().collect(),
                    prompt: mine
                        .iter()
                        .zip(chunk.tokens.iter().skip(1))
                        .map(|(row, &next)| prompt_logprob(row, next, top))
                        .collect(),
                },
                _ => ChunkOut {
                    logits: mine.iter().map(|r| r.to_vec()).collect(),
                    prompt: Vec::new(),
                },
            }));
        }
        Ok(results)
    }

    /// Write positions `start..start + n` of `layer` (K and V, `n *
    /// kv_dim` values each, read from the host pool's checked reader) into
    /// `table`'s pages on the device, through the checked `kv_write`: how a
    /// decode node's adopted prompt, which landed and was verified in the
    /// host pool, reaches the device. `start` is the reservation's cached
    /// head (pages shared through the prefix cache, already on the device
    /// and never written again).
    pub fn load_prompt(
        &self,
        table: &[kvmesh_kernels::PageRef],
        start: usize,
        n: usize,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let gpu = &*self.gpu;
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.pool.apply_events()?;
        let spec = ChunkSpec {
            table: table.to_vec(),
            start,
            rows: n,
            // The head below `start` is the shared one.
            cached: start,
        };
        let mut tables = StepTables::new(gpu, &[spec])?;
        st.pool
            .write_kv(layer, &gpu.upload(k)?, &gpu.upload(v)?, &mut tables)?;
        match tables
            .violations(gpu)?
            .first()
            .and_then(|r| chunk_error(st.pool.outcome(r)))
        {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// [`Self::forward_observed`] without an observer.
    pub fn forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Vec<ChunkResult>> {
        self.forward_observed(batch, &mut |_, _, _| {})
    }

    fn embed_rows(&self, ids: &CudaSlice<u32>, rows: usize, x: &mut CudaSlice<f32>) -> Result<()> {
        let cfg = &self.cfg;
        match &self.embed {
            DevMatrix::F32 { w, .. } => ops::embedding(
                &self.gpu,
                w,
                WeightDtype::F32,
                ids,
                rows,
                cfg.vocab_size,
                cfg.hidden_size,
                x,
            )?,
            DevMatrix::Half { w, dtype, .. } => ops::embedding(
                &self.gpu,
                w,
                *dtype,
                ids,
                rows,
                cfg.vocab_size,
                cfg.hidden_size,
                x,
            )?,
        }
        Ok(())
    }

    /// Final norm and vocabulary projection of rows `want` of `x`,
    /// [`SCORE_ROWS`] rows at a time (device memory stays `SCORE_ROWS x
    /// vocab` floats whatever the prompt), copied to the host.
    fn logits_of(
        &self,
        x: &CudaSlice<f32>,
        want: &[u32],
        xn: &mut CudaSlice<f32>,
        half: &mut CudaSlice<u16>,
        sel: &mut CudaSlice<f32>,
        logits: &mut CudaSlice<f32>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let gpu = &*self.gpu;
        let (hidden, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let mut out = Vec::with_capacity(want.len() * vocab);
        if want.is_empty() {
            return Ok(out);
        }
        for rows in want.chunks(SCORE_ROWS) {
            let idx = gpu.upload(rows)?;
            ops::gather_rows(gpu, x, &idx, rows.len(), hidden, sel)?;
            ops::rms_norm(
                gpu,
                sel,
                &self.final_norm,
                rows.len(),
                hidden,
                cfg.rms_norm_eps,
                xn,
            )?;
            self.lm_head.apply(gpu, xn, rows.len(), half, logits)?;
            out.extend(gpu.download(&logits.slice(..rows.len() * vocab))?);
        }
        debug_assert_eq!(self.lm_head.rows(), vocab);
        Ok(out)
    }
}

/// A chunk's decoded violation record as the error that fails it (the
/// errors the CPU pool gives for the same refusals), or `None` if clean.
fn chunk_error(d: Decoded) -> Option<ModelError> {
    match d {
        Decoded::Clean => None,
        Decoded::Guard(g) => Some(ModelError::Guard(g)),
        Decoded::WriteGap {
            page,
            layer,
            slot,
            watermark,
        } => Some(ModelError::Kv(PoolError::WriteGap {
            page,
            layer,
            slot,
            watermark,
        })),
        Decoded::SharedPage { position, cached } => {
            Some(ModelError::Kv(PoolError::SharedPage { position, cached }))
        }
        Decoded::Unknown { raw } => Some(ModelError::Compute {
            detail: format!("the device wrote an unknown violation record {raw:?}"),
        }),
    }
}

/// Queue a copy of the first `n` values of `d` to `base + at`.
///
/// # Safety
/// `base` points to pinned host memory of at least `at + n` values that
/// stays allocated, and is neither read nor written, until the stream has
/// been synchronized.
unsafe fn copy_back(
    gpu: &Gpu,
    d: &CudaSlice<f32>,
    n: usize,
    base: *mut f32,
    at: usize,
) -> Result<()> {
    use kvmesh_cuda::cudarc::driver::DevicePtr;
    let (src, _read) = d.device_ptr(gpu.stream());
    // SAFETY: the caller's contract.
    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), n) };
    // SAFETY: `src` holds at least `n` values (the caller sized `d`).
    unsafe {
        kvmesh_cuda::cudarc::driver::result::memcpy_dtoh_async(dst, src, gpu.stream().cu_stream())
    }
    .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
    Ok(())
}
