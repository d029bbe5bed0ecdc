//! The single-process reference engine: one model, one KV pool, no
//! disaggregation. It is what `kvmesh generate` runs, and the oracle every
//! disaggregated test compares against token for token. It uses the same
//! [`Llama`] forward pass and the same pool and reservations as the services.
//!
//! Admission happens before allocation (I3): an empty prompt, or a prompt
//! whose length plus `max_new_tokens` exceeds the context limit, is refused
//! with a typed error and nothing is reserved; a pool too small for the
//! whole sequence is refused by the pool without a partial grant. A sequence
//! reserves its whole budget (prompt + new tokens) up front, so decoding can
//! never run out of pages halfway.

mod config;
mod grammar;
mod prefix;
mod sequence;
mod step;
mod stopping;

pub use config::{check_pool_capacity, EngineConfig};
pub use prefix::{PrefixCache, PREFIX_CACHE_SHARE};
pub use sequence::Sequence;
pub use step::{StepItem, StepWork};
pub use stopping::Stopping;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_kvpool::{KvPool, PoolConfig, Reservation};

use crate::error::{ModelError, Result};
use crate::llama::{LayerDone, Llama, LogitsWanted, SeqChunk};
use crate::loader::{load_with, LoadedModel};
use crate::sampling::{PromptLogprob, Sampler, SamplingParams};
use kvmesh_tokenizer::{ChatMessage, TextTokenizer};

/// What to generate from.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Raw text; special-token text in it is parsed as special tokens.
    Text(String),
    /// Chat messages, rendered through the model's chat template with the
    /// generation prompt appended.
    Chat(Vec<ChatMessage>),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// The result of [`Engine::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (without the end-of-sequence token).
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
    /// Why it stopped.
    pub finish_reason: FinishReason,
}

/// Where [`Engine::prefill_batch_streamed`] hands each computed layer:
/// `(sequence index, layer, its prompt K and V or the read error)`.
pub type LayerKvSink<'a> = dyn FnMut(usize, usize, Result<(Vec<f32>, Vec<f32>)>) + Send + 'a;

/// Where [`Engine::prefill_batch_streamed`] gets the two vectors it fills
/// with a layer's K and V (cleared first): a caller that hands back the ones
/// it has shipped makes a stream of prompts allocate nothing (a fresh
/// buffer of a few hundred KiB per layer is a page fault per 4 KiB).
pub type KvBuffers<'a> = dyn FnMut() -> (Vec<f32>, Vec<f32>) + Send + 'a;

/// The reference engine.
#[derive(Debug)]
pub struct Engine {
    model: Arc<Llama>,
    /// What runs every forward pass ([`crate::forward::Forward`]): the CPU
    /// model itself, or its copy on a CUDA device (`model` then stays for
    /// metadata and as the oracle).
    runner: Arc<dyn crate::forward::Forward>,
    /// The CUDA model, when `runner` is one (device reports).
    cuda: Option<Arc<crate::cuda::CudaLlama>>,
    tokenizer: TextTokenizer,
    pool: KvPool,
    max_model_len: usize,
    eos: Vec<u32>,
    /// The model's family, its weights' fingerprint
    /// ([`crate::weights::Weights::fingerprint`]: configuration and weight
    /// values, not the file's name) and the precision its weights run at:
    /// what the prefix cache's model tag names.
    identity: String,
    /// The prefix cache's keys, when it is on
    /// ([`Engine::with_prefix_cache`]).
    prefix: Option<Arc<PrefixCache>>,
    /// Structured output's vocabulary, built on first use (`grammar`).
    vocabulary: std::sync::OnceLock<
        std::result::Result<kvmesh_structured::Vocabulary, kvmesh_structured::StructuredError>,
    >,
}

impl Engine {
    /// Load a model (HF directory or GGUF file) and size its pool.
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Self> {
        let started = Instant::now();
        let loaded = load_with(path, cfg.precision)?;
        let engine = Self::from_loaded(loaded, cfg)?;
        tracing::info!(
            model = %path.display(),
            secs = format!("{:.2}", started.elapsed().as_secs_f64()),
            kv_pool_tokens = engine.pool.capacity_tokens(),
            max_model_len = engine.max_model_len,
            "engine ready"
        );
        Ok(engine)
    }

    /// Build from an already loaded model.
    pub fn from_loaded(loaded: LoadedModel, cfg: &EngineConfig) -> Result<Self> {
        Self::build(loaded, cfg, None)
    }

    /// Build from an already loaded model over an existing pool (a decode
    /// node's, whose pages arrive by transfer). The pool's shape must be the
    /// model's KV shape.
    pub fn with_pool(loaded: LoadedModel, cfg: &EngineConfig, pool: KvPool) -> Result<Self> {
        Self::build(loaded, cfg, Some(pool))
    }

    fn build(loaded: LoadedModel, cfg: &EngineConfig, pool: Option<KvPool>) -> Result<Self> {
        let eos = loaded.stop_token_ids();
        let kv_dtype = cfg.kv_dtype_for(loaded.precision);
        let identity = format!(
            "{}-{}@{:?}",
            loaded.config.family,
            loaded.weights.fingerprint(&loaded.config),
            loaded.precision
        );
        let LoadedModel {
            config,
            weights,
            tokenizer,
            ..
        } = loaded;
        let limit = config.max_position_embeddings;
        let max_model_len = match cfg.max_model_len {
            Some(0) => return Err(invalid("max_model_len", "0", "must be at least 1")),
            Some(n) if n > limit => {
                return Err(invalid(
                    "max_model_len",
                    &n.to_string(),
                    &format!("the model supports at most {limit} positions"),
                ))
            }
            Some(n) => n,
            None => limit,
        };
        let pool_tokens = cfg.kv_pool_tokens.unwrap_or(max_model_len);
        let pool_cfg = PoolConfig {
            scrub: cfg.scrub,
            poison: cfg.poison,
            dtype: kv_dtype,
            ..config.pool_config(pool_tokens, cfg.page_size)
        };
        let pool = match pool {
            None => KvPool::new(pool_cfg)?,
            Some(p) => {
                let c = p.config();
                let shape =
                    |c: &PoolConfig| (c.n_layers, c.n_kv_heads, c.head_dim, c.entry, c.dtype);
                if shape(c) != shape(&pool_cfg) {
                    return Err(invalid(
                        "kv pool",
                        &format!(
                            "{} layers x {} KV heads x {} {} ({} entries)",
                            c.n_layers, c.n_kv_heads, c.head_dim, c.dtype, c.entry.name()
                        ),
                        "the pool's shape or dtype is not the model's KV shape and --kv-cache-dtype",
                    ));
                }
                p
            }
        };
        let cuda = match cfg.device {
            kvmesh_cuda::DeviceSpec::Cpu
                if cfg.device_weights != kvmesh_cuda::ops::WeightDtype::F32 =>
            {
                return Err(invalid(
                    "device_weights",
                    cfg.device_weights.name(),
                    "applies to a CUDA device only (--device cuda)",
                ))
            }
            kvmesh_cuda::DeviceSpec::Cpu => None,
            spec @ kvmesh_cuda::DeviceSpec::Cuda(_) => {
                let gpu = kvmesh_cuda::gpu::Gpu::open(spec)?;
                let device_pool = kvmesh_cuda::pool::DeviceKvPool::new(gpu, pool.clone())?;
                Some(Arc::new(crate::cuda::CudaLlama::new(
                    &config,
                    &weights,
                    device_pool,
                    cfg.device_weights,
                )?))
            }
        };
        let model = Arc::new(Llama::new(config, weights)?);
        let runner: Arc<dyn crate::forward::Forward> = match &cuda {
            Some(c) => c.clone(),
            None => model.clone(),
        };
        // Fusing the projections freed their parts.
        crate::loader::release_freed_heap();
        Ok(Self {
            model,
            runner,
            cuda,
            tokenizer,
            pool,
            max_model_len,
            eos,
            identity,
            prefix: None,
            vocabulary: std::sync::OnceLock::new(),
        })
    }

    /// One forward pass on the engine's device.
    pub(crate) fn forward(
        &self,
        batch: &mut [SeqChunk<'_>],
    ) -> Result<Vec<crate::llama::ChunkResult>> {
        self.runner.forward(batch)
    }

    /// [`Self::forward`] with a per-layer observer.
    fn forward_observed(
        &self,
        batch: &mut [SeqChunk<'_>],
        observe: &mut LayerDone<'_>,
    ) -> Result<Vec<crate::llama::ChunkResult>> {
        self.runner.forward_observed(batch, observe)
    }

    /// The model on the CUDA device, when the engine runs on one.
    pub fn cuda(&self) -> Option<&crate::cuda::CudaLlama> {
        self.cuda.as_deref()
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }
    /// The KV pool.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
    /// The model's identity: family, weights' fingerprint and precision
    /// (`llama-3f0c...@Quantized`); nodes of one mesh must agree on it.
    pub fn identity(&self) -> &str {
        &self.identity
    }
    /// The kernels this engine computes with and their numerics: the
    /// process's CPU path (`("avx512", "x86-fma")`; [`kvmesh_kernels::cpu`]),
    /// or on a CUDA device its name and `"cuda"` (`("cuda:0", "cuda")`).
    /// Nodes of one mesh pair only when the numerics agree, so the router
    /// never joins a GPU prefill to a CPU decode (their KV differ in the
    /// last bits) unless every node runs the same kind.
    pub fn cpu_kernels(&self) -> (&str, &'static str) {
        self.runner.kernels()
    }
    /// The context limit in tokens (prompt plus generated).
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }
    /// End-of-sequence token ids.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Turn a prompt into token ids.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(t) => Ok(self.tokenizer.encode(t)?),
            Prompt::Chat(messages) => Ok(self.tokenizer.encode_chat(messages)?),
            Prompt::Tokens(ids) => Ok(ids.clone()),
        }
    }

    /// Admit a sequence: check the context limit, then reserve pages for the
    /// prompt and all `max_new_tokens` (all or nothing).
    pub fn admit(&self, prompt_ids: Vec<u32>, max_new_tokens: usize) -> Result<Sequence> {
        let total = self.check_admission(&prompt_ids, max_new_tokens)?;
        let kv = self.pool.reserve(total)?;
        Ok(Sequence::new(kv, prompt_ids, total, 0))
    }

    /// I3 before anything is reserved: a prompt, and a sequence within the
    /// context limit. Returns the tokens to reserve.
    fn check_admission(&self, prompt_ids: &[u32], max_new_tokens: usize) -> Result<usize> {
        if prompt_ids.is_empty() {
            return Err(ModelError::EmptyPrompt);
        }
        let total = prompt_ids.len().saturating_add(max_new_tokens);
        if total > self.max_model_len {
            return Err(ModelError::ContextLengthExceeded {
                prompt_tokens: prompt_ids.len(),
                max_new_tokens,
                limit: self.max_model_len,
            });
        }
        Ok(total)
    }

    /// Adopt a sequence whose prompt KV is already in `kv` (a verified
    /// transfer): positions `0..prompt_ids.len()` must be written at every
    /// layer, and `kv` must hold room for `max_new_tokens` more. The
    /// context limit is re-checked here too (I3).
    pub fn adopt(
        &self,
        prompt_ids: Vec<u32>,
        max_new_tokens: usize,
        kv: Reservation,
    ) -> Result<Sequence> {
        if prompt_ids.is_empty() {
            return Err(ModelError::EmptyPrompt);
        }
        let prompt_len = prompt_ids.len();
        let total = prompt_len.saturating_add(max_new_tokens);
        if total > self.max_model_len || total > kv.capacity_tokens() {
            return Err(ModelError::ContextLengthExceeded {
                prompt_tokens: prompt_len,
                max_new_tokens,
                limit: self.max_model_len.min(kv.capacity_tokens()),
            });
        }
        // I2 before the first read: every prompt slot written (a hole is
        // counted as a guard violation), and nothing past the prompt.
        kv.require_written(prompt_len)?;
        let n_layers = self.model.config().n_layers;
        if let Some(layer) = (0..n_layers).find(|&l| kv.written_tokens(l) != prompt_len) {
            return Err(ModelError::Compute {
                detail: format!(
                    "adopted KV holds {} tokens at layer {layer}, the prompt has {prompt_len}",
                    kv.written_tokens(layer)
                ),
            });
        }
        if self.runner.keeps_own_kv() {
            // The prompt landed (and was verified) in the host pool: the
            // same values into the pass's own pages (a device's), through
            // its checked KV write, layer by layer; a cached head is there
            // already.
            let cached = kv.cached_tokens().min(prompt_len);
            let kv_dim = self.pool.config().geometry().kv_dim();
            for layer in 0..n_layers {
                let (k, v) = self.read_kv(&kv, prompt_len, layer)?;
                let from = cached * kv_dim;
                self.runner.adopt_prompt(
                    kv.table(),
                    cached,
                    prompt_len - cached,
                    layer,
                    &k[from..],
                    &v[from..],
                )?;
            }
        }
        Ok(Sequence::new(kv, prompt_ids, total, prompt_len))
    }

    /// The K and V of every cached prompt position at `layer`, position-
    /// major (`prompt_len * kv_dim` values each), read through the checked
    /// reader: what a prefill node ships to a decode node.
    pub fn prompt_kv(&self, seq: &Sequence, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.read_kv(&seq.kv, seq.prompt_len, layer)
    }

    /// The first `n` positions' K and V at `layer` from `kv`'s pages.
    fn read_kv(&self, kv: &Reservation, n: usize, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        self.read_kv_into(kv, n, layer, (Vec::new(), Vec::new()))
    }

    /// [`Self::read_kv`] into the given vectors (cleared first).
    fn read_kv_into(
        &self,
        kv: &Reservation,
        n: usize,
        layer: usize,
        (mut k, mut v): (Vec<f32>, Vec<f32>),
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        use kvmesh_kernels::PagedKv;
        let reader = kv.reader();
        let page_size = self.pool.config().page_size;
        let kv_dim = self.pool.config().geometry().kv_dim();
        k.clear();
        v.clear();
        k.reserve(n * kv_dim);
        v.reserve(n * kv_dim);
        for (i, entry) in kv.table().iter().enumerate() {
            let before = i * page_size;
            if before >= n {
                break;
            }
            let slots = (n - before).min(page_size);
            let s = reader.read_page(*entry, layer, slots)?;
            s.k.extend_f32(&mut k);
            s.v.extend_f32(&mut v);
        }
        Ok((k, v))
    }

    /// [`Self::prefill_batch`], handing each sequence's prompt K/V of a
    /// layer to `layer_kv(i, layer, k, v)` as soon as that layer is computed
    /// (read back through the checked reader, as [`Self::prompt_kv`] does),
    /// so a prefill node ships layer `l` while layers `l + 1..` compute. A
    /// sequence whose chunk failed gets no further calls; its result is the
    /// error.
    pub fn prefill_batch_streamed(
        &self,
        seqs: &mut [&mut Sequence],
        buffers: &mut KvBuffers<'_>,
        layer_kv: &mut LayerKvSink<'_>,
    ) -> Result<Vec<Result<Vec<f32>>>> {
        self.prefill_prompts(seqs, &mut |layer, i, chunk| {
            let n = chunk.start_pos + chunk.tokens.len();
            layer_kv(i, layer, self.read_kv_into(chunk.kv, n, layer, buffers()));
        })
    }

    /// The prompts of `seqs` as one batch, `observe` called per finished
    /// layer and sequence; each one's last-position logits.
    fn prefill_prompts(
        &self,
        seqs: &mut [&mut Sequence],
        observe: &mut LayerDone<'_>,
    ) -> Result<Vec<Result<Vec<f32>>>> {
        let results = {
            let mut batch: Vec<SeqChunk<'_>> = seqs
                .iter_mut()
                .map(|s| SeqChunk {
                    logits: s.prompt_wanted(),
                    tokens: &s.tokens[s.cached..],
                    start_pos: s.cached,
                    kv: &mut s.kv,
                })
                .collect();
            self.forward_observed(&mut batch, observe)?
        };
        Ok(last_rows(seqs, results, "prefill"))
    }

    /// Run the uncached prompt tokens; returns the last position's logits.
    pub fn prefill(&self, seq: &mut Sequence) -> Result<Vec<f32>> {
        let mut results = {
            let start = seq.cached;
            let logits = seq.prompt_wanted();
            let mut batch = [SeqChunk {
                tokens: &seq.tokens[start..],
                start_pos: start,
                kv: &mut seq.kv,
                logits,
            }];
            self.forward(&mut batch)?
        };
        let out = results.pop().unwrap_or_else(|| Ok(Default::default()))?;
        seq.cached = seq.tokens.len();
        seq.prompt_logprobs = out.prompt;
        out.logits
            .into_iter()
            .next()
            .ok_or_else(|| ModelError::Compute {
                detail: "prefill returned no logits".into(),
            })
    }

    /// The reference for prompt logprobs: `prompt` through one forward
    /// pass with every position's whole logits row kept
    /// ([`LogitsWanted::All`], no blocking, no prefix cache), then each
    /// row's [`crate::sampling::prompt_logprob`] of the next token. Entry
    /// `i` is token `i + 1`'s. What a mesh's prompt logprobs are tested
    /// against; it holds `prompt.len() x vocab` floats at once, so it is
    /// for tests and short prompts.
    pub fn prompt_logprobs_reference(
        &self,
        prompt: &[u32],
        top: usize,
    ) -> Result<Vec<PromptLogprob>> {
        let mut seq = self.admit(prompt.to_vec(), 0)?;
        let rows = {
            let mut batch = [SeqChunk {
                tokens: &seq.tokens,
                start_pos: 0,
                kv: &mut seq.kv,
                logits: LogitsWanted::All,
            }];
            self.forward(&mut batch)?
                .pop()
                .unwrap_or_else(|| Ok(Default::default()))?
                .logits
        };
        Ok(rows
            .iter()
            .zip(&prompt[1..])
            .map(|(row, &next)| crate::sampling::prompt_logprob(row, next, top))
            .collect())
    }

    /// Run the uncached prompt tokens of several sequences as one batch
    /// (prompts that arrived together); returns each one's last-position
    /// logits, or its own error.
    pub fn prefill_batch(&self, seqs: &mut [&mut Sequence]) -> Result<Vec<Result<Vec<f32>>>> {
        self.prefill_prompts(seqs, &mut |_, _, _| {})
    }

    /// Append one token to each sequence and run them as one batch; returns
    /// each sequence's next-token logits, or its own error.
    pub fn decode_step(
        &self,
        seqs: &mut [&mut Sequence],
        next: &[u32],
    ) -> Result<Vec<Result<Vec<f32>>>> {
        assert_eq!(seqs.len(), next.len(), "one token per sequence");
        for (seq, &tok) in seqs.iter_mut().zip(next) {
            if seq.tokens.len() >= seq.max_len {
                return Err(ModelError::ContextLengthExceeded {
                    prompt_tokens: seq.prompt_len,
                    max_new_tokens: seq.max_len - seq.prompt_len,
                    limit: seq.max_len,
                });
            }
            seq.tokens.push(tok);
        }
        let results = {
            let mut batch: Vec<SeqChunk<'_>> = seqs
                .iter_mut()
                .map(|s| {
                    let pos = s.tokens.len() - 1;
                    SeqChunk {
                        tokens: &s.tokens[pos..],
                        start_pos: pos,
                        kv: &mut s.kv,
                        logits: LogitsWanted::Last,
                    }
                })
                .collect();
            self.forward(&mut batch)?
        };
        Ok(last_rows(seqs, results, "decode"))
    }

    /// Generate up to `max_new_tokens` tokens, calling `on_text` with each
    /// piece of text as soon as it is complete UTF-8.
    pub fn generate(
        &self,
        prompt: &Prompt,
        max_new_tokens: usize,
        params: SamplingParams,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation> {
        params
            .validate()
            .map_err(|reason| invalid("sampling", "", &reason))?;
        let ids = self.tokenize(prompt)?;
        let mut sampler = Sampler::new(params, &ids, &self.eos);
        let mut seq = self.admit(ids, max_new_tokens)?;
        let mut decoder = self.tokenizer.stream_decoder();
        let mut text = String::new();
        let mut stopping = Stopping::new(self.eos.clone(), max_new_tokens);
        let mut finish = FinishReason::Length;
        if !stopping.spent() {
            let mut logits = self.prefill(&mut seq)?;
            loop {
                let tok = sampler.sample(&mut logits).token;
                let verdict = stopping.after(tok);
                if verdict == Some(FinishReason::Stop) {
                    finish = FinishReason::Stop;
                    break;
                }
                if let Some(piece) = decoder.push(tok)? {
                    on_text(&piece);
                    text.push_str(&piece);
                }
                if verdict == Some(FinishReason::Length) {
                    seq.tokens.push(tok);
                    break;
                }
                let mut r = self.decode_step(&mut [&mut seq], &[tok])?;
                logits = r.pop().unwrap_or_else(|| {
                    Err(ModelError::Compute {
                        detail: "no result".into(),
                    })
                })?;
            }
        }
        if let Some(piece) = decoder.finish()? {
            on_text(&piece);
            text.push_str(&piece);
        }
        Ok(Generation {
            prompt_tokens: seq.prompt_len,
            tokens: seq.generated().to_vec(),
            text,
            finish_reason: finish,
        })
    }
}

/// After a batched forward pass: marks every sequence's tokens cached and
/// keeps each one's single logits row (or its own error).
fn last_rows(
    seqs: &mut [&mut Sequence],
    results: Vec<crate::llama::ChunkResult>,
    step: &str,
) -> Vec<Result<Vec<f32>>> {
    seqs.iter_mut()
        .zip(results)
        .map(|(seq, r)| {
            seq.cached = seq.tokens.len();
            r.and_then(|out| {
                seq.prompt_logprobs = out.prompt;
                out.logits
                    .into_iter()
                    .next()
                    .ok_or_else(|| ModelError::Compute {
                        detail: format!("{step} returned no logits"),
                    })
            })
        })
        .collect()
}

fn invalid(field: &str, value: &str, reason: &str) -> ModelError {
    ModelError::InvalidField {
        path: "<engine config>".into(),
        field: field.into(),
        value: value.into(),
        reason: reason.into(),
    }
}
