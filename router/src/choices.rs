//! Several choices of one request (OpenAI's `n`, and a batch of prompts in
//! one completions request) as one stream of indexed events, for every
//! front end.
//!
//! Choice `p * n + i` is sample `i` of prompt `p` (OpenAI's order). Every
//! choice is validated and admitted before any starts, all together
//! ([`Router::admit_all`]), so a refusal of any refuses the request with
//! nothing started; each holds its own dispatch slot. Sample 0 of each prompt starts at once; samples 1.. of that prompt
//! start when sample 0's first event arrives, which is after prefill has
//! computed the prompt and cached its pages, and after decode has adopted
//! the transferred pages and shared the full ones (`Engine::adopt_in`).
//! The later samples go to the same two nodes ([`Placement`]; same tenant
//! namespace), so prefill finds the prompt's whole pages in its prefix
//! cache and computes only the page holding the last token, and decode
//! grants only that page: the samples lease the full pages sample 0
//! received. One prefill and one transfer of the prompt's full pages;
//! the last partial page travels once per sample, since each sample writes
//! its own tokens after it.
//!
//! Dropping [`Choices`] drops every generation (the tasks that forward them
//! are aborted), which tells the mesh to abort each.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use kvmesh_faults::FaultPlan;

use crate::auth::Tenant;
use crate::error::{DispatchError, GatewayError, Rejection};
use crate::mesh::{Admitted, Event, Generation, Placement};
use crate::nodes::Role;
use crate::validate::Valid;
use crate::Router;

/// Choices one request may ask for at most (prompts times `n`).
pub const MAX_CHOICES: usize = 16;

/// The running choices of one request.
#[derive(Debug)]
pub struct Choices {
    inner: Inner,
    /// Samples per prompt.
    n: usize,
    /// Each prompt's token count.
    prompt_tokens: Vec<usize>,
    logprobs: bool,
}

#[derive(Debug)]
enum Inner {
    /// One choice: its generation, read directly.
    One(Generation),
    /// Several: forwarded by one task per prompt into one channel, which
    /// closes when every choice has ended.
    Many {
        rx: mpsc::Receiver<(usize, Event)>,
        _tasks: JoinSet<()>,
    },
}

impl Choices {
    /// Validated `prompts`, `n` samples each ([`Valid::sample`]), admitted
    /// in order and started as the module says. Refusals before anything
    /// started are the caller's to count ([`Router::fail`]).
    pub async fn start(
        r: &Router,
        prompts: Vec<Valid>,
        n: usize,
        tenant: Tenant,
        faults: FaultPlan,
    ) -> Result<Self, GatewayError> {
        let n = n.max(1);
        let prompt_tokens: Vec<usize> = prompts.iter().map(|v| v.ids().len()).collect();
        let logprobs = prompts
            .first()
            .is_some_and(|v| v.settings().sampling.logprobs.is_some());
        // Every choice at once: one slot each, granted together, so two
        // requests cannot each hold part of the slots and wait for the
        // rest (`crate::admission`).
        let samples = prompts
            .iter()
            .flat_map(|valid| (0..n).map(|i| valid.sample(i as u64)))
            .collect();
        let mut all = r.admit_all(samples, tenant, faults).await?.into_iter();
        let mut admitted: Vec<Vec<Admitted>> = Vec::with_capacity(prompts.len());
        for _ in &prompts {
            let placement = Arc::new(Placement::default());
            let group: Vec<Admitted> = all
                .by_ref()
                .take(n)
                .map(|mut a| {
                    if n > 1 {
                        a.share_placement(Arc::clone(&placement));
                    }
                    a
                })
                .collect();
            admitted.push(group);
        }
        drop(prompts);
        if admitted.len() == 1 && n == 1 {
            let one = admitted.remove(0).remove(0);
            return Ok(Self {
                inner: Inner::One(r.run(one)?),
                n,
                prompt_tokens,
                logprobs,
            });
        }
        // Every prompt's first sample starts here, so that a mesh refusal
        // is the request's error before its response begins.
        let mut firsts = Vec::with_capacity(admitted.len());
        for group in &mut admitted {
            let first = group.remove(0);
            firsts.push(r.run(first)?);
        }
        let (tx, rx) = mpsc::channel(64);
        let mut tasks = JoinSet::new();
        for (p, (first, rest)) in firsts.into_iter().zip(admitted).enumerate() {
            tasks.spawn(run_prompt(r.clone(), p * n, first, rest, tx.clone()));
        }
        Ok(Self {
            inner: Inner::Many { rx, _tasks: tasks },
            n,
            prompt_tokens,
            logprobs,
        })
    }

    /// The next event and the index of its choice; `None` once every
    /// choice has had its terminal event. Cancel-safe.
    pub async fn next(&mut self) -> Option<(usize, Event)> {
        match &mut self.inner {
            Inner::One(g) => g.next().await.map(|ev| (0, ev)),
            Inner::Many { rx, .. } => rx.recv().await,
        }
    }

    /// How many choices there are.
    pub fn len(&self) -> usize {
        self.prompt_tokens.len() * self.n
    }

    /// Never: a request has at least one choice.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples per prompt.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The prompts' token count, each prompt once (usage's
    /// `prompt_tokens`).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens.iter().sum()
    }

    /// Whether the request asked for logprobs.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs
    }
}

/// Forwards prompt `base / n`'s samples: the first at once, the others
/// started at the first one's first event.
async fn run_prompt(
    r: Router,
    base: usize,
    first: Generation,
    rest: Vec<Admitted>,
    tx: mpsc::Sender<(usize, Event)>,
) {
    let mut running = JoinSet::new();
    let mut rest = Some(rest);
    let mut first = first;
    while let Some(ev) = first.next().await {
        // A first sample that failed at once takes the others with it
        // (dropped unstarted: their slots go back).
        if matches!(ev, Event::Error(_)) {
            rest = None;
        }
        // Sample 0's first event goes out before the others start, so no
        // event of theirs can overtake it: the front ends give the prompt's
        // scores (`Event::Prompt`, sample 0's first) to every sample.
        if tx.send((base, ev)).await.is_err() {
            return;
        }
        if let Some(rest) = rest.take() {
            for (i, admitted) in rest.into_iter().enumerate() {
                let index = base + 1 + i;
                let tx = tx.clone();
                match r.run(admitted) {
                    Ok(g) => {
                        running.spawn(forward(index, g, tx));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, choice = index, "a later sample could not start");
                        let ev = Event::Error(late(r.fail(e)));
                        if tx.send((index, ev)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }
    // The others run on; this task owns them until they end.
    while running.join_next().await.is_some() {}
}

async fn forward(index: usize, mut g: Generation, tx: mpsc::Sender<(usize, Event)>) {
    while let Some(ev) = g.next().await {
        if tx.send((index, ev)).await.is_err() {
            return;
        }
    }
}

/// A mesh refusal of a sample started after the response began: the end
/// of that choice ([`crate::mesh::Mesh::generate`] refuses only for want
/// of a healthy node).
fn late(e: GatewayError) -> DispatchError {
    match e {
        GatewayError::Rejected(Rejection::NoHealthyNode { role })
            if role == Role::Prefill.as_str() =>
        {
            DispatchError::NoHealthyNode {
                role: Role::Prefill,
            }
        }
        _ => DispatchError::NoHealthyNode { role: Role::Decode },
    }
}

#[cfg(test)]
mod tests;
