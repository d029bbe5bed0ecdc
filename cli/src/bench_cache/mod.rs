//! `kvmesh bench-cache`: what the prefix cache buys, what it costs, and
//! what it does not reveal, each side by side in one run.
//!
//! Targets: `kvmesh serve --prefix-cache on` and `off`, each started fresh
//! (a cold cache) with two tenants' API keys, taking turns over `--rounds`
//! rounds (the order flips every round), so a slow spell of a shared host
//! falls on both. Per target and round, in order:
//!
//! - **multi-turn**: `--conversations` chats share a system prompt of
//!   about `--system-tokens` tokens; each has `--turns` user messages of
//!   about `--turn-tokens`, and each answer (greedy, at most
//!   `--answer-tokens`) joins the history, so turn k's prompt is turn
//!   k-1's prompt, its answer and a new message. Conversations run
//!   concurrently (`--sequential`: one request at a time, turn 1 of every
//!   conversation, then turn 2, ...). Then every conversation's last
//!   request once more, exactly: the exact repeat. Reported: TTFT per turn
//!   (median over conversations and rounds), on/off. The KV bytes decode
//!   received over this scenario (`kvmesh_node_kv_bytes_received_total`,
//!   from the router's `/metrics`) per request: with the cache on, decode
//!   grants only the pages it lacks and prefill ships only those.
//! - **no-sharing**: `--fresh-requests` prompts of `--fresh-tokens` tokens
//!   that share nothing, one at a time: the cost of hashing and looking up
//!   when nothing hits (TTFT median on/off).
//! - **side-channel** (cache on only): `--side-samples` samples of: tenant
//!   A sends a fresh prompt of `--side-tokens` tokens (a cold miss); then,
//!   in an order drawn from the seed, A repeats it (a hit), tenant B sends
//!   the same prompt, and B sends a prompt nobody sent (the control cold
//!   miss). Reported: the four medians and two-sample KS tests of B's
//!   same prompt against B's control (the namespace rule says: no
//!   difference) and of A's repeat against A's cold miss (a real
//!   difference).
//!
//! A benchmark: no time is asserted. It fails (non-zero exit) when a
//! request fails, or when a request is served a hit it must not be (B's
//! same prompt, a prompt that shares nothing, anything with the cache off).
//! `--script FILE` replaces the generated conversations (JSON: `system`,
//! `users` (a list of user messages per conversation), `answer_tokens`);
//! `scripts/peers.py` passes its own so that llama.cpp runs the same chats.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvmesh_client::metrics::scrape_with;
use kvmesh_model::default_model;
use serde_json::{json, Value};

use crate::loadgen::workload::one_token_words;
use crate::soak::mesh::{start_mesh, wait_healthy};
use crate::ModelArgs;

mod client;
mod report;
mod scenarios;
mod twosample;

use client::Answer;
use scenarios::{MultiTurn, Probe, Script, Shape, SCRAPER, TENANT_A, TENANT_B};

/// How long one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Tokens each no-sharing request generates (TTFT is what is measured).
const FRESH_ANSWER_TOKENS: usize = 4;
/// Tokens the chat template adds around one message, at most (for sizing
/// the pool only).
const TEMPLATE_TOKENS: usize = 16;
/// Seed salts of the scenarios' prompts.
const FRESH_SALT: u64 = 0x4652_4553_4800_0001;
const SIDE_SALT: u64 = 0x5349_4445_0000_0002;

/// A scenario of the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub(crate) enum Scenario {
    MultiTurn,
    NoSharing,
    SideChannel,
}

/// A target: the mesh with its prefix cache on or off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub(crate) enum Target {
    On,
    Off,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::On => "on",
            Target::Off => "off",
        }
    }
}

/// `kvmesh bench-cache` flags.
#[derive(Args, Debug)]
pub struct BenchCacheArgs {
    /// Scenarios to run (comma list) [default: all].
    #[arg(long, value_delimiter = ',', value_enum)]
    scenario: Vec<Scenario>,
    /// Targets (comma list) [default: on,off].
    #[arg(long, value_delimiter = ',', value_enum)]
    targets: Vec<Target>,
    /// Rounds; the targets take turns, their order flipping every round.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Multi-turn: concurrent conversations.
    #[arg(long, default_value_t = 3)]
    conversations: usize,
    /// Multi-turn: user turns per conversation.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// Multi-turn: tokens of the shared system prompt (about).
    #[arg(long, default_value_t = 500)]
    system_tokens: usize,
    /// Multi-turn: tokens of each user message (about).
    #[arg(long, default_value_t = 150)]
    turn_tokens: usize,
    /// Multi-turn: the most tokens of each answer.
    #[arg(long, default_value_t = 32)]
    answer_tokens: usize,
    /// Multi-turn: the conversations from this JSON file instead.
    #[arg(long)]
    script: Option<PathBuf>,
    /// Multi-turn: one request at a time (turn 1 of each conversation,
    /// then turn 2, ...), not the conversations concurrently.
    #[arg(long)]
    sequential: bool,
    /// No-sharing: requests per target and round.
    #[arg(long, default_value_t = 12)]
    fresh_requests: usize,
    /// No-sharing: prompt tokens.
    #[arg(long, default_value_t = 500)]
    fresh_tokens: usize,
    /// Side channel: samples per round (4 requests each).
    #[arg(long, default_value_t = 12)]
    side_samples: usize,
    /// Side channel: prompt tokens.
    #[arg(long, default_value_t = 800)]
    side_tokens: usize,
    /// Seed of the prompts and the side channel's order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where the started meshes' logs go [default: files in the temporary
    /// directory].
    #[arg(long)]
    serve_log: Option<PathBuf>,
    /// One more flag for the started `serve` (repeat).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    #[command(flatten)]
    model: ModelArgs,
}

/// What one target measured, pooled over rounds.
#[derive(Debug, Default)]
pub(crate) struct Measured {
    pub(crate) multi_turn: MultiTurn,
    /// KV bytes decode received over the multi-turn scenario, and its
    /// requests.
    pub(crate) kv_bytes: u64,
    pub(crate) kv_requests: u64,
    pub(crate) fresh: Vec<Answer>,
    pub(crate) side: Vec<(Probe, Answer)>,
}

/// The run's settings, as reported.
pub(crate) struct Setup {
    pub(crate) model: String,
    pub(crate) script: Script,
    pub(crate) scenarios: Vec<Scenario>,
    pub(crate) rounds: usize,
    pub(crate) sequential: bool,
    pub(crate) kv_pool_tokens: usize,
}

pub fn run(a: BenchCacheArgs) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut scenarios = if a.scenario.is_empty() {
        vec![
            Scenario::MultiTurn,
            Scenario::NoSharing,
            Scenario::SideChannel,
        ]
    } else {
        a.scenario.clone()
    };
    scenarios.sort();
    scenarios.dedup();
    let mut targets = if a.targets.is_empty() {
        vec![Target::On, Target::Off]
    } else {
        a.targets.clone()
    };
    targets.sort();
    targets.dedup();
    let model_path = match &a.model.model {
        Some(p) => p.clone(),
        None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
    };
    let loaded = kvmesh_model::load_with(&model_path, kvmesh_model::Precision::Quantized)
        .with_context(|| format!("loading model {}", model_path.display()))?;
    let tok = loaded.tokenizer.clone();
    let max_model_len = a
        .model
        .max_model_len
        .unwrap_or(loaded.config.max_position_embeddings);
    drop(loaded);
    let words = one_token_words(&tok)?;
    let script = match &a.script {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str::<Script>(&text)
                .with_context(|| format!("{}: not a conversation script", p.display()))?
        }
        None => Script::generate(
            &tok,
            &words,
            a.seed,
            Shape {
                conversations: a.conversations,
                turns: a.turns,
                system_tokens: a.system_tokens,
                turn_tokens: a.turn_tokens,
                answer_tokens: a.answer_tokens,
            },
        )?,
    };
    script.check()?;
    // The pool holds every conversation whole, three times over: the
    // cache's share of it keeps them (a benchmark of hits, not eviction).
    let longest = tok.encode(&script.system)?.len()
        + script
            .users
            .iter()
            .map(|us| {
                us.iter()
                    .map(|u| {
                        tok.encode_raw(u).map_or(0, |t| t.len() + TEMPLATE_TOKENS)
                            + script.answer_tokens
                    })
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0);
    let kv_pool_tokens = a.model.kv_pool_tokens.unwrap_or_else(|| {
        (3 * script.users.len() * longest)
            .max(max_model_len)
            .max(4 * a.side_tokens.max(a.fresh_tokens))
    });
    if longest + script.answer_tokens > max_model_len {
        bail!(
            "a conversation of about {longest} tokens does not fit the context of {max_model_len}"
        );
    }

    let mut measured: BTreeMap<Target, Measured> = BTreeMap::new();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    for round in 0..a.rounds {
        let mut order = targets.clone();
        if round % 2 == 1 {
            order.reverse();
        }
        for target in order {
            eprintln!(
                "bench-cache: round {} of {}, prefix cache {}",
                round + 1,
                a.rounds,
                target.name()
            );
            let m = measured.entry(target).or_default();
            let mut flags = a.model.serve_flags(kv_pool_tokens);
            flags.extend([
                "--prefix-cache".into(),
                target.name().into(),
                format!("--api-key={}={}", TENANT_A.0, TENANT_A.1),
                format!("--api-key={}={}", TENANT_B.0, TENANT_B.1),
                format!("--api-key={}={}:metrics", SCRAPER.0, SCRAPER.1),
            ]);
            flags.extend(a.serve_args.iter().cloned());
            let log = a.serve_log.as_ref().map(|p| {
                p.with_file_name(format!(
                    "{}-{}-{}.log",
                    p.file_stem()
                        .map_or("serve".into(), |s| s.to_string_lossy()),
                    target.name(),
                    round + 1
                ))
            });
            let (child, addr) = start_mesh(&model_path, &flags, log, "bench-cache")?;
            let mut child = Some(child);
            let seed = a.seed.wrapping_add(round as u64);
            rt.block_on(async {
                wait_healthy(&addr, &mut child).await?;
                one_target(
                    &a, &scenarios, target, &addr, &tok, &words, &script, seed, m,
                )
                .await
            })
            .with_context(|| {
                format!(
                    "prefix cache {}, round {}; serve log {}",
                    target.name(),
                    round + 1,
                    child
                        .as_ref()
                        .map_or_else(String::new, |c| c.log.display().to_string())
                )
            })?;
            // The mesh stops before the next starts: targets never share
            // cores.
            drop(child);
        }
    }
    drop(rt);

    let name = model_path.file_name().map_or_else(
        || model_path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let setup = Setup {
        model: name,
        script,
        scenarios,
        rounds: a.rounds,
        sequential: a.sequential,
        kv_pool_tokens,
    };
    print!("{}", report::table(&setup, &measured));
    let json = report::json(&setup, &measured);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    report::check(&measured)
}

/// The scenarios against one started target.
#[allow(clippy::too_many_arguments)]
async fn one_target(
    a: &BenchCacheArgs,
    scenarios: &[Scenario],
    target: Target,
    addr: &str,
    tok: &kvmesh_model::TextTokenizer,
    words: &[&str],
    script: &Script,
    seed: u64,
    m: &mut Measured,
) -> Result<()> {
    for s in scenarios {
        match s {
            Scenario::MultiTurn => {
                let before = kv_counters(addr).await?;
                let t = Instant::now();
                let mt = scenarios::multi_turn(addr, script, a.sequential, REQUEST_TIMEOUT).await?;
                let sent = mt.requests() as u64;
                eprintln!(
                    "bench-cache: multi-turn, {sent} requests in {:.1} s",
                    t.elapsed().as_secs_f64()
                );
                let after = settled_kv_counters(addr, before.granted + sent).await?;
                m.kv_bytes += after.bytes - before.bytes;
                m.kv_requests += sent;
                m.multi_turn.extend(mt);
            }
            Scenario::NoSharing => {
                let prompts = scenarios::fresh_prompts(
                    tok,
                    words,
                    seed ^ FRESH_SALT,
                    a.fresh_requests,
                    a.fresh_tokens,
                )?;
                m.fresh.extend(
                    scenarios::no_sharing(addr, &prompts, FRESH_ANSWER_TOKENS, REQUEST_TIMEOUT)
                        .await?,
                );
            }
            Scenario::SideChannel if target == Target::On => {
                m.side.extend(
                    scenarios::side_channel(
                        addr,
                        tok,
                        words,
                        seed ^ SIDE_SALT,
                        a.side_samples,
                        a.side_tokens,
                        REQUEST_TIMEOUT,
                    )
                    .await?,
                );
            }
            Scenario::SideChannel => {}
        }
    }
    Ok(())
}

/// The decode nodes' grants and KV bytes received, summed, from the
/// router's `/metrics` (their last load reports).
#[derive(Clone, Copy, Debug)]
struct KvCounters {
    granted: u64,
    bytes: u64,
}

async fn kv_counters(addr: &str) -> Result<KvCounters> {
    let m = scrape_with(addr, Some(SCRAPER.0))
        .await
        .context("scraping /metrics")?;
    Ok(KvCounters {
        granted: m.sum("kvmesh_node_reservations_granted_total", &[]) as u64,
        bytes: m.sum("kvmesh_node_kv_bytes_received_total", &[]) as u64,
    })
}

/// The counters once the load reports show `granted` grants, taken from a
/// report at least two polls later (so every transfer that ended before
/// the last answer is counted).
async fn settled_kv_counters(addr: &str, granted: u64) -> Result<KvCounters> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while kv_counters(addr).await?.granted < granted {
        if Instant::now() > deadline {
            bail!("the decode nodes' reports did not reach {granted} grants in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(2 * kvmesh_router::nodes::POLL).await;
    kv_counters(addr).await
}

/// JSON of the run's settings.
pub(crate) fn config_json(s: &Setup) -> Value {
    json!({
        "model": s.model,
        "rounds": s.rounds,
        "sequential": s.sequential,
        "kv_pool_tokens": s.kv_pool_tokens,
        "conversations": s.script.users.len(),
        "turns": s.script.turns(),
        "answer_tokens": s.script.answer_tokens,
        "scenarios": s.scenarios.iter().map(|x| format!("{x:?}")).collect::<Vec<_>>(),
    })
}
