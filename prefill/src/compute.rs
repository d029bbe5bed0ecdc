//! The compute thread and the shipping tasks: prompts that arrive
//! together run as one batched forward pass, and each request's task
//! writes its layers through its grant's writer as the pass produces them,
//! then transfer-done with the first token.

use super::*;

/// Prompt tokens one batched prefill takes at most: prompts that arrived
/// together run as one forward pass up to this many tokens.
const BATCH_TOKENS: usize = 2048;

/// The compute thread: takes every prompt that is waiting (up to
/// [`BATCH_TOKENS`]), runs them as one batch, then ships each one's KV.
pub(crate) fn compute(
    engine: Arc<Engine>,
    mut jobs: mpsc::Receiver<Work>,
    depth: Arc<AtomicUsize>,
    rt: tokio::runtime::Handle,
    stopped: Stopped,
    metrics: Arc<PrefillMetrics>,
) {
    let mut stopping = false;
    while !stopping {
        let Some(Work::Job(first)) = jobs.blocking_recv() else {
            return;
        };
        let mut batch = vec![*first];
        let mut tokens = batch[0].prompt.len();
        while tokens < BATCH_TOKENS {
            match jobs.try_recv() {
                Ok(Work::Job(j)) => {
                    tokens += j.prompt.len();
                    batch.push(*j);
                }
                Ok(Work::Stop) => {
                    stopping = true;
                    break;
                }
                Err(_) => break,
            }
        }
        depth.fetch_add(batch.len(), Ordering::Relaxed);
        let n = batch.len();
        run_batch(&engine, batch, &rt, &stopped, &metrics);
        depth.fetch_sub(n, Ordering::Relaxed);
    }
}

fn run_batch(
    engine: &Engine,
    batch: Vec<Job>,
    rt: &tokio::runtime::Handle,
    stopped: &Stopped,
    metrics: &Arc<PrefillMetrics>,
) {
    // Requests already gone (aborted before compute) leave now.
    let mut live = Vec::new();
    for job in batch {
        let id = job.writer.grant().reservation;
        if is_stopped(stopped, id) {
            let _ = job.done.send(Err(WriterError::Aborted(id).into()));
            continue;
        }
        match rt.block_on(job.writer.check()) {
            Ok(()) => live.push(job),
            Err(e) => {
                let _ = job.done.send(Err(e.into()));
            }
        }
    }
    let mut admitted = Vec::new();
    for job in live {
        // In a namespace the prompt's cached head is leased, not computed;
        // a prompt to be scored skips the cache (neither leases nor offers
        // pages): a cached head has no logits, so every position runs.
        let admitted_seq = match (job.ns, job.prompt_logprobs) {
            (_, Some(top)) => engine.admit(job.prompt.clone(), 0).and_then(|mut seq| {
                seq.score_prompt(top)?;
                Ok(seq)
            }),
            (Some(ns), None) => engine.admit_in(ns, job.prompt.clone(), 0),
            (None, None) => engine.admit(job.prompt.clone(), 0),
        };
        match admitted_seq {
            Ok(seq) => admitted.push((job, seq)),
            Err(e) => {
                let _ = job.done.send(Err(e.into()));
            }
        }
    }
    if admitted.is_empty() {
        return;
    }
    // One shipping task per request owns its writer and writes each layer
    // as the forward pass finishes it, so the transfer of layer l overlaps
    // the compute of layers l + 1..; transfer-done goes last, after the first
    // token is sampled. The feed holds at most every layer plus the end, so
    // the compute thread never waits on a slow transfer.
    let n_layers = engine.model().config().n_layers;
    // Layer buffers the shipping tasks have written come back here to be
    // filled again, so a stream of prompts allocates none.
    let (spare_tx, spare_rx) = std::sync::mpsc::channel();
    let mut feeds = Vec::with_capacity(admitted.len());
    let mut seqs = Vec::with_capacity(admitted.len());
    let (mut computed, mut from_cache) = (0, 0);
    // Each request's `prefill.compute` span, open while the batch runs.
    let batch_size = admitted.len();
    let mut computing = Vec::with_capacity(batch_size);
    for (job, seq) in admitted {
        from_cache += seq.cached_len();
        computed += job.prompt.len().saturating_sub(seq.cached_len());
        let Job {
            sampler,
            writer,
            done,
            span,
            ..
        } = job;
        let cached = u32::try_from(seq.cached_len()).unwrap_or(u32::MAX);
        computing.push(kvmesh_telemetry::span!(
            parent: &span,
            "prefill.compute",
            batch_size = batch_size as u64,
            prompt_tokens = seq.prompt_len() as u64,
            cached_tokens = u64::from(cached)
        ));
        let (tx, rx) = mpsc::channel(n_layers + 1);
        let transfer = kvmesh_telemetry::span!(
            parent: &span,
            "prefill.transfer",
            reservation.id = %writer.grant().reservation,
            pages = writer.grant().pages.len() as u64
        );
        rt.spawn(
            ship(
                writer,
                rx,
                done,
                Arc::clone(stopped),
                spare_tx.clone(),
                Arc::clone(metrics),
            )
            .instrument(transfer),
        );
        feeds.push((tx, sampler, cached));
        seqs.push(seq);
    }
    let began = std::time::Instant::now();
    let results = {
        let mut refs: Vec<&mut kvmesh_model::engine::Sequence> = seqs.iter_mut().collect();
        // Moved in: the closure runs on a compute pool thread (`Send`).
        let mut buffers = move || spare_rx.try_recv().unwrap_or_default();
        engine.prefill_batch_streamed(&mut refs, &mut buffers, &mut |i, layer, kv| {
            let feed = match (u16::try_from(layer), kv) {
                (Ok(l), Ok((k, v))) => Feed::Layer(l, k, v),
                (Err(_), _) => Feed::Failed(PrefillError::Invalid("too many layers".into())),
                (_, Err(e)) => Feed::Failed(e.into()),
            };
            // A full or closed feed means the task already ended (abort,
            // writer lost); it answers the request itself.
            let _ = feeds[i].0.try_send(feed);
        })
    };
    metrics.batch(seqs.len(), began.elapsed(), computed, from_cache);
    match results {
        Ok(results) => {
            for ((((tx, mut sampler, cached), logits), seq), span) in
                feeds.into_iter().zip(results).zip(&mut seqs).zip(computing)
            {
                if logits.is_err() {
                    kvmesh_telemetry::fail(&span, "model");
                }
                let end = match logits {
                    Ok(mut l) => {
                        let s = sampler.sample(&mut l);
                        Feed::First(first_token(s, cached, seq.take_prompt_logprobs()))
                    }
                    Err(e) => Feed::Failed(e.into()),
                };
                let _ = tx.try_send(end);
            }
        }
        Err(e) => {
            for span in &computing {
                kvmesh_telemetry::fail(span, "model");
            }
            let msg = e.to_string();
            for (tx, _, _) in feeds {
                let _ = tx.try_send(Feed::Failed(PrefillError::Invalid(format!(
                    "prefill failed: {msg}"
                ))));
            }
        }
    }
}

/// The first token as transfer-done carries it to the decode node, which
/// hands it and the report to the router on its token stream.
fn first_token(s: Sampled, cached: u32, prompt: Vec<PromptLogprob>) -> FirstToken {
    FirstToken {
        id: s.token,
        logprobs: s.logprobs.map(|l| TokenLogprobs {
            logprob: l.logprob,
            top: l.top,
        }),
        cached_tokens: cached,
        prompt_scores: prompt
            .into_iter()
            .map(|p| PromptScore {
                logprob: p.logprob,
                rank: p.rank,
                top: p.top,
            })
            .collect(),
    }
}

/// What the compute thread hands a request's shipping task.
enum Feed {
    /// One layer's prompt K and V, position-major.
    Layer(u16, Vec<f32>, Vec<f32>),
    /// The first token: every layer was sent; finish the transfer.
    First(FirstToken),
    /// The request failed; drop the writer.
    Failed(PrefillError),
}

/// A request's shipping task: writes layers in order through the grant's
/// writer (checking for an abort before each), handing each layer's
/// buffers back to `spare`, then transfer-done with the first token and
/// its report; answers the request with prefill's cached token count. Dropping the writer on any failure lets
/// the decode node's abort (or lease) end the reservation.
async fn ship(
    mut writer: GrantWriter,
    mut feed: mpsc::Receiver<Feed>,
    done: oneshot::Sender<Result<u32, PrefillError>>,
    stopped: Stopped,
    spare: std::sync::mpsc::Sender<(Vec<f32>, Vec<f32>)>,
    metrics: Arc<PrefillMetrics>,
) {
    let id = writer.grant().reservation;
    let began = std::time::Instant::now();
    let mut bytes = 0;
    // What each layer's write carries: the prompt's slots past a cached
    // head, over the granted pages.
    let (pages, written) = {
        let g = writer.grant();
        let written = g.prompt_tokens.saturating_sub(g.cached_tokens);
        (
            g.pages.len() as u64,
            u32::try_from(written).unwrap_or(u32::MAX),
        )
    };
    let r = async {
        let first = loop {
            match feed.recv().await {
                Some(Feed::Layer(l, k, v)) => {
                    if is_stopped(&stopped, id) {
                        return Err(WriterError::Aborted(id).into());
                    }
                    let layer = kvmesh_telemetry::span!(
                        "kv.layer",
                        layer = u64::from(l),
                        pages,
                        bytes = writer
                            .grant()
                            .geometry
                            .payload_len(&(l..l.saturating_add(1)), written)
                            .unwrap_or(0)
                    );
                    let wrote = writer
                        .write_layer(l, &k, &v)
                        .instrument(layer.clone())
                        .await;
                    bytes = writer.bytes_written();
                    wrote.inspect_err(|e| kvmesh_telemetry::fail(&layer, e.kind()))?;
                    // Back to the compute thread (gone once the batch
                    // ended: then they are simply freed).
                    let _ = spare.send((k, v));
                }
                Some(Feed::First(p)) => break p,
                Some(Feed::Failed(e)) => return Err(e),
                None => {
                    return Err(PrefillError::Invalid(
                        "the prefill compute ended without a first token".into(),
                    ))
                }
            }
        };
        let finish = kvmesh_telemetry::span!("kv.transfer_done");
        let cached = first.cached_tokens;
        writer
            .finish(first)
            .instrument(finish.clone())
            .await
            .inspect_err(|e| kvmesh_telemetry::fail(&finish, e.kind()))?;
        Ok(cached)
    }
    .await;
    let outcome = match &r {
        Ok(_) => "completed",
        Err(PrefillError::Writer(e)) => e.kind(),
        Err(_) => "failed",
    };
    metrics.transfer(outcome, began.elapsed(), bytes);
    if let Err(e) = &r {
        kvmesh_telemetry::fail(&kvmesh_telemetry::current(), e.kind());
    }
    let _ = done.send(r);
}
