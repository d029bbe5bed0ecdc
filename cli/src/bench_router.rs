//! `kvmesh bench-router`: what the router itself costs per request.
//!
//! Two parts:
//! - In process: the gateway's own path for one long prompt (about
//!   `--prompt-tokens` tokens), as a completion and as a chat request:
//!   tokenization, the chat template, [`validate`] (JSON body, fields,
//!   tokenization) and [`Router::admit`]. The router here has no node, so
//!   admission runs its context-window check and its capacity lookup over
//!   the nodes' cached load reports and ends at `no_healthy_node`: the
//!   whole decision up to the point where a node would be involved, less
//!   the queue slot (one uncontended `Semaphore::try_acquire_owned`).
//!   `--iterations` timed runs after `--warmup`; p50/p90/p99 in
//!   microseconds.
//! - Live: over-length prompts (the same long prompts, over the mesh's
//!   context window) against a `kvmesh serve` child started with a small
//!   `--max-model-len` (or `--url`), from `--clients` keep-alive
//!   connections for `--duration` seconds. Every answer must be the 400
//!   `context_length_exceeded` refusal; anything else is an error. The
//!   router's /metrics before and after show that no node reservation was
//!   granted and that the refusals counted equal the requests sent.
//!
//! With `--fairness`, instead: the noisy-neighbour scenario of per-tenant
//! admission ([`fairness`]).
//!
//! A benchmark: nothing here asserts a time. The run fails (non-zero exit)
//! only on the live part's counts: an unexpected answer, a grant, or a
//! refusal count that differs from what was sent. With `--url`, other
//! traffic to that mesh during the run shows up as a count mismatch.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use hyper::body::Bytes;
use kvmesh_meshauth::MeshSecret;
use kvmesh_model::{default_model, ChatMessage, TextTokenizer};
use kvmesh_router::http::validate;
use kvmesh_router::nodes::Nodes;
use kvmesh_router::{Rejection, Router, RouterConfig};
use serde_json::{json, Value};

use kvmesh_client::http::{Connection, Request};

use crate::soak::mesh::{host_port, start_mesh, MeshChild};

/// Completion budget of every request (the gateway's default).
const MAX_TOKENS: usize = 16;

/// How long one live request may take before it counts as an error.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The unit the long prompts repeat: digits, punctuation and a little
/// non-ASCII, so the tokenizer's pre-tokenizer has some work to do.
const FILLER: &str = "The committee reviewed 42 quarterly reports on Tuesday; \
    the weather in Zürich stayed mild, and nobody expected the results (3.5% up). ";

/// `kvmesh bench-router` flags.
#[derive(Args, Debug)]
pub struct BenchRouterArgs {
    /// Length of the long prompts, tokens (at least; the filler repeats
    /// whole).
    #[arg(long, default_value_t = 2000)]
    prompt_tokens: usize,
    /// Timed iterations of each in-process step.
    #[arg(long, default_value_t = 2000)]
    iterations: usize,
    /// Untimed iterations before them.
    #[arg(long, default_value_t = 100)]
    warmup: usize,
    /// Concurrent keep-alive clients of the live part.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seconds of the live part (0 skips it).
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Context window of the mesh started here: small, so that the long
    /// prompts are over it.
    #[arg(long, default_value_t = 256)]
    max_model_len: usize,
    /// Drive this running mesh (`http://HOST:PORT`) instead of starting
    /// one. Its context window must be under the prompts' length, and no
    /// other traffic may reach it during the run.
    #[arg(long)]
    url: Option<String>,
    /// With --url: the API key to send (`Authorization: Bearer KEY`); on a
    /// router with API keys it needs the inference and metrics scopes (the
    /// run reads `/metrics` before and after).
    #[arg(long, env = "KVMESH_API_KEY")]
    api_key: Option<String>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where the started mesh's log (stderr) goes [default: a file in the
    /// temporary directory].
    #[arg(long)]
    serve_log: Option<PathBuf>,
    /// A Hugging Face directory or a GGUF file, for the tokenizer (and the
    /// started mesh) [default: SmolLM2-135M-Instruct Q4_1, fetched on
    /// first use].
    #[arg(long, env = "KVMESH_MODEL")]
    model: Option<PathBuf>,
    /// Instead of the two parts above: the noisy neighbour. A probe
    /// tenant's TTFT alone and while another tenant keeps requests of
    /// many choices in flight, on a mesh per admission policy (fifo, fair)
    /// started here; see `bench_router::fairness`.
    #[arg(long)]
    fairness: bool,
    /// --fairness: the meshes' dispatch slots (`serve --max-running`).
    #[arg(long, default_value_t = 64)]
    fair_slots: usize,
    /// --fairness: the noisy tenant's requests always in flight.
    #[arg(long, default_value_t = 6)]
    noisy: usize,
    /// --fairness: choices per noisy request (`n`).
    #[arg(long, default_value_t = 16)]
    noisy_n: usize,
    /// --fairness: tokens each noisy choice generates.
    #[arg(long, default_value_t = 32)]
    noisy_tokens: usize,
    /// --fairness: probe requests timed per phase.
    #[arg(long, default_value_t = 30)]
    probes: usize,
    /// --fairness: also a mesh where the noisy tenant may hold at most this
    /// many slots (`serve --tenant-share noisy:max_running=N`).
    #[arg(long)]
    noisy_cap: Option<usize>,
}

/// The smallest number of whole [`FILLER`] repeats whose token count (by
/// `count`) reaches `target`, the text and its count.
fn sized_prompt(
    target: usize,
    mut count: impl FnMut(&str) -> Result<usize>,
) -> Result<(String, usize)> {
    // Doubling, then bisection: `lo` repeats are short of the target,
    // `hi` repeats reach it.
    let mut hi = 1usize;
    while count(&FILLER.repeat(hi))? < target {
        if hi >= 1 << 20 {
            bail!("{} filler repeats are still under {target} tokens", hi);
        }
        hi *= 2;
    }
    let mut lo = hi / 2;
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if count(&FILLER.repeat(mid))? >= target {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let text = FILLER.repeat(hi);
    let n = count(&text)?;
    Ok((text, n))
}

/// The long prompts, as text and as the gateway's request bodies.
#[derive(Debug)]
struct Prompts {
    completion: String,
    completion_tokens: usize,
    chat: Vec<ChatMessage>,
    chat_tokens: usize,
}

impl Prompts {
    fn build(tok: &TextTokenizer, target: usize) -> Result<Self> {
        let (completion, completion_tokens) = sized_prompt(target, |t| Ok(tok.encode(t)?.len()))?;
        let one = |t: &str| vec![ChatMessage::new("user", t)];
        let (content, chat_tokens) = sized_prompt(target, |t| Ok(tok.encode_chat(&one(t))?.len()))?;
        Ok(Self {
            completion,
            completion_tokens,
            chat: one(&content),
            chat_tokens,
        })
    }

    fn completion_body(&self) -> Vec<u8> {
        json!({"prompt": self.completion, "max_tokens": MAX_TOKENS, "temperature": 0})
            .to_string()
            .into_bytes()
    }

    fn chat_body(&self) -> Vec<u8> {
        let msgs: Vec<Value> = self
            .chat
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        json!({"messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0})
            .to_string()
            .into_bytes()
    }
}

// ---------------------------------------------------------------------------
// In process.

/// One timed step of the in-process part.
#[derive(Debug)]
struct StepRow {
    prompt: &'static str,
    step: &'static str,
    us: Percentiles,
}

/// Times `f` `iterations` times after `warmup` untimed runs; microseconds.
async fn sample<F, Fut>(warmup: usize, iterations: usize, mut f: F) -> Result<Percentiles>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let mut us = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        let t = Instant::now();
        f().await?;
        if i >= warmup {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Percentiles::of(us).ok_or_else(|| anyhow!("no timed iteration (--iterations 0)"))
}

/// What the gateway does with a body before any node is involved:
/// validation, the response id, admission.
async fn validate_and_admit(r: &Router, chat: bool, body: &[u8]) -> Result<()> {
    let valid = validate(r, chat, body)
        .map_err(|e| anyhow!("the benchmark's own request was refused: {e}"))?
        .prompts
        .remove(0);
    black_box(kvmesh_kvwire::RequestId::mint().ok());
    let tenant = kvmesh_router::auth::Tenant("bench".into());
    match r
        .admit(valid, tenant, kvmesh_faults::FaultPlan::none())
        .await
    {
        // No node is registered: admission ends here, before the queue.
        Err(Rejection::NoHealthyNode { .. }) => Ok(()),
        Ok(admitted) => {
            drop(black_box(admitted));
            Ok(())
        }
        Err(e) => bail!("admission refused the benchmark's prompt: {e}"),
    }
}

/// The body decode's Generate carries for `prompt_ids`: one gRPC frame.
fn generate_body(prompt_ids: &[u32]) -> Vec<u8> {
    use prost::Message;
    let msg = kvmesh_proto::internal::v1::GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_new_tokens: MAX_TOKENS as u32,
        ..Default::default()
    }
    .encode_to_vec();
    let mut body = Vec::with_capacity(msg.len() + 5);
    body.push(0);
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(&msg);
    body
}

/// One internal call's proofs, both ways, over `body`: what the router's
/// channel and the node's wrapper add to a call.
async fn mesh_proofs(body: &[u8]) -> Result<()> {
    use kvmesh_meshauth::call::{body_digest, check_reply, sign_call, Call, CallVerifier};
    static KEYS: std::sync::OnceLock<(MeshSecret, CallVerifier)> = std::sync::OnceLock::new();
    let (secret, node) = KEYS.get_or_init(|| {
        let s = MeshSecret::generate().unwrap_or_else(|_| MeshSecret::insecure());
        (s.clone(), CallVerifier::new(s, "decode-0"))
    });
    let path = "/kvmesh.internal.v1.Decode/Generate";
    let now = kvmesh_meshauth::grpc::unix_ms();
    // The router's side: the body's digest, the call's proof.
    let call = Call {
        path,
        recipient: "decode-0",
        body: &body_digest(body),
    };
    let signed = sign_call(secret, &call, now)?;
    // The node's: its own digest of what arrived, the checks, its answer.
    let admitted = node
        .check(Some(signed.token.as_bytes()), path, &body_digest(body), now)
        .map_err(|e| anyhow!("{e}"))?;
    let proof = node.reply_proof(&admitted);
    // The router's again: the answer's proof.
    check_reply(secret, "decode-0", &signed, Some(proof.as_bytes())).map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

fn in_process(
    tok: &TextTokenizer,
    stop_ids: Vec<u32>,
    p: &Prompts,
    a: &BenchRouterArgs,
) -> Result<Vec<StepRow>> {
    let cfg = RouterConfig {
        model_id: "bench".into(),
        // Room for both prompts: admission passes the context check.
        max_model_len: p.completion_tokens.max(p.chat_tokens) + MAX_TOKENS,
        ..RouterConfig::default()
    };
    let nodes = Nodes::new(&[], MeshSecret::insecure()).map_err(anyhow::Error::msg)?;
    let router = Router::new(cfg, tok.clone(), stop_ids, nodes);
    let (completion, chat) = (p.completion_body(), p.chat_body());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let (w, n) = (a.warmup, a.iterations);
    let (r, text, msgs) = (&router, p.completion.as_str(), p.chat.as_slice());
    let (completion, chat) = (completion.as_slice(), chat.as_slice());
    rt.block_on(async move {
        let mut rows = Vec::new();
        let mut row = |prompt, step, us| rows.push(StepRow { prompt, step, us });
        let tk = r.tokenizer();
        row(
            "completion",
            "tokenize",
            sample(w, n, move || async move {
                black_box(tk.encode(text)?);
                Ok(())
            })
            .await?,
        );
        row(
            "completion",
            "validate",
            sample(w, n, move || async move {
                black_box(validate(r, false, completion).map_err(|e| anyhow!("{e}"))?);
                Ok(())
            })
            .await?,
        );
        row(
            "completion",
            "validate + admit",
            sample(w, n, move || validate_and_admit(r, false, completion)).await?,
        );
        // Mesh authentication both ways on the internal call that carries
        // this prompt (decode's Generate): the router signs method, node
        // and body; the node checks that and signs its answer; the router
        // checks the answer. Its cost against TTFT is the goal (< 1%).
        let body = generate_body(&tk.encode(text)?);
        let body = body.as_slice();
        row(
            "completion",
            "mesh proofs both ways",
            sample(w, n, move || mesh_proofs(body)).await?,
        );
        row(
            "chat",
            "template",
            sample(w, n, move || async move {
                black_box(tk.apply_chat_template(msgs, true)?);
                Ok(())
            })
            .await?,
        );
        row(
            "chat",
            "template + tokenize",
            sample(w, n, move || async move {
                black_box(tk.encode_chat(msgs)?);
                Ok(())
            })
            .await?,
        );
        // The baseline of the row above: the rendering encoded as one
        // string, which is what content protection costs against (and
        // what let special-token text in content become control tokens).
        row(
            "chat",
            "unprotected tokenize",
            sample(w, n, move || async move {
                black_box(tk.encode_raw(&tk.apply_chat_template(msgs, true)?)?);
                Ok(())
            })
            .await?,
        );
        row(
            "chat",
            "validate",
            sample(w, n, move || async move {
                black_box(validate(r, true, chat).map_err(|e| anyhow!("{e}"))?);
                Ok(())
            })
            .await?,
        );
        row(
            "chat",
            "validate + admit",
            sample(w, n, move || validate_and_admit(r, true, chat)).await?,
        );
        Ok(rows)
    })
}

pub fn run(a: BenchRouterArgs) -> Result<()> {
    if a.live() && a.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if a.iterations == 0 {
        bail!("--iterations must be at least 1");
    }
    let model = match &a.model {
        Some(p) => p.clone(),
        None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
    };
    if a.fairness {
        return fairness::run(&a, &model);
    }
    // The router's own cost needs the router's inputs only: the metadata,
    // as `kvmesh router` reads it, not the weights.
    let info = kvmesh_tokenizer::ModelInfo::read(&model)
        .with_context(|| format!("reading model metadata {}", model.display()))?;
    let stop_ids = info.stop_token_ids();
    let tok = info.tokenizer;
    let prompts = Prompts::build(&tok, a.prompt_tokens)?;
    eprintln!(
        "bench-router: in process, {} iterations of each step ({} and {} prompt tokens)",
        a.iterations, prompts.completion_tokens, prompts.chat_tokens
    );
    let steps = in_process(&tok, stop_ids, &prompts, &a)?;

    let live = if a.live() {
        let (mut mesh, addr) = match &a.url {
            Some(u) => (None, host_port(u)),
            None => {
                let flags = vec!["--max-model-len".to_owned(), a.max_model_len.to_string()];
                let (m, addr) = start_mesh(&model, &flags, a.serve_log.clone(), "bench-router")?;
                eprintln!(
                    "bench-router: mesh at http://{addr}, log {}",
                    m.log.display()
                );
                (Some(m), addr)
            }
        };
        eprintln!(
            "bench-router: live, {} clients for {} s",
            a.clients, a.duration
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        Some(rt.block_on(live(&a, &addr, &prompts, &mut mesh))?)
    } else {
        None
    };

    let report = Report {
        model: model.file_name().map_or_else(
            || model.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        iterations: a.iterations,
        warmup: a.warmup,
        completion_tokens: prompts.completion_tokens,
        chat_tokens: prompts.chat_tokens,
        steps,
        live,
    };
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report.json())?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    print!("{}", report.table());
    let failures = report.failures();
    if failures.is_empty() {
        Ok(())
    } else {
        bail!("bench-router failed: {}", failures.join("; "))
    }
}

impl BenchRouterArgs {
    fn live(&self) -> bool {
        self.duration > 0
    }
}
mod fairness;
mod live;
mod report;
#[cfg(test)]
mod tests;

use live::*;
use report::*;
