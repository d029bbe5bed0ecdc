//! Causal grouped-query attention over a paged, ownership-checked KV cache.
//!
//! # Paths
//! [`crate::cpu::path`] picks the build: AVX-512 (`tiled512`) and AVX2
//! (`tiled`, or the generic block with eight-lane primitives for head
//! sizes that are not a multiple of 32) compute the same bits as each
//! other; the portable build (unfused dot products, the C library's
//! `exp`) agrees with them within f32 rounding, not to the bit. Within any
//! one path a query's output does not depend on the block or batch it runs
//! in.
//!
//! Soft-capping ([`AttentionShape::softcap`]) is one scalar step on every
//! path (`softcap`: the C library's `tanhf`, as transformers divides,
//! takes the tanh and multiplies), applied to each path's scaled scores,
//! so it keeps the paths' agreement as it is: AVX2 and AVX-512 to the bit.
//!
//! Cost per call: one I1/I2 check per page touched (O(pages), independent of
//! head count and head size), then O(queries * context * n_heads * head_dim)
//! arithmetic. All checks happen before any arithmetic, so a violation
//! reads nothing and writes nothing to `out`.
//!
//! Attention sinks ([`AttentionShape::sinks`], gpt-oss) join each query
//! head's softmax as one more logit that carries no value: the maximum is
//! taken over the scores and the sink, the denominator adds
//! `exp(sink - max)`. That is one scalar step in each path's finalize
//! (the AVX2 and AVX-512 builds share theirs), so the paths agree as
//! before.
//!
//! Soft-capping adds one `tanhf` per score: 10 ns a call on this project's
//! 2-core machines (a `rustc -O` loop of 10M calls; `expf` took 4 ns),
//! chosen over a vector polynomial for its accuracy (an ulp, as PyTorch's
//! `tanh`), against the score's dot product of `head_dim` multiply-adds.

use std::sync::Arc;

use rayon::prelude::*;

use crate::paged::{GuardViolation, KvDtype, KvEntry, KvValues, PageRef, PageSlices, PagedKv};

/// The head layout of one attention call.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; `n_heads` must be a multiple of it.
    pub n_kv_heads: usize,
    /// Dimension of one head's query and key.
    pub head_dim: usize,
    /// Dimension of one head's value and output: `head_dim` over a
    /// [`KvEntry::KeyValue`] pool; over a [`KvEntry::Latent`] one, the
    /// leading values of each key that are its value (at most `head_dim`).
    pub v_dim: usize,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Sliding window: a query at position `p` attends positions
    /// `p + 1 - window ..= p`. `None` attends the whole prefix.
    pub window: Option<usize>,
    /// Attention logit soft-capping (Gemma 2): each scaled score `s`
    /// becomes `cap * tanh(s / cap)` before the softmax. `None`: scores
    /// as they are.
    pub softcap: Option<f32>,
    /// Attention sinks (gpt-oss): one learned logit per query head
    /// (`n_heads` values) that joins the softmax's denominator as a
    /// position whose value is zero, so a head may attend to nothing.
    /// `None`: a plain softmax.
    pub sinks: Option<Arc<[f32]>>,
}

/// Query tokens per parallel task of a prompt chunk (all heads): their K/V
/// rows are read once per block instead of once per query.
const QUERY_BLOCK: usize = 16;

/// Below this many multiply-adds a call runs on the calling thread. The
/// forward pass runs on a pool thread, where starting a parallel section
/// costs a few microseconds (from outside the pool it cost tens, and this
/// was 16 times higher): a decode step's attention for one sequence splits
/// its KV heads (or their query heads, [`decode_runs`]) across the threads
/// from about 230 positions (9 heads x 230 x 64). Measured
/// (`PATHS_BENCH="attention decode" cargo bench --bench paths`, 2 threads,
/// f16 pool, three rounds against the higher threshold): 1023 positions
/// 51-52 us instead of 93-107, 255 positions 15 us instead of 25-28.
const PARALLEL_THRESHOLD: usize = 1 << 17;

/// Attention for `positions.len()` query tokens of one sequence at `layer`.
///
/// - `q`: `[n_tokens][n_heads][head_dim]`, already position-encoded.
/// - `positions`: the absolute position of each query token; the token at
///   position `p` attends positions `..= p`, whose K/V must already be in the
///   cache (the caller writes the current tokens' K/V first).
/// - `table`: the sequence's page table.
/// - `out`: `[n_tokens][n_heads][v_dim]`.
/// - Over a [`KvEntry::Latent`] pool each key row's leading `v_dim` values
///   are its value (latent attention: `q` is already absorbed into the
///   latent space, `out` is still in it).
///
/// Every page needed is checked through [`PagedKv::read_page`] first; on a
/// violation the function returns it without computing anything.
///
/// # Panics
/// If the slice lengths disagree with `shape`, sinks included (a caller
/// bug, not input).
pub fn paged_attention<K: PagedKv + ?Sized>(
    kv: &K,
    table: &[PageRef],
    layer: usize,
    shape: &AttentionShape,
    q: &[f32],
    positions: &[usize],
    out: &mut [f32],
) -> Result<(), GuardViolation> {
    let path = crate::cpu::path();
    paged_attention_with(path, kv, table, layer, shape, q, positions, out)
}

/// [`paged_attention`] on a chosen path (tests, benchmarks).
///
/// # Panics
/// As [`paged_attention`], and if this CPU lacks `path`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with<K: PagedKv + ?Sized>(
    path: crate::cpu::Path,
    kv: &K,
    table: &[PageRef],
    layer: usize,
    shape: &AttentionShape,
    q: &[f32],
    positions: &[usize],
    out: &mut [f32],
) -> Result<(), GuardViolation> {
    assert!(path.available(), "{path} kernels on a CPU without them");
    let geo = kv.geometry();
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
        v_dim,
        ..
    } = *shape;
    assert_eq!(
        geo.n_kv_heads, n_kv_heads,
        "pool and model disagree on kv heads"
    );
    assert_eq!(
        geo.head_dim, head_dim,
        "pool and model disagree on head_dim"
    );
    assert!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        "n_heads must be a multiple of n_kv_heads"
    );
    // Latent entries: values are the keys' leading `v_dim` values.
    let latent_v = match geo.entry {
        KvEntry::KeyValue => {
            assert_eq!(
                v_dim, head_dim,
                "a key-value pool's values are head_dim wide"
            );
            None
        }
        KvEntry::Latent => {
            assert!(v_dim <= head_dim, "latent values are a prefix of the key");
            Some(v_dim)
        }
    };
    let q_stride = n_heads * head_dim;
    assert_eq!(
        q.len(),
        positions.len() * q_stride,
        "q has the wrong length"
    );
    assert_eq!(
        out.len(),
        positions.len() * n_heads * v_dim,
        "out has the wrong length"
    );
    if let Some(sinks) = &shape.sinks {
        assert_eq!(sinks.len(), n_heads, "one sink per query head");
    }
    let Some(&max_pos) = positions.iter().max() else {
        return Ok(());
    };

    // Check and fetch every page the call touches, before any arithmetic.
    let context = max_pos + 1;
    let page_size = geo.page_size;
    let n_pages = context.div_ceil(page_size);
    if table.len() < n_pages {
        let v = GuardViolation::TableTooShort {
            position: max_pos,
            needed: n_pages - 1,
            len: table.len(),
        };
        kv.report(&v);
        return Err(v);
    }
    let lowest = positions
        .iter()
        .map(|&p| window_start(p, shape.window))
        .min()
        .unwrap_or(0);
    let mut pages: Vec<Option<PageSlices<'_>>> = Vec::with_capacity(n_pages);
    for (i, entry) in table[..n_pages].iter().enumerate() {
        let first = i * page_size;
        if first + page_size <= lowest {
            // Entirely outside every query's window: never read, never checked.
            pages.push(None);
            continue;
        }
        let n_slots = page_size.min(context - first);
        pages.push(Some(kv.read_page(*entry, layer, n_slots)?));
    }

    if positions.len() == 1 {
        prefetch_pages(&pages);
    }
    let group = n_heads / n_kv_heads;
    let kv_dim = n_kv_heads * head_dim;
    let work = positions.len() * n_heads * context * head_dim;
    if positions.len() == 1 {
        // One query token (a decode step): one block per KV head, its query
        // heads together (they are adjacent), so each K and V row is read
        // once per KV head; in parallel, with fewer KV heads than threads,
        // each KV head's query heads split into runs (`decode_runs`).
        let parallel = work >= PARALLEL_THRESHOLD;
        let runs = if parallel {
            decode_runs(group, n_kv_heads, rayon::current_num_threads())
        } else {
            1
        };
        let per = group / runs;
        let body = |(c, o): (usize, &mut [f32])| {
            let (kvh, first) = (c / runs, (c % runs) * per);
            let heads = kvh * group + first..kvh * group + first + per;
            let queries: Vec<(&[f32], usize)> = heads
                .clone()
                .map(|h| (&q[h * head_dim..][..head_dim], positions[0]))
                .collect();
            let mut outs: Vec<&mut [f32]> = o.chunks_mut(v_dim).collect();
            // The run's query heads are adjacent: so are their sinks.
            let sinks = shape.sinks.as_deref().map(|s| &s[heads]);
            let args = (
                shape,
                pages.as_slice(),
                page_size,
                kv_dim,
                kvh * head_dim,
                sinks,
                latent_v,
            );
            run_block(path, &queries, &mut outs, args);
        };
        if parallel {
            out.par_chunks_mut(per * v_dim).enumerate().for_each(body);
        } else {
            out.chunks_mut(per * v_dim).enumerate().for_each(body);
        }
        return Ok(());
    }
    // Several query tokens (a prompt chunk): blocks of QUERY_BLOCK tokens;
    // within a block, every query head of one KV head reads each K and V
    // row once for all of them.
    let body = |(bi, chunk): (usize, &mut [f32])| {
        let t0 = bi * QUERY_BLOCK;
        let mut slots: Vec<Option<&mut [f32]>> = chunk.chunks_mut(v_dim).map(Some).collect();
        for kvh in 0..n_kv_heads {
            let mut queries = Vec::new();
            let mut outs = Vec::new();
            let mut sinks = Vec::new();
            for (idx, slot) in slots.iter_mut().enumerate() {
                let (t, h) = (t0 + idx / n_heads, idx % n_heads);
                if h / group != kvh {
                    continue;
                }
                if let Some(o) = slot.take() {
                    queries.push((&q[t * q_stride + h * head_dim..][..head_dim], positions[t]));
                    outs.push(o);
                    if let Some(s) = &shape.sinks {
                        sinks.push(s[h]);
                    }
                }
            }
            let sinks = shape.sinks.as_ref().map(|_| sinks.as_slice());
            let args = (
                shape,
                pages.as_slice(),
                page_size,
                kv_dim,
                kvh * head_dim,
                sinks,
                latent_v,
            );
            run_block(path, &queries, &mut outs, args);
        }
    };
    let block = QUERY_BLOCK * n_heads * v_dim;
    if work < PARALLEL_THRESHOLD {
        out.chunks_mut(block).enumerate().for_each(body);
    } else {
        out.par_chunks_mut(block).enumerate().for_each(body);
    }
    Ok(())
}

/// Bytes of a decode step's K/V rows that [`prefetch_pages`] asks for
/// ahead: within every L2 of these machines (512 KiB on a Zen 3), so the
/// first lines are still there when the tiles reach them.
const PREFETCH_BYTES: usize = 256 << 10;

/// Hints the K and V rows of a decode step's pages to the L2 cache, page by
/// page in the tiles' order, up to [`PREFETCH_BYTES`]. A decode step reads
/// each row once, and between two steps the weights' stream has evicted
/// them: the tiles' loads, a page's rows at a time, left most of the
/// memory's parallelism unused. The hints are issued at once, so the
/// misses overlap. Measured (`perf record` of `kvmesh bench-engine
/// --prompt-tokens 32 --decode-tokens 64 --batch 1`, SmolLM2, 2 threads, a
/// Zen 4, two runs each): attention's samples 7.1-7.7% of the matmuls'
/// before, 5.7-5.9% with the hints (theirs included).
fn prefetch_pages(pages: &[Option<PageSlices<'_>>]) {
    let mut left = PREFETCH_BYTES;
    for p in pages.iter().flatten() {
        for v in [&p.k, &p.v] {
            if v.byte_len() > left {
                return;
            }
            v.prefetch();
            left -= v.byte_len();
        }
    }
}

/// Runs each KV head's `group` query heads split into for a parallel
/// decode step: the fewest (a divisor of `group`) that give every one of
/// `threads` a task, or one run per query head. A query's result does not
/// depend on the queries beside it in a block (the tiles group independent
/// scores and chains), so the split changes no bits. Gemma 3 270M (one KV
/// head, four query heads) on two threads: two runs of two, where the
/// whole step's attention ran on one thread; a run's K and V rows are
/// read once per run instead of once per KV head.
fn decode_runs(group: usize, n_kv_heads: usize, threads: usize) -> usize {
    (1..=group)
        .find(|&d| group.is_multiple_of(d) && n_kv_heads * d >= threads)
        .unwrap_or(group)
}

/// A scaled score soft-capped: `cap * tanh(s / cap)` (divide, tanh,
/// multiply, as transformers' Gemma 2 attention computes it), or `s`
/// without a cap. One scalar implementation for every path.
#[inline(always)]
pub(crate) fn softcap(s: f32, cap: Option<f32>) -> f32 {
    match cap {
        Some(cap) => (s / cap).tanh() * cap,
        None => s,
    }
}

fn window_start(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) if w > 0 => (pos + 1).saturating_sub(w),
        _ => 0,
    }
}

/// What every query of a block shares: shape, fetched pages, page size, KV
/// row width, the KV head's offset in a KV row, where the shape has
/// sinks each query's (one per query, in the queries' order), and over a
/// latent pool the width of the value that leads each key.
type BlockArgs<'a, 'p> = (
    &'a AttentionShape,
    &'a [Option<PageSlices<'p>>],
    usize,
    usize,
    usize,
    Option<&'a [f32]>,
    Option<usize>,
);

/// The softmax denominator's share of a sink: `exp(sink - max)` after the
/// maximum `max` of the scores is raised to the sink where it is higher;
/// returns the new maximum and the term (zero without a sink). A NaN
/// sink gives a NaN term (a broken model's NaN output), never a panic.
#[inline(always)]
pub(crate) fn with_sink(max: f32, sink: Option<f32>) -> (f32, f32) {
    match sink {
        Some(s) => {
            let m = max.max(s);
            (m, (s - m).exp())
        }
        None => (max, 0.0),
    }
}

/// [`attend_block`] on `path`'s build: register tiles where the head size
/// allows ([`tiled`], [`tiled512`]) over key-value pools, else the generic
/// block with that path's vector primitives (latent pools: the generic
/// block on every path).
fn run_block(
    path: crate::cpu::Path,
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    #[cfg(target_arch = "x86_64")]
    if path != crate::cpu::Path::Portable {
        assert!(path.available(), "{path} kernels on a CPU without them");
        let head_dim = queries.first().map_or(0, |(q, _)| q.len());
        // SAFETY: the CPU has the path's features (asserted).
        unsafe {
            let tiles = tiled::supports(head_dim) && args.6.is_none();
            match (path, tiles) {
                (crate::cpu::Path::Avx512, true) => tiled512::attend_block(queries, outs, args),
                (crate::cpu::Path::Avx512, false) => attend_block_avx512(queries, outs, args),
                (_, true) => tiled::attend_block(queries, outs, args),
                (_, false) => attend_block_avx2(queries, outs, args),
            }
        }
        return;
    }
    let _ = path;
    attend_block::<Portable>(queries, outs, args);
}

/// [`attend_block`] compiled for AVX2 + FMA, with explicit eight-lane dot
/// and axpy. One process always runs one build.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_block_avx2(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    attend_block::<x86::Avx2>(queries, outs, args);
}

/// [`attend_block`] compiled for AVX-512: the AVX2 build's arithmetic (its
/// two eight-lane dot accumulators are the halves of one register), so the
/// same bits.
///
/// # Safety
/// The CPU must support AVX-512 F/DQ and the AVX2 set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
unsafe fn attend_block_avx512(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    attend_block::<tiled512::Avx512>(queries, outs, args);
}

/// The two vector primitives of attention, per instruction set.
pub(crate) trait Lanes {
    /// `sum(a[i] * b[i])`.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `out[i] += w * x[i]`.
    fn axpy(w: f32, x: &[f32], out: &mut [f32]);
}

/// Portable Rust (the reference).
struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b)
    }

    #[inline(always)]
    fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(x) {
            *o += w * x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// AVX2 + FMA; only instantiated inside `attend_one_avx2`, which runs
    /// only when the CPU has both.
    pub(super) struct Avx2;

    impl super::Lanes for Avx2 {
        #[inline(always)]
        fn dot(a: &[f32], b: &[f32]) -> f32 {
            // SAFETY: see the type's comment.
            unsafe { dot(a, b) }
        }

        #[inline(always)]
        fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
            // SAFETY: see the type's comment.
            unsafe { axpy(w, x, out) }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, within both slices.
            unsafe {
                s0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    s0,
                );
                s1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    s1,
                );
            }
            i += 16;
        }
        let mut sum = crate::simd::hsum(_mm256_add_ps(s0, s1));
        for j in i..n {
            sum += a[j] * b[j];
        }
        sum
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n, within both slices.
            unsafe {
                let o = out.as_mut_ptr().add(i);
                let r = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(o));
                _mm256_storeu_ps(o, r);
            }
            i += 8;
        }
        for j in i..n {
            out[j] += w * x[j];
        }
    }
}

/// Query heads of one KV head (`queries[i]`: the head's query vector and
/// its position) over the cached prefix, into `outs[i]`.
///
/// Each K and V row is read once for every query that sees it, yet each
/// query's result is computed by exactly the operations, in exactly the
/// order, it would be alone: its scores in ascending position, softmax,
/// then its weighted V rows in ascending position. So a query's output does
/// not depend on which others share its block (a prompt chunked or whole,
/// prefill or decode, gives the same bits).
#[inline(always)]
fn attend_block<L: Lanes>(
    queries: &[(&[f32], usize)],
    outs: &mut [&mut [f32]],
    args: BlockArgs<'_, '_>,
) {
    let (shape, pages, page_size, kv_dim, head_off, sinks, latent_v) = args;
    let Some(head_dim) = queries.first().map(|(q, _)| q.len()) else {
        return;
    };
    // Rows of a stored block: the V block's over a key-value pool; over a
    // latent one only keys are stored.
    let stored_v = latent_v.is_none();
    // One allocation for the block's per-query state, one per query for
    // its scores (a decode step's single query: two).
    let mut state: Vec<(usize, f32, Vec<f32>)> = queries
        .iter()
        .map(|&(_, pos)| {
            let start = window_start(pos, shape.window);
            (
                start,
                f32::NEG_INFINITY,
                Vec::with_capacity(pos + 1 - start),
            )
        })
        .collect();
    let lo = state.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = queries.iter().map(|&(_, pos)| pos).max().unwrap_or(0);
    // Pages in the window were all fetched by the caller; `None` is only
    // used for pages below every window.
    let values = |p: usize, v: bool| -> KvValues<'_> {
        let Some(s) = pages[p / page_size].as_ref() else {
            unreachable!("page inside the window was not fetched")
        };
        let at = (p % page_size) * kv_dim + head_off;
        (if v { s.v } else { s.k }).slice(at..at + head_dim)
    };
    // An f16 pool's rows of this head, widened once for the block (exact).
    let widened: Option<[Vec<f32>; 2]> = (values(lo, false).dtype() == KvDtype::F16).then(|| {
        [false, true].map(|v| {
            let mut out = Vec::new();
            if !v || stored_v {
                out.reserve((hi + 1 - lo) * head_dim);
                (lo..=hi).for_each(|p| values(p, v).extend_f32(&mut out));
            }
            out
        })
    });
    let stored_row = |p: usize, v: bool| -> &[f32] {
        match (&widened, values(p, v)) {
            (Some(w), _) => &w[usize::from(v)][(p - lo) * head_dim..][..head_dim],
            (None, KvValues::F32(row)) => row,
            (None, KvValues::F16(_)) => unreachable!("every page of a pool has the pool's dtype"),
        }
    };
    let row = |p: usize, v: bool| -> &[f32] {
        match latent_v {
            Some(v_dim) if v => &stored_row(p, false)[..v_dim],
            _ => stored_row(p, v),
        }
    };
    for p in lo..=hi {
        let k = row(p, false);
        for (&(qv, pos), (start, max, scores)) in queries.iter().zip(state.iter_mut()) {
            if *start <= p && p <= pos {
                let s = softcap(L::dot(qv, k) * shape.scale, shape.softcap);
                *max = max.max(s);
                scores.push(s);
            }
        }
    }
    // Softmax in place (over the sink too, where there is one); `max`
    // becomes 1 / sum.
    for (i, (_, max, scores)) in state.iter_mut().enumerate() {
        let (m, sink_term) = with_sink(*max, sinks.map(|s| s[i]));
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            sum += *s;
        }
        *max = 1.0 / (sum + sink_term);
    }
    for o in outs.iter_mut() {
        o.fill(0.0);
    }
    for p in lo..=hi {
        let v = row(p, true);
        for ((&(_, pos), (start, inv, scores)), o) in
            queries.iter().zip(&state).zip(outs.iter_mut())
        {
            if *start <= p && p <= pos {
                let w = scores[p - start] * inv;
                L::axpy(w, v, o);
            }
        }
    }
}

/// Dot product with eight independent accumulators, so the compiler
/// vectorises it without reassociating a single chain.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tiled;
#[cfg(target_arch = "x86_64")]
mod tiled512;
