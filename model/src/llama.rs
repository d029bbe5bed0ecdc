//! The one decoder forward pass over the paged, ownership-checked KV pool,
//! for every family of [`crate::arch`] (their differences are the
//! [`crate::arch::Block`] switches and each layer's attention window and
//! rope).
//!
//! One call runs a batch of sequence chunks together: all their tokens go
//! through each projection as one matrix (so a batched decode step reads
//! every weight once), while attention runs per sequence through
//! [`kvmesh_kernels::paged_attention`], which checks I1 and I2 on every page
//! it reads. A guard violation fails only the sequence it happened in: its
//! rows are zeroed from then on and its result is the error, the other
//! sequences of the batch complete normally.
//!
//! Exact mode: weights are f32 (dequantized at load), activations f32, the
//! same arithmetic as the Hugging Face reference up to summation order.
//! Quantized mode: GGUF block matrices (every `QFormat`) run through the block kernels
//! (`kvmesh_kernels::quant`) with f32 activations; norms, RoPE, attention
//! and the residual stream are f32 as in the exact mode. In both modes a row's result does not
//! depend on the other rows of the batch, so batched decode, chunked prefill
//! and the disaggregated mesh all equal the reference engine token for token.
//!
//! Cost per call with `T` tokens in the batch: one `[T, hidden] x [hidden, out]`
//! matmul per projection, attention linear in each sequence's context, and the
//! vocabulary projection only for the rows whose logits were asked for.

use kvmesh_kernels::norm::rms_norm;
use kvmesh_kernels::rope::{Rope, RopeLayout};
use kvmesh_kernels::{paged_attention, AttentionShape, KvGeometry};
use kvmesh_kvpool::{PoolConfig, Reservation};
use rayon::prelude::*;

use crate::arch::LayerType;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::Projection;
use crate::moe::{MlpRt, MoeRt};
use crate::sampling::{prompt_logprob, PromptLogprob};
use crate::weights::{Ffn, Matrix, Weights};

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prompt chunk that is not the last).
    None,
    /// The last token's logits.
    Last,
    /// Every token's logits (scoring, tests).
    All,
    /// The last token's logits (as [`Self::Last`]), and for every earlier
    /// token of the chunk the [`PromptLogprob`] of the token after it,
    /// with this many alternatives: prompt logprobs. The vocabulary
    /// projection runs over [`SCORE_ROWS`] positions at a time and keeps
    /// only the scores, so memory stays `SCORE_ROWS x vocab` floats
    /// whatever the prompt's length.
    Prompt {
        /// Alternatives per position (at most `MAX_TOP_LOGPROBS`).
        top: usize,
    },
}

/// Positions whose logits one block of prompt scoring holds at once
/// ([`LogitsWanted::Prompt`]): 32 x 49,152 f32 is 6 MiB for SmolLM2, where
/// a 512-token prompt's whole logits matrix would be 100 MiB.
pub const SCORE_ROWS: usize = 32;

/// One sequence's share of a batched forward call: `tokens` at positions
/// `start_pos..start_pos + tokens.len()`, whose K/V are written into `kv`.
#[derive(Debug)]
pub struct SeqChunk<'a> {
    /// Token ids to run.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; every earlier position must already be in `kv`.
    pub start_pos: usize,
    /// The sequence's pages.
    pub kv: &'a mut Reservation,
    /// Which logits to return.
    pub logits: LogitsWanted,
}

/// What [`Llama::forward_observed`] calls as each layer of a chunk is done
/// (`layer, chunk index, chunk`). `Send`: the pass runs on a pool thread.
pub type LayerDone<'a> = dyn FnMut(usize, usize, &SeqChunk<'_>) + Send + 'a;

/// A chunk's outcome: its logits rows and prompt scores, or why it failed.
pub type ChunkResult = Result<ChunkOut>;

/// What a chunk gets back from a forward pass.
#[derive(Clone, Debug, Default)]
pub struct ChunkOut {
    /// The logits rows asked for (`vocab_size` each).
    pub logits: Vec<Vec<f32>>,
    /// With [`LogitsWanted::Prompt`]: position `i`'s score of token
    /// `i + 1` of the chunk, for every position but the last; else empty.
    pub prompt: Vec<PromptLogprob>,
}

/// One layer's projections as the forward pass runs them.
#[derive(Debug)]
struct LayerRt {
    attn_norm: Vec<f32>,
    attn: AttnRt,
    wo: Projection,
    bo: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    mlp_norm: Vec<f32>,
    ffn: FfnRt,
    post_mlp_norm: Option<Vec<f32>>,
    /// This layer's attention (its window) and rope (index into `ropes`).
    shape: AttentionShape,
    rope: usize,
}

/// The MLP slot as the pass runs it.
#[derive(Debug)]
enum FfnRt {
    Dense(MlpRt),
    Moe(Box<MoeRt>),
}

impl FfnRt {
    fn is_quantized(&self) -> bool {
        match self {
            Self::Dense(m) => m.projections().iter().any(|p| p.is_quantized()),
            Self::Moe(m) => m.is_quantized(),
        }
    }

    /// `(bytes, multiply-adds)` of weights one token reads.
    fn active_per_token(&self) -> (usize, usize) {
        match self {
            Self::Dense(m) => m.projections().iter().fold((0, 0), |(b, p), pr| {
                (b + pr.weight_bytes(), p + pr.params())
            }),
            Self::Moe(m) => m.active_per_token(),
        }
    }
}

/// A loaded Llama-family model ready to run.
pub struct Llama {
    cfg: ModelConfig,
    embed: Matrix,
    layers: Vec<LayerRt>,
    final_norm: Vec<f32>,
    lm_head: Projection,
    /// The global rope, then the local one where the family has one.
    ropes: Vec<Rope>,
    quantized: bool,
    /// Activation buffers of finished passes, taken by the next one (see
    /// [`Workspace`]): one per pass that ran at the same time, so a model
    /// driven by one compute thread holds one, whichever pool threads ran
    /// its passes.
    workspaces: std::sync::Mutex<Vec<Workspace>>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("config", &self.cfg)
            .field("quantized", &self.quantized)
            .finish_non_exhaustive()
    }
}

fn compute(e: candle_core::Error) -> ModelError {
    ModelError::Compute {
        detail: e.to_string(),
    }
}

impl Llama {
    /// Build the runtime from loaded weights: f32 matrices run dense
    /// (exact mode), quantized ones through the block kernels, with Q/K/V
    /// and gate/up stacked into one pass each.
    pub fn new(cfg: ModelConfig, w: Weights) -> Result<Self> {
        let mut ropes = vec![Rope::partial(
            cfg.head_dim,
            cfg.rotary_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            RopeLayout::RotateHalf,
        )];
        if let Some(theta) = cfg.local_rope_theta {
            ropes.push(Rope::partial(
                cfg.head_dim,
                cfg.rotary_dim,
                theta,
                kvmesh_kernels::rope::RopeScaling::None,
                RopeLayout::RotateHalf,
            ));
        }
        let mut layers = Vec::with_capacity(w.layers.len());
        for (l, kind) in w.layers.into_iter().zip(&cfg.layer_types) {
            let sliding = *kind == LayerType::Sliding;
            let ffn = match (&l.ffn, &cfg.moe) {
                (Ffn::Dense(m), _) => FfnRt::Dense(MlpRt::new(m)?),
                (Ffn::Moe(m), Some(moe)) => FfnRt::Moe(Box::new(MoeRt::new(m, moe)?)),
                (Ffn::Moe(_), None) => {
                    return Err(ModelError::Compute {
                        detail: "expert weights for a configuration without experts".into(),
                    })
                }
            };
            // What the kernel attends with: the query head and its value
            // (latent attention: the latent entry and its latent part).
            let (head_dim, v_dim) = match &cfg.mla {
                Some(m) => (m.entry_dim(), m.kv_lora_rank),
                None => (cfg.head_dim, cfg.head_dim),
            };
            layers.push(LayerRt {
                attn: AttnRt::new(l.attn, &cfg)?,
                wo: Projection::new(&[&l.wo])?,
                ffn,
                attn_norm: l.attn_norm,
                mlp_norm: l.mlp_norm,
                bo: l.bo,
                post_attn_norm: l.post_attn_norm,
                post_mlp_norm: l.post_mlp_norm,
                shape: AttentionShape {
                    n_heads: cfg.n_heads,
                    n_kv_heads: cfg.n_kv_heads,
                    head_dim,
                    v_dim,
                    scale: cfg.block.attn_scale,
                    window: if sliding { cfg.sliding_window } else { None },
                    softcap: cfg.block.attn_softcap,
                    sinks: l.sinks.map(Into::into),
                },
                rope: usize::from(sliding && ropes.len() > 1),
            });
            // This layer's loaded blocks are free now (their copies are in
            // huge pages): back to the OS before the next layer's copies.
            kvmesh_kernels::huge::trim();
        }
        let (lm_head, embed) = crate::linear::head_and_embedding(&w.lm_head, w.embed)?;
        let quantized = lm_head.is_quantized()
            || layers
                .iter()
                .any(|l| l.attn.is_quantized() || l.ffn.is_quantized());
        Ok(Self {
            cfg,
            embed,
            layers,
            final_norm: w.final_norm,
            lm_head,
            ropes,
            quantized,
            workspaces: std::sync::Mutex::default(),
        })
    }

    /// `(bytes, multiply-adds)` of the weights one token passes through:
    /// each layer's attention projections and MLP slot (a mixture's router,
    /// shared expert and `top_k` experts), then the vocabulary's.
    fn active_per_token(&self) -> (usize, usize) {
        let one = |p: &Projection| (p.weight_bytes(), p.params());
        let add = |(a, b): (usize, usize), (c, d): (usize, usize)| (a + c, b + d);
        self.layers
            .iter()
            .map(|l| {
                add(
                    add(l.attn.active_per_token(), one(&l.wo)),
                    l.ffn.active_per_token(),
                )
            })
            .fold(one(&self.lm_head), add)
    }

    /// Bytes of weights a token's forward pass reads (the embedding lookup
    /// and the norms are left out): what a batch-1 decode step streams
    /// from memory. For a mixture, the chosen experts' (`top_k` of average
    /// size) only.
    pub fn weight_bytes(&self) -> usize {
        self.active_per_token().0
    }

    /// Multiply-adds per token through the projections (attention's are
    /// left out): twice this is a decode token's floating-point operations.
    pub fn matmul_params(&self) -> usize {
        self.active_per_token().1
    }

    /// Multiply-adds through the projections of a `tokens`-token prompt's
    /// prefill: every layer's for each token, the vocabulary's once (a
    /// prefill computes the last position's logits only). Counting the
    /// vocabulary per token, as [`Self::matmul_params`] times the tokens
    /// would, overstates a prefill's rate by the vocabulary's share of the
    /// weights: 21% on SmolLM2-135M, 63% on Gemma 3 270M.
    pub fn prefill_matmul_params(&self, tokens: usize) -> usize {
        let vocab = self.lm_head.params();
        let layers = self.matmul_params() - vocab;
        layers * tokens + if tokens > 0 { vocab } else { 0 }
    }

    /// Whether any matrix runs through the quantized kernels.
    pub fn is_quantized(&self) -> bool {
        self.quantized
    }

    /// `exact-f32`, or `quantized-` and the CPU kernel path this process
    /// runs (`avx512`, `avx2`, `portable`; [`kvmesh_kernels::cpu::path`]):
    /// for logs and benchmark output.
    pub fn mode(&self) -> String {
        if self.quantized {
            format!("quantized-{}", kvmesh_kernels::cpu::path().name())
        } else {
            "exact-f32".to_owned()
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The KV page shape this model needs.
    pub fn kv_geometry(&self, page_size: usize) -> KvGeometry {
        self.pool_config(0, page_size).geometry()
    }

    /// A pool configuration for `kv_pool_tokens` token slots of this model.
    pub fn pool_config(&self, kv_pool_tokens: usize, page_size: usize) -> PoolConfig {
        self.cfg.pool_config(kv_pool_tokens, page_size)
    }

    /// Run a batch of chunks. The outer `Err` is a failure of the whole call
    /// (bad input that names no single sequence, or a compute error); a guard
    /// violation or a KV write error fails only its own chunk.
    pub fn forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Vec<ChunkResult>> {
        self.forward_observed(batch, &mut |_, _, _| {})
    }

    /// [`Self::forward`], calling `layer_done(layer, i, &batch[i])` as soon
    /// as chunk `i`'s K/V of `layer` are in its pages (for each chunk that
    /// has not failed): a prefill node ships each layer while the next ones
    /// compute.
    pub fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        layer_done: &mut LayerDone<'_>,
    ) -> Result<Vec<ChunkResult>> {
        let cfg = &self.cfg;
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(batch.len());
        for chunk in batch.iter() {
            if let Some(&bad) = chunk.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::InvalidField {
                    path: "<request>".into(),
                    field: "token id".into(),
                    value: bad.to_string(),
                    reason: format!("the vocabulary has {} tokens", cfg.vocab_size),
                });
            }
            spans.push(ids.len()..ids.len() + chunk.tokens.len());
            ids.extend_from_slice(chunk.tokens);
        }
        let rows = ids.len();
        let mut failed: Vec<Option<ModelError>> = batch.iter().map(|_| None).collect();
        if rows == 0 {
            return Ok(batch.iter().map(|_| Ok(ChunkOut::default())).collect());
        }
        let positions: Vec<usize> = batch
            .iter()
            .flat_map(|c| c.start_pos..c.start_pos + c.tokens.len())
            .collect();

        // Buffers of an earlier pass of this model (grown as needed; see
        // `Workspace`), back for the next pass when this one is done.
        let mut ws = self.take_workspace();
        // The whole pass runs on one of the pool's threads: each of its
        // ~150 parallel sections (every projection, a decode batch's
        // attention) then starts from inside the pool, where an idle worker
        // steals it at once, instead of being injected from outside and
        // waking the caller through a futex when done (measured: 10% of a
        // batch-1 decode step, and 7% of a prefill, on 2 cores).
        // Its other threads spin for the pass's work meanwhile (`hot`).
        let out = hot::pass(|| {
            let r = self.layers(
                batch,
                &ids,
                &spans,
                &positions,
                &mut failed,
                layer_done,
                &mut ws,
            );
            r.and_then(|()| self.logits(batch, &spans, &mut failed, &mut ws))
        });
        self.put_workspace(ws);
        out
    }

    fn workspaces(&self) -> std::sync::MutexGuard<'_, Vec<Workspace>> {
        // Only whole buffers are pushed and popped: a poisoned list is
        // still a list of buffers.
        self.workspaces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The buffers of a finished pass, or empty ones if every one is in use.
    fn take_workspace(&self) -> Workspace {
        self.workspaces().pop().unwrap_or_default()
    }

    fn put_workspace(&self, ws: Workspace) {
        self.workspaces().push(ws);
    }

    /// The activation buffers this model keeps between passes: the floats
    /// each idle workspace has room for (tests, diagnostics).
    pub fn workspace_floats(&self) -> Vec<usize> {
        self.workspaces().iter().map(Workspace::floats).collect()
    }

    /// Every layer over the batch's rows; the hidden state ends in `ws.x`.
    #[allow(clippy::too_many_arguments)]
    fn layers(
        &self,
        batch: &mut [SeqChunk<'_>],
        ids: &[u32],
        spans: &[std::ops::Range<usize>],
        positions: &[usize],
        failed: &mut [Option<ModelError>],
        layer_done: &mut LayerDone<'_>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        let rows = ids.len();
        let Workspace {
            x,
            xn,
            q,
            k,
            v,
            attn,
            o,
            gate,
            down,
            stacked,
            moe: moe_scratch,
            mla,
            o_in,
            ..
        } = ws;
        x.clear();
        x.resize(rows * hidden, 0.0);
        for (&id, row) in ids.iter().zip(x.chunks_exact_mut(hidden)) {
            self.embed.row_into(id as usize, row).map_err(compute)?;
        }
        if let Some(scale) = cfg.block.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        xn.resize(x.len(), 0.0);
        for (layer, lw) in self.layers.iter().enumerate() {
            // The kernel's query and output widths, and the pool's entry.
            let q_dim = lw.shape.n_heads * lw.shape.head_dim;
            let out_dim = lw.shape.n_heads * lw.shape.v_dim;
            let kv_dim = lw.shape.n_kv_heads * lw.shape.head_dim;
            attn.resize(rows * out_dim, 0.0);
            rms_norm(x, &lw.attn_norm, cfg.rms_norm_eps, xn);
            let projected = Projected {
                q: &mut *q,
                k: &mut *k,
                v: &mut *v,
            };
            let rope = &self.ropes[lw.rope];
            lw.attn
                .project(cfg, rope, xn, positions, projected, stacked, mla)?;

            // K/V into each sequence's pages (serial: each needs its
            // reservation mutably).
            for (i, chunk) in batch.iter_mut().enumerate() {
                let span = spans[i].clone();
                if failed[i].is_some() {
                    continue;
                }
                // A latent pool takes keys only (`v` is empty).
                let ks = &k[span.start * kv_dim..span.end * kv_dim];
                let vs = v.get(span.start * kv_dim..span.end * kv_dim).unwrap_or(&[]);
                if let Err(e) = chunk.kv.write(layer, chunk.start_pos, ks, vs) {
                    failed[i] = Some(e.into());
                }
            }
            // Attention per sequence. A decode batch's sequences are one
            // query each, too small to split inside, so they run in
            // parallel across sequences; a prompt chunk splits itself.
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity(batch.len());
            let mut rest = attn.as_mut_slice();
            for span in spans {
                let (head, tail) = rest.split_at_mut(span.len() * out_dim);
                outs.push(head);
                rest = tail;
            }
            let one = |(i, out): (usize, &mut &mut [f32])| -> Option<ModelError> {
                let span = spans[i].clone();
                if failed[i].is_some() {
                    out.fill(0.0);
                    return None;
                }
                let chunk = &batch[i];
                let qs = &q[span.start * q_dim..span.end * q_dim];
                let r = paged_attention(
                    &chunk.kv.reader(),
                    chunk.kv.table(),
                    layer,
                    &lw.shape,
                    qs,
                    &positions[span],
                    out,
                );
                r.err().map(|e| {
                    out.fill(0.0);
                    e.into()
                })
            };
            let errors: Vec<Option<ModelError>> =
                if batch.len() > 1 && spans.iter().all(|s| s.len() <= 1) {
                    outs.par_iter_mut().enumerate().map(one).collect()
                } else {
                    outs.iter_mut().enumerate().map(one).collect()
                };
            for (i, e) in errors.into_iter().enumerate() {
                if let Some(e) = e {
                    failed[i] = Some(e);
                } else if failed[i].is_none() {
                    layer_done(layer, i, &batch[i]);
                }
            }

            let o_input = lw.attn.o_input(attn, rows, o_in, stacked, mla)?;
            lw.wo.apply_into(o_input, rows, &mut [&mut *o], stacked)?;
            add_bias(o, lw.bo.as_ref());
            add_residual(x, o, lw.post_attn_norm.as_deref(), cfg.rms_norm_eps, xn);

            rms_norm(x, &lw.mlp_norm, cfg.rms_norm_eps, xn);
            let act = cfg.block.activation;
            match &lw.ffn {
                FfnRt::Dense(mlp) => mlp.apply(act, xn, rows, down, stacked, gate)?,
                FfnRt::Moe(moe) => moe.apply(act, xn, rows, hidden, down, stacked, moe_scratch)?,
            }
            add_residual(x, down, lw.post_mlp_norm.as_deref(), cfg.rms_norm_eps, xn);
        }

        Ok(())
    }

    /// Final norm and vocabulary projection, only for the rows asked for;
    /// one result per chunk.
    fn logits(
        &self,
        batch: &[SeqChunk<'_>],
        spans: &[std::ops::Range<usize>],
        failed: &mut [Option<ModelError>],
        ws: &mut Workspace,
    ) -> Result<Vec<ChunkResult>> {
        let cfg = &self.cfg;
        let hidden = cfg.hidden_size;
        // Final norm and vocabulary projection only for the rows asked for.
        let mut want = Vec::new();
        for (i, chunk) in batch.iter().enumerate() {
            let span = spans[i].clone();
            if failed[i].is_some() || span.is_empty() {
                continue;
            }
            match chunk.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last | LogitsWanted::Prompt { .. } => want.push(span.end - 1),
                LogitsWanted::All => want.extend(span),
            }
        }
        let mut logits_rows: Vec<Vec<f32>> = Vec::new();
        if !want.is_empty() {
            // The selected rows, normed, into `xn`; their logits into
            // `logits` (kept between passes: at 16 sequences a fresh 3 MiB
            // per step was 770 page faults).
            let Workspace {
                x,
                xn,
                logits,
                stacked,
                ..
            } = ws;
            let mut sel = Vec::with_capacity(want.len() * hidden);
            for &r in &want {
                sel.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            xn.resize(sel.len(), 0.0);
            rms_norm(&sel, &self.final_norm, cfg.rms_norm_eps, xn);
            self.lm_head
                .apply_into(xn, want.len(), &mut [&mut *logits], stacked)?;
            softcap(logits, cfg.block.final_softcap);
            logits_rows = logits
                .chunks_exact(cfg.vocab_size)
                .map(<[f32]>::to_vec)
                .collect();
        }
        let mut rows_iter = want.iter().copied().zip(logits_rows);
        let mut results = Vec::with_capacity(batch.len());
        for (i, chunk) in batch.iter().enumerate() {
            if let Some(e) = failed[i].take() {
                results.push(Err(e));
                continue;
            }
            let span = spans[i].clone();
            let n = match chunk.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last | LogitsWanted::Prompt { .. } => usize::from(!span.is_empty()),
                LogitsWanted::All => span.len(),
            };
            let mut mine = Vec::with_capacity(n);
            for _ in 0..n {
                if let Some((_, row)) = rows_iter.next() {
                    mine.push(row);
                }
            }
            let prompt = match chunk.logits {
                LogitsWanted::Prompt { top } => {
                    self.score_prompt(ws, span.start, chunk.tokens, top)?
                }
                _ => Vec::new(),
            };
            results.push(Ok(ChunkOut {
                logits: mine,
                prompt,
            }));
        }
        Ok(results)
    }

    /// [`LogitsWanted::Prompt`]'s scores of one chunk whose hidden states
    /// are rows `first..first + tokens.len()` of `x`: position `i` scores
    /// `tokens[i + 1]`. [`SCORE_ROWS`] positions at a time through the
    /// final norm and the vocabulary projection (each row's result does
    /// not depend on the others in the block, so blocking changes no bit),
    /// then each row's log-softmax and top-k in parallel; only the scores
    /// are kept. Cost: the vocabulary projection for every prompt position
    /// instead of the last only, plus one pass over each row for the
    /// log-softmax and one for the top-k.
    fn score_prompt(
        &self,
        ws: &mut Workspace,
        first: usize,
        tokens: &[u32],
        top: usize,
    ) -> Result<Vec<PromptLogprob>> {
        let cfg = &self.cfg;
        let (hidden, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let scored = tokens.len().saturating_sub(1);
        let mut out = Vec::with_capacity(scored);
        // `logits` is free again: the last rows were copied out.
        let Workspace {
            x,
            xn,
            logits,
            stacked,
            ..
        } = ws;
        for block in (0..scored).step_by(SCORE_ROWS) {
            let rows = SCORE_ROWS.min(scored - block);
            let from = (first + block) * hidden;
            let sel = &x[from..from + rows * hidden];
            xn.resize(sel.len(), 0.0);
            rms_norm(sel, &self.final_norm, cfg.rms_norm_eps, xn);
            self.lm_head
                .apply_into(xn, rows, &mut [&mut *logits], stacked)?;
            softcap(logits, cfg.block.final_softcap);
            let next = &tokens[block + 1..block + 1 + rows];
            let scores: Vec<PromptLogprob> = logits
                .par_chunks_exact(vocab)
                .zip(next.par_iter())
                .map(|(row, &t)| prompt_logprob(row, t, top))
                .collect();
            out.extend(scores);
        }
        Ok(out)
    }
}

mod attn;
mod hot;
mod ops;
mod workspace;
use attn::{AttnRt, Projected};
pub(crate) use ops::gated_rows;
#[cfg(test)]
use ops::SWIGLU_PARALLEL;
use ops::{add_bias, add_residual, softcap};
use workspace::Workspace;

#[cfg(test)]
mod tests;
